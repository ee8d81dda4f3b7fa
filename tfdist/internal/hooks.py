"""Every upstream hook of tfdist in one table, and the check that they still match.

tfdist changes TF, Keras and keras-hub behaviour only where those packages have
no public extension point, in the modules of `tfdist.internal`. Each such place
is one `Hook` of `HOOKS`:

- "replaced": tfdist assigns the upstream attribute (a method on its class, a
  module function) and keeps the original, which runs under other strategies;
- "overridden": a tfdist subclass of a private TF / Keras class overrides it;
- "set": tfdist sets a private attribute that upstream code reads (on an
  instance, or on its own subclass); the function reading it is fingerprinted;
- "mirrored": tfdist copies the upstream source (or its kernel's layout) to
  compute it another way, patching nothing;
- "relied on": tfdist calls it on data it reshaped, trusting its source.

Each hook records the sha256 of the upstream source at the supported versions
(`SUPPORTED_VERSIONS`); `check()` compares it with the installed source and
`verify()` raises one `UpstreamMismatchError` naming the packages whose hooks
moved. Every tfdist strategy calls `verify()` when it is created, before any
hook is installed, so an unsupported TF / Keras / keras-hub fails there, once
and clearly, never silently or deep inside a step. `python -m tfdist.check`
prints the report, one line per hook; `docs/upstream_hooks.md` is the table in
words (`markdown_table()`).

Where a hook cannot be fingerprinted (a C++ kernel), its `tests` name the test
that fails when upstream moves, and `check()` asserts only that it exists.

Upgrading a package: run `python -m tfdist.check`, read each moved source
against the tfdist module that relies on it, fix the module, then update the
hook's `sha256`, `SUPPORTED_VERSIONS` and the module's own fingerprints
(`keras_initial_slices.SOURCES`, `keras_hub_attention.SOURCES`).
"""

import dataclasses
import functools
import importlib
import importlib.util
import os
import types
from typing import List, Optional, Sequence, Tuple

from tfdist.internal import sources

# The versions the fingerprints below were taken from.
SUPPORTED_VERSIONS = types.MappingProxyType(
    {"tensorflow": "2.21.0", "keras": "3.15.1", "keras_hub": "0.32.0"})
# What pip calls them.
PIP_NAMES = types.MappingProxyType(
    {"tensorflow": "tensorflow", "keras": "keras", "keras_hub": "keras-hub"})
# Packages tfdist runs without: their hooks are skipped when they are not installed.
OPTIONAL_PACKAGES = frozenset({"keras_hub"})

KINDS = ("replaced", "overridden", "set", "mirrored", "relied on")


@dataclasses.dataclass(frozen=True)
class Hook:
    """One place where tfdist patches, overrides or mirrors an upstream attribute.

    Attributes:
        target: dotted path of the upstream attribute, e.g.
            `"keras.src.trainers.trainer.model_supports_jit"`; for an
            overridden method, the class tfdist subclasses and the method (found
            along its MRO); for an instance attribute, the class and attribute.
        package: "tensorflow", "keras" or "keras_hub".
        kind: one of `KINDS`.
        modules: the tfdist modules that install, define or rely on it.
        why: one line.
        sha256: sha256 of the upstream source of `source` (default `target`) at
            `SUPPORTED_VERSIONS`, as `tfdist.internal.sources.source_sha256`
            computes it; None where no source can be fingerprinted.
        source: dotted path of the fingerprinted function when it is not
            `target` (a "set" attribute: the function that reads it).
        original: where the tfdist module keeps the upstream function it
            replaced, when not in the replacement's `_tfdist_original`:
            `"tfdist.internal.keras_jit._KERAS_MODEL_SUPPORTS_JIT"`, or
            `"tfdist.internal.keras_rows._originals.reduce_values"` (a dict's key).
        tests: the tests that exercise the hook against the installed package.

    Example:

    ```python
    Hook("keras.src.trainers.trainer.model_supports_jit", "keras", "replaced",
         ("tfdist.internal.keras_jit",), "jit_compile=True falls back on a multi-device mesh",
         "287a9d3336efcce31c73380bf054c89a4e967906407c55063a86208bb4a1999c",
         original="tfdist.internal.keras_jit._KERAS_MODEL_SUPPORTS_JIT",
         tests=("tests/internal/test_keras_jit.py",))
    ```
    """

    target: str
    package: str
    kind: str
    modules: Tuple[str, ...]
    why: str
    sha256: Optional[str]
    source: Optional[str] = None
    original: Optional[str] = None
    tests: Tuple[str, ...] = ()

    def __post_init__(self):
        if self.package not in SUPPORTED_VERSIONS:
            raise ValueError(f"Hook {self.target!r}: package must be one of "
                             f"{sorted(SUPPORTED_VERSIONS)}; received {self.package!r}.")
        if self.kind not in KINDS:
            raise ValueError(f"Hook {self.target!r}: kind must be one of {KINDS}; "
                             f"received {self.kind!r}.")
        if self.sha256 is None and not self.tests:
            raise ValueError(f"Hook {self.target!r} has no fingerprint: name the test that "
                             f"checks it against the installed {self.package}.")

    @property
    def fingerprinted(self) -> str:
        """The dotted path whose source `sha256` fingerprints."""
        return self.source or self.target


