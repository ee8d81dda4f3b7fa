"""A job for tests/cluster/test_big_model.py: a model too big for one capped process.

    python -m tfdist.launch --num_workers N --pin_cores -- \\
        tests/jobs/big_model_job.py MODE [SHAPE] [CHECKPOINT]
    python tests/jobs/big_model_job.py single

Every mode first builds and trains a tiny backbone (hidden size 8) the same
way: each process's peak address space (`VmPeak`) then, with every thread and
pool a step needs started, is its baseline. With `TFDIST_TEST_AS_BUDGET`
(bytes) every process then caps its own address space (`RLIMIT_AS`) at its
baseline plus that budget (workers, which run no program of their own, when the
controller tells them through files in `TFDIST_TEST_SIGNAL_DIR`). Modes:

- `train planned CHECKPOINT`: the planner (`tfdist.planner.plan_keras`, on the
  backbone built `unallocated()`, with the budget as `memory_per_device`) picks
  the layout and derives its `LayoutMap`; the keras-hub Gemma backbone on it,
  weights drawn shard by shard, trains 3 steps and saves a sharded checkpoint.
  (`train SHAPE CHECKPOINT`: the backbone's own layout map on a `(batch, model)`
  DeviceMesh of SHAPE instead, "1x2": tensor parallel, "2x1": FSDP.)
- `resume SHAPE CHECKPOINT`: the same backbone on SHAPE loads the checkpoint
  (weights and Adam state), checks them against the saved sums, trains 2 steps.
- `single`: the same backbone and training in one process, no strategy.

The controller prints one line `big_model MODE: {...}` (JSON: weight and slot
bytes, loss, peak RSS and peak address space of every task).
"""

import faulthandler
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tfdist.testing.memory_cap import cap_job, cap_when_told  # noqa: E402

# hidden 1024, FFN 2 x 8192 (Gemma gives each gate half of 16384), 3 layers, vocabulary 8192: 96M parameters, 1.16 GB of
# weights and Adam slots in float32.
CONFIG = dict(vocabulary_size=8192, num_layers=3, num_query_heads=8, num_key_value_heads=8,
              hidden_dim=1024, intermediate_dim=16384, head_dim=128)
TINY = dict(CONFIG, vocabulary_size=64, hidden_dim=8, intermediate_dim=16, head_dim=4)
BATCH, LENGTH, STEPS = 2, 16, 3


