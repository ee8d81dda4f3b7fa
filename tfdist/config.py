"""Frozen configurations, validated before anything is built.

Flags (defined only in `scripts/`) become one of these; `validate()` raises a
single clear `ValueError` naming the bad value, before TensorFlow starts.
"""

import dataclasses
import os

from tfdist.mesh import Mesh


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Where a model runs.

    Args:
        mesh_shape: Mesh-TF mesh shape, e.g. `"data:2;model:2"`.
        layout: Mesh-TF layout rules, e.g. `"batch:data;d_ff:model"`.
    """

    mesh_shape: str = "data:1"
    layout: str = ""

    def validate(self) -> "MeshConfig":
        self.mesh()
        return self

    def mesh(self) -> Mesh:
        return Mesh.parse(self.mesh_shape, self.layout)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run of the demo model.

    Args:
        mesh: the `MeshConfig`.
        steps: optimizer steps.
        batch_size: global batch size; must divide by the number of devices.
        learning_rate: Adam learning rate.
        vocab_size, d_model, d_ff, length: model sizes.
        seed: seed of the data and the initial weights.
    """

    mesh: MeshConfig = MeshConfig()
    steps: int = 200
    batch_size: int = 32
    learning_rate: float = 3e-3
    vocab_size: int = 64
    d_model: int = 32
    d_ff: int = 128
    length: int = 8
    seed: int = 0

    def validate(self) -> "TrainConfig":
        mesh = self.mesh.mesh()
        for name in ("steps", "batch_size", "vocab_size", "d_model", "d_ff", "length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer; received {name}={value!r}.")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be positive; received {self.learning_rate!r}.")
        if self.batch_size % mesh.size:
            raise ValueError(
                f"batch_size={self.batch_size} does not divide by the {mesh.size} "
                f"devices of mesh {mesh.shape}; use a multiple of {mesh.size}."
            )
        for name, logical in (("vocab_size", "vocab"), ("d_model", "d_model"), ("d_ff", "d_ff")):
            axis = mesh.mesh_axis(logical)
            size = mesh.axis_size(axis)
            if getattr(self, name) % size:
                raise ValueError(
                    f"{name}={getattr(self, name)} does not divide by mesh axis "
                    f"{axis!r} of size {size} (layout rule '{logical}:{axis}')."
                )
        return self


