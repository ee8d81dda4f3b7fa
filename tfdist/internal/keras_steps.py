"""Recognises the step functions Keras's `fit`, `evaluate` and `predict` pass to `strategy.run`.

Private Keras API used: what `keras.src.backend.tensorflow.trainer.TensorFlowTrainer`
hands `strategy.run`: for `fit` and `evaluate` the model's bound `train_step`
and `test_step` (`_make_function(self.train_step)`); for `predict` the step
`make_predict_function` defines (`...make_predict_function.<locals>.one_step_on_data`),
reached through the wrappers TensorFlow puts around it (`tf.function`'s
`python_function`, autograph's `_tf_decorator.decorated_target`,
`functools.wraps`'s `__wrapped__`). A model's own `train_step`/`test_step`
override counts as Keras's (it receives Keras's data and must honour its
sample weights, as Keras's does).

Why: `strategy.run` is told nothing about which Keras loop calls it, yet a
tfdist strategy treats Keras's steps, and only those, specially: it evens out
replicas of a partial batch (`tfdist.batch_rows`: padded rows weighted zero,
predictions cut back to the real rows), and Horovod gathers `predict`'s
outputs so every process returns the predictions for the whole batch. Checked
by `tests/internal/test_keras_steps.py` (real `fit`/`evaluate`/`predict` under
a `MirroredStrategy`).
"""

from typing import Optional

_BOUND_STEPS = {"train_step": "train", "test_step": "test"}
_PREDICT_FACTORY = "make_predict_function"
_MAX_WRAPPERS = 10


def _unwrapped(fn):
    """`fn` and the functions TensorFlow's wrappers around it wrap, outermost first."""
    for _ in range(_MAX_WRAPPERS):
        if fn is None:
            return
        yield fn
        decorator = getattr(fn, "_tf_decorator", None)
        fn = (getattr(fn, "__wrapped__", None) or getattr(fn, "python_function", None)
              or (decorator.decorated_target if decorator is not None else None))


def keras_step_kind(fn) -> Optional[str]:
    """"train", "test" or "predict" for (a wrapper of) the step Keras builds, else None.

    Args:
        fn: the function given to `strategy.run` (or to the strategy's
            `extended._call_for_each_replica`).
    """
    import keras

    for f in _unwrapped(fn):
        if isinstance(getattr(f, "__self__", None), keras.Model):
            return _BOUND_STEPS.get(getattr(f, "__name__", ""))
        if _PREDICT_FACTORY in getattr(f, "__qualname__", ""):
            return "predict"
    return None


def keras_step_model(fn):
    """The model whose bound `train_step`/`test_step` `fn` is (or wraps), else None."""
    import keras

    for f in _unwrapped(fn):
        if isinstance(getattr(f, "__self__", None), keras.Model):
            return f.__self__
    return None


def is_keras_predict_step(fn) -> bool:
    """Whether `fn` is (a wrapper of) the step Keras's `make_predict_function` builds."""
    return keras_step_kind(fn) == "predict"
