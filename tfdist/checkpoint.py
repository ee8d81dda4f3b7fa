"""Portable global checkpoints keyed by weight path.

Keras's own `save_weights` / `model.save` already hold global tensors under a
`MeshStrategy` and load onto any mesh, but Keras keys them by layer *class*
(`layers/sharded_dense_1/vars/0`), so a plain Keras model cannot read them.
These checkpoints key every tensor by its path (`ffn1_in/kernel`,
`optimizer/ffn1_in_kernel_momentum`), so they load into any model whose
layers have the same names: a tfdist model on any mesh, or its plain Keras twin.

Writes are atomic: the file is written under a temporary name in the same
directory and renamed over the target, so an interrupted write leaves the
previous checkpoint intact.

Example:

```python
save_global(model, "run/step_100.npz")       # on a 2x2 mesh
load_global(plain_keras_model, "run/step_100.npz")
```
"""

import os
import tempfile

import numpy as np

_OPTIMIZER = "optimizer/"


def _named_variables(model, with_optimizer: bool):
    named = {v.path: v for v in model.weights}
    if with_optimizer and getattr(model, "optimizer", None) is not None:
        # Optimizer paths start with its uniquified name ("adam_3/..."): drop it.
        named.update(
            {_OPTIMIZER + v.path.split("/", 1)[-1]: v for v in model.optimizer.variables}
        )
    return named


def save_global(model, path: str, with_optimizer: bool = True) -> None:
    """Writes the global value of every weight (and optimizer variable) to `path`.

    Args:
        model: a built Keras model.
        path: the `.npz` file to write (atomically).
        with_optimizer: also save the optimizer's variables (slots, iterations).
    """
    write_arrays(global_arrays(model, with_optimizer), path)


def global_arrays(model, with_optimizer: bool = True) -> dict:
    """`{path: global numpy value}` of every weight (and optimizer variable).

    Under a `HorovodStrategy` with a mesh this all-gathers the shards: call it
    on every rank together (`BackupAndRestore` does), then write on one.
    """
    return {name: np.asarray(v.numpy()) for name, v in _named_variables(model, with_optimizer).items()}


def write_arrays(arrays: dict, path: str) -> None:
    """Writes `arrays` to the `.npz` file `path` atomically (temporary name, then rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_global(model, path: str, with_optimizer: bool = True) -> None:
    """Assigns every weight (and optimizer variable) of `model` from `path`.

    Build the optimizer first (`model.optimizer.build(model.trainable_variables)`)
    to restore its state.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: a variable is missing from the file, or has another shape;
            the message lists the names.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"No checkpoint at {path!r}.")
    with np.load(path) as data:
        stored = {name: data[name] for name in data.files}
    named = _named_variables(model, with_optimizer)
    missing = sorted(set(named) - set(stored))
    if missing:
        raise ValueError(
            f"Checkpoint {path!r} has no tensors for {missing}; it holds "
            f"{sorted(stored)}. Layer names must match the saved model's."
        )
    wrong = [
        f"{name}: model {tuple(v.shape)} vs checkpoint {stored[name].shape}"
        for name, v in named.items()
        if tuple(v.shape) != stored[name].shape
    ]
    if wrong:
        raise ValueError(f"Checkpoint {path!r} has other shapes: {wrong}.")
    for name, v in named.items():
        v.assign(stored[name])
