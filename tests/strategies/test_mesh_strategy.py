"""MeshStrategy: true shards, routing of gradients, errors, strategy names."""

import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.layers import ShardedDense
from tfdist.mesh import Mesh
from tfdist.models import build_token_mlp, make_copy_task
from tfdist.strategies import STRATEGY_NAMES, MeshStrategy, get_strategy

LAYOUT = "batch:data;d_ff:model;vocab:model"


def _trained_mlp(mesh, steps=2):
    x, y = make_copy_task(16 * steps)
    strategy = MeshStrategy(mesh, LAYOUT)
    with strategy.scope():
        model = build_token_mlp()
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, verbose=0)
    return strategy, model


def test_weights_and_slots_are_one_shard_per_device():
    strategy, model = _trained_mlp("data:2;model:2")
    kernel = model.get_layer("ffn1_in").kernel  # [d_model=8, d_ff=32], d_ff on model:2
    components = kernel.value.values
    assert len(components) == 4
    assert [tuple(c.shape) for c in components] == [(8, 16)] * 4
    assert [c.device for c in components] == list(strategy.devices)
    per_device_bytes = components[0].shape.num_elements() * 4
    assert per_device_bytes * 2 == np.prod(kernel.shape) * 4
    slots = [v for v in model.optimizer.variables if "ffn1_in_kernel" in v.path]
    assert len(slots) == 2  # momentum and velocity
    for slot in slots:
        assert [tuple(c.shape) for c in slot.value.values] == [(8, 16)] * 4
        assert tuple(slot.shape) == (8, 32)
    table = model.get_layer("embed").embeddings  # [vocab=16, 8], vocab on model:2
    assert [tuple(c.shape) for c in table.value.values] == [(8, 8)] * 4
    replicated = model.get_layer("ffn1_out").bias  # [d_model]
    assert [tuple(c.shape) for c in replicated.value.values] == [(8,)] * 4


def test_shards_are_slices_of_the_global_weight():
    _, model = _trained_mlp("data:2;model:2")
    kernel = model.get_layer("ffn2_out").kernel  # [d_ff=32, d_model=8], d_ff split
    full = kernel.numpy()
    assert full.shape == (32, 8)
    for i, component in enumerate(kernel.value.values):
        model_index = i % 2
        np.testing.assert_array_equal(component.numpy(), full[16 * model_index:16 * (model_index + 1)])
    # Replicas that hold the same shard stay identical after training.
    c = kernel.value.values
    np.testing.assert_array_equal(c[0].numpy(), c[2].numpy())
    np.testing.assert_array_equal(c[1].numpy(), c[3].numpy())


def test_evaluate_and_predict_are_global():
    x, y = make_copy_task(32, seed=3)
    keras.utils.set_random_seed(0)
    reference = build_token_mlp()
    reference.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    strategy = MeshStrategy("data:2;model:2", LAYOUT)
    with strategy.scope():
        model = build_token_mlp()
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.set_weights(reference.get_weights())
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=16, verbose=0),
                               reference.evaluate(x, y, batch_size=16, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=16, verbose=0),
                               reference.predict(x, batch_size=16, verbose=0), rtol=1e-5, atol=1e-6)


def test_sharded_weight_refuses_a_globally_reduced_gradient():
    strategy = MeshStrategy("data:2;model:2", "d_ff:model")
    with strategy.scope():
        layer = ShardedDense(8, ("d_model", "d_ff"))
        layer.build((None, 4))
    var = layer.kernel.value

    @tf.function
    def step():
        per_replica = strategy.run(lambda: tf.ones((4, 4)))
        reduced = strategy.extended.reduce_to("SUM", per_replica, destinations=var)
        return strategy.extended.update(var, lambda v, g: v.assign_sub(g), args=(reduced,))

    with pytest.raises(ValueError, match="did not route"):
        step()


def test_jit_compile_falls_back_with_a_warning_and_trains():
    x, y = make_copy_task(32)
    strategy = MeshStrategy("data:2;model:2", LAYOUT)
    with strategy.scope():
        model = build_token_mlp()
        with pytest.warns(UserWarning, match="jit_compile"):
            model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          jit_compile=True)
    assert model.jit_compile is False
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_run_eagerly_gives_a_clear_error():
    x, y = make_copy_task(16)
    strategy = MeshStrategy("data:1;model:2", LAYOUT)
    with strategy.scope():
        model = build_token_mlp()
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      run_eagerly=True)
    with pytest.raises(RuntimeError, match="run_eagerly=False"):
        model.fit(x, y, batch_size=16, verbose=0)


def test_wrong_device_count_is_rejected():
    with pytest.raises(ValueError, match="data:2;model:4 has 8 devices but 2 devices were given"):
        MeshStrategy("data:2;model:4", devices=["/cpu:0", "/cpu:1"])
    with pytest.raises(ValueError, match=r"needs 16 devices but found 8 CPU devices"):
        MeshStrategy("data:4;model:4")
    with pytest.raises(ValueError, match="appears twice"):
        MeshStrategy("data:2", devices=["/cpu:0", "/cpu:0"])
    with pytest.raises(ValueError, match="'cpu', 'gpu' or None; received devices='tpu'"):
        MeshStrategy("data:2", devices="tpu")


