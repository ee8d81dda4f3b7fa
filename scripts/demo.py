"""Trains a small sharded model on a virtual CPU mesh and checks it against one device.

The model (tfdist.models.build_token_mlp) uses every sharded layer form:
a vocabulary-split embedding, Megatron column/row-parallel FFNs and a
vocabulary-split output layer. The same initial weights and global batches
are trained on the mesh and on a single device; the demo prints the loss,
accuracy, how each weight is stored per device, and the max relative
difference between the two runs' weights.

    python scripts/demo.py --mesh_shape='data:2;model:2' \
        --layout='batch:data;d_ff:model;vocab:model' --steps=200
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from tfdist.config import MeshConfig, TrainConfig  # noqa: E402
from flag_utils import run, validate_mesh_flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("mesh_shape", "data:2;model:2", "Mesh-TF mesh shape.")
    flags.DEFINE_string("layout", "batch:data;d_ff:model;vocab:model", "Mesh-TF layout rules.")
    flags.DEFINE_integer("steps", 200, "Optimizer steps (over 5 epochs).")
    flags.DEFINE_integer("batch_size", 32, "Global batch size.")
    flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
    flags.DEFINE_integer("seed", 0, "Seed of data and initial weights.")
    flags.DEFINE_string("model_dir", None, "If set, write config.json and a global checkpoint here.")
    validate_mesh_flags()



def config_from_flags() -> TrainConfig:
    return TrainConfig(
        mesh=MeshConfig(FLAGS.mesh_shape, FLAGS.layout),
        steps=FLAGS.steps,
        batch_size=FLAGS.batch_size,
        learning_rate=FLAGS.learning_rate,
        seed=FLAGS.seed,
    ).validate()


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        config = config_from_flags()
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    mesh = config.mesh.mesh()

    from tfdist.devices import split_cpu

    split_cpu(max(mesh.size, 1))
    import keras

    from tfdist import checkpoint
    from tfdist.models import build_token_mlp, make_copy_task
    from tfdist.strategies import get_strategy
    from tfdist.testing.equivalence import max_rel_diff
    from tfdist.testing.reference import reference_model

    epochs = 5 if config.steps % 5 == 0 else 1
    n = config.steps // epochs * config.batch_size
    x, y = make_copy_task(n, config.vocab_size, config.length, seed=config.seed)
    x_test, y_test = make_copy_task(512, config.vocab_size, config.length, seed=config.seed + 1)
    build = lambda: build_token_mlp(config.vocab_size, config.d_model, config.d_ff, config.length)  # noqa: E731
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    keras.utils.set_random_seed(config.seed)
    reference = reference_model(build())
    strategy = get_strategy("mesh", mesh_shape=mesh)
    with strategy.scope():
        model = build()
        model.compile(keras.optimizers.Adam(config.learning_rate), loss, metrics=["accuracy"])
    model.set_weights(reference.get_weights())
    reference.compile(keras.optimizers.Adam(config.learning_rate), loss, metrics=["accuracy"])

    print(f"tfdist demo: {mesh} on {len(strategy.devices)} virtual CPU devices")
    for layer in model.layers:
        for name, layout in getattr(layer, "weight_layouts", {}).items():
            where = "replicated" if not layout.is_sharded else f"split over {', '.join(layout.sharded_mesh_axes)}"
            print(f"  {layer.name}/{name}: global {layout.shape} -> {layout.local_shape} per device ({where})")

    start = time.time()
    history = model.fit(x, y, batch_size=config.batch_size, epochs=epochs, shuffle=False, verbose=2)
    mesh_seconds = time.time() - start
    reference.fit(x, y, batch_size=config.batch_size, epochs=epochs, shuffle=False, verbose=0)
    test_loss, test_acc = model.evaluate(x_test, y_test, batch_size=config.batch_size, verbose=0)
    diff = max(max_rel_diff(a, b) for a, b in zip(model.get_weights(), reference.get_weights()))

    print(f"trained {config.steps} steps on the mesh in {mesh_seconds:.1f}s: "
          f"loss {history.history['loss'][0]:.3f} -> {history.history['loss'][-1]:.3f}")
    print(f"held-out accuracy {test_acc:.3f} (loss {test_loss:.3f})")
    print(f"max relative difference of weights vs the single-device run: {diff:.2e}")
    if FLAGS.model_dir:
        os.makedirs(FLAGS.model_dir, exist_ok=True)
        with open(os.path.join(FLAGS.model_dir, "config.json"), "w") as f:
            json.dump(_as_dict(config), f, indent=2)
        checkpoint.save(model, checkpoint.final_path(FLAGS.model_dir))
        print(f"config and global checkpoint written to {FLAGS.model_dir}")
    if diff > 1e-4:
        print("FAILED: the mesh run drifted from the single-device run", file=sys.stderr)
        return 1
    return 0


def _as_dict(config):
    import dataclasses

    return dataclasses.asdict(config)


if __name__ == "__main__":
    define_flags()
    run(main)
