"""What a run leaves to share is what it trained (issue 43): the final eval scores the saved
EMA LoRA loaded back from disk as README tells users to load it; every eval logs how far the
LoRA moves the model (eval/lora_drift) and warns when it moves it not at all; the checkpoints
kept on disk are bounded by --checkpoints-total-limit. Run on grpo_sd35.py, whose plumbing every
SD3.5 script shares verbatim (tests/test_boilerplate.py); each script's own test checks that its
--eval-only score of a checkpoint's in-memory EMA equals the final eval of the saved file
(scripts_harness.assert_eval_only_reproduces)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import grpo_sd35
from scripts_harness import REPO, read_metrics, run_script, script_env, tiny_sd35_flags

SCRIPT = "grpo_sd35.py"


def run_recorded(flags: list[str], loads: Path, faults: dict | None = None) -> tuple[Path, str]:
    """Run the script under tests/faults.py, recording every load_lora_weights folder (and
    with the other faults given)."""
    env = {**script_env(), "FAULT_LORA_LOADS": str(loads), **(faults or {})}
    process = subprocess.run([sys.executable, "tests/faults.py", SCRIPT] + flags, cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=900)
    assert process.returncode == 0, process.stderr[-4000:]
    out = Path(flags[flags.index("--output-dir") + 1])
    (run_dir,) = [path for path in out.iterdir() if path.is_dir()]
    return run_dir, process.stdout


def test_the_final_eval_loads_the_saved_lora_and_the_drift_shows_training(tiny_sd3, tmp_path):
    """--ema-decay 0: the evaluated LoRA is the trained one. The epoch-0 eval sees a LoRA whose
    B matrices start at zero, so its drift is exactly 0; training moves it; the final eval reads
    the last checkpoint's ema_lora/ through load_lora_weights, once, and nothing else does."""
    out = tmp_path / "out"
    flags = tiny_sd35_flags(tiny_sd3, out) + ["--epochs", "2", "--ema-decay", "0"]
    run_dir, stdout = run_recorded(flags, tmp_path / "loads.txt")
    metrics = read_metrics(run_dir)
    assert metrics[0]["eval/lora_drift"] == 0.0
    assert metrics[1]["eval/lora_drift"] > 0 and metrics[1]["eval/final_lora_drift"] > 0
    assert "WARNING" not in stdout, stdout
    saved = run_dir / "checkpoints" / "epoch_00002" / "ema_lora"
    assert (tmp_path / "loads.txt").read_text().splitlines() == [str(saved)]


def test_a_lora_that_does_not_train_raises_the_alarm(tiny_sd3, tmp_path):
    """A learning rate of 0 is the silent adapter of verl-omni#552 in miniature: the weights
    never move, the drift stays 0 at every eval after the first, and each such eval warns."""
    out = tmp_path / "out"
    flags = tiny_sd35_flags(tiny_sd3, out) + ["--epochs", "2", "--ema-decay", "0",
                                              "--learning-rate", "0"]
    process = run_script(SCRIPT, flags, check=False)
    assert process.returncode == 0, process.stderr[-4000:]
    (run_dir,) = out.iterdir()
    metrics = read_metrics(run_dir)
    assert [row["eval/lora_drift"] for row in metrics] == [0.0, 0.0]
    assert metrics[-1]["eval/final_lora_drift"] == 0.0
    warnings = [line for line in process.stdout.splitlines() if line.startswith("WARNING")]
    assert warnings == ["WARNING: eval/lora_drift is 0: does the LoRA train?"] * 2, warnings


def test_checkpoints_total_limit_keeps_the_newest(tiny_sd3, tmp_path):
    """--save-every 1 --checkpoints-total-limit 2 over 3 epochs: epochs 2 and 3 remain."""
    out = tmp_path / "out"
    flags = tiny_sd35_flags(tiny_sd3, out) + ["--epochs", "3", "--eval-every", "3",
                                              "--checkpoints-total-limit", "2"]
    run_dir = run_script(SCRIPT, flags)
    kept = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert kept == ["epoch_00002", "epoch_00003"], kept