@dataclasses.dataclass(frozen=True)
class XCConfig:
    """An extreme-classification run (scripts/train_xc.py).

    Args:
        mesh: where it runs; the rule for `classes` splits the head.
        num_classes: C.
        d_model: feature size (synthetic data) or hidden size (files).
        batch_size: global batch; must divide by the number of devices.
        steps: optimizer steps.
        learning_rate: Adam learning rate.
        label_smoothing: epsilon over the global C.
        sample_rate: class-centre sampling for training (Partial FC); 1.0 = all classes.
        train_file, test_file: XMC/libsvm files; synthetic data when unset.
        eval_examples: held-out examples for top-1/top-5.
        seed: data and initial weights.
        backup_every: with a model directory, a backup (and a resume point)
            every so many steps; 0: one, at the end.
    """

    mesh: MeshConfig = MeshConfig("data:1;model:2", "batch:data;classes:model")
    num_classes: int = 1_000_000
    d_model: int = 256
    batch_size: int = 256
    steps: int = 100
    learning_rate: float = 1e-2
    label_smoothing: float = 0.0
    sample_rate: float = 1.0
    train_file: str = ""
    test_file: str = ""
    eval_examples: int = 2048
    seed: int = 0
    backup_every: int = 0

    def validate(self) -> "XCConfig":
        mesh = self.mesh.mesh()
        for name in ("num_classes", "d_model", "batch_size", "steps", "eval_examples"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer; received {name}={value!r}.")
        every = self.backup_every
        if not isinstance(every, int) or every < 0 or (every and self.steps % every):
            raise ValueError(f"backup_every must be 0 or a positive divisor of steps="
                             f"{self.steps}; received backup_every={every!r}.")
        if self.batch_size % mesh.size:
            raise ValueError(
                f"batch_size={self.batch_size} does not divide by the {mesh.size} "
                f"devices of mesh {mesh.shape}; use a multiple of {mesh.size}."
            )
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1); received {self.label_smoothing!r}.")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1]; received {self.sample_rate!r}.")
        for name in ("train_file", "test_file"):
            path = getattr(self, name)
            if path and not os.path.exists(path):
                raise ValueError(f"{name}={path!r} does not exist.")
        if bool(self.train_file) != bool(self.test_file):
            raise ValueError("Give both train_file and test_file, or neither (synthetic data).")
        return self


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes and options of a `Transformer` (plain data; `validate()` checks it)."""

    REMAT = ("none", "full", "selective")
    SEQUENCE_METHODS = ("ring", "ulysses")

    vocab_size: int
    d_model: int = 256
    num_heads: int = 4
    d_kv: int = 64
    d_ff: int = 1024
    num_encoder_layers: int = 3
    num_decoder_layers: int = 3
    max_length: int = 64
    dropout: float = 0.1
    positions: str = "sinusoidal"
    share_embeddings: bool = True
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_group_size: int = 64
    moe_capacity_factor: float = 1.25
    moe_aux_loss_coef: float = 1e-2
    moe_routing: str = "token_choice"  # or "expert_choice" (encoder-only: not causal)
    moe_dropless: bool = False
    moe_shared_d_ff: int = 0
    # Recomputation in the backward pass (`tfdist.remat`), Megatron's granularities:
    # "full" recomputes each block from its input, "selective" the attention core.
    remat: str = "none"
    # Attention over a sequence the layout splits (`length:<axis>`): "ring" (key/value
    # blocks travel around the axis) or "ulysses" (all-to-all to split heads).
    sequence_method: str = "ring"

    def check_sequence_split(self, parts: int, axis: str, length: int = 0,
                             head_shards: int = 1, method: str = "") -> None:
        """Raises ValueError where sequences of `length` tokens (0: `max_length`, which a
        split pads every batch to) cannot split over the `parts` devices of mesh axis
        `axis`: zig-zag chunks that do not divide them, MoE groups that do not divide a
        chunk, attention dropout, Ulysses (`method`, default the config's) over heads that
        do not divide (each device's `num_heads / head_shards`)."""
        name, value = ("length", length) if length else ("max_length", self.max_length)
        heads = self.num_heads // head_shards
        if (method or self.sequence_method) == "ulysses" and heads % parts:
            raise ValueError(
                f"sequence_method='ulysses' splits each device's {heads} heads over mesh axis "
                f"{axis!r} of {parts} devices, which does not divide them; use ring or a "
                f"num_heads that does.")
        if value % (2 * parts):
            raise ValueError(
                f"{name}={value} does not split into 2 x {parts} zig-zag chunks over mesh axis "
                f"{axis!r} (the layout's length:{axis}); use a multiple of {2 * parts}.")
        chunk = value // (2 * parts)
        if self.moe_experts and chunk % self.moe_group_size:
            raise ValueError(
                f"moe_group_size={self.moe_group_size} does not divide the {chunk} tokens of a "
                f"zig-zag chunk ({name}={value} over 2 x {parts} chunks on mesh axis {axis!r}), "
                f"so the MoE's groups would not be one device's; use a moe_group_size that "
                f"divides {chunk}.")
        if self.dropout:
            raise ValueError(
                f"dropout={self.dropout}: attention dropout over a sequence split on mesh axis "
                f"{axis!r} is not supported (one device's masks cannot be reproduced block by "
                f"block); use dropout=0 with length:{axis}.")

    def validate(self) -> "TransformerConfig":
        for name in ("vocab_size", "d_model", "num_heads", "d_kv", "d_ff", "max_length",
                     "moe_group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer; received {name}={value!r}.")
        for name in ("num_encoder_layers", "num_decoder_layers", "moe_experts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; received {getattr(self, name)!r}.")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1); received dropout={self.dropout!r}.")
        if self.positions not in ("sinusoidal", "learned"):
            raise ValueError(f"positions must be 'sinusoidal' or 'learned'; received "
                             f"positions={self.positions!r}.")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k must be from 1 to moe_experts={self.moe_experts}; "
                             f"received moe_top_k={self.moe_top_k!r}.")
        if self.moe_routing not in ("token_choice", "expert_choice"):
            raise ValueError(f"moe_routing must be 'token_choice' or 'expert_choice'; "
                             f"received moe_routing={self.moe_routing!r}.")
        if self.moe_experts and self.moe_routing == "expert_choice":
            if self.num_decoder_layers > 1:  # blocks 1, 3, ... are MoE
                raise ValueError(
                    f"moe_routing='expert_choice' is not causal (each expert picks among all "
                    f"tokens of a group), and the decoder's blocks 1, 3, ... are MoE "
                    f"(num_decoder_layers={self.num_decoder_layers}); use "
                    f"moe_routing='token_choice'.")
            if self.moe_dropless:
                raise ValueError("moe_dropless is token-choice routing; received "
                                 "moe_routing='expert_choice'.")
        if not isinstance(self.moe_shared_d_ff, int) or self.moe_shared_d_ff < 0:
            raise ValueError(f"moe_shared_d_ff must be an integer >= 0; received "
                             f"{self.moe_shared_d_ff!r}.")
        if self.remat not in self.REMAT:
            raise ValueError(f"remat must be one of {list(self.REMAT)}; received "
                             f"remat={self.remat!r}.")
        if self.sequence_method not in self.SEQUENCE_METHODS:
            raise ValueError(f"sequence_method must be one of {list(self.SEQUENCE_METHODS)}; "
                             f"received sequence_method={self.sequence_method!r}.")
        for name in ("share_embeddings", "moe_dropless"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; received "
                                 f"{name}={getattr(self, name)!r}.")
        return self


