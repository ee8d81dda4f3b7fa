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
- **What**: every weight, the optimizer's variables, the random-generator
  states (`rng/<k>`), so that a resumed run draws the same dropout masks, and
  a strategy's own state (`strategy/...`, `StrategyState`: model averaging's
  counters and replica copies).
- **Names**: a run directory holds `model.npz` (the final weights) and
  `backup/epoch-<n>.npz` (`Backups`: after epoch n, or
  `epoch-<n>-batch-<b>.npz` after b batches of epoch n; newest kept);
  `latest(model_dir)` finds the newest of them.
- **Formats** sit behind `Format`. `NPZ` is the global format, for small
  models: every process gathers, the chief writes one file. `SHARDED`
  (`tfdist.sharded_checkpoint`) is for models bigger than one host: each
  process writes only the shards it holds, nothing is gathered, and loading
  reads only each device's slice, onto any mesh or a plain Keras model.

Example:

```python
save(model, "run/model.npz")                # on a 2x2 mesh, any strategy
load(plain_keras_model, "run/model.npz")    # or onto another mesh
```
"""

import os
import tempfile
from typing import Dict, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from tfdist import runtime
from tfdist.sharded_checkpoint import SHARDED, ShardedFormat

_OPTIMIZER = "optimizer/"
_RNG = "rng/"
_STRATEGY = "strategy/"
FINAL = "model"
BACKUP_DIR = "backup"
BACKUP_PREFIX = "epoch-"
_BATCH = "-batch-"


@runtime_checkable
class StrategyState(Protocol):
    """A strategy with training state of its own (model averaging: counters, copies)."""

    def checkpoint_state(self) -> Dict[str, np.ndarray]:
        """Its state as arrays (every process calls it)."""

    def restore_checkpoint_state(self, arrays: Dict[str, np.ndarray]) -> None:
        """Restores what `checkpoint_state` returned."""


class Format(Protocol):
    """How a checkpoint's `{path: array}` mapping is stored.

    `NpzFormat` stores gathered global arrays (`write`, `read`);
    `ShardedFormat` writes and reads per-device slices itself (`save`, `load`)
    and offers the global arrays on demand (`read`, `tensors`).
    """

    suffix: str

    def read(self, path: str) -> Dict[str, np.ndarray]:
        """Reads every global array of the checkpoint at `path`."""

    def is_complete(self, path: str) -> bool:
        """Whether `path` holds a complete checkpoint (an interrupted save never does)."""

    def delete(self, path: str) -> None:
        """Removes the checkpoint at `path`."""


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

    def is_complete(self, path):
        return os.path.isfile(path)  # written atomically

    def delete(self, path):
        os.unlink(path)


NPZ = NpzFormat()
FORMATS = {"npz": NPZ, "sharded": SHARDED}
"""`--checkpoint_format` values of the scripts."""


def format_of(path: str) -> Format:
    """The format a checkpoint path names by its suffix (`.shards`: sharded, else npz)."""
    return SHARDED if path.rstrip("/").endswith(SHARDED.suffix) else NPZ


def format_named(name: str) -> Format:
    """The format called `name` ("npz" or "sharded"); a clear error otherwise."""
    if name not in FORMATS:
        raise ValueError(f"Unknown checkpoint format {name!r}; expected one of {sorted(FORMATS)}.")
    return FORMATS[name]


def _seed_states(model):
    """The model's random-generator states (Keras `SeedGenerator`s: dropout, noise...).

    Keras names them `seed_generator_<k>` by a process-wide counter, so they are
    keyed by their order in the model instead (the same for the same architecture).
    """
    weights = {id(v) for v in model.weights}
    states = [v for v in getattr(model, "variables", ())
              if id(v) not in weights and v.path.endswith("seed_generator_state")]
    return {f"{_RNG}{k}": v for k, v in enumerate(states)}


def _named_variables(model, with_optimizer: bool):
    named = {v.path: v for v in model.weights}
    named.update(_seed_states(model))
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
    arrays = {name: np.asarray(v.numpy())
              for name, v in _named_variables(model, with_optimizer).items()}
    arrays.update(_strategy_arrays(model, with_optimizer))
    return arrays


def _strategy_arrays(model, with_optimizer: bool) -> dict:
    """`{"strategy/<k>": array}` of a strategy with state of its own (`StrategyState`)."""
    strategy = getattr(model, "distribute_strategy", None)
    if not (with_optimizer and isinstance(strategy, StrategyState)):
        return {}
    return {_STRATEGY + k: np.asarray(v) for k, v in strategy.checkpoint_state().items()}


def save(model, path: str, with_optimizer: bool = True, fmt: Optional[Format] = None) -> bool:
    """Saves `model`'s global weights (and optimizer state): every process gathers, the chief writes.

    Call it on every process of a job (it may be a collective).

    Args:
        model: a built Keras model.
        path: the file to write (atomically).
        with_optimizer: also save the optimizer's variables (slots, iterations).
        fmt: the storage format (default: by the suffix of `path`, `format_of`).
            `SHARDED` writes each process's own shards and gathers nothing.

    Returns:
        Whether this process wrote the file.
    """
    fmt = fmt or format_of(path)
    if isinstance(fmt, ShardedFormat):
        return fmt.save(_named_variables(model, with_optimizer),
                        _strategy_arrays(model, with_optimizer), path,
                        getattr(model, "distribute_strategy", None))
    arrays = global_arrays(model, with_optimizer)
    if not runtime.is_chief(model.distribute_strategy):
        return False
    fmt.write(arrays, path)
    return True


def load(model, path: str, with_optimizer: bool = True, fmt: Optional[Format] = None) -> None:
    """Assigns every weight (and optimizer variable) of `model` from `path`.

    Build the optimizer first (`model.optimizer.build(model.trainable_variables)`)
    to restore its state.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: a variable is missing from the file, or has another shape;
            the message lists the names.
    """
    fmt = fmt or format_of(path)
    if not fmt.is_complete(path):
        raise FileNotFoundError(f"No checkpoint at {path!r}.")
    sharded = isinstance(fmt, ShardedFormat)
    stored = fmt.tensors(path) if sharded else fmt.read(path)
    named = _named_variables(model, with_optimizer)
    if not any(name.startswith(_RNG) for name in stored):
        # Weights saved without random-generator states (a plain model, an older
        # file): the generators keep their current state.
        named = {n: v for n, v in named.items() if not n.startswith(_RNG)}
    missing = sorted(set(named) - set(stored))
    if missing:
        raise ValueError(
            f"Checkpoint {path!r} has no tensors for {missing}; it holds "
            f"{sorted(stored)}. Layer names must match the saved model's."
        )
    wrong = [
        f"{name}: model {tuple(v.shape)} vs checkpoint {stored[name].shape}"
        for name, v in named.items()
        if tuple(v.shape) != _shape(stored, name)
    ]
    if wrong:
        raise ValueError(f"Checkpoint {path!r} has other shapes: {wrong}.")
    strategy = getattr(model, "distribute_strategy", None)
    if sharded:
        fmt.load(named, path, strategy)
    else:
        for name, v in named.items():
            v.assign(stored[name])
    if with_optimizer and isinstance(strategy, StrategyState):
        strategy.restore_checkpoint_state(
            {k[len(_STRATEGY):]: stored[k] for k in stored if k.startswith(_STRATEGY)})


def _shape(stored, name):
    return stored.shape(name) if hasattr(stored, "shape") else stored[name].shape


class Backups:
    """The backups of a run, each complete or absent.

    `directory/epoch-<n><suffix>` holds the state after epoch `n` (0-based);
    `directory/epoch-<n>-batch-<b><suffix>` the state after `b` batches of
    epoch `n`. A backup's *position* is where training resumes from it:
    `(n + 1, 0)` and `(n, b)`.

    Args:
        directory: where the backups live.
        fmt: their format.
    """

    def __init__(self, directory: str, fmt: Format = NPZ):
        self.directory = directory
        self.fmt = fmt

    def path(self, epoch: int, batch: Optional[int] = None) -> str:
        """The backup after epoch `epoch`, or after `batch` batches of it."""
        stem = f"{BACKUP_PREFIX}{epoch}" + ("" if batch is None else f"{_BATCH}{batch}")
        return os.path.join(self.directory, stem + self.fmt.suffix)

    def positions(self) -> Dict[Tuple[int, int], str]:
        """`{(epoch, batches done in it): path}` to resume from, of every complete backup."""
        if not os.path.isdir(self.directory):
            return {}
        found = {}
        for name in os.listdir(self.directory):
            if not (name.startswith(BACKUP_PREFIX) and name.endswith(self.fmt.suffix)):
                continue
            epoch, _, batch = name[len(BACKUP_PREFIX):-len(self.fmt.suffix)].partition(_BATCH)
            if not self.fmt.is_complete(os.path.join(self.directory, name)):
                continue
            if epoch.isdigit() and (batch.isdigit() or (not batch and _BATCH not in name)):
                position = (int(epoch), int(batch)) if batch else (int(epoch) + 1, 0)
                found[position] = os.path.join(self.directory, name)
        return found

    def latest(self) -> Optional[Tuple[int, int]]:
        """The newest backup's position `(epoch, batches done in it)`, or None."""
        return max(self.positions(), default=None)

    def epochs(self) -> Dict[int, str]:
        """`{epoch: path}` of the backups taken at the end of an epoch."""
        return {epoch - 1: path for (epoch, batch), path in self.positions().items()
                if batch == 0}

    def latest_epoch(self) -> int:
        """The newest completed epoch (0-based) with a backup, or -1 if there is none."""
        return max(self.epochs(), default=-1)

    def save(self, model, epoch: int, batch: Optional[int] = None) -> None:
        """Saves after `epoch` (or `batch` batches of it): every process gathers, the chief writes.

        Then drops the older backups; the newer file is complete before they
        go, so a kill at any moment leaves a loadable backup.
        """
        path = self.path(epoch, batch)
        if save(model, path, fmt=self.fmt):
            for old in self.positions().values():
                if old != path:
                    self.fmt.delete(old)

    def delete_all(self, strategy=None) -> None:
        """Removes every backup (on the chief)."""
        if runtime.is_chief(strategy):
            for path in self.positions().values():
                self.fmt.delete(path)


def final_path(model_dir: str, fmt: Format = NPZ) -> str:
    """Where a run in `model_dir` keeps its final weights."""
    return os.path.join(model_dir, FINAL + fmt.suffix)


def latest(model_dir: str, fmt: Optional[Format] = None) -> Optional[str]:
    """The final checkpoint of `model_dir`, else its newest backup, else None.

    Without `fmt`, in any format (a final checkpoint first, then the newest backup).
    """
    formats = [fmt] if fmt is not None else list(FORMATS.values())
    for f in formats:
        if f.is_complete(final_path(model_dir, f)):
            return final_path(model_dir, f)
    found = {}
    for f in formats:
        backups = Backups(os.path.join(model_dir, BACKUP_DIR), f)
        found.update(backups.positions())
    return found[max(found)] if found else None

