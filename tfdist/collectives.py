"""Named-axis collectives for sharded layers.

A sharded layer is written per shard, like Megatron or Mesh-TF's lowering: it
asks for its coordinate along a mesh axis and calls collectives over that axis
by name. Under a replica of a tfdist mesh strategy (`tfdist.runtime`) these are
real collectives, on the mesh's communication backend, among the devices that
differ only along the named axis; anywhere else (one device, a
strategy without a mesh, or Keras building the model in cross-replica context)
the axis has size 1, index 0, and every collective is the identity, so the same
layer code computes the global, single-device result.

All collectives are differentiable (the gradient of `all_gather` is
`reduce_scatter`, of `psum` is `psum`, of `all_to_all` is the reverse
`all_to_all`).

Example (a column-parallel matmul whose batch is gathered over "model"):

```python
x_all = all_gather(x, "model", dim=0)        # [batch * M, d_model]
y_local = tf.matmul(x_all, kernel_shard)     # [batch * M, d_ff / M]
```
"""

from typing import Optional

import tensorflow as tf

from tfdist import runtime
from tfdist.runtime import current_mesh  # noqa: F401  (re-exported: layers read it here)


class AxisContext:
    """Where the current replica sits on one mesh axis.

    Attributes:
        backend: the mesh's communication backend (`tfdist.comm.Backend`).
        replica: this replica's device index.
        group: the device indices that differ from this one only along the
            axis, in axis order.
        index: this replica's coordinate along the axis.
    """

    def __init__(self, backend, replica, group):
        self.backend = backend
        self.replica = replica
        self.group = group
        self.index = group.index(replica)

    @property
    def size(self) -> int:
        return len(self.group)


def axis_context(axis: Optional[str]) -> Optional[AxisContext]:
    """The replica's `AxisContext` for `axis`, or None where the axis is trivial."""
    if axis is None:
        return None
    mesh_runtime = runtime.current_runtime()
    if mesh_runtime is None or tf.distribute.in_cross_replica_context():
        return None
    mesh = mesh_runtime.mesh
    if axis not in mesh.shape.names or mesh.shape.axis_size(axis) == 1:
        return None
    ctx = tf.distribute.get_replica_context()
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    if replica is None:
        raise RuntimeError("tfdist collectives need a static replica id.")
    replica = mesh_runtime.mesh_device_index(int(replica))
    for group in mesh.shape.groups([axis]):
        if replica in group:
            return AxisContext(mesh_runtime.backend, replica, group)
    raise AssertionError(f"replica {replica} is on no group of axis {axis!r}")


def axis_size(axis: Optional[str]) -> int:
    """Number of devices along mesh axis `axis` for this replica (1 if trivial)."""
    ctx = axis_context(axis)
    return 1 if ctx is None else ctx.size


def axis_index(axis: Optional[str]) -> int:
    """This replica's coordinate along mesh axis `axis` (0 if trivial)."""
    ctx = axis_context(axis)
    return 0 if ctx is None else ctx.index


def psum(x, axis: Optional[str]):
    """Sum of `x` over mesh axis `axis`; same shape as `x`."""
    ctx = axis_context(axis)
    if ctx is None:
        return x
    return _psum(ctx, x)


def _psum(ctx, x):
    _outside_loops("psum")

    @tf.custom_gradient
    def op(x):
        def grad(dy):
            return _psum(ctx, dy)

        return ctx.backend.all_reduce(x, ctx.replica, ctx.group), grad

    return op(x)


def pmax(x, axis: Optional[str]):
    """Element-wise maximum of `x` over mesh axis `axis` (no gradient)."""
    ctx = axis_context(axis)
    if ctx is None:
        return tf.stop_gradient(x)
    _outside_loops("pmax")
    return tf.stop_gradient(ctx.backend.all_reduce(x, ctx.replica, ctx.group, merge_op="Max"))


def all_gather(x, axis: Optional[str], dim: int = 0):
    """Concatenates `x` from every device along `axis`, in axis order, on `dim`.

    Args:
        x: a tensor, the same shape on every device of the axis.
        axis: the mesh axis name (None: identity).
        dim: the tensor dimension to concatenate on.

    Returns:
        A tensor whose dimension `dim` is `axis_size(axis)` times larger.
    """
    ctx = axis_context(axis)
    if ctx is None:
        return x
    return _all_gather(ctx, x, dim)


def _all_gather(ctx, x, dim):
    @tf.custom_gradient
    def op(x):
        return _gather_on(ctx, x, dim), lambda dy: _gather_gradient(ctx, dy, dim, x.shape)

    return op(x)


