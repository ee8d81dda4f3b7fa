"""The one checkpoint path: file names, formats, atomic writes, who gathers and who writes.

Every tfdist checkpoint holds *global* tensors keyed by their path
(`ffn1_in/kernel`, `optimizer/ffn1_in_kernel_momentum`), so it loads into
any model whose layers have the same names: a tfdist model on any mesh, or
its plain Keras twin (Keras's own `save_weights` keys tensors by layer class,
which a plain model cannot read).

The rules, in one place:
- **Every process gathers, the chief writes.** Reading a sharded weight
  globally is a collective under `HorovodStrategy` (each rank holds its
  shard), so `save` reads on every process and only the chief
  (`tfdist.runtime.is_chief`) writes.
- **Writes are atomic**: a file is written under a temporary name in its
  directory, flushed, then renamed over the target, so an interrupted save
  leaves the previous checkpoint intact.
- **Names**: a run directory holds `model.npz` (the final weights) and
  `backup/epoch-<n>.npz` (`Backups`: one per completed epoch, newest kept);
  `latest(model_dir)` finds the newest of them.
- **Formats** sit behind `Format` (`write(arrays, path)`, `read(path)`);
  `NPZ` is the global format. A sharded format (each process writing its own
  shards) plugs in here without touching the callers.

Example:

```python
save(model, "run/model.npz")                # on a 2x2 mesh, any strategy
load(plain_keras_model, "run/model.npz")    # or onto another mesh
```
"""

import os
import tempfile
from typing import Dict, Optional, Protocol

import numpy as np

from tfdist import runtime

_OPTIMIZER = "optimizer/"
FINAL = "model"
BACKUP_DIR = "backup"
BACKUP_PREFIX = "epoch-"


class Format(Protocol):
    """How a checkpoint's `{path: array}` mapping is stored."""

    suffix: str

    def write(self, arrays: Dict[str, np.ndarray], path: str) -> None:
        """Writes `arrays` to `path` atomically."""

    def read(self, path: str) -> Dict[str, np.ndarray]:
        """Reads every array of the checkpoint at `path`."""


class NpzFormat:
    """Global tensors in one numpy `.npz` file."""

    suffix = ".npz"

    def write(self, arrays, path):
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=self.suffix)
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

    def read(self, path):
        with np.load(path) as data:
            return {name: data[name] for name in data.files}


NPZ = NpzFormat()


def _named_variables(model, with_optimizer: bool):
    named = {v.path: v for v in model.weights}
    if with_optimizer and getattr(model, "optimizer", None) is not None:
        # Optimizer paths start with its uniquified name ("adam_3/..."): drop it.
        named.update(
            {_OPTIMIZER + v.path.split("/", 1)[-1]: v for v in model.optimizer.variables}
        )
    return named


def global_arrays(model, with_optimizer: bool = True) -> dict:
    """`{path: global numpy value}` of every weight (and optimizer variable).

    Under a `HorovodStrategy` with a mesh this all-gathers the shards: every
    rank calls it together (`save` does).
    """
    return {name: np.asarray(v.numpy()) for name, v in _named_variables(model, with_optimizer).items()}


def save(model, path: str, with_optimizer: bool = True, fmt: Format = NPZ) -> bool:
    """Saves `model`'s global weights (and optimizer state): every process gathers, the chief writes.

    Call it on every process of a job (it may be a collective).

    Args:
        model: a built Keras model.
        path: the file to write (atomically).
        with_optimizer: also save the optimizer's variables (slots, iterations).
        fmt: the storage format.

    Returns:
        Whether this process wrote the file.
    """
    arrays = global_arrays(model, with_optimizer)
    if not runtime.is_chief(model.distribute_strategy):
        return False
    fmt.write(arrays, path)
    return True


def load(model, path: str, with_optimizer: bool = True, fmt: Format = NPZ) -> None:
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
    stored = fmt.read(path)
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


class Backups:
    """The per-epoch backups of a run: `directory/epoch-<n><suffix>`, complete or absent.

    Args:
        directory: where the backups live.
        fmt: their format.
    """

    def __init__(self, directory: str, fmt: Format = NPZ):
        self.directory = directory
        self.fmt = fmt

    def path(self, epoch: int) -> str:
        return os.path.join(self.directory, f"{BACKUP_PREFIX}{epoch}{self.fmt.suffix}")

    def epochs(self) -> Dict[int, str]:
        """`{epoch: path}` of the complete backups (temporary files are not backups)."""
        if not os.path.isdir(self.directory):
            return {}
        found = {}
        for name in os.listdir(self.directory):
            stem = name[len(BACKUP_PREFIX):-len(self.fmt.suffix)]
            if name.startswith(BACKUP_PREFIX) and name.endswith(self.fmt.suffix) and stem.isdigit():
                found[int(stem)] = os.path.join(self.directory, name)
        return found

    def latest_epoch(self) -> int:
        """The newest complete backup's epoch (0-based), or -1 if there is none."""
        return max(self.epochs(), default=-1)

    def save(self, model, epoch: int) -> None:
        """Saves epoch `epoch` (every process gathers, the chief writes), then drops older ones.

        The newer file is complete before the older ones go, so a kill at any
        moment leaves a loadable backup.
        """
        if save(model, self.path(epoch), fmt=self.fmt):
            for old, path in self.epochs().items():
                if old < epoch:
                    os.unlink(path)

    def delete_all(self, strategy=None) -> None:
        """Removes every backup (on the chief)."""
        if runtime.is_chief(strategy):
            for path in self.epochs().values():
                os.unlink(path)


def final_path(model_dir: str, fmt: Format = NPZ) -> str:
    """Where a run in `model_dir` keeps its final weights."""
    return os.path.join(model_dir, FINAL + fmt.suffix)


def latest(model_dir: str, fmt: Format = NPZ) -> Optional[str]:
    """The final checkpoint of `model_dir`, else its newest backup, else None."""
    if os.path.exists(final_path(model_dir, fmt)):
        return final_path(model_dir, fmt)
    backups = Backups(os.path.join(model_dir, BACKUP_DIR), fmt)
    epoch = backups.latest_epoch()
    return backups.path(epoch) if epoch >= 0 else None

