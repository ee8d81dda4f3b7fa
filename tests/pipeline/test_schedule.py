"""Pipeline schedules as data: static checks, simulated time and memory, formulas.

Pure Python (no TensorFlow): every schedule is checked, simulated without a
deadlock, and its simulated bubble and peak stash compared with the formulas
of GPipe, PipeDream-flush (DeepSpeed's `num_pipe_buffers`) and Megatron.
"""

import dataclasses

import pytest

from tfdist.pipeline import (
    Action,
    Schedule,
    ScheduleDeadlock,
    analytic_bubble,
    check,
    gpipe,
    interleaved_one_f_one_b,
    make_schedule,
    one_f_one_b,
    render,
    simulate,
)


def _microbatches(p):
    return sorted({1, 2, p - 1, p, p + 1, 2 * p + 1, 4 * p} - {0})


FLAT = [(p, m) for p in (1, 2, 3, 4, 8) for m in _microbatches(p)]
INTERLEAVED = [(p, m, v) for p in (1, 2, 3, 4, 8) for v in (2, 3, 4)
               for m in sorted({1, 2, p - 1, p, p + 1, 2 * p, 2 * p + 1, 3 * p, 4 * p} - {0})]


def _first_round(p, m):
    rounds = max(1, m // p)
    return -(-m // rounds)


def _ends(sim):
    return {e.action.key: e for events in sim.timeline for e in events}


@pytest.mark.parametrize("p,m", FLAT)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flat_schedule_is_valid_and_matches_the_formulas(name, p, m):
    schedule = make_schedule(name, p, m)
    check(schedule)
    sim = simulate(schedule, forward_time=1.0, backward_time=2.0, comm_time=0.0)
    expected = [m] * p if name == "gpipe" else [min(p - d, m) for d in range(p)]
    assert sim.peak_stashed == tuple(expected)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert sim.bubble_fraction == pytest.approx(analytic_bubble(name, p, m), abs=1e-9)
    assert sim.makespan == pytest.approx(3.0 * (m + p - 1))
    assert sim.busy == pytest.approx([3.0 * m] * p)
    # The formula holds for any F:B ratio, and communication latency never deadlocks.
    for times in [(1.0, 1.0, 0.0), (2.0, 1.0, 0.0), (1.0, 3.0, 0.0)]:
        ratio = simulate(schedule, *times).bubble_fraction
        assert ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-9), times
    assert simulate(schedule, 1.0, 2.0, comm_time=0.5).makespan >= sim.makespan


@pytest.mark.parametrize("p,m", FLAT)
def test_compute_counts_and_communication_per_device(p, m):
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        for d, actions in enumerate(schedule.actions):
            kinds = [a.kind for a in actions]
            assert kinds.count("forward") == kinds.count("backward") == m
            assert kinds.count("recv_activation") == kinds.count("send_gradient") == (
                m if d > 0 else 0)
            assert kinds.count("send_activation") == kinds.count("recv_gradient") == (
                m if d < p - 1 else 0)


@pytest.mark.parametrize("p,m,v", INTERLEAVED)
def test_interleaved_is_valid_and_matches_the_formulas(p, m, v):
    schedule = interleaved_one_f_one_b(p, m, v)
    check(schedule)
    assert schedule.num_virtual_stages == p * v
    sim = simulate(schedule, forward_time=1.0, backward_time=2.0)
    if m >= p:
        expected = (p - 1) / (v * m + p - 1)
    else:  # each chunk waits for its micro-batch's lap of p devices
        expected = 1 - v * m / (v * p + m - 1)
    assert sim.bubble_fraction == pytest.approx(expected, abs=1e-9)
    assert analytic_bubble("interleaved_1f1b", p, m, v) == pytest.approx(expected, abs=1e-12)
    assert simulate(schedule, 1.0, 1.0).bubble_fraction == pytest.approx(expected, abs=1e-9)
    # Megatron's warm-up 2(p-d-1) + (v-1)g forwards, then one more F before the first B.
    g = _first_round(p, m)
    assert sim.peak_stashed == tuple(min(2 * (p - d - 1) + (v - 1) * g + 1, v * m)
                                     for d in range(p))
    if m % p == 0 and m >= 2 * p:
        # Megatron: device 0 holds p * (1 + (p-1)/(p*v)) micro-batches' activations
        # (one chunk's activations are 1/v of a micro-batch's on the device).
        assert sim.peak_stashed[0] / v == pytest.approx(p * (1 + (p - 1) / (p * v)))
    simulate(schedule, 1.0, 2.0, comm_time=0.25)  # no deadlock with latency either


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 6), (8, 9)])
def test_interleaving_shrinks_the_bubble_and_one_chunk_is_1f1b(p, m):
    flat = simulate(one_f_one_b(p, m)).bubble_fraction
    two = simulate(interleaved_one_f_one_b(p, m, 2)).bubble_fraction
    four = simulate(interleaved_one_f_one_b(p, m, 4)).bubble_fraction
    assert four < two < flat
    same = interleaved_one_f_one_b(p, m, 1)
    assert same.actions == one_f_one_b(p, m).actions and same.name == "interleaved_1f1b"


