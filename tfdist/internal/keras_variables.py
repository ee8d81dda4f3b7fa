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


def set_layout(variable: keras.Variable, layout) -> None:
    """Records on a Keras variable the `TensorLayout` its `tf.Variable` was created with."""
    variable._tfdist_layout = layout


def layout_of(variable):
    """The `TensorLayout` recorded by `set_layout`, or None."""
    return getattr(variable, "_tfdist_layout", None)
