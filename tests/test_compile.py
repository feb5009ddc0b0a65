"""The compiled path (--compile, each transformer block compiled in place) of the SD3.5 scripts,
on CPU inductor: the on-policy guard holds, nothing recompiles after the first epoch, and the
per-phase timings add up. grpo_sd35.py stands for the four SD3.5 scripts: its model segment,
where the compile happens, is theirs verbatim (tests/test_boilerplate.py); dance_grpo_flux.py's
compiled run is in tests/test_dance_grpo_flux.py."""

from scripts_harness import assert_common_run, run_script, tiny_sd35_flags


def test_compiled_grpo_stays_on_policy_and_compiles_once(tiny_sd3, tmp_path):
    """The KL's forward (LoRA off) and a ragged last eval batch are graph variants of their
    own. The reward's constant groups make the zero-advantage filter train micro-batches of 2
    in epochs 0 and 1 and of 4 in epoch 2: padded to the rollout's 4, they reuse its graphs."""
    flags = ["--epochs", "3", "--kl-beta", "0.04", "--compile", "--eval-every", "2",
             "--reward", "tests/toy_rewards.py:brightness_of_signs"]
    run_dir = run_script("grpo_sd35.py", tiny_sd35_flags(tiny_sd3, tmp_path) + flags)
    metrics = assert_common_run(run_dir, epochs=3)
    graphs = [m["perf/compiled_graphs"] for m in metrics]
    assert graphs[0] > 0 and graphs == [graphs[0]] * 3, graphs  # epochs 1 and 2 reuse them
    assert [m["charts/actual_batch_size"] for m in metrics] == [2, 2, 4]
    for m in metrics:  # clip-range 1e-4: the script warns above 1e-5
        assert m["losses/on_policy_ratio_dev"] <= 1e-5