def test_one_device_with_chunks_hands_off_locally():
    schedule = interleaved_one_f_one_b(1, 3, 3)
    check(schedule)
    assert all(a.is_compute for a in schedule.actions[0])
    sim = simulate(schedule)
    assert sim.bubble_fraction == 0.0 and sim.makespan == 27.0


@pytest.mark.parametrize("p,m", [(p, m) for p, m in FLAT if m > p])
def test_1f1b_stashes_strictly_less_than_gpipe_when_m_exceeds_p(p, m):
    assert simulate(one_f_one_b(p, m)).peak_stashed[0] == p
    assert simulate(gpipe(p, m)).peak_stashed[0] == m > p


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 6, 1),
                                        ("interleaved_1f1b", 3, 7, 2)])
def test_timeline_respects_every_dependency(name, p, m, v):
    comm = 0.5
    sim = simulate(make_schedule(name, p, m, v), 1.0, 2.0, comm_time=comm)
    ev, last = _ends(sim), p * v - 1
    for (kind, k, i), e in ev.items():
        if kind == "forward" and k > 0:
            assert e.start >= ev[("forward", k - 1, i)].end + comm
        if kind == "backward":
            assert e.start >= ev[("forward", k, i)].end
            if k < last:
                assert e.start >= ev[("backward", k + 1, i)].end + comm
    for events in sim.timeline:  # a device runs one thing at a time, in its order
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))


def test_gpipe_and_1f1b_hand_computed():
    assert [str(a) for a in gpipe(2, 2).actions[0]] == [
        "F0@s0", "SA0@s0", "F1@s0", "SA1@s0", "RG0@s0", "B0@s0", "RG1@s0", "B1@s0"]
    assert [str(a) for a in one_f_one_b(3, 4).actions[1] if a.is_compute] == [
        "F0@s1", "F1@s1", "B0@s1", "F2@s1", "B1@s1", "F3@s1", "B2@s1", "B3@s1"]
    sim = simulate(gpipe(2, 2), 1.0, 2.0)
    assert [(str(e.action), e.start, e.end) for e in sim.timeline[1] if e.action.is_compute] == [
        ("F0@s1", 1.0, 2.0), ("F1@s1", 2.0, 3.0), ("B0@s1", 3.0, 5.0), ("B1@s1", 5.0, 7.0)]
    assert sim.makespan == 9.0 and sim.busy == (6.0, 6.0)
    assert sim.bubble_fraction == pytest.approx(1 / 3)


def test_render_draws_one_row_per_device():
    assert render(one_f_one_b(2, 3)) == (
        "1f1b p=2 m=3 v=1: makespan 8, bubble 0.250\n"
        "device 0 | F0 F1 .  B0 F2 B1 .  B2\n"
        "device 1 | .  F0 B0 F1 B1 F2 B2 .")
    assert render(simulate(gpipe(2, 1), 1.0, 2.0)) == (
        "gpipe p=2 m=1 v=1: makespan 6, bubble 0.500\n"
        "device 0 | F0 .  .  .  B0 --\n"
        "device 1 | .  F0 B0 -- .  .")
    lines = render(interleaved_one_f_one_b(4, 8, 2)).splitlines()
    assert len(lines) == 5 and lines[1].startswith("device 0 | F0.0 F1.0")


# ---- bad schedules and bad arguments --------------------------------------------------


def _without(schedule, text):
    return dataclasses.replace(schedule, actions=[
        [a for a in actions if str(a) != text] for actions in schedule.actions])


def test_check_names_a_missing_receive():
    with pytest.raises(ValueError, match=r"F0@s1 on device 1 has no recv_activation before "
                                         r"it: add RA0@s1 to receive SA0@s0 from device 0"):
        check(_without(gpipe(2, 1), "RA0@s1"))
    with pytest.raises(ValueError, match=r"B0@s0 on device 0 has no recv_gradient"):
        check(_without(one_f_one_b(2, 2), "RG0@s0"))


def _on_device_0(schedule, actions):
    return dataclasses.replace(schedule, actions=(tuple(actions),) + schedule.actions[1:])


_S = one_f_one_b(2, 2)  # device 0: F0 SA0 F1 SA1 RG0 B0 RG1 B1
_D0 = _S.actions[0]


