"""ShardedAttention: multi-head attention whose heads are split by the layout rules.

Weights (no biases, as in Mesh-TF/T5): `query`, `key`, `value`
`[d_model, heads, d_kv]` and `output` `[heads, d_kv, d_model]`, logical axes
`heads` and `d_kv`. With `heads:model` (mesh axis of size M) each device
holds H/M heads — Megatron's attention: the replica's batch is gathered over
the axis, every device attends with its own heads over all gathered rows, and
the output projection's partial sums are reduce-scattered back to the
replica's rows:

    query [b, Lq, d] -> all_gather -> [b*M, Lq, d] -> heads H/M -> [b*M, Lq, d] partial
                     -> reduce_scatter -> [b, Lq, d]

Megatron sequence parallelism: where the layout maps `length` onto the heads'
axis too (`length:model;heads:model`), the replicas of the axis hold the same
rows and different tokens (zig-zag, `tfdist.sequence`). The same all-gather
then brings every device the whole sequence of its rows (as `M` row blocks of
`L/M` tokens, which the projections treat token by token); only the attention
core regroups them into sequences, in device order, with the causal mask
taken from the tokens' global positions. Norms, residuals and the
feed-forward's elementwise work run on `L/M` tokens per device; the
exchanges are the all-gather and reduce-scatter above (Megatron's
`g`/`g-bar`), no all-reduce.

Decoding (outside a replica: every weight reads globally) uses `project_kv`,
`project_query` and `attend` with a key/value cache preallocated to the
maximum length and written at one position per step (`write_cache`).
"""

import keras
import tensorflow as tf

from tfdist import collectives, recompute, sequence
from tfdist.layers.weights import (
    add_sharded_weight,
    check_mesh,
    check_positive_int,
    disable_jit_on_multi_device_mesh,
    sharded_mesh_axis,
)

NEG_INF = -1e9


def padding_bias(key_mask):
    """`[b, Lk]` 1/0 validity of keys -> additive bias `[b, 1, 1, Lk]`."""
    return (1.0 - tf.cast(key_mask, "float32"))[:, None, None, :] * NEG_INF


def causal_bias(length):
    """`[1, 1, L, L]` bias that hides later positions."""
    allowed = tf.linalg.band_part(tf.ones([length, length]), -1, 0)
    return ((1.0 - allowed) * NEG_INF)[None, None]


