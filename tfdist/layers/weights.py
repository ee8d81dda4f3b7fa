"""Weights that declare logical axes; the layout rules decide their sharding."""

from typing import Optional, Sequence

import keras
import tensorflow as tf
from absl import logging

from tfdist import collectives, runtime
from tfdist.core.shards import LAYOUT_KWARG
from tfdist.mesh import TensorLayout


def add_sharded_weight(
    layer,
    name: str,
    shape: Sequence[int],
    axes: Sequence[Optional[str]],
    pad: bool = False,
    regularizer=None,
    constraint=None,
    **kwargs,
):
    """`layer.add_weight` for a weight with logical `axes`.

    Under a `MeshStrategy` whose rules split one of `axes`, the weight is
    created as one shard per device; elsewhere it is an ordinary weight. The
    weight always has its global `shape` in Keras (saving, `get_weights`).

    Args:
        layer: the Keras layer that owns the weight.
        name: weight name.
        shape: global shape.
        axes: one logical axis name (or None) per dimension.
        pad: let split dimensions that do not divide by their mesh axis be
            padded (per `TensorLayout.padded_shape`); the layer masks padding.
        regularizer: a Keras regularizer. On a sharded weight only sums over
            elements (`L1`, `L2`, `L1L2`) are exact, scaled so that the
            shards' penalties add up to the whole weight's (`ShardPenalty`).
        constraint: a Keras constraint. On a sharded weight tfdist applies it
            to each shard after every update (`tfdist.internal.gradient_seam`):
            only constraints exact on a shard are taken (`NonNeg`, and `MaxNorm`,
            `MinMaxNorm`, `UnitNorm` whose norm axes are not split).
        **kwargs: passed to `layer.add_weight` (initializer, dtype, ...).

    Returns:
        The Keras variable. Its `TensorLayout` is in `layer.weight_layouts[name]`.

    Raises:
        ValueError: a dimension does not divide by its mesh axis, or two
            dimensions map to one mesh axis; the message names the layer and
            the weight.
    """
    mesh = collectives.current_mesh()
    layout = mesh.tensor_layout(
        axes, shape, what=f"Layer {layer.name!r} weight {name!r}", pad=pad
    )
    layer._tfdist_built_mesh = mesh  # checked by `check_mesh` on every call
    if not hasattr(layer, "weight_layouts"):
        layer.weight_layouts = {}
    layer.weight_layouts[name] = layout
    if not layout.is_sharded:
        return layer.add_weight(name=name, shape=tuple(shape), regularizer=regularizer,
                                constraint=constraint, **kwargs)
    what = f"Layer {layer.name!r} weight {name!r} ({layout})"
    if regularizer is not None:
        regularizer = ShardPenalty(regularizer, layout, what)
    constraint = _shard_constraint(constraint, layout, what)

    def creator(next_creator, **creator_kwargs):
        creator_kwargs[LAYOUT_KWARG] = layout
        return next_creator(**creator_kwargs)

    with tf.variable_creator_scope(creator):
        variable = layer.add_weight(name=name, shape=tuple(shape), regularizer=regularizer,
                                    **kwargs)
    # Kept from Keras, whose `optimizer.apply` assigns `constraint(variable)`
    # with the global shape; tfdist's optimizer hook applies it per shard.
    variable._tfdist_constraint = constraint
    return variable


_SEPARABLE = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)


class ShardPenalty(keras.regularizers.Regularizer):
    """A sum-over-elements penalty on a sharded weight, exact over the mesh.

    In a replica the weight reads as its shard. Keras adds each replica's
    penalty to its loss and divides the loss by the replica count R; the S
    distinct shards are each held by R / S replicas, so the penalty of a shard
    times S sums, over all replicas, to the penalty of the whole weight, and so
    do its gradients. Read globally (outside a replica) it is the penalty itself.
    """

    def __init__(self, regularizer, layout: TensorLayout, what: str = "a sharded weight"):
        regularizer = keras.regularizers.get(regularizer)
        if type(regularizer) not in _SEPARABLE:
            raise ValueError(
                f"{what}: regularizer {regularizer!r} is not supported on a sharded weight; "
                f"a penalty on shards is exact only when it sums over elements "
                f"(keras.regularizers.L1, L2, L1L2). Use one of those, or a layout that "
                f"does not split this weight.")
        self.regularizer = regularizer
        self.layout = layout
        self.shards = len(layout.shard_owner_groups())

    def __call__(self, x):
        penalty = self.regularizer(x)
        ctx = tf.distribute.get_replica_context()
        mesh_runtime = runtime.current_runtime()
        if mesh_runtime is None or ctx is None or ctx.strategy is not mesh_runtime:
            return penalty  # a global read
        return penalty * self.shards

    def get_config(self):
        return keras.regularizers.serialize(self.regularizer)