@pytest.mark.parametrize("save_every,limit,current,kept", [
    (1, None, 5, [1, 2, 3, 4, 5]),  # no limit: every epoch on the grid
    (2, None, 5, [2, 4, 5]),  # off the grid: only the current one stays
    (2, 1, 5, [4, 5]),  # the newest on the grid, and the current one for --resume
    (1, 1, 5, [5]),
    (2, 3, 6, [2, 4, 6]),
])
def test_pruning_never_drops_the_current_checkpoint(tmp_path, save_every, limit, current, kept):
    folder = tmp_path / "checkpoints"
    for epoch in range(1, current + 1):
        (folder / f"epoch_{epoch:05d}").mkdir(parents=True)
    grpo_sd35.prune_checkpoints(str(tmp_path), str(folder / f"epoch_{current:05d}"),
                                save_every, limit)
    assert sorted(int(path.name[-5:]) for path in folder.iterdir()) == kept


def test_every_evaluated_checkpoint_gets_a_model_card_and_the_push_sends_the_last(tiny_sd3,
                                                                                   tmp_path):
    """Two epochs, --push-to-hub --hub-private --lora-targets attn.to_q to_v, with the Hub a
    recorder (tests/faults.py FAULT_HUB: nothing is sent). Each checkpoint an eval scored has a
    card in both LoRA folders, in the Hub's format (huggingface_hub parses its metadata), with its
    own eval after the base model's and the sheet of that eval beside it; the push creates the
    private repository YOUR_NAME/EXP_NAME and uploads the last checkpoint's ema_lora/ alone
    (no state.pt, no other checkpoint), whose weights adapt the two layers asked for."""
    import huggingface_hub
    from safetensors.torch import load_file

    out = tmp_path / "out"
    flags = tiny_sd35_flags(tiny_sd3, out) + [
        "--epochs", "2", "--ema-decay", "0", "--push-to-hub", "--hub-private",
        "--lora-targets", "attn.to_q", "to_v"]
    hub = tmp_path / "hub.jsonl"
    run_dir, stdout = run_recorded(flags, tmp_path / "loads.txt", {"FAULT_HUB": str(hub)})
    metrics = read_metrics(run_dir)
    before = metrics[0]["eval/reward_mean"]
    scored = {1: metrics[1]["eval/reward_mean"], 2: metrics[1]["eval/final_reward_mean"]}
    for epochs, reward in scored.items():
        save = run_dir / "checkpoints" / f"epoch_{epochs:05d}"
        cards = [(save / folder / "README.md").read_text() for folder in ["lora", "ema_lora"]]
        assert cards[0] == cards[1]
        card = huggingface_hub.ModelCard(cards[1])
        assert card.data.base_model == str(tiny_sd3) and card.data.license == "other"
        assert set(card.data.tags) == {"diffusers", "lora", "text-to-image", "grpo_sd35"}
        assert "Paper: Flow-GRPO, https://arxiv.org/abs/2505.05470" in card.text
        assert f"{before:.4f} before, {reward:.4f} after {epochs} epochs" in card.text
        assert f"({epochs * 2 * 4} images)" in card.text  # --prompts-per-epoch 2 x 4 each
        assert 'pipe.load_lora_weights("tester/grpo_sd35")' in card.text
        assert "`--kl-beta 0.04`" in card.text and "`--epochs 2`" in card.text
        for folder in ["lora", "ema_lora"]:
            sheet = (save / folder / "eval_sheet.png").read_bytes()
            assert sheet == (run_dir / f"eval_{epochs:05d}.png").read_bytes()
    calls = [json.loads(line) for line in hub.read_text().splitlines()]
    last = run_dir / "checkpoints" / "epoch_00002" / "ema_lora"
    assert calls == [
        {"call": "create_repo", "args": ["tester/grpo_sd35"], "private": True, "exist_ok": True},
        {"call": "upload_folder", "args": [], "repo_id": "tester/grpo_sd35",
         "folder_path": str(last)}]
    assert sorted(path.name for path in last.iterdir()) == [
        "README.md", "eval_sheet.png", "pytorch_lora_weights.safetensors"]
    layers = {key.split(".lora")[0].split(".")[-1]
              for key in load_file(last / "pytorch_lora_weights.safetensors")}
    assert layers == {"to_q", "to_v"}, layers
    assert "pushed to https://huggingface.co/tester/grpo_sd35" in stdout
