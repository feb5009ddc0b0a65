"""Hand-computed checks of sde.py.

Every expected number below was worked out on paper from the formulas in the
issue and the papers, with x = 1 and v = 2 everywhere, so a sign or factor
change in any formula fails a test.
"""

import math
from pathlib import Path

import pytest
import torch

from sde import (dpm_step, dppo_keep, dppo_kl_std, flash_sigmas, flow_sigma_t, gaussian_log_prob,
                 ratio_norm_log_ratio, sde_step, sde_steps, sde_window, shift_sigmas, step_kl)

pytestmark = pytest.mark.quick  # all of this file: `pytest -m quick`

SHAPE = (2, 3, 4, 4)  # (B, C, H, W)
BATCH = SHAPE[0]


def constant(value: float, dtype=torch.float32) -> torch.Tensor:
    return torch.full(SHAPE, value, dtype=dtype)


def normal_log_pdf(x: float, mean: float, std: float) -> float:
    return -((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)


def random_latents(seed: int, count: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=generator) for _ in range(count)]


# (kind, sigma, sigma_next, noise_level, second_sigma, expected mean, expected std)
HAND_CASES = [
    # flow, middle step: sigma_t = 0.7 * sqrt(0.5 / 0.5) = 0.7;
    # mean = 1 - 0.049 + 2 * 1.245 * (-0.1) = 0.702
    ("flow", 0.5, 0.4, 0.7, None, 0.702, 0.7 * math.sqrt(0.1)),
    # flow, first step: sigma_t = 0.7 * sqrt(1 / (1 - 0.96)) = 3.5;
    # mean = 1 * (1 - 12.25 * 0.04 / 2) - 0.04 * 2 = 0.675
    ("flow", 1.0, 0.96, 0.7, 0.96, 0.675, 3.5 * 0.2),
    # flow, last step to 0: sigma_t^2 = 0.49 / 9;
    # mean = 1 - sigma_t^2 * 0.1 / 0.2 - 0.2 * (1 + sigma_t^2 * 0.9 / 0.2)
    ("flow", 0.1, 0.0, 0.7, None, 1 - 0.49 / 9 / 2 - 0.2 * (1 + 0.49 / 9 * 4.5),
     0.7 / 3 * math.sqrt(0.1)),
    # dance: x0_hat = 1 - 0.5 * 2 = 0; mean = 1 - 0.2 + 0.045 * 1 / 0.25 * (-0.1) = 0.782
    ("dance", 0.5, 0.4, 0.3, None, 0.782, 0.3 * math.sqrt(0.1)),
    # dance at sigma = 1: x0_hat = -1; mean = 1 - 0.2 + 0.045 * (1 - 0) / 1 * (-0.1) = 0.7955
    ("dance", 1.0, 0.9, 0.3, None, 0.7955, 0.3 * math.sqrt(0.1)),
    # cps: x0_hat = 0, eps_hat = 2; std = 0.4 sin(0.4 pi);
    # mean = sqrt(0.16 - std^2) * 2 = 0.8 cos(0.4 pi)
    ("cps", 0.5, 0.4, 0.8, None, 0.8 * math.cos(0.4 * math.pi), 0.4 * math.sin(0.4 * math.pi)),
    # cps, last step: sigma_next = 0 -> std 0, mean = x0_hat = 1 - 0.1 * 2 = 0.8
    ("cps", 0.1, 0.0, 0.8, None, 0.8, 0.0),
    # ode: x + v dt = 1 - 0.2
    ("ode", 0.5, 0.4, 0.0, None, 0.8, 0.0),
]


@pytest.mark.parametrize(
    "kind,sigma,sigma_next,noise_level,second_sigma,want_mean,want_std", HAND_CASES
)
def test_hand_computed_mean_std_and_log_prob(
    kind, sigma, sigma_next, noise_level, second_sigma, want_mean, want_std
):
    x, v, given = constant(1.0), constant(2.0), constant(0.5)
    sample, log_prob, mean, std = sde_step(
        v, x, sigma, sigma_next, kind, noise_level, prev_sample=given, second_sigma=second_sigma
    )
    assert torch.allclose(mean, torch.full(SHAPE, want_mean), atol=1e-6)
    assert torch.allclose(std.expand(SHAPE), torch.full(SHAPE, want_std), atol=1e-6)
    assert torch.equal(sample, given)
    assert log_prob.shape == (BATCH,) and log_prob.dtype == torch.float32
    if kind == "cps":
        # upstream's constant- and variance-free form, also at sigma_next = 0 (std 0)
        want_log_prob = -((0.5 - want_mean) ** 2)
    elif want_std == 0:
        want_log_prob = 0.0
    else:
        want_log_prob = normal_log_pdf(0.5, want_mean, want_std)
    want = torch.full((BATCH,), want_log_prob)
    assert torch.allclose(log_prob, want, rtol=1e-5, atol=1e-6)


def test_flow_sigma_t_uses_second_sigma_only_at_noise_end():
    got = flow_sigma_t(torch.tensor([1.0, 0.5]), 0.7, second_sigma=0.96)
    assert torch.allclose(got, torch.tensor([3.5, 0.7]))
    with pytest.raises(ValueError, match="second_sigma"):
        flow_sigma_t(1.0, 0.7)


