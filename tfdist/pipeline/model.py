"""`Pipeline`: a Keras model whose stages run on their own devices, trained by a schedule.

    stages = [keras.Sequential([keras.layers.Dense(1024, "relu")] * 8) for _ in range(2)]
    model = Pipeline(stages, devices=["/cpu:0", "/cpu:1"], schedule="1f1b",
                     num_microbatches=8)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    model.fit(x, y, batch_size=64)

`compile`, `fit`, `evaluate`, `predict` and `save_weights` are Keras's own. A
training step splits the batch into `num_microbatches` parts and runs the
schedule's actions (`tfdist.pipeline.engine`): the gradients are the sums of
the micro-batches' gradients of their share of the loss, i.e. the one-device
gradient of the whole batch, and the optimizer applies them once per step
(each update on its variable's device). Inference runs the micro-batches
through the stages, forwards only.
"""

from typing import Optional, Sequence

import keras

from tfdist.pipeline.engine import PipelineExecutor, add_gradients
from tfdist.pipeline.schedule import SCHEDULE_NAMES, make_schedule


class Pipeline(keras.Model):
    """A stack of stages, stage k's variables on device k % p, trained by a schedule.

    Args:
        stages: Keras layers or models applied in order (p * num_chunks of them).
            They are built here, each under its device, from `input_shape`.
        devices: one entry per pipeline rank (p of them): a TF device name
            (e.g. the mesh's devices over TF_CONFIG workers: one process per
            stage), or a tuple of R device names for R data replicas of the
            pipeline (`PipelineExecutor`). Default: the first p logical CPUs
            (or GPUs) of this process. `from_plan` takes them from a mesh.
        schedule: `"gpipe"`, `"1f1b"` or `"interleaved_1f1b"`.
        num_microbatches: m >= 1, any number (not only multiples of p).
        num_chunks: virtual stages per device (interleaved only).
        input_shape: the shape of one input row (without the batch axis), or
            a tuple / dict of them for several inputs (e.g. `((Ls,), (Lt,))`).
        input_dtype: its dtype (or a tuple / dict of them).

    Example:

    >>> model = Pipeline([keras.layers.Dense(4), keras.layers.Dense(1)],
    ...                  num_microbatches=3, input_shape=(8,))   # doctest: +SKIP
    """

    def __init__(self, stages: Sequence, devices: Optional[Sequence[str]] = None,
                 schedule: str = "1f1b", num_microbatches: int = 1, num_chunks: int = 1,
                 input_shape: Sequence[int] = (), input_dtype: str = "float32", **kwargs):
        super().__init__(**kwargs)
        if schedule not in SCHEDULE_NAMES:
            raise ValueError(f"schedule={schedule!r}: valid schedules are {list(SCHEDULE_NAMES)}.")
        if len(stages) % num_chunks:
            raise ValueError(f"{len(stages)} stages do not divide into num_chunks={num_chunks} "
                             f"chunks per device; give a multiple of {num_chunks} stages.")
        p = len(stages) // num_chunks
        plan = make_schedule(schedule, p, num_microbatches, num_chunks)
        devices = list(devices) if devices is not None else _local_devices(p)
        self.stages = list(stages)
        self.schedule_name, self.num_microbatches, self.num_chunks = (
            schedule, num_microbatches, num_chunks)
        self.row_shape, self.row_dtype = _as_tuples(input_shape), input_dtype
        self.executor = PipelineExecutor(self.stages, devices, plan)
        self._build_stages()

    @classmethod
    def from_plan(cls, plan, blocks: Sequence, devices: Sequence[str], input_shape,
                  first: Sequence = (), last: Sequence = (), input_dtype="float32", **kwargs):
        """A pipeline laid out by a `PipelinePlan` (the `layers:stage` layout).

        Args:
            plan: the checked `tfdist.pipeline.layout.PipelinePlan`.
            blocks: the stack of `plan.num_layers` unbuilt Keras layers that the
                `layers` axis splits (e.g. identical Transformer blocks).
            devices: the mesh's devices, device i of the mesh at index i (e.g.
                `ClusterConfig.start()`'s list, or this process's CPUs).
            first, last: layers run before the stack on the first stage (an
                embedding) and after it on the last (a head).
        """
        if len(blocks) != plan.num_layers:
            raise ValueError(f"The plan splits {plan.num_layers} layers but {len(blocks)} "
                             f"blocks were given.")
        if len(devices) != plan.mesh.size:
            raise ValueError(f"Mesh {plan.mesh.shape} has {plan.mesh.size} devices but "
                             f"{len(devices)} were given: {list(devices)}.")
        count = plan.num_stages * plan.num_chunks
        stages = []
        for k in range(count):
            layers = [blocks[j] for j in plan.layers_of(k)]
            layers = (list(first) if k == 0 else []) + layers + (
                list(last) if k == count - 1 else [])
            stages.append(keras.Sequential(layers, name=f"stage_{k}"))
        grid = [tuple(devices[i] for i in plan.stage_devices(s)) for s in range(plan.num_stages)]
        return cls(stages, devices=grid, schedule=plan.schedule_name,
                   num_microbatches=plan.num_microbatches, num_chunks=plan.num_chunks,
                   input_shape=input_shape, input_dtype=input_dtype, **kwargs)

    @classmethod
    def from_model(cls, model, split_at: Sequence[str], devices: Optional[Sequence] = None,
                   **kwargs):
        """A functional (or Sequential) Keras model cut after the layers named
        in `split_at`: len(split_at) + 1 stages, each a copy of the model's
        layers between two cuts built on its device, with the model's weights.

        Nested functional models are inlined first, so a keras-hub `CausalLM`
        is cut between its backbone's decoder blocks
        (`split_at=["transformer_layer_3"]`). Whatever a later stage reads from
        before a cut crosses it with the cut layer's output (a padding mask every
        block reads travels along; integer tensors get no gradient). A layer used
        on both sides of a cut (the token embedding a CausalLM's head reuses)
        stays on the first stage that uses it and gets the sum of the stages'
        gradients. The model may have several inputs (a dict: `fit` takes the
        same `x`) and must have one output.
        """
        import tensorflow as tf

        from tfdist.internal.keras_graph import crossings, inline
        from tfdist.internal.keras_hub_configs import layer_config

        if len(model.outputs) != 1:
            raise ValueError(f"Model {model.name!r} has {len(model.outputs)} outputs: "
                             f"Pipeline.from_model cuts models with one output.")
        flat = inline(model)
        names = [layer.name for layer in flat.layers]
        unknown = [n for n in split_at if n not in names]
        if unknown:
            raise ValueError(f"split_at names {unknown}, not layers of {model.name!r}: "
                             f"its layers are {names}.")
        order = sorted(split_at, key=names.index)
        if list(split_at) != order or len(set(order)) != len(order):
            raise ValueError(f"split_at={list(split_at)}: give distinct layers in the "
                             f"model's order, e.g. {order}.")
        cuts = []
        for n in order:
            try:
                cuts.append(flat.get_layer(n).output)
            except (AttributeError, ValueError) as error:
                raise ValueError(f"split_at names {n!r}, a layer called more than once in "
                                 f"{model.name!r}; cut after a layer called once.") from error
        inputs = keras.tree.flatten(flat.input)
        boundaries = crossings(inputs, cuts, flat.outputs)
        p = len(boundaries) - 1
        devices = list(devices) if devices is not None else _local_devices(p)
        kwargs.setdefault("input_shape", keras.tree.map_structure(
            lambda t: tuple(t.shape[1:]), flat.input))
        kwargs.setdefault("input_dtype", keras.tree.map_structure(lambda t: t.dtype, flat.input))
        stages, clones = [], {}

        def clone_once(layer):  # a layer used by several stages is cloned once
            if id(layer) not in clones:
                clones[id(layer)] = layer.__class__.from_config(layer_config(layer))
            return clones[id(layer)]

        for k in range(p):
            # What a stage passes on untouched goes through an Identity layer: a
            # Keras model cannot return its own input.
            given = {id(t) for t in boundaries[k]}
            passed = [keras.layers.Identity(name=f"{model.name}_stage_{k}_pass_{j}")(t)
                      if id(t) in given else t for j, t in enumerate(boundaries[k + 1])]
            part = keras.Model(flat.input if k == 0 else boundaries[k],
                               flat.output if k == p - 1 else passed,
                               name=f"{model.name}_stage_{k}")
            device = devices[k] if isinstance(devices[k], str) else devices[k][0]
            with tf.device(device):
                copy = keras.models.clone_model(part, clone_function=clone_once)
            copy.set_weights(part.get_weights())
            stages.append(copy)
        return cls(stages, devices=devices, **kwargs)

    def _build_stages(self):
        """Builds every stage on its device from one zero row, and checks where
        its variables landed."""
        import tensorflow as tf

        x = _zero_row(self.row_shape, self.row_dtype)
        earlier = set()  # weights of earlier stages (tied: they stay where they are)
        for k, stage in enumerate(self.stages):
            device = self.executor.device_of(k)
            with tf.device(device):
                x = stage(x, training=False)
            wanted = tf.DeviceSpec.from_string(device)
            for v in stage.weights:
                if id(v) in earlier:
                    continue
                placed = tf.DeviceSpec.from_string(v.value.device)
                fields = ("job", "replica", "task", "device_type", "device_index")
                if any(getattr(wanted, f) is not None and getattr(wanted, f) != getattr(placed, f)
                       for f in fields):
                    raise ValueError(f"Stage {k}'s variable {v.path} was created on "
                                     f"{v.value.device}, not on its device {device}: build "
                                     f"the stage inside Pipeline, not before.")
            earlier |= {id(v) for v in stage.weights}
        self.built = True

    @property
    def losses(self):
        """None of the model's own: the losses the stages add (`add_loss`, an
        MoE's load-balancing loss, regularizers) are counted per micro-batch by
        the executor, each on its stage's device, weighted like the micro-batch's
        loss, so Keras's `compute_loss` must not add them again."""
        return []

    def call(self, x, training=False):
        return self.executor.forward(x, training=training)

    def test_step(self, data):
        """Keras's `test_step`, with the losses the stages add (weighted by their
        micro-batch's rows) in the loss, as a one-device model's loss has them."""
        import tensorflow as tf

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, added = self.executor.forward(x, training=False, added_loss_fn=_sum_of_losses)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                 training=False)
        if added is not None:
            loss = loss + added
        tracker = next(m for m in self.metrics if m.name == "loss")
        tracker.update_state(loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

        def loss_fn(y_i, y_pred_i, sample_weight_i):
            loss = self.compute_loss(x=None, y=y_i, y_pred=y_pred_i,
                                     sample_weight=sample_weight_i, training=True)
            return self.optimizer.scale_loss(loss)

        def added_loss_fn(losses):  # what a stage's call adds, as Keras adds it
            return self.optimizer.scale_loss(_sum_of_losses(losses))

        import tensorflow as tf

        # A loss that averages over something else than rows (tokens) says so.
        count_fn = getattr(self.loss, "normalizer", None)
        loss, gradients, y_pred = self.executor.loss_and_gradients(
            x, y, loss_fn, sample_weight, count_fn, added_loss_fn)
        # A weight several stages use (tied embeddings) gets the sum of their
        # gradients, added on its own device, and is updated once.
        summed = {}
        for stage, stage_gradients in zip(self.stages, gradients):
            for v, g in zip(stage.trainable_variables, stage_gradients):
                if id(v) in summed and g is not None and summed[id(v)][0] is not None:
                    with tf.device(v.value.device):
                        g = add_gradients(summed[id(v)][0], g)
                summed[id(v)] = (g if g is not None else summed.get(id(v), (None,))[0], v)
        # The loss unscaled by the scale it was scaled with (a mixed-precision
        # step that overflows changes the scale in `apply_gradients`).
        loss = loss / self.optimizer.scale_loss(tf.constant(1.0))
        with tf.control_dependencies([loss]):
            self.optimizer.apply_gradients(summed.values())

        # The history's "loss": Keras's own tracker (the first of `metrics` once
        # compiled), weighted by the batch's rows as Keras's `train_step` does.
        tracker = next(m for m in self.metrics if m.name == "loss")
        tracker.update_state(loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def weights_by_path(self):
        """`{path: variable}` of the stages' weights, each once (a tied weight
        under its first stage), by the paths the unpipelined model gives them
        (a stage's own name, when it leads a path, left out)."""
        found = {}
        for stage in self.stages:
            for v in stage.weights:
                parts = v.path.split("/")
                path = "/".join(parts[1:]) if parts[0] == stage.name and len(parts) > 1 \
                    else v.path
                found.setdefault(path, v)
        return found

    def assign_weights_to(self, model):
        """Copies the pipeline's weights into the unpipelined `model` (the one
        `from_model` cut, or any model with the same weight paths), e.g. to save
        one checkpoint of global tensors that any mesh, pipelined or not, loads."""
        ours, theirs = self.weights_by_path(), _by_path(model)
        _check_same_paths(ours, theirs, model)
        for path, v in theirs.items():
            v.assign(ours[path])

    def assign_weights_from(self, model):
        """Copies `model`'s weights (same paths) into the pipeline's stages."""
        ours, theirs = self.weights_by_path(), _by_path(model)
        _check_same_paths(ours, theirs, model)
        for path, v in ours.items():
            v.assign(theirs[path])

    def get_config(self):
        return dict(super().get_config(), schedule=self.schedule_name,
                    num_microbatches=self.num_microbatches, num_chunks=self.num_chunks,
                    input_shape=self.row_shape, input_dtype=self.row_dtype,
                    stages=[keras.saving.serialize_keras_object(s) for s in self.stages])

    @classmethod
    def from_config(cls, config):
        stages = [keras.saving.deserialize_keras_object(s) for s in config.pop("stages")]
        return cls(stages, **config)


def _by_path(model):
    found = {}
    for v in model.weights:
        found.setdefault(v.path, v)
    return found


def _check_same_paths(ours, theirs, model):
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or extra:
        raise ValueError(f"Model {model.name!r} does not hold the pipeline's weights: "
                         f"the pipeline's {missing[:5]} are not in it and its {extra[:5]} "
                         f"are not in the pipeline (weights are matched by path).")


def _sum_of_losses(losses):
    """Keras's sum of a layer's added losses (each summed to a scalar)."""
    import tensorflow as tf

    return tf.add_n([tf.cast(tf.reduce_sum(t), tf.float32) for t in losses])


def _local_devices(count: int):
    import tensorflow as tf

    found = [d.name for d in tf.config.list_logical_devices("GPU")] or [
        d.name for d in tf.config.list_logical_devices("CPU")]
    if len(found) < count:
        raise ValueError(f"The pipeline has {count} devices' stages but this process has "
                         f"{len(found)} devices ({found}); give `devices` or split the CPU "
                         f"(tfdist.devices.split_cpu).")
    return found[:count]


def _as_tuples(shape):
    """Lists (from a config) back to tuples: a shape, or a tuple / dict of shapes."""
    if isinstance(shape, dict):
        return {k: _as_tuples(v) for k, v in shape.items()}
    return tuple(_as_tuples(d) if isinstance(d, (list, tuple, dict)) else d for d in shape)


def _zero_row(shape, dtype):
    """One row of zeros of each input (the stages are built from it)."""
    import tensorflow as tf

    if isinstance(shape, dict):
        return {k: _zero_row(v, dtype[k] if isinstance(dtype, dict) else dtype)
                for k, v in shape.items()}
    if shape and not isinstance(shape[0], (int, type(None))):
        return tuple(_zero_row(s, dtype[i] if isinstance(dtype, (list, tuple)) else dtype)
                     for i, s in enumerate(shape))
    return tf.zeros((1,) + tuple(1 if d is None else d for d in shape), dtype)
