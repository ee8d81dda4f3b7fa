"""Aborts every pending collective op of this process, with a message.

Private TF API used: `tensorflow.python.eager.context.context().abort_collective_ops`
and the error code `tensorflow.python.framework.errors.UNAVAILABLE`.

Why: a collective waiting on a task that has died blocks forever; TensorFlow
has no public call that makes it fail. `tfdist.cluster.watch` calls
`abort_collectives` when a server stops answering, so the step waiting on it
raises `tf.errors.UnavailableError` naming the lost task instead of hanging.
The abort is final for this process: every later collective fails too
("Restart your program to reset"). Checked by
`tests/internal/test_collective_abort.py`.
"""

from tensorflow.python.eager import context
from tensorflow.python.framework import errors


def abort_collectives(message: str) -> None:
    """Makes every pending and future collective op of this process fail.

    Args:
        message: the text of the `tf.errors.UnavailableError` that the waiting
            ops raise, e.g. `"tfdist: lost worker:1 at host2:2222"`.

    Raises:
        TypeError: `message` is not a string.
    """
    if not isinstance(message, str):
        raise TypeError(f"abort_collectives needs a str message; received {message!r}.")
    context.context().abort_collective_ops(errors.UNAVAILABLE, message)
