"""Trains the NMT Transformer on a device mesh and reports held-out BLEU.

    python scripts/train_nmt.py --mesh_shape='data:2;model:2' \
        --layout='batch:data;heads:model;d_ff:model;vocab:model;experts:model' \
        --moe_experts=4 --steps=2000 --model_dir=/tmp/nmt

Data: the built-in English -> German/French number-words corpus (--corpus,
no network; the held-out numbers never occur in training) or parallel text
files (--train_src/--train_tgt/--test_src/--test_tgt, or --train_tsv/
--test_tsv). A SentencePiece model is trained on the training text (or
loaded with --spm_model). Every --eval_every steps: held-out BLEU (sacrebleu,
beam search; character BLEU for the German number words, which are one word
each) and exact-match rate, tokens/s, TensorBoard scalars, an atomic global checkpoint
(resumed from automatically). Writes the resolved flags (usable as
--flagfile) and config to --model_dir. Bad flag values exit with one line.
"""

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from tfdist.config import MeshConfig, NMTConfig, TransformerConfig  # noqa: E402
from flag_utils import (define_checkpoint_flags,  # noqa: E402
                        define_cluster_flags, define_plan_flags, devices_from_flags,
                        devices_to_plan, parse_bytes, run, strategy_from_flags,
                        use_plan, validate_mesh_flags)

FLAGS = flags.FLAGS


def define_flags():
    run, model = NMTConfig(), TransformerConfig(vocab_size=1)
    flags.DEFINE_string("mesh_shape", run.mesh.mesh_shape, "Mesh-TF mesh shape.")
    flags.DEFINE_string("layout", run.mesh.layout,
                        "Mesh-TF layout rules, or 'auto': the planner picks the mesh shape and "
                        "rules over --mesh_shape's devices (scripts/plan.py prints its table).")
    flags.DEFINE_string("corpus", run.corpus, f"Built-in corpus: {list(NMTConfig.CORPORA)}.")
    for name in ("train_src", "train_tgt", "test_src", "test_tgt", "train_tsv", "test_tsv",
                 "spm_model"):
        flags.DEFINE_string(name, "", f"Path ({name.replace('_', ' ')}).")
    flags.DEFINE_integer("num_train", run.num_train, "Built-in corpus: training pairs.")
    flags.DEFINE_integer("num_test", run.num_test, "Built-in corpus: held-out pairs.")
    flags.DEFINE_integer("vocab_size", run.vocab_size, "SentencePiece vocabulary to train.")
    for name in ("d_model", "num_heads", "d_kv", "d_ff", "num_encoder_layers",
                 "num_decoder_layers", "max_length", "moe_experts", "moe_top_k",
                 "moe_group_size"):
        flags.DEFINE_integer(name, getattr(model, name), f"Transformer {name}.")
    flags.DEFINE_enum("moe_routing", model.moe_routing, ["token_choice", "expert_choice"],
                      "MoE routing (expert choice: encoder-only models).")
    flags.DEFINE_boolean("moe_dropless", model.moe_dropless, "MoE drops no token.")
    flags.DEFINE_integer("moe_shared_d_ff", model.moe_shared_d_ff,
                         "Hidden size of the MoE's shared (always-on) experts; 0: none.")
    flags.DEFINE_float("dropout", model.dropout, "Dropout rate.")
    flags.DEFINE_enum("remat", model.remat, list(TransformerConfig.REMAT),
                      "Recompute in the backward pass: each block (full) or the "
                      "attention cores (selective).")
    flags.DEFINE_enum("sequence_method", model.sequence_method,
                      list(TransformerConfig.SEQUENCE_METHODS),
                      "Attention over a sequence the layout splits (length:<axis>): ring "
                      "(key/value blocks travel around the axis) or ulysses (all-to-all to "
                      "split heads).")
    flags.DEFINE_enum("positions", model.positions, ["sinusoidal", "learned"], "Positions.")
    flags.DEFINE_boolean("share_embeddings", model.share_embeddings,
                         "One embedding for source and target.")
    flags.DEFINE_integer("max_tokens", run.max_tokens, "Tokens per global batch.")
    flags.DEFINE_integer("steps", run.steps, "Optimizer steps.")
    flags.DEFINE_integer("eval_every", run.eval_every, "Evaluate and checkpoint every N steps.")
    flags.DEFINE_enum("schedule", run.schedule, list(NMTConfig.SCHEDULES), "Learning rate.")
    flags.DEFINE_float("learning_rate_scale", run.learning_rate_scale,
                       "Scale of the inverse-sqrt schedule (constant: scale * 1e-3).")
    flags.DEFINE_integer("warmup_steps", run.warmup_steps, "Linear warm-up steps.")
    flags.DEFINE_float("label_smoothing", run.label_smoothing, "Label smoothing.")
    flags.DEFINE_integer("beam_size", run.beam_size, "Beam size for BLEU (1: greedy).")
    flags.DEFINE_float("alpha", run.alpha, "GNMT length penalty.")
    flags.DEFINE_integer("eval_sentences", run.eval_sentences, "Held-out sentences per BLEU.")
    flags.DEFINE_integer("seed", run.seed, "Seed.")
    flags.DEFINE_integer("num_microbatches", run.num_microbatches,
                         "Pipeline (a layout with 'layers:<stage axis>'): micro-batches per step.")
    flags.DEFINE_enum("pipeline_schedule", run.pipeline_schedule,
                      ["gpipe", "1f1b", "interleaved_1f1b"], "Pipeline schedule.")
    flags.DEFINE_integer("pipeline_chunks", run.pipeline_chunks,
                         "Pipeline: virtual stages per device (interleaved_1f1b).")
    flags.DEFINE_boolean("xla", True, "jit_compile the training step where TF can.")
    flags.DEFINE_string("model_dir", None, "Config, checkpoints, tokenizer, TensorBoard logs.")
    validate_mesh_flags(allow_auto=True)
    define_plan_flags()
    define_cluster_flags()
    define_checkpoint_flags()


