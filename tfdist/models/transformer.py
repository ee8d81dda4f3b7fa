"""An encoder–decoder NMT Transformer whose weights the layout rules split.

Pre-layer-norm, sinusoidal or learned positions, source/target embeddings
optionally shared, output projection tied to the target embedding (Press &
Wolf 2017). Logical axes: `heads` (attention), `d_ff` (feed-forward), `vocab`
(embeddings and the tied softmax), `experts` (MoE in every other FFN). With
`heads:model;d_ff:model;vocab:model` a `data:N;model:M` mesh runs
Megatron-style tensor parallelism over M devices and data parallelism over N.

Training outputs are the logits of the vocabulary shard each device holds
(`[b*M, Lt, V/M]`, rows gathered over the vocabulary's mesh axis; `[b, Lt, V]`
on one device): train with `SequenceCrossentropy`, which never builds the
full `[tokens, V]` matrix. `translate` decodes outside a replica with global
weights and a key/value cache (each step runs the decoder on one position):
greedy or beam search with GNMT's length penalty, XLA-compiled by default.

Example:

```python
config = TransformerConfig(vocab_size=512, d_model=128, num_heads=4, d_ff=512)
strategy = MeshStrategy("data:2;model:2", "batch:data;heads:model;d_ff:model;vocab:model")
with strategy.scope():
    model = Transformer(config)
    model.compile(keras.optimizers.Adam(InverseSqrtSchedule(128, 4000)),
                  SequenceCrossentropy(512, label_smoothing=0.1))
model.fit(dataset)                       # ((source, decoder_input), target) batches
ids = model.translate(source_ids, beam_size=4, alpha=0.6)
```
"""

import dataclasses
import functools

import keras
import tensorflow as tf

from tfdist import collectives, runtime, sequence
from tfdist.layers import ShardedEmbedding
from tfdist.layers.attention import padding_bias
from tfdist.layers.sharded_softmax import class_axis, sharded_cross_entropy
from tfdist.layers.weights import sharded_mesh_axis
from tfdist.models import decoding
from tfdist.models.transformer_layers import (
    DecoderBlock,
    EncoderBlock,
    TransformerConfig,
    sinusoids,
)

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


