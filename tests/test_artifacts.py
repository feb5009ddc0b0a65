"""What a run leaves to share is what it trained (issue 43): the final eval scores the saved
EMA LoRA loaded back from disk as README tells users to load it; every eval logs how far the
LoRA moves the model (eval/lora_drift) and warns when it moves it not at all; the checkpoints
kept on disk are bounded by --checkpoints-total-limit. Run on grpo_sd35.py, whose plumbing every
SD3.5 script shares verbatim (tests/test_boilerplate.py); each script's own test checks that its
--eval-only score of a checkpoint's in-memory EMA equals the final eval of the saved file
(scripts_harness.assert_eval_only_reproduces)."""

import json
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(scope="module")
def recorded(tiny_sd3, tmp_path_factory) -> tuple[Path, str, Path, Path]:
    """Two epochs at --ema-decay 0 (the evaluated LoRA is the trained one) with --push-to-hub
    --hub-private --lora-targets attn.to_q to_v, the Hub a recorder (tests/faults.py
    FAULT_HUB: nothing is sent) and every load_lora_weights folder recorded: (run dir, stdout,
    the loads, the Hub's calls)."""
    work = tmp_path_factory.mktemp("recorded")
    flags = tiny_sd35_flags(tiny_sd3, work / "out") + [
        "--epochs", "2", "--ema-decay", "0", "--push-to-hub", "--hub-private",
        "--lora-targets", "attn.to_q", "to_v"]
    hub = work / "hub.jsonl"
    run_dir, stdout = run_recorded(flags, work / "loads.txt", {"FAULT_HUB": str(hub)})
    return run_dir, stdout, work / "loads.txt", hub


def test_the_final_eval_loads_the_saved_lora_and_the_drift_shows_training(recorded):
    """The epoch-0 eval sees a LoRA whose B matrices start at zero, so its drift is exactly 0;
    training moves it; the final eval reads the last checkpoint's ema_lora/ through
    load_lora_weights, once, and nothing else does."""
    run_dir, stdout, loads, _ = recorded
    metrics = read_metrics(run_dir)
    assert metrics[0]["eval/lora_drift"] == 0.0
    assert metrics[1]["eval/lora_drift"] > 0 and metrics[1]["eval/final_lora_drift"] > 0
    assert "WARNING" not in stdout, stdout
    saved = run_dir / "checkpoints" / "epoch_00002" / "ema_lora"
    assert loads.read_text().splitlines() == [str(saved)]


def test_a_lora_that_does_not_train_raises_the_alarm_and_old_checkpoints_go(tiny_sd3, tmp_path):
    """A learning rate of 0 is the silent adapter of verl-omni#552 in miniature: the weights
    never move, the drift stays 0 at every eval after the first, and each such eval warns.
    The same run keeps only the newest 2 checkpoints (--save-every 1
    --checkpoints-total-limit 2 over 3 epochs: epochs 2 and 3 remain)."""
    out = tmp_path / "out"
    flags = tiny_sd35_flags(tiny_sd3, out) + ["--epochs", "3", "--ema-decay", "0",
                                              "--learning-rate", "0",
                                              "--checkpoints-total-limit", "2"]
    process = run_script(SCRIPT, flags, check=False)
    assert process.returncode == 0, process.stderr[-4000:]
    (run_dir,) = out.iterdir()
    metrics = read_metrics(run_dir)
    assert [row["eval/lora_drift"] for row in metrics] == [0.0, 0.0, 0.0]
    assert metrics[-1]["eval/final_lora_drift"] == 0.0
    warnings = [line for line in process.stdout.splitlines() if line.startswith("WARNING")]
    assert warnings == ["WARNING: eval/lora_drift is 0: does the LoRA train?"] * 3, warnings
    kept = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert kept == ["epoch_00002", "epoch_00003"], kept


@pytest.mark.parametrize("save_every,limit,current,kept", [
    (1, None, 5, [1, 2, 3, 4, 5]),  # no limit: every epoch on the grid
    (2, None, 5, [2, 4, 5]),  # off the grid: only the current one stays
    (2, 1, 5, [4, 5]),  # the newest on the grid, and the current one for --resume
    (1, 1, 5, [5]),
    (2, 3, 6, [2, 4, 6]),
])
@pytest.mark.quick
def test_pruning_never_drops_the_current_checkpoint(tmp_path, save_every, limit, current, kept):
    folder = tmp_path / "checkpoints"
    for epoch in range(1, current + 1):
        (folder / f"epoch_{epoch:05d}").mkdir(parents=True)
    grpo_sd35.prune_checkpoints(str(tmp_path), str(folder / f"epoch_{current:05d}"),
                                save_every, limit)
    assert sorted(int(path.name[-5:]) for path in folder.iterdir()) == kept


