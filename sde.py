"""Reverse-time step math shared by every script (pure functions, no models): SDE steps, which
steps are SDE steps, which samples train, trust regions on a step's Gaussian, an ODE solver.
(Advantages are each script's own: its ALGO LOGIC.)

Conventions, stated once:
- Time is the flow-matching noise level sigma in [0, 1] (1: pure noise, 0: data), and
  x_sigma = (1 - sigma) x0 + sigma eps, eps ~ N(0, I). Sampling runs from 1 down to 0:
  dt = sigma_next - sigma < 0.
- The transformer predicts the velocity v ~= eps - x0: x0_hat = x - sigma v and
  eps_hat = x + (1 - sigma) v. SD3 takes the timestep 1000 sigma, FLUX sigma itself.
- Log-probs are AVERAGED over all non-batch elements, as upstream Flow-GRPO
  (`flow_grpo/diffusers_patch/sd3_sde_with_logprob.py`) and DanceGRPO (`flux_step`) do: a PPO
  ratio is the per-element geometric mean of the density ratio (hence clip ranges ~1e-4), and
  the log-prob of an i.i.d. latent does not grow with resolution.
- All math runs in float32 whatever the input dtype (bf16 overflows in the squared terms).
- `sde_step(..., prev_sample=None)` samples a step; a given `prev_sample` is scored instead
  (ddpo-pytorch's and flow_grpo's contract): sampling then scoring a draw gives one log-prob.
"""

import math
from typing import Literal

import numpy as np
import torch

StepKind = Literal["flow", "dance", "cps", "ode"]

def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A float or a (B,) tensor as float32 (B, 1, 1, ...), broadcastable against `like`."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    singleton_dims = [1] * (like.ndim - 1)
    return value.reshape(-1, *singleton_dims)

def _mean_over_elements(tensor: torch.Tensor) -> torch.Tensor:
    """(B, ...) -> (B,): the mean over every non-batch dimension (the repo's reduction)."""
    return tensor.mean(dim=tuple(range(1, tensor.ndim)))

def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's static time shift: sigma' = shift * sigma / (1 + (shift - 1) * sigma).

    The same formula as DanceGRPO's `sd3_time_shift`.
    """
    return shift * sigmas / (1 + (shift - 1) * sigmas)

def flow_sigma_t(sigma: float | torch.Tensor, noise_level: float,
                 second_sigma: float | torch.Tensor | None = None) -> torch.Tensor:
    """Flow-GRPO's diffusion coefficient sigma_t = a sqrt(sigma / (1 - sigma)) (arXiv:2505.05470
    Eq. 9, a = noise_level); at sigma == 1 (only there) the denominator is 1 - second_sigma:
    upstream passes the schedule's second sigma (`sigmas[1]`), misleadingly named sigma_max.
    Without the sqrt(-dt), like upstream's `std_dev_t` (its KL divides by 2 sigma_t^2 of
    exactly this). Shape: like `sigma`, float32."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    at_pure_noise = sigma >= 1
    denominator_sigma = sigma
    if bool(at_pure_noise.any()):
        if second_sigma is None:
            raise ValueError("kind='flow' at sigma == 1 needs second_sigma "
                             "(upstream passes the schedule's second sigma)")
        second_sigma = torch.as_tensor(second_sigma, dtype=torch.float32, device=sigma.device)
        denominator_sigma = torch.where(at_pure_noise, second_sigma, sigma)
    return noise_level * torch.sqrt(sigma / (1 - denominator_sigma))

