"""tfdist.internal.keras_tensor_parallel: each registry entry against the installed Keras."""

import inspect
import textwrap

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfdist.distribution as td
from tfdist.internal import keras_tensor_parallel, keras_variables
from tfdist.internal.keras_distribution import layout_map_of
from tfdist.testing.collective_log import recorded_all_gathers

# The calls the tensor-parallel versions reproduce, as Keras 3.15 writes them. A
# Keras upgrade that changes one fails here first: re-read it and update the entry.
KERAS_CALLS = {
    keras.layers.Dense: """
        def call(self, inputs, training=None):
            x = ops.matmul(inputs, self.kernel)
            if self.bias is not None:
                x = ops.add(x, self.bias)
            if self.activation is not None:
                x = self.activation(x)
            return x
        """,
    keras.layers.EinsumDense: """
        def call(self, inputs, training=None):
            x = ops.einsum(self.equation, inputs, self.kernel)
            if self.bias is not None:
                x = ops.add(x, self.bias)
            if self.activation is not None:
                x = self.activation(x)
            return x
        """,
    keras.layers.Embedding: """
        def call(self, inputs):
            if inputs.dtype != "int32" and inputs.dtype != "int64":
                inputs = ops.cast(inputs, "int32")
            outputs = ops.take(self.embeddings, inputs, axis=0)
            return ops.cast(outputs, dtype=self.compute_dtype)
        """,
}


def _original(cls):
    call = cls.__dict__["call"]
    return getattr(call, "_tfdist_original", call)


@pytest.mark.parametrize("cls", list(KERAS_CALLS), ids=lambda c: c.__name__)
def test_the_replaced_calls_are_the_ones_the_registry_reproduces(cls):
    assert textwrap.dedent(inspect.getsource(_original(cls))).strip() == \
        textwrap.dedent(KERAS_CALLS[cls]).strip()


def test_reversible_embedding_is_keras_own_and_its_reverse_call_is_a_matmul():
    assert issubclass(keras_hub.layers.ReversibleEmbedding, keras.layers.ReversibleEmbedding)
    assert "call" not in keras_hub.layers.ReversibleEmbedding.__dict__
    source = inspect.getsource(_original(keras.layers.ReversibleEmbedding))
    for line in ("result = super().call(inputs)", "kernel = ops.transpose(self.embeddings)",
                 "logits = ops.matmul(inputs, kernel)", "ops.tanh(ops.divide(logits, soft_cap))"):
        assert line in source


def test_attach_sets_the_call_on_the_instance_keeping_its_signature():
    layers = [keras.layers.Dense(2), keras.layers.EinsumDense("ab,bc->ac", 2),
              keras.layers.Embedding(4, 2), keras.layers.ReversibleEmbedding(4, 2),
              keras_hub.layers.ReversibleEmbedding(4, 2)]
    for layer in layers:
        original = type(layer).call
        keras_tensor_parallel.attach(layer)
        keras_tensor_parallel.attach(layer)  # idempotent
        call = vars(layer)["call"]
        assert call.__func__._tfdist_original is original
        assert getattr(original, "_tfdist_original", None) is None  # the class is untouched
        assert inspect.signature(call) == inspect.signature(original.__get__(layer))

    class Custom(keras.layers.Dense):  # computes differently: left alone
        def call(self, inputs):
            return super().call(inputs) * 2

    custom, plain = Custom(2), keras.layers.Dense(2)
    keras_tensor_parallel.attach(custom)
    assert "call" not in vars(custom) and "call" not in vars(plain)


def test_layers_built_under_a_layout_map_get_it_and_others_do_not():
    distribution = td.ModelParallel(
        layout_map=td.LayoutMap(td.DeviceMesh((1, 2), ("batch", "model"),
                                              [f"cpu:{i}" for i in range(2)])),
        batch_dim_name="batch")
    with distribution.scope():
        inside = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    outside = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert "call" in vars(inside.layers[0]) and "call" not in vars(outside.layers[0])


