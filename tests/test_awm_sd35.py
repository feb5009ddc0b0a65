"""awm_sd35.py: hand-computed log-prob, loss and timestep units, the SA-Solver and SDE samplers
on a Gaussian toy, then end-to-end runs on the tiny offline SD3 pipeline."""

import math
from functools import partial

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SASolverScheduler

from awm_sd35 import (Text, awm_log_prob, awm_loss, ode_sample, predict_velocity,
                      sa_solver_sample, sde_sample, stratified_timestep_indices)
from sde import sde_step
from scripts_harness import (assert_accuracy_rose, assert_bad_input, assert_common_run,
                             learning_run, read_metrics, run_script,
                             tiny_sd35_flags)
from scripts_harness import assert_ema_moves_once_a_step

SCRIPT = "awm_sd35.py"
# tiny runs: 2 samples x 2 timesteps per forward
FAST = ["--train-batch-size", "2", "--train-timesteps", "2"]


# ---- units ---------------------------------------------------------------------------------
@pytest.mark.quick
def test_awm_log_prob_by_hand():
    x0, noise = torch.randn(2, 4, 2, 2), torch.randn(2, 4, 2, 2)
    offset = torch.tensor([0.5, 2.0]).view(2, 1, 1, 1)
    v = (noise - x0) + offset  # flow-matching error l = offset^2 exactly: (0.25, 4)
    t = torch.tensor([0.5, 0.25])
    got = awm_log_prob(v, x0, noise, t, power=0.25)
    assert got.dtype == torch.float64 and got.shape == (2,)
    want = [-(0.5 / 0.25) * ((0.25 + 1e-10) ** 0.25 - 1e-10**0.25),
            -(0.25 / 0.25) * ((4 + 1e-10) ** 0.25 - 1e-10**0.25)]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6)


@pytest.mark.quick
def test_awm_log_prob_scalar_t_and_power():
    x0, noise = torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1)
    v = torch.full((1, 1, 1, 1), 3.0)  # l = 9
    want = -(0.5 / 0.5) * (9**0.5 - 1e-5)
    assert awm_log_prob(v, x0, noise, 0.5, power=0.5).item() == pytest.approx(want)


@pytest.mark.quick
def test_ghuber_gradient_down_weights_large_errors():
    # d logp / d l = -t (l + eps)^(p - 1): with l = 1/16 and 16 the weights are t * 8 and t / 8
    # (p = 1/4)
    zeros = torch.zeros(1, 1, 1, 1)
    for error, want in ((1 / 16, 8.0), (16.0, 1 / 8)):
        # x0 = noise = 0, so the error is v^2
        v = torch.tensor(error, dtype=torch.float64).sqrt().view(1, 1, 1, 1).requires_grad_(True)
        awm_log_prob(v, zeros, zeros, 0.5).sum().backward()
        # the chain rule: d error / dv = 2v
        assert v.grad.item() == pytest.approx(-0.5 * want * 2 * v.item(), rel=1e-6)


@pytest.mark.quick
def test_awm_policy_loss_value_and_gradient():
    lp = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([10.0, -2.5, 1.0])  # clipped to +-5, divided by 5: (1, -0.5, 0.2)
    v = torch.zeros(3, 1, 1, 1)
    loss, stats = awm_loss(log_prob=lp, advantages=adv, v=v, v_base=None, v_anchor=None,
                           adv_clip=5.0, kl_beta=0.5, anchor_beta=0.5, accum_steps=1)
    # no KL terms, no accumulation: the loss is the policy term
    assert loss.item() == pytest.approx(stats["policy_loss"])
    assert stats["kl"] == 0 and stats["anchor_kl"] == 0
    # the ratio exp(logp - logp.detach()) is exactly 1: the value is -mean(A) for any logp
    assert stats["policy_loss"] == pytest.approx(-(1 - 0.5 + 0.2) / 3)
    loss.backward()  # and the gradient -A / N times the log-prob's
    assert torch.allclose(lp.grad, torch.tensor([-1.0, 0.5, -0.2], dtype=torch.float64) / 3)


