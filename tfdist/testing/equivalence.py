"""Compare a sharded model with its single-device reference.

`compare_with_reference` measures, as max relative differences
(`max|a - b| / max|b|` per tensor, the largest over tensors):

- forward: `predict` outputs on the same inputs;
- loss (including losses layers add with `add_loss`, compared on their own
  as `added_losses`) and gradients of one global batch (sharded gradients
  summed over the replicas that hold each shard, reassembled into global
  tensors);
- weights and optimizer variables after `steps` steps of `fit` on the same
  global batches.

A strategy whose layout splits `length` gets the batches rewritten by
`tfdist.sequence.split_sequences` (every device its tokens of the same rows).

`assert_equivalent` asserts all of them are within `rtol`.
"""

import dataclasses
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from tfdist.testing.reference import reference_model


def max_rel_diff(actual, expected) -> float:
    """`max|actual - expected| / max|expected|` (0 when both are zero)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {actual.shape} != reference shape {expected.shape}")
    scale = np.max(np.abs(expected)) if expected.size else 0.0
    err = np.max(np.abs(actual - expected)) if expected.size else 0.0
    return float(err / scale) if scale > 0 else float(err)


@dataclasses.dataclass
class EquivalenceReport:
    forward: float
    loss: float
    added_losses: float
    gradients: float
    weights: float
    optimizer_variables: float
    steps: int
    model: object = dataclasses.field(default=None, repr=False, compare=False)
    """The trained model under test (for reading its components)."""

    def worst(self) -> float:
        return max(self.forward, self.loss, self.added_losses, self.gradients,
                   self.weights, self.optimizer_variables)

    def __str__(self) -> str:
        return (f"forward {self.forward:.1e}, loss {self.loss:.1e}, added losses "
                f"{self.added_losses:.1e}, gradients "
                f"{self.gradients:.1e}, weights after {self.steps} steps "
                f"{self.weights:.1e}, optimizer variables {self.optimizer_variables:.1e}")


def _same_length(what, actual, expected):
    """Raises unless both lists are as long: `zip` would compare a prefix silently."""
    if len(actual) != len(expected):
        raise AssertionError(f"the model has {len(actual)} {what}, its reference "
                             f"{len(expected)}: nothing would compare the others")


def _rows(x, n):
    """The first `n` rows of an array or of each array of a tuple/dict."""
    return tf.nest.map_structure(lambda a: a[:n], x)


def _per_device(strategy, value):
    """Numpy values of a per-replica `value` for every mesh device, in device order.

    A strategy whose replicas live in several processes (HorovodStrategy)
    gathers them with `gather_local_results` (a collective: all processes).
    """
    local = [np.asarray(tf.convert_to_tensor(v).numpy())  # IndexedSlices too
             for v in strategy.experimental_local_results(value)]
    gather = getattr(strategy, "gather_local_results", None)
    return gather(local) if gather is not None else local


def _length_split(strategy):
    """The strategy's mesh if its layout splits `length` (batches must then be
    rewritten so that every device gets its tokens), else None."""
    from tfdist.sequence.split import sequence_axis

    mesh = getattr(strategy, "mesh", None)
    return mesh if mesh is not None and sequence_axis(mesh) is not None else None


def _batches(strategy, x, y, batch_size):
    """Global batches of `(x, y)`, each rewritten for a length split."""
    from tfdist.sequence import split_sequences

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    return split_sequences(dataset, _length_split(strategy))


def _global_gradients(strategy, model, loss_fn, x, y):
    """Loss and global gradients of one global batch, computed on `strategy`."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(y))
    if _length_split(strategy) is not None:
        dataset = _batches(strategy, x, y, len(y))
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    variables = model.trainable_variables
    n = strategy.num_replicas_in_sync

    @tf.function
    def step(batch):
        def replica_fn(xb, yb):
            # Under a strategy, Keras loss objects already divide by the replica
            # count; losses added by layers do not (Keras scales them in fit).
            with tf.GradientTape() as tape:
                predictions = model(xb, training=True)
                added = tf.add_n(model.losses) / n if model.losses else tf.constant(0.0)
                loss = loss_fn(yb, predictions) + added
            return loss, added, tape.gradient(loss, [v.value for v in variables])

        return strategy.run(replica_fn, args=batch)

    losses, added, grads = step(batch)
    loss = np.sum(_per_device(strategy, losses))
    added = np.sum(_per_device(strategy, added))
    result = []
    for var, grad in zip(variables, grads):
        if grad is None or any(g is None for g in strategy.experimental_local_results(grad)):
            raise AssertionError(f"no gradient for {var.path}: {grad}")
        shards = _per_device(strategy, grad)
        layout = getattr(var.value, "layout", None)
        kept = getattr(var.value, "_tfdist_kept", None)
        if kept is not None and kept.whole_gradient:  # ZeRO-1: whole gradients, the map's layout
            layout = kept.base
        if layout is None:
            result.append(np.sum(shards, axis=0))
            continue
        full = np.zeros(layout.padded_shape, dtype=np.float64)
        for group in layout.shard_owner_groups():
            full[layout.shard_slices(group[0])] = np.sum([shards[i] for i in group], axis=0)
        result.append(full[tuple(slice(0, n) for n in layout.shape)])
    return loss, added, result


