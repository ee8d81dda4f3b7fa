"""Split weights read inside a loop of a Keras call: read once, before the loop.

Private TF/Keras details used here (and only here):

- `keras.layers.Layer.__call__` is wrapped, once: while a layer's call is
  traced in a replica of a tfdist mesh strategy, a per-thread stack records
  the layer and the graph its call started in (the stack is empty elsewhere:
  eager code, cross-replica code such as Keras's symbolic build).
- TF's v2 control flow (`tf.while_loop`, hence `keras.ops.while_loop`,
  `fori_loop`, `scan` and Keras's TF `rnn`; `tf.cond`) traces a loop's body
  and condition, and a cond's branches, as `ControlFlowFuncGraph`s
  (`tensorflow.python.ops.control_flow_v2_func_graphs`) whose `outer_graph`
  is the graph the loop is built in. A tensor of an outer graph used in the
  body is captured: the loop takes it as a loop invariant, and the gradient of
  the loop sums the gradient of every iteration into it.

Why: a weight a `LayoutMap` splits is read whole in a replica, all-gathered
from its shards (FSDP, `tfdist.weight_reads`), and its gradient is
reduce-scattered back. A Keras `LSTM`, `GRU`, `SimpleRNN` (or any
`keras.layers.RNN` cell, or a layer running its own `while_loop`) reads its
weights inside the loop's body, every step. TF cannot differentiate a loop
whose body holds the TF backend's collectives: tracing the gradient fails with
an internal error ("... ordering_token ... is in list of internal_captures but
not in internal_capture_to_output"), and a gather per step would cost T
gathers and T reduce-scatters anyway. So a split weight read inside a loop
(or cond) that runs within a Keras call is read in the graph the *outermost*
Keras call of the replica started in, once per loop, and the loop captures
the gathered value: one all-gather before the loop, and its gradient, the sum
over the steps, is reduce-scattered once after the loop's gradient. Within a
Keras `RNN` layer's call (`unroll=True` builds no loop) every read of a split
weight in the call's own graph is one read as well. Results are one device's.

Where no read can be moved, a layer that runs tfdist collectives on its
activations inside a `while_loop` of a Keras call (tfdist's own sharded
layers) is refused when traced, with an error naming it (`check_no_loop`);
the Keras layers tfdist computes on shards (`keras_tensor_parallel`) fall
back there to their own call, whose weights are then read gathered, once,
before the loop (`in_loop`).

An assignment of such a weight during the call drops its read (later reads
read it anew), and is refused inside a loop a read of it was moved out of
(`before_assign`).

`tests/internal/test_keras_loop_reads.py` checks each detail against the
installed Keras and TF.
"""

import functools
import threading
from typing import Optional, Tuple

import keras
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_v2_func_graphs as cf_graphs

from tfdist import runtime

_state = threading.local()  # .frames: the `_Frame`s of the Keras calls being traced here

_LOOP_GRAPHS = (cf_graphs.WhileBodyFuncGraph, cf_graphs.WhileCondFuncGraph)


class _Frame:
    """One Keras layer call being traced in a replica: the layer, the graph its call
    started in, and the weights read once for it ({key: (variable, tensor, graph)})."""

    __slots__ = ("layer", "graph", "reads")

    def __init__(self, layer, graph):
        self.layer, self.graph, self.reads = layer, graph, {}


def _frames():
    frames = getattr(_state, "frames", None)
    if frames is None:
        frames = _state.frames = []
    return frames


def _traced_in_mesh_replica() -> bool:
    return (not tf.executing_eagerly() and runtime.current_runtime() is not None
            and not tf.distribute.in_cross_replica_context())


def _wrap(original):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        if not _traced_in_mesh_replica():
            return original(self, *args, **kwargs)
        frames = _frames()
        frames.append(_Frame(self, ops.get_default_graph()))
        try:
            return original(self, *args, **kwargs)
        finally:
            frames.pop()

    __call__._tfdist_original = original
    return __call__


def install() -> None:
    """Wraps `keras.layers.Layer.__call__` (idempotent)."""
    current = keras.layers.Layer.__dict__["__call__"]
    if getattr(current, "_tfdist_original", None) is None:
        keras.layers.Layer.__call__ = _wrap(current)