def test_a_mesh_larger_than_the_gpus_raises_instead_of_falling_back_to_cpus(monkeypatch):
    from tfdist.strategies.mesh_strategy import resolve_devices

    real = tf.config.list_logical_devices
    fake_gpus = [types.SimpleNamespace(name=f"/device:GPU:{i}") for i in range(2)]
    monkeypatch.setattr(tf.config, "list_logical_devices",
                        lambda kind=None: fake_gpus if kind == "GPU" else real(kind))
    mesh = Mesh.parse("data:2;model:2")
    with pytest.raises(ValueError, match="needs 4 devices but found 2 GPUs.*devices='cpu'"):
        resolve_devices(mesh)
    assert resolve_devices(Mesh.parse("data:2")) == ["/device:GPU:0", "/device:GPU:1"]
    assert resolve_devices(mesh, "cpu") == [d.name for d in real("CPU")][:4]


def test_layer_that_does_not_divide_fails_at_build_naming_it():
    strategy = MeshStrategy("data:1;model:4", "d_ff:model")
    with strategy.scope():
        layer = ShardedDense(6, ("d_model", "d_ff"), name="ffn")
        with pytest.raises(ValueError) as e:
            layer.build((None, 8))
    for part in ("Layer 'ffn' weight 'kernel'", "'d_ff'", "size 6", "'model'", "size 4"):
        assert part in str(e.value)
    assert not layer.weights


def test_layer_mapping_two_dims_to_one_axis_fails_at_build():
    strategy = MeshStrategy("data:2;model:2", "d_model:model;d_ff:model")
    with strategy.scope():
        layer = ShardedDense(8, ("d_model", "d_ff"), name="ffn")
        with pytest.raises(ValueError, match="Layer 'ffn' weight 'kernel'.*same mesh axis 'model'"):
            layer.build((None, 4))


def test_layout_pointing_at_missing_mesh_axis_fails_in_the_constructor():
    with pytest.raises(ValueError, match="'d_ff:model'"):
        MeshStrategy("data:4", "d_ff:model")


def test_get_strategy_by_name():
    assert {"default", "one_device", "mirrored", "mesh", "averaging"} <= set(STRATEGY_NAMES)
    mesh = get_strategy("mesh", mesh_shape="data:2;model:2", layout="d_ff:model")
    assert isinstance(mesh, MeshStrategy) and mesh.num_replicas_in_sync == 4
    assert get_strategy("default") is tf.distribute.get_strategy()
    assert get_strategy("one_device").num_replicas_in_sync == 1
    assert get_strategy("mirrored", devices=["/cpu:0", "/cpu:1"]).num_replicas_in_sync == 2
    with pytest.raises(ValueError, match=r"Unknown strategy 'horovd'.*\['default', 'one_device', 'mirrored', 'mesh', "):
        get_strategy("horovd")
    with pytest.raises(ValueError, match="takes no options"):
        get_strategy("default", mesh_shape="data:2")


def test_a_layer_built_outside_the_scope_raises_when_the_mesh_runs_it():
    layer = ShardedDense(8, ("d_model", "d_ff"), name="outside")
    layer.build((None, 4))  # no strategy: whole weights
    strategy = MeshStrategy("data:1;model:2", "d_ff:model")

    @tf.function
    def step():
        return strategy.run(lambda: layer(tf.ones((2, 4))))

    with pytest.raises(ValueError, match=r"Layer 'outside' was built for mesh .* but is called in "
                                         r"a replica of MeshStrategy.*scope"):
        step()
    # Outside any replica the layer reads global weights: the single-device result.
    with strategy.scope():
        inside = ShardedDense(8, ("d_model", "d_ff"), name="inside")
        inside.build((None, 4))
    x = np.ones((2, 4), "float32")
    np.testing.assert_allclose(inside(x), x @ inside.kernel.numpy() + inside.bias.numpy(), rtol=1e-6)


def test_a_trace_that_fails_part_way_leaves_the_strategy_usable():
    from tfdist import collectives

    # The timeout bounds the hang this test guards against (the retrace pairing
    # replica 0's second psum with replica 1's first).
    strategy = MeshStrategy("data:1;model:2", collective_timeout=30)
    fail = [True]

    def replica_fn(x):
        y = collectives.psum(x, "model")
        replica = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
        if fail[0] and replica == 0:
            raise ValueError("a bad shape caught while tracing")
        return collectives.psum(y * 2.0, "model")

    def step(x):
        return strategy.run(replica_fn, args=(x,))

    with pytest.raises(ValueError, match="a bad shape caught while tracing"):
        tf.function(step)(tf.ones([2]))
    fail[0] = False
    out = tf.function(step)(tf.ones([2]))
    for value in strategy.experimental_local_results(out):
        np.testing.assert_array_equal(value.numpy(), [8.0, 8.0])  # (1 + 1) * 2 summed twice