@pytest.mark.quick
def test_awm_loss_adds_both_kls_and_divides_by_the_accumulation():
    lp = torch.zeros(2, dtype=torch.float64)
    v = torch.ones(2, 1, 1, 2)
    v_base, v_anchor = torch.zeros(2, 1, 1, 2), torch.full((2, 1, 1, 2), 3.0)  # (v - ref)^2: 1, 4
    loss, stats = awm_loss(log_prob=lp, advantages=torch.tensor([5.0, 0.0]), v=v,
                           v_base=v_base, v_anchor=v_anchor, adv_clip=5.0, kl_beta=0.1,
                           anchor_beta=2.0, accum_steps=4)
    assert stats == {"policy_loss": pytest.approx(-0.5), "kl": 1, "anchor_kl": 4,
                     "kl_loss": pytest.approx(0.1), "anchor_loss": 8}
    assert loss.item() == pytest.approx((-0.5 + 0.1 * 1 + 2.0 * 4) / 4)


@pytest.mark.quick
def test_stratified_picker_discrete_wo_init():
    # 14 steps x 0.9 -> M = 12; floor(linspace(1, 12, 7)) = (1, 2, 4, 6, 8, 10, 12):
    # strata [1,2) [2,4) ... [10,12)
    lows, highs = torch.tensor([1, 2, 4, 6, 8, 10]), torch.tensor([2, 4, 6, 8, 10, 12])
    gen = torch.Generator().manual_seed(0)
    draws = [stratified_timestep_indices(12, 6, "discrete_wo_init", gen) for _ in range(400)]
    seen = torch.stack(draws)
    assert seen.shape == (400, 6) and seen.dtype == torch.long
    # exactly one per stratum, never index 0 (sigma = 1)
    assert ((seen >= lows) & (seen < highs)).all()
    for j in range(6):  # every index of every stratum is drawn
        assert set(seen[:, j].tolist()) == set(range(lows[j], highs[j]))


@pytest.mark.quick
def test_stratified_picker_discrete_may_draw_sigma_one():
    gen = torch.Generator().manual_seed(0)
    seen = torch.stack([stratified_timestep_indices(12, 6, "discrete", gen) for _ in range(200)])
    # floor(linspace(0, 12, 7)) = 0, 2, ..., 12
    assert set(seen[:, 0].tolist()) == {0, 1} and (seen < 12).all()
    # a grid too short for K strata repeats lower ends instead of leaving [1, M)
    seen = stratified_timestep_indices(3, 2, "discrete_wo_init", gen)  # strata [1,2) [2,3)
    assert seen.tolist() == [1, 2]


class GaussianVelocity(torch.nn.Module):
    """Exact velocity for data x0 ~ N(MEAN, 1) per element, in the transformer's call signature
    (timestep = 1000 t)."""

    MEAN = 3.0

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections,
                return_dict):
        s = (timestep / 1000).view(-1, 1, 1, 1)
        # E[x0 | x_s]
        x0 = self.MEAN + (1 - s) / ((1 - s) ** 2 + s**2) * (hidden_states - (1 - s) * self.MEAN)
        return ((hidden_states - x0) / s,)