@pytest.mark.parametrize("bad,message", [
    (_without(_S, "SA1@s0"), r"RA1@s1 on device 1 has no matching send_activation SA1@s0 "
                             r"on device 0"),
    (_without(_S, "B1@s1"), r"has no backward B1@s1 \(stage 1, micro-batch 1"),
    (dataclasses.replace(_S, actions=_S.actions[:1]), r"1 device lists but num_stages=2"),
    (_on_device_0(_S, _D0 + (Action("forward", 0, 0),)), r"F0@s0 appears twice"),
    (_on_device_0(_S, _D0 + (Action("forward", 1, 1),)),
     r"F1@s1 \(chunk=0\) is on device 0: virtual stage 1 belongs on device 1"),
    (_on_device_0(_S, _D0 + (Action("forward", 0, 5),)), r"micro-batches 0..1"),
    (_on_device_0(_S, reversed(_D0)), r"B0@s0 runs before F0@s0 on device 0"),
    (_on_device_0(_S, _D0[1:2] + _D0[:1] + _D0[2:]), r"On device 0, SA0@s0 must come after "
                                                     r"F0@s0"),
], ids=["no-send", "no-backward", "devices", "twice", "wrong-device", "microbatch",
        "backward-first", "send-first"])
def test_check_names_the_problem(bad, message):
    with pytest.raises(ValueError, match=message):
        check(bad)


def test_schedule_holds_only_actions():
    with pytest.raises(TypeError, match=r"device 0: 'F0@s0' is not an Action"):
        Schedule("typo", 1, 1, 1, [["F0@s0"]])


def test_check_rejects_transfers_without_a_peer():
    single = one_f_one_b(1, 1)
    bad = dataclasses.replace(single, actions=[single.actions[0]
                                               + (Action("send_activation", 0, 0),)])
    with pytest.raises(ValueError, match=r"SA0@s0 on device 0 has no peer: stage 1"):
        check(bad)


def test_simulate_names_every_blocked_device():
    # Each device receives before it sends: device 0 waits for a gradient that
    # device 1 can only compute after the activation device 0 has not sent yet.
    f, b = Action("forward", 0, 0), Action("backward", 0, 0)
    schedule = Schedule("crossed", 2, 1, 1, [
        [f, Action("recv_gradient", 0, 0), Action("send_activation", 0, 0), b],
        [Action("recv_activation", 1, 0), Action("forward", 1, 0),
         Action("backward", 1, 0), Action("send_gradient", 1, 0)]])
    check(schedule)  # every transfer is matched: only simulation finds the deadlock
    with pytest.raises(ScheduleDeadlock, match=(
            r"'crossed' deadlocks: device 0 is blocked at RG0@s0 \(action 1 of 4\), waiting "
            r"for SG0@s1 on device 1; device 1 is blocked at RA0@s1 \(action 0 of 4\), "
            r"waiting for SA0@s0 on device 0")) as raised:
        simulate(schedule)
    assert isinstance(raised.value, RuntimeError)
    assert [(d, str(a), w) for d, a, w in raised.value.blocked] == [
        (0, "RG0@s0", ("send_gradient", 1, 0)), (1, "RA0@s1", ("send_activation", 0, 0))]


def test_simulate_finds_a_missing_receive_as_a_deadlock():
    with pytest.raises(ScheduleDeadlock, match=r"device 1 is blocked at F0@s1 .*waiting for "
                                               r"RA0@s1 on device 1"):
        simulate(_without(gpipe(2, 1), "RA0@s1"))


@pytest.mark.parametrize("call,message", [
    (lambda: gpipe(0, 4), r"num_stages=0: must be an integer >= 1"),
    (lambda: one_f_one_b(2, 0), r"num_microbatches=0: must be an integer >= 1"),
    (lambda: one_f_one_b(2, 2.5), r"num_microbatches=2.5: must be an integer >= 1"),
    (lambda: gpipe(True, 2), r"num_stages=True: must be an integer >= 1"),
    (lambda: interleaved_one_f_one_b(4, 8, 0), r"num_chunks=0: must be an integer >= 1"),
    (lambda: make_schedule("pipedream", 2, 4),
     r"Unknown schedule 'pipedream': valid names are \['gpipe', '1f1b', 'interleaved_1f1b'\]"),
    (lambda: make_schedule("1f1b", 2, 4, num_chunks=2), r"num_chunks=2: schedule '1f1b' has "
                                                        r"one chunk"),
    (lambda: analytic_bubble("gpipe", 2, -1), r"num_microbatches=-1"),
    (lambda: simulate(gpipe(2, 2), forward_time=0), r"forward_time=0: must be a number > 0"),
    (lambda: simulate(gpipe(2, 2), comm_time=-1.0), r"comm_time=-1.0: must be a number >= 0"),
    (lambda: Action("fwd", 0, 0), r"Action kind 'fwd': valid kinds are \['forward'"),
    (lambda: Action("forward", -1, 0), r"stage=-1: must be an integer >= 0"),
])
def test_bad_arguments_name_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()
