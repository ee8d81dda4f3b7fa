"""scripts/train_nmt.py and translate.py: a few steps on a 2x2 mesh, outputs, resume, errors."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--d_model=32", "--d_ff=64", "--num_heads=2", "--d_kv=16", "--num_encoder_layers=2",
         "--num_decoder_layers=2", "--max_length=24", "--num_train=1000", "--num_test=20",
         "--eval_sentences=8", "--max_tokens=768", "--vocab_size=128", "--beam_size=2"]
MESH = ["--mesh_shape=data:2;model:2",
        "--layout=batch:data;heads:model;d_ff:model;vocab:model;experts:model"]


@pytest.mark.slow
def test_trains_a_few_steps_writes_outputs_resumes_and_translates(run_script, tmp_path):
    model_dir = tmp_path / "run"
    result = run_script("train_nmt.py", *SMALL, *MESH, "--moe_experts=4", "--moe_group_size=32",
                        "--steps=6", "--eval_every=3", "--checkpoint_format=sharded",
                        f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    # Only the run's own lines: no TF start-up notes, no Keras jit / shuffle warnings.
    assert not result.stderr.strip(), result.stderr[-3000:]
    assert "MoE experts 4" in result.stdout and "(4 replicas)" in result.stdout
    on_device, total = map(lambda n: int(n.replace(",", "")), re.search(
        r"weights ([\d,]+) bytes on device 0 of ([\d,]+)", result.stdout).groups())
    assert on_device < 0.6 * total  # heads, d_ff, vocabulary and experts split over model:2
    assert re.findall(r"epoch (\d): held-out BLEU", result.stdout) == ["1", "2"]  # every 3 steps
    assert "final held-out BLEU" in result.stdout and "tensorboard --logdir" in result.stdout
    files = sorted(os.listdir(model_dir))
    assert files == ["backup", "config.json", "flags.txt", "logs", "model.shards", "spm.model",
                     "spm.vocab"], files
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model"]["moe_experts"] == 4 and config["model"]["vocab_size"] == 128
    assert "--steps=6" in (model_dir / "flags.txt").read_text()
    assert os.listdir(model_dir / "backup") == ["epoch-1.shards"]  # each process's shards
    assert os.listdir(model_dir / "backup" / "epoch-1.shards") == ["gen-1"]
    events = [f for _, _, fs in os.walk(model_dir / "logs") for f in fs if "tfevents" in f]
    assert events

    # Resume: the run is complete, so nothing more is trained (data skipped, no epochs left).
    again = run_script("train_nmt.py", f"--flagfile={model_dir / 'flags.txt'}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "Epoch 1/2" not in again.stdout

    # translate.py loads the 2x2-mesh sharded checkpoint onto another mesh (1x2). (Decoding on one
    # device with XLA: tests/models/test_decoding.py; the suite's time budget.)
    sources = tmp_path / "src.txt"
    sources.write_text("twenty-one\nfour hundred and twelve\n")
    out = subprocess.run([sys.executable, "scripts/translate.py", f"--model_dir={model_dir}",
                          f"--input={sources}", "--mesh_shape=data:1;model:2"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(out.stdout.splitlines()) == 2


@pytest.mark.slow
def test_a_pipelined_transformer_trains_and_translates(run_script, tmp_path):
    """`layers:stage`: the encoder + decoder blocks over 2 stages, 3 micro-batches
    (1F1B); BLEU from a one-device copy of the pipeline's weights."""
    model_dir = tmp_path / "run"
    result = run_script("train_nmt.py", *SMALL, "--mesh_shape=stage:2;data:1",
                        "--layout=layers:stage;batch:data", "--num_microbatches=3",
                        "--steps=4", "--eval_every=2", "--dropout=0.1", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not result.stderr.strip(), result.stderr[-3000:]
    assert "(2 stages x 1 data replicas, 1f1b, 3 micro-batches)" in result.stdout
    assert re.findall(r"epoch (\d): held-out BLEU", result.stdout) == ["1", "2"]
    assert "final held-out BLEU" in result.stdout
    # The final weights are a Transformer's: translate.py loads them onto a mesh.
    sources = tmp_path / "src.txt"
    sources.write_text("twenty-one\n")
    out = subprocess.run([sys.executable, "scripts/translate.py", f"--model_dir={model_dir}",
                          f"--input={sources}", "--mesh_shape=data:1;model:1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(out.stdout.splitlines()) == 1


@pytest.mark.slow
def test_a_sequence_split_transformer_trains_and_translates(run_script, tmp_path):
    """`length:seq`: source and target split over 2 devices (ring attention),
    batches padded to --max_length; BLEU's beam search encodes the sources over
    the split (`Transformer.encode_split`) and decodes with the global weights."""
    model_dir = tmp_path / "run"
    result = run_script("train_nmt.py", *SMALL, "--mesh_shape=data:2;seq:2",
                        "--layout=batch:data;length:seq", "--dropout=0", "--steps=4",
                        "--eval_every=4", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not result.stderr.strip(), result.stderr[-3000:]
    assert "(4 replicas)" in result.stdout
    losses = [float(x) for x in re.findall(r"loss: ([\d.]+)", result.stdout)]
    assert losses and all(x == x for x in losses), result.stdout[-2000:]
    assert "final held-out BLEU" in result.stdout


@pytest.mark.parametrize("flags, fragment", [
    (["--num_heads=3"], "num_heads=3 does not divide by the 2 devices of mesh axis 'model'"),
    (["--corpus=numbers-xx"], "corpus must be one of ['numbers-de', 'numbers-fr']"),
    (["--eval_every=10", "--steps=5"], "eval_every=10 exceeds steps=5"),
    (["--train_src=/nonexistent/a.txt", "--train_tgt=/nonexistent/b.txt",
      "--test_tsv=/nonexistent/t.tsv"], "--train_src='/nonexistent/a.txt' does not exist"),
    (["--label_smoothing=1.5"], "label_smoothing must be in [0, 1)"),
    (["--remat=blocks"], "flag --remat=blocks: value should be one of <none|full|selective>"),
    (["--mesh_shape=data:2;model"], "Malformed mesh shape pair 'model'"),
    (["--checkpoint_format=zip"], "value should be one of <npz|sharded>"),
    (["--layout=auto", "--memory_per_device=lots"], "memory size 'lots' is not a positive number"),
    (["--num_microbatches=2"], "num_microbatches=2 and pipeline_chunks=1 need a stage axis"),
    (["--mesh_shape=stage:3", "--layout=layers:stage"],
     "num_layers=4 does not split over mesh axis stage:3"),
    (["--mesh_shape=seq:2", "--layout=length:seq", "--dropout=0.1"],
     "dropout=0.1: attention dropout over a sequence split on mesh axis 'seq'"),
    (["--mesh_shape=seq:2", "--layout=length:seq", "--dropout=0", "--moe_experts=4",
      "--moe_group_size=4"], "moe_group_size=4 does not divide the 6 tokens of a zig-zag chunk"),
    (["--mesh_shape=seq:4", "--layout=length:seq", "--dropout=0", "--max_length=20"],
     "max_length=20 does not split into 2 x 4 zig-zag chunks"),
    (["--mesh_shape=seq:4", "--layout=length:seq", "--dropout=0", "--sequence_method=ulysses"],
     "sequence_method='ulysses' splits each device's 2 heads over mesh axis 'seq' of 4 devices"),
    (["--mesh_shape=stage:2;seq:2", "--layout=layers:stage;length:seq", "--dropout=0"],
     "Mesh stage:2;seq:2 has axes ['seq'] besides the stage axis 'stage'"),
])
def test_bad_flags_give_one_clear_error(run_script, flags, fragment, assert_one_line_error):
    result = run_script("train_nmt.py", *SMALL, "--mesh_shape=data:1;model:2", "--steps=2",
                        "--eval_every=1", *flags, timeout=300)
    assert_one_line_error(result, fragment)


def test_translate_without_a_model_dir_is_a_clear_error(run_script, tmp_path,
                                                       assert_one_line_error):
    result = run_script("translate.py", f"--model_dir={tmp_path}", timeout=120)
    assert_one_line_error(result, "config.json' does not exist")
