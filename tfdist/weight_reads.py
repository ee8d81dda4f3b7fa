"""How a weight laid out by a Keras `LayoutMap` reads inside a replica.

A Keras layer tfdist knows nothing about computes on whole weights. So a
weight whose layout comes from a `LayoutMap` (`tfdist.distribution`) is
*stored* as one shard per device, but read in a replica as the whole weight:
its split dimensions are all-gathered from their shards (FSDP / ZeRO-3). The
gradient of that all-gather is a reduce-scatter, so each device's gradient
arrives for its own shard only, and the strategy then sums it over the devices
that hold the same shard: exactly one device's gradient, for any layer.

A layer whose computation runs on shards (tensor parallelism,
`tfdist.internal.keras_tensor_parallel`) reads its weights inside
`local_axes(axis)`: dimensions split over `axis` then stay local (no gather),
dimensions split over other axes (FSDP, e.g. Gemma's `batch` dimension) are
still gathered.

The layers tfdist knows (Keras's `Dense`, `EinsumDense`, `Embedding`,
`ReversibleEmbedding`) read their gathered weights through `regathered`, which
gathers again in the backward pass instead of keeping the whole weight alive
between the passes; any other layer's gathered read is kept by the tape until
its backward pass.

Example (a column-parallel matmul of a kernel laid out `(None, "model")`):

```python
with local_axes("model"):
    kernel = tf.convert_to_tensor(layer.kernel)   # [d_in, units / M]
```
"""

import contextlib
import threading

import tensorflow as tf

from tfdist import collectives

_state = threading.local()


@contextlib.contextmanager
def local_axes(*axes: str):
    """Within: weights read in a replica keep their dimensions split over `axes` local."""
    previous = getattr(_state, "local", frozenset())
    _state.local = previous | frozenset(axes)
    try:
        yield
    finally:
        _state.local = previous


def kept_local() -> frozenset:
    """The mesh axes `local_axes` keeps local here (what a weight read depends on)."""
    return getattr(_state, "local", frozenset())


def gathered_axes(layout):
    """The mesh axes a read of a weight with `layout` gathers here (in dimension order)."""
    keep = getattr(_state, "local", frozenset())
    return tuple(a for a in layout.mesh_axes
                 if a is not None and a in layout.sharded_mesh_axes and a not in keep)


def read_in_replica(layout, shard):
    """The weight `shard` (a device's component) is part of, gathered as `local_axes` allows.

    Args:
        layout: the weight's `tfdist.mesh.TensorLayout`.
        shard: this device's component (a variable or tensor of `layout.local_shape`).

    Returns:
        A tensor: the global weight, except dimensions split over `local_axes`,
        which keep this device's slice.
    """
    gather = set(gathered_axes(layout))
    if not gather:
        return shard
    return _gather(tf.convert_to_tensor(shard), layout, gather)  # the read the tape records


def read_kept(shard, whole, axis: str, dim: int, base=None, whole_gradient: bool = False):
    """A ZeRO-1/2 weight read in a replica: its kept copy, gradient to the shard.

    Args:
        shard: this device's component of the weight, split over `axis` on
            dimension `dim` (and as `base` lays it out over other axes).
        whole: this device's component of the kept copy: `shard` gathered
            over `axis`.
        axis, dim: the batch axis ZeRO splits the weight over, and where.
        base: the weight's layout without ZeRO (None: replicated); its split
            dimensions are gathered as `read_in_replica` gathers them.
        whole_gradient: ZeRO-1: the gradient reaching `shard` is this replica's
            whole, unreduced gradient of the copy (shaped like `whole`, not like
            `shard`), which the strategy all-reduces with the replicated
            weights' gradients and then cuts to the shard
            (`tfdist.internal.shard_routing`).

    Returns:
        The shard itself under `local_axes(axis)` (the optimizer's reads);
        otherwise the kept copy, differentiated as an all-gather of `shard`
        (its gradient is reduce-scattered: ZeRO-2) or passed on whole (ZeRO-1),
        then gathered as `base` needs.
    """
    if axis in getattr(_state, "local", frozenset()):
        return shard
    if whole_gradient:
        value = _passed_on_whole(tf.convert_to_tensor(shard), tf.convert_to_tensor(whole))
    else:
        value = collectives.gathered_as(tf.convert_to_tensor(shard),
                                        tf.convert_to_tensor(whole), axis, dim)
    return value if base is None else read_in_replica(base, value)


@tf.custom_gradient
def _passed_on_whole(shard, whole):
    """`whole`; its gradient goes to `shard` unreduced and whole-shaped (ZeRO-1)."""
    def grad(dy):
        return dy, None

    return tf.identity(whole), grad


def _gather(value, layout, axes):
    for dim, axis in enumerate(layout.mesh_axes):
        if axis in axes:
            value = collectives.all_gather(value, axis, dim=dim)
    return value


