"""Trains an extreme classifier whose classes are split over the mesh.

    python scripts/train_xc.py --num_classes=1000000 --mesh_shape='data:1;model:2' \
        --layout='batch:data;classes:model' --steps=100 --model_dir=/tmp/xc

Data: a built-in synthetic task (class prototypes plus noise, Zipf class
frequencies) or XMC/libsvm files (--train_file/--test_file). Writes the
config, a checkpoint (--checkpoint_format) and TensorBoard logs to --model_dir,
with a backup every --backup_every steps that a run with the same --model_dir
resumes from, on any mesh; prints held-out top-1/top-5 accuracy.
"""

import dataclasses
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from tfdist.config import MeshConfig, XCConfig  # noqa: E402
from flag_utils import (define_checkpoint_flags, define_cluster_flags,  # noqa: E402
                        define_plan_flags, devices_to_plan, parse_bytes, run,
                        strategy_from_flags, use_plan, validate_mesh_flags)

FLAGS = flags.FLAGS


def define_flags():
    defaults = XCConfig()
    flags.DEFINE_string("mesh_shape", defaults.mesh.mesh_shape, "Mesh-TF mesh shape.")
    flags.DEFINE_string("layout", defaults.mesh.layout,
                        "Mesh-TF layout rules, or 'auto': the planner picks the mesh shape and "
                        "rules over --mesh_shape's devices, prints its table and trains on it.")
    flags.DEFINE_integer("num_classes", defaults.num_classes, "Number of classes C.")
    flags.DEFINE_integer("d_model", defaults.d_model, "Feature / hidden size.")
    flags.DEFINE_integer("batch_size", defaults.batch_size, "Global batch size.")
    flags.DEFINE_integer("steps", defaults.steps, "Optimizer steps.")
    flags.DEFINE_float("learning_rate", defaults.learning_rate, "Adam learning rate.")
    flags.DEFINE_float("label_smoothing", defaults.label_smoothing, "Label smoothing over all C.")
    flags.DEFINE_float("sample_rate", defaults.sample_rate,
                       "Class-centre sampling (Partial FC) for training: fraction of each "
                       "shard's classes in the softmax, positives always kept; 1 = all.")
    flags.DEFINE_string("train_file", "", "XMC/libsvm training file (default: synthetic).")
    flags.DEFINE_string("test_file", "", "XMC/libsvm held-out file.")
    flags.DEFINE_integer("eval_examples", defaults.eval_examples, "Synthetic held-out examples.")
    flags.DEFINE_integer("seed", defaults.seed, "Seed.")
    flags.DEFINE_string("model_dir", None, "Where to write config, checkpoint and logs.")
    flags.DEFINE_integer("backup_every", defaults.backup_every,
                         "With --model_dir: back up every so many steps (0: once, at the "
                         "end); a run with the same --model_dir resumes from the newest.")
    validate_mesh_flags(allow_auto=True)
    define_plan_flags()
    define_cluster_flags()
    define_checkpoint_flags()


def config_from_flags() -> XCConfig:
    return XCConfig(
        mesh=MeshConfig(FLAGS.mesh_shape, FLAGS.layout), num_classes=FLAGS.num_classes,
        d_model=FLAGS.d_model, batch_size=FLAGS.batch_size, steps=FLAGS.steps,
        learning_rate=FLAGS.learning_rate, label_smoothing=FLAGS.label_smoothing,
        sample_rate=FLAGS.sample_rate, train_file=FLAGS.train_file, test_file=FLAGS.test_file,
        eval_examples=FLAGS.eval_examples, seed=FLAGS.seed,
        backup_every=FLAGS.backup_every).validate()


