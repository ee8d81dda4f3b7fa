"""Recognises the step function Keras's `predict` passes to `strategy.run`.

Private Keras API used: the `__qualname__` of the per-replica step that
`keras.src.backend.tensorflow.trainer.TensorFlowTrainer.make_predict_function`
defines (`...make_predict_function.<locals>.one_step_on_data`), reached through
the wrappers TensorFlow puts around it (`tf.function`'s `python_function`,
autograph's `_tf_decorator.decorated_target`, `functools.wraps`'s `__wrapped__`).

Why: `strategy.run` is told nothing about which Keras loop calls it, yet a
strategy whose replicas each see only their slice of the batch (Horovod: one
process per replica) must gather `predict`'s outputs, and only those, so every
process returns the predictions for the whole batch. Checked by
`tests/internal/test_keras_predict.py` (a real `model.predict` under a
`MirroredStrategy`).
"""

_PREDICT_FACTORY = "make_predict_function"
_MAX_WRAPPERS = 10


def is_keras_predict_step(fn) -> bool:
    """Whether `fn` is (a wrapper of) the step Keras's `make_predict_function` builds.

    Args:
        fn: the function given to `strategy.run` (or to the strategy's
            `extended._call_for_each_replica`).

    Returns:
        True for Keras's predict step, however TensorFlow wrapped it; False for
        any other function (the train and test steps included).
    """
    for _ in range(_MAX_WRAPPERS):
        if fn is None:
            return False
        if _PREDICT_FACTORY in getattr(fn, "__qualname__", ""):
            return True
        decorator = getattr(fn, "_tf_decorator", None)
        fn = (getattr(fn, "__wrapped__", None) or getattr(fn, "python_function", None)
              or (decorator.decorated_target if decorator is not None else None))
    return False
