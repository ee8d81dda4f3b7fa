"""Tensor-parallel calls for Keras layers whose weights a `LayoutMap` splits.

Private Keras detail used here (and only here): the `call` of each
`keras.layers.Dense`, `EinsumDense`, `Embedding` and `ReversibleEmbedding`
(and keras-hub's `ReversibleEmbedding`, the same class) built under a
strategy with a `LayoutMap` is set, on that instance, to a dispatcher
(`attach`, from the strategy's variable creator; no class is patched). It runs
this module's computation when the layer is exactly
one of those classes (a subclass may compute differently), has no LoRA or
quantization, runs in a replica of a tfdist mesh strategy, and its weight is
split by a `LayoutMap` (`tfdist.distribution`): shard-wise (tensor parallel)
when one mesh axis other than the batch axis splits it, and otherwise FSDP,
the weight gathered for its contraction and gathered again in the backward
pass (`weight_reads.regathered`: the whole weight is not kept alive between
the passes). Any other layer runs its original `call`, whose weight reads
gather the whole weight (FSDP, `tfdist.weight_reads`), exact for any layer;
so do these layers inside a `while_loop` of a Keras call (an RNN's cell),
where their weights are read whole, once, before the loop (`keras_loop_reads`).
`tests/internal/test_keras_tensor_parallel.py` checks every entry against the
installed Keras and the original `call`.

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

Known keras-hub blocks gather the rows their column layers read (query, key and
value; gate and up) once per block call, and pair their
column layers with their row layer as Megatron does (`keras_tp_pairs`): the
local columns `[b*M, ..., d_ff/M]` go from gate and up through the block's
element-wise ops straight into the row layer, no all-to-all in between.

The weight itself is never gathered over A; dimensions split over other axes
(a Gemma kernel's dimension on the batch axis) are gathered for the
contraction, and again in the backward pass (FSDP).
Biases are added where the output columns are local (sliced if replicated),
activations after the columns are whole again.
"""

import functools
import types
from typing import Optional

import keras
import tensorflow as tf

from keras.src.backend import set_keras_mask

from tfdist import collectives, runtime, tensor_parallel, weight_reads
from tfdist.internal import keras_hub_attention, keras_loop_reads, keras_tp_pairs, keras_variables


def _layout(variable):
    """The `TensorLayout` a `LayoutMap` gave Keras variable `variable`, or None."""
    return keras_variables.layout_of(variable)


def _keras_layouts():
    mesh_runtime = runtime.current_runtime()
    return getattr(getattr(mesh_runtime, "extended", None), "keras_layouts", None)


def _plan(layer, variable):
    """`(layout, axis)` for a split `variable` of `layer`, or None (run Keras's `call`).

    `axis` is the one mesh axis other than the batch axis the weight is split
    over (tensor parallel), or None: every split dimension is gathered (FSDP).
    """
    layouts = _keras_layouts()
    if layouts is None or tf.distribute.in_cross_replica_context():
        return None
    if keras_loop_reads.in_loop():  # Keras's call: its weights read whole, before the loop
        return None
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return None
    layout = _layout(variable)
    if layout is None or not layout.sharded_mesh_axes:
        return None
    axes = [a for a in layout.sharded_mesh_axes if a != layouts.batch_axis]
    return layout, (axes[0] if len(axes) == 1 else None)


def _dim_on(variable, axis) -> Optional[int]:
    layout = _layout(variable)
    if layout is None or axis not in layout.sharded_mesh_axes:
        return None
    return layout.mesh_axes.index(axis)


def _contract(contract, x, variable, layout, axis=None, lookup=False):
    """`contract(x, weight)`: the weight's dimension on `axis` local, the others gathered.

    The gathered dimensions (FSDP) are gathered again for the backward pass
    (`weight_reads.regathered`), not kept alive between the passes, unless the
    strategy keeps them (`reshard_after_forward=False`). A `lookup` (`contract`
    is `keras.ops.take(weight, x, axis=0)`) needs no weight for its gradient:
    gathered for the forward pass only (`weight_reads.looked_up`).
    """
    keep = (axis,) if axis else ()
    if not _keras_layouts().reshard_after_forward or keras_variables.keeps_whole(variable):
        # Gathered once and kept (ZeRO-1/2 keeps it between steps, too).
        with weight_reads.local_axes(*keep):
            return contract(x, tf.convert_to_tensor(variable))
    with weight_reads.local_axes(*layout.sharded_mesh_axes):
        shard = tf.convert_to_tensor(variable)
    if lookup:
        return weight_reads.looked_up(x, shard, layout, keep=keep)
    return weight_reads.regathered(contract, x, shard, layout, keep=keep,
                                   prefetch=_keras_layouts().prefetch)


