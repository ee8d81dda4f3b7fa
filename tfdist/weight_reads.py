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
    value = tf.convert_to_tensor(shard)  # the read the tape records
    for dim, axis in enumerate(layout.mesh_axes):
        if axis in gather:
            value = collectives.all_gather(value, axis, dim=dim)
    return value
