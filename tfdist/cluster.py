"""A mesh over several worker processes: one controller, the others serve.

tfdist's mesh over workers is single-controller, like `TPUStrategy`: task 0
(the `chief` if the cluster has one, else `worker` 0) runs the Python program
and a TensorFlow server; every other task only runs a TensorFlow server. The
controller connects to the cluster and builds an ordinary `MeshStrategy` over
the devices of all tasks (task-major, so the last mesh axis is split within a
task first), so sharded weights, named-axis collectives, global checkpoints
and Keras `fit` work exactly as on one machine.

    cluster = ClusterConfig.from_env()          # TF_CONFIG, checked
    devices = cluster.start(devices_per_worker=2)  # serves and exits off-chief
    strategy = MeshStrategy("data:2;model:2", layout, devices=devices)

A server exits when the controller has been unreachable for `grace_s`
seconds; the controller aborts its collectives, naming the lost task, when a
server stops answering (`watch`), so a dead process never leaves a hang.
"""

import dataclasses
import json
import os
import socket
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

DEVICES_ENV = "TFDIST_DEVICES_PER_WORKER"
"""Set by `python -m tfdist.launch` for each task: its logical CPU devices."""

_EXAMPLE = ('{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
            '"task": {"type": "worker", "index": 0}}')


def _fail(message: str):
    raise ValueError(f"{message} Expected TF_CONFIG like {_EXAMPLE}.")


