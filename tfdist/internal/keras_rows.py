"""Keras's losses and compiled metrics over the real rows of every replica.

Private Keras API used:
- `keras.src.losses.loss.reduce_values(values, sample_weight, reduction)`,
  which every `keras.losses.Loss` calls (through `reduce_weighted_values`) to
  reduce its weighted per-sample values: it divides by the local element count
  and then by the replica count (`scale_loss_for_distribution`);
- `keras.src.trainers.compile_utils.CompileMetrics.update_state` and its
  `build`, `built`, `_flatten_y`, `_flat_metrics`, `_flat_weighted_metrics`
  (the `metrics=` and `weighted_metrics=` of `compile`);
- the model's `_loss_tracker` (the "loss" of the history), which
  `train_step`/`test_step` update with the replica's loss weighted by its rows
  (`tf.shape(x)[0]`).

Why: in an evened-out tfdist step (`tfdist.batch_rows`) replicas hold padded
rows, and the real rows are uneven, so "mean over my rows, divided by the
replicas" is not one device's mean, and padded rows must not count. Inside such
a step:

- a mean loss (`sum_over_batch_size`, `mean`) returns `sum(values * mask) /
  (elements per row * real rows of all replicas)`: the replica's share of one
  device's mean (the shares add up to it; Keras's loss tracker, which weights
  the replicas by their equal padded rows, reports it too).
  `mean_with_sample_weight` divides by the weights of all replicas' real rows.
  `sum` multiplies by the mask only; `none` is unchanged. A loss that reduced
  itself to a scalar cannot be corrected: the step fails unless its replicas
  were even.
- every compiled metric is updated with the row mask as (a factor of) its
  sample weight: the unweighted `metrics=` too, which Keras updates without
  weights;
- the loss tracker weights each replica's loss by the step's real rows over
  the replica count (not the padded rows), so an epoch's loss weights a
  partial batch by its real rows, as one device does (`track_real_rows`).

Everywhere else Keras's own functions run. Checked by `tests/internal/test_keras_rows.py`.
"""

import tensorflow as tf
from keras.src.losses import loss as loss_module
from keras.src.trainers import compile_utils

from tfdist import batch_rows

_MEANS = ("sum_over_batch_size", "mean")
_originals = {}


def _row_mask_like(mask, x):
    """`mask` `[n]` reshaped to broadcast over `x`'s dimension 0."""
    return tf.reshape(tf.cast(mask, x.dtype), [-1] + [1] * (x.shape.rank - 1))


def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
    original = _originals["reduce_values"]
    rows = batch_rows.current()
    if rows is None or reduction not in _MEANS + ("mean_with_sample_weight", "sum"):
        return original(values, sample_weight, reduction)
    values = tf.convert_to_tensor(values)
    if values.shape.rank == 0:
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        even = tf.debugging.assert_equal(
            rows.total, tf.cast(rows.padded * replicas, rows.total.dtype), message=(
                "tfdist: a loss returned a scalar (it reduced itself over the batch), "
                "so it cannot be averaged over the real rows of a batch whose rows the "
                "replicas hold unevenly (a partial batch); return one loss per sample "
                "and let Keras reduce it, or use batches the replica count divides."))
        with tf.control_dependencies([even]):
            return original(tf.identity(values), sample_weight, reduction)
    values = values * _row_mask_like(rows.mask, values)
    total = tf.reduce_sum(values)
    if reduction == "sum":
        return total
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        from tfdist import collectives

        weights = tf.cast(sample_weight, total.dtype)
        weights = tf.broadcast_to(weights, tf.shape(values)) * _row_mask_like(rows.mask, values)
        divisor = collectives.sum_over_replicas(tf.reduce_sum(weights))
    else:
        elements = tf.cast(tf.size(values), total.dtype)
        per_row = elements / tf.maximum(tf.cast(rows.padded, total.dtype), 1.0)
        divisor = per_row * tf.cast(rows.total, total.dtype)
    return tf.math.divide_no_nan(total, divisor)


def update_metrics(self, y_true, y_pred, sample_weight=None):
    rows = batch_rows.current()
    if rows is None:
        return _originals["update_metrics"](self, y_true, y_pred, sample_weight)
    if not self.built:
        self.build(y_true, y_pred)
    y_true = self._flatten_y(y_true)
    y_pred = self._flatten_y(y_pred)
    mask = rows.mask
    for m, y_t, y_p in zip(self._flat_metrics, y_true, y_pred):
        if m:
            m.update_state(y_t, y_p, sample_weight=mask)
    if sample_weight is not None:
        sample_weight = self._flatten_y(sample_weight)
        if len(sample_weight) < len(y_true):
            sample_weight = [sample_weight[0] for _ in range(len(y_true))]
    else:
        sample_weight = [None for _ in range(len(y_true))]
    for m, y_t, y_p, s_w in zip(self._flat_weighted_metrics, y_true, y_pred, sample_weight):
        if m:
            if s_w is None:
                s_w = mask
            else:
                s_w = tf.convert_to_tensor(s_w)
                s_w = s_w * _row_mask_like(mask, s_w) if s_w.shape.rank else s_w * mask
            m.update_state(y_t, y_p, s_w)


def track_real_rows(model) -> None:
    """Makes `model`'s loss tracker weight an evened-out step by its real rows (idempotent)."""
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is None or getattr(tracker, "_tfdist_real_rows", False):
        return
    update = tracker.update_state

    def update_state(values, sample_weight=None):
        rows = batch_rows.current()
        if rows is not None:
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            sample_weight = rows.total / replicas
        return update(values, sample_weight=sample_weight)

    tracker.update_state = update_state
    tracker._tfdist_real_rows = True


def install() -> None:
    """Replaces Keras's `reduce_values` and `CompileMetrics.update_state` (idempotent)."""
    if _originals:
        return
    if not hasattr(loss_module, "reduce_values") or not hasattr(compile_utils, "CompileMetrics"):
        raise ImportError("tfdist: keras.src.losses.loss.reduce_values or "
                          "keras.src.trainers.compile_utils.CompileMetrics has moved; "
                          "tfdist.internal.keras_rows needs updating for this Keras.")
    _originals["reduce_values"] = loss_module.reduce_values
    _originals["update_metrics"] = compile_utils.CompileMetrics.update_state
    loss_module.reduce_values = reduce_values
    compile_utils.CompileMetrics.update_state = update_metrics
