"""benchmarks/same_behaviour.py: its comparison of two runs' outputs, on synthetic run
directories (no script is launched), and its configuration table."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from scripts_harness import REPO, tiny_sd35_flags

sys.path.insert(0, str(REPO / "benchmarks"))
import same_behaviour as sb  # noqa: E402

CHECKPOINT = "checkpoints/epoch_00001"


def make_run(root: Path, modules_order=("to_q", "to_k", "to_v"), seconds=1.5) -> Path:
    """A run directory as the scripts leave it: metrics, an eval sheet, a checkpoint."""
    run = root / "out" / "grpo_sd35__42__1700000000"
    (run / CHECKPOINT).mkdir(parents=True)
    rows = [{"epoch": 0, "reward/mean": 0.5, "losses/on_policy_ratio_dev": float("nan"),
             "charts/global_step": 2, "perf/epoch_seconds": seconds},
            {"epoch": 1, "reward/mean": 0.625, "losses/on_policy_ratio_dev": 0.0,
             "charts/global_step": 4, "perf/epoch_seconds": 2 * seconds}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    pixels = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)
    Image.fromarray(pixels).save(run / "eval_00000.png")
    generator = torch.Generator().manual_seed(0)
    lora = [torch.randn(2, 3, generator=generator), torch.zeros(3, 2)]
    param = torch.nn.Parameter(lora[0].clone())
    optimizer = torch.optim.AdamW([param])
    param.sum().backward()
    optimizer.step()
    torch.save({"lora": lora, "ema": [t.clone() for t in lora], "extra": {"old": [lora[1].clone()]},
                "optimizer": optimizer.state_dict(), "next_epoch": 1, "global_step": 4,
                "args": {"output_dir": str(root), "resume": None, "learning_rate": 1e-3},
                "script": "grpo_sd35.py"}, run / CHECKPOINT / "state.pt")
    config = json.dumps({"transformer.r": 8, "transformer.target_modules": list(modules_order)})
    for name in ("lora", "ema_lora"):
        (run / CHECKPOINT / name).mkdir()
        save_file({"a.lora_A.weight": lora[0], "a.lora_B.weight": lora[1]},
                  run / CHECKPOINT / name / "pytorch_lora_weights.safetensors",
                  metadata={"format": "pt", "lora_adapter_metadata": config})
    return run


@pytest.fixture
def runs(tmp_path):
    """Two runs of the same code: other directories, timings, hash-seeded module order."""
    return (make_run(tmp_path / "a"),
            make_run(tmp_path / "b", modules_order=("to_v", "to_q", "to_k"), seconds=9.0))


def test_equal_runs_are_the_same(runs):
    assert sb.diff_runs(*runs) == []


def test_a_changed_metric_is_named(runs):
    path = runs[1] / "metrics.jsonl"
    path.write_text(path.read_text().replace("0.625", "0.6250001"))
    assert sb.diff_runs(*runs) == [
        "metrics.jsonl line 2 (epoch 1)['reward/mean']: 0.625 vs 0.6250001"]


def test_nan_equals_nan_but_an_int_is_not_a_float(runs):
    path = runs[1] / "metrics.jsonl"
    path.write_text(path.read_text().replace('"charts/global_step": 2,',
                                             '"charts/global_step": 2.0,'))
    assert sb.diff_runs(*runs) == [
        "metrics.jsonl line 1 (epoch 0)['charts/global_step']: 2 vs 2.0"]


def test_a_changed_pixel_is_counted_and_located(runs):
    path = runs[1] / "eval_00000.png"
    pixels = np.array(Image.open(path))
    pixels[2, 3, 1] += 1
    Image.fromarray(pixels).save(path)
    assert sb.diff_runs(*runs) == [
        "eval_00000.png: 1 pixels differ, max abs diff 1, the first at (x=3, y=2)"]


def test_a_changed_checkpoint_tensor_is_named_with_its_difference(runs):
    path = runs[1] / CHECKPOINT / "state.pt"
    state = torch.load(path)
    state["lora"][1][0, 1] = 0.25
    state["optimizer"]["state"][0]["exp_avg"] *= 1 + 1e-6
    torch.save(state, path)
    found = sb.diff_runs(*runs)
    assert found[0] == f"{CHECKPOINT}/state.pt['lora'][1]: max abs diff 0.25 (1 of 6 elements " \
                       "differ)", found
    assert found[1].startswith(f"{CHECKPOINT}/state.pt['optimizer']['state'][0]['exp_avg']: "
                               "max abs diff "), found
    assert len(found) == 2


def test_a_changed_saved_arg_fails_but_the_run_directories_do_not(runs):
    path = runs[1] / CHECKPOINT / "state.pt"
    state = torch.load(path)
    state["args"]["learning_rate"] = 2e-3
    torch.save(state, path)
    assert sb.diff_runs(*runs) == [
        f"{CHECKPOINT}/state.pt args['learning_rate']: 0.001 vs 0.002"]


def test_a_changed_lora_file_tensor_and_adapter_config_are_named(runs):
    path = runs[1] / CHECKPOINT / "ema_lora" / "pytorch_lora_weights.safetensors"
    config = json.dumps({"transformer.r": 4, "transformer.target_modules": ["to_q"]})
    save_file({"a.lora_A.weight": torch.zeros(2, 3), "a.lora_B.weight": torch.zeros(3, 2)},
              path, metadata={"format": "pt", "lora_adapter_metadata": config})
    name = f"{CHECKPOINT}/ema_lora/pytorch_lora_weights.safetensors"
    found = sb.diff_runs(*runs)
    assert found[0] == (f"{name}['metadata']['lora_adapter_metadata']['transformer.r']: "
                        "8 vs 4")
    assert found[1] == (f"{name}['metadata']['lora_adapter_metadata']"
                        "['transformer.target_modules']: length 3 vs 1")
    assert found[2].startswith(f"{name}['tensors']['a.lora_A.weight']: max abs diff ")
    assert len(found) == 3


def test_missing_and_extra_files_are_listed(runs):
    (runs[1] / "eval_00000.png").rename(runs[1] / "eval_00001.png")
    assert sb.diff_runs(*runs) == [
        "files only in reference ['eval_00000.png'], only in candidate ['eval_00001.png']"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process saves it all
def test_sharded_state_is_compared_tensor_by_tensor(runs):
    import torch.distributed.checkpoint as dcp
    for run, value in zip(runs, (1.0, 1.5)):
        dcp.save({"model": {"w": torch.ones(2)}, "ema": {"w": torch.full((2,), value)}},
                 checkpoint_id=run / CHECKPOINT / "dcp")
    assert sb.diff_runs(*runs) == [
        f"{CHECKPOINT}/dcp['ema']['w']: max abs diff 0.5 (2 of 2 elements differ)"]


def test_stdout_masks_timings_paths_and_run_names(tmp_path):
    lines = []
    for root, speed in ((tmp_path / "a", "12.34"), (tmp_path / "b", "7.00")):
        (root / "run1").mkdir(parents=True)
        (root / "run1" / "stdout.txt").write_text(
            f"1 process(es) x 2 micro-batches; run dir {root}/run1/out/x__42__1700000001\n"
            f"epoch 0: reward 0.5016 | {speed} img/s | 12s | eval 0.5025\n")
        (root / "run1" / "stderr.txt").write_text(
            f"warning\nerror: non-finite reward. Last checkpoint: {root}/run1/out/"
            "x__42__1700000002/checkpoints/epoch_00001\n")
        lines.append(sb.masked_output(root / "run1", REPO, failed=True))
    assert lines[0] == lines[1] == [
        "1 process(es) x 2 micro-batches; run dir <DIR>",
        "epoch 0: reward 0.5016 | <N> img/s | <N>s | eval 0.5025",
        "stderr: ['error: non-finite reward. Last checkpoint: "
        "<ROOT>/run1/out/x__42__<TIME>/checkpoints/epoch_00001']"]


def test_two_processes_split_the_last_batch_size():
    flags = ["--batch-size", "8", "--epochs", "2", "--batch-size", "4"]
    assert sb.with_nproc(flags, 2) == ["--batch-size", "8", "--epochs", "2", "--batch-size", "2"]
    assert sb.with_nproc(["--toy"], 1) == ["--toy"]  # one process: the flags as they are


def test_the_demos_are_the_toy_lines_and_expand_to_toy():
    """docs/toy_world.md's demo lines are `OMP_NUM_THREADS=1 python SCRIPT --toy`: readme_demos
    gives each script ["--toy"], and main_args spells it out as the script's main does (TOY's
    flags the defaults, those given win)."""
    import importlib

    demos = sb.readme_demos()
    assert demos == {script: ["--toy"] for script in sb.SCRIPTS}
    for script in sb.SCRIPTS:
        module = importlib.import_module(script[: -len(".py")])
        assert sb.main_args(script, demos[script]) == module.Args(**module.TOY, toy=True)
        assert sb.main_args(script, ["--toy", "--epochs", "3"]).epochs == 3


def test_the_table_runs_the_tests_tiny_flags_and_every_readme_demo():
    harness = tiny_sd35_flags("MODEL", "OUT")
    out = harness.index("--output-dir")
    assert sb.tiny() == [sb.TINY_MODEL if flag == "MODEL" else flag
                         for flag in harness[:out] + harness[out + 2:]]
    for script in sb.SCRIPTS:
        configs = sb.CONFIGS[script]
        assert {"tiny", "tiny-bf16", "tiny-resume", "tiny-eval-only", "demo-short",
                "demo"} <= set(configs), script
        assert configs["tiny"].nprocs == (1, 2)
        assert configs["demo"].flags == sb.readme_demos()[script]
        assert all(name.startswith(("tiny", "demo")) for name in configs)
