"""A custom training loop (`strategy.run` in a `tf.function`) on a 2x2 mesh.

    python examples/custom_training_loop.py                  # data:2 x model:2
    python examples/custom_training_loop.py --mesh=1,1       # the same loop on one device

An MLP whose hidden layer is split over the `model` axis (Megatron's column /
row pair, from a Keras `LayoutMap`) and whose batch is split over `batch`,
trained by a loop you write yourself: the global batch goes through
`strategy.experimental_distribute_dataset`, each replica computes its loss
scaled by the global batch size, and `optimizer.apply_gradients` inside
`strategy.run` routes every gradient to its shard. The losses printed are
those of one device (run it with `--mesh=1,1` to compare).
"""

import argparse

import tfdist

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--mesh", default="2,2", help="batch,model: the mesh's two axis sizes.")
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--batch_size", type=int, default=64)
parser.add_argument("--hidden", type=int, default=256)
args = parser.parse_args()
data_size, model_size = (int(n) for n in args.mesh.split(","))
tfdist.split_cpu(data_size * model_size)  # virtual CPU devices, before TF starts

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

devices = [f"cpu:{i}" for i in range(data_size * model_size)]
mesh = keras.distribution.DeviceMesh((data_size, model_size), ("batch", "model"), devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["hidden/kernel"] = (None, "model")  # column parallel: each device's hidden units
layout_map["hidden/bias"] = ("model",)
layout_map["out/kernel"] = ("model", None)  # row parallel: contracts the local units
strategy = tfdist.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")

# A regression task: y = sin(x W) for a fixed random W.
rng = np.random.default_rng(0)
x = rng.normal(size=(args.steps * args.batch_size, 32)).astype("float32")
y = np.sin(x @ rng.normal(size=(32, 8)).astype("float32") / 4)

keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((32,)),
                              keras.layers.Dense(args.hidden, activation="relu", name="hidden"),
                              keras.layers.Dense(8, name="out")])
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)

dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size, drop_remainder=True)
batches = iter(strategy.experimental_distribute_dataset(dataset))


@tf.function
def train_step(batch):
    def step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(x, training=True) - y), axis=-1)
            loss = tf.reduce_sum(per_example) / args.batch_size  # the global batch's mean
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = strategy.run(step, args=batch)
    return strategy.reduce("SUM", losses, axis=None)


for i in range(args.steps):
    loss = float(train_step(next(batches)))
    if i % 10 == 0 or i == args.steps - 1:
        print(f"step {i}: loss {loss:.6f}")
from tfdist.testing.memory import device_bytes  # noqa: E402

print(f"{strategy.num_replicas_in_sync} replicas; device 0 holds {device_bytes(model):,} bytes of "
      f"weights and Adam slots ({4 * model.count_params():,} bytes of weights in all); "
      f"final loss {loss:.6f}")
