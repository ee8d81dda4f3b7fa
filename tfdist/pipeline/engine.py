"""Runs a pipeline `Schedule` as one TensorFlow graph over the stages' devices.

Each stage is a Keras layer (or model) whose variables live on its own device.
One training step is one graph: micro-batch i's forward through stage s runs on
stage s's device, its output is the next stage's input (TF copies it across
devices, or across processes over gRPC when the devices are remote), and each
backward takes the gradient of its stage's output from the next stage. TF's
executor runs an op as soon as its inputs are ready, so stages work on
different micro-batches at once; what the schedule adds is the *order* on each
device: every action's ops wait (control dependencies) for the previous action
on the same device, so a device runs exactly its list from the schedule
(GPipe: all forwards then all backwards; 1F1B: warm-up, one forward one
backward, cool-down) and keeps at most the schedule's stash of activations.

Cheat-sheet (see `tfdist.pipeline.schedule`):

    N   rows of the global batch; micro-batch i has n_i rows (sizes differ by at
        most one, any N and m), sum n_i = N
    x_s^i   input of stage s for micro-batch i (x_0^i: the data rows)
    y_s^i   output of stage s; y_s^i = x_{s+1}^i
    L^i     n_i / N * loss(y_{p-1}^i, targets^i): the micro-batch's share of the
            global mean, so that sum_i L^i is the one-device loss of the batch
            (n_i: rows, or what the loss averages over, e.g. real tokens)
    dy_s^i  dL/dy_s^i (the last stage starts from L^i itself)

The gradients are the sums over micro-batches, which is the one-device
gradient of the whole batch whenever the loss is a mean over rows (Keras's
default reduction, "sum_over_batch_size").

Example:

```python
executor = PipelineExecutor(stages, devices, one_f_one_b(2, 4))
loss, gradients = executor.loss_and_gradients(x, y, loss_fn)   # in a tf.function
```
"""

import functools
from typing import Callable, List, Optional, Sequence, Tuple

from tfdist.pipeline.schedule import Schedule, check, simulate


def split_rows(tensor, num_microbatches: int):
    """Splits `tensor` along its first axis into `num_microbatches` parts whose row
    counts differ by at most one (the first `N % m` parts have one more row).

    Works on a batch size known only when the graph runs; with fewer rows than
    micro-batches the last parts are empty.
    """
    import tensorflow as tf

    rows = tf.shape(tensor)[0]
    index = tf.range(num_microbatches)
    sizes = rows // num_microbatches + tf.cast(index < rows % num_microbatches, rows.dtype)
    return tf.split(tensor, sizes, num=num_microbatches, axis=0)


def compute_order(schedule: Schedule):
    """The schedule's forwards and backwards in an order a graph can be built in.

    Ordered by their start in a simulation of the schedule, so every action comes
    after the actions whose results it reads; per device, in the schedule's order.
    """
    timeline = simulate(schedule).timeline
    events = [e for events in timeline for e in events if e.action.is_compute]
    events.sort(key=lambda e: (e.start, e.device))
    return [e.action for e in events]


