"""grpo_sd35.py: hand-computed advantage/loss units, then end-to-end runs on the tiny offline SD3 pipeline."""

import math

import pytest
import torch

from grpo_sd35 import compute_advantages, group_advantages, grpo_loss
from scripts_harness import (TOY_REWARD, assert_bad_input, assert_common_run, assert_eval_only_reproduces,
                             assert_reward_rose, lora_tensors, read_metrics, run_script, tiny_sd35_flags)

SCRIPT = "grpo_sd35.py"


# ---- units -------------------------------------------------------------------------------------------------------
def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    global_std = math.sqrt(sum((r - 10 / 3) ** 2 for r in [1, 2, 3, 4, 5, 5]) / 6)  # population std of all six
    adv = group_advantages(rewards, groups, per_group_std=False)
    want = torch.tensor([-0.5, 0.5, -0.5, 0.5, 0.0, 0.0]) / (global_std + 1e-4)
    assert torch.allclose(adv, want, atol=1e-6)
    adv = group_advantages(rewards, groups, per_group_std=True)  # within-group std 0.5; equal group: 0 / 1e-4 = 0
    assert torch.allclose(adv, torch.tensor([-1, 1, -1, 1, 0, 0]) * 0.5 / (0.5 + 1e-4), atol=1e-6)
    assert torch.isfinite(adv).all()


def test_groups_may_be_interleaved():
    adv = group_advantages(torch.tensor([1.0, 10.0, 3.0, 20.0]), torch.tensor([0, 1, 0, 1]), per_group_std=True)
    assert torch.allclose(adv, torch.tensor([-1.0, -1.0, 1.0, 1.0]), atol=1e-3)


def test_gdpo_normalises_each_reward_within_its_group():
    groups = torch.tensor([0, 0, 1, 1])
    a, b = torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([10.0, 30.0, 30.0, 10.0])
    weights = {"a": 1.0, "b": 0.5}
    adv = compute_advantages(a + 0.5 * b, {"a": a, "b": b}, weights, groups, "gdpo", per_group_std=False)
    # per group: a -> (-1, 1, -1, 1), b -> (-1, 1, 1, -1) (up to the 1e-4 eps); weighted sum (-1.5, 1.5, -0.5, 0.5)
    s = torch.tensor([-1.5, 1.5, -0.5, 0.5])
    assert torch.allclose(adv, s / s.std(unbiased=False), atol=1e-3)
    # "sum" normalises the weighted sum instead: (a + 0.5 b) = (5, 16, 15, 6)
    adv_sum = compute_advantages(a + 0.5 * b, {"a": a, "b": b}, weights, groups, "sum", per_group_std=False)
    assert torch.allclose(adv_sum, torch.tensor([-5.5, 5.5, 4.5, -4.5]) / torch.tensor([5.0, 16, 15, 6]).std(unbiased=False), atol=1e-3)


def test_grpo_loss_by_hand():
    zero = torch.zeros(2)
    loss, ratio = grpo_loss(zero, zero, torch.tensor([-1.0, -1.0]), clip_range=1e-4, adv_clip=5.0)
    assert loss.item() == pytest.approx(1.0) and torch.equal(ratio, torch.ones(2))  # ratio 1, advantage -1 -> 1
    # ratio 1.5 with A = +1 is clipped to 1 + eps; with A = -1 the unclipped -A r = 1.5 is the max
    lp = torch.tensor([math.log(1.5), math.log(1.5)])
    loss, _ = grpo_loss(lp, zero, torch.tensor([1.0, -1.0]), clip_range=0.2, adv_clip=5.0)
    assert loss.item() == pytest.approx((-1.2 + 1.5) / 2)
    loss, _ = grpo_loss(zero, zero, torch.tensor([100.0, -100.0]), clip_range=0.2, adv_clip=5.0)  # advantages clipped
    assert loss.item() == pytest.approx(0.0)
    loss, _ = grpo_loss(zero, zero, torch.tensor([100.0, 100.0]), clip_range=0.2, adv_clip=5.0)
    assert loss.item() == pytest.approx(-5.0)


def test_grpo_loss_gradient_on_policy_is_minus_advantage():
    lp = torch.zeros(2, requires_grad=True)
    loss, _ = grpo_loss(lp, torch.zeros(2), torch.tensor([2.0, -1.0]), clip_range=1e-4, adv_clip=5.0)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([-1.0, 0.5]))


# ---- end to end ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_process_run(tiny_sd3, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo1")
    run_dir = run_script(SCRIPT, tiny_sd35_flags(tiny_sd3, out) + ["--epochs", "2", "--kl-beta", "0.04"])
    return run_dir


