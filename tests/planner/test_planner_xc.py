"""The planner on train_xc.py's extreme classifier: bytes per device equal a real
MeshStrategy's, the collectives it counts equal the traced ones, and --layout=auto."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.config import MeshConfig, XCConfig
from tfdist.planner import Calibration, plan_xc, state_bytes, xc_inventory, xc_work
from tfdist.strategies import MeshStrategy
from tfdist.testing.collective_log import recorded
from tfdist.testing.memory import device_bytes

# 101 classes pad to 104 on 4 devices (26 each), to 102 on 2.
CONFIG = XCConfig(MeshConfig("data:1;model:1", "batch:data"), num_classes=101, d_model=8,
                  batch_size=8, label_smoothing=0.1)
MESHES = [("data:4", "batch:data"), ("data:2;model:2", "batch:data;classes:model"),
          ("data:1;model:4", "batch:data;classes:model")]


def _built(strategy, config):
    from tfdist.layers import (ShardedSoftmax, ShardedSparseCategoricalCrossentropy,
                               ShardedTopKAccuracy)

    C = config.num_classes
    with strategy.scope():
        inputs = keras.Input((config.d_model,))
        model = keras.Model(inputs, ShardedSoftmax(C, name="head")(inputs))
        model.compile(keras.optimizers.Adam(),
                      ShardedSparseCategoricalCrossentropy(C, config.label_smoothing),
                      metrics=[ShardedTopKAccuracy(C, k=1), ShardedTopKAccuracy(C, k=5)])
        model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.parametrize("mesh_shape,layout", MESHES)
def test_weights_and_optimizer_bytes_equal_the_strategys(mesh_shape, layout):
    strategy = MeshStrategy(mesh_shape, layout)
    weights, optimizer, _ = state_bytes(xc_inventory(CONFIG, strategy.mesh), strategy.mesh)
    model = _built(strategy, CONFIG)
    assert {device_bytes(model, i) for i in range(4)} == {weights + optimizer}


@pytest.mark.parametrize("mesh_shape,layout", MESHES[1:])
def test_predicted_collectives_equal_the_traced_ones(mesh_shape, layout):
    from tfdist.layers import ShardedSparseCategoricalCrossentropy, ShardedTopKAccuracy

    strategy = MeshStrategy(mesh_shape, layout)
    model = _built(strategy, CONFIG)
    C = CONFIG.num_classes
    loss_fn = ShardedSparseCategoricalCrossentropy(C, CONFIG.label_smoothing)
    with strategy.scope():
        metrics = [ShardedTopKAccuracy(C, k=1), ShardedTopKAccuracy(C, k=5)]
    rows = CONFIG.batch_size // strategy.mesh.size
    x = tf.constant(np.random.default_rng(0).normal(size=(rows, CONFIG.d_model)), tf.float32)
    y = tf.constant(np.arange(rows) * 7, tf.int32)

    def replica_step():
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        for metric in metrics:
            metric.update_state(y, logits)
        return tape.gradient(loss, model.trainable_variables)

    with recorded(strategy, "all_gather") as gathers, recorded(strategy, "all_reduce") as sums:
        tf.function(lambda: strategy.run(replica_step)).get_concrete_function()
    got = {name: sum(int(np.prod(s)) for s in shapes) * 4 // strategy.mesh.size
           for name, shapes in (("all_gather", gathers), ("all_reduce", sums))}
    want = {"all_gather": 0, "all_reduce": 0}
    for c in xc_work(CONFIG, strategy.mesh).collectives:  # no gradient sums counted
        want[c.kind] += c.count * c.bytes
    assert got["all_gather"] == want["all_gather"] > 0, (want, got)
    assert got["all_reduce"] == want["all_reduce"] > 0, (want, got)


def test_a_head_too_big_for_data_parallelism_is_split_by_classes():
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    calibration = Calibration({4: 1e10}, {(k, n): (1e-4, 1e-9) for k in kinds for n in (2, 4)},
                              {4: 1e-3}, {4: 1e-9})
    config = dataclasses.replace(CONFIG, num_classes=100_000, d_model=64, batch_size=64)
    whole = 3 * 4 * (64 + 1) * 100_000  # kernel, bias and Adam's two slots
    plan = plan_xc(config, 4, memory_per_device=int(0.6 * whole), calibration=calibration)
    assert str(plan.best.mesh.shape) == "data:1;model:4"
    assert str(plan.best.mesh.rules) == "batch:data;classes:model"
    assert [str(c.mesh.shape) for c in plan.too_big] == ["data:2;model:2", "data:4;model:1"]
    # Adam's iteration counter and learning rate: 12 bytes more
    assert plan.too_big[-1].memory.weights + plan.too_big[-1].memory.optimizer == whole + 12