def test_every_evaluated_checkpoint_gets_a_card_of_its_folder_and_the_push_sends_the_last(
        tiny_sd3, recorded):
    """Each checkpoint an eval scored has a card in both LoRA folders, in the Hub's format
    (huggingface_hub parses its metadata), with the base model's eval and its own, each ± its
    standard error, the sheet of that eval beside it, a snippet that imports what it uses and
    loads that folder (ema_lora/: by its Hub id), and the command that trains the same run
    again (tyro parses it back into the run's flags). The push creates the private repository
    YOUR_NAME/EXP_NAME and uploads the last checkpoint's ema_lora/ alone (no state.pt, no
    other checkpoint), whose weights adapt the two layers asked for."""
    import huggingface_hub
    import tyro
    from safetensors.torch import load_file

    run_dir, stdout, _, hub = recorded
    metrics = read_metrics(run_dir)
    before = f"{metrics[0]['eval/reward_mean']:.4f} ± {metrics[0]['eval/reward_stderr']:.4f}"
    scored = {1: metrics[1]["eval/reward_mean"], 2: metrics[1]["eval/final_reward_mean"]}
    errors = {1: metrics[1]["eval/reward_stderr"], 2: metrics[1]["eval/final_reward_stderr"]}
    state = torch.load(run_dir / "checkpoints" / "epoch_00002" / "state.pt", weights_only=False)
    for epochs, reward in scored.items():
        save = run_dir / "checkpoints" / f"epoch_{epochs:05d}"
        for folder, loads in [("lora", str(save / "lora")), ("ema_lora", "tester/grpo_sd35")]:
            card = huggingface_hub.ModelCard((save / folder / "README.md").read_text())
            assert card.data.base_model == str(tiny_sd3) and card.data.license == "other"
            assert set(card.data.tags) == {"diffusers", "lora", "text-to-image", "grpo_sd35"}
            assert "Paper: Flow-GRPO, https://arxiv.org/abs/2505.05470" in card.text
            after = f"{reward:.4f} ± {errors[epochs]:.4f}"
            assert f"{before} before, {after} after {epochs} epochs" in card.text
            assert f"({epochs * 2 * 4} images)" in card.text  # --prompts-per-epoch 2 x 4 each
            assert ("from diffusers import DiffusionPipeline\n"
                    f'pipe = DiffusionPipeline.from_pretrained("{tiny_sd3}")\n'
                    f'pipe.load_lora_weights("{loads}")\n') in card.text
            command = shlex.split(card.text.split("Trained with `")[1].split("`")[0])
            assert command[:2] == ["python", SCRIPT]
            parsed = asdict(tyro.cli(grpo_sd35.Args, args=command[2:]))
            for name in ["resume", "push_to_hub", "hub_model_id"]:  # left out on purpose
                parsed.pop(name)
            assert parsed == {name: value for name, value in state["args"].items()
                              if name in parsed}
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


@pytest.mark.quick
def test_each_card_has_its_own_checkpoints_eval(tmp_path):
    """write_card on made-up evals, all distinct at 4 decimals (one a NaN, which JSON logs as
    null): each evaluated checkpoint's cards quote the base model's eval and that checkpoint's
    own, the last one's from the unlogged final metrics; an eval whose checkpoint is gone
    (pruned) gets no card."""
    rows = [{"epoch": 0, "eval/reward_mean": 0.1111, "eval/reward_stderr": 0.0101,
             "eval/sheet": "eval_00000.png"},
            {"epoch": 1, "eval/reward_mean": None, "eval/reward_stderr": None,
             "eval/sheet": "eval_00001.png"},
            {"epoch": 2, "eval/reward_mean": 0.3333, "eval/reward_stderr": 0.0303,
             "eval/sheet": "eval_00002.png"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    final = {"eval/final_reward_mean": 0.4444, "eval/final_reward_stderr": 0.0404,
             "eval/final_sheet": "eval_00004.png"}
    for epoch in [0, 1, 2, 4]:
        (tmp_path / f"eval_{epoch:05d}.png").write_bytes(bytes([epoch]))
    for epoch in [1, 4]:  # epoch 2's was pruned
        for folder in ["lora", "ema_lora"]:
            (tmp_path / "checkpoints" / f"epoch_{epoch:05d}" / folder).mkdir(parents=True)
    args = grpo_sd35.Args(ema_decay=0.5)
    grpo_sd35.write_card(str(tmp_path), args, images_per_epoch=10, final=final)
    expected = {1: "nan ± nan after 1 epochs (10 images)",
                4: "0.4444 ± 0.0404 after 4 epochs (40 images)"}
    for epoch, after in expected.items():
        for folder in ["lora", "ema_lora"]:
            text = (tmp_path / "checkpoints" / f"epoch_{epoch:05d}" / folder / "README.md")
            card = " ".join(text.read_text().split())
            assert f"0.1111 ± 0.0101 before, {after}" in card, card
            assert "`ema_lora/` its EMA (decay 0.5; 0: the same)" in card
            sheet = text.parent / "eval_sheet.png"
            assert sheet.read_bytes() == bytes([epoch])
    assert not (tmp_path / "checkpoints" / "epoch_00002").exists()