def test_sd3_schedule_matches_reference_table():
    """SD3.5 scheduler (shift 3, 10 steps): noise std 0.700 at step 0
    (via second_sigma = sigmas[1]) and 0.0063 at the last step."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas
    x = torch.zeros(1, 4)
    stds = []
    for i in range(10):
        step = sde_step(x, x, sigmas[i], sigmas[i + 1], "flow", 0.7, second_sigma=sigmas[1])
        stds.append(step[3].item())
    assert stds[0] == pytest.approx(0.700, abs=1e-3)
    assert stds[1] == pytest.approx(0.743, abs=1e-3)
    assert stds[9] == pytest.approx(0.0063, abs=1e-4)


@pytest.mark.parametrize("kind,noise_level", [("flow", 0.7), ("dance", 0.3), ("cps", 0.8)])
def test_sample_then_score_gives_same_log_prob(kind, noise_level):
    generator = torch.Generator().manual_seed(0)
    x, v = torch.randn(SHAPE, generator=generator), torch.randn(SHAPE, generator=generator)
    sample, sampled_log_prob, _, _ = sde_step(
        v, x, 0.7, 0.6, kind, noise_level, generator=generator
    )
    _, scored_log_prob, _, _ = sde_step(v, x, 0.7, 0.6, kind, noise_level, prev_sample=sample)
    assert torch.equal(sampled_log_prob, scored_log_prob)
    ratio = torch.exp(scored_log_prob - sampled_log_prob)
    assert torch.allclose(ratio, torch.ones(BATCH))


def test_generator_makes_sampling_reproducible():
    x, v = constant(1.0), constant(2.0)

    def sample(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return sde_step(v, x, 0.7, 0.6, "flow", 0.7, generator=generator)[0]

    assert torch.equal(sample(3), sample(3))
    assert not torch.equal(sample(3), sample(4))


def test_zero_noise_flow_equals_ode():
    x, v = random_latents(seed=1)
    flow_sample, _, flow_mean, _ = sde_step(v, x, 0.7, 0.6, "flow", 0.0)
    _, ode_log_prob, ode_mean, _ = sde_step(v, x, 0.7, 0.6, "ode", 0.0)
    assert torch.allclose(flow_mean, ode_mean, atol=1e-7)
    assert torch.equal(flow_sample, flow_mean)  # deterministic: the sample is the mean
    assert torch.equal(ode_log_prob, torch.zeros(BATCH))


def test_bf16_inputs_run_in_float32():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(SHAPE, generator=generator).bfloat16()
    v = torch.randn(SHAPE, generator=generator).bfloat16()
    sample, log_prob, mean, std = sde_step(v, x, 0.7, 0.6, "flow", 0.7, generator=generator)
    assert sample.dtype == log_prob.dtype == mean.dtype == std.dtype == torch.float32
    float32_mean = sde_step(v.float(), x.float(), 0.7, 0.6, "flow", 0.7, prev_sample=sample)[2]
    assert torch.equal(mean, float32_mean)


@pytest.mark.parametrize("kind,noise_level", [("flow", 0.7), ("dance", 0.3), ("cps", 0.8)])
def test_empirical_noise_std_matches_returned_std(kind, noise_level):
    generator = torch.Generator().manual_seed(5)
    x, v = torch.zeros(1, 200_000), torch.zeros(1, 200_000)
    sample, _, mean, std = sde_step(v, x, 0.7, 0.6, kind, noise_level, generator=generator)
    assert (sample - mean).std().item() == pytest.approx(std.item(), rel=1e-2)


def test_log_prob_is_a_mean_over_elements():
    """The log-prob of an i.i.d. latent does not scale with its size (mean, not sum)."""
    generator = torch.Generator().manual_seed(6)
    small, big = torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 64, 64)
    small_log_prob = sde_step(small, small, 0.7, 0.6, "flow", 0.7, generator=generator)[1]
    big_log_prob = sde_step(big, big, 0.7, 0.6, "flow", 0.7, generator=generator)[1]
    std = sde_step(small, small, 0.7, 0.6, "flow", 0.7)[3].item()
    # E[log N(x; mu, s)] under x ~ N(mu, s)
    expected = -0.5 - math.log(std) - 0.5 * math.log(2 * math.pi)
    assert small_log_prob.item() == pytest.approx(expected, abs=0.15)
    assert big_log_prob.item() == pytest.approx(expected, abs=0.02)


def test_per_sample_sigmas_match_scalar_calls():
    x, v, given = random_latents(seed=7, count=3)
    sigmas, sigmas_next = torch.tensor([1.0, 0.5]), torch.tensor([0.9, 0.3])
    _, log_prob, mean, _ = sde_step(
        v, x, sigmas, sigmas_next, "flow", 0.7, prev_sample=given, second_sigma=0.9
    )
    for i in range(2):
        row = slice(i, i + 1)
        _, row_log_prob, row_mean, _ = sde_step(
            v[row], x[row], sigmas[i].item(), sigmas_next[i].item(), "flow", 0.7,
            prev_sample=given[row], second_sigma=0.9,
        )
        assert torch.allclose(mean[i], row_mean[0])
        assert torch.allclose(log_prob[i], row_log_prob[0])


def test_gaussian_log_prob_and_shift_by_hand():
    x, mean, std = torch.full((1, 3), 1.0), torch.zeros(1, 3), torch.full((1, 1), 2.0)
    assert gaussian_log_prob(x, mean, std).item() == pytest.approx(normal_log_pdf(1.0, 0.0, 2.0))
    shifted = shift_sigmas(torch.tensor([1.0, 0.5, 0.0]), 3.0)
    assert torch.allclose(shifted, torch.tensor([1.0, 0.75, 0.0]))


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown step kind"):
        sde_step(constant(0.0), constant(0.0), 0.5, 0.4, "euler", 0.7)


def test_cps_last_step_scores_a_given_sample_with_gradient():
    """Upstream (flow_grpo sde_type='cps') keeps -mean((x' - mu)^2) at
    sigma_next = 0, so a trained last step learns."""
    x, given = constant(1.0), constant(0.5)
    v = constant(2.0).requires_grad_()
    # mean = x - 0.1 v = 0.8
    _, log_prob, _, _ = sde_step(v, x, 0.1, 0.0, "cps", 0.8, prev_sample=given)
    assert torch.allclose(log_prob, torch.full((BATCH,), -0.09), atol=1e-6)
    # d/dv -(0.5 - (1 - 0.1 v))^2 = -2 (0.5 - 0.8) 0.1 / n per element = 0.06 / n
    log_prob.sum().backward()
    elements = 3 * 4 * 4
    assert torch.allclose(v.grad, torch.full(SHAPE, 0.06 / elements), atol=1e-7)
    # sampling: x' = mean, log_prob 0
    sampled, log_prob, mean, _ = sde_step(v.detach(), x, 0.1, 0.0, "cps", 0.8)
    assert torch.equal(sampled, mean) and torch.equal(log_prob, torch.zeros(BATCH))


def test_sde_py_stays_readable():
    """Issue 41's budget for the shared math: at most 280 lines of at most 100 columns."""
    lines = (Path(__file__).parent.parent / "sde.py").read_text().splitlines()
    assert len(lines) <= 280
    assert [line for line in lines if len(line) > 100] == []


# ---- Issue 28: Flow-DPPO's mask and KL, MixGRPO's window ----
# Golden numbers from the upstream rules (project notes: a trimmed re-implementation of
# Tencent-Hunyuan/UniRL@1a7b501 unirl/algorithms/flowdppo.py::_flowdppo_kl_adv_loss and
# Tencent-Hunyuan/MixGRPO@e5cdd6a fastvideo/utils/grpo_states.py::GRPOTrainingStates, run
# on these inputs).

def test_step_kl_is_the_gaussian_kl_over_the_element_count():
    gen = torch.Generator().manual_seed(0)
    mean, other = torch.randn(3, 4, 2, 2, generator=gen), torch.randn(3, 4, 2, 2, generator=gen)
    std = torch.tensor([0.5, 1.0, 2.0]).view(3, 1, 1, 1)
    for b in range(3):
        p = torch.distributions.Normal(mean[b].flatten(), std[b].flatten().expand(16))
        q = torch.distributions.Normal(other[b].flatten(), std[b].flatten().expand(16))
        exact = torch.distributions.kl_divergence(p, q).sum()  # a sum over the 16 elements
        assert step_kl(mean, other, std)[b].item() == pytest.approx(exact.item() / 16, rel=1e-5)
    assert step_kl(mean, mean, std).abs().max() == 0


def test_dppo_keep_drops_only_aggressive_moves_past_the_threshold():
    ratio = torch.tensor([1.1, 0.9, 1.1, 0.9, 1.1, 0.9, 1.1, 0.9])
    advantage = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0])
    kl = torch.tensor([2e-5] * 4 + [5e-6] * 4)
    keep = dppo_keep(ratio, advantage, kl, 1e-5)
    # over the threshold: A > 0 pushing ratio up, A < 0 pushing it down are dropped; the two
    # corrective moves stay; under the threshold everything stays
    assert keep.tolist() == [False, False, True, True, True, True, True, True]
    assert dppo_keep(torch.ones(2), torch.tensor([1.0, -1.0]), torch.ones(2), 1e-5).all()
    assert dppo_keep(torch.tensor([2.0]), torch.zeros(1), torch.ones(1), 1e-5).all()  # A = 0


