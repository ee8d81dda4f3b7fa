"""Quarantine: the only place where tfdist touches private TF/Keras APIs.

Why: tf.distribute has no public extension point for a strategy whose variables
are shards rather than mirrors, and Keras pairs gradients with their variables
only inside its optimizer. One job per module, each checked by a test in
`tests/internal/` (or, for the Horovod engine, `tests/cluster/test_horovod.py`)
that fails first, loudly, when a TF or Keras upgrade moves the hook:

- `shard_routing`: `MeshExtended` (a `MirroredExtended`) and `ShardedVariable`
  (a `MirroredVariable`): true shards, gradients routed by variable.
- `horovod_replicas`: `HorovodExtended`, one replica per Horovod rank.
- `model_averaging`: local SGD with periodic model averaging (BMUF).
- `single_controller`: `MeshExtended` and `AveragingExtended` over other tasks'
  devices, their scope's eager ops and resources (a keras-hub tokenizer) left on
  the controller.
- `gradient_seam`: the one place where gradients meet their variables: attached
  to each Keras optimizer created under a tfdist strategy, it routes and
  reduces, clips globally, makes Keras's accumulation and EMA decisions and
  applies, in cross-replica context (the route from a weight's read to its
  update is in its docstring).
- `keras_lamb`: Lamb's trust ratio from the norms of whole sharded weights
  (set on Lamb instances by the seam).
- `keras_reduce`: `strategy.reduce` as Keras 3 calls it (keras#20585, uneven first batches).
- `keras_steps`: recognising Keras's train, test and predict steps.
- `keras_rows`: Keras's losses and compiled metrics over the real rows of all replicas.
- `even_steps`: Keras steps on uneven replicas (partial batches) evened out.
- `keras_fit`: the epoch Keras's `fit` starts from.
- `collective_abort`: aborting pending collectives when a peer is lost.
- `keras_variables`: the Keras variable (path, shape) a `tf.Variable` is created for.
- `keras_distribution`: the `LayoutMap` of Keras's own `ModelParallel`.
- `keras_tensor_parallel`: shard-wise `call`s of Keras's Dense, EinsumDense,
  Embedding and ReversibleEmbedding under a `LayoutMap`, set on each such layer
  built under the strategy (with `keras_tp_pairs`' blocks and attentions).
- `keras_tp_pairs`: Megatron pairing of keras-hub feed-forward blocks' column and
  row layers (the blocks' `call`s, each checked against the installed keras-hub).
- `keras_hub_moe_loss`: keras-hub's MoE load-balancing loss over every replica.
- `keras_hub_attention`: keras-hub's and Keras's attention layers on their local
  heads where a `LayoutMap` splits the heads (each `call` checked against the
  installed source).
- `keras_initial_slices`: a shard of a Keras random initializer's value drawn
  alone, equal to its box of the whole draw (TF's Philox counters).
- `keras_jit`: `jit_compile=True` falling back on a multi-device tfdist mesh.
- `loss_scale`: mixed-precision loss scaling skipping a step on every replica
  when any overflowed (set on `LossScaleOptimizer` instances by the seam).
- `sources`: the sha256 of an upstream function's installed source, which a hook
  mirroring it checks before it runs.
- `hooks`: the table of every upstream function and class attribute tfdist
  replaces, overrides, sets or mirrors, with its fingerprint at the supported
  versions; every strategy checks it when created (`hooks.verify`), and
  `python -m tfdist.check` prints it (`docs/upstream_hooks.md`).
- `keras_h5_slices`: Keras weight files read slice by slice into sharded variables.
- `keras_loop_reads`: split weights read inside a loop of a Keras call (an RNN's
  cell, `keras.ops.while_loop`) read once before the loop; tfdist collectives
  inside such a loop refused, naming the layer.
- `keras_graph`: a functional model's graph read to cut it into pipeline
  stages (nested functional models inlined, the tensors crossing each cut).
- `keras_hub_configs`: the config of keras-hub 0.32's Llama decoder block,
  whose own `get_config` raises (to clone it onto a stage's device).
- `keras_remat`: recomputation with the forward pass's random numbers, variable
  updates, losses and call context (`keras.remat`, `keras.RematScope` on TF).
"""


def install_keras_hooks() -> None:
    """Installs every Keras hook a tfdist mesh strategy relies on (idempotent).

    Each hook changes Keras's behaviour only under a `tfdist.runtime.MeshRuntime`;
    every tfdist mesh strategy calls this when it is created.
    """
    from tfdist.internal import (keras_h5_slices, keras_jit, keras_loop_reads, keras_remat,
                                 keras_rows)

    # The optimizer's seam is not among them: it is attached to each optimizer
    # created under a tfdist strategy (`gradient_seam`), no class patched.
    for hook in (keras_jit, keras_rows, keras_h5_slices, keras_remat, keras_loop_reads):
        hook.install()


def install_layout_map_hooks() -> None:
    """Installs the hooks a strategy with a Keras `LayoutMap` relies on (idempotent):
    keras-hub's global MoE balancing loss. (Tensor-parallel calls of Keras's layers are
    set per layer, on those built under the strategy: `keras_tensor_parallel.attach`.)"""
    from tfdist.internal import keras_hub_moe_loss

    keras_hub_moe_loss.install()