def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Isotropic Gaussian log-density of x, constants kept, a mean over elements; (B, ...) ->
    (B,)."""
    squared_error = (x - mean) ** 2
    log_density = -squared_error / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return _mean_over_elements(log_density)

def sde_step(v: torch.Tensor, x: torch.Tensor, sigma: float | torch.Tensor,
             sigma_next: float | torch.Tensor, kind: StepKind, noise_level: float,
             prev_sample: torch.Tensor | None = None, generator: torch.Generator | None = None,
             second_sigma: float | torch.Tensor | None = None):
    """One reverse step from sigma to sigma_next -> (prev_sample, log_prob, mean, std), float32.

    v, x: (B, ...) velocity and latent, any float dtype; sigma, sigma_next: floats or (B,).
    prev_sample None: draw noise with `generator`, sample the step; a tensor: score it.
    log_prob: (B,), a mean over elements. std: (B, 1, ...), of the step's Gaussian.
    Kinds:
    - 'flow': Flow-GRPO's SDE (arXiv:2505.05470 Eq. 8-9; flow_grpo `sde_step_with_logprob`):
        mean = x + [v + sigma_t^2 / (2 sigma) (x + (1 - sigma) v)] dt, std = sigma_t sqrt(-dt)
    - 'dance': DanceGRPO's (arXiv:2505.07818; `train_grpo_flux.py::flux_step`, sde_solver),
      constant diffusion eta = noise_level:
        mean = x + dt v + eta^2 / 2 (x - (1 - sigma) x0_hat) / sigma^2 dt, std = eta sqrt(-dt)
    - 'cps': coefficient-preserving sampling (arXiv:2509.05952; flow_grpo sde_type='cps'):
        std = sigma_next sin(a pi / 2), mean = (1 - sigma_next) x0_hat
        + sqrt(sigma_next^2 - std^2) eps_hat; log_prob = -mean((x' - mean)^2) EXACTLY as
      upstream (no constants, no 1 / (2 std^2): its clip range 1e-5 carries over), also at
      std = 0 (sigma_next = 0), where a given prev_sample keeps its gradient.
    - 'ode': Euler, mean = x + v dt.
    A step with std 0 ('ode', noise_level 0) is deterministic: prev_sample = mean and
    log_prob = 0 (except 'cps', above).
    """
    v, x = v.float(), x.float()
    sigma = _per_sample(sigma, x)
    sigma_next = _per_sample(sigma_next, x)
    dt = sigma_next - sigma

    if kind == "flow":
        if second_sigma is not None:
            second_sigma = _per_sample(second_sigma, x)
        sigma_t = flow_sigma_t(sigma, noise_level, second_sigma)
        eps_hat = x + (1 - sigma) * v
        drift = v + sigma_t**2 / (2 * sigma) * eps_hat
        mean = x + drift * dt
        std = sigma_t * torch.sqrt(-dt)
    elif kind == "dance":
        x0_hat = x - sigma * v
        correction = (noise_level**2 / 2) * (x - (1 - sigma) * x0_hat) / sigma**2
        mean = x + dt * v + correction * dt
        std = noise_level * torch.sqrt(-dt) * torch.ones_like(sigma)
    elif kind == "cps":
        x0_hat = x - sigma * v
        eps_hat = x + (1 - sigma) * v
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        noise_scale = torch.sqrt(sigma_next**2 - std**2)
        mean = (1 - sigma_next) * x0_hat + noise_scale * eps_hat
    elif kind == "ode":
        mean = x + v * dt
        std = torch.zeros_like(sigma)
    else:
        raise ValueError(f"unknown step kind {kind!r}; expected 'flow', 'dance', 'cps' or 'ode'")

    deterministic = bool((std == 0).all())
    if prev_sample is None:
        if deterministic:
            prev_sample = mean
        else:
            # Draw on the generator's device, so a CPU generator gives the same
            # noise whatever device the latents are on.
            noise_device = x.device if generator is None else generator.device
            noise = torch.randn(x.shape, generator=generator, device=noise_device)
            prev_sample = mean + std * noise.to(x.device)
    prev_sample = prev_sample.float()

    # The log-prob scores the sample as a constant: gradients flow through mean.
    if kind == "cps":  # upstream's form, even where std = 0
        log_prob = -_mean_over_elements((prev_sample.detach() - mean) ** 2)
    elif deterministic:
        log_prob = torch.zeros(x.shape[0], device=x.device)
    else:
        log_prob = gaussian_log_prob(prev_sample.detach(), mean, std)
    return prev_sample, log_prob, mean, std

# ---- Which steps are SDE steps ----
def sde_window(size: int, window_range, num_steps: int, generator, epoch: int = 0,
               shift_every: int | None = None, stride: int = 1, roll_back: bool = True,
               shrink: bool = False) -> tuple[int, int]:
    """The steps [start, end) a rollout samples by SDE, the ODE elsewhere (size 0: every step).
    (A, B) = window_range. Flow-GRPO-Fast (shift_every None): start uniform in {A, ..., B -
    size}, drawn per call. Else start = A + stride (epoch // shift_every) while <= the last
    start L, then A again (roll_back) or stuck (at L's grid point; shrink: at L); stride 0:
    fixed at A. L = B - size: UniRL's SD3 port of MixGRPO (unirl/utils/scheduler_utils.py,
    WindowScheduler._resolve_progressive), whole windows. shrink: L = B, MixGRPO's own
    (Tencent-Hunyuan/MixGRPO@e5cdd6a, GRPOTrainingStates in fastvideo/utils/grpo_states.py as
    train_grpo_flux.py drives it): the window [start, min(start + size, B)) shrinks at the end
    and is empty at start B (where upstream's trainer crashes)."""
    if size == 0:
        return 0, num_steps
    low, high = window_range
    if shift_every is None:
        start = int(torch.randint(low, high - size + 1, (),
                                  generator=generator, device=generator.device))
        return start, start + size
    last = high if shrink else high - size  # the last start
    moves = epoch // shift_every * stride
    if stride and roll_back:  # back to A after the last start
        moves %= ((last - low) // stride + 1) * stride
    elif stride and not shrink:  # UniRL stays on its grid
        moves = min(moves, (last - low) // stride * stride)
    start = min(low + moves, last)
    return start, min(start + size, high)

def sde_steps(count: int, step_range, key) -> list[int]:
    """`count` distinct steps of [A, B), sorted: UniRL's AllSDEScheduler (unirl/utils/
    scheduler_utils.py; its Flow-DPPO recipe), independent steps, not a window. Drawn as it
    draws them, numpy's default_rng(key).choice: key = its rollout id (our epoch) gives its
    steps exactly, on every rank and for every seed."""
    pool = list(range(*step_range))
    rng = np.random.default_rng(key)
    chosen = rng.choice(pool, count, replace=False)
    return sorted(int(i) for i in chosen)

# ---- Which samples train (Flow-GRPO's zero-advantage filter) ----
def training_batches(zero, num_batches: int, size: int, generator):
    """flow_grpo's re-batching of a rank's samples (scripts/train_sd3.py before training): drop
    those whose advantage is zero (`zero`, bool), add random ones back until the rest splits
    into num_batches, shuffle, split; its draws in its order, on `generator`. -> (num_batches,
    size) sample indices: a micro-batch's n trained rows, then its first repeated; and n."""
    keep = ~zero | zero.all()  # all zero: upstream's reshape fails; we train all
    missing = -int(keep.sum()) % num_batches
    if missing:  # upstream draws only then
        dropped = zero.nonzero().flatten()
        keep[dropped[torch.randperm(len(dropped), generator=generator)[:missing]]] = True
    rows = keep.nonzero().flatten()
    rows = rows[torch.randperm(len(rows), generator=generator)].view(num_batches, -1)
    return torch.cat([rows, rows[:, :1].expand(-1, size - rows.shape[1])], 1), rows.shape[1]

# ---- Trust regions on a step's Gaussian ----
def step_kl(mean: torch.Tensor, other_mean: torch.Tensor, std) -> torch.Tensor:
    """KL of two Gaussian steps with the same std: (B, ...) -> (B,), the mean over elements of
    (mean - other_mean)^2 / (2 std^2): the exact KL over the element count (the repo's
    reduction; Flow-DPPO's threshold is calibrated for it). std: a float, (B,) or (B, 1, ...)."""
    std = _per_sample(std, mean)
    return _mean_over_elements((mean.float() - other_mean.float()) ** 2 / (2 * std**2))

def dppo_kl_std(sigma, sigma_next, noise_level: float) -> torch.Tensor:
    """The std of Flow-DPPO's KL as UniRL computes it (unirl/algorithms/flowdppo.py,
    _compute_sigma_t): a sqrt(s / (1 - min(s, 0.99))) sqrt(-dt) at EVERY step. It is the
    'flow' step's std except at sigma = 1 (1.32 there on UniRL's 10-step grid, vs 0.70)."""
    s = torch.as_tensor(sigma, dtype=torch.float32)
    dt = torch.as_tensor(sigma_next, dtype=torch.float32) - s
    std_t = torch.sqrt(s / (1 - s.clamp(max=0.99)))
    return std_t * noise_level * torch.sqrt(-dt)

def dppo_keep(ratio, advantages, kl, threshold: float) -> torch.Tensor:
    """Flow-DPPO's trust region (arXiv:2606.11025; Tencent-Hunyuan/UniRL,
    unirl/algorithms/flowdppo.py): a step's term -A ratio is dropped only where its KL to the
    rollout's step is >= threshold AND it pushes further the way the advantage points
    (ratio > 1 with A > 0, ratio < 1 with A < 0); corrective moves always stay. (B,) bool.
    UniRL clips no advantage: pass them unclipped."""
    aggressive = ((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0))
    return ~((kl >= threshold) & aggressive)

def ratio_norm_log_ratio(log_prob, old_log_prob, mean, old_mean, std):
    """GRPO-Guard's RatioNorm of a Gaussian step's log-ratio (B,); std: (B,).

    With x' = old_mean + std eps and dmu = mean - old_mean, the raw log-ratio is
    mean(eps dmu) / std - mean(dmu^2) / (2 std^2): below 0 (the clip rarely stops positive
    advantages), its gradient ~|dt| / std starving high-noise steps. Adding the bias back and
    scaling by std leaves mean(eps dmu), plus (the batch's bias - its own) std (below)."""
    # Upstream's bias is dmu^2.mean(dim=()) of a 1-D log-prob: torch reduces over ALL dims
    # (pytorch PR #83357), so each sample gets the batch's mean bias. Matched on purpose.
    bias = ((mean - old_mean) ** 2).mean() / (2 * std**2)
    return (log_prob - old_log_prob + bias) * std

# ---- MixGRPO-Flash: DPM-Solver++(2M) after the SDE window ----
def flash_sigmas(sigmas, end: int, ratio: float, shift: float) -> torch.Tensor:
    """MixGRPO-Flash's grid (MixGRPO@e5cdd6a fastvideo/utils/sampling_utils.py,
    run_sample_step, dpm_apply_strategy 'post'): sigmas[:end + 1], then
    int((T + 1 - end) ratio) points from sigmas[end] to 0 uniform in unshifted time, shifted
    (end: the window's; T + 1 = len(sigmas)). At least 2 (upstream's 1 stops at sigmas[end])."""
    s = float(sigmas[end])
    points = max(int((len(sigmas) - end) * ratio), 2)
    t = torch.linspace(s / (shift - (shift - 1) * s), 0, points)
    post = shift_sigmas(t, shift)[1:].to(sigmas)
    return torch.cat([sigmas[: end + 1], post])

def dpm_step(v, x, sigmas, i: int, x0_prev=None):
    """Step i (sigmas[i] -> sigmas[i + 1]) of MixGRPO-Flash's ODE solver: DPM-Solver++ in data
    prediction, 2M 'midpoint' (sampling_utils.py dpm_step, order 2, as its scripts run it);
    second order with the previous step's x0 (x0_prev, at sigmas[i - 1]), first order (DDIM)
    without one and into sigma 0. -> (x at sigmas[i + 1], this step's x0 = x - sigma v)."""
    s = sigmas.float()
    x = x.float()
    x0 = x - s[i] * v.float()
    lam = torch.log(1 - s) - torch.log(s)  # log-SNR
    h = lam[i + 1] - lam[i]
    d = x0
    if x0_prev is not None and s[i + 1] > 0:
        r = h / (lam[i] - lam[i - 1])
        d = x0 + 0.5 * r * (x0 - x0_prev)
    decay = torch.exp(-h) - 1
    x_next = s[i + 1] / s[i] * x - (1 - s[i + 1]) * decay * d
    return x_next, x0
