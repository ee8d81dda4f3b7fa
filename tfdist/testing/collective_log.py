"""Which tensors a strategy's backend all-gathers while a step is traced."""

import contextlib


@contextlib.contextmanager
def recorded_all_gathers(strategy):
    """Within: the static shape of every tensor `strategy.backend.all_gather` receives.

    Yields the list the shapes are appended to. For graph tests such as "a
    tensor-parallel weight is never gathered": tfdist's collectives gather
    `x[tf.newaxis]`, so a weight shard of shape `s` shows up as `(1, *s)`.
    """
    backend = strategy.backend
    original = backend.all_gather
    shapes = []

    def recording(x, *args, **kwargs):
        shapes.append(tuple(x.shape.as_list()))
        return original(x, *args, **kwargs)

    backend.all_gather = recording
    try:
        yield shapes
    finally:
        backend.all_gather = original