def _check_address(job: str, address) -> str:
    if not isinstance(address, str) or address.count(":") != 1:
        _fail(f"Bad address {address!r} in job {job!r}: use 'host:port'.")
    host, port = address.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        _fail(f"Bad address {address!r} in job {job!r}: use 'host:port' with a port in 1..65535.")
    return address


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """The jobs of a cluster and this process's task in it.

    Attributes:
        jobs: job name -> addresses (`chief`, at most one, and `worker`).
        task_type, task_index: this process's task.
    """

    jobs: Tuple[Tuple[str, Tuple[str, ...]], ...]
    task_type: str
    task_index: int

    @classmethod
    def parse(cls, tf_config) -> "ClusterConfig":
        """Checks a TF_CONFIG (JSON text or dict); one ValueError names the problem."""
        if isinstance(tf_config, str):
            try:
                tf_config = json.loads(tf_config)
            except json.JSONDecodeError as e:
                _fail(f"TF_CONFIG is not valid JSON ({e}).")
        if not isinstance(tf_config, dict) or not isinstance(tf_config.get("cluster"), dict):
            _fail(f"TF_CONFIG {tf_config!r} has no 'cluster' mapping.")
        cluster = tf_config["cluster"]
        unknown = sorted(set(cluster) - {"chief", "worker"})
        if unknown:
            _fail(f"TF_CONFIG cluster has job {unknown[0]!r}; tfdist uses 'chief' and 'worker'.")
        if not cluster.get("worker") and not cluster.get("chief"):
            _fail("TF_CONFIG cluster lists no workers.")
        jobs = []
        for job in ("chief", "worker"):
            addresses = cluster.get(job) or []
            if not isinstance(addresses, (list, tuple)):
                _fail(f"TF_CONFIG job {job!r} must list addresses, got {addresses!r}.")
            if job == "chief" and len(addresses) > 1:
                _fail(f"TF_CONFIG has {len(addresses)} chiefs; at most one.")
            if addresses:
                jobs.append((job, tuple(_check_address(job, a) for a in addresses)))
        everything = [a for _, addresses in jobs for a in addresses]
        dupes = sorted({a for a in everything if everything.count(a) > 1})
        if dupes:
            _fail(f"Address {dupes[0]!r} appears twice in the TF_CONFIG cluster.")
        task = tf_config.get("task")
        if not isinstance(task, dict) or "type" not in task or "index" not in task:
            _fail(f"TF_CONFIG task {task!r} must have 'type' and 'index'.")
        sizes = dict((job, len(a)) for job, a in jobs)
        if task["type"] not in sizes:
            _fail(f"TF_CONFIG task type {task['type']!r} is not a job of the cluster {sorted(sizes)}.")
        index = task["index"]
        if not isinstance(index, int) or not 0 <= index < sizes[task["type"]]:
            _fail(f"TF_CONFIG task index {index!r} is out of range for job {task['type']!r} "
                  f"of {sizes[task['type']]} task(s): use 0..{sizes[task['type']] - 1}.")
        return cls(tuple(jobs), task["type"], index)

    @classmethod
    def from_env(cls) -> Optional["ClusterConfig"]:
        """The TF_CONFIG of this process, or None when it is unset."""
        text = os.environ.get("TF_CONFIG", "")
        return cls.parse(text) if text.strip() else None

    @classmethod
    def from_hosts(cls, worker_hosts: Sequence[str], task_index: int) -> "ClusterConfig":
        """`--worker_hosts=h1:p,h2:p --task_index=i` as a cluster of workers."""
        return cls.parse({"cluster": {"worker": list(worker_hosts)},
                          "task": {"type": "worker", "index": task_index}})

    def to_tf_config(self, task_type: Optional[str] = None, task_index: Optional[int] = None) -> str:
        """The TF_CONFIG JSON of this cluster for one task (default: this one)."""
        return json.dumps({
            "cluster": {job: list(a) for job, a in self.jobs},
            "task": {"type": task_type or self.task_type,
                     "index": self.task_index if task_index is None else task_index},
        })

    @property
    def tasks(self) -> List[Tuple[str, int, str]]:
        """`(job, index, address)` of every task, controller first."""
        return [(job, i, a) for job, addresses in self.jobs for i, a in enumerate(addresses)]

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def controller(self) -> Tuple[str, int, str]:
        return self.tasks[0]

    @property
    def is_controller(self) -> bool:
        job, index, _ = self.controller
        return (self.task_type, self.task_index) == (job, index)

    @property
    def address(self) -> str:
        return dict(self.jobs)[self.task_type][self.task_index]

    def cluster_spec(self):
        import tensorflow as tf

        return tf.train.ClusterSpec({job: list(a) for job, a in self.jobs})

    def task_devices(self, devices_per_worker: int, kind: str = "CPU") -> List[str]:
        """The mesh's device names, task-major (controller's first)."""
        return [f"/job:{job}/replica:0/task:{i}/device:{kind}:{d}"
                for job, i, _ in self.tasks for d in range(devices_per_worker)]

    def choose_devices(self, devices_per_worker: int, found_gpus: Sequence[str],
                       found_cpus: Sequence[str]) -> List[str]:
        """Each task's first `devices_per_worker` GPUs when the tasks have GPUs, else CPUs.

        Raises:
            ValueError: some task has GPUs but fewer than `devices_per_worker`
                (never a silent fall-back to CPUs), or a task lacks the CPUs.
        """
        gpus = self.task_devices(devices_per_worker, "GPU")
        if found_gpus:
            missing = [d for d in gpus if d not in set(found_gpus)]
            if missing:
                raise ValueError(
                    f"The cluster has GPUs but lacks {missing[:3]}: each task needs "
                    f"{devices_per_worker} GPUs (devices_per_worker={devices_per_worker}); "
                    f"found {sorted(found_gpus)[:8]}.")
            return gpus
        devices = self.task_devices(devices_per_worker)
        missing = [d for d in devices if d not in set(found_cpus)]
        if missing:
            raise ValueError(
                f"The cluster lacks devices {missing[:3]}: every task must run with "
                f"devices_per_worker={devices_per_worker}.")
        return devices

    # -- TensorFlow side -----------------------------------------------------

    def mesh_devices(self, mesh_size: int, devices_per_worker: Optional[int] = None):
        """Checks that a mesh of `mesh_size` devices fits, then `start`s.

        Raises:
            ValueError: the mesh size is not tasks x devices per task.
        """
        per_worker = devices_per_worker or devices_per_worker_from_env()
        if self.num_tasks * per_worker != mesh_size:
            raise ValueError(
                f"The mesh has {mesh_size} devices but the cluster has {self.num_tasks} "
                f"tasks x {per_worker} devices; use devices_per_worker="
                f"{max(1, mesh_size // self.num_tasks)} or a mesh of "
                f"{self.num_tasks * per_worker} devices.")
        return self.start(per_worker)

    def start(self, devices_per_worker: Optional[int] = None, threads: int = 0,
              grace_s: float = 10.0, inter_op_threads: Optional[int] = None):
        """Joins the cluster. Returns the mesh devices on the controller.

        The devices are each task's GPUs when the tasks have GPUs (NCCL
        collectives between them), else its (virtual) CPUs.

        Elsewhere serves the controller and exits the process (status 0) once
        the controller has been unreachable for `grace_s` seconds.

        Args:
            devices_per_worker: logical CPU devices of each task (default:
                `TFDIST_DEVICES_PER_WORKER` as set by `python -m tfdist.launch`, else 1).
            threads: intra- and inter-op threads of each task (0: TF's default).
            inter_op_threads: inter-op threads, if not `threads`. A pipeline
                stage pinned to one core wants 1 intra-op thread and 2 inter-op
                threads: with one, TF's executor runs a device's chain of
                micro-batches inline before the sends of their outputs, and the
                next stage waits for all of them (bench/pipeline.py).
        """
        import tensorflow as tf

        from tfdist.devices import split_cpu

        devices_per_worker = devices_per_worker or devices_per_worker_from_env()
        if devices_per_worker > 1:
            split_cpu(devices_per_worker)
        inter = inter_op_threads or threads
        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
        if inter:
            tf.config.threading.set_inter_op_parallelism_threads(inter)
        # Every task, the controller's included, runs a server that owns its
        # mesh devices; the controller's program is a separate client of the
        # cluster (job "localhost"), as a TPUStrategy program is of its TPUs.
        config = tf.compat.v1.ConfigProto(
            intra_op_parallelism_threads=threads, inter_op_parallelism_threads=inter,
            device_count={"CPU": devices_per_worker})
        tf.distribute.Server(self.cluster_spec(), job_name=self.task_type,
                             task_index=self.task_index, config=config, start=True)
        if not self.is_controller:
            print(f"tfdist: {self.task_type}:{self.task_index} serving at {self.address} "
                  f"for controller {self.controller[2]}", flush=True)
            _serve_until_gone(self.controller[2], grace_s)
            sys.stdout.flush()
            os._exit(0)  # the TF server has no clean shutdown
        _wait_for(self.tasks[1:], timeout_s=120)
        tf.config.experimental_connect_to_cluster(self.cluster_spec())
        gpus = [d.name for d in tf.config.list_logical_devices("GPU")
                if not d.name.startswith("/job:localhost")]
        devices = self.choose_devices(devices_per_worker, gpus,
                                      [d.name for d in tf.config.list_logical_devices("CPU")])
        watch(self, interval_s=2.0)
        return devices


