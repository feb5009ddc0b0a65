"""benchmarks/toy_learning.py: its flags, its parallel-process launcher (two tiny runs on the
CPU; --device cuda changes only the environment), and its best / final / collapse report."""

import json
import sys

import pytest
import torch

from scripts_harness import REPO, TOY_SD3, toy_flags

sys.path.insert(0, str(REPO / "benchmarks"))
import toy_learning  # noqa: E402


def test_flags_a_variant_and_extra_flags_replace_toy_flags():
    script, flags = toy_learning.flags_of("grpo", ["--learning-rate", "5e-4", "--seed", "7"])
    assert script == "grpo_sd35.py"
    for flag, value in (("--learning-rate", "5e-4"), ("--guidance-scale", "1"), ("--seed", "7"),
                        ("--group-size", "16")):
        assert flags.count(flag) == 1 and flags[flags.index(flag) + 1] == value, flag
    assert flags[flags.index("--output-dir") + 1] == "OUT"
    assert set(toy_flags(TOY_SD3, "OUT")) <= set(flags)
    _, dance = toy_learning.flags_of("dance")
    assert "--kl-beta" not in dance  # DanceGRPO has no KL term
    for variant in toy_learning.VARIANTS:  # each flag once: the command says what runs
        _, flags = toy_learning.flags_of(variant)
        names = [flag for flag in flags if flag.startswith("--")]
        assert len(names) == len(set(names)), variant
    _, dppo = toy_learning.flags_of("grpo-dppo")  # the mask acts only off-policy
    assert dppo[dppo.index("--updates-per-epoch") + 1] == "2"


def test_cpu_runs_hide_the_gpu_and_cuda_needs_one(monkeypatch):
    assert toy_learning.run_env("cpu")["CUDA_VISIBLE_DEVICES"] == ""
    assert toy_learning.run_env("cpu")["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in toy_learning.run_env("cuda")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no GPU"):
            toy_learning.main(toy_learning.Args(device="cuda", figure=""))


def test_two_tiny_runs_in_parallel_report_best_final_and_collapse(tmp_path, capsys):
    """Two seeds of a 2-epoch GRPO run at 8 images per epoch, as two processes at once."""
    log = tmp_path / "runs.jsonl"
    args = toy_learning.Args(
        variants=["grpo"], seeds=[42, 1], images=16, eval_every=1, jobs=2, figure="",
        eval_seeds=[100, 101],
        log=str(log), extra=["--group-size", "4", "--prompts-per-epoch", "2", "--batch-size", "8",
                             "--num-steps", "4", "--eval-num-steps", "2"])
    results = toy_learning.main(args)
    assert [json.loads(line) for line in log.read_text().splitlines()] == json.loads(
        json.dumps(results))
    assert [(r["variant"], r["seed"]) for r in results] == [("grpo", 42), ("grpo", 1)]
    first, second = results
    assert second["start"] < first["end"] and first["start"] < second["end"]  # in parallel
    for r in results:
        assert [point[0] for point in r["curve"]] == [0, 8, 16]  # images at each eval
        accuracy = [point[2] for point in r["curve"]]
        assert all(0 <= a <= 1 for a in accuracy)
        assert r["base"] == accuracy[0] and r["final"] == accuracy[-1]
        assert r["best"] == max(accuracy) and r["collapse"] == r["final"] - r["best"] <= 0
        assert r["command"][r["command"].index("--seed") + 1] == str(r["seed"])
        assert r["command"][-3:] == ["--eval-seeds", "100", "101"]  # the reporting noise
        assert r["diversity"] > 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| grpo |")]
    mean = lambda key: sum(r[key] for r in results) / 2  # noqa: E731
    assert len(row) == 1 and f"| {mean('best'):.3f} | {mean('final'):.3f} | " in row[0]
    assert f"| {mean('collapse'):+.3f} |" in row[0]