def test_dppo_golden_case_from_upstreams_rule():
    """B 4, three steps with UniRL's sigma_t (eta 0.7, SD3 shift 3, 10 steps: steps 0, 2, 4),
    mu_old 0, mu_new = d on a 1x2x2 latent: UniRL's loss -0.0744814, a quarter masked."""
    d = torch.tensor([[0, 1e-3, 5e-3], [2e-3, 2e-3, 2e-3], [1e-2, 0, 1e-2], [5e-3, 5e-3, 5e-3]])
    log_ratio = torch.tensor([[.1, .1, -.1], [.1, -.1, .1], [.2, 0, -.2], [-.1, .1, -.1]])
    advantage = torch.tensor([1.0, 1.0, -1.0, -1.0])
    sigma_t = [1.32288, 0.53169, 0.38774]
    terms, keeps = [], []
    for step in range(3):
        mean = d[:, step].view(4, 1, 1, 1).expand(4, 1, 2, 2)
        kl = step_kl(mean, torch.zeros_like(mean), torch.tensor(sigma_t[step]))
        keep = dppo_keep(log_ratio[:, step].exp(), advantage, kl, 1e-5)
        keeps.append(keep)
        terms.append(torch.where(keep, -advantage * log_ratio[:, step].exp(), 0.0))
    keep = torch.stack(keeps, 1)
    assert keep.tolist() == [[True, True, True], [True, True, False], [True, True, False],
                             [True, True, False]]
    assert torch.stack(terms).mean().item() == pytest.approx(-0.0744814, abs=1e-6)


