"""`tfdist.internal.keras_graph` against the installed Keras: what crosses a cut,
and nested functional models inlined (Keras's `_keras_history` / `_inbound_nodes`)."""

import keras
import numpy as np

from tfdist.internal.keras_graph import crossings, inline, producers


def _nested():
    """An outer model around an inner functional model that reads both inputs
    (a backbone with a mask), and a head reusing the inner model's first layer."""
    ids = keras.Input((5,), dtype="int32", name="ids")
    mask = keras.Input((5,), dtype="float32", name="mask")
    embed = keras.layers.Embedding(11, 4, name="embed")
    h = embed(ids)
    h = keras.layers.Dense(4, name="block_0")(h)
    h = keras.layers.Multiply(name="masked_0")([h, keras.layers.Reshape((5, 1))(mask)])
    h = keras.layers.Dense(4, name="block_1")(h)
    h = keras.layers.Multiply(name="masked_1")([h, keras.layers.Reshape((5, 1))(mask)])
    inner = keras.Model({"ids": ids, "mask": mask}, h, name="inner")
    out = keras.layers.Dense(11, name="head")(inner(inner.input))
    return keras.Model(inner.input, out, name="outer"), inner


def test_producers_are_the_calls_arguments():
    model, _ = _nested()
    head = model.get_layer("head")
    assert [id(t) for t in producers(head.output)] == [id(head.input)]  # the inner call's output
    assert producers(model.input["ids"]) == []


def test_inline_calls_the_nested_models_layers_in_its_place():
    keras.utils.set_random_seed(0)
    model, inner = _nested()
    flat = inline(model)
    assert "inner" not in [layer.name for layer in flat.layers]
    assert {"embed", "block_0", "block_1", "masked_1", "head"} <= {
        layer.name for layer in flat.layers}
    assert {id(w) for w in flat.weights} == {id(w) for w in model.weights}  # no copy
    x = {"ids": np.arange(10).reshape(2, 5) % 11,
         "mask": np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], "float32")}
    np.testing.assert_allclose(flat.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)
    assert inline(inner) is inner  # nothing nested: the model itself


def test_crossings_carry_what_later_stages_read_from_before_the_cut():
    model, _ = _nested()
    flat = inline(model)
    inputs = keras.tree.flatten(flat.input)
    cut_0, cut_1 = flat.get_layer("block_0").output, flat.get_layer("block_1").output
    lists = crossings(inputs, [cut_0, cut_1], flat.outputs)
    assert lists[0] == inputs and lists[-1] == flat.outputs
    # after block_0: its output and the mask, which block_1's stage reads again
    assert lists[1][0] is cut_0 and [t.name for t in lists[1][1:]] == ["mask"]
    # after block_1: its output and the mask (masked_1 is on the last stage)
    assert lists[2][0] is cut_1 and [t.name for t in lists[2][1:]] == ["mask"]
    # a cut after which nothing earlier is read: only the cut tensor
    last = flat.get_layer("masked_1").output
    assert crossings(inputs, [last], flat.outputs)[1] == [last]
