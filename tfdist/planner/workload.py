"""What one training step of a model asks of each device under a layout.

Dimension cheat-sheet:

    N  devices          B  global batch (rows)      L  length
    b  rows per device = B / N (tfdist splits the batch over every device;
       devices along a model axis hold different rows, see tensor_parallel.py)
    t  tokens per device = b * L
    d  d_model   F  d_ff   H  heads   K  d_kv   V  vocab   E  experts
    A  size of the mesh axis a block's rule splits it over (1: not split)

Compute is the same on every layout (a split block computes on the A-fold
gathered rows with 1/A of the weight), so layouts differ in what they send:

    attention with heads on A, FFN with d_ff on A (Megatron column then row):
        forward  all_gather  x [b, L, d] -> [b*A, L, d];  reduce_scatter of
                 the partial sums [b*A, L, d] -> [b, L, d]
        backward the transposes: reduce_scatter, all_gather (same bytes)
        (attention also gathers its key padding mask [b, L], and a decoder's
        cross-attention the encoder's output: an all_gather forward, a
        reduce_scatter backward)
    embedding with vocab on A: all_gather of the ids, reduce_scatter of the
        looked-up rows (backward: an all_gather)
    tied softmax with vocab on A: all_gather of the states and the labels
        (backward: reduce_scatter of the states'), all-reduces of [b*A, L]:
        max, sum, target logit forward, the placed gradient backward (and
        [b*A, L, 2] logit sums with label smoothing)
    MoE with experts on A: two all_to_all of the [E, G, C, d] buffers
        forward, two backward
    gradients: every trainable weight's local gradient summed over the devices
        holding the same shard, fused into buckets of `bucket_bytes`.
    length on P (`length:seq`, tfdist.sequence; rows per device b = B P / N,
        tokens t = B L / N as before), per attention, n = t H K floats of keys
        (as many of values), the validity t floats where keys are masked:
        ring: P - 1 pair swaps of keys, values, validity forward, as many
            backward and P - 1 swaps of their gradients (two-device "send"s; an
            odd P shifts by all_to_alls of P parts, all zeros but one);
        Ulysses: all_to_all of q, k, v and the output forward (t H K floats
            each), the same four backward, the validity all_gathered.
        No [b, H, L, L] scores are kept (the blockwise kernel keeps the output's
        log-sum-exp, H per token), and causal blocks above the diagonal are
        skipped: a decoder's self-attention computes (2P + 1) / 4P of the scores.

Activations are estimated from the tensors each block keeps for its backward
pass (float32): see `_transformer_activations`.
"""

import dataclasses
import math
from typing import Dict, Optional, Tuple

from tfdist.mesh import Mesh
from tfdist.planner.inventory import Inventory

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


@dataclasses.dataclass(frozen=True)
class Collective:
    """`count` collectives of one `kind` over groups of `group` devices, each
    taking `bytes` bytes per device as input."""

    kind: str
    group: int
    bytes: int
    count: int = 1


@dataclasses.dataclass(frozen=True)
class Work:
    """One step's work per device: `flops`, `collectives`, `activations` bytes."""

    flops: float
    collectives: Tuple[Collective, ...]
    activations: int

    @property
    def bytes_sent(self) -> int:
        """Bytes each device sends per step (ring / pairwise algorithms)."""
        total = 0
        for c in self.collectives:
            share = (c.group - 1) / c.group
            per = {"all_reduce": 2 * share * c.bytes, "all_gather": (c.group - 1) * c.bytes,
                   "reduce_scatter": share * c.bytes, "all_to_all": share * c.bytes,
                   "send": c.bytes}[c.kind]
            total += c.count * per
        return int(total)