_I = "tfdist.internal."
_OPT = "keras.src.backend.tensorflow.optimizer.TFOptimizer"
_LAYER = "keras.src.layers.layer.Layer"
_MIRRORED_EXTENDED = "tensorflow.python.distribute.mirrored_strategy.MirroredExtended"
_MIRRORED_VARIABLE = "tensorflow.python.distribute.values.MirroredVariable"
_EXTENDEDS = (_I + "shard_routing", _I + "horovod_replicas", _I + "model_averaging")
_TP = (_I + "keras_tensor_parallel",)
_TP_TESTS = ("tests/internal/test_keras_tensor_parallel.py",
             "tests/distribution/test_model_parallel.py")
_ATTENTION = (_I + "keras_tp_pairs", _I + "keras_hub_attention")
_ATTENTION_TESTS = ("tests/internal/test_keras_hub_attention.py",
                    "tests/distribution/test_keras_hub.py")
_MESH_TESTS = ("tests/internal/test_shard_routing.py", "tests/strategies/test_mesh_strategy.py")
_BASE_OPT = "keras.src.optimizers.base_optimizer.BaseOptimizer"
_SEAM = (_I + "gradient_seam",)
_SEAM_TESTS = ("tests/internal/test_gradient_seam.py", "tests/strategies/test_optimizers.py")
_SLICES = (_I + "keras_initial_slices",)
_SPLIT_MASK = ("over a sequence split: the padding and causal masks' minimum, whose diagonal "
               "is the keys' padding")
_SLICES_TESTS = ("tests/internal/test_keras_initial_slices.py",)