def all_gather_gradient(dy, axis: Optional[str], dim: int, local_shape):
    """The gradient `all_gather(x, axis, dim)` gives `x` (of `local_shape`) for `dy`."""
    ctx = axis_context(axis)
    return dy if ctx is None else _gather_gradient(ctx, dy, dim, tf.TensorShape(local_shape))


def _gather_gradient(ctx, dy, dim, local_shape):
    """`dy` reduce-scattered on `dim`; kept sparse for `IndexedSlices` (a gathered weight
    read by `tf.gather`)."""
    if isinstance(dy, tf.IndexedSlices):
        return _sparse_reduce_scatter(ctx, dy, dim, local_shape)
    return _reduce_scatter(ctx, dy, dim)


def gathered_as(x, whole, axis: Optional[str], dim: int = 0):
    """`whole`, a kept `all_gather(x, axis, dim)`, differentiated as that gather of `x`.

    For a weight whose gathered value is kept between steps (ZeRO-1/2): the
    forward pass reads the kept copy, no collective; the gradient reaches `x`
    reduce-scattered (kept sparse for a row lookup's `IndexedSlices`), as an
    `all_gather`'s does; `whole` gets none.
    """
    ctx = axis_context(axis)
    if ctx is None:
        return whole

    @tf.custom_gradient
    def op(x, whole):
        def grad(dy):
            if isinstance(dy, tf.IndexedSlices):
                return _sparse_reduce_scatter(ctx, dy, dim, x.shape), None
            return _reduce_scatter(ctx, dy, dim), None

        return tf.identity(whole), grad

    return op(x, whole)


def _sparse_reduce_scatter(ctx, dy, dim, local_shape):
    """`reduce_scatter` of a sparse gradient (`IndexedSlices` over rows), kept sparse.

    The sum of sparse gradients is the concatenation of their entries. Split
    rows (`dim` 0): each device keeps the entries of its own rows, renumbered;
    an entry of another device's rows becomes padding (index -1, value 0), so
    that shapes stay static. Split columns: each device keeps its columns of
    every entry. Padding entries are dropped before the optimizer sees the
    gradient (`ShardRouting`): an index -1 is out of range for the scatter
    updates Keras's TF optimizer applies sparse gradients with.
    """
    dim = dim % len(local_shape)
    dense_shape = tf.constant(local_shape.as_list(), tf.int64)
    indices = _gather_on(ctx, dy.indices, 0)
    if dim == 0:
        values = _gather_on(ctx, dy.values, 0)
        rows = local_shape[0]
        local = indices - tf.cast(ctx.index * rows, indices.dtype)
        held = (indices >= 0) & (local >= 0) & (local < rows)
        mask = tf.reshape(tf.cast(held, values.dtype), [-1] + [1] * (values.shape.rank - 1))
        return tf.IndexedSlices(values * mask, tf.where(held, local, -tf.ones_like(local)),
                                dense_shape)
    received = _exchange(ctx, dy.values, dim)  # [M, n, ..., d / M, ...]
    values = tf.concat(tf.unstack(received, num=ctx.size), axis=0)
    return tf.IndexedSlices(values, indices, dense_shape)


def _outside_loops(what):
    """Raises, naming the layer, where a Keras call traces collective `what` inside a
    `while_loop` (TF cannot differentiate it): the strategy's `check_collective`."""
    mesh_runtime = runtime.current_runtime()
    if mesh_runtime is not None:
        mesh_runtime.check_collective(what)


def _gather_on(ctx, x, dim):
    _outside_loops("all_gather")
    dim = dim % x.shape.rank
    stacked = ctx.backend.all_gather(x[tf.newaxis], ctx.replica, ctx.group)
    return tf.concat(tf.unstack(stacked, num=ctx.size), axis=dim)


def reduce_scatter(x, axis: Optional[str], dim: int = 0):
    """Sums `x` over `axis`, each device keeping its own slice of `dim`.

    Device `j` along the axis receives part `j` of `axis_size` equal parts of
    dimension `dim` of the sum.
    """
    ctx = axis_context(axis)
    if ctx is None:
        return x
    return _reduce_scatter(ctx, x, dim)


