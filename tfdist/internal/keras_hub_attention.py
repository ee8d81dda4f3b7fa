"""keras-hub's Gemma and Llama attention, and Keras's `MultiHeadAttention`, on local heads:
nothing exchanged between query, key, value and output.

Private keras-hub detail used here (and only here): `CachedGemmaAttention`'s
`call` and `_compute_attention`, which this module computes again on the heads
a device holds (keras-hub reshapes with the global head counts, so its own code
cannot run on a device's heads; this mirror of it can), and `LlamaAttention`'s
`call`, mirrored, whose `_compute_attention` runs on local heads as written; and
the same for Keras's `MultiHeadAttention` (private Keras API: its `call`,
mirrored, `_compute_attention` and `_compute_attention_mask`).
`SOURCES` fingerprints the keras-hub source it mirrors or relies on: where the
installed keras-hub differs, the substitute is not installed (each layer then
exchanges its rows, as alone, exact), and
`tests/internal/test_keras_hub_attention.py` fails, asking for the mirror to be
checked against the new source.

Alone (`keras_tensor_parallel`), query, key and value (heads split over mesh
axis A of size M) each all-to-all their local heads back to whole rows, the
core runs on every head of a device's `b` rows, and the output projection
all-to-alls them into local heads again: four head-wide exchanges per call and
as many in the backward pass. Paired, as Megatron-LM pairs attention:

    x [b, t, d] -> all_gather over A (once for query, key and value)
        -> query [b*M, t, H/M, h], key and value [b*M, t, K/M, h] (local heads)
        -> rotary embedding, scores, mask, softmax, weighted values: per row and head
           (the mask [b, t, t] gathered over A too: rows of the whole group)
        -> output projection contracted with the kernel's heads [H/M, h, d]
        -> reduce_scatter over A -> [b, t, d]

Over a sequence split (the mesh's layout maps `length`; `ModelParallel(...,
sequence_axis=...)`), `split_substitute(cls)` computes the layer's call on
this device's tokens instead: `LlamaAttention`'s and `CachedGemmaAttention`'s
projections and rotary embedding (at the tokens' global positions) run as
keras-hub wrote them, the core is `tfdist.sequence`'s ring or Ulysses
attention, causal, with the padding of the keys read off the diagonal of the
decoder's local mask (the minimum of its padding and causal masks: `mask[i, i]`
is key `i`'s padding). Gemma 2's soft cap and sliding window and Keras's
attention raise there (not yet supported), rather than attend within each
device's tokens.

Grouped queries stay grouped: device j holds query heads j*H/M.. and key/value
heads j*K/M.., so its query heads' groups are exactly its key/value heads (a
layout can split K over M only where M divides it; with key and value not
split, the plan finds no pair and nothing is paired).
"""

import functools
import importlib

import numpy as np
import tensorflow as tf

from tfdist import collectives
from tfdist.internal import sources

# keras-hub classes: (module, class) -> ((query, key, value attributes), output attribute,
# {method: sha256 of its source, as mirrored or relied on here}, substitute's name).
SOURCES = {
    ("keras_hub.src.models.gemma.gemma_attention", "CachedGemmaAttention"): (
        ("query_dense", "key_dense", "value_dense"), "output_dense", {
            "call": "d9363a7df8d0c753926db0e2d8df6fd82b1fedda099eb7a8be3cb93d94d486aa",
            "_compute_attention":
                "42f069d8da99ba7069cc4f1c5d764b7e46f29e138f8006916c747766474721bd",
        }, "gemma_attention"),
    ("keras_hub.src.models.llama.llama_attention", "LlamaAttention"): (
        ("_query_dense", "_key_dense", "_value_dense"), "_output_dense", {
            "call": "4e692b3fd360790b138b5fcd90d6fdd2da0d2f476d2d02af4b38c31c753e2476",
            "_compute_attention":
                "a03c2791a8626c61bb61dbc47fb6423bc97351ea66f0caa9cd65a1278e9652c3",
            "_masked_softmax":
                "6dc0c0c2dc9cadc378bd43f6e4cc3175a52155ae299706a6805a1152198b56b4",
        }, "llama_attention"),
    # Keras's own: `call` mirrored; `_compute_attention` (einsums or
    # `dot_product_attention` over whatever heads it is given) and
    # `_compute_attention_mask` (from the local rows, then gathered) run as written.
    ("keras.src.layers.attention.multi_head_attention", "MultiHeadAttention"): (
        ("_query_dense", "_key_dense", "_value_dense"), "_output_dense", {
            "call": "fd666cb2fe09b1019439725658a24e8fe17a15cc1bdc6ac61fc6ffb4a34daad1",
            "_compute_attention":
                "88168a1a82dd0d31365342088698b31988c40e6fdb2cd06001d4d2ec8f372966",
            "_compute_attention_mask":
                "1efa5564bc3863460fbf51af6d7c2e2f51816b040d29dad60bf6c443063df756",
        }, "keras_attention"),
}


