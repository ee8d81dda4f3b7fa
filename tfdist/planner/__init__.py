"""tfdist picks the layout: enumerate, predict memory and step time, rank.

    inventory.py  what a model stores (weights, optimizer variables, logical axes)
    memory.py     bytes per device under a layout (exact for weights and optimizer)
    workload.py   a step's FLOPs, collectives and activations per device
    probe.py      the machine's matmul rate and collective alpha / beta, cached
    search.py     the candidate meshes and rules, the cost model, the ranking
    derive.py     logical axes for any Keras model's weights, lowered to a LayoutMap

Example:

    plan = tfdist.plan(TransformerConfig(vocab_size=8000, d_model=512, ...),
                       devices=4, memory_per_device=2 << 30, global_batch=64, length=128)
    print(plan.table())
    strategy = MeshStrategy(plan.best.mesh)
"""

from typing import Optional, Sequence, Union

from tfdist.internal.keras_unallocated import unallocated
from tfdist.mesh import Mesh

from tfdist.planner.inventory import Entry, Inventory
from tfdist.planner.memory import Memory, state_bytes
from tfdist.planner.probe import Calibration
from tfdist.planner.search import Candidate, NoLayoutFits, Plan, meshes, rank, sequence_meshes
from tfdist.planner.workload import Collective, Work, keras_work, transformer_work, xc_work


def transformer_inventory(config, mesh, optimizer="adam") -> Inventory:
    """The `Inventory` of a `tfdist.models.Transformer` with `config` and its
    `optimizer` (a name: a fresh one is made) as the model lays them out on `mesh`.

    The model is built in `unallocated()` (no weight gets a value, now or
    later) with `mesh` as the ambient mesh (`runtime.weights_on`): layers whose
    weights depend on the mesh (an MoE's hidden axis when experts and `d_ff`
    share a mesh axis) declare what they would on it.
    """
    from tfdist.models import Transformer
    from tfdist.runtime import weights_on

    with weights_on(mesh), unallocated():
        model = Transformer(config, name="transformer")
        model.build()
    return Inventory.of(model, optimizer)  # the optimizer's stand-ins are real variables


def xc_inventory(config, mesh, optimizer="adam") -> Inventory:
    """The `Inventory` of `scripts/train_xc.py`'s model for an `XCConfig` (features ->
    `ShardedSoftmax(num_classes)`) and its `optimizer`, laid out on `mesh`, unallocated."""
    import keras

    from tfdist.layers import ShardedSoftmax
    from tfdist.runtime import weights_on

    with weights_on(mesh), unallocated():
        inputs = keras.Input((config.d_model,))
        model = keras.Model(inputs, ShardedSoftmax(config.num_classes, name="head")(inputs))
    return Inventory.of(model, optimizer)