def _project_out(context, output_kernel):
    """`[b, H, Lq, d_kv]` times `[H, d_kv, d]`: `[b, Lq, d]`, summed over the heads."""
    return tf.einsum("bhqk,hkd->bqd", context, output_kernel)


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedAttention(keras.layers.Layer):
    """Multi-head dot-product attention with heads split by the layout rules.

    Args:
        num_heads: H.
        d_kv: size of each head's keys, values and queries.
        dropout: dropout rate on the attention probabilities (training only).
        kernel_initializer: Keras initializer for the four kernels.
        seed: dropout seed.
        remat_core: recompute the attention core (logits, softmax, dropout,
            the probabilities times the values) in the backward pass instead of
            keeping its `[b, H, Lq, Lk]` tensors: Megatron's "selective"
            recomputation (`tfdist.remat`, same dropout masks).
        sequence_method: where the layout maps `length` onto a mesh axis
            (`tfdist.sequence`: each device holds a zig-zag share of every
            sequence), attend over the split sequence by `"ring"` (key/value
            blocks travel around the axis) or `"ulysses"` (all-to-all to
            split heads; the local heads must divide by the axis). Attention
            dropout is refused there (one device's masks cannot be reproduced
            block by block).
        attention_block: compute attention in blocks of at most this many
            tokens with an online softmax (`tfdist.sequence.blockwise`), on
            one device as over a split sequence: no `[b, H, Lq, Lk]` tensor
            is kept (the largest is `[b, H, block, block]`, recomputed in the
            backward pass) and causal blocks above the diagonal are skipped.
            None: the dense softmax (on one device). No attention dropout.

    Call arguments:
        query: `[b, Lq, d_model]`.
        memory: `[b, Lk, d_model]` to attend over (None: self-attention).
        key_mask: `[b, Lk]` 1 for real keys, 0 for padding (optional).
        causal: hide later positions (self-attention in a decoder).
        training: apply dropout.

    Output shape: `[b, Lq, d_model]`.

    Example:

    ```python
    attention = ShardedAttention(num_heads=8, d_kv=64)   # with "heads:model": 8/M heads per device
    y = attention(x, key_mask=source_mask)
    ```
    """

    def __init__(self, num_heads, d_kv, dropout=0.0, kernel_initializer="glorot_uniform",
                 seed=None, remat_core=False, sequence_method="ring", attention_block=None,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.d_kv = check_positive_int("d_kv", d_kv)
        if not 0 <= dropout < 1:
            raise ValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout!r}")
        self.dropout = float(dropout)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        if not isinstance(remat_core, bool):
            raise ValueError(f"`remat_core` must be True or False. Received: "
                             f"remat_core={remat_core!r}")
        self.remat_core = remat_core
        if sequence_method not in sequence.METHODS:
            raise ValueError(f"`sequence_method` must be one of {sorted(sequence.METHODS)}. "
                             f"Received: sequence_method={sequence_method!r}")
        self.sequence_method = sequence_method
        if attention_block is not None:
            check_positive_int("attention_block", attention_block)
        self.attention_block = attention_block
        self.weight_layouts = {}
        disable_jit_on_multi_device_mesh(self)

    def build(self, query_shape, memory_shape=None):
        d_model = int(query_shape[-1])
        shape, axes = (d_model, self.num_heads, self.d_kv), ("d_model", "heads", "d_kv")
        for name in ("query", "key", "value"):
            setattr(self, name, add_sharded_weight(self, name, shape, axes,
                                                   initializer=self.kernel_initializer))
        self.output_kernel = add_sharded_weight(
            self, "output", (self.num_heads, self.d_kv, d_model), ("heads", "d_kv", "d_model"),
            initializer=self.kernel_initializer)
        layout = self.weight_layouts["query"]
        if sharded_mesh_axis(layout, 0) or sharded_mesh_axis(layout, 2):
            raise ValueError(f"Layer {self.name!r}: {layout} splits d_model or d_kv; "
                             f"ShardedAttention splits only heads.")
        self._heads_axis = sharded_mesh_axis(layout, 1)

    # -- pieces, also used by cached decoding --------------------------------

    def project_query(self, x):
        """`[b, L, d] -> [b, H_local, L, d_kv]`, scaled by `d_kv ** -0.5`."""
        return tf.einsum("bld,dhk->bhlk", x, self.query) * (self.d_kv ** -0.5)

    def project_kv(self, memory):
        """`[b, L, d] ->` keys and values `[b, H_local, L, d_kv]`."""
        return (tf.einsum("bld,dhk->bhlk", memory, self.key),
                tf.einsum("bld,dhk->bhlk", memory, self.value))

    def attend(self, q, k, v, bias=None, training=None):
        """Softmax attention of `q` over `k`/`v`, then the output projection: `[b, Lq, d]`."""
        return _project_out(self.attend_context(q, k, v, bias, training),
                            tf.convert_to_tensor(self.output_kernel))

    def attend_context(self, q, k, v, bias=None, training=None):
        """Softmax attention of `q` over `k`/`v`: `[b, H_local, Lq, d_kv]`."""
        # Masks are added in float32: -1e9 is -inf in float16, and a row whose
        # keys are all masked would then be NaN instead of uniform.
        logits = tf.cast(tf.einsum("bhqk,bhlk->bhql", q, k), "float32")
        if bias is not None:
            logits = logits + tf.cast(bias, "float32")
        probs = tf.nn.softmax(logits, axis=-1)
        if training and self.dropout:
            probs = keras.random.dropout(probs, self.dropout, seed=self.seed_generator)
        return tf.einsum("bhql,bhlk->bhqk", tf.cast(probs, v.dtype), v)

    @staticmethod
    def write_cache(cache, value, index):
        """`cache [b, H, L_max, d_kv]` with position `index` set to `value [b, H, 1, d_kv]`."""
        at = tf.one_hot(index, tf.shape(cache)[2], dtype=cache.dtype)[None, None, :, None]
        return cache * (1.0 - at) + value * at

    # -- training / evaluation ------------------------------------------------

    def call(self, query, memory=None, key_mask=None, causal=False, training=None):
        check_mesh(self)
        axis = self._heads_axis
        query_all = collectives.all_gather(query, axis, dim=0)  # [b*M, Lq, d]
        memory_all = query_all if memory is None else collectives.all_gather(memory, axis, dim=0)
        mask = None
        if key_mask is not None:
            mask = collectives.all_gather(tf.stop_gradient(tf.cast(key_mask, query.dtype)),
                                          axis, dim=0)
        k, v = self.project_kv(memory_all)
        length_axis = sequence.length_axis()
        if length_axis is not None and length_axis == axis:  # Megatron sequence parallelism
            context = self._attend_gathered_tokens(self.project_query(query_all), k, v, axis,
                                                   causal, mask, training)
        elif length_axis is not None or self.attention_block:  # Lq, Lk: this device's tokens
            context = self._attend_split_sequence(self.project_query(query_all), k, v,
                                                  length_axis, causal, mask, training)
        else:
            bias = None if mask is None else padding_bias(mask)
            if causal:
                causal_part = causal_bias(tf.shape(query_all)[1])
                bias = causal_part if bias is None else bias + causal_part
            core = recompute.remat(self.attend_context) if self.remat_core else self.attend_context
            context = core(self.project_query(query_all), k, v, bias, training)
        # Partial sums over the local heads [b*M, Lq, d] -> [b, Lq, d]
        return collectives.reduce_scatter_partial_sums(
            _project_out, [context, tf.convert_to_tensor(self.output_kernel)], axis, dim=0)

    def _attend_gathered_tokens(self, q, k, v, axis, causal, key_mask, training):
        """`[b*M, H_local, Lq/M, d_kv]` attention of the `M` devices' token blocks
        gathered over `axis` (which splits both `length` and `heads`): each row's
        blocks regrouped into its whole sequence, in device (zig-zag) order."""
        if training and self.dropout:
            raise ValueError(
                f"Layer {self.name!r}: attention dropout ({self.dropout}) with `length` and "
                f"`heads` both split over mesh axis {axis!r} is not supported (one device's "
                f"masks cannot be reproduced); set dropout=0.0 for the attention.")
        parts = collectives.axis_size(axis)

        def sequences(x):  # [M*b, H, L/M, ...] -> [b, H, L, ...], device m's tokens m-th
            blocks = tf.reshape(x, tf.concat([[parts, -1], tf.shape(x)[1:]], 0))
            blocks = tf.transpose(blocks, [1, 2, 0] + list(range(3, x.shape.rank + 1)))
            return tf.reshape(blocks, tf.concat([tf.shape(blocks)[:2], [-1], tf.shape(x)[3:]],
                                                0))

        bias = None
        if key_mask is not None:  # [M*b, Lk/M] -> [b, Lk]
            bias = padding_bias(sequences(key_mask[:, None])[:, 0])
        if causal:  # the tokens' global positions, in device order
            order = tf.constant(sequence.SequenceSplit(int(q.shape[2]) * parts, parts,
                                                       balanced=True).order(), tf.int32)
            hidden = tf.cast(order[None, :] > order[:, None], "float32") * NEG_INF
            bias = hidden[None, None] if bias is None else bias + hidden[None, None]
        core = recompute.remat(self.attend_context) if self.remat_core else self.attend_context
        context = core(sequences(q), sequences(k), sequences(v), bias, training)
        # [b, H, L, d_kv] -> [M*b, H, L/M, d_kv]: device m's tokens back in row block m.
        shape = tf.shape(context)
        blocks = tf.reshape(context, [shape[0], shape[1], parts, -1, shape[3]])
        return tf.reshape(tf.transpose(blocks, [2, 0, 1, 3, 4]),
                          [-1, shape[1], int(q.shape[2]), shape[3]])

    def _attend_split_sequence(self, q, k, v, axis, causal, key_mask, training):
        """`[b, H_local, Lq / P, d_kv]` blockwise attention, over a sequence split on mesh
        axis `axis` (None: this device's whole sequence)."""
        if training and self.dropout:
            where = (f"with `length` split over mesh axis {axis!r}" if axis
                     else f"with attention_block={self.attention_block}")
            raise ValueError(
                f"Layer {self.name!r}: attention dropout ({self.dropout}) {where} is not "
                f"supported; set dropout=0.0 for the attention (residual and feed-forward "
                f"dropout work per token).")
        heads_last = [0, 2, 1, 3]  # [b, H, L, d_kv] <-> [b, L, H, d_kv]
        context = sequence.sequence_attention(
            tf.transpose(q, heads_last), tf.transpose(k, heads_last), tf.transpose(v, heads_last),
            axis, method=self.sequence_method, causal=causal, key_mask=key_mask, balanced=True,
            scale=1.0, block=self.attention_block)  # project_query scaled the queries
        return tf.transpose(context, heads_last)

    def compute_output_shape(self, query_shape, memory_shape=None):
        return tuple(query_shape)

    def get_config(self):
        config = super().get_config()
        config.update(num_heads=self.num_heads, d_kv=self.d_kv, dropout=self.dropout,
                      kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
                      seed=self.seed, remat_core=self.remat_core,
                      sequence_method=self.sequence_method, attention_block=self.attention_block)
        return config