def fingerprint(cls, method: str) -> str:
    """sha256 of the installed source of `cls.method` (as keras-hub wrote it)."""
    return sources.source_sha256(cls.__dict__[method])


def _installed(module: str, name: str, methods: dict):
    """The installed class `module.name` if each of its `methods` has the source whose
    sha256 is given, else None (keras-hub absent, without this model, or changed)."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return cls if all(fingerprint(cls, m) == sha for m, sha in methods.items()) else None


@functools.cache  # the installed sources do not change within a process
def attention_classes():
    """{installed keras-hub attention class: (column attributes, row attribute, substitute)}
    whose source is the one mirrored here."""
    classes = {}
    for (module, name), (columns, row, sources, substitute) in SOURCES.items():
        cls = _installed(module, name, sources)
        if cls is not None:
            classes[cls] = (columns, row, globals()[substitute])
    return classes


def _vllm_serving() -> bool:
    try:
        from keras_hub.src.vllm.context import get_vllm_context
    except ImportError:
        return False
    context = get_vllm_context()
    return context is not None and context.paged_attention_func is not None


def gemma_attention(layer, pair, axis, x, attention_mask=None, cache=None,
                    cache_update_index=0, training=False):
    """`CachedGemmaAttention.call` on this device's heads of every row of the group.

    Returns NotImplemented (keras-hub's call runs, each layer exchanging its
    rows) for a cache (decoding), dropout in training (its mask would be drawn
    for another layout of rows), no mask, or vLLM serving.
    """
    if (cache is not None or attention_mask is None or (layer.dropout and training)
            or _vllm_serving()):
        return NotImplemented
    from keras import ops

    query = pair.take(layer.query_dense(x))  # [b*M, t, H/M, h]
    key = pair.take(layer.key_dense(x))  # [b*M, t, K/M, h]
    value = pair.take(layer.value_dense(x))
    query = layer._apply_rope(query, cache_update_index)
    key = layer._apply_rope(key, cache_update_index)
    full_mask = mask = _gathered_mask(attention_mask, axis)  # [b*M, t, t]

    if layer.query_head_dim_normalize:
        query_normalization = 1 / np.sqrt(layer.head_dim)
    else:
        query_normalization = 1 / np.sqrt(layer.hidden_dim // layer.num_query_heads)
    if layer.use_sliding_window_attention:
        mask = layer._mask_sliding_window(mask, cache_update_index=cache_update_index)

    if layer._use_fused_attention_op():
        kwargs = ({"attn_logits_soft_cap": layer.logit_soft_cap}
                  if layer.logit_soft_cap is not None else {})
        vectors = ops.dot_product_attention(
            query=query, key=key, value=value,
            mask=ops.cast(ops.expand_dims(mask, axis=1), dtype="bool"),
            scale=query_normalization, **kwargs)
    else:
        query *= ops.cast(query_normalization, dtype=query.dtype)
        b, q_len, local_heads, h = ops.shape(query)
        kv_heads = key.shape[-2]  # this device's: K/M
        query = ops.reshape(query, (b, q_len, kv_heads, local_heads // kv_heads, h))
        logits = ops.einsum("btkgh,bskh->bkgts", query, key)
        if layer.logit_soft_cap is not None:
            logits = ops.divide(logits, layer.logit_soft_cap)
            logits = ops.multiply(ops.tanh(logits), layer.logit_soft_cap)
        weights = layer.softmax(logits, mask=mask[:, None, None, :, :])
        weights = ops.cast(weights, logits.dtype)
        vectors = ops.einsum("bkgts,bskh->btkgh", weights, value)
        vectors = ops.reshape(vectors, (b, q_len, local_heads, h))

    # Wipe the vectors of queries that attend to no token (the mask before any window).
    no_attended_tokens = ops.all(ops.equal(full_mask, 0), axis=-1, keepdims=True)[..., None]
    vectors = ops.where(no_attended_tokens, ops.zeros_like(vectors), vectors)
    return layer.output_dense(pair.hand_over(vectors))


def llama_attention(layer, pair, axis, hidden_states, attention_mask=None, cache=None,
                    cache_update_index=None, training=None):
    """`LlamaAttention.call` on this device's heads of every row of the group.

    Its `_compute_attention` (einsums over whatever heads it is given, the
    mask broadcast over heads) runs as keras-hub wrote it, on the local heads
    and the gathered mask. NotImplemented (keras-hub's call, unpaired) for a
    cache, dropout in training, no mask, or vLLM serving.
    """
    if (cache is not None or cache_update_index is not None or attention_mask is None
            or (layer.dropout and training) or _vllm_serving()):
        return NotImplemented
    from keras import ops

    query = pair.take(layer._query_dense(hidden_states))  # [b*M, t, H/M, h]
    query = layer.rotary_embedding_layer(query, start_index=0)
    key = pair.take(layer._key_dense(hidden_states))  # [b*M, t, K/M, h]
    value = pair.take(layer._value_dense(hidden_states))
    key = layer.rotary_embedding_layer(key, start_index=0)
    key = ops.repeat(key, repeats=layer.num_key_value_groups, axis=2)
    value = ops.repeat(value, repeats=layer.num_key_value_groups, axis=2)
    vectors = layer._compute_attention(query, key, value, _gathered_mask(attention_mask, axis))
    return layer._output_dense(pair.hand_over(vectors))


def keras_attention(layer, pair, axis, query, value, key=None, query_mask=None,
                    value_mask=None, key_mask=None, attention_mask=None,
                    return_attention_scores=False, training=None, use_causal_mask=False):
    """Keras's `MultiHeadAttention.call` on this device's heads of every row of the group.

    Its mask (`[b, T, S]`, from the local rows' Keras masks, the given mask
    and causality) is gathered over the axis; its `_compute_attention` runs on
    the local heads as Keras wrote it. NotImplemented (Keras's call, unpaired)
    for attention scores returned, a gate (`use_gate`), dropout in training, or
    a subclass with its own `_compute_attention`.
    """
    from keras.src import backend
    from keras.src.layers.attention.multi_head_attention import MultiHeadAttention

    if (return_attention_scores or getattr(layer, "_use_gate", False)
            or (layer._dropout and training)
            or type(layer)._compute_attention is not MultiHeadAttention._compute_attention):
        return NotImplemented
    if key is None:
        key = value
    query_mask = backend.get_keras_mask(query)
    backend.set_keras_mask(query, None)
    backend.set_keras_mask(value, None)
    backend.set_keras_mask(key, None)
    causal_only = (use_causal_mask and query_mask is None and value_mask is None
                   and key_mask is None and attention_mask is None
                   and layer._sliding_window is None)
    if causal_only:  # the causal mask is built from the shapes, for any rows
        attention_mask = None
    else:
        attention_mask = layer._compute_attention_mask(
            query, value, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
            attention_mask=attention_mask, use_causal_mask=use_causal_mask)
        if attention_mask is not None:
            attention_mask = _gathered_mask(attention_mask, axis)  # [b*M, T, S]
    query = pair.take(layer._query_dense(query))  # [b*M, T, N/M, h]
    key = pair.take(layer._key_dense(key))
    value = pair.take(layer._value_dense(value))
    vectors, _ = layer._compute_attention(
        query, key, value, attention_mask, training, False,
        **({"use_causal_mask": True} if causal_only else {}))
    output = layer._output_dense(pair.hand_over(vectors))
    if query_mask is not None:
        backend.set_keras_mask(output, query_mask)
    return output


def _refuse_in_split(layer, axis, cache, cache_update_index, training, attention_mask,
                     extra=None):
    what = ("a key/value cache (decoding)" if cache is not None or cache_update_index
            else f"attention dropout ({layer.dropout})" if layer.dropout and training
            else "vLLM serving" if _vllm_serving()
            else "no attention mask (the keras-hub decoder always passes one)"
            if attention_mask is None else extra)
    if what:
        raise ValueError(f"Layer {layer.name!r} ({type(layer).__name__}) over a sequence split "
                         f"on mesh axis {axis!r}: {what} is not supported there; train and "
                         f"evaluate under the split, generate on a mesh without one.")


def _split_core(query, key, value, attention_mask, axis, method, scale, window=None):
    """Causal ring / Ulysses attention of this device's tokens `[b, t, H, h]`; the keys'
    padding is the diagonal of the decoder's local mask (padding and causal masks'
    minimum, `SPLIT_SOURCES`); `window`: a sliding window of that many tokens."""
    from tfdist import sequence

    key_mask = tf.linalg.diag_part(tf.cast(tf.stop_gradient(attention_mask), query.dtype))
    vectors = sequence.sequence_attention(query, key, value, axis, method=method, causal=True,
                                          key_mask=key_mask, balanced=True, scale=scale,
                                          window=window)
    return vectors, key_mask


def llama_split_attention(layer, axis, method, hidden_states, attention_mask=None, cache=None,
                          cache_update_index=None, training=None, window=None):
    """`LlamaAttention.call` on this device's tokens of a sequence split over mesh axis `axis`
    (zig-zag, `tfdist.sequence.split_sequences`): causal ring or Ulysses attention
    (`method`) over the whole sequence, rotary positions global (`window`: a sliding
    window, Qwen's)."""
    from keras import ops

    from tfdist import sequence

    _refuse_in_split(layer, axis, cache, cache_update_index is not None, training,
                     attention_mask)
    positions = sequence.token_positions(int(hidden_states.shape[1]))
    query = layer.rotary_embedding_layer(layer._query_dense(hidden_states), positions=positions)
    key = layer.rotary_embedding_layer(layer._key_dense(hidden_states), positions=positions)
    value = layer._value_dense(hidden_states)
    vectors, _ = _split_core(query, key, value, attention_mask, axis, method,
                             float(layer._inv_norm_factor), window)
    return layer._output_dense(ops.cast(vectors, layer.compute_dtype))


def gemma_split_attention(layer, axis, method, x, attention_mask=None, cache=None,
                          cache_update_index=0, training=False):
    """`CachedGemmaAttention.call` on this device's tokens of a sequence split over `axis`:
    rotary positions global (Gemma's layout of them), queries scaled as Gemma scales them,
    causal ring or Ulysses attention, and the vectors of queries that see no valid key
    wiped, as Gemma wipes them (from the keys' padding over the whole sequence)."""
    from keras import ops

    from tfdist import sequence

    _refuse_in_split(layer, axis, cache, bool(cache_update_index), training, attention_mask,
                     "attention logits soft-capped (Gemma 2)" if layer.logit_soft_cap
                     is not None else "a sliding window (Gemma 2)"
                     if layer.use_sliding_window_attention else None)
    positions = sequence.token_positions(int(x.shape[1]))
    query = layer._apply_rope(layer.query_dense(x), 0, positions=positions)
    key = layer._apply_rope(layer.key_dense(x), 0, positions=positions)
    value = layer.value_dense(x)
    scale = (1 / np.sqrt(layer.head_dim) if layer.query_head_dim_normalize
             else 1 / np.sqrt(layer.hidden_dim // layer.num_query_heads))
    vectors, key_mask = _split_core(query, key, value, attention_mask, axis, method,
                                    float(scale))
    # A query sees a valid key iff one is at or before it in the whole sequence.
    seen = tf.cumsum(sequence.global_tokens(key_mask, axis, dim=1, balanced=True), axis=1)
    local = sequence.local_tokens(seen, axis, dim=1, balanced=True)
    vectors = tf.where((local > 0)[:, :, None, None], vectors, tf.zeros_like(vectors))
    return layer.output_dense(ops.cast(vectors, layer.compute_dtype))


def qwen_split_attention(layer, axis, method, hidden_states, attention_mask=None, cache=None,
                         cache_update_index=None, training=None):
    """`QwenAttention.call` (Llama's, with biases) over a sequence split on `axis`, with its
    sliding window (keras-hub's band: a query sees the `sliding_window_size` keys ending
    at its own position)."""
    window = layer.sliding_window_size if layer.use_sliding_window_attention else None
    return llama_split_attention(layer, axis, method, hidden_states, attention_mask, cache,
                                 cache_update_index, training, window=window)


def unsupported_split_attention(layer, axis, method, *args, **kwargs):
    raise ValueError(
        f"Layer {layer.name!r} ({type(layer).__name__}) attends over the whole sequence, "
        f"which mesh axis {axis!r} splits (the layout's `length`); tfdist computes "
        f"{', '.join(sorted(SPLIT_SUBSTITUTES))} over a split sequence, not this layer yet. "
        f"Use a mesh without a sequence axis for this model.")


# Attention classes (by name) -> their call over a sequence split.
SPLIT_SUBSTITUTES = {"LlamaAttention": llama_split_attention,
                     "CachedGemmaAttention": gemma_split_attention,
                     "QwenAttention": qwen_split_attention}

# Attention classes tfdist pairs with no tensor-parallel substitute, only over a split
# sequence (their substitute in `SPLIT_SUBSTITUTES`): (module, class) -> {method: sha256
# relied on}.
SPLIT_ONLY = {
    ("keras_hub.src.models.qwen.qwen_attention", "QwenAttention"): {
        "call": "e3d5017be8790d6e97559f52de77809af7b7e0b29c3ddc2dba1f7e4e48569f1c"},
}


@functools.cache
def split_only_classes():
    """{installed class in `SPLIT_ONLY` whose source is the one relied on: its substitute}."""
    classes = {}
    for (module, name), methods in SPLIT_ONLY.items():
        cls = _installed(module, name, methods)
        if cls is not None:
            classes[cls] = split_substitute(cls)
    return classes


def split_dispatcher(original, split, otherwise=None):
    """`call` computing the layer over the mesh's sequence split with `split(layer, axis,
    method, *args, **kwargs)` (traced under a length split), else `otherwise` (default:
    the original call; the pairing dispatcher for attentions `keras_tp_pairs` pairs)."""
    otherwise = otherwise or original

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        if not tf.executing_eagerly():
            from tfdist import sequence

            axis = sequence.length_axis()
            if axis is not None:
                method = getattr(tf.distribute.get_strategy(), "sequence_method", "ring")
                return split(self, axis, method, *args, **kwargs)
        return otherwise(self, *args, **kwargs)

    call._tfdist_original = original
    return call


# What the split substitutes rely on besides the attention's own call: the decoder builds
# the attention mask as the padding and causal masks' minimum (its diagonal: the padding).
SPLIT_SOURCES = {
    ("keras_hub.src.models.llama.llama_decoder", "LlamaTransformerDecoder"): {
        "_compute_self_attention_mask":
            "1e3e6dcbc82dfd0f9ca3fd54319992c9bb217b83ed63f8f0773f337a9932f7a2",
    },
    ("keras_hub.src.models.gemma.gemma_decoder_block", "GemmaDecoderBlock"): {
        "_compute_attention_mask":
            "2475d988fbec3f0dc0b060213eeb5f72672e3f75442ddfbdb8260a6e220465bd",
    },
    ("keras_hub.src.models.qwen.qwen_decoder", "QwenTransformerDecoder"): {
        "_compute_self_attention_mask":
            "979a1ae491598d63a401e9a358f6553c4eb964af05c691d7f97ad459f42c8973",
    },
}


@functools.cache
def split_sources_match() -> bool:
    """Whether the installed keras-hub's sources in `SPLIT_SOURCES` are the ones relied on."""
    return all(_installed(module, name, methods) is not None
               for (module, name), methods in SPLIT_SOURCES.items())


def split_substitute(cls):
    """The function computing `cls`'s call over a split sequence (one that raises a clear
    error where tfdist has none, or where the sources it relies on differ)."""
    if not split_sources_match():
        return unsupported_split_attention
    return SPLIT_SUBSTITUTES.get(cls.__name__, unsupported_split_attention)


def _gathered_mask(mask, axis):
    """The attention mask's rows of the whole group (no gradient flows through a mask)."""
    mask = tf.stop_gradient(tf.convert_to_tensor(mask))
    gathered = collectives.all_gather(tf.cast(mask, tf.int32), axis, dim=0)
    return tf.cast(gathered, mask.dtype)
