"""A job for tests/cluster: a keras-hub Gemma backbone, its own layout map, over Horovod ranks.

    horovodrun -np 2 --gloo -H localhost:2 python tests/jobs/hvd_keras_hub_job.py SHAPE [task]

Builds `HorovodStrategy(layout_map=GemmaBackbone.get_layout_map(mesh))` over
a `DeviceMesh` of SHAPE ("1x2": tensor parallel over the ranks, "2x1": FSDP)
and compares the unmodified backbone's forward, loss, gradients, weights and
Adam slots after 10 steps with one process, printing one report line per rank
with the bytes of weights and slots this rank holds. With `task`: a
`GemmaCausalLM` with its preprocessor on raw strings instead (`fit`,
`evaluate`, `predict`, greedy `generate`; tests/distribution/test_keras_hub_tasks.py).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "distribution"))

shape = tuple(int(n) for n in sys.argv[1].split("x"))

import keras  # noqa: E402

from tfdist.strategies.horovod import HorovodStrategy  # noqa: E402

mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"),
                                     [f"cpu:{i}" for i in range(shape[0] * shape[1])])
import keras_hub  # noqa: E402

strategy = HorovodStrategy(layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
                           batch_dim_name="batch")

if sys.argv[2:] == ["task"]:
    import test_keras_hub_tasks as tasks  # noqa: E402

    report = tasks.assert_matches_one_device(strategy, tasks.run_reference())
    print(f"rank {strategy.rank} causal_lm {sys.argv[1]}: {report}", flush=True)
    sys.exit(0)

import numpy as np  # noqa: E402
from test_keras_hub import LENGTH, VOCAB, language_model  # noqa: E402

from tfdist.testing.equivalence import assert_equivalent  # noqa: E402
from tfdist.testing.memory import device_bytes  # noqa: E402

# Whole values rank 0 broadcasts (none for split variables: each rank makes its own
# shards, random ones from rank 0's seed).
broadcast, broadcast_shapes = strategy.extended.hvd.broadcast, []


def recording_broadcast(value, *args, **kwargs):
    broadcast_shapes.append(tuple(value.shape.as_list()))
    return broadcast(value, *args, **kwargs)


strategy.extended.hvd.broadcast = recording_broadcast

rng = np.random.default_rng(0)
x = {"token_ids": rng.integers(0, VOCAB, (160, LENGTH)).astype("int32"),
     "padding_mask": np.ones((160, LENGTH), "int32")}
y = rng.integers(0, VOCAB, (160, LENGTH)).astype("int32")
report = assert_equivalent(
    lambda: language_model("gemma"), strategy, x, y, reference=lambda: language_model("gemma"),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    optimizer=lambda: keras.optimizers.Adam(1e-3), batch_size=16, steps=10)
variables = report.model.weights + report.model.optimizer.variables
one_process = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)
sharded = [v for v in variables if getattr(v.value, "layout", None) is not None]
whole = sum(1 for s in broadcast_shapes if s in {tuple(v.shape) for v in sharded})
print(f"rank {strategy.rank} gemma {sys.argv[1]}: {report}; bytes {device_bytes(report.model)} "
      f"of {one_process}; sharded variables {len(sharded)}, broadcast whole {whole}", flush=True)
