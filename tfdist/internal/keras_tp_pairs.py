"""Megatron pairing of known keras-hub feed-forward blocks: no exchange between gate/up and down.

Private keras-hub detail used here (and only here): the class and the
attribute names of the feed-forward layers of keras-hub decoder blocks, and
that their `call` applies only element-wise ops between the column layers
(gate and up, the hidden dimension split over a mesh axis) and the row layer
(down, that dimension contracted). `tests/internal/test_keras_tp_pairs.py`
checks each entry against the installed keras-hub.

Alone, each layer exchanges its rows (`tfdist.internal.keras_tensor_parallel`):
a column layer all-to-alls its local output columns back to whole rows, the
row layer all-to-alls them into local columns again, three `[b, ..., d_ff]`
exchanges per block and as many in the backward pass. Paired, as Megatron-LM
pairs its column- and row-parallel linears, the local columns stay local:

    x [b, ..., d_model] -> all_gather over A (once for gate and up)
        -> gate, up: [b*M, ..., d_ff/M]  (local columns, bias slice, activation)
        -> element-wise ops of the block: [b*M, ..., d_ff/M]
        -> down: contracted with the kernel's rows [d_ff/M, d_model]
        -> reduce_scatter over A -> [b, ..., d_model]

To Keras the local columns look like whole rows: they travel reshaped to the
shape a column layer returns, `[b, ..., d_ff]` (the same number of elements;
element-wise ops do not care how they are laid out), and the row layer
reshapes them back. That is only right if nothing but element-wise ops of the
paired outputs (and scalars) reaches the row layer and nothing else reads
them, so after the block has been traced its graph is checked
(`_check_region`): anything else raises, naming the op. Pairing is off
(each layer exchanges its rows, as alone) in eager execution, where no graph
can be checked, and when one of the layers is recomputed on its own
(`RematScope`), whose recomputation runs outside the block.

Attention layers pair the same way, their heads the split dimension, but the
ops between query/key/value and the output are not element-wise: there
`keras_hub_attention` computes the layer's call itself on the local heads
(a substitute), and the graph check still asserts that nothing else reads
them. An attention inside a paired block pairs on its own, then the block.
"""

import functools
import importlib
import threading
from typing import Optional

import tensorflow as tf

# Element-wise ops a block may apply between paired column outputs and the row layer.
_ELEMENTWISE = frozenset({
    "Abs", "Add", "AddV2", "Cast", "Ceil", "Cos", "Div", "DivNoNan", "Elu", "Erf", "Erfc",
    "Exp", "Expm1", "Floor", "Gelu", "Identity", "Inv", "LeakyRelu", "Log", "Log1p", "Maximum",
    "Minimum", "Mul", "MulNoNan", "Neg", "Pow", "RealDiv", "Reciprocal", "Relu", "Relu6",
    "Round", "Rsqrt", "Selu", "Sigmoid", "Sign", "Sin", "Softplus", "Softsign", "Sqrt",
    "Square", "SquaredDifference", "Sub", "Tanh",
})

# keras-hub blocks: (module, class) -> ((column attributes), row attribute).
BLOCKS = {
    ("keras_hub.src.models.gemma.gemma_decoder_block", "GemmaDecoderBlock"):
        (("gating_ffw", "gating_ffw_2"), "ffw_linear"),
    ("keras_hub.src.models.llama.llama_decoder", "LlamaTransformerDecoder"):
        (("_feedforward_gate_dense", "_feedforward_intermediate_dense"),
         "_feedforward_output_dense"),
}

_local = threading.local()  # replicas are traced in threads of their own


class Pair:
    """One traced block call's pairing: its column layers, row layer and mesh axis size."""

    def __init__(self, block, columns, row, size):
        self.block = block
        self.columns = columns
        self.row = row
        self.size = size  # devices along the mesh axis the layers split
        self.outputs = []  # the column layers' local columns, as Keras sees them
        self.row_reads = []  # the ops the row layer read them with (shape, reshape)
        self.gathered = {}  # (tensor, axis): its rows gathered over the axis

    def hand_over(self, local):
        """Local columns `[b*M, ..., d/M]` of a column layer, shaped `[b, ..., d]` for Keras."""
        out = tf.reshape(local, _moved(local, self.size))
        self.outputs.append(out)
        return out

    def take(self, x):
        """The row layer's input `[b, ..., d]` back as the local columns `[b*M, ..., d/M]`."""
        before = set(x.consumers())
        local = tf.reshape(x, _moved(x, self.size, inverse=True))
        self.row_reads.extend(op for op in x.consumers() if op not in before)
        return local


def _moved(x, size, inverse=False):
    """`x`'s shape with dimension 0 divided (times, if `inverse`) by `size`, the last times it."""
    dims = [d if d is not None else s
            for d, s in zip(x.shape.as_list(), tf.unstack(tf.shape(x), num=x.shape.rank))]
    first, last = (dims[0] * size, dims[-1] // size) if inverse else (dims[0] // size,
                                                                      dims[-1] * size)
    return [first, *dims[1:-1], last]


def column_pair(layer) -> Optional[Pair]:
    """The active pairing that takes `layer`'s local columns, or None."""
    pair = getattr(_local, "pair", None)
    return pair if pair is not None and any(c is layer for c in pair.columns) else None


def row_pair(layer) -> Optional[Pair]:
    """The active pairing whose row layer is `layer`, or None."""
    pair = getattr(_local, "pair", None)
    return pair if pair is not None and pair.row is layer else None


