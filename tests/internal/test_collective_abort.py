"""The private TF hook behind `tfdist.cluster.watch`: aborting pending collectives.

If a TF upgrade renames or removes `Context.abort_collective_ops`, or an abort
no longer makes a waiting collective fail, these tests fail first.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from tensorflow.python.eager import context
from tensorflow.python.framework import errors

from tfdist.internal.collective_abort import abort_collectives

# A collective of group size 2 with only one member waits forever; another
# thread aborts it after 1 s. Runs in its own process: an abort is final.
_PENDING_COLLECTIVE = textwrap.dedent("""
    import threading, time
    import tensorflow as tf
    from tfdist.internal.collective_abort import abort_collectives

    def abort():
        time.sleep(1.0)
        abort_collectives("tfdist-test: lost worker:1")

    threading.Thread(target=abort, daemon=True).start()
    try:
        with tf.device("/cpu:0"):
            tf.raw_ops.CollectiveReduceV2(
                input=tf.constant([1.0]), group_size=tf.constant(2), group_key=tf.constant(1),
                instance_key=tf.constant(1), ordering_token=[], merge_op="Add", final_op="Id")
        print("NO ERROR")
    except tf.errors.UnavailableError as e:
        print("UNAVAILABLE", e.message)
""")


def test_hook_exists():
    assert callable(context.context().abort_collective_ops)
    assert isinstance(errors.UNAVAILABLE, int)


def test_abort_fails_a_pending_collective_with_the_message():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", _PENDING_COLLECTIVE], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "UNAVAILABLE" in result.stdout and "tfdist-test: lost worker:1" in result.stdout, (
        result.stdout, result.stderr[-2000:])


def test_message_must_be_a_string():
    with pytest.raises(TypeError, match="received 3"):
        abort_collectives(3)
