"""Tensor-parallel calls for Keras layers whose weights a `LayoutMap` splits.

Private Keras detail used here (and only here): the `call` methods of
`keras.layers.Dense`, `EinsumDense`, `Embedding` and `ReversibleEmbedding`
(and keras-hub's `ReversibleEmbedding`, the same class) are replaced, once,
by a dispatcher. It runs this module's shard-wise computation when the layer
is exactly one of those classes (a subclass may compute differently), has no
LoRA or quantization, runs in a replica of a tfdist mesh strategy, and its
weight is split (by a `LayoutMap`, `tfdist.distribution`) over a mesh axis
other than the batch axis; otherwise it runs the original `call`, whose
weight reads gather the whole weight (FSDP, `tfdist.weight_reads`), exact
for any layer. `tests/internal/test_keras_tensor_parallel.py` checks every
entry against the installed Keras and the original `call`.

Each replica holds its own rows (the batch is split over every replica). For
a weight split over mesh axis A of size M (shapes for a replica's `b` rows):

    column (a kernel's output dimension on A):
        x [b, ..., d_in] -> all_gather over A -> [b*M, ..., d_in]
        times the kernel shard -> [b*M, ..., d_out/M]
        -> all_to_all -> [b, ..., d_out]
    row (a kernel's contracted dimension on A):
        x [b, ..., d_in] -> all_to_all -> [b*M, ..., d_in/M]
        times the kernel shard -> [b*M, ..., d_out] partial sums
        -> reduce_scatter over A -> [b, ..., d_out]
    vocabulary-split embedding (the table's rows on A):
        ids [b, ...] -> all_gather -> [b*M, ...]; look up the ids this shard
        holds (zero elsewhere) -> reduce_scatter over A -> [b, ..., d]

The weight itself is never gathered over A; dimensions split over other axes
(a Gemma kernel's dimension on the batch axis) are gathered when read (FSDP).
Biases are added where the output columns are local (sliced if replicated),
activations after the columns are whole again.
"""

import functools
from typing import Optional

import keras
import tensorflow as tf

from tfdist import collectives, runtime, weight_reads
from tfdist.internal import keras_variables


def _layout(variable):
    """The `TensorLayout` a `LayoutMap` gave Keras variable `variable`, or None."""
    return keras_variables.layout_of(variable)


def _tp_axis(layer, variable) -> Optional[str]:
    """The one mesh axis (not the batch axis) `variable` is split over, or None."""
    mesh_runtime = runtime.current_runtime()
    layouts = getattr(getattr(mesh_runtime, "extended", None), "keras_layouts", None)
    if layouts is None or tf.distribute.in_cross_replica_context():
        return None
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return None
    layout = _layout(variable)
    if layout is None:
        return None
    axes = [a for a in layout.sharded_mesh_axes if a != layouts.batch_axis]
    return axes[0] if len(axes) == 1 else None


def _dim_on(variable, axis) -> Optional[int]:
    layout = _layout(variable)
    if layout is None or axis not in layout.sharded_mesh_axes:
        return None
    return layout.mesh_axes.index(axis)


def _read_local(variable, axis):
    """`variable` with its dimension on `axis` kept local (other split dimensions gathered)."""
    with weight_reads.local_axes(axis):
        return tf.convert_to_tensor(variable)


def _read_slice(variable, axis, dim):
    """This device's part (along `axis`) of dimension `dim` of `variable`."""
    if _dim_on(variable, axis) == dim:
        return _read_local(variable, axis)
    value = tf.convert_to_tensor(variable)
    size = collectives.axis_size(axis)
    width = value.shape[dim] // size
    start = collectives.axis_index(axis) * width
    begin = [0] * value.shape.rank
    begin[dim] = start
    size = value.shape.as_list()
    size[dim] = width
    return tf.slice(value, begin, size)  # a dense gradient, like the reference's