def test_one_process_run(one_process_run):
    metrics = assert_common_run(one_process_run, epochs=2)
    for m in metrics:
        assert m["losses/on_policy_ratio_dev"] < 1e-3
        assert math.isfinite(m["losses/kl"]) and math.isfinite(m["losses/approx_kl"])
    assert metrics[1]["losses/kl"] > 0  # after one update the LoRA moved away from the base model


def test_resume_matches_uninterrupted_run(tiny_sd3, tmp_path, one_process_run):
    first = run_script(SCRIPT, tiny_sd35_flags(tiny_sd3, tmp_path / "a") + ["--epochs", "1", "--kl-beta", "0.04"])
    resumed = run_script(SCRIPT, tiny_sd35_flags(tiny_sd3, tmp_path / "a") + [
        "--epochs", "2", "--kl-beta", "0.04", "--resume", str(first / "checkpoints" / "epoch_00001")])
    assert resumed == first and [m["epoch"] for m in read_metrics(resumed)] == [0, 1]  # continues its run dir
    want = lora_tensors(one_process_run / "checkpoints" / "epoch_00002")
    got = lora_tensors(resumed / "checkpoints" / "epoch_00002")
    assert all(torch.allclose(w, g, atol=1e-6) for w, g in zip(want, got))


def test_two_process_torchrun(tiny_sd3, tmp_path):
    run_dir = run_script(SCRIPT, tiny_sd35_flags(tiny_sd3, tmp_path, precision="bf16") + ["--epochs", "2", "--batch-size", "2"],
                         nproc=2)
    for m in assert_common_run(run_dir, epochs=2):
        assert m["losses/on_policy_ratio_dev"] < 1e-3


def test_learning_brightness_rises(tiny_sd3, tmp_path):
    run_dir = run_script(SCRIPT, tiny_sd35_flags(tiny_sd3, tmp_path) + [
        "--epochs", "8", "--kl-beta", "0", "--learning-rate", "1e-2", "--clip-range", "0.2", "--eval-every", "100",
        "--save-every", "100"])
    assert_reward_rose(read_metrics(run_dir), window=2)


@pytest.mark.parametrize("flags,message", [
    (["--train-prompts", "missing.txt"], "does not exist"),
    (["--reward", "no_such_reward"], "no_such_reward"),
    (["--model", "/nonexistent/model"], "neither an existing local path"),
    (["--prompts-per-epoch", "3"], "do not split"),
    (["--updates-per-epoch", "3"], "--updates-per-epoch"),
    (["--reward", "ocr", "--train-prompts", "tests/assets/bad_ocr_prompts.txt"], "quoted"),
])
def test_bad_input_is_rejected_before_loading(tiny_sd3, tmp_path, flags, message):
    assert_bad_input(SCRIPT, tiny_sd35_flags(tiny_sd3, tmp_path) + flags, message)


def test_empty_prompt_file_is_rejected(tiny_sd3, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert_bad_input(SCRIPT, tiny_sd35_flags(tiny_sd3, tmp_path) + ["--train-prompts", str(empty)], "is empty")


def test_toy_reward_flag_is_the_default_of_the_harness():
    assert TOY_REWARD.endswith(":brightness")


def test_non_finite_loss_stops_with_message_and_keeps_checkpoint(tiny_sd3, tmp_path):
    flags = tiny_sd35_flags(tiny_sd3, tmp_path) + ["--epochs", "3", "--reward", "tests/toy_rewards.py:nan_after_two_batches",
                                                    "--eval-reward", TOY_REWARD]
    proc = run_script(SCRIPT, flags, check=False)
    assert proc.returncode != 0 and "non-finite" in proc.stderr.strip().splitlines()[-1]
    checkpoints = sorted((p for p in tmp_path.glob("*/checkpoints/*")), key=lambda p: p.name)
    assert [p.name for p in checkpoints] == ["epoch_00001"]
    assert all(torch.isfinite(t).all() for t in lora_tensors(checkpoints[0]))


def test_saved_lora_loads_into_the_diffusers_pipeline(tiny_sd3, one_process_run):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    pipe.load_lora_weights(str(one_process_run / "checkpoints" / "epoch_00002" / "lora"))
    image = pipe("a sign that says \"hi\"", num_inference_steps=2, height=32, width=32, output_type="pt").images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()


def test_eval_only_scores_a_checkpoint(tiny_sd3, tmp_path, one_process_run):
    ckpt = one_process_run / "checkpoints" / "epoch_00002"
    run_dir = run_script(SCRIPT, tiny_sd35_flags(tiny_sd3, tmp_path) + ["--eval-only", "--resume", str(ckpt)])
    assert_eval_only_reproduces(run_dir, one_process_run)