# ---- Issue 41: the 2026 recipes as upstream runs them ----
# Golden numbers below were produced by copying upstream's own functions into a scratch folder
# outside this repository (with stubs for their package imports), running them on the inputs
# written here, and pasting their outputs; torch 2.13.0 (CPU), numpy 2.4.6, diffusers 0.42.1.
# UniRL: Tencent-Hunyuan/UniRL@1a7b501; MixGRPO: Tencent-Hunyuan/MixGRPO@e5cdd6a.
UNIRL_GRID = [1.0, 0.964285671710968, 0.9230769872665405, 0.8749999403953552, 0.8181818127632141,
              0.75, 0.6666666865348816, 0.5625, 0.4285714626312256, 0.25, 0.0]


def unirl_grid() -> torch.Tensor:
    return shift_sigmas(torch.linspace(1, 0, 11), 3.0)


def test_unirl_sd3_grid_is_shifted_uniform():
    """UniRL's SD3 sigma grid (unirl/sde/runtime.py get_sigma_schedule(10, shift=3.0), static
    branch), printed: shift(linspace(1, 0, 11)), not diffusers' SD3 grid (whose second-to-last
    sigma is 0.0089, UniRL's 0.25)."""
    assert unirl_grid().tolist() == UNIRL_GRID


def test_dppo_kl_std_is_unirls_at_every_step():
    """UniRL's FlowDPPO._compute_sigma_t (unirl/algorithms/flowdppo.py), called unbound on a
    segment with these sigmas, eta 0.7, all 10 steps of UniRL's grid; then steps 0-4 of
    diffusers' SD3 grid (FlowMatchEulerDiscreteScheduler(shift=3).set_timesteps(10))."""
    want = [1.322877049446106, 0.7383700013160706, 0.5316891074180603, 0.4414590299129486,
            0.3877381682395935, 0.34999993443489075, 0.31950485706329346, 0.29047369956970215,
            0.2561738193035126, 0.20207259058952332]
    grid = unirl_grid()
    got = dppo_kl_std(grid[:-1], grid[1:], 0.7)
    assert torch.allclose(got, torch.tensor(want), rtol=1e-6, atol=0)
    x = torch.zeros(1, 4)  # the step's own std: equal from step 1 on, 0.70 at step 0
    stds = [sde_step(x, x, grid[i], grid[i + 1], "flow", 0.7, second_sigma=grid[1])[3].item()
            for i in range(10)]
    assert stds[0] == pytest.approx(0.7, abs=1e-6)
    assert stds[1:] == pytest.approx(want[1:], rel=1e-6)
    from diffusers import FlowMatchEulerDiscreteScheduler
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    diffusers_grid = scheduler.sigmas.float()
    got = dppo_kl_std(diffusers_grid[:5], diffusers_grid[1:6], 0.7)
    want = [1.3977357149124146, 0.7429640889167786, 0.5361523032188416, 0.4458971321582794,
            0.39179420471191406]
    assert torch.allclose(got, torch.tensor(want), rtol=1e-6, atol=0)


def dppo_terms(d, log_ratio, advantage, sigma_t, threshold):
    """Our mask and loss terms over (B, steps) with mu_old 0, mu_new = d on a 1x2x2 latent."""
    terms, keeps = [], []
    for k in range(d.shape[1]):
        mean = d[:, k].view(-1, 1, 1, 1).expand(-1, 1, 2, 2)
        kl = step_kl(mean, torch.zeros_like(mean), sigma_t[k])
        ratio = log_ratio[:, k].exp()
        keep = dppo_keep(ratio, advantage, kl, threshold)
        keeps.append(keep)
        terms.append(torch.where(keep, -advantage * ratio, 0.0))
    return torch.stack(terms, 1), torch.stack(keeps, 1)