@keras.saving.register_keras_serializable(package="tfdist")
class Transformer(keras.Model):
    """Encoder–decoder Transformer; call on `(source_ids, decoder_input_ids)`.

    Args:
        config: a `TransformerConfig` (or its dict).

    Call: `source_ids [b, Ls]`, `decoder_input_ids [b, Lt]` (BOS + target),
    int, 0 = padding. Returns the logits' vocabulary shard (see module doc).
    """

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        if isinstance(config, dict):
            config = TransformerConfig(**config)
        self.model_config = c = config.validate()
        init = keras.initializers.RandomNormal(stddev=c.d_model ** -0.5)
        self.target_embedding = ShardedEmbedding(c.vocab_size, c.d_model,
                                                 embeddings_initializer=init,
                                                 name="target_embedding")
        self.source_embedding = self.target_embedding if c.share_embeddings else \
            ShardedEmbedding(c.vocab_size, c.d_model, embeddings_initializer=init,
                             name="source_embedding")
        self.encoder_blocks = [EncoderBlock(c, i, name=f"encoder_{i}")
                               for i in range(c.num_encoder_layers)]
        self.decoder_blocks = [DecoderBlock(c, i, name=f"decoder_{i}")
                               for i in range(c.num_decoder_layers)]
        self.encoder_norm = keras.layers.LayerNormalization(epsilon=1e-6, name="encoder_norm")
        self.decoder_norm = keras.layers.LayerNormalization(epsilon=1e-6, name="decoder_norm")
        self.drop = keras.layers.Dropout(c.dropout)
        self._decoders = {}
        self.build()

    def build(self, input_shape=None):
        if self.built:
            return
        c = self.model_config
        self.target_embedding.build()
        if not self.model_config.share_embeddings:
            self.source_embedding.build()
        if c.positions == "learned":
            self.position_table = self.add_weight(
                name="positions", shape=(c.max_length, c.d_model),
                initializer=keras.initializers.RandomNormal(stddev=0.02))
        else:
            self.position_table = tf.constant(sinusoids(c.max_length, c.d_model))
        shape = (None, None, c.d_model)
        for layer in [*self.encoder_blocks, *self.decoder_blocks, self.encoder_norm,
                      self.decoder_norm]:
            layer.build(shape)
        self._vocab_axis = sharded_mesh_axis(self.target_embedding.weight_layouts["embeddings"], 0)
        self.built = True

    # The logical axes of every split weight, by path (LayoutMap keys: regexes that
    # match the whole `variable.path`).
    LOGICAL_AXES = {
        r".*_embedding/embeddings": ("vocab", "d_model"),
        r".*attention/(query|key|value)": ("d_model", "heads", "d_kv"),
        r".*attention/output": ("heads", "d_kv", "d_model"),
        r".*ffn/inner/kernel": ("d_model", "d_ff"),
        r".*ffn/inner/bias": ("d_ff",),
        r".*ffn/outer/kernel": ("d_ff", "d_model"),
        # MoE with experts and d_ff on one mesh axis: each expert whole on one device.
        r".*ffn/wi": ("experts", "d_model", None),
        r".*ffn/wo": ("experts", None, "d_model"),
    }

    @classmethod
    def get_layout_map(cls, device_mesh, model_parallel_dim_name="model",
                       data_parallel_dim_name="batch"):
        """A `LayoutMap` in keras-hub's convention: Megatron and GShard over one axis.

        Attention heads, the feed-forward hidden units, the (tied) vocabulary
        and the MoE experts are split over `model_parallel_dim_name`; the batch
        over `data_parallel_dim_name`. The result is a
        `tfdist.distribution.RulesLayoutMap`: under
        `tfdist.distribution.ModelParallel(layout_map=...)` the model trains
        exactly as under `MeshStrategy(mesh, "batch:<data>;heads:<model>;
        d_ff:<model>;vocab:<model>;experts:<model>")`, the same weight layouts,
        the same tensor-parallel computation.

        Args:
            device_mesh: a `keras.distribution.DeviceMesh`.
            model_parallel_dim_name: its model-parallel axis.
            data_parallel_dim_name: its data-parallel axis.
        """
        from tfdist.distribution.rules_layout_map import RulesLayoutMap, check_dim_names

        check_dim_names(device_mesh, model_parallel_dim_name=model_parallel_dim_name,
                        data_parallel_dim_name=data_parallel_dim_name)
        model, data = model_parallel_dim_name, data_parallel_dim_name
        rules = f"batch:{data};heads:{model};d_ff:{model};vocab:{model};experts:{model}"
        return RulesLayoutMap(device_mesh, rules, cls.LOGICAL_AXES)

    # -- pieces ---------------------------------------------------------------

    def _embed(self, embedding, ids, start=0, training=None):
        x = embedding(ids) * (self.model_config.d_model ** 0.5)
        table = tf.cast(self.position_table, x.dtype)
        if sequence.length_axis() is not None:  # this device's tokens: their global positions
            positions = sequence.token_positions(ids.shape[1])
            x = x + gather_rows_dense_gradient(table, positions)[None]
        else:
            length = tf.shape(ids)[1]
            x = x + table[start:start + length][None]
        return self.drop(x, training=training)

    def encode(self, source_ids, training=None):
        """`source_ids [b, Ls]` -> (memory `[b, Ls, d]`, source mask `[b, Ls]` float)."""
        mask = tf.cast(tf.not_equal(source_ids, PAD_ID), self.compute_dtype)
        x = self._embed(self.source_embedding, source_ids, training=training)
        for block in self.encoder_blocks:
            x = block(x, source_mask=mask, training=training)
        return self.encoder_norm(x), mask

    def decode(self, decoder_input_ids, memory, memory_mask, training=None):
        """Decoder states `[b, Lt, d]` (before the output projection)."""
        x = self._embed(self.target_embedding, decoder_input_ids, training=training)
        for block in self.decoder_blocks:
            x = block(x, memory, memory_mask=memory_mask, training=training)
        return self.decoder_norm(x)

    def output_logits(self, states):
        """Tied projection onto this device's vocabulary shard: `[b*M, L, V/M]`."""
        states_all = collectives.all_gather(states, self._vocab_axis, dim=0)
        return tf.einsum("bld,vd->blv", states_all, self.target_embedding.embeddings)

    def call(self, inputs, training=None):
        source_ids, decoder_input_ids = inputs
        memory, mask = self.encode(source_ids, training=training)
        return self.output_logits(self.decode(decoder_input_ids, memory, mask, training=training))

    def compute_output_spec(self, inputs, training=None):
        source_ids, decoder_input_ids = inputs
        return keras.KerasTensor(tuple(decoder_input_ids.shape) + (self.model_config.vocab_size,),
                                 dtype=self.compute_dtype)

    # -- decoding -------------------------------------------------------------

    def memory_cache(self, memory, memory_mask):
        """Per decoder layer, the encoder's keys/values `[b, H, Ls, d_kv]` and padding bias.

        Computed once per source and constant over the search (beam search
        repeats it per beam once, rather than reordering it every step).
        """
        bias = padding_bias(memory_mask)
        layers = []
        for block in self.decoder_blocks:
            keys, values = block.cross_attention.project_kv(memory)
            layers.append({"keys": keys, "values": values, "bias": bias})
        return layers

    def initial_cache(self, batch_size, max_length):
        """Per decoder layer, preallocated self-attention keys/values `[b, H, L, d_kv]`."""
        c = self.model_config
        empty = tf.zeros([batch_size, c.num_heads, max_length, c.d_kv], self.compute_dtype)
        return {"layers": [{"keys": empty, "values": empty} for _ in self.decoder_blocks]}

    def decode_step(self, ids, index, cache, memory):
        """The logits `[N, V]` after token `ids [N]` at `index`, and the updated cache.

        `cache` comes from `initial_cache` (and earlier steps), `memory` from
        `memory_cache`, both with N rows; with `functools.partial(...,
        memory=...)` this is a `decoding` step function.
        """
        # Not `_embed(..., start=index)`: its slice of the position table at a tensor
        # start leaves the length dimension unknown, and with that the XLA beam search
        # of the random MoE test model picked other tokens than graph mode. One step
        # with an unknown length agrees to 7e-7 under XLA (as does the static one), so
        # it is most likely near-tied logits of a random model flipping; the gather
        # keeps `[N, 1, d]` static and both modes identical.
        x = self.target_embedding(ids[:, None]) * (self.model_config.d_model ** 0.5)
        x = x + tf.cast(tf.gather(self.position_table, index), x.dtype)[None, None]
        layers = []
        for block, layer_cache, layer_memory in zip(self.decoder_blocks, cache["layers"], memory):
            x, layer_cache = block.step(x, index, layer_cache, layer_memory)
            layers.append(layer_cache)
        logits = self.output_logits(self.decoder_norm(x))[:, 0, :]
        return tf.cast(logits, "float32"), {"layers": layers}

    def translate(self, source_ids, beam_size=4, alpha=0.6, max_length=None, jit_compile=True):
        """Target ids `[b, max_length]` (EOS included, then 0s) for `source_ids [b, Ls]`.

        Greedy when `beam_size == 1`, else beam search with GNMT's length
        penalty `alpha`. Runs outside any replica on the global weights (a
        model trained on any mesh), XLA-compiled unless `jit_compile=False`
        or the weights live on several devices (XLA cannot read those; load
        the checkpoint into a model on one device to decode fast).

        On a mesh whose layout maps `length`, the encoder runs over the split
        sequence (`encode_split`: its attention's work and activations split
        over the axis); the search then reads the whole memory, as its
        cross-attention's keys and values (one query per step, linear in `Ls`).
        """
        max_length = max_length or self.model_config.max_length
        if max_length > self.model_config.max_length:
            raise ValueError(f"max_length={max_length} exceeds the model's position table "
                             f"({self.model_config.max_length}).")
        on_mesh = runtime.current_runtime(self.distribute_strategy) is not None
        if jit_compile and on_mesh and len(self.distribute_strategy.extended.worker_devices) > 1:
            jit_compile = False  # XLA cannot read variables that live on other devices
        source_ids = tf.convert_to_tensor(source_ids, "int32")
        split = on_mesh and sequence.sequence_axis(self.distribute_strategy.mesh) is not None
        key = (beam_size, float(alpha), max_length, jit_compile, split)
        if key not in self._decoders:
            search = functools.partial(self._search, beam_size=beam_size, alpha=alpha,
                                       max_length=max_length)
            self._decoders[key] = tf.function(
                search if split else lambda src: search(*self.encode(src, training=False)),
                jit_compile=jit_compile, reduce_retracing=True)
        if split:
            return self._decoders[key](*self.encode_split(source_ids))
        return self._decoders[key](source_ids)

    def encode_split(self, source_ids):
        """(memory `[b, Ls', d]`, mask `[b, Ls']`) of `source_ids [b, Ls]`, encoded over
        the sequence split of the model's mesh (its layout maps `length`).

        Every device encodes its rows' zig-zag share of the tokens (ring or
        Ulysses attention over the axis), as in training; the shares are
        merged in token order. Rows are padded to a multiple of the mesh's
        row groups (with copies of the first row, dropped again) and the
        length with padding to `Ls'`, the next multiple of `2 P` (of
        `2 P x moe_group_size` with an MoE, whose groups must lie in one
        chunk); padding is masked, so the search reads the same memory.
        """
        strategy = self.distribute_strategy
        mesh = strategy.mesh
        axis = sequence.sequence_axis(mesh)
        parts = mesh.axis_size(axis)
        c = self.model_config
        unit = 2 * parts * (c.moe_group_size if c.moe_experts else 1)
        rows, length = (int(d) for d in source_ids.shape)
        padded = -(-length // unit) * unit
        if padded > c.max_length:
            raise ValueError(
                f"Sources of {length} tokens pad to {padded} (a multiple of {unit}: 2 x {parts} "
                f"zig-zag chunks over mesh axis {axis!r}"
                f"{f' of moe_group_size={c.moe_group_size} tokens' if c.moe_experts else ''}), "
                f"more than max_length={c.max_length}; translate sources of at most "
                f"{c.max_length // unit * unit} tokens on this mesh.")
        groups = mesh.shape.size // parts
        src = tf.pad(source_ids, [[0, 0], [0, padded - length]], constant_values=PAD_ID)
        src = tf.concat([src, tf.repeat(src[:1], -rows % groups, axis=0)], axis=0)
        if "encode_split" not in self._decoders:
            self._decoders["encode_split"] = sequence.SplitRunner(
                strategy, lambda ids: self.encode(ids, training=False))
        memory, mask = self._decoders["encode_split"](src)
        return memory[:rows], mask[:rows]

    def _search(self, memory, memory_mask, beam_size, alpha, max_length):
        memory = self.memory_cache(memory, memory_mask)
        if beam_size > 1:
            # Row b*K + k is beam k of source b, and beams never change source:
            # the encoder's part is repeated once, only the self-attention cache
            # is reordered each step.
            memory = tf.nest.map_structure(lambda t: tf.repeat(t, beam_size, axis=0), memory)
        step = functools.partial(self.decode_step, memory=memory)
        batch = tf.shape(memory_mask)[0]
        start, cache = tf.fill([batch], BOS_ID), self.initial_cache(batch, max_length)
        if beam_size == 1:
            return decoding.greedy_search(step, start, cache, max_length, EOS_ID)[0]
        ids, _ = decoding.beam_search(step, start, cache, beam_size, max_length, EOS_ID,
                                      alpha=alpha)
        return ids[:, 0]

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.model_config)}


