"""Sharded checkpoints: each process writes the shards it holds; nothing is gathered.

A sharded checkpoint is a directory. Each save adds a *generation*
`gen-<g>/`, a TensorFlow tensor bundle (`ckpt.index`, `ckpt.data-<k>-of-<n>`)
keyed like every tfdist checkpoint (`dense/kernel`, `optimizer/...`,
`rng/<k>`, `strategy/...`), in which each sharded tensor is stored as the
global slices its devices hold (TF's `SaveV2` slice specs), once per distinct
slice. The bundle's index says which global slice each data file holds.

How a save runs (`ShardedFormat.save`, on every process of the job):
1. Every process writes, for each host of its devices, one part
   (`.staging-<g>/part-<process>-<host>`) with the distinct slices owned by
   that host's devices (each distinct slice by one of the devices holding it,
   `_owned_slices`; replicated tensors by the chief). The save op runs on the host that holds
   the tensors, so a worker of a mesh over workers writes its own shards and
   the controller receives none of them.
2. After a barrier of all processes, the chief merges the parts' indices
   (`MergeV2Checkpoints`: the index is written last) and renames the staging
   directory to `gen-<g>` (atomic), then removes the older generations.
A process killed at any moment leaves the newest complete generation intact.

Loading (`ShardedFormat.load`) reads, on each device's host, only the slice
that device holds (`RestoreV2` slice specs), so it works onto any mesh, any
number of processes, and into a plain Keras model (which reads whole tensors:
TF assembles them from the stored slices). `tensors(path)` is a lazy mapping
of global tensors, read on demand, for tools.

Every process must see the same directory (a shared filesystem), as for
TF's own multi-worker checkpoints.
"""

import os
import re
import shutil
from typing import Dict, Iterator, Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

from tfdist import runtime

_GEN = "gen-"
_STAGING = ".staging-"
_BUNDLE = "ckpt"
_PARTS_KEY = "tfdist/parts/"  # every part holds one (SaveV2 refuses an empty part)


def _slice_spec(shape, slices) -> str:
    """TF's slice spec ("6 8 0,3:-") of `slices` (clipped to `shape`) of a tensor of `shape`."""
    if not shape:
        return ""
    dims = " ".join(str(n) for n in shape)
    parts = ":".join(f"{s.start},{s.stop - s.start}" for s in slices)
    return f"{dims} {parts}"


def _clip(slices, shape):
    """`slices` of a padded tensor, cut to the unpadded `shape` (None if empty)."""
    clipped = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(slices, shape))
    return None if any(s.stop <= s.start for s in clipped) else clipped


def _host_cpu(device: str) -> str:
    """The CPU of the task that holds `device` (`/job:worker/replica:0/task:1/device:CPU:0`)."""
    return tf.DeviceSpec.from_string(device).replace(device_type="CPU", device_index=0).to_string()


