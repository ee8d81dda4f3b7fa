"""Enumerate the layouts tfdist can run, predict each, rank them.

A candidate is a mesh `data:N/A;model:A` (A dividing the N devices) with the
rule `batch:data` and, for A > 1, a non-empty set of the model's splittable
logical axes (`heads`, `d_ff`, `vocab`, `experts`, `classes`) on `model`.
Candidates whose weights do not divide (and may not pad) are dropped with
the reason; the rest get their bytes per device (`memory.py`), their step's
work (`workload.py`) and its predicted time under a `Calibration`:

    step = overhead(N) + f * (flops / rate(N) + update(N) * local trainable bytes)
           + sum over collectives of count * (alpha(kind, group) + beta(kind, group) * bytes)

On unequal devices (relative `speeds`) `f` is N / sum(speeds) for a pure
data-parallel layout, whose rows can follow the speeds
(`HorovodStrategy(batch_shares=...)`), and 1 / min(speeds) for the others,
whose replicas must hold equal rows (the slowest sets the pace).

A sequence candidate (`sequence_meshes`) adds a `seq` axis of P devices with
`length:seq` to a `data x model` mesh of the other N / P, and names its
attention (`sequence_method`: ring or Ulysses); or puts `length` on the model
axis that splits the heads (Megatron sequence parallelism, no method).

Those that fit `memory_per_device` are ranked by predicted step time.
"""

import dataclasses
import itertools
from typing import List, Optional, Sequence, Tuple

from tfdist.mesh import Mesh
from tfdist.planner.memory import Memory, state_bytes
from tfdist.planner.probe import Calibration
from tfdist.planner.workload import Work

MODEL_AXES = ("heads", "d_ff", "vocab", "experts", "classes")


