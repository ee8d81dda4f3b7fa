"""Fingerprints of the upstream source a hook mirrors or relies on.

A hook that copies part of a Keras, keras-hub or TF function records the
sha256 of that function's installed source; where the installed one differs,
the hook steps aside (the upstream code runs) and its test fails, naming what
moved. Used by `keras_initial_slices`, `keras_hub_attention` and `hooks`
(the table of every upstream hook, checked when a strategy is created).
"""

import hashlib
import inspect


def source_sha256(function) -> str:
    """sha256 of `function`'s installed source, as upstream wrote it: through
    `functools.wraps` wrappers and tfdist's own (`_tfdist_original`)."""
    function = inspect.unwrap(getattr(function, "_tfdist_original", function))
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()