def _reachable(address: str, timeout: float = 2.0) -> bool:
    host, port = address.split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _wait_for(tasks, timeout_s: float) -> None:
    """Blocks until every task's port answers; names the late ones."""
    deadline = time.monotonic() + timeout_s
    waiting = list(tasks)
    while waiting:
        waiting = [t for t in waiting if not _reachable(t[2])]
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(
                f"tfdist: tasks {[f'{j}:{i} at {a}' for j, i, a in waiting]} did not start "
                f"within {timeout_s:.0f} s.")
        if waiting:
            time.sleep(0.2)


def _serve_until_gone(address: str, grace_s: float) -> None:
    seen, last = False, time.monotonic()
    while True:
        if _reachable(address):
            seen, last = True, time.monotonic()
        elif time.monotonic() - last > (grace_s if seen else 300.0):
            print(f"tfdist: controller {address} is gone; this server exits.", flush=True)
            return
        time.sleep(1.0)


_WATCHED: Dict[int, threading.Thread] = {}


def watch(cluster: ClusterConfig, interval_s: float = 2.0, misses: int = 3) -> None:
    """On the controller: aborts collectives when a server stops answering.

    A background thread connects to every other task each `interval_s`; after
    `misses` failures in a row it aborts all collective ops with an error
    naming the lost task, so a step waiting on it fails instead of hanging.
    """
    from tfdist.internal.collective_abort import abort_collectives

    def loop():
        failures = {t: 0 for t in cluster.tasks[1:]}
        while True:
            time.sleep(interval_s)
            for task in failures:
                failures[task] = 0 if _reachable(task[2], timeout=interval_s) else failures[task] + 1
                if failures[task] >= misses:
                    message = (f"tfdist: lost {task[0]}:{task[1]} at {task[2]} "
                               f"(no answer for {misses * interval_s:.0f} s)")
                    print(message, file=sys.stderr, flush=True)
                    abort_collectives(message)
                    return

    if id(cluster) not in _WATCHED:
        thread = threading.Thread(target=loop, name="tfdist-cluster-watch", daemon=True)
        thread.start()
        _WATCHED[id(cluster)] = thread


def devices_per_worker_from_env(default: Optional[int] = None) -> int:
    value = os.environ.get(DEVICES_ENV, "")
    if not value:
        return default or 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{DEVICES_ENV}={value!r} must be a positive integer.")
    return int(value)
