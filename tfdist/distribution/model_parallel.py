"""keras.distribution's `ModelParallel` and `DataParallel`, as tfdist strategies on TF."""

from typing import Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tfdist.keras_layouts import KerasLayouts
from tfdist.internal import install_layout_map_hooks, keras_distribution
from tfdist.mesh import LayoutRules, Mesh
from tfdist.strategies.mesh_strategy import MeshStrategy


def _tf_devices(device_mesh) -> Optional[list]:
    """The TF device names of a Keras `DeviceMesh`'s devices (row-major), or None.

    Keras names devices `"cpu:0"`, `"gpu:1"` (or backend device objects); each
    must be one of this process's logical devices.
    """
    names = [str(getattr(d, "name", d)) for d in np.asarray(device_mesh.devices).flatten()]
    found = {}
    for kind in ("CPU", "GPU"):
        for i, device in enumerate(tf.config.list_logical_devices(kind)):
            found[f"{kind.lower()}:{i}"] = device.name
            found[device.name.lower()] = device.name
    out = []
    for name in names:
        key = name.lower()
        key = key.split("device:")[-1] if "device:" in key and key not in found else key
        if key not in found:
            raise ValueError(
                f"DeviceMesh device {name!r} is not a device of this process; its devices "
                f"are {sorted(k for k in found if ':' in k and '/' not in k)}.")
        out.append(found[key])
    return out


