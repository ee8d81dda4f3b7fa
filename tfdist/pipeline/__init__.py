"""Pipeline parallelism: the stage axis, schedules as data, and a Keras model that runs them.

- `tfdist.pipeline.schedule`: GPipe, 1F1B, interleaved 1F1B as per-device
  action lists, checked and simulated (pure Python; the vocabulary p, m, v, F,
  B, stash, bubble);
- `tfdist.pipeline.layout`: `PipelinePlan`, the `layers:stage` layout checked
  (pure Python);
- `tfdist.pipeline.engine`: `PipelineExecutor`, a schedule run as one TF graph;
- `tfdist.pipeline.model`: `Pipeline`, the Keras model (`compile` / `fit`).

`Pipeline` and `PipelineExecutor` import TensorFlow when first used; the rest
of this package does not. See docs/pipeline.md.
"""

from tfdist.pipeline.layout import PipelinePlan
from tfdist.pipeline.schedule import (
    KINDS,
    SCHEDULE_NAMES,
    Action,
    Event,
    Schedule,
    ScheduleDeadlock,
    Simulation,
    analytic_bubble,
    check,
    gpipe,
    interleaved_one_f_one_b,
    make_schedule,
    one_f_one_b,
    render,
    simulate,
)

__all__ = [
    "KINDS",
    "Pipeline",
    "PipelineExecutor",
    "PipelinePlan",
    "SCHEDULE_NAMES",
    "Action",
    "Event",
    "Schedule",
    "ScheduleDeadlock",
    "Simulation",
    "analytic_bubble",
    "check",
    "gpipe",
    "interleaved_one_f_one_b",
    "make_schedule",
    "one_f_one_b",
    "render",
    "simulate",
]


def __getattr__(name):
    if name == "Pipeline":
        from tfdist.pipeline.model import Pipeline

        return Pipeline
    if name == "PipelineExecutor":
        from tfdist.pipeline.engine import PipelineExecutor

        return PipelineExecutor
    raise AttributeError(f"module 'tfdist.pipeline' has no attribute {name!r}")