def gradient_collectives(inventory: Inventory, mesh: Mesh,
                         bucket_bytes: int = 25 << 20) -> Tuple[Collective, ...]:
    """The gradient all-reduces of `inventory`'s trainable weights on `mesh`.

    A weight's gradient is summed over the devices holding its shard
    (`TensorLayout.shard_owner_groups`); tfdist fuses those of one group size
    into buckets of at most `bucket_bytes`.
    """
    by_group: Dict[int, int] = {}
    data_axis = mesh.mesh_axis("batch")
    for entry in inventory.weights:
        if not entry.trainable:
            continue
        layout = mesh.tensor_layout(entry.axes, entry.shape, pad=entry.may_pad)
        if data_axis is not None and data_axis in layout.sharded_mesh_axes:
            continue  # split over the batch axis (FSDP): reduce-scattered where it is read
        group = mesh.size // layout.num_shards
        if group > 1:
            by_group[group] = by_group.get(group, 0) + \
                math.prod(layout.local_shape) * entry.itemsize
    out = []
    for group, total in sorted(by_group.items()):
        buckets = max(1, math.ceil(total / bucket_bytes))
        out.append(Collective("all_reduce", group, total // buckets, buckets))
    return tuple(out)


def transformer_work(config, mesh: Mesh, batch: int, length: int,
                     inventory: Optional[Inventory] = None,
                     bucket_bytes: int = 25 << 20, label_smoothing: float = 0.0,
                     sequence_method: Optional[str] = None) -> Work:
    """A `tfdist.models.Transformer` training step of `batch` rows of `length`
    source and target tokens on `mesh` (see the module docstring).

    Args:
        config: the model's `TransformerConfig`.
        mesh: the candidate `Mesh` (shape and rules).
        batch: global rows per step.
        length: tokens per row (source and target).
        inventory: the model's `Inventory` (its gradients); None: no gradient
            collectives counted.
        bucket_bytes: the strategy's gradient bucket size.
        label_smoothing: the loss's (one more all-reduce when split).
        sequence_method: "ring" or "ulysses" where `mesh` splits `length`
            (default: the config's).

    Raises:
        ValueError: the layout cannot run the model (the reason named).
    """
    c = config
    n = mesh.size
    t = batch * length / n
    b = batch / n
    d, v = c.d_model, c.vocab_size
    word = 4

    def split(logical):
        return mesh.axis_size(mesh.mesh_axis(logical))

    a_heads, a_ff, a_vocab, a_exp = split("heads"), split("d_ff"), split("vocab"), split("experts")
    parts = split("length")
    # Megatron sequence parallelism: `length` on the heads' axis. The attention gathers
    # the tokens over it as it gathers rows (the Megatron exchanges below) and attends
    # densely; no ring or Ulysses exchange.
    megatron_sp = parts > 1 and mesh.mesh_axis("length") == mesh.mesh_axis("heads")
    method = "ring" if megatron_sp else sequence_method or c.sequence_method
    if parts > 1:
        _check_sequence_split(c, mesh, batch, length, parts, method, a_heads)
    elif batch % n:
        raise ValueError(f"global_batch={batch} does not divide over the {n} devices (tfdist "
                         f"splits the rows over every device); use a multiple of {n}.")
    colls = []

    def megatron(a, rows_bytes, times=1):
        # forward all_gather + reduce_scatter, backward the same two again
        if a > 1:
            colls.append(Collective("all_gather", a, int(rows_bytes), 2 * times))
            colls.append(Collective("reduce_scatter", a, int(a * rows_bytes), 2 * times))

    x_bytes = t * d * word
    moe_tokens = _moe_slots(c)
    routed = t * (a_ff if a_ff > 1 and a_exp == 1 else 1)  # an MoE gathers over d_ff's axis
    if c.moe_experts and routed % c.moe_group_size:
        raise ValueError(f"each device routes {routed:g} tokens through the MoE, which "
                         f"moe_group_size={c.moe_group_size} does not divide (the MoE would "
                         f"refuse it).")
    layers = [("encoder", i) for i in range(c.num_encoder_layers)] + \
             [("decoder", i) for i in range(c.num_decoder_layers)]
    flops = 0.0
    for j, (side, i) in enumerate(layers):
        attentions = 1 if side == "encoder" else 2
        flops += _block_flops(c, j, t, b, length, 1 if megatron_sp else parts)
        if parts > 1 and not megatron_sp:
            # encoder self and cross-attention mask their keys; a decoder's self-attention
            # is causal, unmasked
            colls.extend(_sequence_collectives(method, parts, t * c.num_heads * c.d_kv * word,
                                               t * a_heads * word, masked=1,
                                               unmasked=attentions - 1))
        megatron(a_heads, x_bytes, attentions)
        if a_heads > 1:  # the key padding masks (encoder self, cross), forward only
            colls.append(Collective("all_gather", a_heads, int(t * word), 1))
        if side == "decoder" and a_heads > 1:  # the encoder memory, gathered for the cross keys
            colls.append(Collective("all_gather", a_heads, int(x_bytes), 1))
            colls.append(Collective("reduce_scatter", a_heads, int(a_heads * x_bytes), 1))
        if c.moe_experts and i % 2 == 1:
            buffer = int(moe_tokens * t * d * word)
            if a_exp > 1:
                colls.append(Collective("all_to_all", a_exp, buffer, 4))
            elif a_ff > 1:
                megatron(a_ff, x_bytes)
        else:
            megatron(a_ff, x_bytes)
    flops += 2 * t * d * v  # the tied softmax
    lookups = 2
    if a_vocab > 1:
        colls.append(Collective("all_gather", a_vocab, int(t * 4), lookups))  # ids
        colls.append(Collective("reduce_scatter", a_vocab, int(a_vocab * x_bytes), lookups))
        colls.append(Collective("all_gather", a_vocab, int(x_bytes), lookups))  # backward
        # the softmax: its states and labels gathered (backward: a reduce_scatter),
        # the rows' max and sum of exponentials all-reduced
        colls.append(Collective("all_gather", a_vocab, int(x_bytes), 1))
        colls.append(Collective("all_gather", a_vocab, int(t * 4), 1))
        colls.append(Collective("reduce_scatter", a_vocab, int(a_vocab * x_bytes), 1))
        colls.append(Collective("all_reduce", a_vocab, int(a_vocab * t * word), 4))
        if label_smoothing:  # the rows' logit sums too
            colls.append(Collective("all_reduce", a_vocab, int(2 * a_vocab * t * word), 1))
    flops *= 3  # forward + backward (two matmuls per forward one)
    if inventory is not None:
        colls.extend(gradient_collectives(inventory, mesh, bucket_bytes))
    activations = _transformer_activations(c, t, b, length, a_heads, a_ff, a_vocab, a_exp,
                                           blockwise=parts > 1 and not megatron_sp)
    return Work(flops, tuple(colls), int(activations))


def _check_sequence_split(c, mesh: Mesh, batch: int, length: int, parts: int, method: str,
                          a_heads: int) -> None:
    """Raises ValueError where `length` on `parts` devices cannot run the model."""
    axis = mesh.mesh_axis("length")
    rows = mesh.size // parts
    if batch % rows:
        raise ValueError(f"global_batch={batch} does not divide over the {rows} devices that "
                         f"hold different rows (length is on {axis}:{parts}).")
    if method not in c.SEQUENCE_METHODS:
        raise ValueError(f"sequence_method={method!r}; expected one of "
                         f"{list(c.SEQUENCE_METHODS)}.")
    # An MoE routes each device's own tokens (groups inside a zig-zag chunk, checked here):
    # its all-to-all is the one it sends without a split, over a device's t tokens.
    c.check_sequence_split(parts, axis, length, head_shards=a_heads, method=method)


def _sequence_collectives(method: str, parts: int, kv_bytes: float, mask_bytes: float,
                          masked: int, unmasked: int) -> Tuple[Collective, ...]:
    """What `masked` + `unmasked` attentions over a sequence split on `parts` devices
    exchange per device: `kv_bytes` are the keys' (values': as many; queries' and the
    output's under Ulysses), `mask_bytes` the keys' validity."""
    out = []
    for count, mask in ((masked, mask_bytes), (unmasked, 0)):
        if not count:
            continue
        if method == "ring" and parts % 2:  # an odd ring shifts by one: all-to-alls
            # whose parts but the receiver's are zeros (TF has no point-to-point op)
            out.append(Collective("all_to_all", parts, int(parts * (2 * kv_bytes + mask)),
                                  2 * (parts - 1) * count))
            out.append(Collective("all_to_all", parts, int(parts * 2 * kv_bytes),
                                  (parts - 1) * count))
        elif method == "ring":
            out.append(Collective("send", 2, int(2 * kv_bytes + mask), 2 * (parts - 1) * count))
            out.append(Collective("send", 2, int(2 * kv_bytes), (parts - 1) * count))
        else:
            out.append(Collective("all_to_all", parts, int(kv_bytes), 8 * count))
            if mask:
                out.append(Collective("all_gather", parts, int(mask), count))
    return tuple(out)


def _moe_slots(c) -> float:
    """Expert slots per token of an MoE block: E x its capacity per group of S tokens, over S
    (the Transformer's MoE: `min_capacity=1`; the capacity rounds up to whole tokens, which
    for small groups is far from `top_k x capacity_factor`)."""
    if not c.moe_experts:
        return 0.0
    from tfdist.layers.moe import expert_capacity

    S, E = c.moe_group_size, c.moe_experts
    if c.moe_routing == "expert_choice":
        capacity = min(S, expert_capacity(S, E, 1, c.moe_capacity_factor, 1))
    else:
        capacity = expert_capacity(S, E, c.moe_top_k, c.moe_capacity_factor, 1)
    return E * capacity / S


def _block_flops(c, j: int, t: float, b: float, length: int, parts: int = 1) -> float:
    """Forward FLOPs of block `j` of the encoder + decoder stack on t = b * length
    tokens (a device's share; every layout computes the same but for a sequence
    split over `parts` > 1, whose blockwise kernel skips causal blocks)."""
    d, f, h, k = c.d_model, c.d_ff, c.num_heads, c.d_kv
    decoder = j >= c.num_encoder_layers
    i = j - c.num_encoder_layers if decoder else j
    projections = 2 * t * d * h * k * 4
    scores = 2 * 2 * b * h * length * length * k
    ffn = 2 * 2 * t * d * f
    if c.moe_experts and i % 2 == 1:
        ffn = ffn * _moe_slots(c) + 2 * t * d * c.moe_experts
    if not decoder:
        return projections + scores + ffn
    causal = (2 * parts + 1) / (4 * parts) if parts > 1 else 1.0
    return 2 * projections + (1 + causal) * scores + ffn


def _transformer_activations(c, t, b, length, a_heads, a_ff, a_vocab, a_exp,
                             blocks=None, lookups: int = 2, projects: bool = True,
                             blockwise: bool = False) -> float:
    """Bytes one device keeps for the backward pass (float32, no remat).

    Per attention: the normalized input (d) and its A-fold gathered copy,
    q, k, v and the context (H*K each), the scores and probabilities
    [b, H, L, L] (and the dropout mask on them), the residual's dropout mask.
    Per FFN: the normalized and gathered input, the hidden units before and
    after the ReLU (F each). The softmax: the logits and their gradient (V
    each). Per token and embedding lookup: its row (d).

    `blocks` (stack indices; default all), `lookups` (embedding lookups) and
    `projects` (the softmax) select a pipeline stage's part. `blockwise` (a split
    sequence): no scores are kept, the log-sum-exp per token and head instead.
    """
    d, f, h, k, v = c.d_model, c.d_ff, c.num_heads, c.d_kv, c.vocab_size
    drop = 1 if c.dropout else 0
    per_attention = t * (2 * d + (a_heads - 1) * d + 4 * h * k + drop * d)
    per_attention += t * h if blockwise else (2 + drop) * b * h * length * length
    per_ffn = t * (2 * d + (a_ff - 1) * d + 2 * f + drop * d)
    if c.moe_experts:
        slots = min(1.0, c.moe_top_k * c.moe_capacity_factor / c.moe_experts) * c.moe_experts
        per_moe = t * (2 * d + slots * (2 * d + 2 * f) + c.moe_experts)
    else:
        per_moe = per_ffn
    floats = 0.0
    E = c.num_encoder_layers
    for j in (range(E + c.num_decoder_layers) if blocks is None else blocks):
        i = j - E if j >= E else j
        floats += per_attention * (1 if j < E else 2)
        floats += per_moe if c.moe_experts and i % 2 == 1 else per_ffn
    if projects:
        floats += t * (2 * v + (a_vocab - 1) * d)
    floats += lookups * t * d
    return floats * 4


def keras_work(inventory: Inventory, mesh: Mesh, batch: int, length: int,
               bucket_bytes: int = 25 << 20) -> Work:
    """A training step of any Keras model whose weights carry derived logical axes
    (`tfdist.planner.derive`), under `tfdist.distribution.ModelParallel`.

    Per device, with t = batch * length / N tokens and d = d_model:

    - FLOPs: 6 t x (elements of every kernel and embedding), forward and backward;
    - a layer group (the weights under one parent path: an attention, an MLP)
      whose kernels split a dimension over a model axis of size A: Megatron's
      all_gather of its input rows and reduce_scatter of its output rows
      (`t * d` floats), forward and backward;
    - an embedding table split by vocabulary: the ids gathered, the rows
      reduce-scattered (backward: an all_gather); an untied output table split
      by vocabulary: the logits all-to-all'd back to whole rows (`t * V`),
      forward and backward;
    - a weight split over the batch axis (FSDP, `d_model:data`): gathered for the
      forward and again for the backward pass (`reshard_after_forward`), its
      gradient reduce-scattered; the others' gradients all-reduced (`gradient_collectives`).
    """
    n = mesh.size
    t = batch * length / n
    word = 4
    d = next((e.shape[e.axes.index("d_model")] for e in inventory.weights
              if "d_model" in e.axes), 0)
    flops = 0.0
    colls = []
    groups = {}
    data_axis = mesh.mesh_axis("batch")
    for e in inventory.weights:
        layout = mesh.tensor_layout(e.axes, e.shape, pad=e.may_pad)
        if len(e.shape) >= 2 and "d_model" in e.axes:
            flops += 6 * t * math.prod(e.shape)
        split = {l: a for l, a in zip(e.axes, layout.mesh_axes)
                 if a is not None and a != data_axis and mesh.axis_size(a) > 1}
        if "vocab" in split:
            a = mesh.axis_size(split["vocab"])
            if e.axes[0] == "vocab":  # a lookup table
                colls += [Collective("all_gather", a, int(t * 4), 1),
                          Collective("reduce_scatter", a, int(a * t * d * word), 1),
                          Collective("all_gather", a, int(t * d * word), 1)]
            else:  # an untied output projection: logits back to whole rows
                colls.append(Collective("all_to_all", a, int(t * e.shape[1] * word), 2))
        elif split:
            parent = e.path.rsplit("/", 2)[0]
            groups.setdefault(parent, mesh.axis_size(next(iter(split.values()))))
        if data_axis is not None and data_axis in layout.mesh_axes and mesh.axis_size(data_axis) > 1:
            dsize = mesh.axis_size(data_axis)
            local = math.prod(layout.local_shape) * e.itemsize
            colls += [Collective("all_gather", dsize, local, 2),
                      Collective("reduce_scatter", dsize, local * dsize, 1)]
    for a in groups.values():
        colls += [Collective("all_gather", a, int(t * d * word), 2),
                  Collective("reduce_scatter", a, int(a * t * d * word), 2)]
    colls.extend(gradient_collectives(inventory, mesh, bucket_bytes))
    # activations: each kernel's output per token and the norms' inputs (an estimate)
    acts = sum(t * math.prod(e.shape) / max(1, e.shape[e.axes.index("d_model")]) * word
               for e in inventory.weights if "d_model" in e.axes and len(e.shape) >= 2)
    return Work(flops, tuple(colls), int(acts))


def xc_work(config, mesh: Mesh, inventory: Optional[Inventory] = None,
            bucket_bytes: int = 25 << 20, top_k: Tuple[int, ...] = (1, 5)) -> Work:
    """A training step of `scripts/train_xc.py`'s model (features -> `ShardedSoftmax`
    over C classes, its loss and top-k metrics) on `mesh`, for an `XCConfig`.

    Per device, with b = batch / N rows, d = d_model, C classes, A = the
    size of the axis `classes` is split over and r = `sample_rate` (training
    multiplies by r of each shard's classes):

    - FLOPs: the logits [b*A, d] x [d, r*C/A] and the kernel's gradient, 4 b d r C
      (the features are data: no gradient flows to them);
    - with A > 1: the features gathered over the axis (b d floats) and the
      labels (b ints); the loss's max, sum of exponentials and target logit
      all-reduced over [b*A] floats, the placed gradient once more backward (and
      [b*A, 2] logit sums with label smoothing); each top-k metric all-reduces
      [b*A] twice and gathers [b*A, k] values and ids;
    - the kernel's and bias's gradients summed over the devices holding the
      same shard (`gradient_collectives`).

    Activations: the logits, their exponentials and their gradient (b r C
    floats each) and the gathered features.
    """
    n = mesh.size
    b = config.batch_size / n
    d, c, r = config.d_model, config.num_classes, config.sample_rate
    a = mesh.axis_size(mesh.mesh_axis("classes"))
    word = 4
    colls = []
    if a > 1:
        rows = b * a
        colls += [Collective("all_gather", a, int(b * d * word), 1),
                  Collective("all_gather", a, int(b * 4), 1),
                  Collective("all_reduce", a, int(rows * word), 4)]
        if config.label_smoothing:
            colls.append(Collective("all_reduce", a, int(2 * rows * word), 1))
        for k in top_k:
            colls += [Collective("all_reduce", a, int(rows * word), 2),
                      Collective("all_gather", a, int(rows * min(k, math.ceil(c / a)) * 4), 2)]
    if inventory is not None:
        colls.extend(gradient_collectives(inventory, mesh, bucket_bytes))
    flops = 4 * b * d * r * c
    activations = (3 * b * r * c + b * a * d) * word
    return Work(flops, tuple(colls), int(activations))