def _chain():
    """The graphs from the current one up to the outermost Keras call's (excluded), or
    None when no Keras call is traced here or the current graph is not inside its."""
    frames = getattr(_state, "frames", None)
    if not frames:
        return None
    top = frames[0].graph
    graph, chain = ops.get_default_graph(), []
    while graph is not top:
        chain.append(graph)
        graph = getattr(graph, "outer_graph", None)
        if graph is None:
            return None
    return chain


def _moved_out(chain) -> bool:
    return any(isinstance(g, cf_graphs.ControlFlowFuncGraph) for g in chain)


def read_once(variable, key, read):
    """`read()`, a replica's gathered read of split weight `variable`, made once per call.

    Args:
        variable: the sharded variable being read.
        key: what else the read depends on (the axes kept local).
        read: makes the read in the current graph.

    Returns:
        Inside a loop or cond of a Keras call: the read made in the graph of the
        outermost Keras call (the loop captures it), once per `key` and call of
        the innermost layer called in that graph (the layer that runs the loop:
        an RNN layer, or a layer with its own `while_loop`). In a Keras `RNN`
        layer's call, in that call's graph (Keras's TF `rnn` calls the cell once
        outside the loop, and `unroll=True` builds no loop): the same one read.
        Elsewhere: `read()`.
    """
    chain = _chain()
    if chain is None:
        return read()
    frames = _state.frames
    if _moved_out(chain):
        home = frames[0].graph
        frame = next(f for f in reversed(frames) if f.graph is home)
    else:
        home = ops.get_default_graph()
        frame = next((f for f in reversed(frames)
                      if f.graph is home and isinstance(f.layer, keras.layers.RNN)), None)
        if frame is None:
            return read()
    entry = (id(variable), key)
    if entry not in frame.reads:
        with home.as_default():
            frame.reads[entry] = (variable, read(), home)  # (the variable keeps its id unique)
    return frame.reads[entry][1]


def in_loop() -> bool:
    """Whether the current graph is inside a `while_loop` of a Keras call traced here."""
    chain = _chain()
    return chain is not None and any(isinstance(g, _LOOP_GRAPHS) for g in chain)


def _looping() -> Optional[Tuple[object, object]]:
    """`(layer, looper)`: the innermost Keras layer being called and the one whose call
    runs the `while_loop` the current graph is in; None outside such a loop."""
    chain = _chain()
    if chain is None:
        return None
    inner = next((i for i, g in enumerate(chain) if isinstance(g, _LOOP_GRAPHS)), None)
    if inner is None:
        return None
    frames = _state.frames
    outside = [frames[0].graph, *chain[inner + 1:]]
    looper = next(f for f in reversed(frames) if any(f.graph is g for g in outside))
    return frames[-1].layer, looper.layer


def _describe(layer) -> str:
    return f"{type(layer).__name__} {getattr(layer, 'name', '?')!r}"


def check_no_loop(what: str) -> None:
    """Raises if a tfdist collective (`what`) is traced inside a `while_loop` of a Keras call.

    TF cannot differentiate a loop whose body holds such a collective (and it
    would run once per step): tfdist refuses it when traced, naming the layer.
    """
    looping = _looping()
    if looping is None:
        return
    layer, looper = looping
    where = "" if looper is layer else f" within the call of {_describe(looper)}"
    raise ValueError(
        f"tfdist: {_describe(layer)} runs a collective ({what}) inside a while_loop"
        f"{where}. TensorFlow cannot differentiate a loop whose body holds tfdist's "
        f"collectives (which would also run once per step). tfdist moves the reads of "
        f"split weights out of a loop (Keras's own layers read them whole there), not a "
        f"computation on shards: call this layer outside the loop, or leave its weights "
        f"unsplit.")


def before_assign(variable) -> None:
    """Called before `variable` is assigned: its reads made once for a Keras call traced
    here in this graph are dropped (later reads read it anew, after the assignment).

    Raises:
        ValueError: naming the variable and the layer, if a read of it was moved out of
            the loop (or cond) the assignment is in: the loop would not see it.
    """
    graph = ops.get_default_graph()
    for frame in getattr(_state, "frames", None) or ():
        for entry, (read, _, home) in list(frame.reads.items()):
            if read is not variable:
                continue
            if graph is not home:
                raise ValueError(
                    f"tfdist: split weight {variable.name!r} is assigned inside a loop (or "
                    f"cond) of the call of {_describe(frame.layer)}, which reads it once, "
                    f"before the loop; assign it outside the loop.")
            del frame.reads[entry]
