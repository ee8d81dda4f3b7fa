"""Starting the tasks of one job: on loopback here, or as commands for hosts."""

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Sequence

from tfdist.cluster import DEVICES_ENV, ClusterConfig



def free_ports(n: int) -> List[int]:
    """`n` distinct ports free on loopback now."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("localhost", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def loopback_cluster(num_workers: int) -> ClusterConfig:
    return ClusterConfig.from_hosts([f"localhost:{p}" for p in free_ports(num_workers)], 0)


def _stream(pipe, prefix: str, out) -> None:
    for line in iter(pipe.readline, b""):
        out.write(f"{prefix} {line.decode(errors='replace')}")
        out.flush()
    pipe.close()


def _end(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, the processes still running (only ours, by pid)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_local(command: Sequence[str], num_workers: int, devices_per_worker: int = 1,
              pin_cores: bool = False, linger_s: float = 15.0, out=None) -> int:
    """Runs `command` once per task on loopback, each with its TF_CONFIG.

    Output lines are prefixed `[worker i]`. Returns the first non-zero exit
    status (ending the other tasks), else 0 once task 0 (the controller) has
    exited and the others have followed within `linger_s` (then they are
    ended: servers of a single-controller mesh have nothing left to do).

    Args:
        pin_cores: pin task i to CPU core i (Linux `sched_setaffinity`).
    """
    out = out or sys.stdout
    cluster = loopback_cluster(num_workers)
    procs, threads = [], []
    # A SIGTERM to the launcher (a CI timeout) ends the tasks too.
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    for i in range(num_workers):
        env = dict(os.environ, TF_CONFIG=cluster.to_tf_config("worker", i))
        env[DEVICES_ENV] = str(devices_per_worker)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        preexec = None
        if pin_cores:
            core = i % os.cpu_count()
            preexec = lambda core=core: os.sched_setaffinity(0, {core})  # noqa: E731
        p = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, preexec_fn=preexec)
        procs.append(p)
        t = threading.Thread(target=_stream, args=(p.stdout, f"[worker {i}]", out), daemon=True)
        t.start()
        threads.append(t)
    status, controller_done = 0, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, status = failed[0]
                out.write(f"[launch] worker {i} exited with status {status}; ending the others\n")
                break
            if all(c is not None for c in codes):
                break
            if codes[0] == 0:
                controller_done = controller_done or time.monotonic()
                if time.monotonic() - controller_done > linger_s:
                    break
            time.sleep(0.1)
    except KeyboardInterrupt:
        status = 130
    finally:
        _end(procs)
        for t in threads:
            t.join(timeout=5)
        signal.signal(signal.SIGTERM, previous)
    return status


def cluster_commands(command: Sequence[str], hosts: Sequence[str], port: int = 2222,
                     devices_per_worker: int = 1) -> List[str]:
    """The shell command to start each task of the same job on real hosts."""
    addresses = [h if ":" in h else f"{h}:{port}" for h in hosts]
    cluster = ClusterConfig.from_hosts(addresses, 0)
    lines = []
    for i, address in enumerate(addresses):
        env = f"TF_CONFIG={shlex.quote(cluster.to_tf_config('worker', i))} {DEVICES_ENV}={devices_per_worker}"
        lines.append(f"# on {address.split(':')[0]}\n{env} {shlex.join(command)}")
    return lines


def horovod_command(command: Sequence[str], hosts: Sequence[str], slots: int) -> str:
    """The `horovodrun` line for one process per device on `hosts`."""
    spec = ",".join(f"{h.split(':')[0]}:{slots}" for h in hosts)
    return f"horovodrun -np {len(hosts) * slots} -H {spec} --gloo {shlex.join(command)}"
