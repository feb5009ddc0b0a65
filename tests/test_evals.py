"""What a run shows and how it is checked later (issues 45, 46), on grpo_sd35.py, whose
plumbing every SD3.5 script copies verbatim: eval seeds with a standard error, a labelled
contact sheet, --eval-only from a checkpoint alone, the diversity signal, prompt files."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import grpo_sd35
from scripts_harness import REPO, read_metrics, run_script, script_env, tiny_sd35_flags

SCRIPT = "grpo_sd35.py"
# A LoRA and an EMA that move (lr 1e-2, the EMA each step); 2 eval seeds
FLAGS = ["--epochs", "2", "--kl-beta", "0", "--learning-rate", "1e-2", "--ema-decay", "0.5",
         "--ema-interval", "0", "--eval-seeds", "42", "7", "--save-every", "2"]


@pytest.fixture(scope="module")
def seeded_run(tiny_sd3, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("seeds")
    return run_script(SCRIPT, tiny_sd35_flags(tiny_sd3, out) + FLAGS)


def test_evals_report_a_standard_error_over_prompts_and_seeds(seeded_run):
    first, last = read_metrics(seeded_run)
    # 2 seeds x the 4 test lines: std / sqrt(8)
    assert 0 < first["eval/reward_stderr"] < first["eval/reward_mean"]
    assert last["eval/final_reward_stderr"] > 0
    # each seed draws its own noise: two samples of one prompt differ
    assert first["eval/diversity"] > 0
    sheet = Image.open(seeded_run / "eval_00000.png")
    assert sheet.size == (640, 24 + 4 * (320 + 24))  # 4 test prompts, 2 samples each


def test_the_diversity_signal_reads_zero_when_every_sample_of_a_prompt_is_alike(tiny_sd3,
                                                                                 tmp_path):
    """eval/diversity is the reward-hacking signal: the RMS pixel distance between two samples
    of one prompt. Made to fire: the eval seeds 7 and 7 draw every prompt's two samples from the
    same noise, as a run collapsed to one image per prompt would, and it reads exactly 0 (seeds
    42 and 7 above: > 0)."""
    flags = tiny_sd35_flags(tiny_sd3, tmp_path) + ["--eval-only", "--eval-seeds", "7", "7"]
    (row,) = read_metrics(run_script(SCRIPT, flags))
    assert row["eval/diversity"] == 0.0 and 0 < row["eval/reward_mean"] < 1


def test_eval_only_needs_only_the_checkpoint(seeded_run, tmp_path):
    """Its flags come from state.pt (prompts, model, eval seeds, ...): it reproduces the
    run's final eval of the same EMA weights."""
    final = read_metrics(seeded_run)[-1]
    checkpoint = seeded_run / "checkpoints" / "epoch_00002"
    process = subprocess.run([sys.executable, SCRIPT, "--eval-only", "--resume",
                              str(checkpoint), "--output-dir", str(tmp_path)], cwd=REPO,
                             env=script_env(), capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    assert f"resuming from {checkpoint}" in process.stdout
    (eval_run,) = tmp_path.iterdir()
    (row,) = read_metrics(eval_run)
    assert row["epoch"] == 2 and not (eval_run / "checkpoints").exists()
    assert row["eval/reward_mean"] == final["eval/final_reward_mean"]
    assert row["eval/reward_stderr"] == final["eval/final_reward_stderr"]


@pytest.mark.quick
def test_the_contact_sheet_has_a_title_labels_each_row_and_no_blank_strip():
    """A 24 px title, then per row a 24 px label over its images; the cells fill 640 px (2
    columns: 320 px each), so only a row with fewer images than the widest leaves white."""
    red = np.zeros((32, 32, 3), np.uint8)
    red[..., 0] = 255
    sheet = grpo_sd35.contact_sheet("grpo_sd35.py after 2 epochs: 0.5000 ± 0.0100",
                                    [("0.500  a prompt", [red, red]), ("0.250  b", [red])])
    assert sheet.size == (640, 24 + 2 * (320 + 24))
    pixels = np.asarray(sheet)
    assert (pixels[:24, :400] < 128).any() and (pixels[24:48, :200] < 128).any()  # text
    assert (pixels[48:368, :, 0] == 255).all() and (pixels[48:368, :, 1:] == 0).all()
    assert (pixels[392:712, :320, 0] == 255).all() and (pixels[392:712, 320:] == 255).all()


@pytest.mark.quick
@pytest.mark.parametrize("text", [
    "two red squares\nthree blue circles\n",  # a final newline
    "two red squares\nthree blue circles",  # none: the last line is a prompt all the same
    "\ufefftwo red squares\r\n\r\n  three blue circles  \r\n\n",  # BOM, CRLF, blank lines
], ids=["final-newline", "no-final-newline", "bom-crlf-blank-lines"])
def test_prompt_files_read_every_line_and_nothing_else(tmp_path, text):
    """A BOM is no part of the first prompt, blank lines are none, and the last line counts
    with or without its newline; JSONL likewise, keeping each row for the reward."""
    path = tmp_path / "prompts.txt"
    path.write_bytes(text.encode())
    prompts, meta = grpo_sd35.load_prompts(str(path))
    assert prompts == ["two red squares", "three blue circles"] and meta == [{}, {}]
    rows = [json.dumps({"prompt": prompt, "n": n}) for n, prompt in enumerate(prompts)]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_bytes(text.replace("two red squares", rows[0])
                      .replace("three blue circles", rows[1]).encode())
    prompts, meta = grpo_sd35.load_prompts(str(jsonl))
    assert prompts == ["two red squares", "three blue circles"]
    assert [row["n"] for row in meta] == [0, 1]
