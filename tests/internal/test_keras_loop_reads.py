"""tfdist.internal.keras_loop_reads: the TF and Keras details it relies on, and its hook.

If a TF or Keras upgrade changes how loops are traced, or where Keras's TF `rnn`
calls its cell, these tests fail first. The values (LSTM, GRU, SimpleRNN, a
custom cell and a custom loop against one device) are in
`tests/distribution/test_recurrent.py`.
"""

import inspect

import keras
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_v2_func_graphs as cf_graphs

from tfdist.internal import keras_loop_reads
from tfdist.strategies import MeshStrategy


def test_install_wraps_layer_call_once_and_keeps_its_signature():
    keras_loop_reads.install()
    keras_loop_reads.install()
    call = keras.layers.Layer.__dict__["__call__"]
    assert call._tfdist_original is not None
    assert getattr(call._tfdist_original, "_tfdist_original", None) is None
    assert inspect.signature(call) == inspect.signature(call._tfdist_original)
    assert all(next(c for c in cls.__mro__ if "__call__" in c.__dict__) is keras.layers.Layer
               for cls in (keras.Model, keras.Sequential, keras.layers.RNN, keras.layers.LSTM))


def test_tf_traces_loop_bodies_and_cond_branches_as_graphs_inside_the_caller():
    seen = {}

    @tf.function
    def f(x):
        seen["caller"] = ops.get_default_graph()

        def body(i, x):
            seen["while"] = ops.get_default_graph()
            return i + 1, x * 2.0

        def branch():
            seen["cond"] = ops.get_default_graph()
            return x + 1.0

        def keras_body(i, x):
            seen["keras"] = ops.get_default_graph()
            return i + 1, x

        _, x = tf.while_loop(lambda i, x: i < 3, body, (0, x))
        _, x = keras.ops.while_loop(lambda i, x: i < 3, keras_body, (0, x))
        return tf.cond(x[0] > 0, branch, lambda: x)

    f(tf.ones([2]))
    assert isinstance(seen["while"], cf_graphs.WhileBodyFuncGraph)
    assert isinstance(seen["keras"], cf_graphs.WhileBodyFuncGraph)
    assert isinstance(seen["cond"], cf_graphs.CondBranchFuncGraph)
    for key in ("while", "keras", "cond"):
        assert isinstance(seen[key], cf_graphs.ControlFlowFuncGraph)
        assert seen[key].outer_graph is seen["caller"]
    assert not isinstance(seen["caller"], cf_graphs.ControlFlowFuncGraph)