@keras.saving.register_keras_serializable(package="tfdist")
class SequenceCrossentropy(keras.losses.Loss):
    """Label-smoothed cross-entropy per target token over the global vocabulary.

    Padding (id 0) is masked and the loss is the mean over the *global*
    batch's real tokens: each replica returns its tokens' losses divided by
    the token count summed over every replica (`collectives.sum_over_replicas`:
    the mesh's axes, or another strategy's all-reduce), and the `sum`
    reduction adds them up, so any mesh, and any tf.distribute strategy,
    trains exactly like one device. Works on the
    vocabulary shards `Transformer` returns (and on full logits on one device).

    Args:
        vocab_size: the global V.
        label_smoothing: epsilon over the V classes.
    """

    def __init__(self, vocab_size, label_smoothing=0.0, name="sequence_crossentropy", **kwargs):
        kwargs.pop("reduction", None)
        super().__init__(name=name, reduction="sum", **kwargs)
        self.vocab_size = vocab_size
        self.label_smoothing = float(label_smoothing)

    def call(self, y_true, y_pred):
        labels = tf.cast(tf.reshape(y_true, [-1]), "int32")
        logits = tf.reshape(y_pred, [-1, tf.shape(y_pred)[-1]])
        losses = sharded_cross_entropy(labels, logits, self.vocab_size, class_axis("vocab"),
                                       self.label_smoothing)
        weights = tf.cast(tf.not_equal(labels, PAD_ID), losses.dtype)
        tokens = collectives.sum_over_replicas(tf.reduce_sum(weights))  # any strategy
        return tf.reshape(losses * weights, tf.shape(y_true)) / tf.maximum(tokens, 1.0)

    def normalizer(self, y_true):
        """What the loss averages over in `y_true`: its real (non-padding) tokens.

        A pipeline weights each micro-batch's loss by its share of them."""
        return tf.reduce_sum(tf.cast(tf.not_equal(y_true, PAD_ID), "float32"))

    def get_config(self):
        return {"name": self.name, "vocab_size": self.vocab_size,
                "label_smoothing": self.label_smoothing}


