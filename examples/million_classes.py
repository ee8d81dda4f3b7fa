"""A classifier over a million classes, its softmax split over the devices.

    python examples/million_classes.py                         # 1,000,000 classes on 2 devices
    python examples/million_classes.py --sample_rate=0.1       # Partial FC: 10% of each shard

The output layer's `[d_model, classes]` kernel is split by class over the
`model` axis (`classes:model`): each device computes logits for its own
classes, and the softmax, the cross-entropy and top-k accuracy combine the
shards with a max, a sum and a top-k over the axis, never gathering the
`[batch, classes]` logits. With `--sample_rate` below 1, training uses only
that fraction of each shard's classes (the batch's positives always kept,
as in Partial FC); evaluation uses all of them.
"""

import argparse

import tfdist

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--num_classes", type=int, default=1_000_000)
parser.add_argument("--devices", type=int, default=2, help="Size of the model axis.")
parser.add_argument("--d_model", type=int, default=64)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch_size", type=int, default=256)
parser.add_argument("--sample_rate", type=float, default=1.0)
args = parser.parse_args()
tfdist.split_cpu(args.devices)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdist.data.xc import synthetic_batch  # noqa: E402
from tfdist.layers import (ShardedSoftmax, ShardedSparseCategoricalCrossentropy,  # noqa: E402
                           ShardedTopKAccuracy)
from tfdist.strategies import MeshStrategy  # noqa: E402

C = args.num_classes
strategy = MeshStrategy(f"data:1;model:{args.devices}", "batch:data;classes:model")

# Synthetic task: each class has a prototype; an example is its class's prototype
# plus noise, classes drawn with Zipf frequencies (tfdist.data.xc).
rng = np.random.default_rng(0)
x, y = map(np.concatenate, zip(*[synthetic_batch(rng, args.batch_size, C, args.d_model)
                                 for _ in range(args.steps)]))
x_test, y_test = synthetic_batch(np.random.default_rng(1), 1024, C, args.d_model)

keras.utils.set_random_seed(0)
with strategy.scope():
    features = keras.Input((args.d_model,))
    labels = keras.Input((), dtype="int32")
    head = ShardedSoftmax(C, kernel_initializer="zeros", sample_rate=args.sample_rate,
                          name="head")
    model = keras.Model(features, head(features))  # [batch, C] logits, split by class
    model.compile(keras.optimizers.Adam(0.05), ShardedSparseCategoricalCrossentropy(C),
                  metrics=[ShardedTopKAccuracy(C, k=1), ShardedTopKAccuracy(C, k=5)])
    if args.sample_rate < 1:  # the sampled softmax needs the labels and adds its own loss
        train_model = keras.Model([features, labels], head(features, labels=labels))
        train_model.compile(keras.optimizers.Adam(0.05), loss=None)
        train_x = (x, y)
    else:
        train_model, train_x = model, x

layout = head.weight_layouts["kernel"]
print(f"{C:,} classes: kernel {layout.shape} -> {layout.local_shape} per device")
train_model.fit(train_x, y, batch_size=args.batch_size, epochs=1, verbose=2)
result = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0, return_dict=True)
print(f"held-out top-1 {result['top1_accuracy']:.3f}, top-5 {result['top5_accuracy']:.3f}")