HOOKS: Tuple[Hook, ...] = (
    # -- Keras: the optimizer's seam, set per instance (no class patched) -------------
    Hook(f"{_BASE_OPT}._backend_apply_gradients", "keras", "set", _SEAM,
         "on each optimizer created under a tfdist strategy: the gradient seam, which "
         "Keras's apply calls in a replica with each replica's gradients",
         "43097be63b919d035bddf973cb3dac75e56b37f55dabb66c960254165e2f1477",
         source=f"{_BASE_OPT}.apply", tests=_SEAM_TESTS),
    Hook(f"{_BASE_OPT}._backend_apply_gradients", "keras", "mirrored", _SEAM,
         "the seam makes its decisions in its order (clipping, weight decay, accumulation, "
         "EMA), in cross-replica context",
         "48d6e24d580392413add1616a1bd8acdd4e7f3fe41db2f130d34d8093ef4757d", tests=_SEAM_TESTS),
    Hook("keras.src.optimizers.lamb.Lamb.update_step", "keras", "set",
         _SEAM + (_I + "keras_lamb",),
         "on each Lamb created under a tfdist strategy, called per component by Keras's TF "
         "update step: the trust ratio from the norms of whole sharded weights",
         "ec83c95231ba33ee08aec21749ca92dff304cb6f77bdb21376621e183f513b20",
         source=f"{_OPT}._distributed_tf_update_step",
         tests=("tests/internal/test_keras_lamb.py",)),
    Hook("keras.src.optimizers.lamb.Lamb.update_step", "keras", "mirrored",
         (_I + "keras_lamb",), "Keras's formula, with global norms for sharded weights",
         "be61e254012b60f55a4880d7ccd5a86e642a838f69e366bda3a988cff249390e",
         tests=("tests/internal/test_keras_lamb.py",)),
    Hook("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.check_finite", "keras",
         "set", _SEAM + (_I + "loss_scale",),
         "on each LossScaleOptimizer created under a tfdist strategy, called on every "
         "replica by Keras's _tf_apply: a step skipped everywhere when any replica overflowed",
         "e702c4db1a0622e3b4da2f76d6cca4660f63c145e272d7510d96d674cf944814",
         source="keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._tf_apply",
         tests=("tests/internal/test_loss_scale.py",)),
    Hook("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.check_finite", "keras",
         "relied on", (_I + "loss_scale",), "each replica's own answer, made global",
         "b0ce693a4ff0133b24ff258572b4279b2154ed1a3ff0478368ec5914272ea3a5",
         tests=("tests/internal/test_loss_scale.py",)),
    Hook(f"{_BASE_OPT}.__init__", "keras", "relied on", _SEAM,
         "creates the optimizer's first variable inside name_scope(caller=optimizer): where "
         "the seam is attached",
         "7d5c171dfc92e81fc0d6247489c2ca78c02080d900679f5f0e04f4d651b3114f", tests=_SEAM_TESTS),
    Hook("keras.src.backend.common.name_scope.name_scope.__enter__", "keras", "relied on",
         _SEAM, "the name-scope stack whose top entry's caller is the optimizer being created",
         "3ad9c648f157b115f45c59359d35bb1c438418f4607c0b48a533c965e59540e2", tests=_SEAM_TESTS),
    Hook(f"{_OPT}._backend_update_step", "keras", "relied on", _SEAM,
         "the seam calls it in cross-replica context: each gradient applied per component",
         "00bd759c099a6b72e88785836a38006d3d197c329b14bf6e75b77339460d3bc3", tests=_SEAM_TESTS),
    Hook(f"{_OPT}._all_reduce_sum_gradients", "keras", "relied on", _SEAM,
         "returns the seam's reduced gradients unchanged in cross-replica context",
         "953512efa56c968002e3ddf9c13f593a893cad8770391ab6c7a1c001fde513b0", tests=_SEAM_TESTS),
    # -- Keras: replaced -------------------------------------------------------------
    Hook("keras.src.trainers.trainer.model_supports_jit", "keras", "replaced", (_I + "keras_jit",),
         "jit_compile=True falls back on a multi-device mesh, for every model",
         "287a9d3336efcce31c73380bf054c89a4e967906407c55063a86208bb4a1999c",
         original=_I + "keras_jit._KERAS_MODEL_SUPPORTS_JIT",
         tests=("tests/internal/test_keras_jit.py",)),
    Hook("keras.src.losses.loss.reduce_values", "keras", "replaced", (_I + "keras_rows",),
         "mean losses over the real rows of every replica (partial batches)",
         "60b0462147725ad25b69cbfa93f1662fd83a803d6b43add1804d48c7f0cdddb9",
         original=_I + "keras_rows._originals.reduce_values",
         tests=("tests/internal/test_keras_rows.py",)),
    Hook("keras.src.trainers.compile_utils.CompileMetrics.update_state", "keras", "replaced",
         (_I + "keras_rows",), "compiled metrics count only the real rows (partial batches)",
         "75fad85bf74f4a10e0f35b8e2162c9486d36e91e4fc116aa52526fd305a30908",
         original=_I + "keras_rows._originals.update_metrics",
         tests=("tests/internal/test_keras_rows.py",)),
    Hook("keras.src.saving.saving_lib.H5IOStore.__getitem__", "keras", "replaced",
         (_I + "keras_h5_slices",), "weights-file datasets read on demand, not whole",
         "ef8c082dd4fcf4e4ca0c3717734d9da28a385bbf0b41f671c873a810de7f6b5f",
         tests=("tests/internal/test_keras_h5_slices.py",)),
    Hook("keras.src.backend.common.variables.Variable.assign", "keras", "replaced",
         (_I + "keras_h5_slices",),
         "a weights-file dataset assigned to a sharded variable unread: each shard reads its slice",
         "4fdea6a6244132ab5b3c8f7b7da108258ea9e8dd457c92be70c8a8e5122a44a3",
         tests=("tests/internal/test_keras_h5_slices.py",)),
    Hook("keras.src.saving.saving_lib.is_memory_sufficient", "keras", "replaced",
         (_I + "keras_h5_slices",), "a .keras archive's weights read from disk, lazily",
         "10b9add1c6a60955d59e8d0a0ed9168b6318e101de9c4a07bb73a85d677bf947",
         tests=("tests/internal/test_keras_h5_slices.py",)),
    Hook("keras.src.backend.tensorflow.core.remat", "keras", "replaced", (_I + "keras_remat",),
         "recomputation with the forward pass's random numbers, updates, losses and context",
         "a7b1285a0365d7526d87a5b8452db364d922515a014a271e3238ccc66c425d8c",
         original=_I + "keras_remat._KERAS_REMAT",
         tests=("tests/internal/test_keras_remat.py",)),
    Hook(f"{_LAYER}.add_loss", "keras", "replaced", (_I + "keras_remat",),
         "losses added inside a recomputed call keep their gradient",
         "7f70f38e2f25640dcda67a0a3d09edc99e492c26d22adc1de7c6735c4e3453ec",
         original=_I + "keras_remat._KERAS_ADD_LOSS",
         tests=("tests/internal/test_keras_remat.py",)),
    Hook(f"{_LAYER}.__call__", "keras", "replaced", (_I + "keras_loop_reads",),
         "the Keras calls traced in a replica recorded: split weights read once before a loop",
         "4fb7e42e4ffd9b1ab8d23006c049981364609973d18a066a27547c29c1c31754",
         tests=("tests/internal/test_keras_loop_reads.py",)),
    Hook(f"{_LAYER}.call", "keras", "set", _TP + _ATTENTION,
         "on each Dense, EinsumDense, Embedding, ReversibleEmbedding, MultiHeadAttention and "
         "known keras-hub block and attention built under a LayoutMap (the strategy's variable "
         "creator): its shard-wise call, which Layer.__call__ calls",
         "4fb7e42e4ffd9b1ab8d23006c049981364609973d18a066a27547c29c1c31754",
         source=f"{_LAYER}.__call__", tests=_TP_TESTS + _ATTENTION_TESTS),
    Hook("keras.src.layers.core.dense.Dense.call", "keras", "mirrored", _TP,
         "column- or row-parallel (or FSDP) where a LayoutMap splits the kernel",
         "50d7f2ec4bcf91d03dab1762f182081e9cce95289e086444c3177d142692a50b", tests=_TP_TESTS),
    Hook("keras.src.layers.core.einsum_dense.EinsumDense.call", "keras", "mirrored", _TP,
         "column- or row-parallel (or FSDP) where a LayoutMap splits the kernel",
         "11e1183ef9c2b8e574d47fe58a8f7315b06de34c5e1a6588ae6936f8a7529b64", tests=_TP_TESTS),
    Hook("keras.src.layers.core.embedding.Embedding.call", "keras", "mirrored", _TP,
         "lookups in a vocabulary- or feature-split table",
         "2fe5e1e7474fd6709869bc3ff4326ba70c9a5e0aac30ac2d14623cf8463b3e4c", tests=_TP_TESTS),
    Hook("keras.src.layers.core.reversible_embedding.ReversibleEmbedding.call", "keras",
         "mirrored", _TP,
         "logits from a split table (also keras-hub's ReversibleEmbedding, a subclass)",
         "b3243c2ba8c5bddc5e20f7513f8a18704be5ec26470b7032841bc9b191c36cbc", tests=_TP_TESTS),
    Hook("keras.src.layers.attention.multi_head_attention.MultiHeadAttention.call", "keras",
         "mirrored", _ATTENTION, "mirrored on a device's heads: no exchange within attention",
         "fd666cb2fe09b1019439725658a24e8fe17a15cc1bdc6ac61fc6ffb4a34daad1",
         tests=_ATTENTION_TESTS),
    # -- Keras: overridden, set, mirrored, relied on ----------------------------------
    Hook("keras.src.backend.common.stateless_scope.StatelessScope.add_update", "keras",
         "overridden", (_I + "keras_remat",),
         "a recomputed call's variable updates recorded, to apply once",
         "333c7c4cd5cab9d87104e7913a231d2c0beddee01051fcbce92cc7574b06220a",
         tests=("tests/internal/test_keras_remat.py",)),
    Hook("keras.src.backend.common.stateless_scope.StatelessScope.get_current_value", "keras",
         "overridden", (_I + "keras_remat",),
         "a nested recomputed call reads the updates made before it",
         "10bed40ffeae5fca2c5b1a80c290f9cd8871d3e2053d4606c7ecd4fbf7d3cb74",
         tests=("tests/internal/test_keras_remat.py",)),
    Hook("keras.src.trainers.trainer.Trainer._initial_epoch", "keras", "set", (_I + "keras_fit",),
         "BackupAndRestore resumes fit at the saved epoch",
         "a9a6dc02a7ddafa8b2588c5cfa3f9785517b357d1db831e5e1ead4d20cf07204",
         source="keras.src.backend.tensorflow.trainer.TensorFlowTrainer.fit",
         tests=("tests/internal/test_keras_fit.py",)),
    Hook("keras.src.trainers.trainer.Trainer.train_function", "keras", "set", (_I + "keras_fit",),
         "BackupAndRestore skips the batches a resumed epoch already trained",
         "a9a6dc02a7ddafa8b2588c5cfa3f9785517b357d1db831e5e1ead4d20cf07204",
         source="keras.src.backend.tensorflow.trainer.TensorFlowTrainer.fit",
         tests=("tests/internal/test_keras_fit.py",)),
    Hook("keras.src.trainers.trainer.Trainer._loss_tracker.update_state", "keras", "set",
         (_I + "keras_rows",), "the loss history weights a partial batch by its real rows",
         "addc194e254fbb646fee6b6b0eec13e1c5a53936f28a1c8d03ebfd4445c0e54b",
         source="keras.src.metrics.reduction_metrics.Mean.update_state",
         tests=("tests/internal/test_keras_rows.py",)),
    Hook("keras.src.initializers.random_initializers.RandomNormal.__call__", "keras", "mirrored",
         _SLICES, "a shard of the initial value drawn alone",
         "e873d2fc41cc8621b164fbb1857f4c2585e4406f4b92ccbf4b287a733be9fece", tests=_SLICES_TESTS),
    Hook("keras.src.initializers.random_initializers.RandomUniform.__call__", "keras", "mirrored",
         _SLICES, "a shard of the initial value drawn alone",
         "01c9054d776967fe449905d7fa157117dd6ad4d43df14b279058062e10b540a9", tests=_SLICES_TESTS),
    Hook("keras.src.initializers.random_initializers.TruncatedNormal.__call__", "keras",
         "mirrored", _SLICES, "a shard of the initial value drawn alone",
         "1d0c163b9670f4c196455b50b932bc53c6803bc458c48d8028e4e3c557ea2920",
         tests=_SLICES_TESTS),
    Hook("keras.src.initializers.random_initializers.VarianceScaling.__call__", "keras",
         "mirrored", _SLICES, "a shard of the initial value drawn alone (fans of the whole)",
         "baf2b9943e296a5c9af9fbc2409bd7a94bede1dc3bc5aa21be8aed19d333e0b2", tests=_SLICES_TESTS),
    Hook("keras.src.backend.tensorflow.random.normal", "keras", "mirrored", _SLICES,
         "a shard of the initial value drawn alone",
         "58c75c5521f3eb1add77fe0e273eea9735959fb7db3849fb03c0f550fa84642f", tests=_SLICES_TESTS),
    Hook("keras.src.backend.tensorflow.random.uniform", "keras", "mirrored", _SLICES,
         "a shard of the initial value drawn alone",
         "9ca69437a855029f707d67e6cb5dcf670c259a31cb09e416fed52b0320aa985b", tests=_SLICES_TESTS),
    Hook("keras.src.backend.tensorflow.random.truncated_normal", "keras", "mirrored", _SLICES,
         "a shard of the initial value drawn alone",
         "75682b9b641f18d1567b16f176f9a133c8ef8017fd24d447f03f0375cf20cf52", tests=_SLICES_TESTS),
    Hook("keras.src.layers.attention.multi_head_attention.MultiHeadAttention._compute_attention",
         "keras", "relied on", _ATTENTION, "runs on a device's heads as written",
         "88168a1a82dd0d31365342088698b31988c40e6fdb2cd06001d4d2ec8f372966",
         tests=_ATTENTION_TESTS),
    Hook("keras.src.layers.attention.multi_head_attention.MultiHeadAttention"
         "._compute_attention_mask", "keras", "relied on", _ATTENTION,
         "the mask of a device's rows, gathered over the heads' axis",
         "1efa5564bc3863460fbf51af6d7c2e2f51816b040d29dad60bf6c443063df756",
         tests=_ATTENTION_TESTS),
    # -- keras-hub ---------------------------------------------------------------------
    Hook("keras_hub.src.models.gemma.gemma_decoder_block.GemmaDecoderBlock.call", "keras_hub",
         "mirrored", (_I + "keras_tp_pairs",),
         "gate and up paired with down (Megatron): no exchange between them",
         "efb67b8ab50709ea17f6764d2e9705c3a8e25bd42a680dacf460af1c2c06e8f9",
         tests=("tests/internal/test_keras_tp_pairs.py",)),
    Hook("keras_hub.src.models.llama.llama_decoder.LlamaTransformerDecoder.call", "keras_hub",
         "mirrored", (_I + "keras_tp_pairs",),
         "gate and up paired with down (Megatron): no exchange between them",
         "e377491d082f1a64e192e8575d6dacb3108df1ab9f6dd85dbdc358fa235d0c36",
         tests=("tests/internal/test_keras_tp_pairs.py",)),
    Hook("keras_hub.src.models.gemma.gemma_attention.CachedGemmaAttention.call", "keras_hub",
         "mirrored", _ATTENTION, "mirrored on a device's heads: no exchange within attention",
         "d9363a7df8d0c753926db0e2d8df6fd82b1fedda099eb7a8be3cb93d94d486aa",
         tests=_ATTENTION_TESTS),
    Hook("keras_hub.src.models.llama.llama_attention.LlamaAttention.call", "keras_hub",
         "mirrored", _ATTENTION, "mirrored on a device's heads: no exchange within attention",
         "4e692b3fd360790b138b5fcd90d6fdd2da0d2f476d2d02af4b38c31c753e2476",
         tests=_ATTENTION_TESTS),
    Hook("keras_hub.src.models.llama.llama_decoder.LlamaTransformerDecoder"
         "._compute_self_attention_mask", "keras_hub", "relied on", _ATTENTION,
         _SPLIT_MASK,
         "1e3e6dcbc82dfd0f9ca3fd54319992c9bb217b83ed63f8f0773f337a9932f7a2",
         tests=_ATTENTION_TESTS + ("tests/sequence/test_keras_hub_sequence.py",)),
    Hook("keras_hub.src.models.gemma.gemma_decoder_block.GemmaDecoderBlock"
         "._compute_attention_mask", "keras_hub", "relied on", _ATTENTION,
         _SPLIT_MASK,
         "2475d988fbec3f0dc0b060213eeb5f72672e3f75442ddfbdb8260a6e220465bd",
         tests=_ATTENTION_TESTS + ("tests/sequence/test_keras_hub_sequence.py",)),
    Hook("keras_hub.src.models.qwen.qwen_attention.QwenAttention.call", "keras_hub",
         "mirrored", _ATTENTION, "mirrored over a sequence split (a split-only dispatcher, set "
         "on each instance built under a LayoutMap)",
         "e3d5017be8790d6e97559f52de77809af7b7e0b29c3ddc2dba1f7e4e48569f1c",
         tests=("tests/sequence/test_keras_hub_sequence.py",)),
    Hook("keras_hub.src.models.qwen.qwen_decoder.QwenTransformerDecoder"
         "._compute_self_attention_mask", "keras_hub", "relied on", _ATTENTION,
         _SPLIT_MASK,
         "979a1ae491598d63a401e9a358f6553c4eb964af05c691d7f97ad459f42c8973",
         tests=("tests/sequence/test_keras_hub_sequence.py",)),
    Hook("keras_hub.src.models.qwen_moe.qwen_moe_decoder.compute_load_balancing_loss",
         "keras_hub", "replaced", (_I + "keras_hub_moe_loss",),
         "the MoE load-balancing loss over every replica's tokens",
         "b66298cb8e66e6c3ab93bbd861e9cb0766a820afc260ce01044914a260f62e11",
         tests=("tests/distribution/test_keras_hub.py",)),
    Hook("keras_hub.src.models.qwen3_moe.qwen3_moe_decoder.compute_load_balancing_loss",
         "keras_hub", "replaced", (_I + "keras_hub_moe_loss",),
         "the MoE load-balancing loss over every replica's tokens",
         "b66298cb8e66e6c3ab93bbd861e9cb0766a820afc260ce01044914a260f62e11",
         tests=("tests/distribution/test_keras_hub.py",)),
    Hook("keras_hub.src.models.gemma.gemma_attention.CachedGemmaAttention._compute_attention",
         "keras_hub", "mirrored", _ATTENTION, "computed again on a device's heads",
         "42f069d8da99ba7069cc4f1c5d764b7e46f29e138f8006916c747766474721bd",
         tests=_ATTENTION_TESTS),
    Hook("keras_hub.src.models.llama.llama_attention.LlamaAttention._compute_attention",
         "keras_hub", "relied on", _ATTENTION, "runs on a device's heads as written",
         "a03c2791a8626c61bb61dbc47fb6423bc97351ea66f0caa9cd65a1278e9652c3",
         tests=_ATTENTION_TESTS),
    Hook("keras_hub.src.models.llama.llama_attention.LlamaAttention._masked_softmax",
         "keras_hub", "relied on", _ATTENTION, "runs on a device's heads as written",
         "6dc0c0c2dc9cadc378bd43f6e4cc3175a52155ae299706a6805a1152198b56b4",
         tests=_ATTENTION_TESTS),
    # -- TensorFlow: MirroredExtended, overridden by tfdist's strategies' extendeds -----
    Hook(f"{_MIRRORED_EXTENDED}._call_for_each_replica", "tensorflow", "overridden",
         _EXTENDEDS + (_I + "even_steps",),
         "Keras steps evened out over uneven replicas (also wrapped per MultiWorkerStrategy)",
         "8e5d38916ea6111446b2d8f48258c76e3235049574b6693f1c11279e10f12570",
         tests=("tests/strategies/test_partial_batches.py",) + _MESH_TESTS),
    Hook(f"{_MIRRORED_EXTENDED}._use_merge_call", "tensorflow", "overridden", _EXTENDEDS,
         "no merge call while tfdist updates variables in cross-replica context",
         "c8f218081f251682058ace6414aed382b3c46ee6ce7811a67400b347aed17953",
         tests=_SEAM_TESTS),
    Hook(f"{_MIRRORED_EXTENDED}._create_variable", "tensorflow", "overridden", _EXTENDEDS,
         "sharded variables: component i is shard i of the global initial value",
         "3245e44cf40f661f2bfbe34af2218e06ed23562a8c6b53a75227d9b86bf362bb", tests=_MESH_TESTS),
    Hook(f"{_MIRRORED_EXTENDED}._update", "tensorflow", "overridden", _EXTENDEDS,
         "each component updated from its routed gradient (averaged every K steps)",
         "041aff50897dc7fa3cf74b5c4d06fbfab85115a322819491519f53f5224b5779",
         tests=_MESH_TESTS + ("tests/strategies/test_averaging.py",)),
    Hook(f"{_MIRRORED_EXTENDED}._batch_reduce_to", "tensorflow", "overridden",
         (_I + "horovod_replicas", _I + "model_averaging"),
         "reductions by Horovod; each replica keeps its own gradient (local SGD)",
         "13d47cf062069e5f5379748605566a77767ad1e60ca2c8b4de41fd68041e856d",
         tests=("tests/cluster/test_horovod.py", "tests/strategies/test_averaging.py")),
    Hook(f"{_MIRRORED_EXTENDED}._reduce_to", "tensorflow", "overridden",
         (_I + "horovod_replicas",), "reductions by Horovod over the ranks",
         "3ae47c98951671d27e14ad1b64ceafa76f10434c0c3670ce454b20efeef7f301",
         tests=("tests/cluster/test_horovod.py",)),
    Hook(f"{_MIRRORED_EXTENDED}._num_replicas_in_sync", "tensorflow", "overridden",
         (_I + "horovod_replicas",), "one replica per Horovod rank",
         "118b3aa55a32bfafc16850ea51756c94613c5e32a3624d3dee6c83749d86da0f",
         tests=("tests/cluster/test_horovod.py",)),
    Hook(f"{_MIRRORED_EXTENDED}._experimental_distribute_dataset", "tensorflow", "overridden",
         (_I + "horovod_replicas",), "each rank its slice of every global batch",
         "abb8f33f3bf4e2915f6a717f5d3e0d7a7c7f5024ddb08cb476650b351cbfd06d",
         tests=("tests/cluster/test_horovod.py",)),
    Hook(f"{_MIRRORED_EXTENDED}._default_device", "tensorflow", "set",
         (_I + "single_controller",),
         "a mesh over workers leaves its scope's eager ops and resources on the controller",
         "8f6d688b1f1a535bdf24bf6c7ca05a3f2e5582f87fca8461f338b1f6673dd257",
         source=f"{_MIRRORED_EXTENDED}._initialize_multi_worker",
         tests=("tests/cluster/test_mesh_over_workers.py",)),
    Hook("tensorflow.python.distribute.mirrored_strategy.MirroredStrategy._collective_key_base",
         "tensorflow", "set", ("tfdist.strategies.mesh_strategy", "tfdist.strategies.horovod",
                             "tfdist.strategies.averaging"),
         "tfdist's strategies give MirroredExtended the collective key base it reads",
         "d4cd84cc71cdbd97054b1cacf688e1f809f411ce6b87565dae4811324a9a8ac3",
         source=f"{_MIRRORED_EXTENDED}.__init__", tests=_MESH_TESTS),
    # -- TensorFlow: MirroredVariable, overridden by ShardedVariable -----------------
    Hook(f"{_MIRRORED_VARIABLE}._get", "tensorflow", "overridden", (_I + "shard_routing",),
         "a replica reads its shard, or the whole weight gathered (LayoutMap)",
         "a990d39f234f59e6061c5cd2c0954f12d99a2cbeee36b07c24c451a8d196714b", tests=_MESH_TESTS),
    Hook(f"{_MIRRORED_VARIABLE}._get_cross_replica", "tensorflow", "overridden",
         (_I + "shard_routing", _I + "horovod_replicas"),
         "read outside a replica: the global tensor assembled from the shards",
         "e3104bd6bb6cdea66c58ad587388aa855c22685d60f727177f9a302250b6dcd7", tests=_MESH_TESTS),
    Hook(f"{_MIRRORED_VARIABLE}.value", "tensorflow", "overridden", (_I + "shard_routing",),
         "reads as `_get` (the shard, or the gathered weight)",
         "5363ffd587fccf379ed508e869bf71e07c43a110bd1f86bf77cb141f6088e88a", tests=_MESH_TESTS),
    Hook(f"{_MIRRORED_VARIABLE}.read_value", "tensorflow", "overridden",
         (_I + "shard_routing",), "reads as `_get` (the shard, or the gathered weight)",
         "19415e5c59f7248a138df834ca1761e0c333cafce2fbb93b80a8243fabda6a83", tests=_MESH_TESTS),
    Hook(f"{_MIRRORED_VARIABLE}._dense_var_to_tensor", "tensorflow", "overridden",
         (_I + "shard_routing",), "converts as `_get` reads",
         "746fe6d7ac8fdcb67b0dee5ad5d84d2cfdb8c514215666ab6e4832877eaa54d0", tests=_MESH_TESTS),
    Hook(f"{_MIRRORED_VARIABLE}._update_cross_replica", "tensorflow", "overridden",
         (_I + "shard_routing",), "a global value assigned is split into shards",
         "6aab75ee5794aeec8e908baf711f1e856669961267476c2c119120d489b352d3", tests=_MESH_TESTS),
    Hook(f"{_MIRRORED_VARIABLE}._update_replica", "tensorflow", "overridden",
         (_I + "shard_routing",), "a replica updates its own shard",
         "60252fff9613fb400b668f8bde799f4bc8deed537b00f0652d44f266ec6c7939", tests=_MESH_TESTS),
    Hook(f"{_MIRRORED_VARIABLE}._serialize_to_tensors", "tensorflow", "overridden",
         (_I + "shard_routing",), "checkpoints save the global tensor, not shard 0",
         "54eba113aec935b7d1ca55542b051412993626259ce0bd0d05c7b3693d48f16b",
         tests=("tests/strategies/test_checkpoints.py",)),
    Hook(f"{_MIRRORED_VARIABLE}._restore_from_tensors", "tensorflow", "overridden",
         (_I + "shard_routing",), "checkpoints restore the global tensor into shards",
         "0597aefed0d339979c79dfc0152ab1b8a35fe48b534e6d990c74e340e6953ad1",
         tests=("tests/strategies/test_checkpoints.py",)),
    # -- TensorFlow: mirrored ----------------------------------------------------------
    Hook("tensorflow.python.ops.stateless_random_ops.stateless_random_uniform", "tensorflow",
         "mirrored", _SLICES, "a shard of the initial value drawn alone",
         "1e640124fe6dc0ea7746a7c7068d46dce2c1535f4f1187ce94525fa95e2c7903",
         tests=_SLICES_TESTS),
    Hook("tensorflow.python.ops.stateless_random_ops.stateless_random_normal", "tensorflow",
         "mirrored", _SLICES, "a shard of the initial value drawn alone",
         "12e7c3983042a3dfcb32cc66fa4a562c5e201d8e743229942009a41a25a712c7",
         tests=_SLICES_TESTS),
    Hook("tensorflow.python.ops.stateless_random_ops.stateless_truncated_normal", "tensorflow",
         "mirrored", _SLICES, "a shard of the initial value drawn alone",
         "78f85fe5fb07a89d1015639e35479ff8fd0365a376d209fcdd3bed0fd3188520",
         tests=_SLICES_TESTS),
    Hook("tensorflow.raw_ops.StatelessRandomUniformV2", "tensorflow", "mirrored", _SLICES,
         "Philox counters of a box of the value (a C++ kernel: checked by value)", None,
         tests=_SLICES_TESTS),
    Hook("tensorflow.raw_ops.StatelessRandomNormalV2", "tensorflow", "mirrored", _SLICES,
         "Philox counters of a box of the value (a C++ kernel: checked by value)", None,
         tests=_SLICES_TESTS),
    Hook("tensorflow.raw_ops.StatelessTruncatedNormalV2", "tensorflow", "mirrored", _SLICES,
         "Philox counters of a box of the value (a C++ kernel: checked by value)", None,
         tests=_SLICES_TESTS),
    # -- a functional model's graph, cut into pipeline stages --------------------------
    Hook("keras.src.ops.node.Node.__init__", "keras", "relied on", (_I + "keras_graph",),
         "a tensor's _keras_history and its operation's _inbound_nodes (the call's arguments)",
         "040f39aadf6f17e349fc70939050031e4c6b861b4282989bd8c66fe4ff247c4a",
         tests=("tests/internal/test_keras_graph.py",)),
    Hook("keras.src.ops.symbolic_arguments.SymbolicArguments.fill_in", "keras", "relied on",
         (_I + "keras_graph",), "a call replayed on the inlined tensors",
         "c63004bedd31717271196ad77a65ba4673b6837027abf515694843fef251e25f",
         tests=("tests/internal/test_keras_graph.py",)),
    Hook("keras_hub.src.models.llama.llama_decoder.LlamaTransformerDecoder.get_config",
         "keras_hub", "mirrored", (_I + "keras_hub_configs",),
         "reads an attribute __init__ never sets: the config built from the attributes",
         "3db7d4c77ff382dfe482fb1d5933a9e5afcbad1434e8d7fcb97e41b87a4ce14e",
         tests=("tests/internal/test_keras_hub_configs.py",)),
)