@tf.custom_gradient
def gather_rows_dense_gradient(table, positions):
    """`tf.gather(table, positions)` whose gradient is a dense `[rows, d]` tensor.

    A sequence-split device reads its tokens' rows of the position table; one
    device slices the table, whose gradient is dense. `tf.gather`'s would be
    `IndexedSlices`, one row per position per replica once summed, and Keras's
    Adam squares `IndexedSlices` values before adding duplicate rows: its
    second moment would differ from one device's. A dense gradient adds first.
    """
    def gradient(upstream):
        rows = tf.shape(table, out_type=positions.dtype)[0]
        return tf.math.unsorted_segment_sum(upstream, positions, rows), None

    return tf.gather(table, positions), gradient


@keras.saving.register_keras_serializable(package="tfdist")
class InverseSqrtSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up then inverse square root (Vaswani et al. 2017), scaled.

    `lr(step) = scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)`
    with `step` counted from 1.
    """

    def __init__(self, d_model, warmup_steps=4000, scale=1.0):
        self.d_model = d_model
        self.warmup_steps = warmup_steps
        self.scale = scale

    def __call__(self, step):
        step = tf.cast(step, "float32") + 1.0
        return self.scale * self.d_model ** -0.5 * tf.minimum(
            tf.math.rsqrt(step), step * self.warmup_steps ** -1.5)

    def get_config(self):
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps, "scale": self.scale}