def plan_from_flags():
    """The planner's ranking of this script's model over the devices of --mesh_shape,
    each bounded by --memory_per_device."""
    from tfdist.planner import plan_xc

    devices = devices_to_plan()
    FLAGS.layout = "batch:data"  # any valid rules: the config is checked, then planned
    config = config_from_flags()
    return plan_xc(config, devices, memory_per_device=parse_bytes(FLAGS.memory_per_device))


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        if FLAGS.layout == "auto":
            use_plan(plan_from_flags(), "train_xc")
        config = config_from_flags()
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    mesh = config.mesh.mesh()
    if FLAGS.strategy == "multi_worker":  # data parallel between tasks: no mesh here
        from tfdist.mesh import Mesh

        mesh = Mesh.parse(";".join(f"{n}:1" for n in mesh.shape.names), config.mesh.layout)
    try:
        strategy = strategy_from_flags(mesh)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    import keras
    import numpy as np

    from tfdist import checkpoint
    from tfdist.data.xc import read_xmc, synthetic_batch
    from tfdist.layers import ShardedSoftmax, ShardedSparseCategoricalCrossentropy, ShardedTopKAccuracy
    from tfdist.callbacks import BackupAndRestore, is_chief

    C = config.num_classes
    if config.train_file:
        try:
            x, y = read_xmc(config.train_file)
            x_test, y_test = read_xmc(config.test_file, num_features=x.shape[1])
        except (ValueError, FileNotFoundError) as e:  # a malformed or missing file
            raise app.UsageError(str(e)) from None
        if max(y.max(), y_test.max()) >= C:
            raise app.UsageError(f"labels go up to {max(y.max(), y_test.max())} but num_classes={C}.")
        reps = -(-config.steps * config.batch_size // len(x))
        x, y = np.tile(x, (reps, 1))[: config.steps * config.batch_size], np.tile(y, reps)[: config.steps * config.batch_size]
    else:
        rng = np.random.default_rng(config.seed)
        batches = [synthetic_batch(rng, config.batch_size, C, config.d_model, seed=config.seed)
                   for _ in range(config.steps)]
        x, y = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])
        x_test, y_test = synthetic_batch(np.random.default_rng(config.seed + 1),
                                         config.eval_examples, C, config.d_model, seed=config.seed)
    keras.utils.set_random_seed(config.seed)
    chief = is_chief(strategy)
    with strategy.scope():
        inputs = keras.Input((x.shape[1],))
        head = ShardedSoftmax(C, kernel_initializer="zeros", sample_rate=config.sample_rate,
                              label_smoothing=config.label_smoothing, name="head")
        model = keras.Model(inputs, head(inputs))
        train_model = model
        if config.sample_rate < 1:  # the sampled head needs the labels to keep positives
            labels = keras.Input((), dtype="int32")
            train_model = keras.Model([inputs, labels], head(inputs, labels=labels))
        model.compile(keras.optimizers.Adam(config.learning_rate),
                      ShardedSparseCategoricalCrossentropy(C, config.label_smoothing),
                      metrics=[ShardedTopKAccuracy(C, k=1), ShardedTopKAccuracy(C, k=5)])
        if train_model is not model:  # the sampled head adds its own loss
            train_model.compile(keras.optimizers.Adam(config.learning_rate), loss=None)
    layout = model.get_layer("head").weight_layouts["kernel"]
    print(f"train_xc: {C:,} classes on {mesh} ({strategy.num_replicas_in_sync} replicas); "
          f"head kernel {layout.shape} -> "
          f"{layout.local_shape} per device"
          + (f"; training samples {config.sample_rate:g} of each shard's classes"
             if config.sample_rate < 1 else ""))
    callbacks = []
    if FLAGS.model_dir and chief:  # one writer: the chief (or the mesh's controller)
        os.makedirs(FLAGS.model_dir, exist_ok=True)
        with open(os.path.join(FLAGS.model_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(config), f, indent=2)
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(FLAGS.model_dir, "logs")))
    train_x = (x, y) if config.sample_rate < 1 else x
    every = config.backup_every or config.steps
    done = 0
    if FLAGS.model_dir:  # an epoch per backup; a rerun resumes after the newest
        backup = BackupAndRestore(os.path.join(FLAGS.model_dir, checkpoint.BACKUP_DIR),
                                  delete_checkpoint=False,
                                  checkpoint_format=FLAGS.checkpoint_format)
        callbacks.insert(0, backup)
        done = backup.latest_epoch() + 1
    import tensorflow as tf

    batches = tf.data.Dataset.from_tensor_slices((train_x, y)).batch(config.batch_size)
    train_model.fit(batches.skip(done * every), epochs=config.steps // every,
                    steps_per_epoch=every, verbose=2, callbacks=callbacks)
    result = model.evaluate(x_test, y_test, batch_size=config.batch_size, verbose=0, return_dict=True)
    print(f"held-out top-1 {result['top1_accuracy']:.3f}, top-5 {result['top5_accuracy']:.3f} "
          f"(loss {result['loss']:.3f}, {len(x_test)} examples)")
    if FLAGS.model_dir:
        fmt = checkpoint.format_named(FLAGS.checkpoint_format)  # npz: the chief writes
        checkpoint.save(model, checkpoint.final_path(FLAGS.model_dir, fmt), fmt=fmt)
    if FLAGS.model_dir and chief:
        print(f"config, checkpoint and TensorBoard logs in {FLAGS.model_dir}")
    return 0


if __name__ == "__main__":
    define_flags()
    run(main)
