"""Every layer of a Keras model, nested ones included.

Private Keras API used here (and only here): `Layer._flatten_layers(include_self,
recursive)`, the walk Keras itself uses for `Model.layers` and for collecting
weights; Keras 3 has no public recursive one (`Model.layers` is one level).
Checked by `tests/internal/test_keras_layers.py`.
"""


def all_layers(model, include_self: bool = True):
    """`model` (if `include_self`) and every layer nested in it, each once."""
    return list(model._flatten_layers(include_self=include_self, recursive=True))
