"""The Keras variable a `tf.Variable` is being created for.

Private Keras detail used here (and only here): the TF backend's
`Variable._initialize_with_initializer` hands `tf.Variable` the initial value
`lambda: initializer(self._shape, dtype=self._dtype)`, whose closure holds the
Keras variable, so a variable creator (a strategy's) learns the variable's
`path` and global `shape` before any value exists. `tests/internal/test_keras_variables.py`
fails when Keras changes this.
"""

from typing import Optional

import keras
import numpy as np


def keras_variable_of(initial_value) -> Optional[keras.Variable]:
    """The Keras variable whose `tf.Variable` starts from `initial_value`, or None.

    None for a variable Keras did not create from an initializer (a plain
    `tf.Variable`, or a Keras variable created from a value).
    """
    for cell in getattr(initial_value, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(contents, keras.Variable):
            return contents
    return None


def set_layout(variable: keras.Variable, layout, keeps_whole: bool = False) -> None:
    """Records on a Keras variable the `TensorLayout` its `tf.Variable` was created with.

    `keeps_whole`: the strategy keeps a whole copy that replicas read (ZeRO-1/2).
    """
    variable._tfdist_layout = layout
    variable._tfdist_keeps_whole = bool(keeps_whole)


def keeps_whole(variable) -> bool:
    """Whether `set_layout` recorded a kept whole copy (ZeRO-1/2) for this Keras variable."""
    return getattr(variable, "_tfdist_keeps_whole", False)


def layout_of(variable):
    """The `TensorLayout` recorded by `set_layout`, or None."""
    return getattr(variable, "_tfdist_layout", None)


def initializer_of(initial_value):
    """The Keras initializer in the closure of a Keras variable's initial value, or None."""
    for cell in getattr(initial_value, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:
            continue
        if isinstance(contents, keras.initializers.Initializer):
            return contents
    return None


_CONSTANT = (keras.initializers.Zeros, keras.initializers.Ones, keras.initializers.Constant)
_ELEMENTWISE_RANDOM = (keras.initializers.RandomNormal, keras.initializers.RandomUniform,
                       keras.initializers.TruncatedNormal)


def shard_maker(initializer, layout, dtype, random: bool, seeded_only: bool = False):
    """`make(shard_index, local_shape)` drawing one shard's initial value alone, or None.

    Constant initializers (`Zeros`, `Ones`, a scalar `Constant`) give exactly the slice of
    the global value. With `random`, element-wise random ones (`RandomNormal`,
    `RandomUniform`, `TruncatedNormal`) and `VarianceScaling` (Glorot, He,
    LeCun: its scale from the *global* shape's fans) draw each shard from the
    same distribution with a seed of its own (`seed + shard index`): the same
    distribution as one device's, not the same numbers. With `seeded_only`
    (processes that each make their own shard, and must agree where they hold
    the same one), only initializers with an integer seed. Anything else: None.

    Private Keras API used here: `keras.src.initializers.random_initializers.compute_fans`.
    """
    global_shape = layout.shape
    constant = type(initializer) in _CONSTANT and np.ndim(getattr(initializer, "value", 0)) == 0
    if layout.is_padded:  # padding must be zeros
        return (lambda index, shape: initializer(shape, dtype=dtype)) \
            if type(initializer) is keras.initializers.Zeros else None
    if constant:  # a scalar everywhere (a Constant of an array is not one)
        return lambda index, shape: initializer(shape, dtype=dtype)
    if not random:
        return None
    variance = isinstance(initializer, keras.initializers.VarianceScaling)
    if not variance and type(initializer) not in _ELEMENTWISE_RANDOM:
        return None
    if seeded_only and not isinstance(getattr(initializer, "seed", None), int):
        return None

    def make(index, shape):
        shard = _reseeded(initializer, index)
        value = shard(shape, dtype=dtype)
        if variance:  # stddev (or limit) is proportional to 1 / sqrt(the fan divisor)
            ratio = _fan_divisor(initializer, shape) / _fan_divisor(initializer, global_shape)
            value = value * ratio ** 0.5
        return value

    return make


def _reseeded(initializer, index):
    seed = getattr(initializer, "seed", None)
    if not isinstance(seed, int):
        return initializer  # a SeedGenerator draws new numbers on every call
    config = initializer.get_config()
    config["seed"] = (seed + 1_000_003 * (index + 1)) % (2 ** 31 - 1)
    return type(initializer).from_config(config)


def _fan_divisor(initializer, shape):
    from keras.src.initializers.random_initializers import compute_fans

    fan_in, fan_out = compute_fans(tuple(shape), input_axes=initializer.input_axes,
                                   output_axes=initializer.output_axes)
    if initializer.mode == "fan_in":
        return max(1.0, fan_in)
    if initializer.mode == "fan_out":
        return max(1.0, fan_out)
    return max(1.0, (fan_in + fan_out) / 2.0)