def _column(x, axis, compute, concat_dim):
    """`compute` on every row of the group, output columns local, columns exchanged back."""
    x_all = collectives.all_gather(x, axis, dim=0)  # [b*M, ..., d_in]
    y = compute(x_all)  # [b*M, ..., d_out/M]
    return collectives.all_to_all(y, axis, split_dim=0, concat_dim=concat_dim)


def _row(x, axis, split_dim, compute):
    """`compute` on this device's input columns of every row, partial sums scattered back."""
    x_cols = collectives.all_to_all(x, axis, split_dim=split_dim, concat_dim=0)
    return collectives.reduce_scatter(compute(x_cols), axis, dim=0)  # [b, ..., d_out]


# -- Dense ----------------------------------------------------------------------


def dense_call(layer, inputs, training=None):
    axis = _tp_axis(layer, layer.kernel)
    if axis is None:
        return NotImplemented
    x = tf.convert_to_tensor(inputs)
    kernel_dim = _dim_on(layer.kernel, axis)
    kernel = _read_local(layer.kernel, axis)
    if kernel_dim == 1:  # column-parallel

        def compute(x_all):
            y = keras.ops.matmul(x_all, kernel)
            if layer.bias is not None:
                y = y + _read_slice(layer.bias, axis, 0)
            return y

        y = _column(x, axis, compute, concat_dim=-1)
    else:  # row-parallel
        y = _row(x, axis, -1, lambda cols: keras.ops.matmul(cols, kernel))
        if layer.bias is not None:
            y = y + tf.convert_to_tensor(layer.bias)
    return layer.activation(y) if layer.activation is not None else y


# -- EinsumDense ----------------------------------------------------------------


def _einsum_specs(equation):
    if "..." in equation or "," not in equation or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    x_spec, kernel_spec = inputs.split(",")
    if not x_spec or x_spec[0] != output[0] or x_spec[0] in kernel_spec:
        return None  # the batch must be the first dimension of input and output
    return x_spec, kernel_spec, output


def einsum_dense_call(layer, inputs, training=None):
    axis = _tp_axis(layer, layer.kernel)
    specs = _einsum_specs(layer.equation)
    if axis is None or specs is None:
        return NotImplemented
    x_spec, kernel_spec, out_spec = specs
    letter = kernel_spec[_dim_on(layer.kernel, axis)]
    if letter in x_spec and letter in out_spec:
        return NotImplemented  # a dimension of input, kernel and output alike
    x = tf.convert_to_tensor(inputs)
    kernel = _read_local(layer.kernel, axis)
    if letter in out_spec:  # column-parallel: output dimension `letter` local

        def compute(x_all):
            y = keras.ops.einsum(layer.equation, x_all, kernel)
            if layer.bias is not None:
                y = y + _einsum_bias(layer, out_spec, axis, letter)
            return y

        y = _column(x, axis, compute, concat_dim=out_spec.index(letter))
    else:  # row-parallel: contracted dimension `letter` split
        y = _row(x, axis, x_spec.index(letter),
                 lambda cols: keras.ops.einsum(layer.equation, cols, kernel))
        if layer.bias is not None:
            y = y + tf.convert_to_tensor(layer.bias)
    return layer.activation(y) if layer.activation is not None else y


def _einsum_bias(layer, out_spec, axis, letter):
    """The bias, sliced like output dimension `letter` where the bias has it."""
    first = min(out_spec.find(c) for c in layer.bias_axes)
    bias_spec = out_spec[first:]
    if letter not in layer.bias_axes or letter not in bias_spec:
        return tf.convert_to_tensor(layer.bias)
    return _read_slice(layer.bias, axis, bias_spec.index(letter))


# -- Embedding and ReversibleEmbedding -------------------------------------------


def embedding_call(layer, inputs):
    axis = _tp_axis(layer, layer.embeddings)
    if axis is None:
        return NotImplemented
    ids = tf.convert_to_tensor(inputs)
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    table = _read_local(layer.embeddings, axis)
    ids_all = collectives.all_gather(ids, axis, dim=0)  # [b*M, ...]
    if _dim_on(layer.embeddings, axis) == 0:  # vocabulary split: [V/M, d]
        rows = table.shape[0]
        local = ids_all - tf.cast(collectives.axis_index(axis) * rows, ids_all.dtype)
        found = _held_rows(table, local)  # [b*M, ..., d], zero for other shards' ids
        out = collectives.reduce_scatter(found, axis, dim=0)  # [b, ..., d]
    else:  # features split: [V, d/M]
        out = collectives.all_to_all(tf.gather(table, ids_all), axis, split_dim=0,
                                     concat_dim=-1)
    return tf.cast(out, layer.compute_dtype)