def parameter_count(c=CONFIG) -> int:
    """The backbone's parameters: embedding; per layer two norms, attention, gated FFN; a norm."""
    d, heads = c["hidden_dim"], c["head_dim"]
    attention = d * heads * (2 * c["num_query_heads"] + 2 * c["num_key_value_heads"])
    layer = 2 * d + attention + 3 * d * (c["intermediate_dim"] // 2)  # Gemma halves it
    return c["vocabulary_size"] * d + c["num_layers"] * layer + d


def model_bytes() -> int:
    """Bytes of the weights and Adam's two slots (float32)."""
    return 3 * 4 * parameter_count()


mode = None


def _job_status(field):
    """`field` (bytes) of every task of this job, in task order."""
    from tfdist.testing.memory import job_status

    status = job_status(field)
    return [status[k] for k in sorted(status)]


def _report(**fields):
    fields.update(vm_size=_job_status("VmSize"), vm_peak=_job_status("VmPeak"),
                  peak_rss=_job_status("VmHWM"))
    print(f"big_model {mode}: {json.dumps(fields)}", flush=True)


def _data(config):
    import numpy as np

    rng = np.random.default_rng(0)
    rows = BATCH * STEPS
    x = {"token_ids": rng.integers(0, config["vocabulary_size"], (rows, LENGTH)).astype("int32"),
         "padding_mask": np.ones((rows, LENGTH), "int32")}
    y = rng.normal(size=(rows, LENGTH, config["hidden_dim"])).astype("float32")
    return x, y


def _sums(model):
    """Sum of squares of every float32 weight and optimizer variable, each distinct shard
    summed on its own device (float64): no whole tensor is gathered."""
    import tensorflow as tf

    out = []
    for v in list(model.weights) + list(model.optimizer.variables):
        if v.dtype != "float32":
            continue
        var = v.value
        components = getattr(var, "values", (var,))
        layout = getattr(var, "layout", None) if hasattr(var, "_tfdist_layout") else None
        owners = [g[0] for g in layout.shard_owner_groups()] if layout is not None else [0]
        total = 0.0
        for i in owners:
            with tf.device(components[i].device):
                total += float(tf.reduce_sum(tf.square(tf.cast(components[i], tf.float64))))
        out.append(total)
    return out


def _build(strategy, config):
    import keras
    import keras_hub

    with strategy.scope():
        model = keras_hub.models.GemmaBackbone(**config)
        model.compile(keras.optimizers.Adam(1e-4), "mse")
        model.optimizer.build(model.trainable_variables)
    assert model.count_params() == parameter_count(config), (model.count_params(),
                                                            parameter_count(config))
    return model


def _planned(devices, budget):
    """(ModelParallel, plan fields): the planner's fastest layout of the backbone that
    fits `budget` bytes per process, and its derived LayoutMap.

    The calibration is fixed (collectives dear, compute cheap): this job is about
    memory; `bench/planner.py` measures the ranking against real steps."""
    import keras
    import keras_hub

    import tfdist.distribution as td
    from tfdist.planner import Calibration, keras_layout_map, plan_keras, unallocated

    with unallocated():  # shapes and paths only: the planner allocates no weight
        model = keras_hub.models.GemmaBackbone(**CONFIG)
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    calibration = Calibration({2: 1e10}, {(k, 2): (1e-4, 1e-9) for k in kinds}, {2: 1e-3},
                              {2: 1e-9})
    plan = plan_keras(model, devices, BATCH, LENGTH, memory_per_device=budget,
                      calibration=calibration)
    device_mesh, layout_map = keras_layout_map(model, plan.best, devices)
    fields = dict(plan=plan.best.flags, planned_total=plan.best.memory.total,
                  too_big=[f"{c.mesh.shape} {c.mesh.rules}" for c in plan.too_big])
    print(plan.table(), flush=True)
    return td.ModelParallel(layout_map=layout_map, batch_dim_name="data",
                            devices=devices), fields


def main():
    global mode
    faulthandler.enable()  # a native crash under the cap prints where it happened
    mode = sys.argv[1]
    task = json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]
    budget = int(os.environ.get("TFDIST_TEST_AS_BUDGET", "0"))  # bytes above the baseline
    signal_dir = os.environ.get("TFDIST_TEST_SIGNAL_DIR", "")
    planned = {}
    if mode == "single":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        strategy = tf.distribute.get_strategy()
    else:
        if task > 0 and budget:
            cap_when_told(signal_dir, task)
        from tfdist.cluster import ClusterConfig

        devices = ClusterConfig.from_env().start(threads=1)
        import keras
        import keras_hub

        import tfdist.distribution as td

        if sys.argv[2] == "planned":
            strategy, planned = _planned(devices, budget or None)
        else:
            shape = tuple(int(n) for n in sys.argv[2].split("x"))
            mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
            strategy = td.ModelParallel(
                layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
                batch_dim_name="batch", devices=devices)
    from tfdist import checkpoint
    from tfdist.testing.memory import device_bytes

    tasks = 1 if mode == "single" else 2
    # The baseline: the same program with a tiny backbone, so that every thread and
    # pool a step needs already exists; then each process caps itself above it.
    tiny = _build(strategy, TINY)
    tiny.fit(*_data(TINY), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    fields = dict(baseline=_job_status("VmPeak"), **planned)
    if budget:
        fields["caps"] = cap_job(signal_dir, tasks, budget)
    x, y = _data(CONFIG)
    print(f"big_model {mode} started: building the backbone", flush=True)
    model = _build(strategy, CONFIG)
    bytes_per_device = [device_bytes(model, i) for i in range(tasks)]
    fields.update(device_bytes=bytes_per_device, built_peak=_job_status("VmPeak"))
    if mode == "resume":
        path = sys.argv[3]
        checkpoint.load(model, path)
        saved = json.load(open(os.path.join(os.path.dirname(path), "sums.json")))
        restored = _sums(model)
        fields["restored_max_relative_diff"] = max(
            abs(a - b) / max(abs(b), 1e-30) for a, b in zip(restored, saved))
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    fields["loss"] = history["loss"]
    fields["fit_peak"] = _job_status("VmPeak")
    if mode == "train":
        path = sys.argv[3]
        checkpoint.save(model, path)
        fields["save_peak"] = _job_status("VmPeak")
        json.dump(_sums(model), open(os.path.join(os.path.dirname(path), "sums.json"), "w"))
    _report(**fields)


if __name__ == "__main__":
    main()
