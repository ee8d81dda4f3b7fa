"""The Keras variable a `tf.Variable` is being created for, and the objects creating it.

Private Keras details used here (and only here): Keras's name-scope stack
(`global_state`'s "name_scope_stack"), whose entries' `caller` are the layers
and optimizer whose variables are being created (`scope_callers`); and the TF
backend's
`Variable._initialize_with_initializer` hands `tf.Variable` the initial value
`lambda: initializer(self._shape, dtype=self._dtype)`, whose closure holds the
Keras variable, so a variable creator (a strategy's) learns the variable's
`path` and global `shape` before any value exists. `tests/internal/test_keras_tensor_parallel.py`
fails when Keras changes this.
"""

from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from keras.src.backend.common import global_state

from tfdist.internal import keras_initial_slices


def scope_callers() -> tuple:
    """The callers of Keras's open name scopes, outermost first.

    Keras opens `name_scope(obj.name, caller=obj)` around a layer's build and
    an optimizer's variable creation: inside a variable creator these are the
    model, the blocks and the layer whose weight is being created, or the
    optimizer.
    """
    stack = global_state.get_global_attribute("name_scope_stack") or ()
    return tuple(entry.caller for entry in stack if entry.caller is not None)


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


def shard_maker(initializer, layout, dtype, share_seed=None):
    """`make(device_index)`: that device's shard of the initial value, made alone, or None.

    Constant initializers (`Zeros`, `Ones`, a scalar `Constant`) give each shard
    as is. Keras's random ones (`RandomNormal`, `RandomUniform`, `TruncatedNormal`,
    `VarianceScaling`: Glorot, He, LeCun) give exactly the shard of the value one
    device draws (`keras_initial_slices`), without drawing the rest: the seed is
    drawn once per variable, and `share_seed(seed)` (processes that each make
    their own shards: rank 0's seed) makes every shard of it agree. Padding (a
    padded layout's last shard) is zeros. Anything else (`Orthogonal`, a custom
    initializer): None, the value is drawn whole.
    """
    global_shape, padded_shape = layout.shape, layout.padded_shape
    if type(initializer) in _CONSTANT and np.ndim(getattr(initializer, "value", 0)) == 0:
        if layout.is_padded and type(initializer) is not keras.initializers.Zeros:
            return None  # padding must be zeros
        return lambda index: initializer(layout.local_shape, dtype=dtype)
    draw = keras_initial_slices.slice_drawer(initializer, global_shape, dtype) \
        if initializer is not None else None
    if draw is None:
        return None
    seeds = []

    def make(index):
        if not seeds:  # one seed per variable, as one call of the initializer draws
            seed = keras_initial_slices.draw_seed(initializer)
            seeds.append(seed if share_seed is None else share_seed(seed))
        box = layout.shard_slices(index)
        real = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(box, global_shape))
        value = draw(seeds[0], real)
        if padded_shape != global_shape:
            value = tf.pad(value, [(0, (s.stop - s.start) - (r.stop - r.start))
                                   for s, r in zip(box, real)])
        return value

    return make