class ModelParallel(MeshStrategy):
    """Keras's `ModelParallel` on TensorFlow: any Keras model, weights split by a `LayoutMap`.

    A `tf.distribute` strategy (a tfdist `MeshStrategy`) over the devices of the
    `LayoutMap`'s `DeviceMesh`, one replica per device. Every variable whose
    `path` a `LayoutMap` key matches is *stored* as one shard per device (its
    optimizer slots too), for every Keras layer:

    - Layers whose computation tfdist runs on shards (`Dense`, `EinsumDense`,
      `Embedding`, `ReversibleEmbedding`; `MultiHeadAttention` and keras-hub
      attention through their `EinsumDense` projections) compute with the
      weight's shard and exchange activations (tensor parallelism): the weight
      is never gathered over that mesh axis.
    - tfdist's own layers, given a tfdist model's layout map
      (`Transformer.get_layout_map`, a `RulesLayoutMap`), run their own
      tensor-parallel computation with the layouts the map names.
    - Every other layer reads the whole weight, all-gathered from its shards,
      and its gradient is reduce-scattered to them (FSDP); so is any dimension
      laid out on the batch axis. A weight read inside a loop (the cell of an
      `LSTM`, `GRU`, `SimpleRNN` or `RNN`, a `keras.ops.while_loop`) is
      gathered once, before the loop.

    Results are those of one device. The global batch is split over every
    replica (so replicas along the model axes hold different rows, and no
    computation is repeated); losses that sum or average over examples are
    exact. Checkpoints hold global tensors and load onto any mesh or into a
    plain Keras model.

    Split weights are made shard by shard, each on its device: optimizer slots,
    constant initializers, and Keras's random ones (`RandomNormal`,
    `RandomUniform`, `TruncatedNormal`, Glorot, He, LeCun) whose shards are
    drawn alone yet are exactly one device's values for the same seed. Only an
    initializer that needs the whole value (`Orthogonal`, a custom one) draws
    it whole, on the first device, before it is split.

    Args:
        device_mesh: a `keras.distribution.DeviceMesh` (default: the layout
            map's).
        layout_map: a `keras.distribution.LayoutMap` (regex keys matching
            the whole `variable.path`; a path matching two keys is an error; no match
            means replicated), e.g. a keras-hub backbone's `get_layout_map(mesh)`.
        batch_dim_name: the mesh axis named after the batch (default: the
            mesh's first axis). Weights split over it are FSDP.
        devices: TF device names overriding the `DeviceMesh`'s.
        reshard_after_forward: FSDP's memory/time trade (PyTorch FSDP's name).
            True (default): a gathered weight of `Dense`, `EinsumDense`,
            `Embedding` and `ReversibleEmbedding` lives only for its forward
            contraction and is gathered again for the backward pass, so the
            peak holds the shards plus about one layer's whole weights; it
            costs a second all-gather per weight and step. False: the gathered
            weight is kept from the forward to the backward pass (one gather).
            Other layers always keep it.
        prefetch: with `reshard_after_forward`, gather one layer ahead
            (PyTorch FSDP's `forward_prefetch` and `BACKWARD_PRE`): a layer's
            weight is gathered once the *previous* FSDP contraction's input is
            ready (in the backward pass, its output gradient), so the gather
            overlaps that layer's compute. The peak then holds about two
            layers' whole weights instead of one. Default False.
        zero_stage: ZeRO (Rajbhandari et al.) for the trainable weights the
            layout map leaves whole over the batch axis (all of them without a
            map), on a batch axis of N > 1 devices:

            - 0 (default): they are replicated, as in plain data parallelism.
            - 1: each is *stored* split over the batch axis on its first
              dimension that divides by N, so its optimizer slots (and
              gradient accumulators, EMA averages) are 1/N per device.
              Replicas read a kept whole copy, refreshed after each optimizer
              step by one all-gather of every weight's new shard (a flat
              buffer). Gradients are all-reduced whole, fused with the
              replicated weights' as in data parallelism, and each device
              keeps its slice.
            - 2: as 1, but each gradient is reduce-scattered to the shards in
              the backward pass (gradients 1/N too; one collective per weight).
            - 3: stored split and gathered when read, as a `LayoutMap` entry on
              the batch axis would (FSDP / ZeRO-3): weights 1/N too, a gather
              per read.

            Results are exactly those of data parallelism. Weights with no
            dimension divisible by N (a scalar, an odd-sized bias) and
            non-trainable variables stay replicated. Checkpoints hold global
            tensors, as always.
        sequence_axis: a mesh axis (not the batch axis) to split every sequence
            over (the logical axis `length`, `tfdist.sequence`): its devices hold
            the same rows and different tokens (zig-zag). Feed batches through
            `tfdist.sequence.split_sequences(dataset, strategy.mesh)`. keras-hub's
            `LlamaAttention`, `CachedGemmaAttention` and `QwenAttention` attend
            over the whole sequence (ring or Ulysses, rotary positions global); other attention
            layers are refused; every other layer works token by token.
            Generation (a cache) is refused.
        sequence_method: `"ring"` or `"ulysses"` attention over `sequence_axis`.
        **options: `MeshStrategy` options (`collective_timeout`, `bucket_bytes`,
            `max_shapes`).

    Example:

    ```python
    devices = [f"cpu:{i}" for i in range(4)]
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices)
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    strategy = tfdist.distribution.ModelParallel(layout_map=layout_map,
                                                 batch_dim_name="batch")
    with strategy.scope():
        model = keras_hub.models.GemmaBackbone(...)
        model.compile(...)
    model.fit(...)
    ```
    """

    def __init__(
        self,
        device_mesh=None,
        layout_map=None,
        batch_dim_name: Optional[str] = None,
        devices: Union[None, str, Sequence[str]] = None,
        reshard_after_forward: bool = True,
        zero_stage: int = 0,
        prefetch: bool = False,
        sequence_axis: Optional[str] = None,
        sequence_method: str = "ring",
        **options,
    ):
        if device_mesh is None and layout_map is None:
            raise ValueError("ModelParallel needs a layout_map (or a device_mesh); received "
                             "neither.")
        if device_mesh is None:
            device_mesh = layout_map.device_mesh
        layouts = KerasLayouts.for_mesh(device_mesh, layout_map, batch_dim_name,  # checked first
                                        reshard_after_forward=reshard_after_forward,
                                        zero_stage=zero_stage, prefetch=prefetch)
        if devices is None:
            devices = _tf_devices(device_mesh)
        # A tfdist model's layout map (`RulesLayoutMap`) carries its layout rules:
        # tfdist's layers then compute on their shards with the same layouts.
        rules = getattr(layout_map, "layout_rules", LayoutRules(()))
        if sequence_axis is not None:
            rules = _with_sequence_axis(rules, sequence_axis, sequence_method, layouts)
        rules.check_mesh(layouts.mesh_shape)
        install_layout_map_hooks()
        super().__init__(Mesh(layouts.mesh_shape, rules), devices=devices,
                         keras_layouts=layouts, **options)
        self.device_mesh = device_mesh
        self.layout_map = layout_map
        self.batch_dim_name = layouts.batch_axis
        self.sequence_axis, self.sequence_method = sequence_axis, sequence_method

    def __repr__(self):
        return f"ModelParallel(mesh {self.mesh.shape}, batch_dim_name={self.batch_dim_name!r})"


