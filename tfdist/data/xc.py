"""Extreme-classification data: a learnable synthetic task and XMC/libsvm files.

Synthetic: class `c` has the prototype `p(c)_j = sqrt(2/d) * cos(w_j * c + phi_j)`
(a deterministic function of `c`, so a million classes need no stored table);
an example is `p(c) + noise * N(0, I)` with `c` drawn from a Zipf law over
`[0, C)`, like real label frequencies.

Files: the Extreme Classification Repository format (optional header line
`num_points num_features num_labels`, then `l1,l2,... f:v f:v ...`) and plain
libsvm (`label f:v ...`). Single-label training uses each row's first label.
"""

import os
from typing import Optional, Tuple

import numpy as np


def prototypes(class_ids, d_model: int, seed: int = 0) -> np.ndarray:
    """`[n, d_model]` float32 prototypes of `class_ids`."""
    rng = np.random.default_rng(seed)
    freqs = rng.uniform(0.0, np.pi, size=d_model)
    phases = rng.uniform(0.0, 2 * np.pi, size=d_model)
    angles = np.outer(np.asarray(class_ids, dtype=np.float64), freqs) + phases
    return (np.sqrt(2.0 / d_model) * np.cos(angles)).astype("float32")


def synthetic_batch(rng, batch_size: int, num_classes: int, d_model: int,
                    zipf_a: float = 1.1, noise: float = 0.05, seed: int = 0):
    """One batch `(x [batch, d_model], y [batch])` of the synthetic task."""
    ranks = rng.zipf(zipf_a, size=batch_size * 2)
    ranks = ranks[ranks <= num_classes][:batch_size]
    while len(ranks) < batch_size:
        extra = rng.zipf(zipf_a, size=batch_size)
        ranks = np.concatenate([ranks, extra[extra <= num_classes]])[:batch_size]
    # Scatter popular classes over the id range so every shard gets some.
    classes = ((ranks - 1) * 2654435761 % num_classes).astype("int64")
    x = prototypes(classes, d_model, seed) + noise * rng.standard_normal((batch_size, d_model))
    return x.astype("float32"), classes.astype("int32")


def read_xmc(path: str, num_features: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Reads an XMC or libsvm file into dense features and first labels.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: a malformed line, named with its line number.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"No XMC/libsvm file at {path!r} (--train_file/--test_file).")
    rows, labels = [], []
    with open(path) as f:
        lines = f.read().splitlines()
    start = 0
    if lines and len(lines[0].split()) == 3 and ":" not in lines[0]:
        num_features = num_features or int(lines[0].split()[1])
        start = 1
    for number, line in enumerate(lines[start:], start=start + 1):
        if not line.strip():
            continue
        head, *pairs = line.split()
        try:
            label = int(head.split(",")[0])
            feats = {int(k): float(v) for k, v in (p.split(":") for p in pairs)}
        except ValueError as e:
            raise ValueError(f"{path}:{number}: malformed line {line[:60]!r}: {e}") from None
        rows.append(feats)
        labels.append(label)
    width = num_features or (max((max(r) for r in rows if r), default=-1) + 1)
    x = np.zeros((len(rows), width), "float32")
    for i, feats in enumerate(rows):
        for k, v in feats.items():
            if k >= width:
                raise ValueError(f"{path}: feature index {k} >= num_features {width}.")
            x[i, k] = v
    return x, np.asarray(labels, "int32")
