"""A Keras model trained by Horovod ranks, its optimizer state split over them (ZeRO-2).

    horovodrun -np 2 --gloo -H localhost:2 python examples/horovod_job.py

One process per device (here per CPU core). `HorovodStrategy` is a
`tf.distribute` strategy whose replicas are the Horovod ranks: each rank reads
its own slice of every global batch, gradients are summed with Horovod's
collectives (Gloo), and with `zero_stage=2` each rank keeps only its slice of
the Adam slots (and reduce-scatters the gradients). An unmodified Keras
`compile` / `fit` / `evaluate`; every rank ends with the same weights, which
equal one process training on the whole batches.
"""

import argparse

import keras
import numpy as np

from tfdist.strategies import HorovodStrategy

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--batch_size", type=int, default=64, help="Global batch (all ranks).")
parser.add_argument("--hidden", type=int, default=512)
args = parser.parse_args()

strategy = HorovodStrategy(zero_stage=2)

# Classify points by which of 4 random directions they are closest to.
rng = np.random.default_rng(0)
x = rng.normal(size=(args.steps * args.batch_size, 16)).astype("float32")
y = np.argmax(x @ rng.normal(size=(16, 4)), axis=-1).astype("int32")

keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(args.hidden, activation="relu"),
                              keras.layers.Dense(4)])
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
history = model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
loss, accuracy = model.evaluate(x[:1024], y[:1024], batch_size=args.batch_size, verbose=0)
checksum = sum(float(np.abs(w).sum()) for w in model.get_weights())
print(f"rank {strategy.rank} of {strategy.num_replicas_in_sync}: {args.steps} steps, "
      f"training loss {history.history['loss'][0]:.4f}, evaluate loss {loss:.4f} accuracy "
      f"{accuracy:.3f}, weight checksum {checksum:.6f}", flush=True)
