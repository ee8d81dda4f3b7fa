"""Sequence (context) parallelism: the logical axis `length` over a mesh axis.

- `split`: which tokens a device holds (contiguous or zig-zag balanced),
  their global positions, and the inputs' local tokens.
- `ring_attention` (pass-KV) and `ulysses_attention` (head all-to-all):
  exact attention over the split sequence, causal and padded, grouped
  queries, cross-attention (queries and keys each on their own split).
- `sequence_attention(..., method=...)` picks one by name.
- `split_sequences(dataset, mesh)`: global batches rewritten so that a
  strategy's row split gives every device of a row group its own tokens
  (zig-zag); `merge_sequences` undoes it for `predict`'s outputs;
  `token_positions` gives a layer its tokens' global positions;
  `SplitRunner` runs per-token work (an encoder) on every device's share
  and merges its outputs.

Layers: `ShardedAttention(..., sequence_method="ring" | "ulysses")` attends
over the split sequence wherever the ambient mesh's layout maps `length`.

See docs/sequence.md.
"""

from typing import Optional

from tfdist.sequence.data import SplitRunner, merge_sequences, split_sequences
from tfdist.sequence.ring import ring_attention, ring_rounds
from tfdist.sequence.split import (
    SequenceSplit,
    global_tokens,
    length_axis,
    local_positions,
    local_tokens,
    sequence_axis,
    token_positions,
)
from tfdist.sequence.ulysses import ulysses_attention

METHODS = {"ring": ring_attention, "ulysses": ulysses_attention}


def sequence_attention(q, k, v, axis: Optional[str], method: str = "ring", **kwargs):
    """`ring_attention` or `ulysses_attention` (by `method`) of `q`, `k`, `v` over `axis`."""
    if method not in METHODS:
        raise ValueError(f"Unknown sequence attention method {method!r}; valid: "
                         f"{sorted(METHODS)}.")
    return METHODS[method](q, k, v, axis, **kwargs)


__all__ = ["SequenceSplit", "SplitRunner", "global_tokens", "length_axis", "local_positions",
           "local_tokens", "merge_sequences", "ring_attention", "ring_rounds",
           "sequence_attention", "sequence_axis", "split_sequences", "token_positions",
           "ulysses_attention"]
