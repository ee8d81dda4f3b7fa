"""The communication-backend interface every tfdist strategy talks through.

A backend moves tensors among the devices of one mesh. Every call names the
calling replica by its *mesh device index* and the group of mesh device
indices taking part (in axis order); every device of the group makes the
same call in the same order. Two implementations sit side by side in this
package:

- `TFCollectiveBackend` (`tf_collectives.py`): TensorFlow's V2 collective ops
  among the devices of one process or of a single-controller cluster (ring
  over gRPC between tasks, NCCL on GPUs).
- `HorovodBackend` (`horovod.py`): Horovod collectives among ranks, one mesh
  device per rank, over process sets registered at `hvd.init`.

Adding a collective means adding a method here and to both implementations.
Layers never call a backend directly: they call the named-axis collectives of
`tfdist.collectives`, which find the backend of the ambient mesh
(`tfdist.runtime.current_runtime()`); the strategies call `batch_all_reduce`
for gradients.
"""

from typing import List, Protocol, Sequence, Tuple, runtime_checkable

Group = Tuple[int, ...]
"""Mesh device indices taking part in one collective, in axis order."""


@runtime_checkable
class Backend(Protocol):
    """Collectives among the devices of a mesh.

    Shapes: `x` is the calling device's tensor; `n = len(group)`.
    """

    def all_reduce(self, x, replica: int, group: Group, merge_op: str = "Add"):
        """`merge_op` ("Add", "Max", "Min") of `x` over `group`; same shape as `x`."""

    def all_gather(self, x, replica: int, group: Group):
        """`[n * d0, ...]`: `x` of every device of `group` concatenated on dimension 0."""

    def all_to_all(self, x, replica: int, group: Group, shape_varies: bool = False):
        """Splits dimension 0 of `x` into `n` parts; part `j` goes to the `j`-th device.

        `shape_varies`: `x`'s shape may change between executions of a step
        whose inputs keep theirs (a dropless MoE's expert buffers, sized by
        the busiest expert): the call must pair up by its own run-time shape.
        """

    def permute(self, x, replica: int, group: Group, source: Sequence[int]):
        """`x` of device `group[source[k]]`, received by device `group[k]`.

        `source` is a permutation of `range(n)` (positions in `group`); every
        device of `group` passes a tensor of the same shape and dtype. Each
        device sends its `x` to the one device that takes it and nothing else
        (where the backend can: see the implementations).
        """

    def batch_all_reduce(self, tensors: Sequence, replica: int, group: Group) -> List:
        """Sums of every tensor of `tensors` over `group`, fused into few collectives.

        Every device of `group` passes tensors of the same shapes and dtypes in
        the same order. This is the data-parallel gradient path: the backend
        packs the tensors into buckets (tensor fusion) so that a model with
        many small weights costs a few large transfers.
        """

    def step_shapes(self, tensors):
        """A context in which the collectives of one traced step are traced.

        `tensors` are the step's inputs (every local replica's). Collectives
        whose shapes are known only at run time must still pair up right at
        every step, whatever shapes the inputs have: a backend whose instances
        fix their shape (TF's) keys them by the inputs' run-time shapes.
        """


def check_permutation(source: Sequence[int], n: int) -> Tuple[int, ...]:
    """`source` as a tuple if it is a permutation of `range(n)`, else one clear error."""
    source = tuple(int(s) for s in source)
    if sorted(source) != list(range(n)):
        raise ValueError(
            f"permute needs a permutation of the {n} positions of the group "
            f"(range({n}) in some order); got source={list(source)}.")
    return source


def is_involution(source: Sequence[int]) -> bool:
    """Whether `source` only swaps pairs (and fixes the rest): applied twice, the identity."""
    return all(source[source[k]] == k for k in range(len(source)))


def in_supported_dtype(x, collective):
    """`collective(x)`; bfloat16, which neither TF's collective ops nor Horovod take, as float32.

    Exact for gathers and all-to-all; a sum is accumulated in float32 and
    rounded once (one device, which sums nothing across devices, rounds each
    partial product instead: within bfloat16's precision either way).
    """
    import tensorflow as tf

    x = tf.convert_to_tensor(x)
    if x.dtype != tf.bfloat16:
        return collective(x)
    return tf.cast(collective(tf.cast(x, tf.float32)), tf.bfloat16)