def _tf_variable(variable):
    """The `tf.Variable` (maybe distributed) behind a Keras variable."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def _components(variable, strategy):
    """`[(component, mesh device index or None, layout or None)]` of this process."""
    var = _tf_variable(variable)
    layout = getattr(var, "layout", None) if hasattr(var, "_tfdist_layout") else None
    values = getattr(var, "values", None)
    if values is None or not isinstance(values, (tuple, list)):
        return [(var, None, None)]
    if layout is None:
        return [(component, None, None) for component in values]
    mesh_runtime = runtime.current_runtime(strategy)
    return [(component, mesh_runtime.mesh_device_index(i), layout)
            for i, component in enumerate(values)]


def _owned_slices(layout):
    """`{device index: clipped slices}`: for each distinct slice, the one device that writes it.

    The k-th distinct slice is written by the k-th of the devices holding it
    (cyclically), so the replicas along the unsplit axes (on other hosts, in a
    mesh over workers) share the writing.
    """
    holders = {}
    for d in range(layout.mesh_shape.size):
        key = tuple((s.start, s.stop) for s in layout.shard_slices(d))
        holders.setdefault(key, []).append(d)
    return {devices[k % len(devices)]: _clip(tuple(slice(a, b) for a, b in key), layout.shape)
            for k, (key, devices) in enumerate(holders.items())}


class _Part:
    def __init__(self):
        self.names, self.specs, self.tensors = [], [], []

    def add(self, name, spec, tensor):
        self.names.append(name)
        self.specs.append(spec)
        self.tensors.append(tensor)


def _generations(path: str) -> Dict[int, str]:
    if not os.path.isdir(path):
        return {}
    found = {}
    for name in os.listdir(path):
        if name.startswith(_GEN) and name[len(_GEN):].isdigit():
            found[int(name[len(_GEN):])] = os.path.join(path, name)
    return found


def bundle_prefix(path: str) -> Optional[str]:
    """The TF bundle prefix of the newest complete generation at `path`, or None."""
    generations = _generations(path)
    if not generations:
        return None
    return os.path.join(generations[max(generations)], _BUNDLE)


class _LazyTensors(Mapping):
    """Global tensors of a sharded checkpoint, each read (assembled from its slices) on access."""

    def __init__(self, prefix: str):
        self._reader = tf.train.load_checkpoint(prefix)
        self._shapes = {k: v for k, v in self._reader.get_variable_to_shape_map().items()
                        if not k.startswith(_PARTS_KEY)}

    def __getitem__(self, name):
        if name not in self._shapes:
            raise KeyError(name)
        return self._reader.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._shapes))

    def __len__(self):
        return len(self._shapes)

    def shape(self, name) -> Tuple[int, ...]:
        return tuple(self._shapes[name])


class ShardedFormat:
    """Per-process shards in a TF tensor bundle, one generation directory per save."""

    suffix = ".shards"

    def is_complete(self, path: str) -> bool:
        return bundle_prefix(path) is not None

    def delete(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def tensors(self, path: str) -> "_LazyTensors":
        """The checkpoint's global tensors, read on demand (`{name: np.ndarray}`)."""
        prefix = bundle_prefix(path)
        if prefix is None:
            raise FileNotFoundError(f"No complete sharded checkpoint at {path!r}.")
        return _LazyTensors(prefix)

    def read(self, path: str) -> Dict[str, np.ndarray]:
        """Every global tensor (for small models and tools; a big model: `tensors`)."""
        stored = self.tensors(path)
        return {name: stored[name] for name in stored}

    # -- saving --------------------------------------------------------------

    def _parts(self, named, extra, strategy) -> Dict[str, _Part]:
        process = runtime.process_index(strategy)
        chief = runtime.is_chief(strategy)
        parts: Dict[str, _Part] = {}

        def part_for(device):
            return parts.setdefault(_host_cpu(device) if device else "", _Part())

        for name, variable in named.items():
            comps = _components(variable, strategy)
            _, _, layout = comps[0]
            if layout is None:
                if chief:
                    component = comps[0][0]
                    part_for(component.device).add(name, "", component.read_value())
                continue
            owned = _owned_slices(layout)
            for component, index, _ in comps:
                clipped = owned.get(index)
                if clipped is None:  # another device writes it, or all padding
                    continue
                with tf.device(component.device):
                    value = component.read_value()
                    if layout.is_padded:
                        value = value[tuple(slice(0, s.stop - s.start) for s in clipped)]
                part_for(component.device).add(name, _slice_spec(layout.shape, clipped), value)
        if chief:
            for name, array in extra.items():
                part_for("").add(name, "", tf.constant(array))
        if not parts:
            parts[""] = _Part()
        return {f"part-{process}-" + (re.sub(r"[^A-Za-z0-9]+", "_", host).strip("_") or "local"):
                part for host, part in parts.items()}

    def save(self, named: Dict[str, object], extra: Dict[str, np.ndarray], path: str,
             strategy) -> bool:
        """Writes this process's shards of `named` (and, on the chief, `extra`) at `path`.

        Call it on every process together. Returns whether this process
        completed the checkpoint (the chief).
        """
        generations = _generations(path)
        generation = max(generations, default=0) + 1
        staging = os.path.join(path, f"{_STAGING}{generation}")
        os.makedirs(staging, exist_ok=True)
        parts = self._parts(named, extra, strategy)
        count = runtime.process_count(strategy)
        for part_name, part in parts.items():
            part.add(f"{_PARTS_KEY}{part_name}", "", tf.constant(count, tf.int64))
            device = next((t.device for t in part.tensors if t.device), None)
            _write_part(_host_cpu(device) if device else None, os.path.join(staging, part_name),
                        part)
        runtime.barrier(strategy, "tfdist_sharded_save")
        wrote = False
        if runtime.is_chief(strategy):
            prefixes = sorted(os.path.join(staging, f[:-len(".index")])
                              for f in os.listdir(staging)
                              if f.startswith("part-") and f.endswith(".index")
                              and int(f.split("-")[1]) < count)
            tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=prefixes,
                                          destination_prefix=os.path.join(staging, _BUNDLE),
                                          delete_old_dirs=False)
            for f in os.listdir(staging):
                if not f.startswith(_BUNDLE + "."):
                    os.unlink(os.path.join(staging, f))
            _fsync_dir(staging)
            os.rename(staging, os.path.join(path, f"{_GEN}{generation}"))
            _fsync_dir(path)
            for old in generations.values():
                shutil.rmtree(old, ignore_errors=True)
            for f in os.listdir(path):
                if f.startswith(_STAGING):
                    shutil.rmtree(os.path.join(path, f), ignore_errors=True)
            wrote = True
        runtime.barrier(strategy, "tfdist_sharded_save_done")
        return wrote

    # -- loading -------------------------------------------------------------

    def load(self, named: Dict[str, object], path: str, strategy) -> None:
        """Assigns every variable of `named` from `path`, each device reading its own slice.

        A slice is read once per host and assigned to each of that host's
        devices that hold it. Names and shapes are checked first by the
        caller, through `tensors(path)`.
        """
        prefix = bundle_prefix(path)
        for name, variable in named.items():
            read = {}  # (host, slice spec): the value read there
            for component, index, layout in _components(variable, strategy):
                slices = clipped = None
                if layout is not None:
                    slices = layout.shard_slices(index)
                    clipped = _clip(slices, layout.shape)
                with tf.device(component.device or None):
                    if layout is not None and clipped is None:  # all padding
                        component.assign(tf.zeros(component.shape, component.dtype))
                        continue
                    spec = "" if layout is None else _slice_spec(layout.shape, clipped)
                    key = (_host_cpu(component.device) if component.device else "", spec)
                    if key not in read:
                        (read[key],) = tf.raw_ops.RestoreV2(
                            prefix=prefix, tensor_names=[name], shape_and_slices=[spec],
                            dtypes=[component.dtype.base_dtype])
                    value = read[key]
                    if layout is not None and layout.is_padded:
                        value = tf.pad(value, [[0, s.stop - s.start - (c.stop - c.start)]
                                               for s, c in zip(slices, clipped)])
                    component.assign(value)
            refresh = getattr(_tf_variable(variable), "refresh_kept_whole", None)
            if refresh is not None:  # ZeRO-1/2: its whole copy, from the shards just read
                refresh()


def _write_part(device, prefix, part) -> None:
    """Runs `SaveV2` for `part` on `device` and returns once the files exist.

    An eager op on a remote worker's device may still be running when it
    returns; a function's result is not ready before its stateful ops ran.
    """

    @tf.function(autograph=False)
    def write(tensors):
        with tf.device(device):
            saved = tf.raw_ops.SaveV2(prefix=prefix, tensor_names=part.names,
                                      shape_and_slices=part.specs, tensors=tensors)
            with tf.control_dependencies([saved]):  # else the function prunes it
                return tf.constant(0)

    write(list(part.tensors)).numpy()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SHARDED = ShardedFormat()