# -- checking ---------------------------------------------------------------------------

OK, MOVED, MISSING, SKIPPED = "ok", "moved", "missing", "skipped"


@dataclasses.dataclass(frozen=True)
class HookStatus:
    """How one `Hook` compares with the installed package.

    Attributes:
        hook: the hook.
        status: "ok" (the source matches, or exists where it has no
            fingerprint), "moved" (the source differs), "missing" (the target
            or its package is gone) or "skipped" (an optional package, not
            installed).
        installed_sha256: the installed source's sha256, where computed.
        detail: what was found, for the report.
    """

    hook: Hook
    status: str
    installed_sha256: Optional[str] = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in (OK, SKIPPED)


class UpstreamMismatchError(RuntimeError):
    """The installed TF / Keras / keras-hub is not the source tfdist's hooks were written for."""


def _resolve(path: str):
    """The object at dotted `path`: the longest importable module, then attributes
    (classes' through their MRO; a `name.key` past a dict is the key's value)."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = obj[name] if isinstance(obj, dict) else getattr(obj, name)
        return obj
    raise ImportError(f"No module of {path!r} can be imported.")


_TFDIST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _defined_in_tfdist(function) -> bool:
    """Whether `function` is tfdist's (a replacement, even one `functools.wraps` named
    after the upstream function it wraps)."""
    code = getattr(function, "__code__", None)
    return code is not None and os.path.abspath(code.co_filename).startswith(_TFDIST_DIR)


def upstream_function(hook: Hook):
    """The upstream function `hook.sha256` fingerprints, even after tfdist replaced it.

    Raises:
        ImportError, AttributeError, KeyError: the target is gone.
    """
    function = _resolve(hook.fingerprinted)
    if isinstance(function, property):
        function = function.fget
    # Installed: the original tfdist's replacement carries, or its module kept.
    function = getattr(function, "_tfdist_original", function)
    if hook.original is not None and _defined_in_tfdist(function):
        function = _resolve(hook.original)
    return function


def is_installed(package: str) -> bool:
    """Whether `package` can be imported (without importing it)."""
    return importlib.util.find_spec(package) is not None


def installed_version(package: str) -> Optional[str]:
    """`package`'s installed version (its `__version__`), or None when it is not installed."""
    if not is_installed(package):
        return None
    return getattr(importlib.import_module(package), "__version__", "unknown")