@dataclasses.dataclass
class ReferenceRun:
    """What the single-device reference computed (reusable across meshes)."""

    initial_weights: list
    outputs: object  # forward on the first batch, or None
    loss: float
    added_losses: float
    gradients: list
    weights: list
    optimizer_variables: list


def _build_reference(build_model, reference, seed):
    keras.utils.set_random_seed(seed)
    return reference_model(build_model()) if reference is None else reference()


def run_reference(
    build_model: Callable[[], keras.Model],
    x,
    y,
    *,
    loss,
    optimizer: Callable[[], keras.optimizers.Optimizer],
    batch_size: int,
    steps: int = 20,
    seed: int = 0,
    compare_outputs: bool = True,
    reference: Callable[[], keras.Model] = None,
    run_eagerly: bool = False,
) -> ReferenceRun:
    """Runs the single-device reference alone (arguments as `compare_with_reference`'s,
    `loss` being the reference's).

    A test comparing several meshes with one reference computes it once and
    passes it as `compare_with_reference(..., reference_run=...)`. `run_eagerly`
    trains it eagerly: faster for references built of many small ops (a
    per-token loop traces for longer than it runs).
    """
    model = _build_reference(build_model, reference, seed)
    return _train_reference(model, x, y, loss=loss, optimizer=optimizer,
                            batch_size=batch_size, steps=steps,
                            compare_outputs=compare_outputs, run_eagerly=run_eagerly)


def _train_reference(model, x, y, *, loss, optimizer, batch_size, steps, compare_outputs,
                     run_eagerly=False) -> ReferenceRun:
    """`run_reference` on an already built reference `model`."""
    initial = model.get_weights()
    x1, y1 = _rows(x, batch_size), _rows(y, batch_size)
    outputs = model(x1, training=False) if compare_outputs else None
    with tf.GradientTape() as tape:
        predictions = model(x1, training=True)
        added = tf.add_n(model.losses) if model.losses else tf.constant(0.0)
        value = loss(y1, predictions) + added
    grads = tape.gradient(value, model.trainable_variables)
    model.compile(optimizer=optimizer(), loss=loss, run_eagerly=run_eagerly)
    n = steps * batch_size
    model.fit(_rows(x, n), _rows(y, n), batch_size=batch_size, epochs=1, shuffle=False,
              verbose=0)
    return ReferenceRun(
        initial_weights=initial,
        outputs=None if outputs is None else tf.nest.map_structure(np.asarray, outputs),
        loss=float(value.numpy()), added_losses=float(added.numpy()),
        gradients=[np.asarray(tf.convert_to_tensor(g)) for g in grads],
        weights=model.get_weights(),
        optimizer_variables=[v.numpy() for v in model.optimizer.variables])