def gathered_once(x, axis, gather):
    """`gather()`, the rows of `x` gathered over `axis`: once per tensor within a paired block.

    Shared only within one block call, in one trace: no tape starts or stops
    between the reads there (a layer recomputed on its own turns pairing off),
    so every reader's gradient reaches `x` through the one gather.
    """
    pair = getattr(_local, "pair", None)
    if pair is None:
        return gather()
    key = (x.ref(), axis)
    if key not in pair.gathered:
        pair.gathered[key] = gather()
    return pair.gathered[key]


def _check_region(pair):
    """Raises unless only element-wise ops lead from the paired outputs to the row layer."""
    block = type(pair.block).__name__
    if not pair.row_reads:
        raise RuntimeError(
            f"tfdist: {block} {pair.block.name!r} returned without calling its row layer "
            f"{pair.row.name!r} on the local columns of {[c.name for c in pair.columns]}; "
            "the installed keras-hub no longer pairs them (tfdist.internal.keras_tp_pairs).")
    region = {t.ref() for t in pair.outputs}
    frontier, ops = list(pair.outputs), []
    while frontier:
        for op in frontier.pop().consumers():
            if op in pair.row_reads or op in ops:
                continue
            if op.type not in _ELEMENTWISE and op.type != "IdentityN":
                raise RuntimeError(
                    f"tfdist: in {block} {pair.block.name!r}, {op.type} op {op.name!r} reads "
                    f"the local columns of {[c.name for c in pair.columns]} paired with "
                    f"{pair.row.name!r}; only element-wise ops may lie between them "
                    "(tfdist.internal.keras_tp_pairs).")
            ops.append(op)
            for i, out in enumerate(op.outputs):
                # IdentityN (tf.custom_gradient's) passes input i through to output i.
                if op.type != "IdentityN" or op.inputs[i].ref() in region:
                    region.add(out.ref())
                    frontier.append(out)
    for op in ops:
        for i, t in enumerate(op.inputs):
            scalar = t.shape.is_fully_defined() and t.shape.num_elements() == 1
            if t.ref() in region or scalar or op.type == "IdentityN":
                continue
            raise RuntimeError(
                f"tfdist: in {block} {pair.block.name!r}, {op.type} op {op.name!r} combines "
                f"the local columns paired with {pair.row.name!r} with {t.name!r} of shape "
                f"{t.shape}, which is neither paired nor a scalar "
                "(tfdist.internal.keras_tp_pairs).")
    for read in pair.row_reads:
        if read.inputs[0].ref() not in region:
            raise RuntimeError(
                f"tfdist: in {block} {pair.block.name!r}, the row layer {pair.row.name!r} "
                f"read {read.inputs[0].name!r}, not the paired local columns "
                "(tfdist.internal.keras_tp_pairs).")


def _dispatcher(original, attributes, plan, substitute=None):
    """`call` pairing the layer's columns with its row layer; `substitute(layer, pair, axis,
    *args, **kwargs)`, if given, computes the layer's call on local columns itself (or
    returns NotImplemented: the original call, unpaired)."""
    columns_of, row_of, dim = attributes

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        outer = getattr(_local, "pair", None)
        if tf.executing_eagerly() or (outer is not None and outer.block is self):
            return original(self, *args, **kwargs)
        columns = [getattr(self, name, None) for name in columns_of]
        row = getattr(self, row_of, None)
        planned = plan(columns, row, dim)
        if planned is None:
            return original(self, *args, **kwargs)
        size, axis = planned
        _local.pair = pair = Pair(self, columns, row, size)
        try:  # within an outer pairing (an attention in a paired block): this one first
            out = NotImplemented
            if substitute is not None:
                out = substitute(self, pair, axis, *args, **kwargs)
            if out is NotImplemented:
                if substitute is not None:
                    _local.pair = outer  # keras-hub's own call: its layers unpaired
                out = original(self, *args, **kwargs)
        finally:
            _local.pair = outer
        if pair.outputs or pair.row_reads:
            _check_region(pair)
        return out

    call._tfdist_original = original
    return call


def block_classes():
    """{keras-hub block class: (column attributes, row attribute)} of the installed keras-hub."""
    classes = {}
    for (module, name), attributes in BLOCKS.items():
        try:
            classes[getattr(importlib.import_module(module), name)] = attributes
        except (ImportError, AttributeError):
            continue  # keras-hub absent, or without this model
    return classes


def entries(plan) -> tuple:
    """((a known block's or attention's `call`, the pairing dispatcher wrapping it), ...).

    `plan(columns, row, dim)` gives `(size, axis)`, the one mesh axis the layers
    would run column- and row-parallel over, their split dimension `dim` (from
    the end), and its size; else None (each layer runs alone).
    `keras_tensor_parallel.attach` sets the dispatcher on each such layer built
    under a `LayoutMap`; no class is patched.
    """
    from tfdist.internal import keras_hub_attention

    found = [(cls, (*attributes, -1), None) for cls, attributes in block_classes().items()]
    found += [(cls, (columns, row, -2), substitute) for cls, (columns, row, substitute)
              in keras_hub_attention.attention_classes().items()]

    def maker(cls, attributes, substitute):
        def make(original):
            paired = _dispatcher(original, attributes, plan, substitute)
            if substitute is None:  # a feed-forward block: no sequence to attend over
                return paired
            # An attention over a sequence split: computed there, unpaired (each
            # projection exchanges its rows alone); elsewhere paired.
            return keras_hub_attention.split_dispatcher(
                original, keras_hub_attention.split_substitute(cls), otherwise=paired)
        return make

    return tuple((cls.__dict__["call"], maker(cls, attributes, substitute))
                 for cls, attributes, substitute in found)