def model_config_from_flags(vocab_size=None) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=vocab_size or FLAGS.vocab_size, d_model=FLAGS.d_model, num_heads=FLAGS.num_heads,
        d_kv=FLAGS.d_kv, d_ff=FLAGS.d_ff, num_encoder_layers=FLAGS.num_encoder_layers,
        num_decoder_layers=FLAGS.num_decoder_layers, max_length=FLAGS.max_length,
        dropout=FLAGS.dropout, positions=FLAGS.positions,
        share_embeddings=FLAGS.share_embeddings, moe_experts=FLAGS.moe_experts,
        moe_top_k=FLAGS.moe_top_k, moe_group_size=FLAGS.moe_group_size,
        moe_routing=FLAGS.moe_routing, moe_dropless=FLAGS.moe_dropless,
        moe_shared_d_ff=FLAGS.moe_shared_d_ff, remat=FLAGS.remat,
        sequence_method=FLAGS.sequence_method)


def config_from_flags() -> NMTConfig:
    return NMTConfig(
        mesh=MeshConfig(FLAGS.mesh_shape, FLAGS.layout), model=model_config_from_flags(),
        corpus=FLAGS.corpus,
        train_src=FLAGS.train_src, train_tgt=FLAGS.train_tgt, test_src=FLAGS.test_src,
        test_tgt=FLAGS.test_tgt, train_tsv=FLAGS.train_tsv, test_tsv=FLAGS.test_tsv,
        num_train=FLAGS.num_train, num_test=FLAGS.num_test, spm_model=FLAGS.spm_model,
        vocab_size=FLAGS.vocab_size, max_tokens=FLAGS.max_tokens, steps=FLAGS.steps,
        eval_every=FLAGS.eval_every, learning_rate_scale=FLAGS.learning_rate_scale,
        warmup_steps=FLAGS.warmup_steps, schedule=FLAGS.schedule,
        label_smoothing=FLAGS.label_smoothing, beam_size=FLAGS.beam_size, alpha=FLAGS.alpha,
        eval_sentences=FLAGS.eval_sentences, seed=FLAGS.seed,
        num_microbatches=FLAGS.num_microbatches, pipeline_schedule=FLAGS.pipeline_schedule,
        pipeline_chunks=FLAGS.pipeline_chunks).validate()


