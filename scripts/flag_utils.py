"""Helpers shared by the absl entry points in scripts/ (flags live only here)."""

import atexit
import os
import re
import sys
import threading

from absl import app, flags

from tfdist.mesh import LayoutRules, MeshShape


def _parses(parse):
    def check(value):
        try:
            parse(value)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True

    return check


def validate_mesh_flags(mesh_flag: str = "mesh_shape", layout_flag: str = "layout",
                        allow_auto: bool = False) -> None:
    """Rejects a malformed mesh shape or layout at flag parsing, with the parser's message
    (`allow_auto`: the layout may be `auto`, the planner's choice)."""
    flags.register_validator(mesh_flag, _parses(MeshShape.parse), "")
    layouts = LayoutRules.parse
    if allow_auto:
        def layouts(value):
            return None if value == "auto" else LayoutRules.parse(value)
    flags.register_validator(layout_flag, _parses(layouts), "")


def validate_bytes_flag(name: str) -> None:
    """Rejects a malformed memory size (`parse_bytes`) at flag parsing."""
    flags.register_validator(name, _parses(parse_bytes), "")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def parse_bytes(value: str):
    """`"2GiB"`, `"512MiB"`, `"1e9"` -> bytes (an int); `""` -> None.

    Raises:
        ValueError: naming the value and the units understood.
    """
    value = value.strip()
    if not value:
        return None
    match = re.fullmatch(r"([0-9.eE+]+)\s*([A-Za-z]*)", value)
    unit = match.group(2).lower() if match else None
    try:
        number = float(match.group(1)) if match else -1.0
    except ValueError:
        number = -1.0
    if unit not in _UNITS or not number > 0:
        raise ValueError(f"memory size {value!r} is not a positive number of bytes with one of "
                         f"the units {sorted(u for u in _UNITS if u)} (e.g. 2GiB, 512MiB, 1e9).")
    return int(number * _UNITS[unit])


def define_plan_flags() -> None:
    """--memory_per_device, the bound `--layout=auto` plans under."""
    flags.DEFINE_string("memory_per_device", "",
                        "--layout=auto: bytes a device may hold, e.g. 2GiB, 512MiB, 1e9 "
                        "(empty: no bound).")
    validate_bytes_flag("memory_per_device")


def devices_to_plan() -> int:
    """The device count `--layout=auto` plans over: --mesh_shape's, on this machine
    (CPU devices split before TensorFlow starts).

    Raises:
        ValueError: under a cluster or Horovod, where every process would plan
            (and calibrate) on its own: run the planner once and pass its flags.
    """
    FLAGS = flags.FLAGS
    devices = MeshShape.parse(FLAGS.mesh_shape).size
    if FLAGS.strategy != "mesh" or cluster_from_flags() is not None:
        raise ValueError("--layout=auto plans over this machine's devices (--strategy=mesh "
                         "without a cluster); for Horovod ranks or a cluster plan on one "
                         "machine (scripts/plan.py, or this script with --layout=auto) and "
                         "pass the flags it prints.")
    from tfdist.devices import split_cpu

    split_cpu(devices)  # before the planner's model starts TensorFlow
    return devices


def use_plan(ranked, script: str) -> None:
    """Prints the planner's table and sets the flags to its pick (`--layout=auto`):
    --mesh_shape, --layout, a pipeline's --num_microbatches and --pipeline_schedule, a
    split sequence's --sequence_method."""
    FLAGS = flags.FLAGS
    print(ranked.table(), flush=True)
    best = ranked.best
    FLAGS.mesh_shape, FLAGS.layout = str(best.mesh.shape), str(best.mesh.rules)
    if best.pipeline is not None:
        FLAGS.num_microbatches = best.pipeline.num_microbatches
        FLAGS.pipeline_schedule = best.pipeline.schedule_name
    if best.sequence_method is not None:
        FLAGS.sequence_method = best.sequence_method
    print(f"{script}: --layout=auto chose {best.flags}", flush=True)


def define_cluster_flags() -> None:
    """--strategy, --communication, --worker_hosts, --task_index, --devices_per_worker."""
    flags.DEFINE_enum("strategy", "mesh", ["mesh", "multi_worker", "horovod"],
                      "mesh: the mesh over this machine's devices, or over the tasks of "
                      "TF_CONFIG / --worker_hosts (single controller); multi_worker: "
                      "data parallelism between TF_CONFIG tasks; horovod: the mesh over "
                      "Horovod ranks, one device per rank (launch with horovodrun -np "
                      "<mesh size>).")
    flags.DEFINE_enum("communication", "ring", ["ring", "nccl", "auto"],
                      "Collective implementation for --strategy=multi_worker.")
    flags.DEFINE_list("worker_hosts", [], "host:port of every task (builds TF_CONFIG).")
    flags.DEFINE_integer("task_index", 0, "This task's index in --worker_hosts.")
    flags.DEFINE_integer("devices_per_worker", 0,
                         "Logical CPU devices per task (0: TFDIST_DEVICES_PER_WORKER or 1).")


def define_checkpoint_flags() -> None:
    """--checkpoint_format."""
    flags.DEFINE_enum("checkpoint_format", "npz", ["npz", "sharded"],
                      "npz: global tensors, every process gathers and the chief writes one "
                      "file (small models); sharded: each process writes only its own shards "
                      "and nothing is gathered (models bigger than one host). Both load onto "
                      "any mesh.")


