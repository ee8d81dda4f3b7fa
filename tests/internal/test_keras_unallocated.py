"""`unallocated()`: a model built inside never gets its weights' values, even after a
later model's build leaves Keras's outermost stateless scope (where a plain
`StatelessScope(initialize_variables=False)` leaves them to be allocated)."""

import keras
import pytest

from tfdist.internal.keras_unallocated import unallocated


def _model(units):
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(units),
                             keras.layers.Dense(2)])


def _later_model():
    # A later model whose layer Keras calls on symbolic inputs through the TF backend's
    # `compute_output_spec` (no `compute_output_shape`): that opens and leaves the
    # outermost StatelessScope, where Keras initializes every variable still waiting.
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Lambda(lambda x: x * 2.0)(inputs))


def _allocated(model):
    return [v._value is not None for v in model.weights]


def test_keras_allocates_a_deferred_model_at_the_next_build():
    # The upstream behaviour unallocated() exists for.
    with keras.StatelessScope(initialize_variables=False):
        model = _model(5)
    assert _allocated(model) == [False] * 4
    _later_model()
    assert _allocated(model) == [True] * 4


def test_a_model_built_unallocated_stays_so_and_still_tells_its_weights():
    with unallocated():
        model = _model(7)
    _later_model()
    with keras.StatelessScope():
        pass
    assert _allocated(model) == [False] * 4
    assert [(tuple(v.shape), v.dtype) for v in model.weights] == [
        ((3, 7), "float32"), ((7,), "float32"), ((7, 2), "float32"), ((2,), "float32")]
    assert [v.path.split("/", 1)[1] for v in model.weights][::2] == ["dense/kernel",
                                                                      "dense_1/kernel"] or \
        all(v.path.endswith(("kernel", "bias")) for v in model.weights)


def test_variables_waiting_from_before_are_left_to_keras():
    with keras.StatelessScope(initialize_variables=False):
        earlier = _model(4)
    with unallocated():
        _model(6)
    _later_model()
    assert _allocated(earlier) == [True] * 4


def test_refused_inside_a_stateless_scope():
    with keras.StatelessScope():
        with pytest.raises(RuntimeError, match="inside a keras.StatelessScope"):
            with unallocated():
                pass
