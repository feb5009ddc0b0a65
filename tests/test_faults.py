"""Faults lose nothing (issue 42): preemption, two runs in one second, corrupt checkpoints, a
full disk, a reward that fails, an unwritable output directory. Each fault is injected
deterministically (tests/faults.py: a frozen clock, a disk that fills at a named file; a reward
file that raises or sends SIGTERM at its n-th call) into grpo_sd35.py, whose plumbing every
SD3.5 script shares verbatim (tests/test_boilerplate.py); SIGTERM and a full disk into every
script, since each runs its own copy."""

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import grpo_sd35
from scripts_harness import (REPO, TOY_REWARD, assert_bad_input, lora_tensors, read_metrics,
                             script_env, tiny_sd35_flags)

SCRIPT = "grpo_sd35.py"
# The toy reward (mean brightness) that fails as FAULT_DO says at its FAULT_AT-th call (0:
# never); as the training reward, it is called twice an epoch (2 micro-batches).
FAULTY_REWARD = '''
import os, signal, torch

calls = []


def brightness(images, prompts, metadata):
    calls.append(1)
    if len(calls) == int(os.environ.get("FAULT_AT", 0)):
        if os.environ["FAULT_DO"] == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        if os.environ["FAULT_DO"] == "raise":
            raise ZeroDivisionError("the reward broke")
        if os.environ["FAULT_DO"] == "nan":
            return torch.full((len(prompts),), float("nan")), {}
    return images.mean(dim=(1, 2, 3)), {}
'''


def faulty(tmp_path: Path, out: str, epochs: int, extra=(), in_eval=False, script=SCRIPT,
           **env):
    """A tiny 2-micro-batch-per-epoch run with the faulty reward for training (or, with
    in_eval, for eval): (the finished process, its --output-dir)."""
    reward = tmp_path / "faulty_reward.py"
    reward.write_text(FAULTY_REWARD)
    flags = tiny_sd35_flags(Path(faulty.model), tmp_path / out) + list(extra)
    rewards = [f"{reward}:brightness", TOY_REWARD][::-1 if in_eval else 1]
    flags += ["--reward", rewards[0], "--eval-reward", rewards[1], "--epochs", str(epochs)]
    flags += [] if script == "dance_grpo_flux.py" else ["--kl-beta", "0"]  # dance: no KL
    process = subprocess.run([sys.executable, "tests/faults.py", script] + flags, cwd=REPO,
                             env={**script_env(), **env}, capture_output=True, text=True,
                             timeout=600)
    return process, tmp_path / out


@pytest.fixture(scope="module")
def clean_run(tiny_sd3, tmp_path_factory) -> Path:
    faulty.model = tiny_sd3
    process, out = faulty(tmp_path_factory.mktemp("clean"), "out", epochs=3)
    assert process.returncode == 0, process.stderr[-3000:]
    (run_dir,) = out.iterdir()
    return run_dir


def last_line(process: subprocess.CompletedProcess) -> str:
    return process.stdout.strip().splitlines()[-1]


def test_sigterm_costs_at_most_an_epoch_and_resume_latest_finishes_the_same(clean_run,
                                                                             tmp_path):
    process, out = faulty(tmp_path, "out", epochs=3, FAULT_AT="5", FAULT_DO="sigterm")
    assert process.returncode == 128 + 15, process.stderr[-3000:]
    # at epoch 2's first reward: epochs 0 and 1 are saved, and the line says where to go on
    assert last_line(process).startswith("stopped by SIGTERM; --resume latest continues")
    assert last_line(process).endswith("checkpoints/epoch_00002")
    process, _ = faulty(tmp_path, "out", epochs=3, extra=["--resume", "latest"])
    assert process.returncode == 0, process.stderr[-3000:]
    (run,) = out.iterdir()  # it went on in its own directory
    assert f"resuming from {run}/checkpoints/epoch_00002" in process.stdout
    assert [row["epoch"] for row in read_metrics(run)] == [0, 1, 2]
    want = lora_tensors(clean_run / "checkpoints" / "epoch_00003")
    got = lora_tensors(run / "checkpoints" / "epoch_00003")
    assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_two_runs_started_in_the_same_second_get_two_directories(tiny_sd3, tmp_path):
    faulty.model = tiny_sd3
    for _ in range(2):
        process, out = faulty(tmp_path, "out", epochs=1, FAULT_TIME="1800000000")
        assert process.returncode == 0, process.stderr[-3000:]
    runs = sorted(out.iterdir())
    assert len(runs) == 2 and all("__1800000000_" in run.name for run in runs)
    for run in runs:  # each has its own, whole metrics and checkpoint
        assert [row["epoch"] for row in read_metrics(run)] == [0]
        assert (run / "checkpoints" / "epoch_00001" / "state.pt.sha256").is_file()