def test_the_keras_variable_and_layout_map_hooks():
    seen, initializers = [], []

    def creator(next_creator, **kwargs):
        seen.append(keras_variables.keras_variable_of(kwargs["initial_value"]))
        initializers.append(type(keras_variables.initializer_of(kwargs["initial_value"])))
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        layer = keras.layers.Dense(3, name="probe")
        layer.build((2, 4))
    assert [(v.path, tuple(v.shape)) for v in seen] == [("probe/kernel", (4, 3)),
                                                        ("probe/bias", (3,))]
    assert initializers == [keras.initializers.GlorotUniform, keras.initializers.Zeros]
    assert keras_variables.keras_variable_of(lambda: 0.0) is None
    from keras.src.initializers.random_initializers import compute_fans  # keras_initial_slices

    assert compute_fans((4, 3)) == (4, 3) and compute_fans((2, 4, 3)) == (8, 6)
    mesh = td.DeviceMesh((2,), ("batch",), ["cpu:0", "cpu:1"])
    layout_map = td.LayoutMap(mesh)
    assert layout_map_of(keras.distribution.ModelParallel(layout_map=layout_map)) is layout_map


def _strategy(shape, layouts, **options):
    n = int(np.prod(shape))
    layout_map = td.LayoutMap(td.DeviceMesh(shape, ("batch", "model"),
                                            [f"cpu:{i}" for i in range(n)]))
    for key, value in layouts.items():
        layout_map[key] = value
    return td.ModelParallel(layout_map=layout_map, **options)


def _global_gradient(var, parts):
    layout = getattr(var.value, "layout", None)
    if layout is None:
        return np.sum(parts, axis=0)
    full = np.zeros(layout.shape)
    for group in layout.shard_owner_groups():
        full[layout.shard_slices(group[0])] = np.sum([parts[i] for i in group], axis=0)
    return full


def _sharded_run(strategy, layer, x, probe, call_kwargs):
    """Output rows, global gradients of sum(output * probe), and the shapes all-gathered."""
    n = strategy.num_replicas_in_sync
    rows = x.shape[0] // n

    def replica():
        i = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
        xs, ps = x[i * rows:(i + 1) * rows], probe[i * rows:(i + 1) * rows]
        with tf.GradientTape() as tape:
            y = layer(xs, **call_kwargs)
            loss = tf.reduce_sum(y * tf.cast(ps, y.dtype))
        return y, tape.gradient(loss, [v.value for v in layer.trainable_weights])

    with recorded_all_gathers(strategy) as gathered:
        y, grads = tf.function(lambda: strategy.run(replica))()
    outputs = np.concatenate([t.numpy() for t in strategy.experimental_local_results(y)])
    grads = [_global_gradient(v, [tf.convert_to_tensor(g).numpy()
                                  for g in strategy.experimental_local_results(grad)])
             for v, grad in zip(layer.trainable_weights, grads)]
    return outputs, grads, gathered


CASES = {
    "dense_column": (lambda: keras.layers.Dense(12, activation="relu", name="l"),
                     {"l/kernel": (None, "model")}, (8, 3, 10), {}),
    "dense_row": (lambda: keras.layers.Dense(6, name="l"), {"l/kernel": ("model", None)},
                  (8, 10), {}),
    "dense_row_fsdp": (lambda: keras.layers.Dense(6, name="l"),
                       {"l/kernel": ("model", "batch")}, (8, 10), {}),
    "einsum_column": (lambda: keras.layers.EinsumDense("btd,dnh->btnh", (3, 4, 5), bias_axes="nh",
                                                       name="l"),
                      {"l/kernel": (None, "model", None), "l/bias": ("model",)}, (8, 3, 10),
                      {}),
    "einsum_row": (lambda: keras.layers.EinsumDense("btnh,nhd->btd", (3, 6), bias_axes="d",
                                                    activation="tanh", name="l"),
                   {"l/kernel": ("model", None, "batch")}, (8, 3, 4, 5), {}),
    "embedding_vocab": (lambda: keras.layers.Embedding(20, 6, name="l"),
                        {"l/embeddings": ("model", "batch")}, (8, 5), {}),
    "embedding_features": (lambda: keras.layers.Embedding(20, 6, name="l"),
                           {"l/embeddings": (None, "model")}, (8, 5), {}),
    "reverse_tied": (lambda: keras_hub.layers.ReversibleEmbedding(20, 6, logit_soft_cap=3.0,
                                                                  name="l"),
                     {"l/embeddings": ("model", None)}, (8, 5, 6), {"reverse": True}),
    # FSDP alone (split over the batch axis only; not split on 1x2):
    "dense_fsdp": (lambda: keras.layers.Dense(6, activation="tanh", name="l"),
                   {"l/kernel": ("batch", None), "l/bias": ("batch",)}, (8, 10), {}),
    "einsum_fsdp": (lambda: keras.layers.EinsumDense("...d,dnh->...nh", (4, 5), bias_axes="h",
                                                     name="l"),
                    {"l/kernel": ("batch", None, None)}, (8, 3, 10), {}),
    "embedding_fsdp": (lambda: keras.layers.Embedding(20, 6, name="l"),
                       {"l/embeddings": ("batch", None)}, (8, 5), {}),
    "reverse_fsdp": (lambda: keras_hub.layers.ReversibleEmbedding(20, 6, name="l"),
                     {"l/embeddings": ("batch", None)}, (8, 5, 6), {"reverse": True}),
}


