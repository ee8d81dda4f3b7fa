"""tfdist picks the layout: enumerate, predict memory and step time, rank.

    inventory.py  what a model stores (weights, optimizer variables, logical axes)
    memory.py     bytes per device under a layout (exact for weights and optimizer)
    workload.py   a step's FLOPs, collectives and activations per device
    probe.py      the machine's matmul rate and collective alpha / beta, cached
    search.py     the candidate meshes and rules, the cost model, the ranking

Example:

    plan = tfdist.plan(TransformerConfig(vocab_size=8000, d_model=512, ...),
                       devices=4, memory_per_device=2 << 30, global_batch=64, length=128)
    print(plan.table())
    strategy = MeshStrategy(plan.best.mesh)
"""

from typing import Optional, Sequence, Union

from tfdist.mesh import Mesh

from tfdist.planner.inventory import Entry, Inventory
from tfdist.planner.memory import Memory, state_bytes
from tfdist.planner.probe import Calibration
from tfdist.planner.search import Candidate, NoLayoutFits, Plan, meshes, rank
from tfdist.planner.workload import Collective, Work, transformer_work


def transformer_inventory(config, mesh, optimizer="adam") -> Inventory:
    """The `Inventory` of a `tfdist.models.Transformer` with `config` and its
    `optimizer` (a name: a fresh one is made) as the model lays them out on `mesh`.

    The model is built in a Keras `StatelessScope` (no weight is allocated)
    with `mesh` as the ambient mesh (`runtime.weights_on`): layers whose
    weights depend on the mesh (an MoE's hidden axis when experts and `d_ff`
    share a mesh axis) declare what they would on it.
    """
    import keras

    from tfdist.models import Transformer
    from tfdist.runtime import weights_on

    with weights_on(mesh), keras.StatelessScope():
        model = Transformer(config, name="transformer")
        model.build()
    return Inventory.of(model, optimizer)  # the optimizer's stand-ins are real variables


def plan(model_config, devices: Union[int, Sequence[str]], global_batch: int, length: int,
         memory_per_device: Optional[int] = None, optimizer="adam",
         calibration: Optional[Calibration] = None, bucket_bytes: int = 25 << 20) -> Plan:
    """Ranks the layouts of a tfdist `Transformer` over `devices` by predicted step time.

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

    Returns:
        A `Plan`: `plan.best.mesh` is the fastest layout that fits;
        `plan.table()` prints them all.

    Raises:
        NoLayoutFits: nothing fits `memory_per_device` (the message names the
            least memory per device that would), or no layout is valid.
        ValueError: a bad argument.
    """
    num = devices if isinstance(devices, int) else len(devices)
    for name, value in (("devices", num), ("global_batch", global_batch), ("length", length)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer; received {name}={value!r}.")
    if global_batch % num:
        raise ValueError(f"global_batch={global_batch} does not divide over {num} devices "
                         f"(tfdist splits the rows over every device); use a multiple of {num}.")
    calibration = calibration or Calibration.measure([num])
    splittable = transformer_inventory(model_config, Mesh.single_device(), None).logical_axes
    return rank(meshes(splittable, num),
                lambda mesh: transformer_inventory(model_config, mesh, optimizer),
                lambda mesh, inventory: transformer_work(model_config, mesh, global_batch,
                                                         length, inventory, bucket_bytes),
                calibration, memory_per_device)


__all__ = ["Calibration", "Candidate", "Collective", "Entry", "Inventory", "Memory",
           "NoLayoutFits", "Plan", "Work", "meshes", "plan", "rank", "state_bytes",
           "transformer_inventory", "transformer_work"]
