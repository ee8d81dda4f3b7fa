"""Pipeline-parallel schedules as data: GPipe, 1F1B and interleaved 1F1B.

Pure Python: nothing here imports TensorFlow. A schedule is, per device, the
ordered list of actions that device runs; `check` validates it statically,
`simulate` runs it in an event-driven model of time and memory, `render` draws it.

Cheat-sheet:

    p       devices (`num_stages`); device d is pipeline rank d
    v       model chunks per device (`num_chunks`; 1 unless interleaved)
    K       p * v virtual stages; virtual stage k runs on device k % p as its
            chunk k // p (Megatron's looping placement: d, d + p, d + 2p, ...)
    m       micro-batches per step (`num_microbatches`)
    F, B    forward / backward of one micro-batch through one virtual stage
    stash   (virtual stage, micro-batch) pairs whose F ran but whose B has not:
            the activations a device holds
    bubble  idle share of the step: 1 - sum(busy) / (p * makespan)

    | schedule         | bubble fraction (uniform F, B)   | peak stash on device d        |
    |------------------|----------------------------------|-------------------------------|
    | gpipe            | (p-1) / (m+p-1)                  | m                             |
    | 1f1b             | (p-1) / (m+p-1)                  | min(p-d, m)                   |
    | interleaved_1f1b | (p-1) / (v*m+p-1)    when m >= p | min(2(p-d-1)+(v-1)g+1, v*m),  |
    |                  | 1 - v*m / (v*p+m-1)  when m < p  | g = first round size (= p     |
    |                  |                                  | when p divides m)             |

Megatron (Narayanan et al., 2021) writes the bubble as an *overhead* relative
to the ideal time, (p-1)/(v*m); the *fraction* of the whole step is
(p-1)/(v*m+p-1). Both describe the same idle time; v = 1 gives GPipe's.

Example:

```python
schedule = one_f_one_b(num_stages=4, num_microbatches=8)
check(schedule)
sim = simulate(schedule, forward_time=1.0, backward_time=2.0)
sim.bubble_fraction   # 3 / 11 == analytic_bubble("1f1b", 4, 8)
sim.peak_stashed      # (4, 3, 2, 1)
print(render(sim))
```
"""

import dataclasses
import itertools
from typing import Dict, List, Tuple, Union

KINDS = ("forward", "backward", "send_activation", "recv_activation",
         "send_gradient", "recv_gradient")
"""Action kinds. Sends are non-blocking (buffered); receives block."""

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b")

