"""Named-axis collectives: values and gradients on a 2x4 mesh, identity elsewhere."""

import numpy as np
import pytest
import tensorflow as tf

from tfdist import collectives
from tfdist.strategies import MeshStrategy

MESH = "data:2;model:4"


@pytest.fixture(scope="module")
def strategy():
    return MeshStrategy(MESH)


def _run(strategy, fn):
    """Runs fn(replica_id) on every replica; returns per-replica numpy results."""

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            return fn(int(tf.get_static_value(ctx.replica_id_in_sync_group)))

        return strategy.run(replica_fn)

    out = step()
    return [tf.nest.map_structure(lambda t: t.numpy(), v) for v in strategy.experimental_local_results(out)]


def _x(replica):
    """A [4, 2] tensor unique to the replica."""
    return tf.constant(np.arange(8, dtype="float32").reshape(4, 2) + 100 * replica)


def _np_x(replica):
    return np.arange(8, dtype="float32").reshape(4, 2) + 100 * replica


GROUPS = {"model": [[0, 1, 2, 3], [4, 5, 6, 7]], "data": [[0, 4], [1, 5], [2, 6], [3, 7]]}


def _group(axis, replica):
    return next(g for g in GROUPS[axis] if replica in g)


@pytest.mark.parametrize("axis", ["model", "data"])
def test_axis_index_and_size(strategy, axis):
    out = _run(strategy, lambda r: tf.constant([collectives.axis_index(axis), collectives.axis_size(axis)]))
    for r, (index, size) in enumerate(out):
        assert size == len(_group(axis, r)) and index == _group(axis, r).index(r)


@pytest.mark.parametrize("axis", ["model", "data"])
def test_psum(strategy, axis):
    out = _run(strategy, lambda r: collectives.psum(_x(r), axis))
    for r, value in enumerate(out):
        np.testing.assert_allclose(value, sum(_np_x(p) for p in _group(axis, r)))


@pytest.mark.parametrize("axis", ["model", "data"])
def test_pmax(strategy, axis):
    out = _run(strategy, lambda r: collectives.pmax(_x(r) * (-1.0) ** r, axis))
    for r, value in enumerate(out):
        np.testing.assert_allclose(
            value, np.max([_np_x(p) * (-1.0) ** p for p in _group(axis, r)], axis=0))


@pytest.mark.parametrize("axis, dim", [("model", 0), ("model", 1), ("data", 1)])
def test_all_gather(strategy, axis, dim):
    out = _run(strategy, lambda r: collectives.all_gather(_x(r), axis, dim=dim))
    for r, value in enumerate(out):
        np.testing.assert_array_equal(value, np.concatenate([_np_x(p) for p in _group(axis, r)], axis=dim))


@pytest.mark.parametrize("axis", ["model", "data"])
def test_reduce_scatter(strategy, axis):
    out = _run(strategy, lambda r: collectives.reduce_scatter(_x(r), axis, dim=0))
    for r, value in enumerate(out):
        group = _group(axis, r)
        total = sum(_np_x(p) for p in group)
        np.testing.assert_allclose(value, np.split(total, len(group), axis=0)[group.index(r)])


def test_all_to_all(strategy):
    out = _run(strategy, lambda r: collectives.all_to_all(_x(r), "model", split_dim=0, concat_dim=1))
    for r, value in enumerate(out):
        group = _group("model", r)
        expected = np.concatenate([np.split(_np_x(p), 4, axis=0)[group.index(r)] for p in group], axis=1)
        np.testing.assert_array_equal(value, expected)


OPS = {
    "psum": lambda x: collectives.psum(x, "model"),
    "all_gather": lambda x: collectives.all_gather(x, "model", dim=0),
    "reduce_scatter": lambda x: collectives.reduce_scatter(x, "model", dim=0),
    "all_to_all": lambda x: collectives.all_to_all(x, "model", split_dim=0, concat_dim=1),
}

