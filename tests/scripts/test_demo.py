"""The demo script runs end to end, and bad flags give one clear error."""

import json

import pytest


@pytest.mark.slow
def test_demo_trains_on_a_2x2_mesh_and_matches_one_device(run_script, tmp_path):
    result = run_script("demo.py", "--steps=10", "--batch_size=16", f"--model_dir={tmp_path}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ffn1_in/kernel: global (32, 128) -> (32, 64) per device (split over model)" in result.stdout
    line = next(l for l in result.stdout.splitlines() if l.startswith("max relative difference"))
    assert float(line.rsplit(" ", 1)[1]) <= 1e-5
    config = json.load(open(tmp_path / "config.json"))
    assert config["mesh"] == {"mesh_shape": "data:2;model:2", "layout": "batch:data;d_ff:model;vocab:model"}
    assert (tmp_path / "model.npz").exists()


@pytest.mark.parametrize(
    "flag, fragment",
    [
        ("--mesh_shape=data:2;model", "Malformed mesh shape pair 'model'"),
        ("--layout=batch:data;dff:model", "Unknown logical axis 'dff'"),
        ("--batch_size=6", "batch_size=6 does not divide by the 4 devices"),
        ("--mesh_shape=data:2;model:3 --batch_size=48",
         "vocab_size=64 does not divide by mesh axis 'model' of size 3"),
    ],
)
def test_bad_flags_exit_with_one_clear_error(run_script, flag, fragment, assert_one_line_error):
    result = run_script("demo.py", *flag.split(), timeout=120)
    assert_one_line_error(result, fragment)
