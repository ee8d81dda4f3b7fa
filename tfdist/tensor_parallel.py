"""Megatron's column- and row-parallel contractions over a named mesh axis.

The one implementation of both forms, used by tfdist's `ShardedDense` and by
the tensor-parallel calls of Keras's `Dense` / `EinsumDense` under a
`LayoutMap`. Each replica holds its own `b` rows; the weight is split over
mesh axis A of size M and is never gathered over it:

    column (the kernel's output dimension on A):
        x [b, ..., d_in] -> all_gather over A -> [b*M, ..., d_in]
        compute with the kernel shard -> [b*M, ..., d_out/M]
        -> all_to_all -> [b, ..., d_out]          (or kept: `output_sharded`)
    row (the kernel's contracted dimension on A):
        x [b, ..., d_in] -> all_to_all -> [b*M, ..., d_in/M]   (skipped: `input_sharded`)
        compute with the kernel shard -> [b*M, ..., d_out] partial sums
        -> reduce_scatter over A -> [b, ..., d_out]

A row layer's input exchange moves each device's `b * d_in * (M-1)/M` values
(an all-gather of the rows followed by a slice would move M times that).
Outside a mesh (or with M = 1) every collective is the identity.
"""

from typing import Callable, Optional, Sequence

from tfdist import collectives


def column(x, axis: Optional[str], compute: Callable, concat_dim: int = -1,
           output_sharded: bool = False, gather_rows: Optional[Callable] = None):
    """`compute(rows)` on every row of the axis group; its output columns are local.

    Args:
        x: `[b, ..., d_in]`, this replica's rows.
        axis: the mesh axis the kernel's output dimension is split over.
        compute: `[b*M, ..., d_in] -> [b*M, ..., d_out/M]`, with the kernel shard.
        concat_dim: the output dimension the columns are split on.
        output_sharded: return `[b*M, ..., d_out/M]` for a row layer next.
        gather_rows: gathers `x` over `axis` (default `all_gather` on dim 0);
            a block whose column layers read the same rows gathers them once.

    Returns:
        `[b, ..., d_out]`, or the local columns of every row when `output_sharded`.
    """
    rows = gather_rows(x) if gather_rows is not None else collectives.all_gather(x, axis, dim=0)
    y = compute(rows)
    if output_sharded:
        return y
    return collectives.all_to_all(y, axis, split_dim=0, concat_dim=concat_dim)


def row(x, axis: Optional[str], compute: Callable, split_dim: int = -1,
        input_sharded: bool = False, operands: Sequence = ()):
    """`compute(cols, *operands)` on this device's input columns of every row, summed.

    Args:
        x: `[b, ..., d_in]` (or, `input_sharded`, `[b*M, ..., d_in/M]` from a
            column layer's `output_sharded`).
        axis: the mesh axis the contracted dimension is split over.
        compute: `[b*M, ..., d_in/M] -> [b*M, ..., d_out]` partial sums.
        split_dim: the input dimension split over `axis`.
        operands: further tensors `compute` takes (the kernel), widened with
            the input when they are half precision: the partial sums are kept
            in float32 and rounded once, as one device rounds
            (`collectives.reduce_scatter_partial_sums`).

    Returns:
        `[b, ..., d_out]`.
    """
    if not input_sharded:
        x = collectives.all_to_all(x, axis, split_dim=split_dim, concat_dim=0)
    return collectives.reduce_scatter_partial_sums(compute, [x, *operands], axis, dim=0)