def cluster_from_flags():
    """The `ClusterConfig` of --worker_hosts or TF_CONFIG, or None on one machine."""
    from tfdist.cluster import ClusterConfig

    FLAGS = flags.FLAGS
    if FLAGS.worker_hosts:
        return ClusterConfig.from_hosts(FLAGS.worker_hosts, FLAGS.task_index)
    return ClusterConfig.from_env()


def strategy_from_flags(mesh):
    """The strategy the cluster flags ask for, over `mesh` (a `tfdist.mesh.Mesh`).

    Built by `tfdist.strategies.get_strategy`: `horovod`, `multi_worker`, or
    for `--strategy=mesh` a `mesh` over this machine's (virtual CPU) devices,
    or a `mesh_cluster` when TF_CONFIG / --worker_hosts name a cluster. On a
    task that only serves a mesh over workers this does not return.

    Raises:
        ValueError: a broken TF_CONFIG / --worker_hosts, or a mesh that does
            not match the cluster's devices.
        ImportError: `--strategy=horovod` without a Horovod build.
    """
    from tfdist.strategies import get_strategy

    FLAGS = flags.FLAGS
    if FLAGS.strategy == "horovod":
        return get_strategy("horovod", mesh_shape=mesh)
    cluster = cluster_from_flags()
    if FLAGS.strategy == "multi_worker":
        if cluster is None:
            raise ValueError("--strategy=multi_worker needs TF_CONFIG or --worker_hosts.")
        if FLAGS.worker_hosts:
            import os

            os.environ["TF_CONFIG"] = cluster.to_tf_config()
        return get_strategy("multi_worker", communication=FLAGS.communication)
    if cluster is None:
        from tfdist.devices import split_cpu

        split_cpu(mesh.size)
        return get_strategy("mesh", mesh_shape=mesh)
    return get_strategy("mesh_cluster", mesh_shape=mesh, cluster=cluster,
                        devices_per_worker=FLAGS.devices_per_worker)


def devices_from_flags(mesh):
    """The mesh's devices for a pipeline (no strategy): this machine's CPUs split
    into `mesh.size`, or the devices of the cluster TF_CONFIG / --worker_hosts
    name (on a task that only serves, this does not return)."""
    cluster = cluster_from_flags()
    if cluster is None:
        import tensorflow as tf

        from tfdist.devices import split_cpu

        split_cpu(mesh.size)
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][:mesh.size]
    else:
        devices = list(cluster.start(devices_per_worker=flags.FLAGS.devices_per_worker))
    if len(devices) != mesh.size:
        raise ValueError(f"Mesh {mesh.shape} needs {mesh.size} devices; the cluster has "
                         f"{len(devices)}: {devices}.")
    return devices


# TensorFlow's native start-up and run-time notes, written by its C++ logging to
# file descriptor 2 whatever TF_CPP_MIN_LOG_LEVEL says (TF 2.21 logs through
# absl, before absl::InitializeLog): "I0000 00:00:... port.cc:153] oneDNN custom
# operations are on", "cudart_stub.cc ... Could not find cuda drivers", ...
_NATIVE_LINE = re.compile(rb"^[IW]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ")
_NATIVE_NOISE = (
    rb"WARNING: All log messages before absl::InitializeLog() is called",
    rb"To enable the following instructions:",  # the second line of cpu_feature_guard's note
    rb"failed call to cuInit",  # a machine without a GPU driver
    rb"oneDNN supports DT_INT32 only on platforms with AVX-512",  # falls back, as it says
)


def _is_native_noise(line: bytes) -> bool:
    return bool(_NATIVE_LINE.match(line)) or any(n in line for n in _NATIVE_NOISE)


def quiet_native_logs() -> None:
    """Leaves TensorFlow's native INFO/WARNING lines (and four known harmless
    errors) out of this process's stderr; everything else passes, in order.

    File descriptor 2 becomes a pipe read by a thread that drops those lines;
    at exit it is restored and the thread drained. `TFDIST_NATIVE_LOGS=1` shows
    everything.
    """
    if os.environ.get("TFDIST_NATIVE_LOGS") == "1":
        return
    sys.stderr.flush()
    real = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump():
        with os.fdopen(read_end, "rb") as source, os.fdopen(os.dup(real), "wb", 0) as sink:
            for line in source:
                if not _is_native_noise(line):
                    sink.write(line)

    thread = threading.Thread(target=pump, name="tfdist-stderr", daemon=True)
    thread.start()

    def restore():
        sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's last write end here: the pump sees EOF
        thread.join(timeout=5)  # a child process still holding the pipe: give up

    atexit.register(restore)


def fail(message) -> None:
    """Ends the script on bad input: one line on stderr, exit status 2."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def run(main) -> None:
    """absl's `app.run(main)` for tfdist's scripts.

    A bad flag (a validator's or a parser's error) and an `app.UsageError`
    raised by `main` print one line, `<script>: error: <message>`, and exit 2:
    no help text, no traceback. TensorFlow's native log notes are left out of
    stderr (`quiet_native_logs`).
    """
    quiet_native_logs()

    def parse(argv):
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            fail(e)

    def checked(argv):
        try:
            return main(argv)
        except app.UsageError as e:
            fail(e)

    app.run(checked, flags_parser=parse)
