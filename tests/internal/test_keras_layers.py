"""`all_layers` walks nested layers, as the planner needs to find every weight's layer."""

import keras

from tfdist.internal.keras_layers import all_layers


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(4, name="inner")

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        return self.inner(x)


def test_all_layers_reaches_a_layer_nested_in_a_custom_layer():
    model = keras.Sequential([keras.Input((3,)), Block(name="block"), keras.layers.Dense(2)])
    names = [layer.name for layer in all_layers(model)]
    assert names[0] == model.name and {"block", "inner"} <= set(names)
    assert model.name not in [layer.name for layer in all_layers(model, include_self=False)]
    paths = {v.path for layer in all_layers(model) for v in layer.weights}
    assert "sequential/block/inner/kernel" in paths or any(p.endswith("inner/kernel") for p in paths)