@pytest.mark.parametrize("shape", [(1, 2), (2, 2)])
@pytest.mark.parametrize("case", list(CASES))
def test_each_entry_equals_the_keras_call_and_gathers_no_tensor_parallel_weight(case, shape):
    make, layouts, x_shape, call_kwargs = CASES[case]
    rng = np.random.default_rng(0)
    if case.startswith("embedding"):
        x = rng.integers(0, 20, x_shape).astype("int32")
    else:
        x = rng.normal(size=x_shape).astype("float32")
    reference = make()
    build_shape = (None, 5) if case.startswith("reverse") else x_shape
    reference.build(build_shape)
    strategy = _strategy(shape, layouts)
    with strategy.scope():
        layer = make()
        layer.build(build_shape)
    layer.set_weights(reference.get_weights())
    probe = rng.normal(size=reference.compute_output_shape(x_shape)
                       if not case.startswith("reverse") else x_shape[:-1] + (20,))
    with tf.GradientTape() as tape:
        expected = reference(x, **call_kwargs)
        loss = tf.reduce_sum(expected * probe)
    expected_grads = tape.gradient(loss, reference.trainable_weights)
    outputs, grads, gathered = _sharded_run(strategy, layer, x, probe, call_kwargs)
    np.testing.assert_allclose(outputs, expected.numpy(), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, tf.convert_to_tensor(want).numpy(), rtol=1e-5,
                                   atol=1e-5)
    for var in layer.trainable_weights:
        layout = var.value.layout if hasattr(var.value, "layout") else None
        if layout is not None and "batch" not in layout.sharded_mesh_axes:
            shard = (1,) + tuple(var.value.values[0].shape)
            assert shard not in gathered, f"{var.path} was gathered: {gathered}"


# Ops that pass a gathered weight on unchanged in value (the gather's own
# unstack/concat and custom-gradient identities, reads, casts, transposes).
_PASS_THROUGH = {"Unpack", "ConcatV2", "Identity", "IdentityN", "Cast", "Transpose", "Reshape"}


def _weights_kept_for_the_backward_pass(strategy, layer, x):
    """Forward all-gathers of a weight whose result an op of the backward pass reads.

    Replica 0's ops (the others are named `replica_1/...`), split by creation
    order: the backward pass is every op made from the tape's first op on.
    """

    def replica():  # the input's gradient too, as for any layer but the first
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x))
        return tape.gradient(loss, [x] + [v.value for v in layer.trainable_weights])

    graph = tf.function(lambda: strategy.run(replica)).get_concrete_function().graph
    ops = [op for op in graph.get_operations() if not op.name.startswith("replica_")]
    start = next(i for i, op in enumerate(ops) if "gradient_tape" in op.name.split("/"))
    backward = {op.name for op in ops[start:]}

    def reads_a_variable(op):
        if op.type == "ReadVariableOp":
            return True
        return op.type in _PASS_THROUGH | {"CollectiveGatherV2", "ExpandDims", "StridedSlice"} \
            and any(reads_a_variable(t.op) for t in op.inputs)

    kept, gathers = [], [op for op in ops[:start]
                         if op.type == "CollectiveGatherV2" and reads_a_variable(op)]
    assert gathers, "the forward pass gathers the weight"
    for op in gathers:
        frontier, readers = [op], []
        while frontier:
            for out in frontier.pop().outputs:
                for consumer in out.consumers():
                    (frontier if consumer.type in _PASS_THROUGH else readers).append(consumer)
        if any(r.name in backward for r in readers):
            kept.append(op.name)
    return kept


class OtherEinsumDense(keras.layers.EinsumDense):
    """A subclass: tfdist runs its own call, whose gathered read the tape keeps."""