def sa_sample(tau, window=(0.3, 0.9), seed=1, n=4000):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(14)
    solver = SASolverScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                               predictor_order=2, corrector_order=2)
    noise = torch.randn(n, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    return sa_solver_sample(gaussian_velocity(n), solver, noise, scheduler.sigmas.float(), tau,
                            window, torch.Generator().manual_seed(seed))


def gaussian_velocity(n):
    """GaussianVelocity through the script's predict_velocity, for n samples, no CFG."""
    text = Text(torch.zeros(n, 1, 1), torch.zeros(n, 1))
    return partial(predict_velocity, GaussianVelocity(), text=text, negative=text,
                   guidance_scale=1.0)


@pytest.mark.quick
def test_sa_solver_sample_reaches_the_data_distribution():
    ode, sde = sa_sample(0.0), sa_sample(0.4)
    # diffusers' own flow grid would stop at sigma = 0.19 (mean 0.81 * 3); this one reaches data
    for x in (ode, sde):
        assert abs(x.mean().item() - GaussianVelocity.MEAN) < 0.03
        assert abs(x.std().item() - 1) < 0.2
    # upstream's own SA-Solver (AWM repo be51372, flow_grpo/diffusers_patch/sa_solver.py) on
    # this toy and noise, run offline: tau 0: mean 2.98756, std 1.10127, per-sample max |diff|
    # to ours 0 (with diffusers' first corrector left on, 0.006: the first two samples below
    # would move by up to 3e-3); tau 0.4 (other noise draws): std 1.12053
    assert ode.mean().item() == pytest.approx(2.98756, abs=1e-4)
    assert ode.std().item() == pytest.approx(1.10127, abs=1e-4)
    upstream_first = [1.76251, 1.733436, 2.722014, 2.521072, 3.92711, 3.755326, 2.650282, 0.677903]
    assert ode[:2].flatten().tolist() == pytest.approx(upstream_first, abs=1e-5)
    assert sde.std().item() == pytest.approx(1.12053, abs=0.015)


@pytest.mark.quick
def test_sa_solver_sample_noise_only_inside_the_window():
    # tau 0: an ODE, the generator is unused
    assert torch.equal(sa_sample(0.0, seed=1), sa_sample(0.0, seed=2))
    # no step lands in the window
    assert torch.equal(sa_sample(0.4, window=(2.0, 3.0), seed=1), sa_sample(0.0))
    assert not torch.equal(sa_sample(0.4, seed=1), sa_sample(0.4, seed=2))


@pytest.mark.quick
def test_sde_sample_is_eulers_ode_or_the_flow_sde_step_by_step():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    sigmas, velocity = scheduler.sigmas.float(), gaussian_velocity(3)
    noise = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    # 'ode': eval's Euler sampler, whatever the noise level; the generator is never drawn from
    gen = torch.Generator().manual_seed(5)
    assert torch.equal(sde_sample(velocity, noise, sigmas, "ode", 0.7, gen),
                       ode_sample(velocity, noise, sigmas))
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(5).get_state())
    # 'flow': sde.py's Flow-GRPO step at every step, drawing from the generator in order
    sample = sde_sample(velocity, noise, sigmas, "flow", 0.7, torch.Generator().manual_seed(1))
    gen, x = torch.Generator().manual_seed(1), noise
    for i in range(6):
        x = sde_step(velocity(x, sigmas[i]), x, sigmas[i], sigmas[i + 1], "flow", 0.7,
                     generator=gen, second_sigma=sigmas[1])[0]
    assert torch.equal(sample, x)
    other = sde_sample(velocity, noise, sigmas, "flow", 0.7, torch.Generator().manual_seed(2))
    assert not torch.equal(sample, other)


# ---- end to end ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_process_run(tiny_run):
    """The contract's run (scripts_harness.ONE_PROCESS_FLAGS), shared with
    tests/test_contract.py."""
    return tiny_run(SCRIPT)


@pytest.mark.quick
def test_one_process_run(one_process_run):
    metrics = assert_common_run(one_process_run, epochs=2)
    for epoch, m in enumerate(metrics):
        assert m["charts/global_step"] == epoch + 1  # exactly one optimizer step per epoch
        assert m["charts/anchor_decay"] == pytest.approx(min(0.3, 0.001 * (epoch + 1)))
        assert math.isfinite(m["losses/fm_loss"]) and m["losses/fm_loss"] > 0
    # LoRA B = 0: LoRA == base == anchor; after one step both moved apart
    assert metrics[0]["losses/kl"] == 0 and metrics[0]["losses/anchor_kl"] == 0
    assert metrics[1]["losses/kl"] > 0 and metrics[1]["losses/anchor_kl"] > 0
    for m in metrics:  # each KL reaches the loss weighted by its flag (not their defaults)
        # relative only: anchor_kl is ~1e-12, inside pytest.approx's default absolute 1e-12
        assert m["losses/kl_loss"] == pytest.approx(0.01 * m["losses/kl"], rel=1e-9, abs=0)
        anchor = 0.5 * m["losses/anchor_kl"]
        assert m["losses/anchor_loss"] == pytest.approx(anchor, rel=1e-9, abs=0)


