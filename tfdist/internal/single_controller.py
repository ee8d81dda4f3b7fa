"""A single controller's `MirroredExtended` over devices of other tasks.

Private TF API used here (and only here): `MirroredExtended._initialize_strategy`
and `MirroredExtended._default_device`.

tfdist's mesh over workers, and model averaging over them, is one program (the
controller, a client of the cluster: job "localhost") driving the devices of
every task, as TPUStrategy drives its TPUs. `MirroredExtended` refuses devices
of several tasks in eager mode, so a strategy is made on its first device and
then initialised on all of them (`_initialize_strategy`).

For devices of a task other than the controller's, `MirroredExtended` also sets
`_default_device` to the first one's task ("/job:worker/task:0"), a device
scope its `scope()` enters: whatever is made eagerly under the scope and is not
a variable then lives on worker 0 rather than on the controller. A resource
made there cannot serve the controller's input pipeline. keras-hub's everyday
flow is exactly that: a `GemmaCausalLM` and its preprocessor are built under
the scope (the `GemmaTokenizer`'s SentencePiece model, a resource, on worker 0),
then `fit`, `evaluate` and `predict` map the preprocessor over a `tf.data`
pipeline built on the controller, and distributing it (serialized by
`tf.data.experimental.replicate` to run on every worker) fails:

    FailedPreconditionError: Failed to serialize the input pipeline graph:
    Trying to access resource _0_SentencepieceOp located in device
    /job:worker/replica:0/task:0/device:CPU:0 from device
    /job:localhost/replica:0/task:0/device:CPU:0

The same happens to any resource an input pipeline captures (a Keras
`StringLookup`'s table) and to TF's own `MirroredStrategy` over workers. With no
default device the scope leaves such ops on the controller, as without a
strategy: the pipeline serializes the resource with itself, and each worker
rebuilds it. Variables are unaffected (the strategy places each component on its
device), and so are the steps Keras traces (called outside the scope).

Checked by tests/cluster/test_mesh_over_workers.py (a keras-hub `GemmaCausalLM`
with its preprocessor on raw strings over two worker processes, equal to one
device: it fails as above without this); `initialize_on_devices` raises if
`MirroredExtended` no longer has the attribute it clears.
"""

from tensorflow.python.distribute import mirrored_strategy


def initialize_on_devices(extended: mirrored_strategy.MirroredExtended, devices) -> None:
    """Initialises `extended` (made on `devices[:1]`) on all `devices`, of any tasks.

    Args:
        extended: a `MirroredExtended` made on the first of `devices`.
        devices: device names, possibly of several tasks of a cluster.

    Raises:
        RuntimeError: this TensorFlow's `MirroredExtended` has no `_default_device`
            (the hook moved: this module must follow it).
    """
    extended._initialize_strategy(devices)
    if not hasattr(extended, "_default_device"):
        raise RuntimeError(
            "tfdist.internal.single_controller: MirroredExtended has no _default_device in "
            "this TensorFlow version, so a strategy scope over other tasks' devices may put "
            "resources (tokenizers, lookup tables) out of the controller's input pipeline's "
            "reach; update this module for the installed TensorFlow.")
    extended._default_device = None