def _read_slice(variable, axis, dim):
    """This device's part (along `axis`) of dimension `dim` of `variable`."""
    if _dim_on(variable, axis) == dim:
        with weight_reads.local_axes(axis):
            return tf.convert_to_tensor(variable)
    value = tf.convert_to_tensor(variable)
    size = collectives.axis_size(axis)
    width = value.shape[dim] // size
    start = collectives.axis_index(axis) * width
    begin = [0] * value.shape.rank
    begin[dim] = start
    size = value.shape.as_list()
    size[dim] = width
    return tf.slice(value, begin, size)  # a dense gradient, like the reference's


def _finish(layer, y, whole_bias=True):
    """`y` plus the layer's whole bias (unless the columns added their slices) and activation."""
    if whole_bias and layer.bias is not None:
        y = y + tf.convert_to_tensor(layer.bias)
    return layer.activation(y) if layer.activation is not None else y


# -- Dense and EinsumDense --------------------------------------------------------


def _einsum_specs(equation):
    if "..." in equation or "," not in equation or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    x_spec, kernel_spec = inputs.split(",")
    if not x_spec or x_spec[0] != output[0] or x_spec[0] in kernel_spec:
        return None  # the batch must be the first dimension of input and output
    return x_spec, kernel_spec, output


def _role(layer):
    """How a `Dense` or `EinsumDense` layer's split kernel computes, or None (Keras's `call`).

    Returns `(layout, axis, role, dim)`: role "fsdp" (axis None: every split
    dimension gathered), "column" (`dim`, counted from the end, is the output
    dimension split over `axis`) or "row" (`dim`, from the end, is the input
    dimension contracted over `axis`).
    """
    plan = _plan(layer, layer.kernel)
    if plan is None:
        return None
    layout, axis = plan
    if axis is None:
        return layout, None, "fsdp", None
    if not isinstance(layer, keras.layers.EinsumDense):
        return (layout, axis, "column", -1) if _dim_on(layer.kernel, axis) == 1 else (
            layout, axis, "row", -1)
    specs = _einsum_specs(layer.equation)
    if specs is None:
        return layout, None, "fsdp", None
    x_spec, kernel_spec, out_spec = specs
    letter = kernel_spec[_dim_on(layer.kernel, axis)]
    if letter in x_spec and letter in out_spec:  # a dimension of input, kernel and output alike
        return layout, None, "fsdp", None
    if letter in out_spec:
        return layout, axis, "column", out_spec.index(letter) - len(out_spec)
    return layout, axis, "row", x_spec.index(letter) - len(x_spec)


def _bias_slice(layer, axis, dim):
    """The bias, sliced like the split output dimension `dim` (from the end) where it has it."""
    if not isinstance(layer, keras.layers.EinsumDense):
        return _read_slice(layer.bias, axis, 0)
    out_spec = _einsum_specs(layer.equation)[2]
    letter = out_spec[dim]
    first = min(out_spec.find(c) for c in layer.bias_axes)
    bias_spec = out_spec[first:]
    if letter not in layer.bias_axes or letter not in bias_spec:
        return tf.convert_to_tensor(layer.bias)
    return _read_slice(layer.bias, axis, bias_spec.index(letter))