def test_dppo_golden_step_0_and_3_with_unclipped_advantages():
    """UniRL's _flowdppo_kl_adv_loss (unirl/algorithms/flowdppo.py) run on B 6, steps 0 and 3 of
    UniRL's grid, sigma_t from its _compute_sigma_t (eta 0.7), mu_old 0, mu_new = d on a
    (1, 2, 2) latent, old log-prob 0, new = log_ratio, these advantages (two |A| > 5: UniRL
    clips none), tau 1e-5: its loss_per_elem, pasted. grpo_loss must therefore take -A ratio
    with the raw A under dppo (clamping to 5 changes the mean by 0.30)."""
    d = torch.tensor([[2e-3, 2e-3], [4e-3, 1e-3], [1e-3, 8e-4], [3.5e-3, 5e-4], [6e-3, 1e-3],
                      [5e-4, 2e-3]])
    log_ratio = torch.tensor([[.05, -.05], [.1, .1], [-.1, .2], [-.05, -.05], [.2, -.1],
                              [.1, .1]])
    advantage = torch.tensor([1.0, 7.5, -1.0, -6.0, 0.5, -0.5])
    want = torch.tensor([[-1.0512710809707642, -0.951229453086853],
                         [-8.288782119750977, -8.288782119750977],
                         [0.904837429523468, 1.2214027643203735],
                         [5.707376480102539, 5.707376480102539],
                         [0.0, -0.452418714761734],
                         [0.5525854825973511, 0.5525854825973511]])
    grid = unirl_grid()
    sigma_t = dppo_kl_std(grid[[0, 3]], grid[[1, 4]], 0.7)
    terms, keep = dppo_terms(d, log_ratio, advantage, sigma_t, 1e-5)
    assert torch.allclose(terms, want, rtol=1e-6, atol=0)
    assert terms.mean().item() == pytest.approx(-0.3655266761779785, rel=1e-6)
    clamped, _ = dppo_terms(d, log_ratio, advantage.clamp(-5, 5), sigma_t, 1e-5)
    assert clamped.mean().item() - terms.mean().item() == pytest.approx(0.302, abs=1e-3)
    # with the step's own std at step 0 (0.70, our former sigma there) two samples flip to
    # dropped: 7.5 and -6.0 push further with a KL 3.6x larger
    own_std = torch.stack([torch.tensor(0.7), sigma_t[1]])
    _, own_keep = dppo_terms(d, log_ratio, advantage, own_std, 1e-5)
    assert (own_keep != keep).nonzero().tolist() == [[1, 0], [3, 0]]


def test_dppo_ratio_exactly_one_and_kl_exactly_tau():
    """UniRL's _flowdppo_kl_adv_loss on B 4 with KL exactly tau (means 2^-8 apart, sigma_t
    0.25, tau 2^-13): ratio exactly 1 stays (neither > 1 nor < 1) whatever A; KL == tau counts
    as high (its keep test is KL < tau); A = +-8 unclipped. Loss [-8, 8, 0, 0]; with tau one
    step above, [-8, 8, -6.631025791168213, 5.429024696350098]."""
    mean = torch.full((4, 1, 2, 2), 2.0**-8)
    kl = step_kl(mean, torch.zeros_like(mean), 0.25)
    assert kl.tolist() == [2.0**-13] * 4
    ratio = torch.tensor([0.0, 0.0, 0.1, -0.1]).exp()
    advantage = torch.tensor([8.0, -8.0, 6.0, -6.0])
    above = [-8.0, 8.0, -6.631025791168213, 5.429024696350098]
    for tau, want in [(2.0**-13, [-8.0, 8.0, 0.0, 0.0]), (2.0**-13 * (1 + 2**-20), above)]:
        keep = dppo_keep(ratio, advantage, kl, tau)
        got = torch.where(keep, -advantage * ratio, 0.0)
        assert torch.allclose(got, torch.tensor(want), rtol=1e-7, atol=0)


def test_sde_steps_are_unirls_all_sde_scheduler_draws():
    """UniRL's AllSDEScheduler(10, timestep_fraction=[0.0, 0.5], num_sde_steps=3) (its Flow-DPPO
    recipe, examples/diffusion/sd3_flowdppo.yaml), get_sde_indices(k) for rollouts k = 0..23,
    sorted: independent steps of [0, 5); over k < 1000, 306 draws are contiguous (31%)."""
    want = ("234 123 012 024 234 023 124 234 124 134 123 034 134 234 034 234 124 023 124 134 "
            "124 013 123 024").split()
    assert ["".join(map(str, sde_steps(3, (0, 5), k))) for k in range(24)] == want
    draws = [sde_steps(3, (0, 5), k) for k in range(1000)]
    assert sum(d[-1] - d[0] == 2 for d in draws) == 306
    assert sde_steps(5, (0, 5), 7) == [0, 1, 2, 3, 4] and sde_steps(0, (0, 5), 7) == []


def test_bf16_means_inflate_the_dppo_kl():
    """UniRL keeps the step means in bf16 (trajectory_precision; SD3DiffusionStage.replay casts
    prev_sample_means to it), so its KL reads rounded means. Measured here on N(0, 1) means of
    SD3's (16, 64, 64) latent at step 3 of UniRL's grid with a true KL of 0.3 tau: the rounded
    means read 1.04 tau (seed 1: 1.01; steps 0, 1, 2, 4: 0.44, 0.66, 0.88, 1.16). UniRL's
    _gaussian_kl_div on the same bf16 tensors gives these to 1e-5."""
    grid = unirl_grid()
    gen = torch.Generator().manual_seed(0)
    old, delta = (torch.randn(1, 16, 64, 64, generator=gen) for _ in range(2))
    std = dppo_kl_std(grid[3], grid[4], 0.7)
    delta = delta * (0.3e-5 / step_kl(delta, torch.zeros_like(delta), std)).sqrt()
    new = old + delta
    assert step_kl(new, old, std).item() == pytest.approx(0.3e-5, rel=1e-4)
    rounded = step_kl(new.bfloat16(), old.bfloat16(), std).item()
    assert rounded / 1e-5 == pytest.approx(1.0395, abs=1e-4)