def _check_step(devices, global_batch: int, length: int, rows_on_every_device=True) -> int:
    """The device count, once `devices`, `global_batch` and `length` are checked
    (with `rows_on_every_device`, the batch must divide over every device; else each
    candidate checks what it splits the rows over)."""
    num = devices if isinstance(devices, int) else len(devices)
    for name, value in (("devices", num), ("global_batch", global_batch), ("length", length)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer; received {name}={value!r}.")
    if rows_on_every_device and global_batch % num:
        raise ValueError(f"global_batch={global_batch} does not divide over {num} devices "
                         f"(tfdist splits the rows over every device); use a multiple of {num}.")
    return num


def plan(model_config, devices: Union[int, Sequence[str]], global_batch: int, length: int,
         memory_per_device: Optional[int] = None, optimizer="adam",
         calibration: Optional[Calibration] = None, bucket_bytes: int = 25 << 20,
         engine: str = "mesh", speeds: Optional[Sequence[float]] = None,
         pipeline: bool = True, sequence: bool = True) -> Plan:
    """Ranks the layouts of a tfdist `Transformer` over `devices` by predicted step time.

    Candidates: every `data x model` mesh with the model's splittable axes on
    `model`; (with `sequence`) each of those over N / P devices with `length` on
    a `seq` axis of the other P, ring and Ulysses attention (`sequence_meshes`;
    valid without dropout or an MoE, for a length of 2P chunks); and (with
    `pipeline`) every `stage:p;data:N/p` pipeline with the 1F1B and GPipe
    schedules and p, 2p or 4p micro-batches (`tfdist.planner.pipeline`).
    The batch must divide over the devices holding different rows (all but a
    `seq` axis's).

    Args:
        model_config: the model's `TransformerConfig`.
        devices: a device count, or the device names.
        global_batch: rows per step.
        length: tokens per row (source and target).
        memory_per_device: bytes a device may hold (None: no limit).
        optimizer: the optimizer (name or a fresh Keras optimizer).
        calibration: the machine's constants (default: `Calibration.measure`,
            cached per machine).
        bucket_bytes: the strategy's gradient bucket size.
        engine: what the devices are: "mesh" (devices of one process) or
            "processes" (one per process, pinned one per core); the calibration's.
        speeds: the devices' relative speeds, if unequal (e.g. measured with
            `tfdist.callbacks.SpeedProportionalBatches`'s probe): pure data
            parallelism can split rows by speed (`Candidate.batch_shares`),
            other layouts wait for the slowest.
        pipeline: weigh pipeline layouts too (`Candidate.pipeline`).
        sequence: weigh sequence splits too (`Candidate.sequence_method`).

    Returns:
        A `Plan`: `plan.best.mesh` is the fastest layout that fits;
        `plan.table()` prints them all.

    Raises:
        NoLayoutFits: nothing fits `memory_per_device` (the message names the
            least memory per device that would), or no layout is valid.
        ValueError: a bad argument.
    """
    num = _check_step(devices, global_batch, length, rows_on_every_device=not sequence)
    calibration = calibration or Calibration.measure([num], engine=engine)
    from tfdist.planner.pipeline import pipeline_memory_and_work, pipeline_plans

    whole = transformer_inventory(model_config, Mesh.single_device(), optimizer)
    stack = model_config.num_encoder_layers + model_config.num_decoder_layers
    pipelines = pipeline_plans(stack, num, global_batch) if pipeline else []
    candidates = meshes(whole.logical_axes, num)
    if sequence:
        candidates += sequence_meshes(whole.logical_axes, num)
    inventories = {}

    def inventory_of(mesh):  # a length split lays the weights out as the rest of the mesh
        key = (str(mesh.shape), str(mesh.rules))
        if key not in inventories:
            inventories[key] = transformer_inventory(model_config, mesh, optimizer)
        return inventories[key]

    return rank(candidates, inventory_of,
                lambda mesh, inventory, method=None: transformer_work(
                    model_config, mesh, global_batch, length, inventory, bucket_bytes,
                    sequence_method=method),
                calibration, memory_per_device, speeds, pipelines,
                lambda plan: pipeline_memory_and_work(model_config, plan, global_batch, length,
                                                      whole))


def plan_xc(config, devices: Union[int, Sequence[str]],
            memory_per_device: Optional[int] = None, optimizer="adam",
            calibration: Optional[Calibration] = None, bucket_bytes: int = 25 << 20,
            engine: str = "mesh", speeds: Optional[Sequence[float]] = None) -> Plan:
    """Ranks the layouts of `scripts/train_xc.py`'s extreme classifier (an `XCConfig`:
    classes, features, batch, sample rate) over `devices`: data parallelism, and the
    classes split over a `model` axis of every size dividing the devices.

    Args, Returns and Raises: as `plan` (the global batch is `config.batch_size`).
    """
    num = _check_step(devices, config.batch_size, 1)
    calibration = calibration or Calibration.measure([num], engine=engine)
    return rank(meshes(("classes",), num),
                lambda mesh: xc_inventory(config, mesh, optimizer),
                lambda mesh, inventory: xc_work(config, mesh, inventory, bucket_bytes),
                calibration, memory_per_device, speeds)


def plan_keras(model, devices: Union[int, Sequence[str]], global_batch: int, length: int,
               memory_per_device: Optional[int] = None, optimizer="adam",
               calibration: Optional[Calibration] = None, bucket_bytes: int = 25 << 20,
               engine: str = "mesh") -> Plan:
    """Ranks layouts of any built Keras `model` under `tfdist.distribution.ModelParallel`.

    The weights' logical axes are derived from their layers and shapes
    (`tfdist.planner.derive`): Megatron's column / row splits of `Dense` and
    `EinsumDense` kernels over `d_ff` and attention `heads`, embeddings over
    `vocab`, and FSDP (`d_model:data`). Candidates are `data x model` meshes
    with every combination of those rules; `keras_layout_map(model, candidate)`
    turns one into the `LayoutMap` to train with.

    The model need not hold its weights: one built inside `unallocated()`
    (shapes, dtypes and paths only) plans the same, for models bigger than
    the planning process may allocate.

    Args and Raises: as `plan`, for a Keras model of `length`-token rows.
    """
    from tfdist.planner.derive import logical_axes

    num = _check_step(devices, global_batch, length)
    axes = logical_axes(model)
    inventory = Inventory.of(model, optimizer, axes=axes)
    calibration = calibration or Calibration.measure([num], engine=engine)
    return rank(meshes(inventory.logical_axes, num, fsdp=True), lambda mesh: inventory,
                lambda mesh, inv: keras_work(inv, mesh, global_batch, length, bucket_bytes),
                calibration, memory_per_device)


def keras_layout_map(model, candidate: Candidate, devices=None):
    """`(DeviceMesh, LayoutMap)` of a `plan_keras` candidate: pass them to
    `tfdist.distribution.ModelParallel(layout_map=..., batch_dim_name="data")`."""
    import keras

    from tfdist.planner.derive import layout_map

    shape = candidate.mesh.shape
    devices = devices or [f"cpu:{i}" for i in range(shape.size)]
    device_mesh = keras.distribution.DeviceMesh(shape.sizes, shape.names, devices)
    return device_mesh, layout_map(model, device_mesh, candidate.mesh.rules)


__all__ = ["Calibration", "Candidate", "Collective", "Entry", "Inventory", "Memory",
           "NoLayoutFits", "Plan", "Work", "keras_layout_map", "keras_work", "meshes", "plan",
           "plan_keras", "plan_xc", "rank", "sequence_meshes", "state_bytes",
           "transformer_inventory", "transformer_work",
           "unallocated", "xc_inventory", "xc_work"]
