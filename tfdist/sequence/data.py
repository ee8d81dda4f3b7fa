"""Batches for a mesh whose layout splits `length`: every device gets its tokens.

A tfdist strategy hands each replica its own rows of a global batch (the
rows split over every device, in mesh device order). With `length` on mesh
axis `seq` of size P, the devices that differ only along `seq` must instead
hold the *same* rows and different tokens. `split_sequences` rewrites each
global batch so that the strategy's ordinary row split does exactly that:

    x [B, L] --(zig-zag tokens)--> rows of R = devices / P row groups
      device (rows r, seq s) <- x[r B/R : (r+1) B/R, tokens of s]   [B/R, L/P]
    as one tensor [B P, L / P] whose i-th block of B/R rows is device i's

Every tensor of rank >= 2 of a batch is split on dimension 1 (ids, targets,
per-token sample weights); a rank-1 tensor (a per-row value) is repeated for
the P devices of the row group. Keras's losses then see matching local
`y_true` / `y_pred` on every device, and their means over equal token counts
add up to one device's mean over the global batch.

`merge_sequences` turns what `predict` returns (every device's local rows,
concatenated in device order) back into `[B, L, ...]`; `SplitRunner` runs a
per-token function (an encoder) on every device's share and merges its outputs.
"""

import numpy as np
import tensorflow as tf

from tfdist.sequence.split import SequenceSplit, sequence_axis


def _placement(mesh, axis: str):
    """Per mesh device: (row group, coordinate on `axis`); and the row-group count.

    The groups along `axis` are the row groups, in row-major order of the other axes."""
    groups = mesh.shape.groups([axis])
    placement = [None] * mesh.shape.size
    for row, group in enumerate(groups):
        for s, device in enumerate(group):
            placement[device] = (row, s)
    return placement, len(groups)


def split_sequences(dataset: tf.data.Dataset, mesh) -> tf.data.Dataset:
    """`dataset` of global batches rewritten for `mesh`'s sequence split (see module doc).

    Args:
        dataset: batches whose tensors are `[B, L, ...]` (or `[B]`); `B` a
            multiple of the row groups (devices / P), `L` of `2 P`.
        mesh: a `tfdist.mesh.Mesh` (e.g. `strategy.mesh`) whose layout maps
            `length`; without one the dataset is returned unchanged.
    """
    axis = sequence_axis(mesh)
    if axis is None:
        return dataset
    parts = mesh.axis_size(axis)
    placement, groups = _placement(mesh, axis)
    # Block i of the result (device i's) is piece (row group, seq part) of placement[i].
    order = np.array([row * parts + s for row, s in placement], np.int32)

    def split(x):
        x = tf.convert_to_tensor(x)
        rows = x.shape[0]
        if rows is not None and rows % groups:
            raise ValueError(
                f"A batch of {rows} rows does not split over the {groups} row groups of "
                f"mesh {mesh.shape} (length on {axis!r}): batch sizes must be multiples of "
                f"{groups} (batch with drop_remainder=True, or pad the last batch).")
        if x.shape.rank == 1:
            pieces = tf.repeat(tf.reshape(x, [groups, 1, -1]), parts, axis=1)  # [R, P, B/R]
            return tf.reshape(tf.gather(tf.reshape(pieces, [groups * parts, -1]), order), [-1])
        length = int(x.shape[1])
        zigzag = SequenceSplit(length, parts, balanced=True).order()
        x = tf.gather(x, zigzag, axis=1)  # device 0's tokens, then device 1's, ...
        rest = tf.shape(x)[2:]
        pieces = tf.reshape(x, tf.concat([[groups, -1, parts, length // parts], rest], 0))
        perm = [0, 2, 1, 3] + list(range(4, x.shape.rank + 2))
        pieces = tf.transpose(pieces, perm)  # [R, P, B/R, L/P, ...]
        pieces = tf.reshape(pieces, tf.concat([[groups * parts, -1, length // parts], rest], 0))
        return tf.reshape(tf.gather(pieces, order), tf.concat([[-1, length // parts], rest], 0))

    return dataset.map(lambda *batch: tf.nest.map_structure(split, batch if len(batch) > 1
                                                            else batch[0]))


def merge_sequences(outputs, mesh):
    """`[B P, L / P, ...]` of every device's local tokens (in device order) -> `[B, L, ...]`."""
    axis = sequence_axis(mesh)
    outputs = np.asarray(outputs)
    if axis is None:
        return outputs
    parts = mesh.axis_size(axis)
    placement, groups = _placement(mesh, axis)
    blocks = np.split(outputs, mesh.shape.size)  # device i's [B/R, L/P, ...]
    local = outputs.shape[1]
    zigzag = SequenceSplit(local * parts, parts, balanced=True).order()
    rows = []
    for row in range(groups):
        by_part = {s: blocks[i] for i, (r, s) in enumerate(placement) if r == row}
        tokens = np.concatenate([by_part[s] for s in range(parts)], axis=1)
        whole = np.empty_like(tokens)
        whole[:, zigzag] = tokens
        rows.append(whole)
    return np.concatenate(rows, axis=0)



class SplitRunner:
    """Runs `fn` on every device's rows and tokens of a batch; merges its outputs back.

    Args:
        strategy: a tfdist mesh strategy whose layout maps `length` (`strategy.mesh`).
        fn: a replica function of the local `[B/R, L/P, ...]` inputs (a tensor or a
            tuple of them) returning tensors `[B/R, L/P, ...]`: per-token work such as
            an encoder's. Collectives over the sequence axis (ring or Ulysses
            attention) run inside it.

    Call on `[B, L, ...]` arrays (`B` a multiple of the row groups, devices / P;
    `L` of `2 P`, as for `split_sequences`): `fn`'s outputs as numpy `[B, L, ...]`
    in global token order. The step is traced once per input shape.
    """

    def __init__(self, strategy, fn):
        self.strategy, self.mesh = strategy, strategy.mesh
        self._step = tf.function(
            lambda b: strategy.run(fn, args=b if isinstance(b, tuple) else (b,)),
            reduce_retracing=True)

    def __call__(self, inputs):
        dataset = split_sequences(tf.data.Dataset.from_tensors(inputs), self.mesh)
        batch = next(iter(self.strategy.experimental_distribute_dataset(dataset)))
        return tf.nest.map_structure(self._merge, self._step(batch))

    def _merge(self, value):
        blocks = [np.asarray(v) for v in self.strategy.experimental_local_results(value)]
        gather = getattr(self.strategy, "gather_local_results", None)
        if gather is not None:  # replicas in several processes (Horovod)
            blocks = gather(blocks)
        if len(blocks) != self.mesh.shape.size:
            raise ValueError(f"SplitRunner needs every device's output; this process sees "
                             f"{len(blocks)} of mesh {self.mesh.shape}'s "
                             f"{self.mesh.shape.size}.")
        return merge_sequences(np.concatenate(blocks), self.mesh)
