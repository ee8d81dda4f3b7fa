"""tfdist.internal.keras_h5_slices: Keras weight files read shard by shard, never whole."""

import contextlib
import inspect

import h5py
import keras
import keras_hub
import numpy as np
import pytest

import tfdist.distribution as td
from tfdist.internal import keras_h5_slices

VOCAB, LENGTH, D = 32, 6, 16


def test_the_keras_code_the_hooks_replace():
    from keras.src.backend.common import variables
    from keras.src.saving import saving_lib

    keras_h5_slices.install()
    getitem = inspect.getsource(saving_lib.H5IOStore.__getitem__._tfdist_original)
    assert "value = safe_get_h5_dataset(self._h5_entry_group, key)" in getitem
    assert "value = np.array(value)" in getitem  # Keras reads the dataset whole
    assign = inspect.getsource(variables.Variable.assign._tfdist_original)
    assert "value = self._convert_to_tensor(value, dtype=self._dtype)" in assign
    assert "if is_memory_sufficient(model):" in inspect.getsource(
        saving_lib._load_model_from_fileobj)
    for owner in (keras.layers.Layer, keras.optimizers.Optimizer):  # assign what they read
        assert ".assign(store[" in inspect.getsource(owner.load_own_variables)
    assert saving_lib.is_memory_sufficient._tfdist_original is not None


@contextlib.contextmanager
def recorded_reads():
    """Within: (dataset shape, shape read) of every read of an HDF5 dataset."""
    getitem, array = h5py.Dataset.__getitem__, h5py.Dataset.__array__
    reads = []

    def recording_getitem(self, key, *args, **kwargs):
        out = getitem(self, key, *args, **kwargs)
        reads.append((tuple(self.shape), np.shape(out)))
        return out

    def recording_array(self, *args, **kwargs):  # np.array(dataset): Keras's whole read
        reads.append((tuple(self.shape), tuple(self.shape)))
        return array(self, *args, **kwargs)

    h5py.Dataset.__getitem__, h5py.Dataset.__array__ = recording_getitem, recording_array
    try:
        yield reads
    finally:
        h5py.Dataset.__getitem__, h5py.Dataset.__array__ = getitem, array


def model():
    ids = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, D, name="token")(ids)
    x = keras.layers.Dense(4 * D, activation="relu", name="up")(x)
    x = keras.layers.Dense(D, name="down")(x)
    return keras.Model(ids, keras.layers.Dense(VOCAB, name="head")(x))


def strategy(shape):
    n = int(np.prod(shape))
    layout_map = td.LayoutMap(td.DeviceMesh(shape, ("batch", "model"),
                                            [f"cpu:{i}" for i in range(n)]))
    layout_map["token/embeddings"] = ("model", "batch")
    layout_map["up/kernel"] = ("batch", "model")
    layout_map["down/kernel"] = ("model", None)
    layout_map["head/kernel"] = (None, "model")
    return td.ModelParallel(layout_map=layout_map)


def trained(shape):
    with strategy(shape).scope():
        m = model()
        m.compile(keras.optimizers.Adam(1e-2), "mse")
    rng = np.random.default_rng(0)
    m.fit(rng.integers(0, VOCAB, (16, LENGTH)), rng.normal(size=(16, LENGTH, VOCAB)),
          batch_size=8, epochs=1, verbose=0)
    return m


def _values(m):
    return [np.asarray(v) for v in m.weights + m.optimizer.variables]


@pytest.mark.parametrize("fmt", ["weights.h5", "keras"])
def test_weights_and_slots_are_read_one_shard_at_a_time_onto_another_mesh(tmp_path, fmt):
    saved = trained((2, 2))
    path = str(tmp_path / f"model.{fmt}")
    if fmt == "keras":
        saved.save(path)
    else:
        saved.save_weights(path)
    with recorded_reads() as reads:
        if fmt == "keras":
            with strategy((1, 4)).scope():
                loaded = keras.models.load_model(path)
        else:
            with strategy((1, 4)).scope():
                loaded = model()
                loaded.compile(keras.optimizers.Adam(1e-2), "mse")
                loaded.optimizer.build(loaded.trainable_variables)
            loaded.load_weights(path)
    for want, got in zip(_values(saved), _values(loaded)):
        np.testing.assert_array_equal(got, want)
    # The kernels and tables (and their Adam slots) are split 4 ways: each read is
    # one shard; only the small replicated biases and counters are read whole.
    big = [(whole, part) for whole, part in reads if np.prod(whole) >= 4 * D * D // 2]
    assert len(big) == 3 * 4 * 4  # 4 weights x (weight, 2 slots) x 4 distinct shards
    assert all(np.prod(part) == np.prod(whole) // 4 for whole, part in big), big


def test_keras_loads_whole_outside_a_tfdist_strategy(tmp_path):
    path = str(tmp_path / "model.weights.h5")
    plain = model()
    plain.save_weights(path)
    with recorded_reads() as reads:
        again = model()
        again.load_weights(path)
    assert reads and all(whole == part for whole, part in reads)  # Keras's own behaviour
    for want, got in zip(plain.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_a_keras_hub_preset_loads_shard_by_shard(tmp_path):
    config = dict(vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=2,
                  hidden_dim=16, intermediate_dim=64, head_dim=4)
    backbone = keras_hub.models.GemmaBackbone(**config)
    backbone.save_to_preset(str(tmp_path))
    mesh = td.DeviceMesh((2, 2), ("batch", "model"), [f"cpu:{i}" for i in range(4)])
    with recorded_reads() as reads:
        with td.ModelParallel(layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
                              batch_dim_name="batch").scope():
            loaded = keras_hub.models.GemmaBackbone.from_preset(str(tmp_path))
    for want, got in zip(backbone.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(got, want)
    embedding = next(v for v in loaded.weights if v.path.endswith("token_embedding/embeddings"))
    assert len(embedding.value.values) == 4  # stored one shard per device
    table = [part for whole, part in reads if whole == (64, 16)]
    assert table and all(part == (32, 8) for part in table), table  # (model, batch) shards
