"""Fine-tune a keras-hub causal LM on raw strings with `ModelParallel`, then generate.

    python examples/finetune_causal_lm.py                        # a small Gemma, 2x2 mesh
    python examples/finetune_causal_lm.py --preset=PATH          # a saved keras-hub preset

keras-hub's everyday flow, unchanged: a `GemmaCausalLM` with its preprocessor
(`GemmaTokenizer`, SentencePiece) compiled and `fit` on a list of strings,
then `generate`. Only the strategy is tfdist's: `ModelParallel` with the layout
map keras-hub ships for Gemma (`GemmaBackbone.get_layout_map`), so every
weight is stored split over the mesh (tensor parallel over `model`, FSDP over
`batch`) and the batch is split over all devices. Without `--preset` the model
is a small Gemma whose tokenizer is trained here on the text (no download);
the text teaches it to count in words: "twenty-one, twenty-two, ...".
"""

import argparse
import io

import tfdist

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--preset", default="", help="A keras-hub Gemma preset (directory or handle).")
parser.add_argument("--mesh", default="2,2", help="batch,model: the mesh's two axis sizes.")
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--examples", type=int, default=512)
parser.add_argument("--sequence_length", type=int, default=32)
args = parser.parse_args()
batch_size, model_size = (int(n) for n in args.mesh.split(","))
tfdist.split_cpu(batch_size * model_size)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from num2words import num2words  # noqa: E402

# Text: runs of four consecutive numbers in words, "forty-one, forty-two, forty-three, forty-four".
rng = np.random.default_rng(0)
text = [", ".join(num2words(int(n) + i) for i in range(4)) for n in rng.integers(1, 99, args.examples)]

devices = [f"cpu:{i}" for i in range(batch_size * model_size)]
mesh = keras.distribution.DeviceMesh((batch_size, model_size), ("batch", "model"), devices)
strategy = tfdist.distribution.ModelParallel(
    layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh), batch_dim_name="batch")

keras.utils.set_random_seed(0)
with strategy.scope():
    if args.preset:
        model = keras_hub.models.GemmaCausalLM.from_preset(args.preset)  # loaded shard by shard
        model.preprocessor.sequence_length = args.sequence_length
    else:
        import sentencepiece

        proto = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            # every run of numbers once, so the vocabulary (48: it divides over the
            # mesh) does not depend on --examples
            sentence_iterator=iter([", ".join(num2words(n + i) for i in range(4))
                                    for n in range(1, 99)]), model_writer=proto,
            vocab_size=48, minloglevel=2,
            model_type="unigram", pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
            eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>")
        tokenizer = keras_hub.models.GemmaTokenizer(proto=proto.getvalue())
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, num_query_heads=4,
            num_key_value_heads=2, hidden_dim=64, intermediate_dim=256, head_dim=16)
        preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(
            tokenizer, sequence_length=args.sequence_length)
        model = keras_hub.models.GemmaCausalLM(backbone, preprocessor)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), sampler="greedy")

from tfdist.testing.memory import device_bytes  # noqa: E402

print(f"{model.count_params():,} parameters on a {batch_size}x{model_size} mesh; device 0 "
      f"holds {device_bytes(model):,} bytes of weights and Adam slots")
history = model.fit(text, batch_size=16, epochs=args.epochs, verbose=2)
prompt = "thirty-six, thirty-seven,"
print(f"generate({prompt!r}): {model.generate([prompt], max_length=16)[0]!r}")
