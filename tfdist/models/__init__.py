"""Models built from tfdist layers."""

from tfdist.models.token_mlp import build_token_mlp, make_copy_task

__all__ = ["build_token_mlp", "make_copy_task"]
