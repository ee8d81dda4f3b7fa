"""`jit_compile=True` under a multi-device tfdist mesh falls back, for every model.

Private Keras API used here (and only here):
`keras.src.trainers.trainer.model_supports_jit`, which the `jit_compile`
setter of every Keras model consults at `compile`.

Keras compiles each replica's step with XLA when `jit_compile=True`. Under a
tfdist strategy of several devices or processes that step contains the
gradient routing (a merge call) and collectives, which XLA cannot compile on
CPU (and Horovod's XLA ops are GPU-only). tfdist layers mark themselves
`supports_jit=False` there, so Keras proceeds with `jit_compile=False` and
its one-line warning; `install()` gives models without tfdist layers (a
plain Keras model under `MeshStrategy("data:4")`) the same fall-back instead
of an XLA compile error. Everywhere else Keras decides as before.
"""

from keras.src.trainers import trainer

from tfdist import runtime

_KERAS_MODEL_SUPPORTS_JIT = trainer.model_supports_jit


def _spans_devices(model) -> bool:
    mesh_runtime = runtime.current_runtime(model.distribute_strategy)
    return mesh_runtime is not None and mesh_runtime.num_replicas_in_sync > 1


def model_supports_jit(model) -> bool:
    if _spans_devices(model):
        return False
    return _KERAS_MODEL_SUPPORTS_JIT(model)


def install() -> None:
    """Makes Keras's jit check see tfdist's multi-device strategies (idempotent)."""
    trainer.model_supports_jit = model_supports_jit


def installed() -> bool:
    return trainer.model_supports_jit is model_supports_jit
