"""Translates text with a model trained by scripts/train_nmt.py.

    echo "four hundred and twelve" | python scripts/translate.py --model_dir=/tmp/nmt
    python scripts/translate.py --model_dir=/tmp/nmt --input=sources.txt --beam_size=4

Reads the run's config.json, tokenizer (spm.model) and global checkpoint
(model.npz, or the newest backup) from --model_dir, builds the model on
--mesh_shape (default: one device, where decoding is XLA-compiled: a
checkpoint from any mesh loads on any other) and writes one translation per
input line to stdout (or --output).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from flag_utils import run, validate_mesh_flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("model_dir", None, "Directory written by train_nmt.py.")
    flags.DEFINE_string("checkpoint", "", "A .npz global checkpoint (default: model_dir's).")
    flags.DEFINE_string("input", "", "File of source sentences (default: stdin).")
    flags.DEFINE_string("output", "", "Where to write translations (default: stdout).")
    flags.DEFINE_integer("beam_size", 4, "Beam size (1: greedy).")
    flags.DEFINE_float("alpha", 0.6, "GNMT length penalty.")
    flags.DEFINE_integer("batch_size", 32, "Sentences per decoding batch.")
    flags.DEFINE_string("mesh_shape", "data:1;model:1", "Mesh to load the model on.")
    flags.DEFINE_string("layout", "batch:data;heads:model;d_ff:model;vocab:model", "Layout.")
    flags.mark_flag_as_required("model_dir")
    validate_mesh_flags()


def checkpoint_path(model_dir: str, explicit: str = "") -> str:
    """`explicit`, else the run's final checkpoint, else its newest backup; raises if none."""
    from tfdist import checkpoint

    if explicit:
        if not os.path.exists(explicit):
            raise FileNotFoundError(f"--checkpoint={explicit!r} does not exist.")
        return explicit
    found = checkpoint.latest(model_dir)
    if found is None:
        raise FileNotFoundError(
            f"No checkpoint in {model_dir!r}: neither {checkpoint.FINAL}.npz / .shards nor "
            f"{checkpoint.BACKUP_DIR}/{checkpoint.BACKUP_PREFIX}N.npz / .shards (did "
            f"train_nmt.py run with this --model_dir?).")
    return found


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)
    config_file = os.path.join(FLAGS.model_dir, "config.json")
    try:
        for path in (config_file, os.path.join(FLAGS.model_dir, "spm.model")):
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path!r} does not exist: --model_dir must be a "
                                        f"directory written by train_nmt.py.")
        if FLAGS.input and not os.path.exists(FLAGS.input):
            raise FileNotFoundError(f"--input={FLAGS.input!r} does not exist.")
        path = checkpoint_path(FLAGS.model_dir, FLAGS.checkpoint)
        from tfdist.mesh import Mesh

        mesh = Mesh.parse(FLAGS.mesh_shape, FLAGS.layout)
    except (ValueError, FileNotFoundError) as e:
        raise app.UsageError(str(e)) from None
    with open(config_file) as f:
        saved = json.load(f)

    from tfdist import checkpoint
    from tfdist.data.nmt import load_tokenizer
    from tfdist.models import Transformer, TransformerConfig
    from tfdist.models.nmt_eval import translate_texts
    from tfdist.strategies import get_strategy
    from tfdist.devices import split_cpu

    tokenizer = load_tokenizer(os.path.join(FLAGS.model_dir, "spm.model"))
    if mesh.size > 1:
        split_cpu(mesh.size)
        strategy = get_strategy("mesh", mesh_shape=mesh)
    else:
        strategy = get_strategy("default")
    config = TransformerConfig(**saved["model"])
    with strategy.scope():
        model = Transformer(config, name="transformer")
    checkpoint.load(model, path, with_optimizer=False)
    lines = open(FLAGS.input).read().splitlines() if FLAGS.input else sys.stdin.read().splitlines()
    out = translate_texts(model, tokenizer, lines, FLAGS.batch_size, FLAGS.beam_size, FLAGS.alpha)
    text = "\n".join(out) + ("\n" if out else "")
    if FLAGS.output:
        with open(FLAGS.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    define_flags()
    run(main)