class PipelineExecutor:
    """Builds one training or inference step of a pipeline from a schedule.

    Args:
        stages: the stages in order, callables `stage(x, training=...)` with
            `trainable_variables` (Keras layers or models), each built with its
            variables on its (first) device. One per virtual stage (p * v of
            them, virtual stage k on device k % p, as in `Schedule`).
        devices: one entry per pipeline rank (p of them): a TF device name, or
            a sequence of R device names to run R pipelines side by side (data
            parallelism: replica r takes the r-th R-th of the batch's rows and
            runs stage s on `devices[s][r]`; the variables live on replica 0's
            device, the others read them and their gradients are summed there).
        schedule: the `Schedule` (checked here).
    """

    def __init__(self, stages: Sequence, devices: Sequence, schedule: Schedule):
        check(schedule)
        if len(devices) != schedule.num_stages:
            raise ValueError(f"The schedule {schedule.name!r} has {schedule.num_stages} "
                             f"devices but {len(devices)} were given: {list(devices)}.")
        if len(stages) != schedule.num_virtual_stages:
            raise ValueError(f"The schedule {schedule.name!r} runs "
                             f"{schedule.num_virtual_stages} stages ({schedule.num_stages} "
                             f"devices x {schedule.num_chunks} chunks) but {len(stages)} "
                             f"stages were given.")
        grid = [(d,) if isinstance(d, str) else tuple(d) for d in devices]
        if len({len(g) for g in grid}) != 1 or not grid[0]:
            raise ValueError(f"Every pipeline rank needs the same number (>= 1) of data "
                             f"replicas' devices; got {[list(g) for g in grid]}.")
        flat = [d for g in grid for d in g]
        if len(set(flat)) != len(flat):
            raise ValueError(f"A device appears twice among the pipeline's devices {flat}: "
                             f"each (stage, replica) needs its own device.")
        self.stages = list(stages)
        self.grid = grid
        self.devices = [g[0] for g in grid]
        self.num_replicas = len(grid[0])
        self.schedule = schedule
        self.order = compute_order(schedule)

    def device_of(self, stage: int, replica: int = 0) -> str:
        return self.grid[self.schedule.device_of(stage)][replica]

    def _split(self, structure):
        """Rows per (replica, micro-batch), replica-major: concatenated in this
        order they are the batch's rows in their order. `structure` may be a
        tensor or a nest of tensors (e.g. `(source_ids, target_ids)`), split alike."""
        import tensorflow as tf

        m = self.schedule.num_microbatches
        columns = [[part for replica in split_rows(t, self.num_replicas)
                    for part in split_rows(replica, m)] for t in tf.nest.flatten(structure)]
        return [tf.nest.pack_sequence_as(structure, list(parts)) for parts in zip(*columns)]

    def forward(self, x, training: bool = False, added_loss_fn: Optional[Callable] = None):
        """The stages applied to `x`, micro-batch by micro-batch, concatenated.

        Only forwards: stage s of micro-batch i waits for stage s of micro-batch
        i - 1 on its device, so the devices work on successive micro-batches at once.
        With `added_loss_fn` (as in `loss_and_gradients`), returns
        `(outputs, added)`: `added` the sum over micro-batches of the losses the
        stages' calls add, each weighted by its micro-batch's share of the rows
        (None if no stage adds any).
        """
        import tensorflow as tf

        m = self.schedule.num_microbatches
        outputs = self._split(x)
        rows = [tf.cast(tf.shape(tf.nest.flatten(part)[0])[0], tf.float32) for part in outputs]
        total_rows = tf.cast(tf.shape(tf.nest.flatten(x)[0])[0], tf.float32)
        added = []
        for s, stage in enumerate(self.stages):
            for r in range(self.num_replicas):
                previous = []
                with tf.device(self.device_of(s, r)):
                    for i in range(r * m, (r + 1) * m):
                        received = _received(outputs[i])  # not held back by the order
                        with tf.control_dependencies(previous):
                            outputs[i] = stage(received, training=training)
                            if added_loss_fn is not None and stage.losses:
                                added.append(added_loss_fn(stage.losses) * rows[i] / total_rows)
                        previous = tf.nest.flatten(outputs[i])
        with tf.device(self.device_of(len(self.stages) - 1)):
            outputs = tf.concat(outputs, axis=0)
            if added_loss_fn is None:
                return outputs
            return outputs, (tf.add_n(added) if added else None)

    def loss_and_gradients(self, x, y, loss_fn: Callable, sample_weight=None,
                           count_fn: Optional[Callable] = None,
                           added_loss_fn: Optional[Callable] = None
                           ) -> Tuple[object, List, object]:
        """One step's loss, gradients and outputs, run in the schedule's order.

        Args:
            x: the global batch's inputs (first axis: rows).
            y: its targets, split like `x`.
            loss_fn: `loss_fn(y_i, y_pred_i, sample_weight_i)` -> the mean loss of
                micro-batch i (a scalar); it is weighted by the micro-batch's share
                of the rows.
            sample_weight: optional, split like `x`.
            count_fn: `count_fn(y_i)` -> what the loss averages over in `y_i`
                (float); micro-batch i's loss is weighted by its count over the
                batch's. Default: rows (Keras's "sum_over_batch_size" losses);
                a loss averaging over tokens that are not padding gives their
                number (`SequenceCrossentropy.normalizer`).
            added_loss_fn: `added_loss_fn(losses)` -> a scalar, for the losses a
                stage's call adds (`stage.losses` after it: `add_loss`, an MoE's
                load-balancing loss, regularizers); they join micro-batch i's
                loss with the same weight, on the stage's device. Default: none
                are counted.

        Returns:
            `(loss, gradients, outputs)`: the batch's loss (sum of the micro-batch
            shares), per stage the list of gradients of its `trainable_variables`
            (summed over micro-batches and replicas; `None` where a variable gets
            none), and the last stage's outputs for the whole batch (for metrics).
        """
        import tensorflow as tf

        m, R = self.schedule.num_microbatches, self.num_replicas
        last = len(self.stages) - 1
        with tf.device(self.device_of(0)):  # the inputs where the first stage reads them
            xs = self._split(x)
        with tf.device(self.device_of(last)):  # the targets where the loss is
            ys = self._split(y)
            weights = self._split(sample_weight) if sample_weight is not None else [None] * m * R
            if count_fn is None:
                count_fn = lambda t: tf.cast(tf.shape(tf.nest.flatten(t)[0])[0], tf.float32)  # noqa
            batch_count = count_fn(y)
            shares = [count_fn(ys[i]) / batch_count for i in range(m * R)]
        variables = [list(stage.trainable_variables) for stage in self.stages]
        sums = [[[None] * len(v) for v in variables] for _ in range(R)]
        inputs, outputs, tapes, upstream, added_losses = {}, {}, {}, {}, []
        losses, predictions = [None] * m * R, [None] * m * R
        previous = {}  # (device, replica) -> the last action's results there
        for action in self.order:
            s, d = action.stage, self.schedule.device_of(action.stage)
            for r in range(R):
                i = r * m + action.microbatch  # the (replica, micro-batch)'s rows
                if action.kind == "forward":
                    # The receive: stage s - 1's output copied onto this device as
                    # soon as it is ready (outside the device's order, so that a
                    # transfer never waits for the compute before it).
                    with tf.device(self.grid[d][r]):
                        inputs[s, i] = _received(xs[i] if s == 0 else outputs.pop((s - 1, i)))
                elif s != last:  # the receive of the gradients of its outputs, likewise
                    with tf.device(self.grid[d][r]):
                        upstream[s, i] = [None if g is None else tf.identity(g)
                                          for g in upstream[s, i]]
                with tf.device(self.grid[d][r]), tf.control_dependencies(
                        previous.get((d, r), [])):
                    if action.kind == "forward":
                        with tf.GradientTape() as tape:
                            if s > 0:
                                tape.watch(_differentiable(inputs[s, i]))
                            out = self.stages[s](inputs[s, i], training=True)
                            added = self.stages[s].losses if added_loss_fn else []
                            added = added_loss_fn(added) * shares[i] if added else None
                            if s == last:
                                loss_i = loss_fn(ys[i], out, weights[i]) * shares[i]
                                out = (loss_i if added is None else loss_i + added, out)
                            elif added is not None:
                                added_losses.append(added)
                        tapes[s, i] = (tape, out[0] if s == last else out, added)
                        if s == last:
                            losses[i], predictions[i] = out
                            previous[d, r] = [losses[i]]
                        else:
                            outputs[s, i] = out
                            previous[d, r] = tf.nest.flatten(out)
                    else:
                        tape, target, added = tapes.pop((s, i))
                        received = _differentiable(inputs.pop((s, i))) if s > 0 else []
                        if s == last:
                            targets, output_gradients = target, None
                        else:  # the stage's float outputs and their upstream gradients
                            targets = _differentiable(target)
                            output_gradients = [
                                tf.zeros_like(t) if g is None else g
                                for t, g in zip(targets, upstream.pop((s, i)))]
                            if added is not None:  # the stage's own losses, weight 1
                                targets = [added] + targets
                                output_gradients = [tf.ones_like(added)] + output_gradients
                        grads = tape.gradient(targets, variables[s] + received,
                                              output_gradients=output_gradients)
                        if s > 0:
                            upstream[s - 1, i] = grads[len(variables[s]):]
                        total = sums[r][s]
                        for j, g in enumerate(grads[:len(variables[s])]):
                            if g is not None:
                                total[j] = g if total[j] is None else add_gradients(total[j], g)
                        previous[d, r] = [g for g in grads if g is not None] or previous.get(
                            (d, r), [])
        gradients = []
        for s in range(len(self.stages)):
            with tf.device(self.device_of(s)):  # where the stage's variables live
                gradients.append([
                    None if parts[0] is None else functools.reduce(add_gradients, parts)
                    for parts in zip(*(sums[r][s] for r in range(R)))])
        with tf.device(self.device_of(last)):
            loss = tf.add_n(losses + added_losses)
            predictions = tf.concat(predictions, axis=0)
        return loss, gradients, predictions


def add_gradients(a, b):
    """The sum of two gradients of one variable: `IndexedSlices` (an embedding
    lookup's) stay sparse when both are (their rows concatenated), otherwise dense."""
    import tensorflow as tf

    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0),
                                tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _received(structure):
    """The receive: a stage's input copied onto the device it runs on (under the
    caller's `tf.device`)."""
    import tensorflow as tf

    return tf.nest.map_structure(tf.identity, structure)


def _differentiable(structure):
    """The floating-point tensors of a nest, flattened (ids and masks of int
    type carry no gradient)."""
    import tensorflow as tf

    return [t for t in tf.nest.flatten(structure) if t.dtype.is_floating]
