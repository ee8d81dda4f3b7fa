"""scripts/plan.py and train_nmt.py --layout=auto, run as a user would."""

SMALL = ["--d_model=32", "--d_ff=64", "--num_heads=2", "--d_kv=16", "--num_encoder_layers=2",
         "--num_decoder_layers=2", "--max_length=24", "--max_tokens=768", "--vocab_size=128"]


def test_plan_prints_the_ranked_layouts_and_the_flags(run_script, calibrated):
    result = run_script("plan.py", *SMALL, "--mesh_shape=data:4", "--moe_experts=4",
                        "--memory_per_device=64MiB", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["#", "mesh", "layout", "state"]
    assert " 1  data:4;model:1   batch:data " in result.stdout
    assert "experts:model" in result.stdout and "data:1;model:4" in result.stdout
    assert lines[-1] == "best: --mesh_shape='data:4;model:1' --layout='batch:data'"
    assert "stage:4;data:1   layers:stage;batch:data (1f1b, m=4)" in result.stdout


def test_plan_picks_a_pipeline_where_only_its_stages_fit(run_script, calibrated):
    # data:2 holds 5.7 MiB per device (the whole model and its slots, the batch's
    # activations); 1F1B with 8 micro-batches over 2 stages 1.2 MiB on the heavier
    result = run_script("plan.py", *SMALL, "--mesh_shape=data:2", "--memory_per_device=2MiB",
                        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == (
        "best: --mesh_shape='stage:2;data:1' --layout='layers:stage;batch:data' "
        "--num_microbatches=8 --pipeline_schedule=1f1b")


def test_plan_names_the_least_memory_when_nothing_fits(run_script, calibrated,
                                                       assert_one_line_error):
    result = run_script("plan.py", *SMALL, "--mesh_shape=data:2", "--memory_per_device=1KiB",
                        timeout=300)
    assert_one_line_error(result, "no layout fits in memory_per_device=1,024 bytes; the least "
                                  "any takes is")


def test_train_nmt_layout_auto_trains_on_the_planners_pick(run_script, calibrated, tmp_path):
    result = run_script("train_nmt.py", *SMALL, "--mesh_shape=data:2", "--layout=auto",
                        "--num_train=500", "--num_test=10", "--eval_sentences=4",
                        "--beam_size=1", "--steps=2", "--eval_every=2",
                        f"--model_dir={tmp_path / 'run'}", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train_nmt: --layout=auto chose --mesh_shape='data:2;model:1' " \
           "--layout='batch:data'" in result.stdout
    assert "final held-out BLEU" in result.stdout
    assert "--layout=batch:data" in (tmp_path / "run" / "flags.txt").read_text()


def test_train_nmt_layout_auto_splits_a_long_sequence_that_fits_no_other_way(
        run_script, calibrated, tmp_path):
    """512 tokens a row, 8 MiB a device: the attention scores kept whole (data parallel,
    tensor parallel, a pipeline) do not fit; the plan splits the length (ring), the
    script pads to --max_length, splits every batch and trains."""
    long = [f for f in SMALL if not f.startswith(("--max_length", "--max_tokens"))]
    result = run_script("train_nmt.py", *long, "--max_length=512", "--max_tokens=1024",
                        "--dropout=0", "--mesh_shape=data:2", "--layout=auto",
                        "--memory_per_device=8MiB", "--num_train=200", "--num_test=4",
                        "--eval_sentences=2", "--beam_size=1", "--steps=2", "--eval_every=2",
                        f"--model_dir={tmp_path / 'run'}", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("train_nmt: --layout=auto chose --mesh_shape='data:1;seq:2;model:1' "
            "--layout='batch:data;length:seq' --sequence_method=ring") in result.stdout
    assert "final held-out BLEU" in result.stdout
    flags = (tmp_path / "run" / "flags.txt").read_text()
    assert "--layout=batch:data;length:seq" in flags and "--sequence_method=ring" in flags