class NoLayoutFits(ValueError):
    """No candidate layout fits the memory given per device."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One predicted layout: its `mesh`, bytes per device, work and step time."""

    mesh: Mesh
    memory: Memory
    work: Work
    step_seconds: float
    batch_shares: Optional[Tuple[float, ...]] = None
    """Rows per device proportional to their speeds (`HorovodStrategy(batch_shares=...)`),
    for a pure data-parallel layout on unequal devices; else None (equal rows)."""
    pipeline: Optional[object] = None
    """The `PipelinePlan` of a pipeline layout (`layers:stage`), else None."""
    sequence_method: Optional[str] = None
    """"ring" or "ulysses" where the mesh splits `length`, else None."""

    @property
    def flags(self) -> str:
        flags = f"--mesh_shape='{self.mesh.shape}' --layout='{self.mesh.rules}'"
        if self.pipeline is not None:
            flags += (f" --num_microbatches={self.pipeline.num_microbatches} "
                      f"--pipeline_schedule={self.pipeline.schedule_name}")
        if self.sequence_method is not None:
            flags += f" --sequence_method={self.sequence_method}"
        return flags

    @property
    def description(self) -> str:
        """The layout rules, and a pipeline's schedule and micro-batches or a split
        sequence's attention."""
        if self.pipeline is not None:
            return (f"{self.mesh.rules} ({self.pipeline.schedule_name}, "
                    f"m={self.pipeline.num_microbatches})")
        if self.sequence_method is not None:
            return f"{self.mesh.rules} ({self.sequence_method})"
        return str(self.mesh.rules)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The ranked candidates that fit (fastest first) and those that do not."""

    ranked: Tuple[Candidate, ...]
    too_big: Tuple[Candidate, ...]
    invalid: Tuple[Tuple[str, str], ...]
    memory_per_device: Optional[int]

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    def table(self) -> str:
        """The ranked table: mesh, layout, memory per device, predicted step, bytes sent."""
        rows = self.ranked + self.too_big
        wm = max([16] + [len(str(c.mesh.shape)) for c in rows])
        wl = max([44] + [len(c.description) for c in rows])
        header = (f"{'#':>2}  {'mesh':<{wm}} {'layout':<{wl}} {'state MiB':>9} "
                  f"{'total MiB':>9} {'step ms':>8} {'sent MiB':>8}")
        lines = [header, "-" * len(header)]
        for i, c in enumerate(rows, 1):
            mark = "" if i <= len(self.ranked) else "  (does not fit)"
            lines.append(f"{i:>2}  {str(c.mesh.shape):<{wm}} {c.description:<{wl}} "
                         f"{c.memory.state / 2**20:>9.2f} {c.memory.total / 2**20:>9.2f} "
                         f"{1e3 * c.step_seconds:>8.2f} {c.work.bytes_sent / 2**20:>8.2f}{mark}")
        return "\n".join(lines)


def meshes(logical_axes: Sequence[str], num_devices: int, fsdp: bool = False) -> List[Mesh]:
    """Every `data x model` mesh over `num_devices` whose rules split some of a
    model's `logical_axes` (those in `MODEL_AXES`) over `model`; with `fsdp`,
    each also with `d_model:data` (weights split over the batch axis too) where
    data > 1."""
    splittable = [a for a in MODEL_AXES if a in logical_axes]
    out = []
    for model in (a for a in range(1, num_devices + 1) if num_devices % a == 0):
        data = num_devices // model
        shape = f"data:{data};model:{model}"
        choices = [()] if model == 1 else [
            chosen for k in range(1, len(splittable) + 1)
            for chosen in itertools.combinations(splittable, k)]
        for chosen in choices:
            rules = ["batch:data"] + [f"{a}:model" for a in chosen]
            out.append(Mesh.parse(shape, ";".join(rules)))
            if fsdp and data > 1 and "d_model" in logical_axes:
                out.append(Mesh.parse(shape, ";".join(rules + ["d_model:data"])))
    return out


def sequence_meshes(logical_axes: Sequence[str], num_devices: int,
                    methods: Sequence[str] = ("ring", "ulysses")) -> List[Tuple[Mesh, str]]:
    """`(mesh, sequence_method)` for every `seq` axis of P > 1 devices dividing
    `num_devices`, over every `data x model` mesh of the other N / P (`meshes`):
    `data:D;seq:P;model:A` with `length:seq` added to the rules, once per method;
    and `(mesh, None)` for every `data x model` mesh over all N whose `model` axis
    splits the heads, with `length:model` (Megatron sequence parallelism)."""
    out = []
    for parts in (p for p in range(2, num_devices + 1) if num_devices % p == 0):
        for base in meshes(logical_axes, num_devices // parts):
            data, model = base.shape.axis_size("data"), base.shape.axis_size("model")
            mesh = Mesh.parse(f"data:{data};seq:{parts};model:{model}",
                              f"{base.rules};length:seq")
            out.extend((mesh, method) for method in methods)
    # Megatron sequence parallelism: `length` on the model axis that splits the heads (the
    # attention gathers the tokens there as it gathers rows; no ring, so no method).
    for base in meshes(logical_axes, num_devices):
        model = base.mesh_axis("heads")
        if model is not None and base.axis_size(model) > 1:
            out.append((Mesh.parse(str(base.shape), f"{base.rules};length:{model}"), None))
    return out


def speed_factor(mesh: Mesh, speeds: Optional[Sequence[float]]) -> float:
    """How much longer the compute takes on devices of relative `speeds` than on equal
    fastest ones: rows in proportion to speed where only the batch is split (every
    device busy for N / sum(speeds)), else equal rows (the slowest sets the pace)."""
    if not speeds:
        return 1.0
    relative = [s / max(speeds) for s in speeds]
    if mesh.splits_only_batch:
        return len(relative) / sum(relative)
    return 1.0 / min(relative)


def step_seconds(work: Work, devices: int, calibration: Calibration, update_bytes: int = 0,
                 compute_factor: float = 1.0) -> float:
    """The cost model (see the module docstring): `update_bytes`, the local trainable
    bytes the optimizer updates (`Memory.gradients`); `compute_factor` scales the compute
    and update terms (unequal devices: `speed_factor`)."""
    seconds = calibration.overhead_seconds(devices) + compute_factor * (
        calibration.compute_seconds(work.flops, devices) +
        calibration.update_seconds_for(update_bytes, devices))
    for c in work.collectives:
        seconds += c.count * calibration.collective_seconds(c.kind, c.group, c.bytes)
    return seconds


def rank(candidates: Sequence[Mesh], inventory_of, work_of, calibration: Calibration,
         memory_per_device: Optional[int] = None,
         speeds: Optional[Sequence[float]] = None, pipelines: Sequence = (),
         pipeline_of=None) -> Plan:
    """Predicts every candidate mesh and ranks those that fit.

    Args:
        candidates: the `Mesh`es to weigh, or `(mesh, sequence_method)` pairs
            (`sequence_meshes`).
        inventory_of: `mesh -> Inventory`, what the model stores on a mesh.
        work_of: `(mesh, inventory) -> Work`, the model's step on a mesh
            (`(mesh, inventory, sequence_method)` for a pair).
        calibration: the machine's `Calibration`.
        memory_per_device: bytes a device may hold (None: no limit).
        speeds: the devices' relative speeds (unequal devices; None: equal).
        pipelines: `PipelinePlan`s to weigh too (`tfdist.planner.pipeline`).
        pipeline_of: `plan -> (Memory of the heaviest device, Work)`.

    Raises:
        NoLayoutFits: no candidate fits; the message names the least memory
            per device that would, and its layout.
    """
    fits, too_big, invalid = [], [], []

    def weigh(mesh, memory, work, **extra):
        candidate = Candidate(mesh, memory, work,
                              step_seconds(work, mesh.size, calibration, memory.gradients,
                                           speed_factor(mesh, speeds)), **extra)
        fit = memory_per_device is None or memory.total <= memory_per_device
        (fits if fit else too_big).append(candidate)

    for mesh in candidates:
        method = None
        if isinstance(mesh, tuple):
            mesh, method = mesh
        try:
            inventory = inventory_of(mesh)
            weights, optimizer, gradients = state_bytes(inventory, mesh)
            work = work_of(mesh, inventory) if method is None else \
                work_of(mesh, inventory, method)
        except ValueError as e:
            invalid.append((str(mesh) + (f" ({method})" if method else ""), str(e)))
            continue
        shares = None
        if speeds and mesh.splits_only_batch:
            shares = tuple(s / sum(speeds) for s in speeds)
        weigh(mesh, Memory(weights, optimizer, gradients, work.activations), work,
              batch_shares=shares, sequence_method=method)
    for plan in pipelines:
        try:
            memory, work = pipeline_of(plan)
        except ValueError as e:
            invalid.append((f"{plan.mesh} ({plan.schedule_name}, m={plan.num_microbatches})",
                            str(e)))
            continue
        weigh(plan.mesh, memory, work, pipeline=plan)
    if not fits:
        if not too_big:
            reasons = "; ".join(f"{m}: {why}" for m, why in invalid[:3])
            raise NoLayoutFits(f"no layout of the model is valid on these devices: {reasons}")
        least = min(too_big, key=lambda c: c.memory.total)
        raise NoLayoutFits(
            f"no layout fits in memory_per_device={memory_per_device:,} bytes; the least any "
            f"takes is {least.memory.total:,} bytes per device ({least.mesh}"
            + (f", {least.pipeline.schedule_name} with {least.pipeline.num_microbatches} "
               f"micro-batches" if least.pipeline is not None else "") + ": weights "
            f"{least.memory.weights:,}, optimizer {least.memory.optimizer:,}, gradients "
            f"{least.memory.gradients:,}, activations {least.memory.activations:,}). Give at "
            f"least that much, more devices, or a smaller batch.")
    fits.sort(key=lambda c: c.step_seconds)
    too_big.sort(key=lambda c: c.memory.total)
    return Plan(tuple(fits), tuple(too_big), tuple(invalid), memory_per_device)