def looked_up(ids, shard, layout, keep=()):
    """Rows `ids` (int, any shape) of the weight gathered from `shard`, as
    `keras.ops.take(weight, ids, axis=0)` reads them (FSDP: an embedding lookup).

    Gathered for the forward pass only: a lookup's weight gradient is its output
    gradient summed into the rows it read, which needs no weight value, so the
    backward pass gathers nothing (`regathered` would gather the whole weight
    again for nothing) and nothing keeps the gathered weight alive. The
    gradient reaches the shards as the gathers' gradients would carry it:
    `IndexedSlices`, reduce-scattered and kept sparse.
    """
    keep = set(keep) | getattr(_state, "local", frozenset())
    axes = [a for a in layout.sharded_mesh_axes if a not in keep]
    gathered = [(dim, axis) for dim, axis in enumerate(layout.mesh_axes) if axis in axes]
    shapes = [shard.shape]  # before each gather, in gather order
    for dim, axis in gathered:
        whole = shapes[-1].as_list()
        whole[dim] *= collectives.axis_size(axis)
        shapes.append(tf.TensorShape(whole))
    whole_shape = shapes[-1]
    ids = tf.convert_to_tensor(ids)
    # keras.ops.take on TF counts negative ids from the end.
    rows = tf.where(ids < 0, ids + tf.cast(whole_shape[0], ids.dtype), ids)
    if not gathered:
        return tf.gather(shard, rows)

    @tf.custom_gradient
    def run(shard):
        with tf.control_dependencies([ids]):  # not before the forward pass reaches here
            ready = tf.identity(shard)

        def grad(dy):
            dy = tf.IndexedSlices(tf.reshape(dy, [-1, *whole_shape[1:]]),
                                  tf.reshape(tf.cast(rows, tf.int64), [-1]),
                                  tf.constant(whole_shape.as_list(), tf.int64))
            for (dim, axis), local_shape in zip(reversed(gathered), reversed(shapes[:-1])):
                dy = collectives.all_gather_gradient(dy, axis, dim, local_shape)
            return dy

        return tf.gather(_gather(ready, layout, axes), rows), grad

    return run(shard)


def _ahead(tensor, kind):
    """The tensor the previous `regathered` of this trace and replica waited for (`kind`:
    "forward" inputs or "backward" output gradients), else `tensor`; records `tensor`.

    Traced earlier, it never depends on ops made after it: no cycle."""
    if tf.executing_eagerly():
        return tensor
    previous = getattr(_state, kind, None)
    setattr(_state, kind, tensor)
    return previous if previous is not None and previous.graph is tensor.graph else tensor


def regathered(contract, x, shard, layout, keep=(), prefetch=False):
    """`contract(x, weight)`, the weight gathered from `shard` in the forward pass and again in the backward.

    FSDP's memory promise: the gathered weight lives only as long as the
    contraction that reads it. A plain gathered read would be kept alive by
    the tape until the backward pass (a matmul's input gradient needs the
    weight), so every layer's whole weight would be held at the peak. Here the
    backward pass gathers the weight again, once the output's gradient has
    arrived, and differentiates `contract` on that copy (its forward result is
    unused there, so TF prunes it). The forward gather likewise waits for `x`:
    TF would otherwise run every layer's gather as soon as the step starts
    (their shards are ready), holding all whole weights at once.

    Args:
        contract: `(x, weight) -> y`, differentiable in both (a matmul, einsum
            or row lookup; `x` may be integer ids).
        x: its first input.
        shard: this device's component of the weight (a tensor read under
            `local_axes` of all its axes).
        layout: the weight's `tfdist.mesh.TensorLayout`.
        keep: mesh axes whose dimensions stay local (tensor parallelism).
        prefetch: wait for the previous `regathered` contraction's input (in
            the backward pass, its output gradient) instead of this one's, so
            the gather overlaps the previous layer's compute.

    Returns:
        `contract(x, weight)`, the weight gathered over every split axis but
        `keep` and the ambient `local_axes`.
    """
    keep = set(keep) | getattr(_state, "local", frozenset())
    axes = {a for a in layout.sharded_mesh_axes if a not in keep}
    if not axes:
        return contract(x, shard)
    x_trainable = x.dtype.is_floating or x.dtype.is_complex

    @tf.custom_gradient
    def run(x, shard):
        # Not before the forward pass reaches here (or the layer before, prefetching).
        with tf.control_dependencies([_ahead(x, "forward") if prefetch else x]):
            ready = tf.identity(shard)

        def grad(dy):
            # Not before the backward pass reaches here (or the layer after, prefetching).
            with tf.control_dependencies([_ahead(dy, "backward") if prefetch else dy]):
                again = tf.identity(shard)
            sources = [x, again] if x_trainable else [again]
            with tf.GradientTape() as tape:
                tape.watch(sources)
                y = contract(x, _gather(again, layout, axes))
            grads = tape.gradient(y, sources, output_gradients=dy)
            return tuple(grads) if x_trainable else (None, grads[0])

        return contract(x, _gather(ready, layout, axes)), grad

    return run(x, shard)
