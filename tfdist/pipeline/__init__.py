"""Pipeline parallelism: schedules as plain data (pure Python, no TensorFlow).

See `tfdist.pipeline.schedule` for the vocabulary (p, m, v, F, B, stash, bubble).
"""

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
