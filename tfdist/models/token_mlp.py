"""A small token model that uses every sharded layer form, and a task for it.

    ids [batch, length]
      -> ShardedEmbedding (vocab split)              [batch, length, d_model]
      -> ShardedDense column, output sharded         [batch*M, length, d_ff/M]
      -> ShardedDense row, input sharded  (+ resid.) [batch, length, d_model]
      -> ShardedDense column, output gathered        [batch, length, d_ff]
      -> ShardedDense row, input gathered (+ resid.) [batch, length, d_model]
      -> ShardedDense column over vocab, gathered    [batch, length, vocab]
"""

import keras
import numpy as np

from tfdist.layers import ShardedDense, ShardedEmbedding


def build_token_mlp(vocab_size=16, d_model=8, d_ff=32, length=4,
                    plain_embedding=False) -> keras.Model:
    """Builds the model; weights are sharded by the layout of the strategy in scope.

    With `plain_embedding`, the embedding is a replicated `keras.layers.Embedding`
    (a sparse `IndexedSlices` gradient) instead of a `ShardedEmbedding`.

    Returns:
        A functional Keras model from ids `[batch, length]` to logits
        `[batch, length, vocab_size]`.
    """
    ids = keras.Input((length,), dtype="int32", name="ids")
    embed = keras.layers.Embedding if plain_embedding else ShardedEmbedding
    h = embed(vocab_size, d_model, name="embed")(ids)
    f = ShardedDense(d_ff, ("d_model", "d_ff"), activation="relu",
                     output_sharded=True, name="ffn1_in")(h)
    h = h + ShardedDense(d_model, ("d_ff", "d_model"), input_sharded=True, name="ffn1_out")(f)
    f = ShardedDense(d_ff, ("d_model", "d_ff"), activation="relu", name="ffn2_in")(h)
    h = h + ShardedDense(d_model, ("d_ff", "d_model"), name="ffn2_out")(f)
    logits = ShardedDense(vocab_size, ("d_model", "vocab"), name="logits")(h)
    return keras.Model(ids, logits, name="token_mlp")


def make_copy_task(num_examples, vocab_size=16, length=4, seed=0):
    """Ids and targets: each target token is a fixed permutation of its input token,
    `(7 * token + 3) % vocab` (a permutation when 7 does not divide vocab).

    Returns:
        `(x, y)`, int32 arrays of shape `[num_examples, length]`.
    """
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab_size, size=(num_examples, length)).astype("int32")
    y = ((7 * x + 3) % vocab_size).astype("int32")
    return x, y
