"""Shared reverse-time step math for every script in this repo (pure functions, no models).

Conventions, stated once:
- Time is the flow-matching noise level sigma in [0, 1]: sigma = 1 is pure noise, sigma = 0 is data.
- Forward process: x_sigma = (1 - sigma) * x0 + sigma * eps, eps ~ N(0, I).
- The transformer predicts the velocity v ~= eps - x0 (so x0_hat = x - sigma * v and eps_hat = x + (1 - sigma) * v).
  SD3 takes the timestep input 1000 * sigma; FLUX takes sigma itself (the diffusers pipeline multiplies by 1000 inside).
- Sampling runs from sigma = 1 down to 0: dt = sigma_next - sigma < 0.
- Log-probs are AVERAGED over all non-batch elements (channels, height, width, or packed tokens), as upstream
  Flow-GRPO (`flow_grpo/diffusers_patch/sd3_sde_with_logprob.py`) and DanceGRPO (`train_grpo_flux.py::flux_step`) do.
  A PPO ratio exp(logp_new - logp_old) is therefore the per-element geometric mean of the true density ratio, which is
  why the scripts' clip ranges are tiny (~1e-4). The log-prob of an i.i.d. latent does not grow with resolution.
- All math runs in float32 whatever the input dtype (bf16 overflows in the squared terms).

`sde_step(..., prev_sample=None)` samples a step; passing `prev_sample` scores that given next latent instead (the same
contract as ddpo-pytorch / flow_grpo), so sampling then scoring the same draw returns the same log-prob.
"""

import math
from typing import Literal

import torch

StepKind = Literal["flow", "dance", "cps", "ode"]


def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A Python float or (B,) tensor as float32 of shape (B, 1, 1, ...) broadcastable against `like`."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def _mean_over_elements(t: torch.Tensor) -> torch.Tensor:
    """(B, ...) -> (B,): average over every non-batch dimension (the log-prob reduction of this repo)."""
    return t.mean(dim=tuple(range(1, t.ndim)))


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's static time shift sigma' = shift * sigma / (1 + (shift - 1) * sigma) (DanceGRPO's `sd3_time_shift`)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_sigma_t(
    sigma: float | torch.Tensor, noise_level: float, sigma_max: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Flow-GRPO's diffusion coefficient sigma_t = a * sqrt(sigma / (1 - sigma)) (arXiv:2505.05470 Eq. 9).

    At sigma == 1 the denominator would vanish, so there (and only there) it uses 1 - sigma_max, where upstream passes
    the schedule's SECOND sigma (`sigmas[1]`, not the maximum). Returned without the sqrt(-dt) factor, as upstream's
    `std_dev_t`; the Flow-GRPO KL divides by 2 * sigma_t**2 of exactly this value. Shape: like `sigma` (float32).
    """
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    at_noise = sigma >= 1
    if bool(at_noise.any()):
        if sigma_max is None:
            raise ValueError("kind='flow' at sigma == 1 needs sigma_max (upstream passes the schedule's second sigma)")
        denom_sigma = torch.where(at_noise, torch.as_tensor(sigma_max, dtype=torch.float32, device=sigma.device), sigma)
    else:
        denom_sigma = sigma
    return noise_level * torch.sqrt(sigma / (1 - denom_sigma))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Full isotropic Gaussian log-density of x (constants kept), averaged over non-batch elements -> (B,)."""
    log_density = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return _mean_over_elements(log_density)


def sde_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    kind: StepKind,
    noise_level: float,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_max: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One reverse step from sigma to sigma_next. Returns (prev_sample, log_prob, mean, std), all float32.

    v, x: (B, ...) velocity prediction and current latent, any float dtype. sigma, sigma_next: floats or (B,) tensors.
    prev_sample None: draw noise with `generator` and sample; given: score it. log_prob: (B,), mean over elements.
    std: (B, 1, ...) standard deviation of the Gaussian the step samples from (0 for 'ode').

    kinds:
    - 'flow'  Flow-GRPO SDE (arXiv:2505.05470 Eq. 8-9; flow_grpo `sde_step_with_logprob`, sde_type='sde'):
              mean = x + [v + sigma_t^2 / (2 sigma) * (x + (1 - sigma) v)] dt, std = sigma_t * sqrt(-dt).
    - 'dance' DanceGRPO SDE (arXiv:2505.07818; DanceGRPO `train_grpo_flux.py::flux_step`, sde_solver=True):
              constant diffusion eta = noise_level, mean = x + dt v + eta^2/2 * (x - (1 - sigma) x0_hat)/sigma^2 * dt,
              std = eta * sqrt(-dt).
    - 'cps'   Coefficient-preserving sampling (arXiv:2509.05952; flow_grpo sde_type='cps'):
              std = sigma_next * sin(noise_level * pi / 2), mean = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2) eps_hat.
              log_prob = -mean((x' - mean)^2) EXACTLY as upstream: constants AND the 1/(2 std^2) are dropped, so the
              PPO clip range tuned upstream for CPS (1e-5) carries over, but this is not a normalised density.
              Also at std = 0 (sigma_next = 0): a given prev_sample still gets -mean((x' - mean)^2) and its gradient.
    - 'ode'   Euler: mean = x + v dt, prev_sample = mean, log_prob = 0, std = 0.
    A step whose std is 0 ('ode', or noise_level 0) is deterministic: prev_sample = mean and log_prob = 0 (but 'cps').
    """
    v, x = v.float(), x.float()
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    dt = s_next - s

    if kind == "flow":
        sigma_t = flow_sigma_t(s, noise_level, None if sigma_max is None else _per_sample(sigma_max, x))
        mean = x + (v + sigma_t**2 / (2 * s) * (x + (1 - s) * v)) * dt
        std = sigma_t * torch.sqrt(-dt)
    elif kind == "dance":
        x0_hat = x - s * v
        mean = x + dt * v + (noise_level**2 / 2) * (x - (1 - s) * x0_hat) / s**2 * dt
        std = noise_level * torch.sqrt(-dt) * torch.ones_like(s)
    elif kind == "cps":
        x0_hat, eps_hat = x - s * v, x + (1 - s) * v
        std = s_next * math.sin(noise_level * math.pi / 2)
        mean = (1 - s_next) * x0_hat + torch.sqrt(s_next**2 - std**2) * eps_hat
    elif kind == "ode":
        mean = x + v * dt
        std = torch.zeros_like(s)
    else:
        raise ValueError(f"unknown step kind {kind!r}; expected one of 'flow', 'dance', 'cps', 'ode'")

    deterministic = bool((std == 0).all())
    if prev_sample is None:
        if deterministic:
            prev_sample = mean
        else:
            noise_device = x.device if generator is None else generator.device
            prev_sample = mean + std * torch.randn(x.shape, generator=generator, device=noise_device).to(x.device)
    prev_sample = prev_sample.float()

    if kind == "cps":  # upstream even where std = 0 (flow_grpo sd3_sde_with_logprob.py, sde_type='cps')
        log_prob = -_mean_over_elements((prev_sample.detach() - mean) ** 2)
    elif deterministic:
        log_prob = torch.zeros(x.shape[0], device=x.device)
    else:
        log_prob = gaussian_log_prob(prev_sample.detach(), mean, std)
    return prev_sample, log_prob, mean, std