def plan_from_flags():
    """The planner's ranking over the devices of --mesh_shape, for this script's model.

    The model as the flags give it, its vocabulary rounded up as the tokenizer
    rounds it on any mesh of those devices; a step of the most rows of
    --max_length tokens that --max_tokens holds (rounded down to a multiple of
    the devices); --memory_per_device bounds each device.
    """
    import math

    from tfdist.planner import plan

    devices = devices_to_plan()
    multiple = math.lcm(8, devices)
    vocab = -(-FLAGS.vocab_size // multiple) * multiple
    rows = max(devices, FLAGS.max_tokens // FLAGS.max_length // devices * devices)
    return plan(model_config_from_flags(vocab), devices, global_batch=rows,
                length=FLAGS.max_length, memory_per_device=parse_bytes(FLAGS.memory_per_device))


def resolved_flags() -> str:
    """This script's flags (and the shared cluster flags), one `--name=value` per line."""
    mine = (sys.argv[0], os.path.abspath(sys.argv[0]), "__main__", "flag_utils")
    lines = [flag.serialize() for module, defined in FLAGS.flags_by_module_dict().items()
             if module in mine or module.endswith("flag_utils.py") for flag in defined
             if flag.value is not None and flag.name != "flagfile"]
    return "\n".join(sorted(set(lines))) + "\n"


def load_pairs(config: NMTConfig):
    """(train pairs, held-out pairs) of the files or of the built-in corpus."""
    from tfdist.data import nmt

    if config.train_tsv or config.train_src:
        train = nmt.read_tsv(config.train_tsv) if config.train_tsv else \
            nmt.read_parallel(config.train_src, config.train_tgt)
        test = nmt.read_tsv(config.test_tsv) if config.test_tsv else \
            nmt.read_parallel(config.test_src, config.test_tgt)
        return train, test
    corpus = nmt.number_corpus(config.corpus.split("-")[1], num_train=config.num_train,
                               num_test=config.num_test, seed=config.seed)
    return list(corpus.train), list(corpus.test)


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        if FLAGS.layout == "auto":
            use_plan(plan_from_flags(), "train_nmt")
        config = config_from_flags()
        mesh = config.mesh.mesh()
        plan = config.pipeline_plan()
        if plan is None:
            strategy, devices = strategy_from_flags(mesh), None
        else:  # the pipeline places its stages itself, outside any strategy
            import tensorflow as tf

            strategy, devices = tf.distribute.get_strategy(), devices_from_flags(mesh)
        train_pairs, test_pairs = load_pairs(config)
    except (ValueError, FileNotFoundError) as e:
        raise app.UsageError(str(e)) from None

    import keras

    from tfdist import checkpoint
    from tfdist.callbacks import BackupAndRestore, is_chief
    from tfdist.data import nmt
    from tfdist.models import InverseSqrtSchedule, SequenceCrossentropy, Transformer
    from tfdist.models.nmt_eval import NMTEvaluation, TokenCount
    from tfdist.testing.memory import device_bytes

    chief = is_chief(strategy)
    model_dir = FLAGS.model_dir or tempfile.mkdtemp(prefix="tfdist_nmt_")
    os.makedirs(model_dir, exist_ok=True)
    vocab_shards = mesh.axis_size(mesh.mesh_axis("vocab"))
    try:
        if config.spm_model:
            tokenizer = nmt.load_tokenizer(config.spm_model)
        else:
            texts = [s for pair in train_pairs for s in pair]
            where = model_dir if chief else tempfile.mkdtemp()  # one writer per directory
            tokenizer = nmt.train_tokenizer(texts, os.path.join(where, "spm"),
                                            vocab_size=config.vocab_size,
                                            vocab_multiple=max(8, vocab_shards), seed=config.seed)
        if tokenizer.vocab_size % vocab_shards:
            raise ValueError(f"--spm_model has {tokenizer.vocab_size} pieces, which do not split "
                             f"over the {vocab_shards} devices of the vocabulary's mesh axis.")
        model_config = dataclasses.replace(config.model, vocab_size=tokenizer.vocab_size)
        replicas = strategy.num_replicas_in_sync if plan is None else plan.num_replicas
        # MoE groups must divide each replica's tokens: 8 rows x a multiple of 8 positions.
        multiple = replicas * (8 if model_config.moe_experts else 1)
        # Length buckets of 8 positions on every mesh: the collectives take one key per
        # bucket shape (tfdist.comm.shape_keys). A sequence split pads every batch to
        # max_length (its attention is sized when traced) and gives each device its
        # tokens of the batch's rows.
        split = config.sequence_split() > 1
        dataset = nmt.make_dataset(train_pairs, tokenizer, config.max_tokens,
                                   batch_multiple=multiple, max_length=model_config.max_length,
                                   bucket_width=model_config.max_length if split else 8,
                                   seed=config.seed, repeat=True)
        if split:
            from tfdist.sequence import split_sequences

            dataset = split_sequences(dataset, mesh)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    if chief:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({**dataclasses.asdict(config), "model": dataclasses.asdict(model_config)},
                      f, indent=2)
        with open(os.path.join(model_dir, "flags.txt"), "w") as f:  # usable as --flagfile
            f.write(resolved_flags())
        if config.spm_model:
            shutil.copy(config.spm_model, os.path.join(model_dir, "spm.model"))

    keras.utils.set_random_seed(config.seed)
    # --xla compiles where TF can (one device); elsewhere Keras falls back, and says so.
    warnings.filterwarnings("ignore", "Model doesn't support `jit_compile=True`")
    with strategy.scope():
        if plan is None:
            model = Transformer(model_config, name="transformer")
        else:
            from tfdist.models.transformer_pipeline import pipelined_transformer

            model = pipelined_transformer(model_config, plan, devices)
        if config.schedule == "inverse_sqrt":
            rate = InverseSqrtSchedule(model_config.d_model, config.warmup_steps,
                                       config.learning_rate_scale)
        else:
            rate = config.learning_rate_scale * 1e-3
        model.compile(keras.optimizers.Adam(rate, beta_2=0.98, epsilon=1e-9),
                      SequenceCrossentropy(model_config.vocab_size, config.label_smoothing),
                      metrics=[TokenCount()], jit_compile=FLAGS.xla and plan is None)
    if plan is None:
        where = (f"({replicas} replicas); MoE experts {model_config.moe_experts or 'none'}; "
                 f"weights {device_bytes(model):,} bytes on device 0 of "
                 f"{4 * model.count_params():,} (Adam's two slots follow the same layout)")
    else:
        where = (f"({plan.num_stages} stages x {plan.num_replicas} data replicas, "
                 f"{plan.schedule_name}, {plan.num_microbatches} micro-batches); weights per "
                 f"stage {[stage.count_params() for stage in model.stages]}")
    print(f"train_nmt: {len(train_pairs)} training pairs, {len(test_pairs)} held-out; "
          f"vocabulary {tokenizer.vocab_size}; {model.count_params():,} parameters on {mesh} "
          f"{where}", flush=True)

    fmt = checkpoint.format_named(FLAGS.checkpoint_format)
    backup = BackupAndRestore(os.path.join(model_dir, checkpoint.BACKUP_DIR),
                              delete_checkpoint=False,  # translate.py reads the newest
                              checkpoint_format=FLAGS.checkpoint_format)
    done = backup.latest_epoch() + 1  # resumed: continue the data where it stopped
    tokenize = "char" if config.corpus == "numbers-de" and not (config.train_src or
                                                               config.train_tsv) else "13a"
    evaluation = NMTEvaluation(tokenizer, test_pairs[:config.eval_sentences], config.beam_size,
                               config.alpha, tokenize=tokenize)
    callbacks = [backup, evaluation]
    if chief:
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(model_dir, "logs")))
    epochs = config.steps // config.eval_every
    model.fit(dataset.skip(done * config.eval_every), epochs=epochs,
              steps_per_epoch=config.eval_every, verbose=2 if not sys.stdout.isatty() else 1,
              callbacks=callbacks, shuffle=False)  # the dataset shuffles itself
    bleu, _ = evaluation.evaluate() if not evaluation.history else (evaluation.history[-1], None)
    if plan is not None:  # the final weights as a Transformer's: they load onto any mesh
        from tfdist.models.transformer_pipeline import one_device_copy

        model = one_device_copy(model)
    checkpoint.save(model, checkpoint.final_path(model_dir, fmt), with_optimizer=False, fmt=fmt)
    if chief:
        print(f"final held-out BLEU {bleu:.1f} ({tokenize}; {len(evaluation.pairs)} sentences, beam "
              f"{config.beam_size}); config, tokenizer, checkpoint in {model_dir}; TensorBoard: "
              f"tensorboard --logdir {os.path.join(model_dir, 'logs')}", flush=True)
    return 0


if __name__ == "__main__":
    define_flags()
    run(main)