def compare_with_reference(
    build_model: Callable[[], keras.Model],
    strategy,
    x,
    y,
    *,
    loss,
    optimizer: Callable[[], keras.optimizers.Optimizer],
    batch_size: int,
    steps: int = 20,
    seed: int = 0,
    reference_loss=None,
    compare_outputs: bool = True,
    reference: Callable[[], keras.Model] = None,
    reference_run: ReferenceRun = None,
) -> EquivalenceReport:
    """Trains `build_model()` on `strategy` and its reference on one device.

    Args:
        build_model: builds the tfdist model (called once outside any strategy,
            once under `strategy.scope()`).
        strategy: the strategy under test.
        x, y: at least `steps * batch_size` examples.
        loss: a `keras.losses.Loss` object with `sum_over_batch_size` reduction.
        optimizer: makes a fresh optimizer.
        batch_size: the global batch size.
        steps: optimizer steps to compare weights after.
        seed: Keras seed for the initial weights.
        reference_loss: the reference model's loss, if it differs (e.g. Keras
            cross-entropy for a model trained with a sharded one).
        compare_outputs: compare `predict` outputs (off for models whose
            outputs are shards, such as `ShardedSoftmax` logits; forward is then
            reported as 0 and covered by the loss).
        reference: builds the single-device reference (called outside any
            strategy); default: `build_model()` with each tfdist layer replaced
            by its plain Keras twin (`reference_model`), which needs a
            functional model. A subclassed model is its own reference on one
            device, where every collective is the identity.
        reference_run: the reference's results from `run_reference` with the
            same arguments, computed once for several strategies.
    """
    reference_loss = loss if reference_loss is None else reference_loss
    for value in (loss, reference_loss):
        if not isinstance(value, keras.losses.Loss):
            raise TypeError(f"losses must be keras.losses.Loss objects; received {value!r}.")
    # Built even when its run is given: the model is built from the same random
    # state (layers' seed generators) either way.
    reference_built = _build_reference(build_model, reference, seed)
    with strategy.scope():
        model = build_model()
    ref = reference_run
    if ref is None:
        ref = _train_reference(reference_built, x, y, loss=reference_loss, optimizer=optimizer,
                               batch_size=batch_size, steps=steps,
                               compare_outputs=compare_outputs)
    model.set_weights(ref.initial_weights)

    forward = 0.0
    x1, y1 = _rows(x, batch_size), _rows(y, batch_size)
    if compare_outputs:
        mesh = _length_split(strategy)
        if mesh is not None:  # every device its tokens; outputs merged back into sequences
            from tfdist.sequence import merge_sequences, split_sequences

            local = model.predict(split_sequences(
                tf.data.Dataset.from_tensor_slices(x1).batch(batch_size), mesh), verbose=0)
            outputs = [merge_sequences(o, mesh) for o in tf.nest.flatten(local)]
        else:
            outputs = tf.nest.flatten(model.predict(x1, batch_size=batch_size, verbose=0))
        _same_length("outputs", outputs, tf.nest.flatten(ref.outputs))
        forward = max(max_rel_diff(a, b) for a, b in zip(outputs, tf.nest.flatten(ref.outputs)))
    loss_value, added, grads = _global_gradients(strategy, model, loss, x1, y1)
    _same_length("gradients", grads, ref.gradients)
    gradients = max(max_rel_diff(g, r) for g, r in zip(grads, ref.gradients))

    with strategy.scope():
        model.compile(optimizer=optimizer(), loss=loss)
    n = steps * batch_size
    if _length_split(strategy) is not None:  # every device its tokens of the same rows
        model.fit(_batches(strategy, _rows(x, n), _rows(y, n), batch_size), epochs=1,
                  verbose=0)
    else:
        model.fit(_rows(x, n), _rows(y, n), batch_size=batch_size, epochs=1, shuffle=False,
                  verbose=0)
    _same_length("weights", model.get_weights(), ref.weights)
    _same_length("optimizer variables", model.optimizer.variables, ref.optimizer_variables)
    weights = max(max_rel_diff(a, b) for a, b in zip(model.get_weights(), ref.weights))
    slots = max(max_rel_diff(a.numpy(), b)
                for a, b in zip(model.optimizer.variables, ref.optimizer_variables))
    return EquivalenceReport(
        forward=forward,
        loss=max_rel_diff(loss_value, ref.loss),
        added_losses=max_rel_diff(added, ref.added_losses),
        gradients=gradients,
        weights=weights,
        optimizer_variables=slots,
        steps=steps,
        model=model,
    )


def assert_equivalent(*args, rtol: float = 1e-5, **kwargs) -> EquivalenceReport:
    """`compare_with_reference`, asserting every difference is within `rtol`."""
    report = compare_with_reference(*args, **kwargs)
    assert report.worst() <= rtol, f"not equivalent within {rtol}: {report}"
    return report
