"""The `LayoutMap` of a `keras.distribution.ModelParallel`.

Private Keras attribute used here (and only here): `ModelParallel._layout_map`
(Keras 3.15 keeps it private and has no accessor).
`tests/internal/test_keras_variables.py` fails when it moves.
"""


def layout_map_of(distribution):
    """The `LayoutMap` a `keras.distribution.ModelParallel` was built with."""
    return distribution._layout_map
