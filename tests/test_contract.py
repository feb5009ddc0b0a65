"""The contract every script keeps, whatever its algorithm: the shared behaviour a researcher's
copy of a script inherits. A copy (`cp grpo_sd35.py rloo_sd35.py`, then its ALGO LOGIC edited) is
a supported start once it passes

    pytest tests/test_contract.py --script rloo_sd35.py

(docs/write_your_own.md). Without --script: the five shipped scripts. A script runs on its tiny
random pipeline (SD3.5 or FLUX, told by its pipeline class), with the tiny flags and, for a
shipped script, its own (scripts_harness.ONE_PROCESS_FLAGS); it must
- finish two epochs in one process: finite losses, a LoRA that moved, checkpoints, eval sheets,
  model cards, the on-policy ratio exactly 1 where it has the check, and its push to the Hub;
- continue a checkpoint bit for bit from `--resume` alone (LoRA, EMA, snapshots, AdamW);
- run under `torchrun --nproc_per_node 2` (gloo, bf16);
- save LoRAs that diffusers loads as the same weights, and that generate;
- reject bad input in one line, and stop on a NaN reward in one line, its checkpoint intact.
The budgets and the verbatim-copy checks bind the shipped scripts only (test_boilerplate.py)."""

import pytest
import torch

from scripts_harness import (NAN_REWARD, assert_bad_input, assert_common_run, assert_pushed,
                             assert_same_state, assert_stopped_at_the_nan_reward,
                             contract_flags, cut_back_copy, is_flux, read_metrics, run_script)


def on_policy_devs(metrics: list[dict]) -> list[tuple[float, float]]:
    """Each epoch's (max |ratio - 1|, clipped fraction) before its first update, where the
    script logs them (its algorithm re-scores its rollouts)."""
    return [(m["losses/on_policy_ratio_dev"], m["losses/on_policy_clipfrac"]) for m in metrics
            if "losses/on_policy_ratio_dev" in m]


@pytest.mark.quick
def test_one_process_run_leaves_a_whole_run(contract_script, tiny_run):
    run_dir = tiny_run(contract_script)
    metrics = assert_common_run(run_dir, epochs=2)
    # before the first update the policy is the rollout's: the ratio is 1, bit for bit
    assert all(devs == (0.0, 0.0) for devs in on_policy_devs(metrics)), on_policy_devs(metrics)
    assert_pushed(run_dir, contract_script, epochs=2)  # its card, sheet and LoRA


@pytest.mark.quick
def test_resume_continues_bit_for_bit(contract_script, tiny_run, tmp_path):
    run_dir = tiny_run(contract_script)
    first = cut_back_copy(run_dir, tmp_path)  # as if it had stopped after epoch 1
    # no flag but where to resume: the rest is the checkpoint's (--no-push-to-hub: given wins)
    resumed = run_script(contract_script, [
        "--resume", str(first / "checkpoints" / "epoch_00001"), "--output-dir", str(tmp_path),
        "--no-push-to-hub"])
    assert resumed == first  # it continues its run directory
    assert [m["epoch"] for m in read_metrics(resumed)] == [0, 1]
    assert_same_state(resumed / "checkpoints" / "epoch_00002",
                      run_dir / "checkpoints" / "epoch_00002")


def test_two_processes(contract_script, tiny_run):
    metrics = assert_common_run(tiny_run(contract_script, nproc=2), epochs=2)
    assert all(dev < 1e-3 for dev, _ in on_policy_devs(metrics))  # bf16 under torchrun


@pytest.mark.quick
def test_saved_loras_load_into_diffusers_as_the_same_weights(contract_script, tiny_run):
    """Each checkpoint folder loads with `pipe.load_lora_weights` (its card's snippet) into the
    adapter the script trained, tensor for tensor, and the pipeline generates with it."""
    from diffusers import DiffusionPipeline

    last = tiny_run(contract_script) / "checkpoints" / "epoch_00002"
    state = torch.load(last / "state.pt", map_location="cpu", weights_only=False)
    pipe = DiffusionPipeline.from_pretrained(state["args"]["model"])
    for folder, key in [("lora", "lora"), ("ema_lora", "ema")]:
        pipe.load_lora_weights(str(last / folder), adapter_name=folder)
        loaded = [p.detach() for name, p in pipe.transformer.named_parameters()
                  if f".{folder}." in name]
        assert len(loaded) == len(state[key])
        assert all(torch.equal(a, b) for a, b in zip(loaded, state[key])), folder
    images = pipe("a sign", num_inference_steps=2, height=32, width=32, output_type="pt").images
    assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all()


@pytest.mark.quick
def test_bad_input_is_rejected_in_one_line(contract_script, tiny_sd3, tiny_flux, tmp_path):
    model = tiny_flux if is_flux(contract_script) else tiny_sd3
    flags = contract_flags(contract_script, model, tmp_path)
    assert_bad_input(contract_script, flags + ["--resolution", "33"],
                     "--resolution 33 is not a positive multiple of")
    missing = str(tmp_path / "none.txt")
    assert_bad_input(contract_script, flags + ["--test-prompts", missing],
                     f"error: prompt file {missing!r} does not exist (docs/usage.md: prompt sets)")


def test_a_nan_reward_stops_in_one_line(contract_script, tiny_sd3, tiny_flux, tmp_path):
    model = tiny_flux if is_flux(contract_script) else tiny_sd3
    flags = contract_flags(contract_script, model, tmp_path) + NAN_REWARD
    assert_stopped_at_the_nan_reward(run_script(contract_script, flags, check=False), tmp_path)