def check_hook(hook: Hook) -> HookStatus:
    """`hook` against the installed source."""
    if not is_installed(hook.package):
        if hook.package in OPTIONAL_PACKAGES:
            return HookStatus(hook, SKIPPED, detail=f"{hook.package} is not installed")
        return HookStatus(hook, MISSING, detail=f"{hook.package} is not installed")
    try:
        function = upstream_function(hook)
    except (ImportError, AttributeError, KeyError) as e:
        return HookStatus(hook, MISSING, detail=f"{hook.fingerprinted} not found ({e})")
    if hook.sha256 is None:
        return HookStatus(hook, OK, detail=f"exists; checked by {', '.join(hook.tests)}")
    try:
        digest = sources.source_sha256(function)
    except (OSError, TypeError) as e:
        return HookStatus(hook, MISSING, detail=f"no source for {hook.fingerprinted} ({e})")
    if digest != hook.sha256:
        return HookStatus(hook, MOVED, digest,
                          f"sha256 {digest[:12]}... where {hook.sha256[:12]}... was supported")
    return HookStatus(hook, OK, digest)


def check(hooks: Sequence[Hook] = None) -> List[HookStatus]:
    """Every hook of `hooks` (default: `HOOKS`) against the installed packages.

    `HOOKS` is checked once per process (the installed sources do not change).
    """
    if hooks is None:
        return list(_checked())
    return [check_hook(hook) for hook in hooks]


