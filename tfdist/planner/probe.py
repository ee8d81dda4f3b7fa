"""The cost model's constants, measured on the machine it runs on.

A short probe, run in a fresh process per device count (TF fixes its devices
at start-up), measures on a `MeshStrategy` over `n` devices of this process
(`split_cpu`):

- the matmul rate per device when all `n` devices multiply at once
  (`[rows, d] x [d, d]` float32, inside one `strategy.run`);
- for each collective (all-reduce, all-gather, reduce-scatter, all-to-all) over
  the `n` devices, the time of one call at a small and a large input: the
  latency alpha and the seconds per byte beta of `alpha + beta * bytes`;
- the seconds per byte of an optimizer update (Adam's arithmetic on a weight,
  its gradient and two slots, all float32) when all `n` devices update at once;
- the fixed cost of one step (a `strategy.run` of nothing but a scalar sum).

Two engines: `mesh`, the devices of one process (`split_cpu`, sharing the
cores); `processes`, one device per process, processes pinned one per core
(`tfdist.launch.local.run_local(pin_cores=True)`, one intra-op thread each), a
mesh over their TF_CONFIG workers (collectives over loopback gRPC).

Results are cached per machine (host name and CPU count) and engine in
`~/.cache/tfdist/planner/` (`TFDIST_PLANNER_CACHE` overrides the directory);
`Calibration.measure` re-uses them unless asked to re-measure.

    python -m tfdist.planner.probe --devices 4   # one device count, JSON on stdout
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from typing import Dict, Sequence, Tuple

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
ENGINES = ("mesh", "processes")
SMALL_BYTES = 4 << 10
LARGE_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured constants of the cost model, per device count.

    Args:
        matmul_flops: `{n: FLOP/s per device while n devices multiply}`.
        collectives: `{(kind, n): (alpha seconds, beta seconds per byte)}`.
        step_seconds: `{n: seconds of an empty step on n devices}`.
        update_seconds: `{n: seconds per weight byte of an Adam update while n
            devices update}`.
        machine: where it was measured.
    """

    matmul_flops: Dict[int, float]
    collectives: Dict[Tuple[str, int], Tuple[float, float]]
    step_seconds: Dict[int, float]
    update_seconds: Dict[int, float] = dataclasses.field(default_factory=dict)
    machine: str = ""

    def collective_seconds(self, kind: str, group: int, nbytes: float) -> float:
        """`kind` over `group` devices of `nbytes` each; a "send" (a pipeline's
        hand-off between two devices) costs what a 2-device all_gather of the
        same bytes does: there too each device sends them once."""
        if group <= 1:
            return 0.0
        if kind == "send":
            kind, group = "all_gather", 2
        alpha, beta = self._nearest(self.collectives, (kind, group))
        return alpha + beta * nbytes

    def compute_seconds(self, flops: float, devices: int) -> float:
        return flops / self._nearest(self.matmul_flops, devices)

    def overhead_seconds(self, devices: int) -> float:
        return self._nearest(self.step_seconds, devices)

    def update_seconds_for(self, weight_bytes: float, devices: int) -> float:
        return weight_bytes * self._nearest(self.update_seconds, devices)

    @staticmethod
    def _nearest(table, key):
        if key in table:
            return table[key]
        if isinstance(key, tuple):  # the same kind at the nearest measured group size
            same = [k for k in table if k[0] == key[0]]
            if not same:
                raise KeyError(f"no {key[0]} measured; measured: {sorted(table)}")
            return table[min(same, key=lambda k: abs(k[1] - key[1]))]
        return table[min(table, key=lambda k: abs(k - key))]

    def merged(self, other: "Calibration") -> "Calibration":
        return Calibration({**self.matmul_flops, **other.matmul_flops},
                           {**self.collectives, **other.collectives},
                           {**self.step_seconds, **other.step_seconds},
                           {**self.update_seconds, **other.update_seconds}, self.machine)

    def to_json(self) -> dict:
        return {"machine": self.machine,
                "matmul_flops": {str(n): r for n, r in self.matmul_flops.items()},
                "collectives": {f"{k}:{n}": list(ab) for (k, n), ab in self.collectives.items()},
                "step_seconds": {str(n): s for n, s in self.step_seconds.items()},
                "update_seconds": {str(n): s for n, s in self.update_seconds.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        colls = {}
        for key, ab in data["collectives"].items():
            kind, n = key.rsplit(":", 1)
            colls[(kind, int(n))] = tuple(ab)
        return cls({int(n): r for n, r in data["matmul_flops"].items()}, colls,
                   {int(n): s for n, s in data["step_seconds"].items()},
                   {int(n): s for n, s in data.get("update_seconds", {}).items()},
                   data.get("machine", ""))

    @classmethod
    def measure(cls, device_counts: Sequence[int], refresh: bool = False,
                engine: str = "mesh") -> "Calibration":
        """The calibration for `device_counts` on `engine` (`ENGINES`), from the
        cache or measured now (one probe job per missing count, seconds each)."""
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r}; valid engines: {ENGINES}.")
        path = cache_path(engine)
        cached = None
        if os.path.exists(path) and not refresh:
            with open(path) as f:
                cached = cls.from_json(json.load(f))
        have = set(cached.update_seconds) if cached else set()
        result = cached or cls({}, {}, {}, {}, machine_name())
        for n in sorted(set(device_counts) - have):
            result = result.merged(_probe_process(n, engine))
        if result is not cached:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(result.to_json(), f, indent=1)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file
        return result


def machine_name() -> str:
    return f"{socket.gethostname()}-{os.cpu_count()}cpu"


def cache_path(engine: str = "mesh") -> str:
    root = os.environ.get("TFDIST_PLANNER_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "tfdist", "planner"))
    suffix = "" if engine == "mesh" else f"-{engine}"
    return os.path.join(root, f"{machine_name()}{suffix}.json")


def _probe_process(n: int, engine: str = "mesh") -> Calibration:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    command = [sys.executable, "-m", "tfdist.planner.probe", "--devices", str(n)]
    if engine == "mesh":
        out = subprocess.run(command, capture_output=True, text=True, env=env)
        if out.returncode:
            raise RuntimeError(f"the planner's probe on {n} devices failed:\n"
                               f"{out.stderr[-3000:]}")
        return Calibration.from_json(json.loads(out.stdout.strip().splitlines()[-1]))
    import io
    import tempfile

    from tfdist.launch.local import run_local

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "probe.json")
        log = io.StringIO()
        status = run_local(command + ["--processes", "--result", result], n, pin_cores=True,
                           linger_s=2.0, out=log)
        if status or not os.path.exists(result):
            raise RuntimeError(f"the planner's probe over {n} processes failed (status "
                               f"{status}):\n{log.getvalue()[-3000:]}")
        with open(result) as f:
            return Calibration.from_json(json.load(f))


def _timed(fn, repeats: int = 7) -> float:
    fn()  # trace and warm up
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def probe(n: int, rows: int = 1024, width: int = 512, matmuls: int = 8,
          devices=None) -> Calibration:
    """Measures the constants on `n` devices (see the module docstring): this
    process's CPU split in `n`, or the given `devices` (a cluster's)."""
    if devices is None:
        from tfdist.devices import split_cpu

        split_cpu(n)
    import tensorflow as tf

    from tfdist import collectives
    from tfdist.strategies.mesh_strategy import MeshStrategy

    strategy = MeshStrategy(f"data:{n}", "batch:data", devices=devices)
    axis = "data"

    def run(fn, *args):
        @tf.function
        def step():
            return strategy.run(fn, args=args)

        return lambda: tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t,
                                             strategy.experimental_local_results(step()))

    with strategy.scope():  # variables: inputs that grappler cannot fold into constants
        x0 = tf.Variable(tf.random.stateless_normal([rows, width], seed=[1, 2]))
        w = tf.Variable(tf.random.stateless_normal([width, width], seed=[3, 4]) * 0.03)
        data = tf.Variable(tf.random.stateless_normal([LARGE_BYTES // 4], seed=[5, 6]))

        def matmuls_fn():
            x = x0
            for _ in range(matmuls):
                x = tf.matmul(x, w)
            return tf.reduce_sum(x)

        def empty_fn():
            return tf.reduce_sum(tf.ones([4]))

        base = _timed(run(empty_fn))
        seconds = max(_timed(run(matmuls_fn)) - base, 1e-9)
        rate = 2.0 * rows * width * width * matmuls / seconds

        weight = tf.Variable(data)  # Adam on a LARGE_BYTES weight, as Keras's Adam computes it
        slots = [tf.Variable(tf.zeros_like(data)) for _ in range(2)]

        def update_fn():
            g = data * 1e-3
            slots[0].assign_add((g - slots[0]) * 0.1)
            slots[1].assign_add((tf.square(g) - slots[1]) * 0.001)
            weight.assign_sub(slots[0] * 1e-3 / (tf.sqrt(slots[1]) + 1e-7))
            return tf.constant(0.0)

        update = max(_timed(run(update_fn)) - base, 0.0) / LARGE_BYTES

        def collective(kind, nbytes):
            floats = max(n, nbytes // 4 // n * n)

            def fn():
                x = data[:floats]
                if kind == "all_reduce":
                    y = collectives.psum(x, axis)
                elif kind == "all_gather":
                    y = collectives.all_gather(x, axis, dim=0)
                elif kind == "reduce_scatter":
                    y = collectives.reduce_scatter(x, axis, dim=0)
                else:
                    y = collectives.all_to_all(tf.reshape(x, [n, -1]), axis, split_dim=0,
                                               concat_dim=0)
                return tf.reduce_sum(y)

            return max(_timed(run(fn)) - base, 0.0)

        colls = {}
        for kind in KINDS:
            small, large = collective(kind, SMALL_BYTES), collective(kind, LARGE_BYTES)
            beta = max(large - small, 0.0) / (LARGE_BYTES - SMALL_BYTES)
            colls[(kind, n)] = (max(small - beta * SMALL_BYTES, 0.0), beta)
    return Calibration({n: rate}, colls if n > 1 else {}, {n: base}, {n: update}, machine_name())


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--processes", action="store_true",
                        help="run as a task of a tfdist.launch job, one device per task")
    parser.add_argument("--result", help="--processes: where the controller writes the JSON")
    args = parser.parse_args(argv)
    if not args.processes:
        print(json.dumps(probe(args.devices).to_json()), flush=True)
        return 0
    from tfdist.cluster import ClusterConfig

    devices = ClusterConfig.from_env().start(threads=1, inter_op_threads=2)  # serves elsewhere
    data = probe(args.devices, devices=list(devices)).to_json()
    with open(args.result + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(args.result + ".tmp", args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