@pytest.mark.parametrize("make, layout", [
    (lambda cls: cls("btd,de->bte", (3, 16), name="l"), ("batch", None)),  # FSDP
    (lambda cls: cls("btd,de->bte", (3, 16), name="l"), ("batch", "model")),  # FSDP + TP
], ids=["fsdp", "fsdp_and_tensor_parallel"])
def test_fsdp_gathers_again_in_the_backward_pass_instead_of_keeping_the_weight(make, layout):
    x = tf.ones((2, 3, 8))
    kept = {}
    for cls in (OtherEinsumDense, keras.layers.EinsumDense):
        strategy = _strategy((2, 2), {"l/kernel": layout})
        with strategy.scope():
            layer = make(cls)
            layer.build((None, 3, 8))
        kept[cls] = _weights_kept_for_the_backward_pass(strategy, layer, x)
    assert kept[OtherEinsumDense], "the check finds a gathered weight the tape keeps"
    assert kept[keras.layers.EinsumDense] == []
    strategy = _strategy((2, 2), {"l/kernel": layout}, reshard_after_forward=False)
    with strategy.scope():
        layer = make(keras.layers.EinsumDense)
        layer.build((None, 3, 8))
    assert _weights_kept_for_the_backward_pass(strategy, layer, x)  # asked to keep it


@pytest.mark.parametrize("layout", [("batch", None), (None, "batch")], ids=["rows", "columns"])
def test_an_fsdp_embedding_gathers_its_table_for_the_forward_pass_only(layout):
    # A lookup's table gradient needs no table value: the backward pass gathers nothing
    # (its gradient reduce-scatter gathers ids and rows, reading no variable) and keeps
    # nothing. (Its values: test_each_entry_equals_the_keras_call...[embedding_fsdp-*].)
    strategy = _strategy((2, 2), {"e/embeddings": layout})
    with strategy.scope():
        layer = keras.layers.Embedding(16, 8, name="e")
        layer.build((None, 3))
    ids = tf.constant([[1, 2, 15], [0, 7, 7]])
    assert _weights_kept_for_the_backward_pass(strategy, layer, ids) == []

    def replica():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids))
        return tape.gradient(loss, layer.embeddings.value)

    graph = tf.function(lambda: strategy.run(replica)).get_concrete_function().graph
    ops = [op for op in graph.get_operations() if not op.name.startswith("replica_")]
    start = next(i for i, op in enumerate(ops) if "gradient_tape" in op.name.split("/"))

    def reads_a_variable(op):
        return op.type == "ReadVariableOp" or any(reads_a_variable(t.op) for t in op.inputs)

    gathers = [op for op in ops if op.type == "CollectiveGatherV2" and reads_a_variable(op)]
    assert len(gathers) == 1 and ops.index(gathers[0]) < start, [op.name for op in gathers]


def _gather_waits(strategy, layers, x):
    """For replica 0's forward and backward weight gathers, in trace order: the tensors
    their shard read waits for (control inputs of the `Identity` before the gather)."""

    def replica():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x
            for layer in layers:
                y = layer(y)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, [v.value for layer in layers for v in layer.trainable_weights])

    graph = tf.function(lambda: strategy.run(replica)).get_concrete_function().graph
    ops = [op for op in graph.get_operations() if not op.name.startswith("replica_")]
    waits = [[c.name for c in op.control_inputs] for op in ops
             if op.type == "Identity" and op.control_inputs
             and op.inputs[0].op.type == "ReadVariableOp"]
    return waits, {op.name: op for op in ops}


@pytest.mark.parametrize("prefetch", [False, True])
def test_prefetch_gathers_each_fsdp_weight_one_layer_ahead(prefetch):
    strategy = _strategy((2, 1), {"l\\d/kernel": ("batch", None)}, prefetch=prefetch)
    with strategy.scope():
        layers = [keras.layers.Dense(8, name=f"l{i}", use_bias=False) for i in range(3)]
        for layer in layers:
            layer.build((None, 8))
    waits, ops = _gather_waits(strategy, layers, tf.ones((4, 8)))
    assert len(waits) == 6 and all(len(w) == 1 for w in waits), waits
    forward, backward = [w[0] for w in waits[:3]], [w[0] for w in waits[3:]]
    # Without prefetching, each gather waits for its own layer's input (its output's
    # gradient); prefetching, the second and third wait for the layer before's.
    assert len(set(forward)) == 3 - prefetch and len(set(backward)) == 3 - prefetch
    if prefetch:
        assert forward[1] == forward[0] and backward[1] == backward[0]
    assert all(not ops[name].type.startswith("Collective") for name in forward + backward)