def test_anchor_trails_the_lora(one_process_run):
    checkpoints = one_process_run / "checkpoints"
    states = [torch.load(checkpoints / f"epoch_{epoch:05d}" / "state.pt", map_location="cpu")
              for epoch in (1, 2)]
    anchors_1, anchors_2 = states[0]["extra"]["anchor"], states[1]["extra"]["anchor"]
    loras_2 = states[1]["lora"]
    for before, after in zip(anchors_1, anchors_2):
        assert before.shape == after.shape
    # anchor_2 = d anchor_1 + (1 - d) lora_2 with d = min(0.3, 0.001 * 2)
    decay = 0.002
    for anchor_1, anchor_2, lora_2 in zip(anchors_1, anchors_2, loras_2):
        assert torch.allclose(anchor_2, decay * anchor_1 + (1 - decay) * lora_2, atol=1e-6)
    assert any(not torch.equal(before, after) for before, after in zip(anchors_1, anchors_2))
    assert any(not torch.equal(anchor, lora) for anchor, lora in zip(anchors_2, loras_2))


@pytest.mark.quick
def test_the_ema_moves_once_an_optimizer_step(one_process_run):
    assert_ema_moves_once_a_step(one_process_run, decay=0.99)  # the default --ema-decay


def test_two_process_torchrun(tiny_run):
    metrics = read_metrics(tiny_run(SCRIPT, nproc=2))  # the contract's (TWO_PROCESS_FLAGS)
    for epoch, m in enumerate(metrics):
        assert m["charts/global_step"] == epoch + 1


def test_euler_sde_sampler_runs(tiny_sd3, tmp_path):
    run_dir = run_script(SCRIPT, tiny_sd35_flags(tiny_sd3, tmp_path) + FAST + [
        "--epochs", "1", "--sampler", "flow_sde", "--noise-level", "0.7"])
    assert_common_run(run_dir, epochs=1)


# README's AWM demo, with ODE rollouts like the eval's (with the default SA-Solver SDE rollouts
# an 8-epoch run gained +0.010, -0.010 at seeds 42, 2 on the earlier toy and lenient reward);
# run in the background from the session's start (scripts_harness.LEARNING_RUNS); `--toy`: the
# demo's flags
LEARNING_FLAGS = ["--toy", "--epochs", "32"]


def test_learning_toy_accuracy_rises(tmp_path):
    # toy world, the AWM demo: held-out exact accuracy (strict counting) on the reporting noise
    # (eval seeds 100-115) after 32 epochs rose by +0.029 (seed 42, this test: 0.528 -> 0.557),
    # +0.029 (seed 1), +0.076 (seed 2), each ± 0.018 (benchmarks/toy_demos.jsonl, whose evals
    # run in batches of 8: +0.030 at seed 42); a run that changes nothing gains exactly 0. The
    # base: scored once for the three SD3 scripts that share it (scripts_harness.SHARED_BASE)
    base, trained, _ = learning_run(SCRIPT, LEARNING_FLAGS, tmp_path)
    assert_accuracy_rose(base, trained)


@pytest.mark.quick
@pytest.mark.parametrize("flags,message", [
    (["--train-prompts", "missing.txt"], "does not exist"),
    (["--reward", "no_such_reward"], "no_such_reward"),
    (["--prompts-per-epoch", "3", "--batch-size", "8"], "do not split"),
    (["--train-batch-size", "3"], "--train-batch-size 3"),
    (["--num-steps", "2"], "leaves no training grid points"),
])
def test_bad_input_is_rejected_before_training(tiny_sd3, tmp_path, flags, message):
    flags = tiny_sd35_flags(tiny_sd3, tmp_path) + FAST + ["--epochs", "1"] + flags
    assert_bad_input(SCRIPT, flags, message)