def _held_rows(table, local):
    """Rows `local` of `table` [rows, d], zero where `local` is outside it.

    Its gradient is sparse over the held rows only (other ids are padding,
    index -1, dropped before the optimizer), as one device's `tf.gather` is.
    """
    held = (local >= 0) & (local < table.shape[0])
    safe = tf.where(held, local, tf.zeros_like(local))
    mask = tf.cast(held, table.dtype)[..., tf.newaxis]

    @tf.custom_gradient
    def lookup(table):
        def grad(dy):
            indices = tf.reshape(tf.where(held, local, -tf.ones_like(local)), [-1])
            values = tf.reshape(dy * mask, [-1, table.shape[-1]])
            return tf.IndexedSlices(values, tf.cast(indices, tf.int64),
                                    tf.constant(table.shape.as_list(), tf.int64))

        return tf.gather(table, safe) * mask, grad

    return lookup(table)


def reversible_embedding_call(layer, inputs, reverse=False):
    if not reverse:
        return NotImplemented  # the original calls Embedding.call (dispatched too)
    weight = layer.embeddings if layer.tie_weights else layer.reverse_embeddings
    axis = _tp_axis(layer, weight)
    if axis is None:
        return NotImplemented
    # Output (vocabulary) dimension: 0 of the tied table [V, d], 1 of [d, V].
    vocab_dim = 0 if layer.tie_weights else 1
    x = tf.convert_to_tensor(inputs)
    part = _read_local(weight, axis)
    kernel = tf.transpose(part) if layer.tie_weights else part
    if layer.reverse_dtype is not None:
        x = tf.cast(x, layer.reverse_dtype)
        kernel = tf.cast(kernel, layer.reverse_dtype)
    if _dim_on(weight, axis) == vocab_dim:
        logits = _column(x, axis, lambda x_all: keras.ops.matmul(x_all, kernel), -1)
    else:
        logits = _row(x, axis, -1, lambda cols: keras.ops.matmul(cols, kernel))
    if layer.logit_soft_cap is not None:
        cap = layer.logit_soft_cap
        logits = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(logits, cap)), cap)
    return logits


# -- the registry ---------------------------------------------------------------


def _registry():
    """(class whose `call` is replaced, tensor-parallel call, classes it serves exactly)."""
    entries = [
        (keras.layers.Dense, dense_call, (keras.layers.Dense,)),
        (keras.layers.EinsumDense, einsum_dense_call, (keras.layers.EinsumDense,)),
    ]
    reversible = [keras.layers.ReversibleEmbedding]
    try:
        import keras_hub

        reversible.append(keras_hub.layers.ReversibleEmbedding)
    except ImportError:
        pass
    entries.append((keras.layers.Embedding, embedding_call,
                    (keras.layers.Embedding, *reversible)))
    entries.append((keras.layers.ReversibleEmbedding, reversible_embedding_call,
                    tuple(reversible)))
    return entries


def _dispatcher(original, tensor_parallel, serves):
    @functools.wraps(original)
    def call(self, *args, **kwargs):
        if type(self) in serves:
            out = tensor_parallel(self, *args, **kwargs)
            if out is not NotImplemented:
                return out
        return original(self, *args, **kwargs)

    call._tfdist_original = original
    return call


def install() -> None:
    """Replaces the registry's `call` methods by dispatchers (idempotent)."""
    for cls, tensor_parallel, serves in _registry():
        current = cls.__dict__["call"]
        if getattr(current, "_tfdist_original", None) is None:
            cls.call = _dispatcher(current, tensor_parallel, serves)
