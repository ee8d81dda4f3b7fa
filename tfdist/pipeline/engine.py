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

from typing import Callable, List, Sequence, Tuple

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
            variables on its device. One per virtual stage (p * v of them, virtual
            stage k on device k % p, as in `Schedule`).
        devices: one TF device name per pipeline rank (p of them).
        schedule: the `Schedule` (checked here).
    """

    def __init__(self, stages: Sequence, devices: Sequence[str], schedule: Schedule):
        check(schedule)
        if len(devices) != schedule.num_stages:
            raise ValueError(f"The schedule {schedule.name!r} has {schedule.num_stages} "
                             f"devices but {len(devices)} were given: {list(devices)}.")
        if len(stages) != schedule.num_virtual_stages:
            raise ValueError(f"The schedule {schedule.name!r} runs "
                             f"{schedule.num_virtual_stages} stages ({schedule.num_stages} "
                             f"devices x {schedule.num_chunks} chunks) but {len(stages)} "
                             f"stages were given.")
        self.stages = list(stages)
        self.devices = list(devices)
        self.schedule = schedule
        self.order = compute_order(schedule)

    def device_of(self, stage: int) -> str:
        return self.devices[self.schedule.device_of(stage)]

    def forward(self, x, training: bool = False):
        """The stages applied to `x`, micro-batch by micro-batch, concatenated.

        Only forwards: stage s of micro-batch i waits for stage s of micro-batch
        i - 1 on its device, so the devices work on successive micro-batches at once.
        """
        import tensorflow as tf

        m = self.schedule.num_microbatches
        outputs = split_rows(x, m)
        for s, stage in enumerate(self.stages):
            previous = []
            with tf.device(self.device_of(s)):
                for i in range(m):
                    with tf.control_dependencies(previous):
                        outputs[i] = stage(tf.identity(outputs[i]), training=training)
                    previous = [outputs[i]]
        with tf.device(self.device_of(len(self.stages) - 1)):
            return tf.concat(outputs, axis=0)

    def loss_and_gradients(self, x, y, loss_fn: Callable, sample_weight=None
                           ) -> Tuple[object, List, object]:
        """One step's loss, gradients and outputs, run in the schedule's order.

        Args:
            x: the global batch's inputs (first axis: rows).
            y: its targets, split like `x`.
            loss_fn: `loss_fn(y_i, y_pred_i, sample_weight_i)` -> the mean loss of
                micro-batch i (a scalar); it is weighted by the micro-batch's share
                of the rows.
            sample_weight: optional, split like `x`.

        Returns:
            `(loss, gradients, outputs)`: the batch's loss (sum of the micro-batch
            shares), per stage the list of gradients of its `trainable_variables`
            (summed over micro-batches; `None` where a variable gets none), and the
            last stage's outputs for the whole batch (for metrics).
        """
        import tensorflow as tf

        m = self.schedule.num_microbatches
        last = len(self.stages) - 1
        xs, ys = split_rows(x, m), split_rows(y, m)
        weights = split_rows(sample_weight, m) if sample_weight is not None else [None] * m
        rows = tf.cast(tf.shape(x)[0], tf.float32)
        variables = [list(stage.trainable_variables) for stage in self.stages]
        sums = [[None] * len(v) for v in variables]
        inputs, outputs, tapes, upstream = {}, {}, {}, {}
        losses, predictions = [None] * m, [None] * m
        previous = [[] for _ in self.devices]  # the last action's results, per device
        for action in self.order:
            s, i = action.stage, action.microbatch
            d = self.schedule.device_of(s)
            with tf.device(self.devices[d]), tf.control_dependencies(previous[d]):
                if action.kind == "forward":
                    # The receive: stage s - 1's output copied onto this device.
                    inputs[s, i] = tf.identity(xs[i] if s == 0 else outputs.pop((s - 1, i)))
                    with tf.GradientTape() as tape:
                        if s > 0:
                            tape.watch(inputs[s, i])
                        out = self.stages[s](inputs[s, i], training=True)
                        if s == last:
                            share = tf.cast(tf.shape(out)[0], tf.float32) / rows
                            out = (loss_fn(ys[i], out, weights[i]) * share, out)
                    tapes[s, i] = (tape, out[0] if s == last else out)
                    if s == last:
                        losses[i], predictions[i] = out
                        previous[d] = [losses[i]]
                    else:
                        outputs[s, i] = out
                        previous[d] = [out]
                else:
                    tape, target = tapes.pop((s, i))
                    sources = variables[s] + ([inputs[s, i]] if s > 0 else [])
                    grads = tape.gradient(target, sources,
                                          output_gradients=upstream.pop((s, i), None))
                    inputs.pop((s, i))
                    if s > 0:
                        upstream[s - 1, i] = grads[-1]
                    for j, g in enumerate(grads[:len(variables[s])]):
                        if g is not None:
                            sums[s][j] = g if sums[s][j] is None else sums[s][j] + g
                    previous[d] = [g for g in grads if g is not None] or previous[d]
        with tf.device(self.device_of(last)):
            loss = tf.add_n(losses)
            predictions = tf.concat(predictions, axis=0)
        return loss, sums, predictions