def dense_call(layer, inputs, training=None):
    """`Dense` and `EinsumDense`: column- or row-parallel over the kernel's split axis, or FSDP."""
    role = _role(layer)
    if role is None:
        return NotImplemented
    layout, axis, kind, dim = role
    x = tf.convert_to_tensor(inputs)
    if isinstance(layer, keras.layers.EinsumDense):
        def contract(x, kernel):
            return keras.ops.einsum(layer.equation, x, kernel)
    else:
        contract = keras.ops.matmul
    if kind == "fsdp":
        return _finish(layer, _contract(contract, x, layer.kernel, layout))
    if kind == "column":

        def compute(x_all):
            y = _contract(contract, x_all, layer.kernel, layout, axis)
            if layer.bias is not None:
                y = y + _bias_slice(layer, axis, dim)
            return y

        pair = keras_tp_pairs.column_pair(layer)
        if pair is not None:  # local columns stay local until the paired row layer
            return pair.hand_over(_finish(layer, compute(_gathered_rows(x, axis)),
                                          whole_bias=False))
        return _finish(layer, tensor_parallel.column(
            x, axis, compute, concat_dim=dim,
            gather_rows=lambda x: _gathered_rows(x, axis)), whole_bias=False)

    def compute(cols):
        return _contract(contract, cols, layer.kernel, layout, axis)

    pair = keras_tp_pairs.row_pair(layer)
    if pair is not None:  # the paired column layers' local columns, every row of the group
        y = collectives.reduce_scatter_partial_sums(compute, [pair.take(x)], axis, dim=0)
    else:
        y = tensor_parallel.row(x, axis, compute, split_dim=dim)
    return _finish(layer, y)


def pairing_plan(columns, row, dim=-1):
    """`(size, axis)`: the mesh axis `columns` and `row` pair over (`keras_tp_pairs`), or None.

    They can when each is exactly a `Dense` or `EinsumDense` that runs tensor
    parallel over one mesh axis, the columns splitting output dimension `dim`
    (from the end: -1, a feed-forward block's hidden units; -2, attention's
    heads) and the row contracting its input dimension `dim`, and none is
    recomputed on its own (its recomputation would run outside the pairing).
    """
    layers = [*columns, row]
    if any(type(layer) not in (keras.layers.Dense, keras.layers.EinsumDense)
           or getattr(getattr(layer, "_remat_mode", None), "mode", None) is not None
           for layer in layers):
        return None
    roles = [_role(layer) for layer in layers]
    if any(role is None for role in roles):
        return None
    kinds = [(axis, kind, d) for _, axis, kind, d in roles]
    axis = kinds[0][0]
    wanted = [(axis, "column", dim)] * len(columns) + [(axis, "row", dim)]
    if axis is None or kinds != wanted:
        return None
    return collectives.axis_size(axis), axis


def _gathered_rows(x, axis):
    """`all_gather(x, axis, dim=0)`; within a paired block once per tensor: gate and up, or
    query, key and value, read the same rows (their gradients meet before one reduce-scatter)."""
    return keras_tp_pairs.gathered_once(x, axis, lambda: collectives.all_gather(x, axis, dim=0))


# -- Embedding and ReversibleEmbedding -------------------------------------------


def embedding_call(layer, inputs):
    plan = _plan(layer, layer.embeddings)
    if plan is None:
        return NotImplemented
    layout, axis = plan
    ids = tf.convert_to_tensor(inputs)
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    if axis is None:  # FSDP
        out = _contract(lambda ids, table: keras.ops.take(table, ids, axis=0), ids,
                        layer.embeddings, layout, lookup=True)
        return tf.cast(out, layer.compute_dtype)
    if _dim_on(layer.embeddings, axis) == 0:  # vocabulary split: [V/M, d]

        def lookup(ids_all, table):
            rows = table.shape[0]
            local = ids_all - tf.cast(collectives.axis_index(axis) * rows, ids_all.dtype)
            return tensor_parallel.held_rows(table, local)  # zero for other shards' ids

        out = tensor_parallel.vocab_split(ids, axis, lambda ids_all: _contract(
            lookup, ids_all, layer.embeddings, layout, axis))  # [b, ..., d]
    else:  # features split: [V, d/M]
        ids_all = collectives.all_gather(ids, axis, dim=0)  # [b*M, ...]
        found = _contract(lambda ids_all, table: tf.gather(table, ids_all), ids_all,
                          layer.embeddings, layout, axis)
        out = collectives.all_to_all(found, axis, split_dim=0, concat_dim=-1)
    return tf.cast(out, layer.compute_dtype)