def _shard_constraint(constraint, layout: TensorLayout, what: str):
    """`constraint`, if applying it to each shard of `layout` is exact; else raises."""
    if constraint is None:
        return None
    constraint = keras.constraints.get(constraint)
    if type(constraint) is keras.constraints.NonNeg:
        return constraint
    if type(constraint) in (keras.constraints.MaxNorm, keras.constraints.MinMaxNorm,
                            keras.constraints.UnitNorm):
        rank = len(layout.shape)
        axes = constraint.axis if isinstance(constraint.axis, (list, tuple)) else [constraint.axis]
        split = [a % rank for a in axes if sharded_mesh_axis(layout, a % rank)]
        if not split:
            return constraint
        reason = f"its norms run over dimension {split[0]}, which is split"
    else:
        reason = "tfdist applies constraints shard by shard and cannot tell whether it is exact"
    raise ValueError(
        f"{what}: constraint {constraint!r} is not supported on a sharded weight: {reason}. "
        f"Exact on shards: NonNeg, and MaxNorm/MinMaxNorm/UnitNorm over dimensions the "
        f"layout does not split.")


def check_mesh(layer) -> None:
    """Raises if `layer` runs in a replica of a mesh other than the one it was built for.

    A tfdist layer lays its weights out for the mesh in scope when it is built.
    Called in a replica of a tfdist strategy with another mesh (typically: built
    outside `strategy.scope()`, so its weights are whole, then run by that
    strategy) it would compute on unsharded weights while its collectives talk
    over the new mesh. Calls outside any replica (Keras's symbolic build,
    `Transformer.translate`, a model used without a strategy) read global
    weights and compute the single-device result, so they pass.
    """
    built = getattr(layer, "_tfdist_built_mesh", None)
    if built is None or tf.distribute.in_cross_replica_context():
        return
    mesh_runtime = runtime.current_runtime()
    if mesh_runtime is None or mesh_runtime.mesh == built:
        return
    raise ValueError(
        f"Layer {layer.name!r} was built for mesh {built} but is called in a replica of "
        f"{mesh_runtime!r} (mesh {mesh_runtime.mesh}). Build the model inside that "
        f"strategy's scope (`with strategy.scope(): model = ...`), or load its weights into "
        f"a model built there.")


def sharded_mesh_axis(layout: TensorLayout, dim: int) -> Optional[str]:
    """The mesh axis (of size > 1) dimension `dim` of `layout` is split over."""
    axis = layout.mesh_axes[dim]
    return axis if axis in layout.sharded_mesh_axes else None


def disable_jit_on_multi_device_mesh(layer) -> None:
    """Marks `layer` as not XLA-compilable when it runs on a multi-device mesh.

    Keras compiles the whole `strategy.run` step when `jit_compile=True`; XLA
    cannot compile a step that spans devices and has no collectives on CPU,
    so under a multi-device `MeshStrategy` Keras then proceeds with
    `jit_compile=False` instead of failing.
    """
    mesh = collectives.current_mesh()
    if mesh.size > 1:
        layer.supports_jit = False
        logging.log_first_n(
            logging.INFO,
            "tfdist: a %d-device mesh step cannot be XLA-compiled as a whole "
            "(XLA has no cross-device collectives on CPU); jit_compile=True "
            "falls back to jit_compile=False.",
            1,
            mesh.size,
        )


def check_positive_int(arg: str, value) -> int:
    """Returns `value` if it is a positive int, else raises naming `arg`."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"Received an invalid value for `{arg}`, expected a positive "
            f"integer. Received: {arg}={value!r}"
        )
    return value


def check_axes(arg: str, axes, example: Sequence[str]) -> tuple:
    """Returns the logical axes of a 2-D weight as a tuple, else raises naming `arg`."""
    axes = tuple(axes)
    if len(axes) != 2:
        raise ValueError(
            f"`{arg}` names the logical axes of the 2-D weight, e.g. "
            f"{tuple(example)}. Received: {arg}={axes!r}"
        )
    return axes
