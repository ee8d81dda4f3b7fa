"""Caps on a process's address space (`RLIMIT_AS`) for memory tests and benchmarks.

A job first runs a tiny step so that every thread and pool a step needs exists;
each process's peak address space (`VmPeak`) is then its baseline, and it caps
itself at the baseline plus a budget. Workers of a single-controller mesh run no
program of their own: a thread started before the cluster (`cap_when_told`)
waits for the controller's order (`cap_job`) in a shared directory.
"""

import os
import resource


def own_status(field: str) -> int:
    """Bytes of this process's `/proc/self/status` entry `field` (`VmPeak`, `VmHWM`)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def cap_self(budget: int) -> int:
    """Caps this process's address space at its peak so far plus `budget`; returns the cap."""
    cap = own_status("VmPeak") + budget
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return cap


def cap_when_told(signal_dir: str, task: int) -> None:
    """On a worker (which runs no program of its own), a thread that caps the process once
    the controller has run the tiny step: it waits for `cap-<task>` in `signal_dir`, caps
    itself and answers with `capped-<task>` (the cap)."""
    import threading
    import time

    def wait():
        order = os.path.join(signal_dir, f"cap-{task}")
        while not os.path.exists(order):
            time.sleep(0.05)
        cap = cap_self(int(open(order).read()))
        with open(os.path.join(signal_dir, f"capped-{task}.tmp"), "w") as f:
            f.write(str(cap))
        os.replace(os.path.join(signal_dir, f"capped-{task}.tmp"),
                   os.path.join(signal_dir, f"capped-{task}"))

    threading.Thread(target=wait, daemon=True).start()


def cap_job(signal_dir: str, tasks: int, budget: int, controller: bool = True):
    """On the controller: caps itself (unless not `controller`: a controller apart from
    the devices) and orders every worker to; returns the caps."""
    import time

    caps = [cap_self(budget)] if controller else []
    for task in range(1, tasks):
        with open(os.path.join(signal_dir, f"cap-{task}.tmp"), "w") as f:
            f.write(str(budget))
        os.replace(os.path.join(signal_dir, f"cap-{task}.tmp"),
                   os.path.join(signal_dir, f"cap-{task}"))
    for task in range(1, tasks):
        answer = os.path.join(signal_dir, f"capped-{task}")
        deadline = time.time() + 60
        while not os.path.exists(answer):
            if time.time() > deadline:
                raise TimeoutError(f"worker {task} did not cap itself within 60 s")
            time.sleep(0.05)
        caps.append(int(open(answer).read()))
    return caps
