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


@pytest.mark.parametrize("mesh, method", [
    ("seq:2", "ring"),
    ("seq:4", "ring"),
    ("data:2;seq:2", "ring"),
    ("seq:2", "ulysses"),
    ("data:2;seq:2", "ulysses"),
])
def test_fit_equals_one_device(one_device, mesh, method):
    strategy = MeshStrategy(mesh, layout="batch:data;length:seq" if "data" in mesh
                            else "length:seq")
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
