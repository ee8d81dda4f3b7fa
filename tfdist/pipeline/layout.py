"""The stage axis in the layout language: which layers run on which devices.

Pure Python, checked before any graph exists. A mesh axis holds the pipeline
stages and the logical axis `layers` (the model's stack of layers) is split
over it, in Mesh-TensorFlow's syntax like every other axis:

    --mesh_shape='stage:2;data:2'  --layout='layers:stage;batch:data'

Stage s runs layers [s * L/p, (s+1) * L/p) on the devices whose `stage`
coordinate is s; with `batch:data` too, each of those devices runs its own
rows of every micro-batch (a pipeline per data replica; the stage's gradients
are summed over the replicas before the update, so the step is still the
one-device step of the whole batch).

With v chunks per device (interleaved 1F1B) the stack is split into p * v
virtual stages, virtual stage k on stage coordinate k % p.

Example:

>>> plan = PipelinePlan.from_mesh("stage:2;data:2", "layers:stage;batch:data",
...                               num_layers=8, num_microbatches=4)
>>> plan.layers_of(1), plan.stage_devices(1)
(range(4, 8), (1, 3))
"""

import dataclasses
from typing import Optional, Tuple

from tfdist.mesh import Mesh
from tfdist.pipeline.schedule import SCHEDULE_NAMES, Schedule, make_schedule


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """A checked pipeline layout: mesh, stage axis, layers per stage and schedule.

    Build it with `from_mesh`, which validates every argument.
    """

    mesh: Mesh
    stage_axis: str
    data_axis: Optional[str]
    num_layers: int
    num_microbatches: int
    schedule_name: str = "1f1b"
    num_chunks: int = 1

    @classmethod
    def from_mesh(cls, mesh_shape, layout, num_layers: int, num_microbatches: int,
                  schedule: str = "1f1b", num_chunks: int = 1,
                  global_batch: Optional[int] = None) -> "PipelinePlan":
        """Checks a pipeline layout and returns its plan; raises one `ValueError`
        naming the bad value and what would be valid.

        Args:
            mesh_shape, layout: as everywhere in tfdist (`Mesh.parse`); `layout`
                must map `layers` onto a mesh axis.
            num_layers: L, the length of the stack to split.
            num_microbatches: m >= 1, any number.
            schedule: one of `SCHEDULE_NAMES`.
            num_chunks: v, virtual stages per device (interleaved 1F1B only).
            global_batch: if given, checked to give every micro-batch of every
                data replica at least one row.
        """
        mesh = mesh_shape if isinstance(mesh_shape, Mesh) else Mesh.parse(mesh_shape, layout)
        stage_axis = mesh.mesh_axis("layers")
        if stage_axis is None:
            raise ValueError(f"Layout {str(mesh.rules)!r} has no rule for the logical axis "
                             f"'layers': add e.g. 'layers:stage' with a mesh axis 'stage' "
                             f"in the mesh shape (mesh: {mesh.shape}).")
        if schedule not in SCHEDULE_NAMES:
            raise ValueError(f"schedule={schedule!r}: valid schedules are {list(SCHEDULE_NAMES)}.")
        for name, value in (("num_layers", num_layers), ("num_microbatches", num_microbatches),
                            ("num_chunks", num_chunks)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1.")
        p = mesh.axis_size(stage_axis)
        if num_layers % (p * num_chunks):
            valid = [n for n in range(1, num_layers + 1) if num_layers % (n * num_chunks) == 0]
            raise ValueError(
                f"num_layers={num_layers} does not split over mesh axis {stage_axis}:{p}"
                + (f" x {num_chunks} chunks" if num_chunks > 1 else "")
                + f": give a multiple of {p * num_chunks} layers, or a {stage_axis!r} axis of "
                f"size in {valid}.")
        make_schedule(schedule, p, num_microbatches, num_chunks)  # validates the rest
        data_axis = mesh.mesh_axis("batch")
        if data_axis == stage_axis:
            raise ValueError(f"Layout {str(mesh.rules)!r} maps both 'layers' and 'batch' to "
                             f"{stage_axis!r}: the stage axis holds layers only; split the "
                             f"batch over another mesh axis.")
        others = [a for a in mesh.shape.names
                  if a not in (stage_axis, data_axis) and mesh.axis_size(a) > 1]
        if others:
            raise ValueError(
                f"Mesh {mesh.shape} has axes {others} besides the stage axis {stage_axis!r} "
                f"and the batch's axis {data_axis!r}: a pipeline composes with data "
                f"parallelism today; tensor, expert and FSDP axes inside a stage are not "
                f"supported yet (give them size 1).")
        replicas = mesh.axis_size(data_axis)
        if global_batch is not None and global_batch < replicas * num_microbatches:
            raise ValueError(
                f"global_batch={global_batch} gives fewer rows than micro-batches: "
                f"{replicas} data replica(s) x num_microbatches={num_microbatches} need at "
                f"least {replicas * num_microbatches} rows; lower num_microbatches to at most "
                f"{max(global_batch // replicas, 1)} or raise the batch.")
        return cls(mesh, stage_axis, data_axis, num_layers, num_microbatches, schedule,
                   num_chunks)

    @property
    def num_stages(self) -> int:
        """p, the size of the stage axis."""
        return self.mesh.axis_size(self.stage_axis)

    @property
    def num_replicas(self) -> int:
        """How many pipelines run side by side (the size of the batch's axis)."""
        return self.mesh.axis_size(self.data_axis)

    def layers_of(self, virtual_stage: int) -> range:
        """The indices in the stack of the layers virtual stage k runs."""
        per = self.num_layers // (self.num_stages * self.num_chunks)
        return range(virtual_stage * per, (virtual_stage + 1) * per)

    def stage_devices(self, stage: int) -> Tuple[int, ...]:
        """Mesh device indices of stage coordinate `stage`, one per data replica
        (ordered by the batch's axis)."""
        shape = self.mesh.shape
        found = [i for i in range(shape.size) if shape.coordinates(i)[self.stage_axis] == stage]
        if self.data_axis is not None:
            found.sort(key=lambda i: shape.coordinates(i)[self.data_axis])
        return tuple(found)

    def schedule(self) -> Schedule:
        return make_schedule(self.schedule_name, self.num_stages, self.num_microbatches,
                             self.num_chunks)
