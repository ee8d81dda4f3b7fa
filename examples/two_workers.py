"""Tensor-parallel training over two worker processes (a mesh over TF_CONFIG tasks).

    python -m tfdist.launch --num_workers 2 -- examples/two_workers.py

`tfdist.launch` starts this program twice on loopback, each with its
TF_CONFIG (on real hosts: `python -m tfdist.launch --hosts h1,h2 --print --
examples/two_workers.py` prints the commands). Task 0 is the controller: it
builds a `MeshStrategy` over the devices of both tasks and runs an unmodified
Keras `fit`; task 1 serves its device and exits when the controller is done.
The feed-forward's hidden units (`d_ff`) and the vocabulary are split over the
two processes, so each holds half of those weights and of their Adam slots.
"""

import argparse

from tfdist.cluster import ClusterConfig

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--d_ff", type=int, default=512)
args = parser.parse_args()

cluster = ClusterConfig.from_env()
if cluster is None:
    raise SystemExit("two_workers.py: no TF_CONFIG; start it with "
                     "`python -m tfdist.launch --num_workers 2 -- examples/two_workers.py`")
devices = cluster.start()  # on task 1 this serves the controller, then exits

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdist.layers import ShardedDense, ShardedEmbedding  # noqa: E402
from tfdist.strategies import MeshStrategy  # noqa: E402
from tfdist.testing.memory import device_bytes  # noqa: E402

VOCAB, LENGTH, D_MODEL, BATCH = 64, 8, 64, 32
strategy = MeshStrategy("data:1;model:2", "d_ff:model;vocab:model", devices=devices)

# Copy task: each target token is a fixed permutation of its input token.
rng = np.random.default_rng(0)
x = rng.integers(0, VOCAB, size=(args.steps * BATCH, LENGTH)).astype("int32")
y = (7 * x + 3) % VOCAB

keras.utils.set_random_seed(0)
with strategy.scope():
    ids = keras.Input((LENGTH,), dtype="int32")
    h = ShardedEmbedding(VOCAB, D_MODEL, name="embed")(ids)  # vocabulary split
    f = ShardedDense(args.d_ff, ("d_model", "d_ff"), activation="relu", output_sharded=True,
                     name="ffn_in")(h)  # column parallel: each device's hidden units
    h = h + ShardedDense(D_MODEL, ("d_ff", "d_model"), input_sharded=True,
                         name="ffn_out")(f)  # row parallel: summed over the devices
    logits = ShardedDense(VOCAB, ("d_model", "vocab"), name="logits")(h)
    model = keras.Model(ids, logits)
    model.compile(keras.optimizers.Adam(3e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
hosts = sorted({d.split("/device")[0] for d in devices})
print(f"mesh data:1;model:2 over {hosts}")
history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
print(f"{args.steps} steps: loss {history.history['loss'][0]:.4f}, "
      f"accuracy {history.history['accuracy'][0]:.3f}; each process holds "
      f"{device_bytes(model):,} bytes of weights and Adam slots")
