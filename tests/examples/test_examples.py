"""Every script in examples/ runs as a user runs it, on small sizes, and does what it says."""

import os
import re
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def run(*command, timeout=600, **env):
    result = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout,
                            cwd=ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def example(name):
    return os.path.join(EXAMPLES, name)


def test_every_example_is_tested_and_listed_in_the_readme():
    tested = {"custom_training_loop.py", "two_workers.py", "million_classes.py",
              "horovod_job.py", "moe_transformer.sh", "finetune_causal_lm.py"}
    shipped = {f for f in os.listdir(EXAMPLES) if f.endswith((".py", ".sh"))}
    assert shipped == tested
    readme = open(os.path.join(EXAMPLES, "README.md")).read()
    assert all(f"`{name}`" in readme for name in shipped)


@pytest.mark.slow
def test_custom_training_loop_equals_one_device():
    steps = 12
    out = run(sys.executable, example("custom_training_loop.py"), f"--steps={steps}",
              "--hidden=64")
    losses = {int(s): float(v) for s, v in re.findall(r"step (\d+): loss (\S+)", out)}
    assert sorted(losses) == [0, 10, 11], out
    assert "4 replicas" in out

    # The same loop with plain Keras on one device (no strategy, nothing of tfdist).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * 64, 32)).astype("float32")
    y = np.sin(x @ rng.normal(size=(32, 8)).astype("float32") / 4)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(8)])
    optimizer = keras.optimizers.Adam(1e-3)
    reference = {}
    for i in range(steps):
        xb, yb = x[i * 64:(i + 1) * 64], y[i * 64:(i + 1) * 64]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        reference[i] = float(loss)
    for i, value in losses.items():
        np.testing.assert_allclose(value, reference[i], rtol=2e-5, err_msg=f"step {i}")


@pytest.mark.slow
def test_two_workers_split_the_model_over_two_processes():
    out = run(sys.executable, "-m", "tfdist.launch", "--num_workers", "2", "--",
              example("two_workers.py"), "--steps=30", "--d_ff=256")
    assert "over ['/job:worker/replica:0/task:0', '/job:worker/replica:0/task:1']" in out, out
    loss, accuracy, held = re.search(
        r"30 steps: loss (\S+), accuracy (\S+); each process holds ([\d,]+) bytes", out).groups()
    # Weights 64x64 + 64x256 + 256 + 256x64 + 64 + 64x64 + 64, Adam's two slots: 3 copies.
    whole = 3 * 4 * (64 * 64 + 64 * 256 + 256 + 256 * 64 + 64 + 64 * 64 + 64)
    assert int(held.replace(",", "")) < 0.55 * whole  # all but two biases split in half
    assert float(loss) < np.log(64) and float(accuracy) > 0.2  # learning the permutation


@pytest.mark.slow
def test_million_classes_example_splits_the_classes_and_learns():
    out = run(sys.executable, example("million_classes.py"), "--num_classes=20000", "--steps=10")
    assert "20,000 classes: kernel (64, 20000) -> (64, 10000) per device" in out
    top1 = float(re.search(r"held-out top-1 (\S+),", out).group(1))
    assert top1 > 0.3, out  # Zipf classes: the frequent ones are learnt in 10 steps


@pytest.mark.slow
def test_finetune_causal_lm_example_fits_raw_strings_and_generates():
    out = run(sys.executable, example("finetune_causal_lm.py"), "--epochs=3", "--examples=128",
              "--sequence_length=24")
    params, held = re.search(r"([\d,]+) parameters on a 2x2 mesh; device 0 holds ([\d,]+) bytes",
                             out).groups()
    whole = 3 * 4 * int(params.replace(",", ""))  # weights and Adam's two slots
    assert int(held.replace(",", "")) < 0.5 * whole, out  # split over the mesh, not copied
    losses = [float(v) for v in re.findall(r" - loss: (\S+)", out)]
    assert len(losses) == 3 and losses[-1] < 0.7 * losses[0], out
    generated = re.search(r"generate\('thirty-six, thirty-seven,'\): '(.*)'", out).group(1)
    assert generated.startswith("thirty-six, thirty-seven,") and len(generated) > 25, out


@pytest.mark.slow
def test_moe_transformer_example_trains_with_train_nmt_flags(tmp_path):
    out = run("bash", example("moe_transformer.sh"), "--steps=4", "--eval_every=2",
              "--num_train=400", "--num_test=8", "--eval_sentences=4", "--d_model=32",
              "--d_ff=64", "--moe_shared_d_ff=32", "--max_tokens=768", "--vocab_size=128",
              "--beam_size=1", "--num_encoder_layers=1", "--num_decoder_layers=1",
              f"--model_dir={tmp_path}", PYTHON=sys.executable)
    assert "MoE experts 8" in out and "(4 replicas)" in out, out
    assert re.findall(r"epoch (\d): held-out BLEU", out) == ["1", "2"]
    assert os.path.exists(tmp_path / "config.json")


@pytest.mark.slow
@pytest.mark.horovod
def test_horovod_job_ranks_agree_with_one_process():
    runner = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or "horovodrun"
    threads = dict(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
                   HOROVOD_GLOO_TIMEOUT_SECONDS="30")
    out = run(runner, "-np", "2", "--gloo", "-H", "localhost:2", sys.executable,
              example("horovod_job.py"), "--steps=20", "--hidden=64", **threads)
    pattern = r"rank (\d) of (\d): 20 steps, .*weight checksum (\S+)"
    ranks = {int(r): (int(n), float(c)) for r, n, c in re.findall(pattern, out)}
    assert sorted(ranks) == [0, 1] and ranks[0] == ranks[1], out  # the same weights
    single = run(sys.executable, example("horovod_job.py"), "--steps=20", "--hidden=64",
                 **threads)
    (_, n, checksum), = re.findall(pattern, single)
    assert n == "1"
    np.testing.assert_allclose(ranks[0][1], float(checksum), rtol=1e-5)