class SpyCell(keras.layers.Layer):
    """Records the graph each of its calls is traced in."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state_size = 2
        self.graphs = []

    def call(self, inputs, states):
        self.graphs.append(ops.get_default_graph())
        return inputs[:, :2] + states[0], [states[0]]


@pytest.mark.parametrize("unroll", [False, True])
def test_keras_rnn_calls_its_cell_once_in_its_own_graph_then_in_a_loop_unless_unrolled(unroll):
    cell = SpyCell()
    layer = keras.layers.RNN(cell, unroll=unroll)
    graphs = []

    @tf.function
    def f(x):
        graphs.append(ops.get_default_graph())
        return layer(x)

    f(tf.ones([1, 3, 4]))
    caller = graphs[0]
    if unroll:
        assert cell.graphs == [caller] * 3  # the three steps
    else:
        assert cell.graphs[0] is caller  # time zero: the outputs' structure
        assert [type(g) for g in cell.graphs[1:]] == [cf_graphs.WhileBodyFuncGraph]
        assert cell.graphs[1].outer_graph is caller


class Probe(keras.layers.Layer):
    """Reads through `read_once` and records what the module sees, then returns x."""

    def __init__(self, records, **kwargs):
        super().__init__(**kwargs)
        self.record = records.append  # (Keras would copy a list attribute)

    def build(self, input_shape):  # (Keras would build by running `call`)
        pass

    def call(self, x):
        def read():
            self.record(("read", ops.get_default_graph()))
            return tf.constant(1.0)

        value = keras_loop_reads.read_once(self, "key", read)
        self.record(("probe", ops.get_default_graph(), keras_loop_reads.in_loop(),
                             keras_loop_reads._looping()))
        return x * value


class Looper(keras.layers.Layer):
    """Calls its probe twice inside a while_loop."""

    def __init__(self, probe, **kwargs):
        super().__init__(**kwargs)
        self.probe = probe

    def build(self, input_shape):
        pass

    def call(self, x):
        def body(i, x):
            return i + 1, self.probe(self.probe(x))

        return keras.ops.while_loop(lambda i, x: i < 3, body, (0, x))[1]


def _run_in_replicas(fn, x):
    strategy = MeshStrategy("data:2")  # frames are kept only in a mesh replica's trace
    with strategy.scope():
        step = tf.function(lambda x: strategy.run(fn, args=(x,)))
        step(x)


def test_a_read_inside_a_call_s_loop_is_made_once_in_the_outer_call_s_graph():
    records = []
    probe = Probe(records, name="probe")
    looper = Looper(probe, name="looper")
    outer_graphs = []

    def replica_fn(x):
        outer_graphs.append(ops.get_default_graph())
        return looper(x)

    _run_in_replicas(replica_fn, tf.ones([2, 3]))
    # Two replicas, each: one read (in the caller's graph), two probes in the loop body.
    reads = [r for r in records if r[0] == "read"]
    probes = [r for r in records if r[0] == "probe"]
    assert [r[1] for r in reads] == outer_graphs
    assert len(probes) == 4
    for _, graph, in_loop, looping in probes:
        assert isinstance(graph, cf_graphs.WhileBodyFuncGraph) and in_loop
        assert looping == (probe, looper)
    with pytest.raises(ValueError, match=r"Refusing 'inner' runs a collective \(psum\) inside "
                                         r"a while_loop within the call of Looper 'outer'"):
        _run_in_replicas(Looper(Refusing(name="inner"), name="outer"), tf.ones([2, 3]))


class Refusing(keras.layers.Layer):
    def call(self, x):
        keras_loop_reads.check_no_loop("psum")
        return x


def test_a_loop_around_the_whole_call_keeps_its_reads_inside():
    """`steps_per_execution`'s loop (or a custom step's) runs whole calls: weights change
    between its iterations, so reads stay in it."""
    records = []
    probe = Probe(records, name="probe")

    def replica_fn(x):
        return tf.while_loop(lambda i, x: i < 2, lambda i, x: (i + 1, probe(x)), (0, x))[1]

    _run_in_replicas(replica_fn, tf.ones([2, 3]))
    reads = [r for r in records if r[0] == "read"]
    probes = [r for r in records if r[0] == "probe"]
    assert len(reads) == len(probes) == 2
    for (_, read_graph), (_, graph, in_loop, looping) in zip(reads, probes):
        assert read_graph is graph and not in_loop and looping is None


class ProbeCell(keras.layers.Layer):
    def __init__(self, probe, **kwargs):
        super().__init__(**kwargs)
        self.probe = probe
        self.state_size = 3

    def build(self, input_shape):
        pass

    def call(self, inputs, states):
        return self.probe(inputs), [states[0]]


class TwoProbes(keras.layers.Layer):
    def __init__(self, probe, **kwargs):
        super().__init__(**kwargs)
        self.probe = probe

    def build(self, input_shape):
        pass

    def call(self, x):
        return self.probe(self.probe(x))


def test_reads_outside_loops_are_made_in_place_except_in_an_rnn_layer_s_call():
    records = []
    probe = Probe(records, name="probe")
    _run_in_replicas(TwoProbes(probe), tf.ones([2, 3]))
    assert len([r for r in records if r[0] == "read"]) == 4  # two per replica
    records.clear()
    _run_in_replicas(keras.layers.RNN(ProbeCell(probe), unroll=True), tf.ones([2, 4, 3]))
    assert len([r for r in records if r[0] == "probe"]) == 8  # four steps per replica
    assert len([r for r in records if r[0] == "read"]) == 2  # one per replica


def test_no_frames_outside_a_mesh_replica():
    records = []
    looper = Looper(Probe(records))
    tf.function(looper)(tf.ones([2, 3]))  # no strategy
    assert len([r for r in records if r[0] == "read"]) == 2  # in the loop body, per probe
    assert not getattr(keras_loop_reads._state, "frames", None)


class AssigningProbe(Probe):
    """Reads, is assigned (what a sharded variable's assignment calls), then reads again."""

    def call(self, x):
        x = super().call(x)
        keras_loop_reads.before_assign(self)
        return super().call(x)


def test_an_assignment_drops_the_read_and_is_refused_inside_a_loop_the_read_left():
    records = []
    _run_in_replicas(keras.layers.RNN(ProbeCell(AssigningProbe(records)), unroll=True),
                     tf.ones([2, 1, 3]))
    assert len([r for r in records if r[0] == "read"]) == 4  # read again after, per replica
    with pytest.raises(ValueError, match=r"split weight 'probe' is assigned inside a loop \(or "
                                         r"cond\) of the call of Looper 'looper', which reads "
                                         r"it once, before the loop"):
        _run_in_replicas(Looper(AssigningProbe([], name="probe"), name="looper"),
                         tf.ones([2, 3]))
