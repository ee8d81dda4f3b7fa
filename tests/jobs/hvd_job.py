"""A job for tests/cluster: Keras fit/evaluate under HorovodStrategy.

    horovodrun -np 2 --gloo -H localhost:2 python tests/jobs/hvd_job.py [--compression fp16]

Trains the same model as a one-process reference on the same global batches
(30 Adam steps) and prints, per rank, the largest relative weight difference,
a weight checksum (identical on all ranks) and evaluate's loss.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

parser = argparse.ArgumentParser()
parser.add_argument("--compression", default="none")
parser.add_argument("--steps_per_execution", type=int, default=1)
parser.add_argument("--die_rank", type=int, default=-1, help="This rank dies at epoch 1.")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--pid_dir", default="", help="Each rank writes rank-<r>.pid at epoch 1.")
parser.add_argument("--global_clipnorm", type=float, default=None)
parser.add_argument("--batch_shares", default="",
                    help="'1,3': fixed shares; 'speed': SpeedProportionalBatches every 3 batches "
                         "with a probe that finds rank 1 three times faster")
args = parser.parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdist.callbacks import is_chief  # noqa: E402
from tfdist.strategies.horovod import HorovodStrategy  # noqa: E402

shares = None
if args.batch_shares:
    shares = "equal" if args.batch_shares == "speed" else \
        [float(v) for v in args.batch_shares.split(",")]
strategy = HorovodStrategy(compression=args.compression, batch_shares=shares)
rng = np.random.default_rng(0)
x = rng.normal(size=(30 * 16, 8)).astype("float32")
y = rng.integers(0, 4, size=(30 * 16,)).astype("int32")


def build():
    keras.utils.set_random_seed(strategy.rank)  # different seeds: rank 0's weights must win
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(4)])
    # Clipping with SGD: Adam would hide a wrong clip scale (it is scale-invariant).
    optimizer = (keras.optimizers.SGD(0.5, global_clipnorm=args.global_clipnorm)
                 if args.global_clipnorm else keras.optimizers.Adam(0.01))
    model.compile(optimizer,
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=args.steps_per_execution)
    return model


with strategy.scope():
    model = build()
initial = [w.copy() for w in model.get_weights()]


class Die(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1 and args.pid_dir:
            with open(os.path.join(args.pid_dir, f"rank-{strategy.rank}.pid"), "w") as f:
                f.write(str(os.getpid()))
        if epoch == 1 and strategy.rank == args.die_rank:
            print(f"rank {strategy.rank}: dying", flush=True)
            os._exit(17)


callbacks = [Die()]
if args.batch_shares == "speed":
    from tfdist.callbacks import SpeedProportionalBatches

    speed = SpeedProportionalBatches(every=3, smoothing=0.5,
                                     probe=lambda: 0.003 if strategy.rank == 0 else 0.001)
    callbacks.append(speed)
model.fit(x, y, batch_size=16, epochs=args.epochs, shuffle=False, verbose=0, callbacks=callbacks)
last_rows = [int(r) for r in strategy.extended._rows.numpy()]  # every rank's, last train step
result = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
predictions = model.predict(x, batch_size=16, verbose=0)

reference = build()
reference.set_weights(initial)
reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
expected = reference.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
diff = max(float(np.abs(a - b).max() / np.abs(b).max())
           for a, b in zip(model.get_weights(), reference.get_weights()))
pred_diff = float(np.abs(predictions - reference.predict(x, batch_size=16, verbose=0)).max())
# A last batch of 5 rows (37 = 2 * 16 + 5), split 2 + 3 over the ranks: every row, in
# order, as the same model predicts them in full batches.
rest = model.predict(x[:37], batch_size=16, verbose=0)
rest_diff = float(np.abs(rest - predictions[:37]).max())
assert len(rest) == 37 and rest_diff < 1e-6, (len(rest), rest_diff)
checksum = sum(float(np.abs(w).sum()) for w in model.get_weights())
print(f"rank {strategy.rank} chief={is_chief(strategy)}: weights rel diff {diff:.2e}, "
      f"checksum {checksum:.6f}, initial checksum {sum(float(np.abs(w).sum()) for w in initial):.6f}, "
      f"loss {result['loss']:.6f} vs {expected['loss']:.6f}, "
      f"predict rows {len(predictions)} diff {pred_diff:.2e}, "
      f"accuracy {result['accuracy']:.4f} vs {expected['accuracy']:.4f}, "
      f"shares {getattr(strategy, 'batch_shares', None)}, last train rows {last_rows}",
      flush=True)