def _with_sequence_axis(rules: LayoutRules, axis: str, method: str, layouts) -> LayoutRules:
    """`rules` with `length:axis`, checked: a mesh axis other than the batch's, a known method."""
    from tfdist import sequence

    names = list(layouts.mesh_shape.names)
    if axis not in names or axis == layouts.batch_axis:
        raise ValueError(f"sequence_axis={axis!r} must be an axis of the DeviceMesh other than "
                         f"the batch axis {layouts.batch_axis!r}; the mesh's axes are {names}.")
    if method not in sequence.METHODS:
        raise ValueError(f"sequence_method={method!r} is not one of {sorted(sequence.METHODS)}.")
    if rules.mesh_axis("length") not in (None, axis):
        raise ValueError(f"The layout map puts `length` on {rules.mesh_axis('length')!r}, not "
                         f"sequence_axis={axis!r}.")
    return LayoutRules(tuple(r for r in rules.rules if r[0] != "length") + (("length", axis),))


class DataParallel(ModelParallel):
    """Keras's `DataParallel` on TensorFlow: every weight replicated, the batch split.

    Args:
        device_mesh: a one-axis `keras.distribution.DeviceMesh` (default: a
            mesh `batch` over `devices`, or over every device of one kind).
        devices: TF device names, "cpu"/"gpu", or None (GPUs if any).
        **options: `ModelParallel`'s `zero_stage` (ZeRO optimizer-state
            sharding) and `MeshStrategy` options.
    """

    def __init__(self, device_mesh=None, devices=None, **options):
        if device_mesh is None:
            import keras

            if devices is None or isinstance(devices, str):
                kind = (devices or ("GPU" if tf.config.list_logical_devices("GPU") else
                                    "CPU")).upper()
                devices = [d.name for d in tf.config.list_logical_devices(kind)]
            device_mesh = keras.distribution.DeviceMesh((len(devices),), ("batch",), devices)
        if len(device_mesh.shape) != 1:
            raise ValueError(f"DataParallel takes a one-axis DeviceMesh; received shape "
                             f"{tuple(device_mesh.shape)} with axes {device_mesh.axis_names}.")
        super().__init__(device_mesh=device_mesh, layout_map=None, devices=devices, **options)

    def __repr__(self):
        return f"DataParallel(mesh {self.mesh.shape})"


def from_keras(distribution, **options) -> ModelParallel:
    """The tfdist strategy for a `keras.distribution.ModelParallel` or `DataParallel`.

    Args:
        distribution: the Keras distribution object.
        **options: `MeshStrategy` options.
    """
    import keras

    if isinstance(distribution, keras.distribution.ModelParallel):
        return ModelParallel(layout_map=keras_distribution.layout_map_of(distribution),
                             batch_dim_name=distribution.batch_dim_name, **options)
    if isinstance(distribution, keras.distribution.DataParallel):
        return DataParallel(device_mesh=distribution.device_mesh, **options)
    raise TypeError(f"from_keras takes a keras.distribution.ModelParallel or DataParallel; "
                    f"received {distribution!r}.")
