"""How far bfloat16 rounding alone moves a single-device run: the baseline mixed-precision
equivalence is measured against, in the same run.

bfloat16 rounds every partial sum, so a mesh (other summation orders) cannot
match one device bit for bit; how far the weights drift depends on the CPU's
bfloat16 kernels. `permuted_rows_drift` trains the
reference twice from the same weights, the second time with the rows inside
every batch permuted: the same mathematics (a mean over the batch), other
roundings. A mesh within a small multiple of that drift rounds no worse than
one device does.
"""

import numpy as np


def relative_l2(model, reference) -> float:
    """`||w - w_ref|| / ||w_ref||` over all weights, concatenated."""
    a = np.concatenate([np.ravel(w) for w in model.get_weights()])
    b = np.concatenate([np.ravel(w) for w in reference.get_weights()])
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _permuted_within_batches(a, batch_size, seed=1):
    rng = np.random.default_rng(seed)
    order = np.concatenate([start + rng.permutation(min(batch_size, len(a) - start))
                            for start in range(0, len(a), batch_size)])
    return a[order]


def permuted_rows_drift(build_reference, compile_model, x, y, batch_size) -> float:
    """Relative L2 between two one-device runs that differ only in row order per batch.

    Args:
        build_reference: returns the single-device model, same initial weights each call.
        compile_model: compiles a model (optimizer, loss) in place.
        x, y: arrays; trained one epoch, not shuffled, in batches of `batch_size`.
    """
    runs = []
    for permute in (False, True):
        model = build_reference()
        compile_model(model)
        xs, ys = (x, y) if not permute else (
            _permuted_within_batches(x, batch_size), _permuted_within_batches(y, batch_size))
        model.fit(xs, ys, batch_size=batch_size, shuffle=False, verbose=0)
        runs.append(model)
    return relative_l2(runs[1], runs[0])
