"""Which tensors a strategy's backend exchanges while a step is traced."""

import contextlib


@contextlib.contextmanager
def recorded(strategy, collective: str):
    """Within: the static shape of every tensor `strategy.backend.<collective>` receives.

    Yields the list the shapes are appended to. `collective` is a backend
    method: "all_gather", "all_to_all" or "all_reduce". tfdist's collectives
    gather `x[tf.newaxis]` and exchange `[M, ...]` stacks of the M parts, so a
    weight shard of shape `s` gathered shows up as `(1, *s)`.
    """
    backend = strategy.backend
    original = getattr(backend, collective)
    shapes = []

    def recording(x, *args, **kwargs):
        shapes.append(tuple(x.shape.as_list()))
        return original(x, *args, **kwargs)

    setattr(backend, collective, recording)
    try:
        yield shapes
    finally:
        setattr(backend, collective, original)


def recorded_all_gathers(strategy):
    """`recorded(strategy, "all_gather")`: for graph tests such as "a tensor-parallel
    weight is never gathered"."""
    return recorded(strategy, "all_gather")