@functools.cache
def _checked() -> Tuple[HookStatus, ...]:
    return tuple(check_hook(hook) for hook in HOOKS)


def mismatch_message(statuses: Sequence[HookStatus]) -> Optional[str]:
    """The error `verify` raises for `statuses`, or None when every hook matches."""
    import tfdist

    failed = [s for s in statuses if not s.ok]
    if not failed:
        return None
    sentences, pins = [], []
    for package in SUPPORTED_VERSIONS:
        mine = [s for s in failed if s.hook.package == package]
        if not mine:
            continue
        supported = SUPPORTED_VERSIONS[package]
        installed = installed_version(package) or "not installed"
        moved = [s.hook.target for s in mine if s.status == MOVED]
        gone = [s.hook.target for s in mine if s.status == MISSING]
        what = []
        if moved:
            what.append(f"its hooks into {', '.join(moved)} no longer match the installed source")
        if gone:
            what.append(f"{', '.join(gone)} no longer exist{'s' if len(gone) == 1 else ''}")
        sentences.append(f"tfdist {tfdist.__version__} supports {package} {supported} "
                         f"(installed: {installed}): {'; '.join(what)}.")
        pins.append(f"{PIP_NAMES[package]}=={supported}")
    return (" ".join(sentences) + f" Install {' '.join(pins)}, or run `python -m tfdist.check` "
            f"for the full report.")