def reversible_embedding_call(layer, inputs, reverse=False):
    if not reverse:  # Keras's branch: `Embedding.call`, then the mask
        out = embedding_call(layer, inputs)
        if out is NotImplemented:
            return out
        mask = keras.layers.Embedding.compute_mask(layer, inputs)
        if mask is not None:
            set_keras_mask(out, mask)
        return out
    weight = layer.embeddings if layer.tie_weights else layer.reverse_embeddings
    plan = _plan(layer, weight)
    if plan is None:
        return NotImplemented
    layout, axis = plan
    x = tf.convert_to_tensor(inputs)
    if layer.reverse_dtype is not None:
        x = tf.cast(x, layer.reverse_dtype)

    def project(x, part):
        kernel = tf.transpose(part) if layer.tie_weights else part
        if layer.reverse_dtype is not None:
            kernel = tf.cast(kernel, layer.reverse_dtype)
        return keras.ops.matmul(x, kernel)

    # Output (vocabulary) dimension: 0 of the tied table [V, d], 1 of [d, V].
    vocab_dim = 0 if layer.tie_weights else 1
    if axis is None:  # FSDP
        logits = _contract(project, x, weight, layout)
    elif _dim_on(weight, axis) == vocab_dim:
        logits = tensor_parallel.column(
            x, axis, lambda x_all: _contract(project, x_all, weight, layout, axis),
            gather_rows=lambda x: _gathered_rows(x, axis))
    else:
        logits = tensor_parallel.row(
            x, axis, lambda cols: _contract(project, cols, weight, layout, axis))
    if layer.logit_soft_cap is not None:
        cap = layer.logit_soft_cap
        logits = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(logits, cap)), cap)
    return logits


# -- the registry ---------------------------------------------------------------


def _registry():
    """(class whose `call` is replaced, tensor-parallel call, classes it serves exactly)."""
    entries = [
        (keras.layers.Dense, dense_call, (keras.layers.Dense,)),
        (keras.layers.EinsumDense, dense_call, (keras.layers.EinsumDense,)),
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


@functools.cache
def _entries():
    """((the upstream `call` a layer's class resolves to, the dispatcher wrapping it), ...),
    each dispatcher made once and bound to every layer it serves."""
    makers = [(cls.__dict__["call"], functools.partial(_dispatcher, tensor_parallel=fn,
                                                      serves=serves))
              for cls, fn, serves in _registry()]
    makers += keras_tp_pairs.entries(pairing_plan)
    makers += [(cls.__dict__["call"],
                functools.partial(keras_hub_attention.split_dispatcher, split=split))
               for cls, split in keras_hub_attention.split_only_classes().items()]
    return tuple((original, make(original)) for original, make in makers)


def attach(layer) -> None:
    """Sets the shard-wise dispatcher as `layer`'s `call` when its class's call is one
    this module or `keras_tp_pairs` computes (idempotent; other layers are left alone)."""
    if not isinstance(layer, keras.layers.Layer) or "call" in vars(layer):
        return
    _refuse_attention_over_a_split(layer)
    resolved = type(layer).call
    for original, dispatcher in _entries():
        if resolved is original:
            # `object.__setattr__`: a plain attribute, kept out of Keras's tracking.
            object.__setattr__(layer, "call", types.MethodType(dispatcher, layer))
            return


def _refuse_attention_over_a_split(layer) -> None:
    """Raises for an attention layer tfdist cannot compute over the mesh's sequence split:
    its own call would attend within each device's tokens only."""
    from tfdist import runtime, sequence

    axis = sequence.sequence_axis(runtime.current_mesh())
    if (axis is None or "Attention" not in type(layer).__name__
            or type(layer).__module__.startswith("tfdist.")):  # tfdist's own: split-aware
        return
    from tfdist.internal import keras_hub_attention

    cls = type(layer)
    known = cls in keras_hub_attention.attention_classes() or \
        cls in keras_hub_attention.split_only_classes()
    if not known or keras_hub_attention.split_substitute(cls) is \
            keras_hub_attention.unsupported_split_attention:
        keras_hub_attention.unsupported_split_attention(layer, axis, None)


def attach_to_layers_being_built() -> None:
    """`attach` to every layer whose name scope is open (from a variable creator: the
    layer whose weight is being created and the blocks around it)."""
    for caller in keras_variables.scope_callers():
        attach(caller)
