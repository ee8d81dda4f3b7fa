"""Configs of keras-hub layers whose own `get_config` fails (to clone them).

keras-hub 0.32's `LlamaTransformerDecoder.get_config` reads
`self.rope_scaling_factor`, an attribute its `__init__` never sets (it sets
`rope_position_scaling_factor`), and leaves out
`rope_frequency_adjustment_factor`: every Llama decoder block raises
`AttributeError` when its config is asked for, so no Llama model can be cloned
layer by layer (`keras.models.clone_model`, `Pipeline.from_model`). Here the
config is built from the attributes `__init__` sets, with the argument names it
takes. `tests/internal/test_keras_hub_configs.py` shows the upstream failure
and that the clone computes what the block computes; the hook table
fingerprints the `get_config` this replaces.

Public: `layer_config(layer)`, the layer's config (its own where it works).
"""

import keras

_LLAMA_DECODER = "keras_hub.src.models.llama.llama_decoder.LlamaTransformerDecoder"


def layer_config(layer) -> dict:
    """`layer.get_config()`, or for a keras-hub Llama decoder block the config
    its broken `get_config` means to return."""
    cls = type(layer)
    if f"{cls.__module__}.{cls.__qualname__}" == _LLAMA_DECODER and not hasattr(
            layer, "rope_scaling_factor"):
        return _llama_decoder_config(layer)
    return layer.get_config()


def _llama_decoder_config(layer) -> dict:
    config = keras.layers.Layer.get_config(layer)
    config.update({
        "intermediate_dim": layer.intermediate_dim,
        "num_query_heads": layer.num_query_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "rope_max_wavelength": layer.rope_max_wavelength,
        "rope_position_scaling_factor": layer.rope_position_scaling_factor,
        "rope_frequency_adjustment_factor": layer.rope_frequency_adjustment_factor,
        "rope_low_freq_factor": layer.rope_low_freq_factor,
        "rope_high_freq_factor": layer.rope_high_freq_factor,
        "rope_pretraining_sequence_length": layer.rope_pretraining_sequence_length,
        "activation": keras.activations.serialize(layer.activation),
        "layer_norm_epsilon": layer.layer_norm_epsilon,
        "kernel_initializer": keras.initializers.serialize(layer.kernel_initializer),
        "dropout": layer.dropout,
    })
    return config
