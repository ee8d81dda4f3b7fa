"""How a sequence is split over a mesh axis (the logical axis `length`).

Contiguous: device `r` of `P` holds tokens `[r L/P, (r+1) L/P)`. Balanced
(zig-zag, for causal attention): the sequence is cut into `2P` equal chunks
and device `r` holds chunks `r` and `2P-1-r`, so that every device has as many
visible (query, key) pairs under a causal mask and none idles on the masked
triangle (the zig-zag ordering of Megatron-Core's context parallelism and
nnScaler's ring attention).

    L = 8, P = 2, contiguous:  device 0: 0 1 2 3    device 1: 4 5 6 7
    L = 8, P = 2, balanced:    device 0: 0 1 6 7    device 1: 2 3 4 5

Positions stay global: a layer that needs them (sinusoidal, learned, RoPE)
asks `local_positions`. Everything here is static: a replica's coordinate on
the axis is known when its step is traced.
"""

import dataclasses
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from tfdist import collectives


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """A sequence of `length` tokens split over `parts` devices.

    Args:
        length: tokens in the whole sequence.
        parts: devices along the sequence's mesh axis.
        balanced: zig-zag chunks (two per device) instead of one contiguous block.

    Example:

    ```python
    split = SequenceSplit(length=8, parts=2, balanced=True)
    split.chunks(0)       # (0, 3): chunks of length 2
    split.positions(0)    # array([0, 1, 6, 7])
    ```
    """

    length: int
    parts: int
    balanced: bool = False

    def __post_init__(self):
        if self.parts < 1:
            raise ValueError(f"A sequence split needs at least one part; got parts={self.parts}.")
        pieces = self.num_chunks
        if self.length <= 0 or self.length % pieces:
            how = f"2 x {self.parts} zig-zag chunks" if self.balanced else f"{self.parts} devices"
            raise ValueError(
                f"A sequence of length {self.length} does not split into {how}: the length "
                f"must be a positive multiple of {pieces} (pad it, e.g. to "
                f"{-(-max(self.length, 1) // pieces) * pieces}).")

    @property
    def num_chunks(self) -> int:
        return 2 * self.parts if self.balanced else self.parts

    @property
    def chunk(self) -> int:
        """Tokens per chunk."""
        return self.length // self.num_chunks

    def chunks(self, index: int) -> Tuple[int, ...]:
        """Global chunk ids held by device `index`, in the order it holds them."""
        if not 0 <= index < self.parts:
            raise ValueError(f"Device index {index} is not in range({self.parts}).")
        if self.balanced:
            return (index, 2 * self.parts - 1 - index)
        return (index,)

    def positions(self, index: int) -> np.ndarray:
        """`[length / parts]` global positions of device `index`'s tokens."""
        return np.concatenate([np.arange(c * self.chunk, (c + 1) * self.chunk)
                               for c in self.chunks(index)])

    def order(self) -> np.ndarray:
        """`[length]` global positions of every device's tokens, device after device."""
        return np.concatenate([self.positions(r) for r in range(self.parts)])


def axis_split(length: int, axis: Optional[str], balanced: bool = False) -> SequenceSplit:
    """The split of a `length`-token sequence over mesh axis `axis` for this replica."""
    return SequenceSplit(length, collectives.axis_size(axis), balanced)


def local_tokens(x, axis: Optional[str], dim: int = 1, balanced: bool = False):
    """The calling device's tokens of `x`, whose dimension `dim` is the whole sequence.

    Outside a mesh (or where `axis` has size 1) `x` itself. For inputs every
    device of the axis receives whole (token ids, targets, masks).
    """
    if collectives.axis_size(axis) == 1:
        return x
    split = axis_split(int(x.shape[dim]), axis, balanced)
    index = collectives.axis_index(axis)
    dim = dim % x.shape.rank

    def take(c):
        begin = [0] * x.shape.rank
        size = [-1] * x.shape.rank
        begin[dim], size[dim] = c * split.chunk, split.chunk
        return tf.slice(x, begin, size)

    return tf.concat([take(c) for c in split.chunks(index)], axis=dim)


def global_tokens(x, axis: Optional[str], dim: int = 1, balanced: bool = False):
    """The whole sequence, in order, from every device's tokens `x` along `dim`.

    The inverse of `local_tokens` (an all-gather; its gradient a reduce-scatter).
    """
    parts = collectives.axis_size(axis)
    if parts == 1:
        return x
    gathered = collectives.all_gather(x, axis, dim=dim)
    split = SequenceSplit(int(gathered.shape[dim]), parts, balanced)
    if not balanced:
        return gathered
    return tf.gather(gathered, np.argsort(split.order()), axis=dim)


def sequence_axis(mesh) -> Optional[str]:
    """The mesh axis `mesh`'s layout puts `length` on (None if none or of size 1)."""
    axis = mesh.mesh_axis("length")
    return axis if axis is not None and mesh.axis_size(axis) > 1 else None


def length_axis() -> Optional[str]:
    """The mesh axis the ambient mesh's layout puts `length` on, if the replica is split on it
    (None outside a replica: Keras building the model sees whole local shapes)."""
    axis = sequence_axis(collectives.current_mesh())
    return axis if collectives.axis_size(axis) > 1 else None


def token_positions(local_length: int):
    """`[local_length]` int32 global positions of this replica's tokens.

    Under a mesh whose layout splits `length` (zig-zag, as `split_sequences`
    hands the tokens out): the positions of this device's chunks; elsewhere
    `0 .. local_length - 1`. For position embeddings, sinusoids and RoPE.
    """
    axis = length_axis()
    if axis is None:
        return tf.range(local_length, dtype=tf.int32)
    return local_positions(int(local_length) * collectives.axis_size(axis), axis, balanced=True)


def local_positions(length: int, axis: Optional[str], balanced: bool = False):
    """`[length / P]` int32 global positions of this device's tokens."""
    split = axis_split(length, axis, balanced)
    return tf.constant(split.positions(collectives.axis_index(axis)), tf.int32)