def windows(size, window_range, shift_every, epochs, **kwargs):
    """Our windows at every epoch < `epochs`, as 'start-end' ('E': empty) per shift interval;
    None if one differs from its interval's first (upstream's are constant within one)."""
    got = ["E" if a == b else f"{a}-{b}" for a, b in (
        sde_window(size, window_range, 25, None, k, shift_every, **kwargs) for k in range(epochs))]
    per_interval = got[::shift_every]
    if got != [per_interval[k // shift_every] for k in range(epochs)]:
        return None
    return " ".join(per_interval)


# MixGRPO's GRPOTrainingStates (fastvideo/utils/grpo_states.py) built as train_grpo_flux.py builds
# it (max_timesteps = 25 - 2, cur_timestep 0, progressive), get_current_timesteps() then
# update_iteration() each iteration: its window per shift interval (it is constant within one).
MIX_SHIPPED = ("0-4 1-5 2-6 3-7 4-8 5-9 6-10 7-11 8-12 9-13 10-14 11-15 12-16 13-17 14-18 15-19 "
               "16-20 17-21 18-22 19-23 20-23 21-23 22-23 E")


@pytest.mark.parametrize("shift_every,epochs,kwargs,want", [
    # finetune_flux_grpo_MixGRPO.sh: iters 25, window 4, --prog_overlap_step 1 --roll_back, 1200
    (25, 1200, {"stride": 1}, MIX_SHIPPED + " " + MIX_SHIPPED),
    # argparse's defaults: no --prog_overlap (stride = the window), no --roll_back, 600
    (25, 600, {"stride": 4, "roll_back": False}, "0-4 4-8 8-12 12-16 16-20 20-23" + " E" * 18),
    (25, 600, {"stride": 4}, " ".join(["0-4 4-8 8-12 12-16 16-20 20-23"] * 4)),
    (25, 700, {"stride": 1, "roll_back": False}, MIX_SHIPPED + " E" * 4),
    # MixGRPO-Flash (iters 20, overlap step 1) and Flash* (overlap step 0: fixed), 600 and 300
    (20, 600, {"stride": 1}, MIX_SHIPPED + " 0-4 1-5 2-6 3-7 4-8 5-9"),
    (20, 300, {"stride": 0}, " ".join(["0-4"] * 15)),
])
def test_mixgrpo_windows_are_grpo_training_states(shift_every, epochs, kwargs, want):
    """Golden windows of MixGRPO's GRPOTrainingStates over every iteration (shrink=True); the
    empty one (start 23) is where upstream's trainer crashes (it prints an unset `ratio`)."""
    assert windows(4, (0, 23), shift_every, epochs, shrink=True, **kwargs) == want


def test_former_whole_window_rule_differs_from_mixgrpos():
    """Our former rule (stride 1, whole windows, wrapped: still the default) against upstream's:
    700 of 1200 iterations differ with the shipped script's settings, 575 of 600 with argparse's
    defaults; MixGRPO's own rule on UniRL's SD3 settings would differ in 225 of 300."""
    def differ(epochs, window_range, a, b):
        return sum(sde_window(4, window_range, 25, None, k, 25, **a)
                   != sde_window(4, window_range, 25, None, k, 25, **b) for k in range(epochs))

    mix = {"shrink": True}
    assert differ(1200, (0, 23), {}, mix) == 700
    assert differ(600, (0, 23), {}, {"stride": 4, "roll_back": False, **mix}) == 575
    assert differ(300, (0, 10), {"stride": 3}, {"stride": 3, **mix}) == 225


def test_unirl_sd3_windows_are_whole():
    """UniRL's WindowScheduler(10, WindowConfig('progressive', window_size=4, iters_per_window=25,
    overlap_size=1, roll_back=True)) (examples/diffusion/sd3_mixgrpo.yaml), get_sde_indices(k),
    k < 300: 0-4 3-7 6-10, four times; with overlap 0 and no roll-back: 0-4, then 4-8 for good."""
    assert windows(4, (0, 10), 25, 300, stride=3) == " ".join(["0-4 3-7 6-10"] * 4)
    assert windows(4, (0, 10), 25, 300, stride=4, roll_back=False) == (
        "0-4" + " 4-8" * 11)


def ratio_norm_case(batch, shape, step, seed, moves, per_sample=False):
    """Flow-GRPO steps (diffusers' SD3 grid, a 0.7): x, v_old, dv ~ seeded N(0, 1), v_new =
    v_old + moves dv, x' sampled from the old step with the same generator. per_sample: the
    bias each sample's own (our former form, the paper's intent)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas.float()
    gen = torch.Generator().manual_seed(seed)
    x, v_old, dv = (torch.randn(batch, *shape, generator=gen) for _ in range(3))
    args = (sigmas[step], sigmas[step + 1], "flow", 0.7)
    x_next, old_log_prob, old_mean, _ = sde_step(v_old, x, *args, generator=gen,
                                                 second_sigma=sigmas[1])
    v = (v_old + dv * torch.tensor(moves).view(-1, *[1] * len(shape))).requires_grad_()
    _, log_prob, mean, std = sde_step(v, x, *args, prev_sample=x_next, second_sigma=sigmas[1])
    normed = ratio_norm_log_ratio(log_prob, old_log_prob, mean, old_mean, std.flatten())
    if per_sample:
        bias = ((mean - old_mean) ** 2).mean(dim=(1, 2, 3)) / (2 * std.flatten() ** 2)
        normed = (log_prob - old_log_prob + bias) * std.flatten()
    return v, normed, sigmas[step] - sigmas[step + 1]


@pytest.mark.parametrize("batch,seed,moves,want", [
    # off-policy, B 4, sample 0 did not move: it gets the batch's bias (0 per sample)
    (4, 0, [0.0, 0.01, 0.02, 0.03], [2.14785359e-06, -6.62361563e-05, 1.10225417e-04,
                                     -6.38441779e-05]),
    (1, 1, [0.001], [1.03987531e-05]),  # batch 1: the batch mean is the sample's own
    (4, 2, [0.0] * 4, [0.0] * 4),  # on-policy: no bias at all
])
def test_ratio_norm_bias_is_the_batch_mean(batch, seed, moves, want):
    """zhtmike/flow_grpo@9745241 scripts/train_sd3_GRPO_Guard.py, its rationorm lines (ratio =
    exp((log_prob - old + bias) * sqrt_dt * sigma_t)) run as a function on flow_grpo's
    sde_step_with_logprob outputs (step 3, shape (4, 2, 2), these seeds and moves): the
    exponent, pasted. Its bias is a batch mean (mean(dim=()) of a 1-D log-prob). Equal to 1e-7:
    flow_grpo's step rounds differently from sde_step (its lines on our step's outputs give
    ours exactly); the per-sample bias would give sample 0 exactly 0."""
    _, normed, _ = ratio_norm_case(batch, (4, 2, 2), 3, seed, moves)
    assert torch.allclose(normed, torch.tensor(want), rtol=0, atol=1e-7)
    _, own, _ = ratio_norm_case(batch, (4, 2, 2), 3, seed, moves, per_sample=True)
    assert torch.equal(own, normed) == (batch == 1 or max(moves) == 0)


def test_ratio_norm_golden_at_upstreams_shapes_with_the_clip_active():
    """The same upstream lines at its OCR config's shapes: B 9, (16, 64, 64), step 2, clip 2e-6,
    these advantages, the loss divided by |dt| (its / sqrt_dt^2): exponent, loss and the
    velocity gradient's norm, pasted. The per-sample bias (our former form) flips the clip
    decision of samples 0, 1 and 7 and moves the gradient by 67%."""
    moves = [0.0, 0.01, 0.02, 0.04, 0.06, 0.08, 0.02, 0.0, 0.04]
    v, normed, dt = ratio_norm_case(9, (16, 64, 64), 2, 3, moves)
    own_v, own, _ = ratio_norm_case(9, (16, 64, 64), 2, 3, moves, per_sample=True)
    want = [6.99610337e-06, 4.75910156e-06, 1.15979346e-05, -1.24884502e-06, -4.60434740e-06,
            -1.32327823e-05, 7.73111788e-06, 6.99610337e-06, -2.97453198e-06]
    assert torch.allclose(normed, torch.tensor(want), rtol=0, atol=1e-7)
    ratio = normed.exp()
    assert ((ratio - 1).abs() > 2e-6).tolist() == [True] * 3 + [False] + [True] * 5
    advantage = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2, 2.0, -1.1, 0.6])

    def ppo_loss(ratio):
        clipped = ratio.clamp(1 - 2e-6, 1 + 2e-6)
        return torch.maximum(-advantage * ratio, -advantage * clipped).mean() / dt

    loss = ppo_loss(ratio)
    loss.backward()
    assert loss.item() == pytest.approx(-2.994534969329834, rel=1e-6)
    assert v.grad.norm().item() == pytest.approx(0.0012229623971506953, rel=1e-5)
    flips = ((ratio - 1).abs() > 2e-6) != ((own.exp() - 1).abs() > 2e-6)
    assert flips.nonzero().flatten().tolist() == [0, 1, 7]
    ppo_loss(own.exp()).backward()
    change = (own_v.grad - v.grad).norm() / v.grad.norm()
    assert change.item() == pytest.approx(0.670, abs=0.005)


def fake_velocity(x, sigma):
    """A model for the Flash goldens: v = -0.4 x + (t - 0.5) c, t = floor(1000 sigma) / 1000
    (the timestep MixGRPO feeds FLUX)."""
    t = torch.floor(sigma * 1000) / 1000
    return -0.4 * x + (t - 0.5) * torch.tensor([0.3, -0.8, 1.1, 0.05]).view(1, 1, 4)


def flash_rollout(end, ratio):
    """Euler up to the window's end (upstream's window steps at eta 0 are Euler), then
    dpm_step on the Flash grid, its history the last window step's x0."""
    grid = flash_sigmas(shift_sigmas(torch.linspace(1, 0, 26), 3.0), end, ratio, 3.0)
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    latents, x0 = [x], None
    for i in range(len(grid) - 1):
        v = fake_velocity(x, grid[i])
        if i < end:
            x, x0 = sde_step(v, x, grid[i], grid[i + 1], "ode", 0.0)[0], x - grid[i] * v
        else:
            x, x0 = dpm_step(v, x, grid, i, x0)
        latents.append(x)
    return grid, torch.stack(latents, 1)


