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

from tfdist.pipeline.engine import PipelineExecutor
from tfdist.pipeline.schedule import SCHEDULE_NAMES, make_schedule


class Pipeline(keras.Model):
    """A stack of stages, stage k's variables on device k % p, trained by a schedule.

    Args:
        stages: Keras layers or models applied in order (p * num_chunks of them).
            They are built here, each under its device, from `input_shape`.
        devices: p TF device names, one per pipeline rank (e.g. the mesh's
            devices over TF_CONFIG workers: one process per stage). Default: the
            first p logical CPUs (or GPUs) of this process.
        schedule: `"gpipe"`, `"1f1b"` or `"interleaved_1f1b"`.
        num_microbatches: m >= 1, any number (not only multiples of p).
        num_chunks: virtual stages per device (interleaved only).
        input_shape: the shape of one input row (without the batch axis).
        input_dtype: its dtype.

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
        self.row_shape, self.row_dtype = tuple(input_shape), input_dtype
        self.executor = PipelineExecutor(self.stages, devices, plan)
        self._build_stages()

    def _build_stages(self):
        """Builds every stage on its device from one zero row, and checks where
        its variables landed."""
        import tensorflow as tf

        x = tf.zeros((1,) + self.row_shape, self.row_dtype)
        for k, stage in enumerate(self.stages):
            device = self.executor.device_of(k)
            with tf.device(device):
                x = stage(x, training=False)
            wanted = tf.DeviceSpec.from_string(device)
            for v in stage.weights:
                placed = tf.DeviceSpec.from_string(v.value.device)
                if (placed.device_type, placed.device_index, placed.task) != (
                        wanted.device_type, wanted.device_index, wanted.task):
                    raise ValueError(f"Stage {k}'s variable {v.path} was created on "
                                     f"{v.value.device}, not on its device {device}: build "
                                     f"the stage inside Pipeline, not before.")
        self.built = True

    def call(self, x, training=False):
        return self.executor.forward(x, training=training)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

        def loss_fn(y_i, y_pred_i, sample_weight_i):
            loss = self.compute_loss(x=None, y=y_i, y_pred=y_pred_i,
                                     sample_weight=sample_weight_i, training=True)
            return self.optimizer.scale_loss(loss)

        if self.losses:
            raise ValueError("Pipeline does not yet train layers that add losses "
                             f"(regularizers, add_loss): {len(self.losses)} found.")
        loss, gradients, y_pred = self.executor.loss_and_gradients(x, y, loss_fn, sample_weight)
        variables = [v for stage in self.stages for v in stage.trainable_variables]
        gradients = [g for stage_gradients in gradients for g in stage_gradients]
        self.optimizer.apply_gradients(zip(gradients, variables))
        import tensorflow as tf

        # The history's "loss": Keras's own tracker (the first of `metrics` once
        # compiled), weighted by the batch's rows as Keras's `train_step` does.
        tracker = next(m for m in self.metrics if m.name == "loss")
        tracker.update_state(loss / self.optimizer.scale_loss(tf.constant(1.0)),
                             sample_weight=tf.shape(x)[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def get_config(self):
        return dict(super().get_config(), schedule=self.schedule_name,
                    num_microbatches=self.num_microbatches, num_chunks=self.num_chunks,
                    input_shape=self.row_shape, input_dtype=self.row_dtype,
                    stages=[keras.saving.serialize_keras_object(s) for s in self.stages])

    @classmethod
    def from_config(cls, config):
        stages = [keras.saving.deserialize_keras_object(s) for s in config.pop("stages")]
        return cls(stages, **config)


def _local_devices(count: int):
    import tensorflow as tf

    found = [d.name for d in tf.config.list_logical_devices("GPU")] or [
        d.name for d in tf.config.list_logical_devices("CPU")]
    if len(found) < count:
        raise ValueError(f"The pipeline has {count} devices' stages but this process has "
                         f"{len(found)} devices ({found}); give `devices` or split the CPU "
                         f"(tfdist.devices.split_cpu).")
    return found[:count]
