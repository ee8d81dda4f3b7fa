"""keras-hub 0.32's Llama decoder block cannot give its config; tfdist builds it."""

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

from tfdist.internal.keras_hub_configs import layer_config  # noqa: E402


def test_the_llama_decoder_config_clones_the_block():
    keras.utils.set_random_seed(0)
    from keras_hub.src.models.llama.llama_decoder import LlamaTransformerDecoder

    block = LlamaTransformerDecoder(intermediate_dim=12, num_query_heads=2,
                                    num_key_value_heads=1, rope_position_scaling_factor=2.0,
                                    rope_frequency_adjustment_factor=None, dropout=0.0,
                                    name="block")
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    y = block(x)
    with pytest.raises(AttributeError, match="rope_scaling_factor"):  # the upstream bug
        block.get_config()
    config = layer_config(block)
    assert config["rope_position_scaling_factor"] == 2.0 and config["name"] == "block"
    clone = LlamaTransformerDecoder.from_config(config)
    clone(x)
    clone.set_weights(block.get_weights())
    np.testing.assert_allclose(clone(x), y, rtol=1e-6)


def test_other_layers_give_their_own_config():
    layer = keras.layers.Dense(3, name="d")
    assert layer_config(layer) == layer.get_config()
