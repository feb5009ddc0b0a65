"""What a run leaves to share and to check (issues 43, 45, 46), on grpo_sd35.py, whose plumbing
every SD3.5 script copies verbatim: a model card beside every LoRA, the Hub push of the final
EMA LoRA only, --checkpoints-total-limit, --lora-targets, a final eval of the saved file, the
silent-adapter alarm, eval seeds with a standard error, a labelled contact sheet, --eval-only
from a checkpoint alone."""

import contextlib
import io
import json
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import grpo_sd35
from scripts_harness import (REPO, ModelLoaded, assert_bad_input, read_metrics, run_script,
                             script_context, script_env, tiny_sd35_flags)

SCRIPT = "grpo_sd35.py"
# A LoRA that moves (lr 1e-2), an EMA that moves each step, 2 eval seeds
FLAGS = ["--epochs", "3", "--kl-beta", "0", "--learning-rate", "1e-2", "--ema-decay", "0.5",
         "--ema-interval", "0", "--eval-seeds", "42", "7", "--save-every", "2",
         "--checkpoints-total-limit", "1", "--push-to-hub", "--hub-model-id", "toy-lora"]


@pytest.fixture(scope="module")
def pushed(tiny_sd3, tmp_path_factory) -> tuple[Path, list]:
    """A run pushing to a recording Hub (tests/faults.py): its run dir and the Hub calls."""
    out = tmp_path_factory.mktemp("pushed")
    flags = tiny_sd35_flags(tiny_sd3, out / "runs") + FLAGS
    env = {**script_env(), "FAULT_HUB": str(out / "hub.json")}
    process = subprocess.run([sys.executable, "tests/faults.py", SCRIPT] + flags, cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    (run_dir,) = (out / "runs").iterdir()
    return run_dir, json.loads((out / "hub.json").read_text())


def test_the_push_sends_the_final_ema_lora_and_its_card_only(pushed):
    run_dir, calls = pushed
    assert [call[0] for call in calls] == ["whoami", "create_repo", "upload_folder"]
    assert calls[1][1:] == ["toy-lora", {"private": False, "exist_ok": True}]
    _, repo, folder, files = calls[2]
    assert repo == "someone/toy-lora"
    assert folder == str(run_dir / "checkpoints" / "epoch_00003" / "ema_lora")
    assert files == ["README.md", "eval_sheet.png", "pytorch_lora_weights.safetensors"]


def test_checkpoints_total_limit_keeps_the_newest_kept_one_and_the_last(pushed):
    run_dir, _ = pushed  # --save-every 2, --checkpoints-total-limit 1, 3 epochs
    saved = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert saved == ["epoch_00002", "epoch_00003"]


def test_every_saved_lora_has_a_model_card(pushed):
    run_dir, _ = pushed
    metrics = read_metrics(run_dir)
    before, after = metrics[0]["eval/reward_mean"], metrics[-1]["eval/final_reward_mean"]
    for name in ("lora", "ema_lora"):
        folder = run_dir / "checkpoints" / "epoch_00003" / name
        card = (folder / "README.md").read_text()
        front, body = card.split("---\n")[1:3]
        assert "base_model: " in front and "library_name: diffusers" in front
        assert "tags: [diffusers, lora, text-to-image, grpo_sd35]" in front
        assert body.startswith("# Flow-GRPO on Stable Diffusion 3.5 Medium")
        assert f"{before:.4f} before, {after:.4f} after" in body
        assert "on 24\nimages" in body or "on 24 images" in body  # 3 epochs x 8
        assert 'pipe.load_lora_weights("toy-lora")' in body and "--kl-beta 0.0" in body
        assert "https://arxiv.org/abs/2505.05470" in body
        sheet = Image.open(folder / "eval_sheet.png")
        assert sheet.size == Image.open(run_dir / "eval_00003.png").size


def test_the_final_eval_scores_the_saved_file_as_trained(pushed, tmp_path):
    """eval/final_* loads ema_lora/ from disk as README says; --eval-only of the checkpoint
    alone (its flags from state.pt) swaps the trained EMA in memory: the same score."""
    run_dir, _ = pushed
    final = read_metrics(run_dir)[-1]
    checkpoint = run_dir / "checkpoints" / "epoch_00003"
    process = subprocess.run([sys.executable, SCRIPT, "--eval-only", "--resume",
                              str(checkpoint), "--output-dir", str(tmp_path)], cwd=REPO,
                             env=script_env(), capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    (eval_run,) = tmp_path.iterdir()
    (row,) = read_metrics(eval_run)
    assert row["eval/reward_mean"] == final["eval/final_reward_mean"]
    assert row["eval/lora_change"] == final["eval/final_lora_change"] > 0


def test_evals_report_lora_change_and_a_standard_error_over_seeds(pushed):
    run_dir, _ = pushed
    first, *_, last = read_metrics(run_dir)
    assert first["eval/lora_change"] == 0  # LoRA B starts at 0: the base model itself
    assert last["eval/lora_change"] > 0
    # 2 seeds x 8 test lines: std / sqrt(16)
    assert 0 < first["eval/reward_stderr"] < first["eval/reward_mean"]


def test_the_contact_sheet_labels_each_row():
    red = np.zeros((32, 32, 3), np.uint8)
    red[..., 0] = 255
    sheet = grpo_sd35.contact_sheet([("0.500  a prompt", [red, red]), ("0.250  b", [red])])
    assert sheet.size == (640, 2 * (128 + 24))  # cells of 128 px, a 24 px label above
    pixels = np.asarray(sheet)
    assert (pixels[:24] < 128).any()  # the label's text
    assert (pixels[24:152, :256, 0] == 255).all() and (pixels[24:152, 256:] == 255).all()


def test_a_bom_is_not_part_of_the_first_prompt(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufefftwo red squares\nthree blue circles\n".encode())
    prompts, _ = grpo_sd35.load_prompts(str(path))
    assert prompts == ["two red squares", "three blue circles"]


def test_bad_sharing_flags_are_refused_before_loading(tiny_sd3, tmp_path):
    flags = tiny_sd35_flags(tiny_sd3, tmp_path / "out")
    assert_bad_input(SCRIPT, flags + ["--lora-targets", "attn.to_q", "attn.nope"],
                     "--lora-targets 'attn.nope' names no layer")
    # HF_HUB_OFFLINE (the harness's): the Hub cannot be reached
    assert_bad_input(SCRIPT, flags + ["--push-to-hub"], "--push-to-hub needs the Hub")


def test_too_few_prompts_are_said_to_be_drawn_with_replacement(tiny_sd3, tmp_path):
    flags = tiny_sd35_flags(tiny_sd3, tmp_path / "out")
    flags[flags.index("--prompts-per-epoch") + 1] = "16"
    stdout = io.StringIO()
    with script_context(None), contextlib.redirect_stdout(stdout):
        sys.argv = [SCRIPT] + flags + ["--batch-size", "8"]
        with pytest.raises(ModelLoaded):
            runpy.run_path(str(REPO / SCRIPT), run_name="__main__")
    assert "fewer than --prompts-per-epoch prompts" in stdout.getvalue()