@dataclasses.dataclass(frozen=True)
class NMTConfig:
    """A translation run (scripts/train_nmt.py).

    Args:
        mesh: where it runs; rules for `heads`, `d_ff`, `vocab`, `experts`.
        model: the `TransformerConfig` (its `vocab_size` is the tokenizer's).
        corpus: built-in corpus `numbers-de` or `numbers-fr`, used unless
            `train_src`/`train_tgt` or `train_tsv` are given.
        train_src, train_tgt, test_src, test_tgt: line-aligned text files.
        train_tsv, test_tsv: `source<TAB>target` files.
        num_train, num_test: sizes of the built-in corpus.
        spm_model: a SentencePiece `.model` to load instead of training one.
        vocab_size: SentencePiece vocabulary to train (rounded to a multiple
            of the vocabulary's mesh axis).
        max_tokens: tokens (batch * padded length) per global batch.
        steps, eval_every: optimizer steps; BLEU/checkpoint every so many.
        learning_rate_scale, warmup_steps: `InverseSqrtSchedule`, or with
            `schedule="constant"` a constant `learning_rate_scale * 1e-3`.
        label_smoothing: epsilon of the loss.
        beam_size, alpha: decoding for BLEU (beam 1 = greedy).
        eval_sentences: held-out sentences translated at each evaluation.
        seed: data order and initial weights.
        num_microbatches, pipeline_schedule, pipeline_chunks: the pipeline,
            when the layout maps `layers` onto a stage axis (`pipeline_plan`).
    """

    mesh: MeshConfig = MeshConfig("data:1;model:1", "batch:data;heads:model;d_ff:model;vocab:model")
    model: TransformerConfig = None
    corpus: str = "numbers-de"
    train_src: str = ""
    train_tgt: str = ""
    test_src: str = ""
    test_tgt: str = ""
    train_tsv: str = ""
    test_tsv: str = ""
    num_train: int = 20_000
    num_test: int = 500
    spm_model: str = ""
    vocab_size: int = 256
    max_tokens: int = 2048
    steps: int = 2000
    eval_every: int = 500
    learning_rate_scale: float = 2.0
    warmup_steps: int = 400
    schedule: str = "inverse_sqrt"
    label_smoothing: float = 0.1
    beam_size: int = 4
    alpha: float = 0.6
    eval_sentences: int = 200
    seed: int = 0
    num_microbatches: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_chunks: int = 1

    CORPORA = ("numbers-de", "numbers-fr")
    SCHEDULES = ("inverse_sqrt", "constant")

    def pipeline_plan(self):
        """The checked `PipelinePlan` when the layout maps `layers` (the encoder's
        then the decoder's blocks) onto a stage axis, else None."""
        from tfdist.pipeline.layout import PipelinePlan

        mesh = self.mesh.mesh()
        if mesh.mesh_axis("layers") is None:
            if self.num_microbatches != 1 or self.pipeline_chunks != 1:
                raise ValueError(f"num_microbatches={self.num_microbatches} and pipeline_chunks="
                                 f"{self.pipeline_chunks} need a stage axis: map 'layers' onto "
                                 f"one in the layout (e.g. 'layers:stage').")
            return None
        model = self.model or TransformerConfig(vocab_size=self.vocab_size)
        return PipelinePlan.from_mesh(
            mesh, None, model.num_encoder_layers + model.num_decoder_layers,
            self.num_microbatches, self.pipeline_schedule, self.pipeline_chunks)

    def sequence_split(self) -> int:
        """Devices the layout splits `length` over (1: none), checked: sequences are then
        padded to `max_length` (one static length: ring and Ulysses attention blocks
        are sized when traced), which zig-zag chunks must divide; attention dropout
        is refused over a split sequence."""
        mesh = self.mesh.mesh()
        axis = mesh.mesh_axis("length")
        parts = mesh.axis_size(axis) if axis is not None else 1
        if parts == 1:
            return 1
        (self.model or TransformerConfig(vocab_size=self.vocab_size)).check_sequence_split(
            parts, axis, head_shards=mesh.axis_size(mesh.mesh_axis("heads")))
        return parts  # (a stage axis beside it: pipeline_plan refuses the mesh)

    def validate(self) -> "NMTConfig":
        self.mesh.validate()
        (self.model or TransformerConfig(vocab_size=self.vocab_size)).validate()
        for name in ("num_train", "vocab_size", "max_tokens", "steps", "eval_every", "beam_size",
                     "eval_sentences", "warmup_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer; received {name}={value!r}.")
        mesh = self.mesh.mesh()
        model = self.model or TransformerConfig(vocab_size=self.vocab_size)
        for logical, name in (("heads", "num_heads"), ("d_ff", "d_ff"), ("experts", "moe_experts")):
            size, shards = getattr(model, name), mesh.axis_size(mesh.mesh_axis(logical))
            if size and size % shards:
                raise ValueError(
                    f"{name}={size} does not divide by the {shards} devices of mesh axis "
                    f"{mesh.mesh_axis(logical)!r} that the layout splits {logical!r} over; use a "
                    f"multiple of {shards}.")
        self.sequence_split()
        if self.eval_every > self.steps:
            raise ValueError(f"eval_every={self.eval_every} exceeds steps={self.steps}.")
        if self.corpus not in self.CORPORA:
            raise ValueError(f"corpus must be one of {list(self.CORPORA)}; received "
                             f"{self.corpus!r} (or give --train_src/--train_tgt or --train_tsv).")
        if self.schedule not in self.SCHEDULES:
            raise ValueError(f"schedule must be one of {list(self.SCHEDULES)}; received "
                             f"{self.schedule!r}.")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1); received {self.label_smoothing!r}.")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0; received {self.alpha!r}.")
        self.pipeline_plan()
        if bool(self.train_src) != bool(self.train_tgt) or bool(self.test_src) != bool(self.test_tgt):
            raise ValueError("Give --train_src with --train_tgt and --test_src with --test_tgt.")
        if (self.train_src or self.train_tsv) and not (self.test_src or self.test_tsv):
            raise ValueError("Training files need held-out files too: --test_src/--test_tgt or "
                             "--test_tsv.")
        for name in ("train_src", "train_tgt", "test_src", "test_tgt", "train_tsv", "test_tsv",
                     "spm_model"):
            path = getattr(self, name)
            if path and not os.path.exists(path):
                raise ValueError(f"--{name}={path!r} does not exist.")
        return self
