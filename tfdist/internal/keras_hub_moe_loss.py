"""keras-hub's MoE load-balancing loss over every replica's tokens, not one replica's.

Private keras-hub detail used here (and only here): the decoder modules of
`QwenMoeBackbone` and `Qwen3MoeBackbone` look up the module-level function
`compute_load_balancing_loss(router_logits, num_experts, top_k, attention_mask)`
when their MoE block runs. Its loss, `E * sum_e f_e * P_e` (f_e: the fraction
of tokens routed to expert e, P_e: the mean router probability of e), is a
product of two means over tokens, so each replica's loss over its own tokens
does not add up to one device's loss over the batch. Under a tfdist mesh
strategy the function is replaced by one that sums the statistics over every
replica first (`psum`, differentiable) and so returns one device's loss on
every replica; Keras then adds each replica's share of it (1 / replicas).
Elsewhere the original runs. `tests/internal/test_keras_hub_moe_loss.py`
checks the original's source and both against one device.
"""

import importlib

from keras import ops

from tfdist import collectives, runtime

MODULES = (
    "keras_hub.src.models.qwen_moe.qwen_moe_decoder",
    "keras_hub.src.models.qwen3_moe.qwen3_moe_decoder",
)


def _psum_everywhere(x):
    for axis in runtime.current_mesh().shape.names:
        x = collectives.psum(x, axis)
    return x


def global_load_balancing_loss(router_logits, num_experts, top_k, attention_mask=None):
    """keras-hub's load-balancing loss, with its token means taken over every replica.

    Args:
        router_logits: `[tokens, num_experts]`, this replica's tokens.
        num_experts: E.
        top_k: experts per token.
        attention_mask: `[batch, length, length]` or None (every token counts).

    Returns:
        The scalar loss of the whole global batch.
    """
    routing_weights = ops.softmax(router_logits, axis=-1)  # [N, E]
    _, selected = ops.top_k(routing_weights, k=top_k)
    expert_mask = ops.one_hot(selected, num_experts)  # [N, k, E]
    if attention_mask is not None:
        counted = ops.cast(ops.reshape(ops.any(attention_mask, axis=-1), (-1, 1)), "float32")
    else:
        counted = ops.ones((ops.shape(routing_weights)[0], 1), "float32")
    tokens = _psum_everywhere(ops.sum(counted, axis=0))  # [1]
    routed = _psum_everywhere(ops.sum(expert_mask * counted[:, None, :], axis=0))  # [k, E]
    probs = _psum_everywhere(ops.sum(routing_weights * ops.cast(counted, routing_weights.dtype),
                                     axis=0))  # [E]
    tokens_per_expert = ops.mean(routed / ops.maximum(tokens, 1e-9), axis=0)
    router_prob_per_expert = probs / ops.cast(ops.maximum(tokens, 1e-9), probs.dtype)
    return ops.sum(tokens_per_expert * router_prob_per_expert) * num_experts


def _dispatcher(original):
    def compute_load_balancing_loss(router_logits, num_experts, top_k, attention_mask=None):
        mesh_runtime = runtime.current_runtime()
        if mesh_runtime is None or mesh_runtime.mesh.size == 1:
            return original(router_logits, num_experts, top_k, attention_mask)
        import tensorflow as tf

        if tf.distribute.in_cross_replica_context():
            return original(router_logits, num_experts, top_k, attention_mask)
        return global_load_balancing_loss(router_logits, num_experts, top_k, attention_mask)

    compute_load_balancing_loss._tfdist_original = original
    return compute_load_balancing_loss


def install() -> None:
    """Replaces the modules' `compute_load_balancing_loss` (idempotent; no keras-hub: no-op)."""
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = module.compute_load_balancing_loss
        if getattr(current, "_tfdist_original", None) is None:
            module.compute_load_balancing_loss = _dispatcher(current)
