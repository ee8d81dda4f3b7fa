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
    vocabulary split (an embedding table's rows on A), `vocab_split` + `held_rows`:
        ids [b, ...] -> all_gather over A -> [b*M, ...]
        look up the ids this shard holds, zero elsewhere -> [b*M, ..., d]
        -> reduce_scatter over A -> [b, ..., d]

A row layer's input exchange moves each device's `b * d_in * (M-1)/M` values
(an all-gather of the rows followed by a slice would move M times that).
Outside a mesh (or with M = 1) every collective is the identity.
"""

from typing import Callable, Optional, Sequence

import tensorflow as tf

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


def vocab_split(ids, axis: Optional[str], lookup: Callable):
    """A lookup in a table whose rows (the vocabulary) are split over `axis`.

    Args:
        ids: `[b, ...]` integer ids, this replica's rows.
        axis: the mesh axis the table's rows are split over.
        lookup: `[b*M, ...]` ids of every row of the group -> `[b*M, ..., d]`
            embeddings of the ids this device holds, zero for the others
            (`held_rows`).

    Returns:
        `[b, ..., d]`: each id's row, from the one device that holds it.
    """
    ids_all = collectives.all_gather(ids, axis, dim=0)  # [b*M, ...]
    return collectives.reduce_scatter(lookup(ids_all), axis, dim=0)  # [b, ..., d]


def held_rows(table, local, dense_gradient: bool = False):
    """Rows `local` of this device's `table` shard `[rows, d]`, zero where `local` is
    outside `[0, rows)` (an id another device holds).

    The table's gradient is over the held rows only: `IndexedSlices` (as one
    device's `tf.gather` gives; other ids become index -1, dropped before the
    optimizer), or with `dense_gradient` a dense `[rows, d]` segment sum.
    """
    table = tf.convert_to_tensor(table)  # a replica's read: its shard
    rows = table.shape[0]
    held = (local >= 0) & (local < rows)
    safe = tf.where(held, local, tf.zeros_like(local))
    mask = tf.cast(held, table.dtype)[..., tf.newaxis]

    @tf.custom_gradient
    def lookup(table):
        def grad(dy):
            values = tf.reshape(dy * mask, [-1, table.shape[-1]])
            if dense_gradient:
                return tf.math.unsorted_segment_sum(values, tf.reshape(safe, [-1]), rows)
            indices = tf.reshape(tf.where(held, local, -tf.ones_like(local)), [-1])
            return tf.IndexedSlices(values, tf.cast(indices, tf.int64),
                                    tf.constant(table.shape.as_list(), tf.int64))

        return tf.gather(table, safe) * mask, grad

    return lookup(table)
