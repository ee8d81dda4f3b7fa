"""ShardedDense: Megatron's column- and row-parallel dense layers.

Which form a layer takes is decided by the layout rules alone: the kernel
`[d_in, d_out]` declares logical axes `kernel_axes = (in_axis, out_axis)`.

- `out_axis` split over mesh axis A (size M): **column-parallel**. Each device
  holds `kernel[:, d_out/M]`. The replica's batch is gathered over A, the
  layer computes its output columns, and either returns them sharded
  (`output_sharded=True`, `[batch * M, ..., d_out / M]`, for a row-parallel
  layer next) or exchanges them back to `[batch, ..., d_out]` (all-to-all).
- `in_axis` split over A: **row-parallel**. Each device holds
  `kernel[d_in/M, :]`. It multiplies its input columns (already sharded when
  `input_sharded=True`, else gathered and sliced) and reduce-scatters the
  partial sums back to `[batch, ..., d_out]`.
- Neither split: an ordinary dense layer.

Shapes (b = per-replica batch, M = size of the mesh axis):

    column, output_sharded:  [b, ..., d_in] -> [b*M, ..., d_out/M]
    column, gathered:        [b, ..., d_in] -> [b, ..., d_out]
    row, input_sharded:      [b*M, ..., d_in/M] -> [b, ..., d_out]
    row:                     [b, ..., d_in] -> [b, ..., d_out]
"""

import keras
import tensorflow as tf

from tfdist import tensor_parallel
from tfdist.layers.weights import (
    add_sharded_weight,
    check_mesh,
    check_axes,
    check_positive_int,
    disable_jit_on_multi_device_mesh,
    sharded_mesh_axis,
)


def _contract(x, kernel):
    """`x [..., d_in]` times `kernel [d_in, d_out]`."""
    if x.shape.rank == 2:
        return tf.matmul(x, kernel)
    return tf.tensordot(x, kernel, axes=1)


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedDense(keras.layers.Layer):
    """A dense layer whose kernel is split by the layout rules (Megatron forms).

    Args:
        units: output features `d_out`.
        kernel_axes: logical axes `(in_axis, out_axis)` of the kernel, e.g.
            `("d_model", "d_ff")` for an FFN's first layer and
            `("d_ff", "d_model")` for its second.
        activation: Keras activation applied to the output.
        use_bias: whether to add a bias (logical axis `out_axis`).
        input_sharded: the input comes from a column-parallel layer with
            `output_sharded=True` (its features split like `in_axis`).
        output_sharded: for a column-parallel layer, return the output columns
            still split (batch gathered) for a following row-parallel layer.
        kernel_initializer: Keras initializer for the global kernel.
        bias_initializer: Keras initializer for the global bias.
        kernel_regularizer, bias_regularizer: Keras regularizers (on a split
            weight: `L1`, `L2`, `L1L2`, exact over the mesh).
        kernel_constraint, bias_constraint: Keras constraints (on a split
            weight: those exact on a shard, see `add_sharded_weight`).

    Input shape: `[batch, ..., d_in]` (or `[batch * M, ..., d_in / M]` when
    `input_sharded` and `in_axis` is split).
    Output shape: `[batch, ..., units]` (or `[batch * M, ..., units / M]` when
    `output_sharded` and `out_axis` is split).

    Example:

    ```python
    ffn_in = ShardedDense(2048, kernel_axes=("d_model", "d_ff"),
                          activation="relu", output_sharded=True)
    ffn_out = ShardedDense(512, kernel_axes=("d_ff", "d_model"),
                           input_sharded=True)
    y = ffn_out(ffn_in(x))   # with "d_ff:model": Megatron's MLP
    ```
    """

    def __init__(
        self,
        units,
        kernel_axes=("d_model", "d_ff"),
        activation=None,
        use_bias=True,
        input_sharded=False,
        output_sharded=False,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.units = check_positive_int("units", units)
        self.kernel_axes = check_axes("kernel_axes", kernel_axes, ("d_model", "d_ff"))
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.input_sharded = bool(input_sharded)
        self.output_sharded = bool(output_sharded)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.weight_layouts = {}
        disable_jit_on_multi_device_mesh(self)

    def build(self, input_shape):
        d_in = int(input_shape[-1])
        self.kernel = add_sharded_weight(
            self,
            "kernel",
            (d_in, self.units),
            self.kernel_axes,
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        layout = self.weight_layouts["kernel"]
        self._in_axis = sharded_mesh_axis(layout, 0)
        self._out_axis = sharded_mesh_axis(layout, 1)
        if self._in_axis and self._out_axis:
            raise ValueError(
                f"Layer {self.name!r}: kernel {layout} is split on both "
                f"dimensions; ShardedDense splits one (column- or row-parallel)."
            )
        self.bias = None
        if self.use_bias:
            self.bias = add_sharded_weight(
                self,
                "bias",
                (self.units,),
                (self.kernel_axes[1],),
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
            )

    def call(self, inputs):
        check_mesh(self)
        x = tf.convert_to_tensor(inputs)
        if self._out_axis is not None:
            return self._column(x)
        if self._in_axis is not None:
            return self._row(x)
        return self._finish(self._matmul(x))

    def _matmul(self, x):
        return _contract(x, self.kernel)

    def _finish(self, y):
        if self.bias is not None:
            y = y + self.bias
        return self.activation(y)

    def _column(self, x):
        return tensor_parallel.column(x, self._out_axis, lambda rows: self._finish(self._matmul(rows)),
                                      output_sharded=self.output_sharded)

    def _row(self, x):
        y = tensor_parallel.row(x, self._in_axis, _contract, input_sharded=self.input_sharded,
                                operands=[tf.convert_to_tensor(self.kernel)])
        return self._finish(y)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self):
        config = super().get_config()
        config.update(
            units=self.units,
            kernel_axes=list(self.kernel_axes),
            activation=keras.activations.serialize(self.activation),
            use_bias=self.use_bias,
            input_sharded=self.input_sharded,
            output_sharded=self.output_sharded,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
            kernel_regularizer=keras.regularizers.serialize(self.kernel_regularizer),
            bias_regularizer=keras.regularizers.serialize(self.bias_regularizer),
            kernel_constraint=keras.constraints.serialize(self.kernel_constraint),
            bias_constraint=keras.constraints.serialize(self.bias_constraint),
        )
        return config