@pytest.mark.parametrize("window,ratio,post,final", [
    # finetune_flux_grpo_MixGRPO_Flash.sh (ratio 0.4) and Flash*.sh (0.2), window [0, 4); a late
    # window [14, 18) (Flash's at iteration 280-299): 8, 4 and 3 post points
    ((0, 4), 0.4, [0.94029850, 0.88524592, 0.81818181, 0.73469388, 0.62790698, 0.48648649,
                   0.29032260, 0.0], [-1.69538021, -1.63555515, -0.47044939, -0.64745682]),
    ((0, 4), 0.2, [0.94029850, 0.79245287, 0.53846157, 0.0],
     [-1.70486975, -1.50536966, -0.60312915, -0.64282227]),
    ((14, 18), 0.4, [0.53846157, 0.32812503, 0.0], [-1.69672811, -1.61719632, -0.48917142,
                                                    -0.64680630]),
])
def test_flash_matches_mixgrpos_dpm_solver(window, ratio, post, final):
    """MixGRPO's fastvideo/utils/sampling_utils.py run_sample_step (dpmsolver++, order 2,
    midpoint, dpm_apply_strategy 'post', flow_grpo_sampling as its scripts; eta 0 so the window
    is deterministic) with fake_velocity as the transformer, 25 steps, shift 3, z ~ seeded
    N(0, 1) of shape (2, 3, 4): its grid from the window's end on and the final latent's first
    4 values, pasted (and, for [0, 4) at 0.4, every latent after the window: see below)."""
    grid, latents = flash_rollout(window[1], ratio)
    assert torch.allclose(grid[window[1]:], torch.tensor(post), atol=2e-7, rtol=0)  # 1 ulp
    assert len(grid) == window[1] + len(post)
    assert torch.allclose(latents[0, -1].flatten()[:4], torch.tensor(final), atol=1e-6, rtol=0)
    if window == (0, 4) and ratio == 0.4:  # element 0 of sample 0 after each step from 4 on
        want = [-1.16159284, -1.19438505, -1.23408389, -1.28309834, -1.34508514, -1.42591870,
                -1.53536952, -1.69538021]
        assert torch.allclose(latents[0, 4:, 0, 0], torch.tensor(want), atol=1e-6, rtol=0)