# What device `i` of a group of m receives, computed globally from all inputs.
GLOBAL_OPS = {
    "psum": lambda xs, i: tf.add_n(xs),
    "all_gather": lambda xs, i: tf.concat(xs, axis=0),
    "reduce_scatter": lambda xs, i: tf.split(tf.add_n(xs), len(xs), axis=0)[i],
    "all_to_all": lambda xs, i: tf.concat([tf.split(x, len(xs), axis=0)[i] for x in xs], axis=1),
}


def _weights(y, replica):
    return tf.reshape(tf.range(tf.size(y), dtype=tf.float32), y.shape) * (replica + 1)


@pytest.mark.parametrize("name", sorted(OPS))
def test_gradients_match_the_global_computation(strategy, name):
    """d/dx_r of sum over replicas of <c_r, op(x)_r>, against one-device autodiff."""

    def grad_fn(r):
        x = _x(r)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = OPS[name](x)
            loss = tf.reduce_sum(_weights(y, r) * y)
        return tape.gradient(loss, x)

    grads = _run(strategy, grad_fn)
    for group in GROUPS["model"]:
        xs = [tf.Variable(_np_x(p)) for p in group]
        with tf.GradientTape() as tape:
            loss = 0.0
            for i, p in enumerate(group):
                y = GLOBAL_OPS[name](xs, i)
                loss += tf.reduce_sum(_weights(y, p) * y)
        for p, g in zip(group, tape.gradient(loss, xs)):
            np.testing.assert_allclose(grads[p], g.numpy(), rtol=1e-6)


def test_outside_a_replica_collectives_are_the_identity():
    x = tf.constant([[1.0, 2.0]])
    assert collectives.axis_size("model") == 1 and collectives.axis_index("model") == 0
    for y in (collectives.psum(x, "model"), collectives.pmax(x, "model"),
              collectives.all_gather(x, "model"),
              collectives.reduce_scatter(x, "model"),
              collectives.all_to_all(x, "model", split_dim=0, concat_dim=1)):
        np.testing.assert_array_equal(y.numpy(), x.numpy())
    assert collectives.current_mesh().size == 1


def test_collectives_in_eager_replicas_raise_instead_of_hanging(strategy):
    with pytest.raises(RuntimeError, match="inside tf.function"):
        strategy.run(lambda: collectives.psum(tf.ones(2), "model"))


def test_repeated_collectives_do_not_pile_up_threads(strategy):
    """A collective timeout costs a sleeping thread per execution; the default has none."""
    import re

    def threads():
        return int(re.search(r"Threads:\s+(\d+)", open("/proc/self/status").read()).group(1))

    @tf.function
    def step():
        return strategy.run(lambda: collectives.psum(tf.ones(2), "model"))

    step()
    before = threads()
    for _ in range(100):
        step()
    # A pile-up adds one thread per execution (100); a loaded machine's pools may
    # still grow by a few threads (8 seen once at 30 executions with three workers).
    assert threads() - before < 40


def test_an_all_to_all_whose_shape_varies_under_fixed_inputs_pairs_by_its_own_shape(strategy):
    """A dropless MoE's expert buffers: sized by a value each step, not by the inputs.

    The step's inputs keep their shapes, so the step-level shape keys cannot
    tell the executions apart; without `shape_varies` the second size meets
    the first one's instance record ("Shape mismatch in the collective
    instance").
    """
    size = tf.Variable(2)

    @tf.function
    def step():
        def replica_fn():
            rows = tf.identity(size) * 4  # known only at run time
            x = tf.fill(tf.stack([rows, 2]), 1.0)
            y = collectives.all_to_all(x, "model", split_dim=0, concat_dim=1, shape_varies=True)
            with tf.GradientTape() as tape:
                tape.watch(x)
                z = collectives.all_to_all(x, "model", split_dim=0, concat_dim=1,
                                           shape_varies=True)
            return tf.shape(y), tape.gradient(z, x, output_gradients=z)

        return strategy.run(replica_fn)

    for n in (2, 3, 2, 1, 3):
        size.assign(n)
        for shape, grad in strategy.experimental_local_results(step()):
            assert shape.numpy().tolist() == [n, 8]
            np.testing.assert_array_equal(grad.numpy(), np.ones((4 * n, 2)))