_SHORT = {"forward": "F", "backward": "B", "send_activation": "SA",
          "recv_activation": "RA", "send_gradient": "SG", "recv_gradient": "RG"}


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}.")
    return value


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of one device: a compute or a point-to-point transfer.

    Args:
        kind: one of `KINDS`.
        stage: the virtual stage it belongs to (`0 .. p*v-1`). Sends name the
            sending stage and receives the receiving one: `send_activation`
            of stage k pairs with `recv_activation` of stage k+1,
            `send_gradient` of stage k with `recv_gradient` of stage k-1.
        microbatch: the micro-batch index (`0 .. m-1`).
        chunk: `stage // p`, the model chunk of the device (0 unless interleaved).

    Example:

    >>> str(Action("forward", stage=1, microbatch=3))
    'F3@s1'
    """

    kind: str
    stage: int
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r}: valid kinds are {list(KINDS)}.")
        for name in ("stage", "microbatch", "chunk"):
            _check_int(name, getattr(self, name), 0)

    @property
    def key(self) -> Tuple[str, int, int]:
        return (self.kind, self.stage, self.microbatch)

    @property
    def is_compute(self) -> bool:
        return self.kind in ("forward", "backward")

    def __str__(self) -> str:
        return f"{_SHORT[self.kind]}{self.microbatch}@s{self.stage}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What each device of a pipeline runs during one training step, in order.

    Between devices every hand-off is explicit: a forward on virtual stage
    k > 0 is preceded on its device by `recv_activation` and, unless k is the
    last stage, followed by `send_activation`; backwards mirror this with
    gradients. Hand-offs between virtual stages on the *same* device (only when
    p == 1) are local and carry no send/receive actions.

    Args:
        name: e.g. `"1f1b"`.
        num_stages: p, the number of devices.
        num_microbatches: m.
        num_chunks: v, model chunks per device (1 unless interleaved).
        actions: one tuple of `Action`s per device, in execution order.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    actions: Tuple[Tuple[Action, ...], ...]

    def __post_init__(self):
        _check_int("num_stages", self.num_stages)
        _check_int("num_microbatches", self.num_microbatches)
        _check_int("num_chunks", self.num_chunks)
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        for d, actions in enumerate(self.actions):
            for a in actions:
                if not isinstance(a, Action):
                    raise TypeError(f"Schedule {self.name!r}, device {d}: {a!r} is not an "
                                    f"Action; write e.g. Action('forward', 0, 0).")

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    def device_of(self, stage: int) -> int:
        """The device that runs virtual stage `stage`."""
        return stage % self.num_stages


def _build(name: str, p: int, m: int, v: int, warmup) -> Schedule:
    """1F1B over rounds of micro-batches, with `warmup(d, g)` warm-up forwards.

    The m micro-batches form max(1, m // p) rounds of near-equal size (each
    >= p when m >= p; as torch's `ScheduleInterleaved1F1B`), g the first's.
    Per round, device d runs forwards on chunk 0 for the round's micro-batches,
    then chunk 1, ...; backwards visit the chunks in reverse. After the warm-up
    it alternates F and B, then drains the remaining backwards.
    """
    rounds = max(1, m // p)
    sizes = [m // rounds + (r < m % rounds) for r in range(rounds)]
    last, actions = p * v - 1, []
    for d in range(p):
        forwards, backwards = [], []
        for r, size in enumerate(sizes):
            batch = range(sum(sizes[:r]), sum(sizes[:r]) + size)
            for c in range(v):
                forwards += [("forward", c * p + d, i) for i in batch]
                backwards += [("backward", (v - 1 - c) * p + d, i) for i in batch]
        w = min(warmup(d, sizes[0]), len(forwards))
        order = forwards[:w] + [a for pair in zip(forwards[w:], backwards) for a in pair]
        order += backwards[len(forwards) - w:]
        device = []
        for kind, k, i in order:  # each compute between its receive and its send
            if kind == "forward":
                recv, send = ("recv_activation", k > 0), ("send_activation", k < last)
            else:
                recv, send = ("recv_gradient", k < last), ("send_gradient", k > 0)
            for t, needed in (recv, (kind, True), send):
                if t == kind or (needed and p > 1):
                    device.append(Action(t, k, i, k // p))
        actions.append(tuple(device))
    return Schedule(name, p, m, v, tuple(actions))


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe's fill-drain schedule: every forward, then every backward.

    Backwards run in forward order (micro-batch 0 first), as torch's
    `ScheduleGPipe`; every device stashes all m micro-batches.

    Args:
        num_stages: p, the number of devices (>= 1).
        num_microbatches: m (>= 1).

    Returns:
        A `Schedule` named `"gpipe"`.

    Example:

    >>> [str(a) for a in gpipe(2, 2).actions[1]]
    ['RA0@s1', 'F0@s1', 'RA1@s1', 'F1@s1', 'B0@s1', 'SG0@s1', 'B1@s1', 'SG1@s1']
    """
    p = _check_int("num_stages", num_stages)
    m = _check_int("num_microbatches", num_microbatches)
    return _build("gpipe", p, m, 1, lambda d, g: m)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-flush (1F1B): warm-up forwards, alternate F and B, drain.

    Device d runs min(p-d-1, m) warm-up forwards, then alternates one forward
    and one backward, then runs the remaining backwards, so at most
    min(p-d, m) micro-batches are stashed on it (DeepSpeed's
    `num_pipe_buffers`). Any m >= 1 works.

    Args:
        num_stages: p, the number of devices (>= 1).
        num_microbatches: m (>= 1).

    Returns:
        A `Schedule` named `"1f1b"`.

    Example:

    >>> [str(a) for a in one_f_one_b(2, 2).actions[0]]
    ['F0@s0', 'SA0@s0', 'F1@s0', 'SA1@s0', 'RG0@s0', 'B0@s0', 'RG1@s0', 'B1@s0']
    """
    p = _check_int("num_stages", num_stages)
    m = _check_int("num_microbatches", num_microbatches)
    return _build("1f1b", p, m, 1, lambda d, g: p - d - 1)


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int,
                            num_chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B: v model chunks per device, any m >= 1.

    Device d holds virtual stages d, d+p, ..., d+(v-1)p. Micro-batches go in
    rounds of g >= p (g = p when p divides m, Megatron's case; otherwise
    torch's even split into max(1, m // p) rounds). Device d runs
    2(p-d-1) + (v-1)g warm-up forwards (Megatron's count), then alternates F
    and B, then drains. With v = 1 this is `one_f_one_b` exactly.

    Deadlock-free for every p, m, v; the bubble is `analytic_bubble`'s.

    Args:
        num_stages: p, the number of devices (>= 1).
        num_microbatches: m (>= 1).
        num_chunks: v, model chunks per device (>= 1).

    Returns:
        A `Schedule` named `"interleaved_1f1b"` with p*v virtual stages.

    Example:

    >>> s = interleaved_one_f_one_b(2, 4, 2)
    >>> [str(a) for a in s.actions[0] if a.is_compute][:5]
    ['F0@s0', 'F1@s0', 'F0@s2', 'F1@s2', 'F2@s0']
    """
    p = _check_int("num_stages", num_stages)
    m = _check_int("num_microbatches", num_microbatches)
    v = _check_int("num_chunks", num_chunks)
    return _build("interleaved_1f1b", p, m, v,
                  lambda d, g: (p - d - 1) * (1 if v == 1 else 2) + (v - 1) * g)


def make_schedule(name: str, num_stages: int, num_microbatches: int,
                  num_chunks: int = 1) -> Schedule:
    """The schedule called `name`, one of `SCHEDULE_NAMES`.

    Example:

    >>> make_schedule("interleaved_1f1b", 4, 8, num_chunks=2).num_virtual_stages
    8
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"Unknown schedule {name!r}: valid names are {list(SCHEDULE_NAMES)}.")
    if name == "interleaved_1f1b":
        return interleaved_one_f_one_b(num_stages, num_microbatches, num_chunks)
    if num_chunks != 1:
        raise ValueError(f"num_chunks={num_chunks!r}: schedule {name!r} has one chunk per "
                         f"device; use num_chunks=1, or 'interleaved_1f1b' for more.")
    return (gpipe if name == "gpipe" else one_f_one_b)(num_stages, num_microbatches)


def analytic_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The idle fraction of a step, 1 - sum(busy) / (p * makespan), by formula.

    With every F taking the same time and every B the same time (any ratio)
    and free communication, the makespan is (F+B) * (m+p-1) for GPipe and 1F1B
    and (F+B) * (v*max(m, p) + min(m, p) - 1) for interleaved 1F1B, so:

    - gpipe, 1f1b: (p-1) / (m+p-1), for every m >= 1;
    - interleaved_1f1b: (p-1) / (v*m+p-1) when m >= p, and
      1 - v*m / (v*p+m-1) when m < p (chunks then wait for their lap of p devices).

    Megatron's "(p-1)/(v*m)" is the same idle time relative to the ideal time
    v*m*(F+B), not a fraction of the step.

    Example:

    >>> analytic_bubble("interleaved_1f1b", p=4, m=8, v=2)  # (p-1) / (v*m+p-1) = 3/19
    0.15789473684210525
    """
    make_schedule(name, p, m, v)  # validates every argument
    slots = v * max(m, p) + min(m, p) - 1  # makespan in units of F+B
    return (slots - v * m) / slots


_PAIRS = {"send_activation": ("recv_activation", 1), "recv_activation": ("send_activation", -1),
          "send_gradient": ("recv_gradient", -1), "recv_gradient": ("send_gradient", 1)}


def _partner(a: Action) -> Tuple[str, int, int]:
    """The key of the transfer that a send or receive pairs with."""
    kind, step = _PAIRS[a.kind]
    return (kind, a.stage + step, a.microbatch)


def _needs(a: Action, p: int, last: int) -> List[Tuple[str, int, int]]:
    """Keys of the actions `a` waits for (see `simulate`)."""
    k, i, cross = a.stage, a.microbatch, p > 1
    if a.kind == "forward":
        if k == 0:
            return []
        return [("recv_activation", k, i) if cross else ("forward", k - 1, i)]
    if a.kind == "backward":
        if k == last:
            return [("forward", k, i)]
        return [("forward", k, i), ("recv_gradient", k, i) if cross else ("backward", k + 1, i)]
    if a.kind.startswith("send"):
        return [("forward" if a.kind == "send_activation" else "backward", k, i)]
    return [_partner(a)]


def _name(key: Tuple[str, int, int]) -> str:
    return f"{_SHORT[key[0]]}{key[2]}@s{key[1]}"


def check(schedule: Schedule) -> None:
    """Checks a schedule statically; raises ValueError naming the first problem.

    Checks that every action sits on the device of its virtual stage; that each
    (virtual stage, micro-batch) pair gets exactly one forward and one backward,
    the backward after the forward; that every hand-off between devices has its
    receive before the compute that consumes it, and exactly one matching send
    after the compute that produces it. Deadlocks are found by `simulate`.

    Example:

    >>> check(gpipe(4, 8))  # passes silently
    """
    s, p = schedule, schedule.num_stages
    last = s.num_virtual_stages - 1
    if len(s.actions) != p:
        raise ValueError(f"Schedule {s.name!r} has {len(s.actions)} device lists but "
                         f"num_stages={p}: give one list of actions per device.")
    where: Dict[Tuple[str, int, int], Tuple[int, int]] = {}  # key -> (device, position)
    for d, actions in enumerate(s.actions):
        for n, a in enumerate(actions):
            if a.stage > last or a.microbatch >= s.num_microbatches:
                raise ValueError(f"{a} on device {d}: valid are stages 0..{last} and "
                                 f"micro-batches 0..{s.num_microbatches - 1}.")
            if a.stage % p != d or a.chunk != a.stage // p:
                raise ValueError(f"{a} (chunk={a.chunk}) is on device {d}: virtual stage "
                                 f"{a.stage} belongs on device {a.stage % p} as chunk "
                                 f"{a.stage // p}.")
            if a.key in where:
                raise ValueError(f"{a} appears twice (devices {where[a.key][0]} and {d}); "
                                 f"each action runs exactly once.")
            where[a.key] = (d, n)
    for k in range(last + 1):
        for i in range(s.num_microbatches):
            fwd, bwd = ("forward", k, i), ("backward", k, i)
            for key in (fwd, bwd):
                if key not in where:
                    raise ValueError(f"Schedule {s.name!r} has no {key[0]} {_name(key)} "
                                     f"(stage {k}, micro-batch {i}, device {k % p}).")
                for need in _needs(Action(*key), p, last):
                    if need[0].startswith("recv") and need not in where:
                        source = _partner(Action(*need))
                        raise ValueError(
                            f"{_name(key)} on device {k % p} has no {need[0]} before it: "
                            f"add {_name(need)} to receive {_name(source)} from device "
                            f"{source[1] % p}.")
            if where[bwd][1] < where[fwd][1]:
                raise ValueError(f"{_name(bwd)} runs before {_name(fwd)} on device {k % p}.")
    for key, (d, n) in where.items():
        a = Action(*key)
        if a.is_compute:
            continue
        partner = _partner(a)
        if p == 1 or not 0 <= partner[1] <= last:
            raise ValueError(f"{a} on device {d} has no peer: stage {partner[1]} is not a "
                             f"virtual stage on another device (stages 0..{last}, p={p}).")
        if partner not in where:
            raise ValueError(f"{a} on device {d} has no matching {partner[0]} "
                             f"{_name(partner)} on device {partner[1] % p}.")
        compute = ("forward" if a.kind.endswith("activation") else "backward",) + key[1:]
        send = a.kind.startswith("send")
        if (where[compute][1] < n) != send:
            raise ValueError(f"On device {d}, {a} must come {'after' if send else 'before'} "
                             f"{_name(compute)}.")


class ScheduleDeadlock(RuntimeError):
    """No device can run its next action and not all devices are done.

    Attributes:
        blocked: `(device, action, waits_for)` for each unfinished device;
            `waits_for` is the `(kind, stage, microbatch)` key of the missing action.
    """

    def __init__(self, message: str, blocked):
        super().__init__(message)
        self.blocked = blocked


@dataclasses.dataclass(frozen=True)
class Event:
    """One action as simulated: it ran on `device` from `start` to `end`.

    A receive's interval is the time its device waited for the data.
    """

    action: Action
    device: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The simulated timeline of a schedule (see `simulate`).

    Args:
        schedule: the schedule simulated.
        timeline: per device, its `Event`s in execution order.
        makespan: when the last action ends.
        busy: per device, its total F and B time.
        bubble_fraction: 1 - sum(busy) / (p * makespan).
        peak_stashed: per device, the most (virtual stage, micro-batch) pairs
            whose forward has run and whose backward has not.
    """

    schedule: Schedule
    timeline: Tuple[Tuple[Event, ...], ...]
    makespan: float
    busy: Tuple[float, ...]
    bubble_fraction: float
    peak_stashed: Tuple[int, ...]


def simulate(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 2.0,
             comm_time: float = 0.0) -> Simulation:
    """Runs a schedule in an event-driven model of time.

    Each device runs its actions strictly in order, each as soon as it may:
    a forward (backward) takes `forward_time` (`backward_time`); sends take no
    device time and never block (buffered); a receive blocks until its send has
    run plus `comm_time`. A forward of stage k > 0 needs its `recv_activation`
    (or, on one device, the forward of stage k-1); a backward needs its own
    forward and its `recv_gradient` (or the backward of stage k+1); a send
    needs the compute whose result it sends. Run `check` first for static errors.

    Args:
        schedule: the `Schedule`.
        forward_time: time of one F (> 0).
        backward_time: time of one B (> 0).
        comm_time: latency from a send to its receive (>= 0).

    Returns:
        A `Simulation`.

    Raises:
        ScheduleDeadlock: (a RuntimeError) naming each blocked device, the
            action it is stuck at and the action that action waits for.

    Example:

    >>> simulate(gpipe(2, 2), forward_time=1.0, backward_time=2.0).makespan
    9.0
    """
    for name, value, zero_ok in (("forward_time", forward_time, False),
                                 ("backward_time", backward_time, False),
                                 ("comm_time", comm_time, True)):
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or value < 0 or (value == 0 and not zero_ok)):
            raise ValueError(f"{name}={value!r}: must be a number {'>=' if zero_ok else '>'} 0.")
    p, last = schedule.num_stages, schedule.num_virtual_stages - 1
    lists = schedule.actions
    duration = {"forward": forward_time, "backward": backward_time}
    done: Dict[Tuple[str, int, int], float] = {}  # key -> end time (or data-ready time)
    clock, position = [0.0] * len(lists), [0] * len(lists)
    events: List[List[Event]] = [[] for _ in lists]
    progress = True
    while progress:
        progress = False
        for d, actions in enumerate(lists):
            while position[d] < len(actions):
                a = actions[position[d]]
                needs = _needs(a, p, last)
                if any(key not in done for key in needs):
                    break
                recv = a.kind.startswith("recv")
                ready = max([clock[d]] + [done[key] + comm_time * recv for key in needs])
                start = clock[d] if recv else ready  # a receive's interval is its wait
                end = ready + duration.get(a.kind, 0.0)
                events[d].append(Event(a, d, start, end))
                done[a.key], clock[d] = end, end
                position[d] += 1
                progress = True
    blocked = [(d, actions[position[d]],
                next(k for k in _needs(actions[position[d]], p, last) if k not in done))
               for d, actions in enumerate(lists) if position[d] < len(actions)]
    if blocked:
        raise ScheduleDeadlock(
            f"Schedule {schedule.name!r} deadlocks: " + "; ".join(
                f"device {d} is blocked at {a} (action {position[d]} of {len(lists[d])}), "
                f"waiting for {_name(k)} on device {k[1] % p}" for d, a, k in blocked)
            + ".", tuple(blocked))
    busy = tuple(sum(e.end - e.start for e in ev if e.action.is_compute) for ev in events)
    makespan = max(clock, default=0.0)
    peaks = tuple(max(itertools.accumulate(
        ({"forward": 1, "backward": -1}.get(a.kind, 0) for a in actions), initial=0))
        for actions in lists)
    return Simulation(schedule, tuple(tuple(ev) for ev in events), makespan, busy,
                      1.0 - sum(busy) / (p * makespan) if makespan else 0.0, peaks)


def render(schedule_or_simulation: Union[Schedule, Simulation]) -> str:
    """Draws a timeline in ASCII, one row per device, one column per time slot.

    `F3` is the forward of micro-batch 3 (`F3.1`: on the device's chunk 1 when
    v > 1), `--` continues the previous compute, `.` is idle. A `Schedule` is
    drawn from `simulate(schedule, 1.0, 1.0)`; a `Simulation` in slots of its
    shortest compute.

    Example:

    >>> print(render(one_f_one_b(2, 3)))
    1f1b p=2 m=3 v=1: makespan 8, bubble 0.250
    device 0 | F0 F1 .  B0 F2 B1 .  B2
    device 1 | .  F0 B0 F1 B1 F2 B2 .
    """
    sim = schedule_or_simulation
    if isinstance(sim, Schedule):
        sim = simulate(sim, forward_time=1.0, backward_time=1.0)
    s = sim.schedule
    computes = [e for ev in sim.timeline for e in ev if e.action.is_compute]
    slot = min((e.end - e.start for e in computes), default=1.0)

    def label(a: Action) -> str:
        return f"{_SHORT[a.kind]}{a.microbatch}" + (f".{a.chunk}" if s.num_chunks > 1 else "")

    width = max((len(label(e.action)) for e in computes), default=1)
    rows = [f"{s.name} p={s.num_stages} m={s.num_microbatches} v={s.num_chunks}: "
            f"makespan {sim.makespan:g}, bubble {sim.bubble_fraction:.3f}"]
    for d, ev in enumerate(sim.timeline):
        cells = ["."] * round(sim.makespan / slot)
        for e in ev:
            if e.action.is_compute:
                first, stop = round(e.start / slot), round(e.end / slot)
                cells[first:stop] = [label(e.action)] + ["-" * width] * (stop - first - 1)
        rows.append(f"device {d} | " + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(rows)