def verify() -> None:
    """Raises unless every hook of `HOOKS` matches the installed packages.

    Called by every tfdist strategy when it is created, before any hook is
    installed. Cheap after the first call in a process (the result is kept).

    Raises:
        UpstreamMismatchError: naming each package whose hooks moved or are
            gone, its installed and its supported version, and those hooks.
    """
    message = mismatch_message(check())
    if message is not None:
        raise UpstreamMismatchError(message)


# -- the table in words ----------------------------------------------------------------


def markdown_table(hooks: Sequence[Hook] = HOOKS) -> str:
    """`hooks` as the Markdown table of `docs/upstream_hooks.md`."""
    rows = ["| Upstream target | Package | Kind | tfdist module | Why | Checked by |",
            "|---|---|---|---|---|---|"]
    for hook in hooks:
        modules = ", ".join(f"`{m.rsplit('.', 1)[-1]}`" for m in hook.modules)
        checked = "sha256" if hook.sha256 else "exists"
        if hook.source:
            checked += f" of `{hook.source}`"
        checked = "; ".join([checked] + [f"`{t}`" for t in hook.tests])
        rows.append(f"| `{hook.target}` | {hook.package} | {hook.kind} | {modules} | "
                    f"{hook.why} | {checked} |")
    return "\n".join(rows) + "\n"
