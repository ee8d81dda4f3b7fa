"""Pipeline candidates of tfdist's Transformer: the stack over a stage axis.

A candidate is a `PipelinePlan` (`tfdist.pipeline.layout`): the mesh
`stage:p;data:N/p` with `layers:stage;batch:data`, a schedule (`1f1b`,
`gpipe`) and m micro-batches. What it asks of each device follows from
where `TransformerStage` puts things (tfdist/models/transformer_pipeline.py):

- stage s runs the stack's blocks `plan.layers_of(s)` (encoder blocks, then
  decoder blocks); the first stage embeds the source (and holds the learned
  position table); the stage ending the encoder holds its final norm and embeds
  the decoder's input, so the target embedding lives there unless the
  embeddings are shared (then on stage 0); the last stage holds the decoder's
  norm and projects with the tied table (a read, no copy kept);
- a stage's weights, Adam's slots and gradients live on its replica-0 device
  (`PipelineExecutor`: the other data replicas read them and send their
  gradients there); Adam's iteration and learning rate on device 0;
- activations: each forward's tensors are kept until its backward, so a
  device holds `Simulation.peak_stashed` micro-batches of its stage's
  activations (1F1B: min(p - s, m); GPipe: m);
- time: every device works in (m + p - 1) slots of the slowest stage's forward
  and backward of one micro-batch (`Simulation.makespan`), so a device's
  compute is counted as that many slots of the slowest stage's FLOPs; between
  stages each micro-batch sends the stage's output state (the states, the
  encoder memory in the decoder, the ids still needed) forward and the float
  tensors' gradients back, and a stage using a table another stage holds (the
  tied embedding on the last stage) reads it every micro-batch and sends its
  gradient once; each priced as a "send" (`Calibration`: a 2-device all_gather
  of the same bytes, where each device sends them once).
"""

import re
from typing import List, Optional, Sequence, Tuple

from tfdist.pipeline.layout import PipelinePlan
from tfdist.pipeline.schedule import simulate
from tfdist.planner.inventory import Inventory
from tfdist.planner.memory import Memory
from tfdist.planner.workload import Collective, Work, _block_flops, _transformer_activations

SCHEDULES = ("1f1b", "gpipe")


def pipeline_plans(num_layers: int, num_devices: int, global_batch: int,
                   schedules: Sequence[str] = SCHEDULES,
                   microbatches: Optional[Sequence[int]] = None) -> List[PipelinePlan]:
    """Every `stage:p;data:N/p` pipeline (p > 1 dividing the devices and the layers)
    with each schedule and m in `microbatches` (default p, 2p, 4p) whose data
    replicas' micro-batches get equal rows."""
    out = []
    for p in range(2, num_devices + 1):
        if num_devices % p or num_layers % p:
            continue
        replicas = num_devices // p
        for m in sorted(set(microbatches or (p, 2 * p, 4 * p))):
            if global_batch % (replicas * m):
                continue
            for schedule in schedules:
                out.append(PipelinePlan.from_mesh(
                    f"stage:{p};data:{replicas}", "layers:stage;batch:data", num_layers, m,
                    schedule, global_batch=global_batch))
    return out


def _holding(plan: PipelinePlan) -> dict:
    """`{stack index: virtual stage that runs it}`."""
    return {j: k for k in range(plan.num_stages * plan.num_chunks) for j in plan.layers_of(k)}


def _virtual_stage(path: str, config, holding: dict) -> int:
    """The virtual stage that holds the Transformer weight at `path`."""
    E = config.num_encoder_layers
    name = path.split("/", 1)[1] if path.startswith("transformer/") else path
    block = re.match(r"(encoder|decoder)_(\d+)/", name)
    if block:
        return holding[int(block.group(2)) + (E if block.group(1) == "decoder" else 0)]
    top = name.split("/")[0]
    if top in ("source_embedding", "positions"):
        return 0
    if top == "target_embedding":
        return 0 if config.share_embeddings else holding[E - 1]
    if top == "encoder_norm":
        return holding[E - 1]
    if top == "decoder_norm":
        return max(holding.values())
    raise ValueError(f"tfdist.planner: no pipeline stage known for weight {path!r}.")


