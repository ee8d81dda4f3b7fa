"""A causal LM with `length` split over a mesh axis trains like one device under `fit`.

`tfdist.testing.causal_lm`: the same Keras model on both sides; on one device
its attention is the dense softmax path, under `length:seq` ring or Ulysses
attention over each device's zig-zag tokens (`split_sequences`). Loss history
and every weight after 10 Adam steps must agree to 1e-5.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfdist import sequence
from tfdist.strategies import MeshStrategy
from tfdist.testing import causal_lm


@pytest.fixture(scope="module")
def one_device():
    return causal_lm.train(None)


@pytest.mark.parametrize("mesh, layout, method", [
    ("seq:2", "length:seq", "ring"),
    ("seq:4", "length:seq", "ring"),
    ("data:2;seq:2", "batch:data;length:seq", "ring"),
    ("seq:2", "length:seq", "ulysses"),
    ("data:2;seq:2", "batch:data;length:seq", "ulysses"),
])
def test_fit_equals_one_device(one_device, mesh, layout, method):
    strategy = MeshStrategy(mesh, layout=layout)
    losses, weights = causal_lm.train(strategy, method)
    want_losses, want_weights = one_device
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert weights.keys() == want_weights.keys()
    for path, value in weights.items():
        np.testing.assert_allclose(value, want_weights[path], rtol=1e-5, atol=1e-5, err_msg=path)


def test_split_and_merge_sequences_round_trip():
    strategy = MeshStrategy("data:2;seq:2", layout="batch:data;length:seq")
    x = np.arange(4 * 8).reshape(4, 8)
    rows = np.arange(4)
    (local, local_rows), = sequence.split_sequences(
        tf.data.Dataset.from_tensors((x, rows)), strategy.mesh)
    # device 1 (data 0, seq 1): rows 0-1, zig-zag tokens 2 3 4 5
    np.testing.assert_array_equal(local.numpy()[2:4], x[0:2, 2:6])
    np.testing.assert_array_equal(local_rows.numpy(), [0, 1, 0, 1, 2, 3, 2, 3])
    np.testing.assert_array_equal(sequence.merge_sequences(local.numpy(), strategy.mesh), x)


def test_split_sequences_names_what_does_not_divide():
    mesh = MeshStrategy("data:2;seq:2", layout="batch:data;length:seq").mesh
    with pytest.raises(ValueError, match=r"length 10 does not split into 2 x 2 zig-zag.*12"):
        sequence.split_sequences(tf.data.Dataset.from_tensors(np.zeros((4, 10))), mesh)
    with pytest.raises(ValueError, match=r"batch of 3 rows does not split over the 2 row groups"):
        sequence.split_sequences(tf.data.Dataset.from_tensors(np.zeros((3, 16))), mesh)