def reduce_scatter_partial_sums(compute, tensors, axis: Optional[str], dim: int = 0):
    """`reduce_scatter(compute(*tensors), axis, dim)`, the partial sums kept in float32.

    `compute` contracts a dimension split over `axis` (a row-parallel matmul).
    One device contracts all of it in float32 and rounds a bfloat16 (or
    float16) result once; rounding each device's partial sum before the sum
    rounds twice, which Adam turned into weights 4.4e-2 (relative L2) from one
    device's after 10 steps on an AVX2 CPU where one device reordering its
    rows moved them 1.5e-3. So half-precision inputs are contracted in float32
    and the sum rounded once, like one device.
    """
    ctx = axis_context(axis)
    half = {tf.bfloat16, tf.float16}
    dtype = tensors[0].dtype
    if ctx is None or dtype not in half:
        return reduce_scatter(compute(*tensors), axis, dim)
    wide = [tf.cast(t, tf.float32) if t.dtype in half else t for t in tensors]
    return tf.cast(_reduce_scatter(ctx, compute(*wide), dim), dtype)


def _reduce_scatter(ctx, x, dim):
    @tf.custom_gradient
    def op(x):
        def grad(dy):
            return _all_gather(ctx, dy, dim)

        received = _exchange(ctx, x, dim)  # [M, ..., n / M, ...] part j from peer j
        return tf.reduce_sum(received, axis=0), grad

    return op(x)


def _exchange(ctx, x, split_dim, shape_varies=False):
    """Sends part j of `x` (split on `split_dim`) to peer j; stacks what arrives."""
    _outside_loops("all_to_all")
    split_dim = split_dim % x.shape.rank
    n = x.shape[split_dim]
    if n is not None and n % ctx.size:  # unknown until run time: tf.split checks it then
        raise ValueError(
            f"Dimension {split_dim} of size {n} does not divide by the "
            f"{ctx.size} devices of the mesh axis."
        )
    parts = tf.stack(tf.split(x, ctx.size, axis=split_dim), axis=0)
    return ctx.backend.all_to_all(parts, ctx.replica, ctx.group, shape_varies=shape_varies)


def all_to_all(x, axis: Optional[str], split_dim: int, concat_dim: int,
               shape_varies: bool = False):
    """Splits `split_dim` over the devices of `axis` and concatenates on `concat_dim`.

    Device `j` receives part `j` of every peer's `split_dim`, concatenated in
    axis order along `concat_dim`. `shape_varies`: `x`'s shape may change
    from one execution to the next while the step's inputs keep theirs (a
    dropless MoE's buffers); the call and its gradient pair up by their own
    run-time shapes (every device of the axis passes the same shape).
    """
    ctx = axis_context(axis)
    if ctx is None:
        return x
    return _all_to_all(ctx, x, split_dim, concat_dim, shape_varies)


def _all_to_all(ctx, x, split_dim, concat_dim, shape_varies=False):
    @tf.custom_gradient
    def op(x):
        def grad(dy):
            return _all_to_all(ctx, dy, concat_dim, split_dim, shape_varies)

        received = _exchange(ctx, x, split_dim, shape_varies)
        return tf.concat(tf.unstack(received, num=ctx.size), axis=concat_dim), grad

    return op(x)


def ppermute(x, axis: Optional[str], source):
    """`x` of the device at coordinate `source[i]` along `axis`, at coordinate `i`.

    `source`: a permutation of `range(axis_size(axis))`, the same on every
    device. Each device sends its `x` to the one device that takes it (a
    pair swap costs one send each way on every backend; see
    `tfdist.comm.Backend.permute`). The gradient runs the inverse permutation.
    """
    ctx = axis_context(axis)
    if ctx is None:
        return x
    return _ppermute(ctx, x, tuple(source))


def _ppermute(ctx, x, source):
    _outside_loops("ppermute")
    inverse = tuple(source.index(k) for k in range(len(source)))

    @tf.custom_gradient
    def op(x):
        def grad(dy):
            return _ppermute(ctx, dy, inverse)

        return ctx.backend.permute(x, ctx.replica, ctx.group, source), grad

    return op(x)


def sum_over_replicas(x):
    """Sum of `x` over every replica of the strategy in scope (no gradient).

    Under a tfdist mesh: a `psum` over all its axes; under another
    multi-replica strategy (MirroredStrategy, MultiWorkerMirroredStrategy):
    its replica context's all-reduce; elsewhere `x`. For normalisers such as
    a global token count, so a loss is the same under every strategy.
    """
    x = tf.stop_gradient(x)
    if runtime.current_runtime() is not None:
        for axis in current_mesh().shape.names:
            x = psum(x, axis)
        return x
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return x
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, x)
