"""A job for tests/cluster: Keras fit/evaluate/predict under multi-worker data parallelism.

Run in every task with a TF_CONFIG (python -m tfdist.launch --num_workers 2 --
tests/jobs/mw_job.py [--plain] [--remat] [--keras_hub_task] [--backup DIR --die_at_epoch E
[--die_task T]]). Trains the
same small model as a single-process reference on the same global batches
and prints the largest weight difference. The data are partial batches: 37
rows in batches of 8 (the last 5 rows split unevenly over the workers) with
sample weights, and an evaluation in batches of 12 (the last batch is one row:
one worker gets none); --plain uses
tf.distribute.MultiWorkerMirroredStrategy itself (which Keras 3 fails under:
keras#20585).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

parser = argparse.ArgumentParser()
parser.add_argument("--plain", action="store_true")
parser.add_argument("--backup", default="")
parser.add_argument("--die_at_epoch", type=int, default=-1)
parser.add_argument("--die_task", type=int, default=-1, help="Only this task dies (-1: all).")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--keras_hub_task", action="store_true",
                    help="Instead: a keras-hub GemmaCausalLM with its tokenizer on raw strings "
                         "(tests/distribution/test_keras_hub_tasks.py) against one process.")
parser.add_argument("--remat", action="store_true",
                    help="The distributed model recomputes its layers (keras.RematScope); the "
                         "reference keeps activations.")
args = parser.parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras.config.disable_traceback_filtering() if os.environ.get("TRACE") else None
from tfdist.callbacks import BackupAndRestore, is_chief  # noqa: E402
from tfdist.strategies import MultiWorkerStrategy  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy() if args.plain else MultiWorkerStrategy()
task = strategy.cluster_resolver.task_id
if args.keras_hub_task:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "distribution"))
    import test_keras_hub_tasks as tasks  # noqa: E402

    report = tasks.assert_matches_one_device(strategy, tasks.run_reference())
    print(f"task {task} causal_lm: {report}", flush=True)
    sys.exit(0)
rng = np.random.default_rng(0)
ROWS, BATCH = 37, 8
x = rng.normal(size=(ROWS, 8)).astype("float32")
y = rng.integers(0, 4, size=(ROWS,)).astype("int32")
w = rng.uniform(0.5, 2.0, size=(ROWS,)).astype("float32")


def build(remat=False):
    keras.utils.set_random_seed(0)
    import contextlib

    with keras.RematScope(mode="full") if remat else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(4)])
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"],
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="w_acc")])
    return model


class Die(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == args.die_at_epoch and args.die_task in (-1, task):
            print(f"task {task}: dying at epoch {epoch}", flush=True)
            os._exit(17)


with strategy.scope():
    model = build(remat=args.remat)
callbacks = [Die()]
if args.backup:
    callbacks.append(BackupAndRestore(args.backup))
args_fit = dict(batch_size=BATCH, epochs=args.epochs, shuffle=False, verbose=0)
history = model.fit(x, y, sample_weight=w, callbacks=callbacks, **args_fit).history
result = model.evaluate(x, y, sample_weight=w, batch_size=12, verbose=0, return_dict=True)
predictions = model.predict(x, batch_size=BATCH, verbose=0)

reference = build()
expected_history = reference.fit(x, y, sample_weight=w, **args_fit).history
expected = reference.evaluate(x, y, sample_weight=w, batch_size=12, verbose=0, return_dict=True)
diff = max(float(np.abs(a - b).max() / np.abs(b).max())
           for a, b in zip(model.get_weights(), reference.get_weights()))
history_diff = max(abs(a - b) for k in history for a, b in zip(history[k],
                                                               expected_history[k][-len(history[k]):]))
metrics_diff = max(abs(result[k] - expected[k]) for k in expected)
pred_diff = float(np.abs(predictions - reference.predict(x, batch_size=BATCH, verbose=0)).max())
print(f"task {task} chief={is_chief(strategy)}: weights rel diff {diff:.2e}, "
      f"predict diff {pred_diff:.2e}, predict rows {len(predictions)}, "
      f"loss {result['loss']:.6f} vs {expected['loss']:.6f}, "
      f"accuracy {result['accuracy']:.4f} vs {expected['accuracy']:.4f}, "
      f"history diff {history_diff:.2e}, evaluate diff {metrics_diff:.2e}, recomputed layers "
      f"{sum(layer._remat_mode is not None for layer in model.layers)}", flush=True)