def stage_state_bytes(inventory: Inventory, config,
                      plan: PipelinePlan) -> List[Tuple[int, int, int]]:
    """`(weights, optimizer, gradients)` bytes on each stage's replica-0 device, in
    stage order (the other replicas' devices hold none of them)."""
    p, holding = plan.num_stages, _holding(plan)
    out = [[0, 0, 0] for _ in range(p)]
    device = {}
    for w in inventory.weights:
        device[w.path] = _virtual_stage(w.path, config, holding) % p
        out[device[w.path]][0] += w.bytes
        if w.trainable:
            out[device[w.path]][2] += w.bytes
    for o in inventory.optimizer:  # a slot beside its weight; the counters on device 0
        out[device[o.weight] if o.weight else 0][1] += o.bytes
    return [tuple(x) for x in out]


def _state_after(config, stage_blocks: range, rows: float, length: int) -> Tuple[int, int]:
    """(float bytes, int bytes) of the state a stage ending at `stage_blocks` sends on."""
    E = config.num_encoder_layers
    last = stage_blocks[-1]
    tokens = rows * length
    if last < E - 1:  # inside the encoder: its states, the source and target ids
        return int(tokens * config.d_model * 4), int(2 * tokens * 4)
    return int(2 * tokens * config.d_model * 4), int(tokens * 4)  # states, memory; source ids


def pipeline_memory_and_work(config, plan: PipelinePlan, batch: int, length: int,
                             inventory: Inventory) -> Tuple[Memory, Work]:
    """The heaviest device's `Memory` and the step's `Work` per device (see the
    module docstring) for `plan` over a global `batch` of `length`-token rows."""
    if plan.num_chunks != 1:
        raise ValueError("tfdist.planner: interleaved pipelines are not planned yet.")
    p, m, replicas = plan.num_stages, plan.num_microbatches, plan.num_replicas
    rows = batch / replicas / m  # rows of one micro-batch on one device
    t = rows * length
    if config.moe_experts and t % config.moe_group_size:
        raise ValueError(f"a micro-batch of {rows:g} rows x {length} tokens routes {t:g} "
                         f"tokens, which moe_group_size={config.moe_group_size} does not "
                         f"divide (the MoE would refuse it).")
    E = config.num_encoder_layers
    simulation = simulate(plan.schedule())
    slots = simulation.makespan / 3.0  # in units of one forward (1) + backward (2)
    state = stage_state_bytes(inventory, config, plan)
    stage_flops, memories = [], []
    for s in range(p):
        blocks = plan.layers_of(s)
        projects = s == p - 1
        lookups = (s == 0) + (E - 1 in blocks)
        flops = sum(_block_flops(config, j, t, rows, length) for j in blocks)
        flops += 2 * t * config.d_model * config.vocab_size if projects else 0
        stage_flops.append(3 * flops)
        acts = _transformer_activations(config, t, rows, length, 1, 1, 1, 1, blocks=blocks,
                                        lookups=lookups, projects=projects)
        weights, optimizer, gradients = state[s]
        memories.append(Memory(weights, optimizer, gradients,
                                int(simulation.peak_stashed[s] * acts)))
    colls = []
    sends = [_state_after(config, plan.layers_of(s), rows, length) for s in range(p - 1)]
    worst = max(f + i for f, i in sends)
    floats = max(f for f, _ in sends)
    colls += [Collective("send", 2, worst, m), Collective("send", 2, floats, m)]
    # A table used on stages other than its own (the tied target embedding: by the
    # stage embedding the decoder's input and by the projecting last stage; learned
    # positions) is read there every micro-batch and gets their gradient once per step.
    holding = _holding(plan)
    table = config.vocab_size * config.d_model * 4
    owner = 0 if config.share_embeddings else holding[E - 1]
    users = {p - 1, holding[E - 1]} | ({0} if config.share_embeddings else set())
    shared = [(table, users - {owner})]
    if config.positions == "learned":
        shared.append((config.max_length * config.d_model * 4, {holding[E - 1]} - {0}))
    for nbytes, readers in shared:
        for _ in readers:
            colls += [Collective("send", 2, nbytes, m), Collective("send", 2, nbytes, 1)]
    if replicas > 1:  # the stage's weights read by the other replicas, their gradients back
        heaviest_stage = max(range(p), key=lambda s: state[s][0])
        colls += [Collective("send", 2, state[heaviest_stage][0], m * (replicas - 1)),
                  Collective("send", 2, state[heaviest_stage][2], replicas - 1)]
    work = Work(flops=slots * max(stage_flops), collectives=tuple(colls),
                activations=max(mem.activations for mem in memories))
    heaviest = max(memories, key=lambda mem: mem.total)
    return heaviest, work


__all__ = ["SCHEDULES", "pipeline_memory_and_work",
           "pipeline_plans", "stage_state_bytes"]