def test_resume_latest_takes_the_newest_good_checkpoint_and_says_so(clean_run, tmp_path,
                                                                   capsys):
    out = tmp_path / "out"
    older = out / "grpo_sd35__42__1700000000_a"
    newer = out / "grpo_sd35__42__1700000001_b"
    shutil.copytree(clean_run, older)
    shutil.copytree(clean_run, newer)
    (older / "checkpoints" / "epoch_00003" / "state.pt").touch()  # mtime says nothing
    newest = newer / "checkpoints" / "epoch_00003" / "state.pt"
    data = bytearray(newest.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(byte ^ 0xFF for byte in data[middle : middle + 16])
    newest.write_bytes(data)
    args = grpo_sd35.Args(model=faulty.model, output_dir=str(out), resume="latest",
                          epochs=4)
    state = grpo_sd35.check_args(args)
    assert args.resume == str(newer / "checkpoints" / "epoch_00002")
    assert state["next_epoch"] == 2
    said = capsys.readouterr().out
    assert f"skipping {newest.parent}: corrupt" in said and "resuming from" in said
    # named explicitly, a bad checkpoint is refused in one line, before the model loads
    flags = tiny_sd35_flags(faulty.model, tmp_path / "x") + ["--epochs", "4"]
    assert_bad_input(SCRIPT, flags + ["--resume", str(newest.parent)], "corrupt")
    (older / "checkpoints" / "epoch_00003" / "state.pt").write_bytes(b"")  # truncated
    assert_bad_input(SCRIPT, flags + ["--resume", str(older / "checkpoints" / "epoch_00003")],
                     "does not match")
    assert_bad_input(SCRIPT, flags + ["--resume", str(tmp_path)], "not a checkpoint")


def test_a_full_disk_stops_with_one_line_naming_the_cause(tiny_sd3, tmp_path):
    faulty.model = tiny_sd3
    for full in ("state.pt", "metrics.jsonl"):
        process, _ = faulty(tmp_path, full, epochs=2, FAULT_FULL_DISK=full)
        assert process.returncode == 1, process.stderr[-3000:]
        line = last_line(process)
        assert line.startswith("error: [Errno 28] No space left on device"), line
        assert "continues from none saved yet" in line or "epoch_00001" in line


@pytest.mark.parametrize("script", ["nft_sd35.py", "awm_sd35.py", "crd_sd35.py",
                                    "dance_grpo_flux.py"])
def test_every_script_ends_in_one_line_on_sigterm_and_on_a_full_disk(script, tiny_sd3,
                                                                      tiny_flux, tmp_path):
    """The rare paths each script runs in its own copy of the plumbing (grpo_sd35.py's: the
    tests above): SIGTERM at epoch 1's first reward ends the run at once (exit 143) naming the
    checkpoint to continue from; a disk that fills at the first state.pt ends it (exit 1)
    naming the file, the save and that none is saved yet."""
    faulty.model = tiny_flux if script.startswith("dance") else tiny_sd3
    extra = ["--train-batch-size", "2"] if script == "awm_sd35.py" else []
    process, out = faulty(tmp_path, "term", epochs=2, extra=extra, script=script,
                          FAULT_AT="3", FAULT_DO="sigterm")
    (run_dir,) = out.iterdir()
    assert process.returncode == 128 + 15, process.stderr[-3000:]
    assert last_line(process) == (
        f"stopped by SIGTERM; --resume latest continues from {run_dir}/checkpoints/epoch_00001")
    process, out = faulty(tmp_path, "full", epochs=2, extra=extra, script=script,
                          FAULT_FULL_DISK="state.pt")
    (run_dir,) = out.iterdir()
    assert process.returncode == 1, process.stderr[-3000:]
    path = run_dir / "checkpoints" / ".epoch_00001.tmp" / "state.pt"
    assert last_line(process) == (f"error: [Errno 28] No space left on device: '{path}' "
                                  "(saving epoch 1); --resume latest continues from none saved yet")


def test_a_reward_that_raises_stops_with_one_line(tiny_sd3, tmp_path):
    faulty.model = tiny_sd3
    process, out = faulty(tmp_path, "out", epochs=3, FAULT_AT="3", FAULT_DO="raise")
    assert process.returncode == 1
    line = last_line(process)
    assert "ZeroDivisionError: the reward broke at epoch 1" in line
    assert line.endswith("checkpoints/epoch_00001") and "Traceback" not in process.stderr


def test_an_eval_nan_is_strict_json_and_named(tiny_sd3, tmp_path):
    faulty.model = tiny_sd3
    process, out = faulty(tmp_path, "out", epochs=1, in_eval=True, FAULT_AT="1",
                          FAULT_DO="nan")
    assert process.returncode == 0, process.stderr[-3000:]
    (run,) = out.iterdir()

    def refuse(token):
        raise ValueError(token)

    row = json.loads((run / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert row["eval/reward_mean"] is None  # null, not NaN
    assert "(nan: a reward gave no number)" in process.stdout


def test_prepare_run_dir_drops_a_cut_line_and_redone_epochs(tmp_path, capsys):
    (tmp_path / "checkpoints" / "epoch_00003").mkdir(parents=True)
    (tmp_path / "checkpoints" / ".epoch_00004.tmp").mkdir()
    (tmp_path / "checkpoints" / "epoch_00002").mkdir()
    lines = [f'{{"epoch": {epoch}}}\n' for epoch in range(3)] + ['{"epoch": 3, "rew']
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    grpo_sd35.prepare_run_dir(str(tmp_path), start_epoch=2)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:2])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch_00002"]
    assert "a full disk cut it short" in capsys.readouterr().out


def test_an_unwritable_output_dir_is_found_before_loading(tiny_sd3, tmp_path):
    flags = tiny_sd35_flags(tiny_sd3, tmp_path / "out")
    read_only = OSError(errno.EROFS, "Read-only file system")
    with mock.patch("tempfile.TemporaryFile", side_effect=read_only):
        assert_bad_input(SCRIPT, flags, "Read-only file system")
    (tmp_path / "a_file").write_text("")
    flags = tiny_sd35_flags(tiny_sd3, tmp_path / "a_file" / "out")
    assert_bad_input(SCRIPT, flags, "--output-dir")


def test_the_plumbing_prints_only_on_rank_0_and_warns_nothing(tiny_sd3, tmp_path):
    """Under torchrun an input error is one line, not one per rank; nothing is printed
    before the start-up line (transformers' torchvision warnings)."""
    flags = tiny_sd35_flags(tiny_sd3, tmp_path / "out") + ["--resolution", "34"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", SCRIPT] + flags
    process = subprocess.run(command, cwd=REPO, env=script_env(), capture_output=True,
                             text=True, timeout=300)
    assert process.returncode != 0
    output = process.stdout + process.stderr
    assert output.count("error: --resolution 34") == 1, output[-3000:]
    assert "torchvision" not in output
