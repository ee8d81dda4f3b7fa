"""tfdist's own models in keras-hub's convention: get_layout_map lowers to the layout rules."""

import keras
import numpy as np
import pytest

import tfdist.distribution as td
from tfdist.models.transformer import SequenceCrossentropy, Transformer
from tfdist.models.transformer_layers import TransformerConfig
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import assert_equivalent

V = 32
MOE = dict(vocab_size=V, d_model=16, num_heads=4, d_kv=4, d_ff=32, max_length=16, dropout=0.0,
           moe_experts=4, moe_group_size=16, num_encoder_layers=2, num_decoder_layers=2)


def keras_mesh(shape, names=("batch", "model")):
    n = int(np.prod(shape))
    return td.DeviceMesh(shape, names, [f"cpu:{i}" for i in range(n)])


def _layouts(strategy, config):
    with strategy.scope():
        model = Transformer(config, name="nmt")
    return {v.path: getattr(v.value, "layout", None) for v in model.weights}


@pytest.mark.parametrize("shape", [(1, 2), (2, 2), (1, 4)])
def test_the_layout_map_and_the_layout_rules_give_every_weight_the_same_layout(shape):
    config = TransformerConfig(**{**MOE, "share_embeddings": False, "positions": "learned"})
    mesh = keras_mesh(shape, ("data", "tp"))
    layout_map = Transformer.get_layout_map(mesh, model_parallel_dim_name="tp",
                                            data_parallel_dim_name="data")
    assert isinstance(layout_map, keras.distribution.LayoutMap)
    from_map = _layouts(td.ModelParallel(layout_map=layout_map, batch_dim_name="data"), config)
    from_rules = _layouts(MeshStrategy(f"data:{shape[0]};tp:{shape[1]}",
                                       "batch:data;heads:tp;d_ff:tp;vocab:tp;experts:tp",
                                       devices=[f"/cpu:{i}" for i in range(np.prod(shape))]),
                          config)
    assert from_map.keys() == from_rules.keys()
    split = {p: l.mesh_axes for p, l in from_rules.items() if l is not None and l.is_sharded}
    assert {p: l.mesh_axes for p, l in from_map.items() if l is not None and l.is_sharded} == split
    assert any("ffn/wi" in p for p in split) and any("attention/query" in p for p in split)
    for path, axes in split.items():  # the map names the same axes by path
        assert tuple(layout_map[path].axes) == axes, path


def test_a_transformer_with_its_layout_map_matches_one_device():
    config = TransformerConfig(**MOE)
    rng = np.random.default_rng(0)
    n, length = 48, 8
    src = rng.integers(3, V, size=(n, length)).astype("int32")
    tgt = rng.integers(3, V, size=(n, length)).astype("int32")
    src[::3, 5:] = 0
    tgt[::2, 6:] = 0
    decoder_input = np.concatenate([np.ones((n, 1), "int32"), tgt[:, :-1]], axis=1)
    strategy = td.ModelParallel(layout_map=Transformer.get_layout_map(keras_mesh((1, 2))))
    report = assert_equivalent(
        lambda: Transformer(config), strategy, (src, decoder_input), tgt,
        loss=SequenceCrossentropy(V, label_smoothing=0.1),
        optimizer=lambda: keras.optimizers.Adam(1e-3), batch_size=8, steps=6,
        compare_outputs=False, reference=lambda: Transformer(config), rtol=5e-5)
    print(f"transformer MoE, ModelParallel 1x2 by get_layout_map: {report}")


def test_a_layout_map_that_disagrees_with_the_rules_and_bad_axis_names_are_errors():
    mesh = keras_mesh((1, 2))
    layout_map = Transformer.get_layout_map(mesh)
    layout_map.pop(r".*ffn/inner/kernel")
    layout_map[r".*ffn/inner/kernel"] = ("model", None)  # edited by hand
    strategy = td.ModelParallel(layout_map=layout_map)
    with pytest.raises(ValueError, match=r"Variable 'nmt/encoder_0/ffn/inner/kernel' "
                                         r"of shape \(16, 32\): the LayoutMap lays it out "
                                         r"\('model', None\), but the layout rules give "
                                         r"\(None, 'model'\)"):
        with strategy.scope():
            Transformer(TransformerConfig(**{**MOE, "moe_experts": 0}), name="nmt")
    with pytest.raises(ValueError, match="model_parallel_dim_name='tp' is not an axis of the "
                                         r"DeviceMesh; its axes are \['batch', 'model'\]"):
        Transformer.get_layout_map(mesh, model_parallel_dim_name="tp")