def test_flash_grid_keeps_a_step_to_zero():
    """Upstream's int(max((T + 1 - end) ratio, 1)) is 1 point for a window ending at 23 (ratio
    0.4): its grid stops at sigmas[23] = 0.2069 and the image is never denoised. Ours takes 2:
    one DDIM step to 0 (a deviation past upstream's 300 iterations)."""
    sigmas = shift_sigmas(torch.linspace(1, 0, 26), 3.0)
    grid = flash_sigmas(sigmas, 23, 0.4, 3.0)
    assert torch.equal(grid[:24], sigmas[:24]) and grid[24:].tolist() == [0.0]


def test_dpm_step_by_hand():
    """First order is DDIM, (s1 / s0) x + (1 - s1 / s0) x0; second order adds
    0.5 h / h0 (x0 - x0_prev) to x0, h the log-SNR step."""
    sigmas = torch.tensor([0.8, 0.5, 0.2, 0.0])
    x, v = torch.ones(1, 2), torch.full((1, 2), 0.5)
    x1, x0 = dpm_step(v, x, sigmas, 1)  # x0 = 1 - 0.25 = 0.75; 0.4 + 0.6 * 0.75
    assert x0.tolist() == [[0.75, 0.75]] and torch.allclose(x1, torch.full((1, 2), 0.85))
    lam = [math.log((1 - s) / s) for s in (0.8, 0.5, 0.2)]
    d = 0.75 + 0.5 * (lam[2] - lam[1]) / (lam[1] - lam[0]) * (0.75 - 0.5)
    x1, _ = dpm_step(v, x, sigmas, 1, torch.full((1, 2), 0.5))
    assert torch.allclose(x1, torch.full((1, 2), 0.4 + 0.6 * d))
    last, x0 = dpm_step(v, x, sigmas, 2, torch.full((1, 2), 0.5))  # into 0: first order, x0
    assert torch.allclose(last, x0)


def test_window_stride_zero_is_a_fixed_window_not_a_division_by_zero():
    windows = {sde_window(4, (0, 23), 25, None, k, 20, stride=0, shrink=True) for k in range(500)}
    assert windows == {(0, 4)}
    assert sde_window(4, (0, 10), 25, None, 999, 25, stride=0) == (0, 4)
