"""Hand-computed checks of sde.py. Every expected number below was worked out on paper from the formulas in the
issue / paper, with x = 1 and v = 2 everywhere, so a sign or factor change in any formula fails a test."""

import math

import pytest
import torch

from sde import flow_sigma_t, gaussian_log_prob, sde_step, shift_sigmas

SHAPE = (2, 3, 4, 4)  # (B, C, H, W)


def _const(value, dtype=torch.float32):
    return torch.full(SHAPE, value, dtype=dtype)


def _normal_logpdf(x, mean, std):
    return -((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)


# (kind, sigma, sigma_next, noise_level, sigma_max, expected mean, expected std)
HAND_CASES = [
    # flow, middle step: sigma_t = 0.7 * sqrt(0.5 / 0.5) = 0.7; mean = 1 - 0.049 + 2 * 1.245 * (-0.1) = 0.702
    ("flow", 0.5, 0.4, 0.7, None, 0.702, 0.7 * math.sqrt(0.1)),
    # flow, first step: sigma_t = 0.7 * sqrt(1 / (1 - 0.96)) = 3.5; mean = 1 * (1 - 12.25 * 0.04 / 2) - 0.04 * 2 = 0.675
    ("flow", 1.0, 0.96, 0.7, 0.96, 0.675, 3.5 * 0.2),
    # flow, last step to 0: sigma_t^2 = 0.49 / 9; mean = 1 - sigma_t^2 * 0.1 / 0.2 - 0.2 * (1 + sigma_t^2 * 0.9 / 0.2)
    ("flow", 0.1, 0.0, 0.7, None, 1 - 0.49 / 9 / 2 - 0.2 * (1 + 0.49 / 9 * 4.5), 0.7 / 3 * math.sqrt(0.1)),
    # dance: x0_hat = 1 - 0.5 * 2 = 0; mean = 1 - 0.2 + 0.045 * 1 / 0.25 * (-0.1) = 0.782
    ("dance", 0.5, 0.4, 0.3, None, 0.782, 0.3 * math.sqrt(0.1)),
    # dance at sigma = 1: x0_hat = -1; mean = 1 - 0.2 + 0.045 * (1 - 0) / 1 * (-0.1) = 0.7955
    ("dance", 1.0, 0.9, 0.3, None, 0.7955, 0.3 * math.sqrt(0.1)),
    # cps: x0_hat = 0, eps_hat = 2; std = 0.4 sin(0.4 pi); mean = sqrt(0.16 - std^2) * 2 = 0.8 cos(0.4 pi)
    ("cps", 0.5, 0.4, 0.8, None, 0.8 * math.cos(0.4 * math.pi), 0.4 * math.sin(0.4 * math.pi)),
    # cps, last step: sigma_next = 0 -> std 0, mean = x0_hat = 1 - 0.1 * 2 = 0.8
    ("cps", 0.1, 0.0, 0.8, None, 0.8, 0.0),
    # ode: x + v dt = 1 - 0.2
    ("ode", 0.5, 0.4, 0.0, None, 0.8, 0.0),
]


@pytest.mark.parametrize("kind,sigma,sigma_next,noise_level,sigma_max,want_mean,want_std", HAND_CASES)
def test_hand_computed_mean_std_and_log_prob(kind, sigma, sigma_next, noise_level, sigma_max, want_mean, want_std):
    x, v, prev = _const(1.0), _const(2.0), _const(0.5)
    sample, log_prob, mean, std = sde_step(v, x, sigma, sigma_next, kind, noise_level, prev_sample=prev, sigma_max=sigma_max)
    assert torch.allclose(mean, torch.full(SHAPE, want_mean), atol=1e-6)
    assert torch.allclose(std.expand(SHAPE), torch.full(SHAPE, want_std), atol=1e-6)
    assert torch.equal(sample, prev)
    assert log_prob.shape == (SHAPE[0],) and log_prob.dtype == torch.float32
    if kind == "cps":  # upstream's constant- and variance-free form, also at sigma_next = 0 (std 0): -(0.5 - 0.8)^2
        want_lp = -((0.5 - want_mean) ** 2)
    elif want_std == 0:
        want_lp = 0.0
    else:
        want_lp = _normal_logpdf(0.5, want_mean, want_std)
    assert torch.allclose(log_prob, torch.full((SHAPE[0],), want_lp), rtol=1e-5, atol=1e-6)


def test_flow_sigma_t_uses_sigma_max_only_at_noise_end():
    got = flow_sigma_t(torch.tensor([1.0, 0.5]), 0.7, sigma_max=0.96)
    assert torch.allclose(got, torch.tensor([3.5, 0.7]))
    with pytest.raises(ValueError, match="sigma_max"):
        flow_sigma_t(1.0, 0.7)


def test_sd3_schedule_matches_reference_table():
    """SD3.5 scheduler (shift 3, 10 steps): noise std 0.700 at step 0 (via sigma_max = sigmas[1]) and 0.0063 last."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas
    x = torch.zeros(1, 4)
    stds = [sde_step(x, x, sigmas[i], sigmas[i + 1], "flow", 0.7, sigma_max=sigmas[1])[3].item() for i in range(10)]
    assert stds[0] == pytest.approx(0.700, abs=1e-3)
    assert stds[1] == pytest.approx(0.743, abs=1e-3)
    assert stds[9] == pytest.approx(0.0063, abs=1e-4)


@pytest.mark.parametrize("kind,noise_level", [("flow", 0.7), ("dance", 0.3), ("cps", 0.8)])
def test_sample_then_score_gives_same_log_prob(kind, noise_level):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    sample, lp, _, _ = sde_step(v, x, 0.7, 0.6, kind, noise_level, generator=g)
    _, lp2, _, _ = sde_step(v, x, 0.7, 0.6, kind, noise_level, prev_sample=sample)
    assert torch.equal(lp, lp2)
    assert torch.allclose(torch.exp(lp2 - lp), torch.ones(SHAPE[0]))


def test_generator_makes_sampling_reproducible():
    x, v = _const(1.0), _const(2.0)
    a = sde_step(v, x, 0.7, 0.6, "flow", 0.7, generator=torch.Generator().manual_seed(3))[0]
    b = sde_step(v, x, 0.7, 0.6, "flow", 0.7, generator=torch.Generator().manual_seed(3))[0]
    c = sde_step(v, x, 0.7, 0.6, "flow", 0.7, generator=torch.Generator().manual_seed(4))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_zero_noise_flow_equals_ode():
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    flow = sde_step(v, x, 0.7, 0.6, "flow", 0.0)
    ode = sde_step(v, x, 0.7, 0.6, "ode", 0.0)
    assert torch.allclose(flow[2], ode[2], atol=1e-7)
    assert torch.equal(flow[0], flow[2])  # deterministic: the sample is the mean
    assert torch.equal(ode[1], torch.zeros(SHAPE[0]))


def test_bf16_inputs_run_in_float32():
    g = torch.Generator().manual_seed(2)
    x, v = torch.randn(SHAPE, generator=g).bfloat16(), torch.randn(SHAPE, generator=g).bfloat16()
    sample, lp, mean, std = sde_step(v, x, 0.7, 0.6, "flow", 0.7, generator=g)
    assert sample.dtype == lp.dtype == mean.dtype == std.dtype == torch.float32
    ref_mean = sde_step(v.float(), x.float(), 0.7, 0.6, "flow", 0.7, prev_sample=sample)[2]
    assert torch.equal(mean, ref_mean)


@pytest.mark.parametrize("kind,noise_level", [("flow", 0.7), ("dance", 0.3), ("cps", 0.8)])
def test_empirical_noise_std_matches_returned_std(kind, noise_level):
    g = torch.Generator().manual_seed(5)
    x, v = torch.zeros(1, 200_000), torch.zeros(1, 200_000)
    sample, _, mean, std = sde_step(v, x, 0.7, 0.6, kind, noise_level, generator=g)
    assert (sample - mean).std().item() == pytest.approx(std.item(), rel=1e-2)


def test_log_prob_is_a_mean_over_elements():
    """The log-prob of an i.i.d. latent does not scale with its size (mean, not sum, reduction)."""
    g = torch.Generator().manual_seed(6)
    small, big = torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 64, 64)
    lp_small = sde_step(small, small, 0.7, 0.6, "flow", 0.7, generator=g)[1]
    lp_big = sde_step(big, big, 0.7, 0.6, "flow", 0.7, generator=g)[1]
    std = sde_step(small, small, 0.7, 0.6, "flow", 0.7)[3].item()
    expected = -0.5 - math.log(std) - 0.5 * math.log(2 * math.pi)  # E[log N(x; mu, s)] under x ~ N(mu, s)
    assert lp_small.item() == pytest.approx(expected, abs=0.15)
    assert lp_big.item() == pytest.approx(expected, abs=0.02)


def test_per_sample_sigmas_match_scalar_calls():
    g = torch.Generator().manual_seed(7)
    x, v, prev = (torch.randn(SHAPE, generator=g) for _ in range(3))
    sig, sig_next = torch.tensor([1.0, 0.5]), torch.tensor([0.9, 0.3])
    _, lp, mean, _ = sde_step(v, x, sig, sig_next, "flow", 0.7, prev_sample=prev, sigma_max=0.9)
    for i in range(2):
        _, lp_i, mean_i, _ = sde_step(v[i : i + 1], x[i : i + 1], sig[i].item(), sig_next[i].item(), "flow", 0.7,
                                      prev_sample=prev[i : i + 1], sigma_max=0.9)
        assert torch.allclose(mean[i], mean_i[0]) and torch.allclose(lp[i], lp_i[0])


def test_gaussian_log_prob_and_shift_by_hand():
    lp = gaussian_log_prob(torch.full((1, 3), 1.0), torch.zeros(1, 3), torch.full((1, 1), 2.0))
    assert lp.item() == pytest.approx(_normal_logpdf(1.0, 0.0, 2.0))
    assert torch.allclose(shift_sigmas(torch.tensor([1.0, 0.5, 0.0]), 3.0), torch.tensor([1.0, 0.75, 0.0]))


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown step kind"):
        sde_step(_const(0.0), _const(0.0), 0.5, 0.4, "euler", 0.7)


def test_cps_last_step_scores_a_given_sample_with_gradient():
    """Upstream (flow_grpo sde_type='cps') keeps -mean((x' - mu)^2) at sigma_next = 0, so a trained last step learns."""
    x, prev = _const(1.0), _const(0.5)
    v = _const(2.0).requires_grad_()
    _, log_prob, _, _ = sde_step(v, x, 0.1, 0.0, "cps", 0.8, prev_sample=prev)  # mean = x - 0.1 v = 0.8
    assert torch.allclose(log_prob, torch.full((SHAPE[0],), -0.09), atol=1e-6)
    log_prob.sum().backward()  # d/dv -(0.5 - (1 - 0.1 v))^2 = -2 (0.5 - 0.8) 0.1 / n per element = 0.06 / n
    assert torch.allclose(v.grad, torch.full(SHAPE, 0.06 / (3 * 4 * 4)), atol=1e-7)
    sampled, log_prob, mean, _ = sde_step(v.detach(), x, 0.1, 0.0, "cps", 0.8)  # sampling: x' = mean, log_prob 0
    assert torch.equal(sampled, mean) and torch.equal(log_prob, torch.zeros(SHAPE[0]))
