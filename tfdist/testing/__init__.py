"""Single-device references, equivalence checks and virtual devices for tests."""

from tfdist.devices import split_cpu  # noqa: F401
