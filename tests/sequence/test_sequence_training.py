"""A causal LM with `length` split over a mesh axis trains like one device under `fit`.

`tfdist.testing.causal_lm`: the same Keras model on both sides; on one device
its attention is the dense softmax path, under `length:seq` ring or Ulysses
attention over each device's zig-zag tokens (`split_sequences`). Loss history
and every weight after 10 Adam steps must agree to 1e-5.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import sequence
from tfdist.strategies import MeshStrategy
from tfdist.testing import causal_lm
from tfdist.testing.pipeline import relative


@pytest.fixture(scope="module")
def one_device():
    return causal_lm.train(None)


@pytest.mark.parametrize("mesh, layout, method", [
    ("seq:2", "length:seq", "ring"),
    ("seq:4", "length:seq", "ring"),
    ("data:2;seq:2", "batch:data;length:seq", "ulysses"),
    # data:2;seq:2 ring and seq:2 Ulysses: with Keras's options, below (same model and path).
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



@pytest.fixture(scope="module")
def one_device_with_options():
    # Global clipping of the summed gradient (each device holds part of every row's
    # tokens: its gradient is a partial sum), EMA weights written back at the end of
    # every fit, and gradients accumulated over 2 steps.
    return causal_lm.train(None, optimizer=_keras_options)


def _keras_options():
    return keras.optimizers.Adam(1e-2, global_clipnorm=0.05, use_ema=True,
                                 ema_momentum=0.9, gradient_accumulation_steps=2)


@pytest.mark.parametrize("mesh, layout, method", [
    ("data:2;seq:2", "batch:data;length:seq", "ring"),
    ("seq:2", "length:seq", "ulysses"),
])
def test_clipping_ema_and_accumulation_over_a_split_sequence_equal_one_device(
        one_device, one_device_with_options, mesh, layout, method):
    want_losses, want_weights = one_device_with_options
    losses, weights = causal_lm.train(MeshStrategy(mesh, layout=layout), method,
                                      optimizer=_keras_options)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    for path, value in weights.items():
        np.testing.assert_allclose(value, want_weights[path], rtol=1e-5, atol=1e-5, err_msg=path)
    # The options acted: plain Adam ends elsewhere.
    plain = one_device[1]
    assert max(float(np.abs(plain[p] - want_weights[p]).max()) for p in plain) > 1e-3


def test_mixed_bfloat16_over_a_split_sequence_is_as_close_to_float32_as_one_device(
        one_device, mixed_bfloat16):
    # bfloat16 rounds every partial sum, and the ring's online softmax adds the blocks in
    # another order than one device's softmax: the split cannot equal one device's
    # bfloat16 run bit for bit. What it must be is as accurate: after 10 Adam steps its
    # weights are as far from the float32 run (relative L2; `one_device`, module-scoped,
    # is set up before the function-scoped policy) as one device's bfloat16 weights are,
    # within 1.5x.
    _, one = causal_lm.train(None)
    _, split = causal_lm.train(MeshStrategy("seq:2", layout="length:seq"), "ring")
    paths = sorted(one_device[1])

    def error(weights, want):
        return relative(np.concatenate([weights[p].ravel() for p in paths]),
                        np.concatenate([want[p].ravel() for p in paths]))

    one_error, split_error = error(one, one_device[1]), error(split, one_device[1])
    print(f"mixed_bfloat16 vs float32 after 10 steps (relative L2): one device "
          f"{one_error:.1e}, seq:2 ring {split_error:.1e}; between them {error(split, one):.1e}")
    assert split_error <= 1.5 * one_error, (split_error, one_error)
