"""Advantage Weighted Matching (AWM) on Stable Diffusion 3.5 Medium: advantage-weighted flow matching on final samples.

Paper: arXiv:2509.25050. Upstream: scxue/advantage_weighted_matching, scripts/train_sd3_awm.py. AWM re-noises each
rollout's FINAL clean latent at K stratified grid timesteps and uses the flow-matching loss as the policy's log-prob
proxy in a PPO-style ratio (on-policy: ratio == 1), plus velocity-MSE KLs to the base model and to a trailing anchor
LoRA; exactly one optimizer step per epoch. Rollouts: diffusers' SASolverScheduler (flow mode) on SD3's shift-3 grid.
Defaults = the paper's OCR run (upstream config/dgx_awm.py::ocr_sd3_no_cfg_1node), rescaled to any GPU count:
    torchrun --nproc_per_node 8 awm_sd35.py --train-prompts ocr/train.txt --test-prompts ocr/test.txt
GenEval: `--reward geneval --kl-beta 0.001`; PickScore: `--reward pickscore --kl-beta 1e-4 --time-type discrete
--noise-level 0 --prompts-per-epoch 24 --train-batch-size 2`. Toy-world CPU demo (~1 min; held-out `eval` rises):
    python awm_sd35.py --model tests/assets/toy-sd3 --train-prompts tests/assets/toy_train.txt \
        --test-prompts tests/assets/toy_test.txt --reward tests/toy_rewards.py:counting_partial \
        --eval-reward tests/toy_rewards.py:counting --resolution 32 --max-sequence-length 24 --mixed-precision no \
        --num-steps 10 --eval-num-steps 10 --group-size 16 --prompts-per-epoch 6 --batch-size 16 --train-batch-size 8 \
        --lora-rank 8 --lora-alpha 8 --kl-beta 0 --anchor-beta 0 --ema-decay 0 --sampler ode --learning-rate 1e-3 --epochs 8
"""

import glob
import json
import math
import os
import resource
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import tyro
from diffusers import SASolverScheduler, StableDiffusion3Pipeline
from huggingface_hub import hf_hub_download
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from PIL import Image
from tqdm import tqdm

import rewards
from sde import sde_step


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (wandb group and run-directory prefix)"""
    seed: int = 42
    """seed of LoRA init and prompt draws (identical on all ranks); sampling/training noise is seeded per rank and epoch"""
    track: bool = False
    """log to Weights & Biases (stdout and metrics.jsonl are always written)"""
    wandb_project: str = "flowrl"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity; None = your default entity"""
    output_dir: str = "runs"
    """runs are written to OUTPUT_DIR/RUN_NAME (metrics, eval sheets, checkpoints)"""
    resume: str | None = None
    """checkpoint directory to continue from (continues at the epoch after it)"""
    eval_only: bool = False
    """only evaluate (the EMA weights of --resume, or the base model) on the test prompts, then exit"""
    model: str = "stabilityai/stable-diffusion-3.5-medium"
    """hub id or local path of a diffusers StableDiffusion3Pipeline"""
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    """dtype of the frozen text encoders and transformer base, with autocast (LoRA and VAE stay fp32); no = all fp32"""
    gradient_checkpointing: bool = False
    """recompute transformer activations in the backward pass (less memory, ~30% slower)"""
    lora_rank: int = 32
    """LoRA rank on the 8 joint-attention projections of every block (the anchor LoRA has the same shape)"""
    lora_alpha: int = 64
    """LoRA alpha (scale = alpha / rank)"""
    max_sequence_length: int = 128
    """T5 tokens per prompt (upstream: 128)"""
    train_prompts: str = "prompts/train.txt"
    """training prompts: one per line, or JSONL with a `prompt` field (other fields are passed to the reward)"""
    test_prompts: str = "prompts/test.txt"
    """eval prompts, same format"""
    reward: str = "ocr"
    """a rewards.py name, a weighted list `ocr=1.0,pickscore=0.5`, or `path/to/file.py:function`"""
    eval_reward: str | None = None
    """reward for eval; None = the training reward"""
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    """several rewards: normalise their weighted sum (upstream), or each within its group then sum (GDPO, arXiv:2601.05242)"""
    resolution: int = 512
    """image height and width in pixels"""
    num_steps: int = 14
    """rollout steps (model evaluations); the training timesteps are drawn from the same SD3 grid"""
    eval_num_steps: int = 40
    """Euler ODE steps for eval"""
    guidance_scale: float = 1.0
    """classifier-free guidance scale in rollouts, training forwards and eval (upstream AWM: 1 = no CFG)"""
    sampler: Literal["sa_solver", "flow_sde", "ode"] = "sa_solver"
    """rollout solver: SA-Solver (PEC, predictor/corrector order 2; upstream), Flow-GRPO's Euler SDE (sde.py), or Euler ODE"""
    noise_level: float = 0.4
    """SA-Solver stochasticity tau inside --tau-window (0 = ODE); with flow_sde, a in sigma_t = a sqrt(sigma / (1 - sigma))"""
    tau_window: tuple[float, float] = (0.3, 0.9)
    """SA-Solver steps whose target sigma lies in this closed range use tau = --noise-level, all others tau = 0"""
    group_size: int = 24
    """images per prompt (the group whose mean is the advantage baseline)"""
    prompts_per_epoch: int = 72
    """prompts (groups) per epoch, over all GPUs"""
    batch_size: int = 6
    """per-GPU rollout batch"""
    train_batch_size: int = 3
    """per-GPU training micro-batch of samples; each forward is train_timesteps x this wide"""
    eval_batch_size: int = 8
    """per-GPU eval batch"""
    epochs: int = 1000
    """epochs to train (each = sample, score, ONE optimizer step over all micro-batches)"""
    learning_rate: float = 3e-4
    """AdamW learning rate (constant)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    ema_decay: float = 0.99
    """eval EMA of the LoRA weights (warm-up min(decay, (1+s)/(10+s))), used for eval and the saved `ema_lora` (0 disables)"""
    train_timesteps: int = 6
    """K: timesteps per micro-batch, one per stratum of the grid, shared by every sample of the micro-batch"""
    time_type: Literal["discrete_wo_init", "discrete"] = "discrete_wo_init"
    """K strata over rollout-grid indices [1, M) (never sigma = 1) or [0, M); M = int(num_steps * timestep_fraction)"""
    timestep_fraction: float = 0.9
    """fraction of the rollout grid the training timesteps are drawn from (the last, least noisy steps are skipped)"""
    weighting: Literal["ghuber", "Uniform", "t", "t**2", "huber"] = "ghuber"
    """how the flow-matching error becomes a log-prob (see `awm_log_prob`)"""
    ghuber_power: float = 0.25
    """p of the 'ghuber' weighting"""
    clip_range: float = 1.0
    """PPO clip on exp(logp - logp_old) (inactive on-policy, where the ratio is exactly 1)"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip, then divided by it (to [-1, 1])"""
    per_group_std: bool = False
    """normalise advantages by each group's std instead of the epoch's global std (upstream default: global)"""
    kl_beta: float = 0.003
    """weight of mean((v - v_base)^2), the base model being the LoRA switched off"""
    anchor_beta: float = 1.0
    """weight of mean((v - v_anchor)^2), the anchor a trailing copy of the LoRA (upstream `ema_beta`)"""
    anchor_decay_max: float = 0.3
    """anchor update anchor <- d anchor + (1 - d) lora after each epoch, d = min(max, rate * global_step)"""
    anchor_decay_rate: float = 0.001
    """slope of the anchor decay in optimizer steps (upstream kl_ema_decay_type='linear')"""
    eval_every: int = 20
    """evaluate every N epochs (and after the last; upstream OCR config: 20, GenEval / PickScore: 50)"""
    eval_sheet_size: int = 16
    """images of the first eval prompts in the contact sheet"""
    save_every: int = 20
    """checkpoint every N epochs (and after the last; upstream OCR config: 20, GenEval / PickScore: 50)"""


LORA_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]  # the 8 joint-attention projections
STATE_FLAGS = ["model", "lora_rank", "lora_alpha"]  # --resume refuses a checkpoint saved with other values
LOG_PROB_EPS = 1e-10  # upstream compute_log_prob_awm: keeps (l + eps)^p differentiable at l = 0
HUBER_OFFSET = 1e-5  # upstream 'huber': -t (sqrt(l + eps) - 1e-5)
SA_SOLVER_T_START = 1 - 1e-3  # upstream sd3_pipeline_with_logprob: the SA-Solver grid starts just below sigma = 1


# ---------------------------------------------------------------------------------------------------------------
# Algorithm: advantages, the AWM log-prob proxy and loss, the timestep picker, the SA-Solver rollout
# ---------------------------------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, per_group_std: bool, eps: float = 1e-4):
    """(reward - its group's mean) / (std + eps), std over all rewards (upstream `global_std`) or within the group.
    rewards, group_ids: (N,). Population std as upstream's np.std. A group whose rewards are all equal gets zeros."""
    rewards = rewards.double()
    count = torch.bincount(group_ids).double()  # (n_groups,)
    centered = rewards - (torch.zeros_like(count).index_add_(0, group_ids, rewards) / count)[group_ids]
    if per_group_std:
        std = (torch.zeros_like(count).index_add_(0, group_ids, centered**2) / count).sqrt()[group_ids]
    else:
        std = rewards.std(unbiased=False)
    return (centered / (std + eps)).float()


def compute_advantages(rewards: torch.Tensor, components: dict[str, torch.Tensor], weights: dict[str, float],
                       group_ids: torch.Tensor, aggregation: str, per_group_std: bool) -> torch.Tensor:
    """Advantages (N,) of the weighted reward `rewards`; with `gdpo`, each component is normalised within its group,
    weighted and summed, then the sum is normalised over the batch (GDPO, arXiv:2601.05242)."""
    if aggregation == "sum" or len(components) <= 1:
        return group_advantages(rewards, group_ids, per_group_std)
    summed = sum(w * group_advantages(components[k], group_ids, per_group_std=True) for k, w in weights.items())
    return (summed - summed.mean()) / (summed.std(unbiased=False) + 1e-4)


def awm_log_prob(v, x0, noise, t, weighting="ghuber", power=0.25) -> torch.Tensor:
    """AWM's log-likelihood proxy (B,), float64 (upstream train_sd3_awm.py::compute_log_prob_awm).
    v, x0, noise: (B, ...) velocity at x_t = (1 - t) x0 + t noise, the clean latent and the noise; t: float or (B,).
    l = mean over elements of (v - (noise - x0))^2 (the flow-matching error), then
    'Uniform' -l, 't' -t l, 't**2' -t^2 l, 'huber' -t (sqrt(l + eps) - 1e-5), 'ghuber' -(t / p)((l + eps)^p - eps^p)."""
    loss = ((v.double() - (noise.double() - x0.double())) ** 2).flatten(1).mean(1)  # (B,)
    t = torch.as_tensor(t, dtype=torch.float64, device=loss.device).expand_as(loss)
    penalties = {"Uniform": loss, "t": t * loss, "t**2": t**2 * loss,
                 "huber": t * (torch.sqrt(loss + LOG_PROB_EPS) - HUBER_OFFSET),
                 "ghuber": t / power * ((loss + LOG_PROB_EPS) ** power - LOG_PROB_EPS**power)}
    if weighting not in penalties:
        raise ValueError(f"unknown weighting {weighting!r}; expected one of {list(penalties)}")
    return -penalties[weighting]


def awm_policy_loss(log_prob, old_log_prob, advantages, clip_range: float, adv_clip: float):
    """PPO-style loss on (N,) log-probs (upstream loss_type='exp_first'): A = clip(A, +-c) / c,
    mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))) with r = exp(logp - logp_old). Returns (loss, ratio)."""
    adv = advantages.double().clamp(-adv_clip, adv_clip) / adv_clip
    ratio = torch.exp(log_prob - old_log_prob)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range)).mean(), ratio


def stratified_timestep_indices(num_steps: int, k: int, fraction: float, time_type: str,
                                generator: torch.Generator) -> torch.Tensor:
    """K rollout-grid indices (K,), one uniformly drawn per stratum (upstream train_sd3_awm.py, `time_type`).
    With M = int(num_steps * fraction) the strata are the integer ranges [b_i, b_i+1) between the floored points b of
    linspace(lo, M, K + 1): lo = 1 for 'discrete_wo_init' (index 0, sigma = 1, is never drawn), lo = 0 for 'discrete'.
    A stratum of width 0 yields its lower end."""
    bounds = torch.linspace(0 if time_type == "discrete" else 1, int(num_steps * fraction), k + 1).long()
    u = torch.rand(k, generator=generator, device=generator.device).cpu()
    return bounds[:-1] + (u * (bounds[1:] - bounds[:-1])).long()


@torch.no_grad()
def sa_solver_rollout(transformer, scheduler, noise, sigmas, tau: float, tau_window, embeds, pooled, neg_embeds,
                      neg_pooled, guidance_scale, autocast, generator) -> torch.Tensor:
    """SA-Solver (arXiv:2309.05019) from noise to the clean latent x0 (B, C, h, w), fp32, one model call per step.
    `scheduler`: diffusers' SASolverScheduler in flow mode, run on upstream's grid (its own never reaches sigma = 0;
    sd3_pipeline_with_logprob.py): SD3's `sigmas` (T+1,) without the final 0, first point 1 - 1e-3, last point halved;
    the last call's x - sigma v is the sample (`denoise_to_zero`). A step into sigma' uses tau if sigma' is in
    tau_window (as upstream; diffusers' tau_func sees the step's source). The second point is not corrected (upstream
    sa_solver.py SASolver.sample: disable_first_corrector)."""
    grid = sigmas[:-1].clone()  # (T,)
    grid[0], grid[-1] = SA_SOLVER_T_START, grid[-2] / 2
    scheduler.set_timesteps(len(grid))  # resets the multistep history
    scheduler.sigmas, scheduler.timesteps = torch.cat([grid, grid[-1:]]).cpu(), (1000 * grid).cpu()
    step_tau = {float(ts): tau if tau_window[0] <= float(s_next) <= tau_window[1] else 0.0
                for ts, s_next in zip(scheduler.timesteps[:-1], grid[1:])}
    scheduler.tau_func = lambda timestep: step_tau[float(timestep)]
    x = noise.float()
    for i, sigma in enumerate(grid.tolist()):
        with autocast:
            v = predict_velocity(transformer, x, sigma, embeds, pooled, neg_embeds, neg_pooled, guidance_scale)
        if i == len(grid) - 1:
            return x - sigma * v
        scheduler.last_sample = None if i == 1 else scheduler.last_sample  # then diffusers skips the first corrector
        x = scheduler.step(v, scheduler.timesteps[i], x, generator=generator, return_dict=False)[0].float()


# ---------------------------------------------------------------------------------------------------------------
# Boilerplate shared verbatim by the SD3.5 scripts: input checks, prompts, model, rollout, decode, eval, checkpoint
# ---------------------------------------------------------------------------------------------------------------
def fail(msg: str):
    raise SystemExit(f"error: {msg}")


def check_args(args) -> dict | None:
    """Checks that need no weights (sizes, config files, wandb login, --resume); returns the checkpoint's state."""
    bad = [n for n in ("epochs", "batch_size", "eval_batch_size", "train_batch_size", "updates_per_epoch", "eval_every",
                       "save_every", "group_size", "prompts_per_epoch", "num_steps", "eval_num_steps", "lora_rank")
           if getattr(args, n, 1) < 1] + ["learning_rate"] * (args.learning_rate < 0)
    for n in bad[:1]:
        fail(f"--{n.replace('_', '-')} must be >= {0 if n == 'learning_rate' else 1}, got {getattr(args, n)}")
    try:  # the small config files give the resolution's factor before the weights load
        vae, dit = (json.load(open(os.path.join(args.model, f"{d}/config.json") if os.path.exists(args.model) else
                                   hf_hub_download(args.model, f"{d}/config.json"))) for d in ("vae", "transformer"))
    except Exception as e:
        fail(f"model {args.model!r} is neither an existing local path nor a hub id like 'org/name' with vae/ and "
             f"transformer/ config.json ({type(e).__name__})")
    factor = 2 ** (len(vae["block_out_channels"]) - 1) * dit.get("patch_size", 1)
    if args.resolution < 1 or args.resolution % factor:
        fail(f"--resolution {args.resolution} is not a multiple of {factor} (VAE downsampling x patch size)")
    if args.track and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        import wandb
        if not wandb.login(prompt=False):
            fail("--track needs a wandb login (`wandb login` or WANDB_API_KEY), or WANDB_MODE=offline")
    if not args.resume:
        return None
    path = os.path.join(args.resume, "state.pt")
    if os.path.basename(os.path.abspath(args.resume)).startswith(".") or not os.path.isfile(path):
        fail(f"--resume {args.resume!r} is not a checkpoint directory (no state.pt; hidden ones are unfinished saves)")
    state = torch.load(path, map_location="cpu")
    for flag in STATE_FLAGS:
        if (saved := state["args"][flag]) != getattr(args, flag):
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)!r} differs from the checkpoint's {saved!r}")
    if not args.eval_only and state["next_epoch"] >= args.epochs:
        fail(f"--epochs {args.epochs} is not past the checkpoint's {state['next_epoch']} epochs: nothing to train")
    return state


def load_prompts(path: str) -> tuple[list[str], list[dict]]:
    """One prompt per line, or JSONL (`.jsonl`) with a `prompt` field; returns prompts and per-prompt metadata."""
    if not os.path.isfile(path):
        fail(f"prompt file {path!r} does not exist")
    lines = [line.strip() for line in open(path, encoding="utf-8") if line.strip()]
    if not lines:
        fail(f"prompt file {path!r} is empty")
    if not path.endswith(".jsonl"):
        return lines, [{} for _ in lines]
    rows = [json.loads(line) for line in lines]
    if any("prompt" not in row for row in rows):
        fail(f"every line of {path!r} needs a 'prompt' field")
    return [row["prompt"] for row in rows], rows


def setup_distributed() -> tuple[int, int, torch.device]:
    """torchrun sets RANK/WORLD_SIZE: nccl on CUDA, gloo on CPU; plain `python` runs one process."""
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        return 0, 1, device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def all_gather_cat(t: torch.Tensor, world: int) -> torch.Tensor:
    """Concatenate an equally-shaped tensor from every rank, in rank order."""
    if world == 1:
        return t
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def seeded_generator(device: torch.device, *keys: int) -> torch.Generator:
    """A generator whose seed mixes (seed, epoch, rank, ...): every draw is reproducible on resume, no state to save."""
    return torch.Generator(device).manual_seed(int(np.random.SeedSequence(list(keys)).generate_state(1)[0]))


def encode(pipe, prompts: list[str], device, max_sequence_length: int):
    """Text embeddings (B, L, 4096) and pooled (B, 2048), from CLIP-L + CLIP-G + T5 as SD3 does."""
    return pipe.encode_prompt(prompts, None, None, device=device, do_classifier_free_guidance=False,
                              max_sequence_length=max_sequence_length)[::2]  # (embeds, -, pooled, -)


def predict_velocity(transformer, x, sigma, embeds, pooled, neg_embeds, neg_pooled, guidance_scale: float):
    """CFG velocity u + g (c - u), one forward on [uncond; cond] (cond only when g == 1); sigma: float or (B,)."""
    cfg = guidance_scale != 1.0
    timestep = (1000 * torch.as_tensor(sigma, device=x.device, dtype=torch.float32)).expand(x.shape[0])  # (B,)
    if cfg:
        x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        embeds, pooled = (torch.cat([neg.expand_as(c), c]) for neg, c in ((neg_embeds, embeds), (neg_pooled, pooled)))
    v = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds,
                    pooled_projections=pooled, return_dict=False)[0].float()
    v_uncond, v_cond = v.chunk(2) if cfg else (v, v)
    return v_uncond + guidance_scale * (v_cond - v_uncond)


@torch.no_grad()
def rollout(transformer, noise, sigmas, kind, noise_level, embeds, pooled, neg_embeds, neg_pooled, guidance_scale,
            autocast, generator):
    """Sample from sigma = 1 to 0. Returns latents (B, T+1, C, h, w) and log-probs (B, T), all fp32."""
    x, latents, log_probs = noise.float(), [noise.float()], []
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        with autocast:
            v = predict_velocity(transformer, x, sigma, embeds, pooled, neg_embeds, neg_pooled, guidance_scale)
        x, log_prob = sde_step(v, x, sigma, sigma_next, kind, noise_level, generator=generator, sigma_max=sigmas[1])[:2]
        latents.append(x)
        log_probs.append(log_prob)
    return torch.stack(latents, dim=1), torch.stack(log_probs, dim=1)


@torch.no_grad()
def decode(vae, latents) -> torch.Tensor:
    """Latents -> images (B, 3, H, W) in [0, 1], decoded in fp32 with the VAE's own scaling and shift."""
    latents = latents.float() / vae.config.scaling_factor + vae.config.shift_factor
    return (vae.decode(latents, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)


def contact_sheet(images: list[np.ndarray], path: str):
    """Save (H, W, 3) uint8 images as one near-square grid PNG (black cells fill the last row)."""
    cols = math.ceil(math.sqrt(len(images)))
    images = images + [np.zeros_like(images[0])] * (-len(images) % cols)
    rows = [np.concatenate(images[i : i + cols], axis=1) for i in range(0, len(images), cols)]
    Image.fromarray(np.concatenate(rows, axis=0)).save(path)


@torch.no_grad()
def evaluate(pipe, args, prompts, metadata, reward_fn, eval_sigmas, neg, rank, world, device, autocast, shape):
    """ODE-sample the test prompts (prompt i on rank i % world, noise seed i) -> (means of reward and info, sheet)."""
    scores, sheet = [], []
    for start in range(rank, len(prompts), world * args.eval_batch_size):
        idx = range(start, len(prompts), world)[: args.eval_batch_size]  # this rank's next prompts
        noise = torch.stack([torch.randn(shape, generator=seeded_generator(device, args.seed, i), device=device)
                             for i in idx])
        embeds, pooled = encode(pipe, [prompts[i] for i in idx], device, args.max_sequence_length)
        images = decode(pipe.vae, rollout(pipe.transformer, noise, eval_sigmas, "ode", 0.0, embeds, pooled, *neg,
                                          args.guidance_scale, autocast, None)[0][:, -1])
        batch_scores, info = reward_fn(images.cpu(), [prompts[i] for i in idx], [metadata[i] for i in idx])
        scores += [{"reward_mean": float(s), **{k: float(v[j]) for k, v in info.items()}}
                   for j, s in enumerate(batch_scores.tolist())]
        sheet += [(i, (img.permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8))
                  for i, img in zip(idx, images) if i < args.eval_sheet_size]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (scores, sheet))
        scores, sheet = [s for g in gathered for s in g[0]], [s for g in gathered for s in g[1]]
    means = {k: float(np.mean([s[k] for s in scores])) for k in scores[0]}
    return means, [img for _, img in sorted(sheet, key=lambda t: t[0])]


def save_checkpoint(path, transformer, lora_params, ema_params, optimizer, next_epoch, global_step, args, extra: dict):
    """Atomic: written to a hidden temp dir (--resume refuses it, `epoch_*` never matches it), then renamed. `lora/`,
    `ema_lora/`: diffusers LoRAs + peft config (trained alpha); state.pt resumes (`extra`: the algorithm's tensors)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = transformer.peft_config["default"].to_dict()
    for name, weights in (("lora", []), ("ema_lora", ema_params)):  # [] swaps nothing in
        with swapped(lora_params, weights):
            StableDiffusion3Pipeline.save_lora_weights(os.path.join(tmp, name), get_peft_model_state_dict(transformer),
                                                       transformer_lora_adapter_metadata=config)
    torch.save({"lora": [p.detach().cpu() for p in lora_params], "ema": [p.cpu() for p in ema_params],
                "optimizer": optimizer.state_dict(), "next_epoch": next_epoch, "global_step": global_step,
                "args": asdict(args), "extra": extra}, os.path.join(tmp, "state.pt"))
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


@contextmanager
def swapped(params, ema):
    """Temporarily put the EMA values into the live LoRA parameters (for eval and the saved `ema_lora`)."""
    for p, e in zip(params, ema):
        p.data, e.data = e.data, p.data
    try:
        yield
    finally:
        for p, e in zip(params, ema):
            p.data, e.data = e.data, p.data


@contextmanager
def adapters_disabled(transformer):
    """The base model: the same transformer with its LoRA switched off (never a second copy)."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def peak_memory_gb(device: torch.device) -> float:
    return (torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)  # Linux reports KiB


def prepare_run_dir(run_dir: str, start_epoch: int):
    """Create the run dir; a resumed one drops the metrics of the epochs it redoes and a crashed save's temp dirs."""
    for tmp in glob.glob(os.path.join(run_dir, "checkpoints", ".*")):
        shutil.rmtree(tmp)
    path = os.path.join(run_dir, "metrics.jsonl")
    lines = open(path).readlines() if os.path.exists(path) else []
    os.makedirs(run_dir, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(line for line in lines if json.loads(line)["epoch"] < start_epoch)


def rank_mean(values: dict[str, float], world: int, device) -> dict[str, float]:
    """The mean of each value over ranks (logged stats are the whole run's, not rank 0's)."""
    stacked = all_gather_cat(torch.tensor([list(values.values())], dtype=torch.float64, device=device), world)
    return dict(zip(values, stacked.mean(0).tolist()))


def check_finite(where: str, run_dir: str, **values):
    """Stop with one line naming the first non-finite value (reward, advantage, loss, gradient) and last checkpoint."""
    for name in [k for k, v in values.items() if not torch.isfinite(torch.as_tensor(v)).all()][:1]:
        last = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "epoch_*")))[-1:] or ["none saved yet"]
        fail(f"non-finite {name} at {where}; stopping. Last checkpoint: {last[0]}")


if __name__ == "__main__":
    args = tyro.cli(Args)

    # ---- input checks and batch arithmetic: fail with one clear line before any model loads ----
    train_prompts, train_meta = ([], []) if args.eval_only else load_prompts(args.train_prompts)
    test_prompts, test_meta = load_prompts(args.test_prompts)
    state = check_args(args)
    rank, world, device = setup_distributed()
    quiet = rank != 0 or not sys.stderr.isatty()  # progress bars only on rank 0's terminal, not in log files
    try:  # rewards are built before the model: a bad file or a server that does not answer fails here
        rewards.check_prompts(args.reward, train_prompts)
        rewards.check_prompts(args.eval_reward or args.reward, test_prompts)
        reward_fn = rewards.build_reward(args.reward, device=device)
        eval_reward_fn = rewards.build_reward(args.eval_reward, device=device) if args.eval_reward else reward_fn
    except ValueError as e:
        fail(str(e))
    images_per_epoch = args.prompts_per_epoch * args.group_size
    if images_per_epoch % (world * args.batch_size):
        fail(f"prompts-per-epoch x group-size = {images_per_epoch} images do not split into {world} GPUs x "
             f"batch-size {args.batch_size}; change --prompts-per-epoch, --group-size or --batch-size")
    local_images = images_per_epoch // world  # images sampled by this rank per epoch
    num_batches = local_images // args.batch_size
    if local_images % args.train_batch_size:
        fail(f"{local_images} images per GPU per epoch do not split into --train-batch-size {args.train_batch_size}")
    num_micro = local_images // args.train_batch_size  # micro-batches accumulated into the epoch's single step
    if int(args.num_steps * args.timestep_fraction) < 2 or args.train_timesteps < 1:
        fail(f"--num-steps {args.num_steps} x --timestep-fraction {args.timestep_fraction} leaves no training grid "
             f"points below sigma = 1 (need int(steps x fraction) >= 2), or --train-timesteps < 1")
    run_name = [f"{args.exp_name}__{args.seed}__{int(time.time())}"]
    if world > 1:
        dist.broadcast_object_list(run_name, src=0)
    run_dir = os.path.join(args.output_dir, run_name[0])
    parent = os.path.dirname(os.path.abspath(args.resume or "."))
    if args.resume and not args.eval_only and os.path.basename(parent) == "checkpoints":
        run_dir = os.path.dirname(parent)  # a resumed run continues its checkpoint's run directory
    if rank == 0:
        print(f"{world} {'GPU(s)' if device.type == 'cuda' else 'process(es)'} x {num_batches} "
              f"rollout batches x {args.batch_size} = {images_per_epoch} images/epoch "
              f"({args.prompts_per_epoch} prompts x {args.group_size}); 1 update/epoch of {num_micro} micro-batches "
              f"x {args.train_batch_size} samples x {args.train_timesteps} timesteps; run dir {run_dir}")

    # ---- model: frozen base in bf16/fp16, LoRA in fp32 (same init on every rank), VAE in fp32 ----
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}[args.mixed_precision]
    pipe = StableDiffusion3Pipeline.from_pretrained(args.model, dtype={"default": dtype, "vae": torch.float32}).to(device)
    transformer = pipe.transformer
    for module in (transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        if module is not None:
            module.requires_grad_(False)
    torch.manual_seed(args.seed)
    transformer.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, init_lora_weights="gaussian",
                                       target_modules=LORA_TARGETS))
    lora_params = [p for p in transformer.parameters() if p.requires_grad]
    for p in lora_params:
        p.data = p.data.float()
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW(lora_params, lr=args.learning_rate, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=args.mixed_precision == "fp16")
    ema_params, anchor_params = [p.detach().clone() for p in lora_params], [p.detach().clone() for p in lora_params]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    latent_shape = (transformer.config.in_channels, *[args.resolution // pipe.vae_scale_factor] * 2)
    pipe.scheduler.set_timesteps(args.num_steps, device=device)
    sigmas = pipe.scheduler.sigmas.float()  # (T+1,) from 1 to 0, SD3's shifted schedule: rollout and training grid
    pipe.scheduler.set_timesteps(args.eval_num_steps, device=device)
    eval_sigmas = pipe.scheduler.sigmas.float()
    solver = SASolverScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", predictor_order=2,
                               corrector_order=2)
    neg = encode(pipe, [""], device, args.max_sequence_length)  # empty-prompt CFG embedding (frozen: no graph)
    start_epoch, global_step = (state["next_epoch"], state["global_step"]) if state is not None else (0, 0)
    if state is not None:
        for params, saved in ((lora_params, "lora"), (ema_params, "ema"), (anchor_params, "anchor")):
            for p, value in zip(params, state["extra"]["anchor"] if saved == "anchor" else state[saved]):
                p.data.copy_(value)
        optimizer.load_state_dict(state["optimizer"])
    if rank == 0:  # created only now: a run that fails earlier leaves no directory behind
        prepare_run_dir(run_dir, start_epoch)
    if args.track and rank == 0:
        import wandb
        wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=os.path.basename(run_dir),
                   config=vars(args), save_code=True)

    def log(metrics: dict, epoch: int):
        if rank == 0:
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, **metrics}) + "\n")
            if args.track:
                wandb.log(metrics, step=epoch)

    def run_eval(epoch: int, prefix: str = "eval/") -> dict:
        with swapped(lora_params, ema_params):  # with --ema-decay 0 the EMA equals the live weights
            means, sheet = evaluate(pipe, args, test_prompts, test_meta, eval_reward_fn, eval_sigmas, neg, rank, world,
                                   device, autocast, latent_shape)
        if rank == 0:
            path = os.path.join(run_dir, f"eval_{epoch:05d}.png")
            contact_sheet(sheet, path)
            print(f"eval after {epoch} epochs: {args.eval_reward or args.reward} = {means['reward_mean']:.4f}")
            if args.track:
                wandb.log({"eval/sheet": wandb.Image(path)}, step=epoch)
        return {prefix + k: v for k, v in means.items()}

    if args.eval_only:
        log(run_eval(start_epoch), start_epoch)
    executor = ThreadPoolExecutor(max_workers=1)  # scores batch i while batch i+1 is sampled
    for epoch in range(start_epoch, 0 if args.eval_only else args.epochs):
        epoch_start = time.time()
        metrics = run_eval(epoch) if epoch % args.eval_every == 0 else {}

        # ---- SAMPLING: identical prompt draw on every rank; each group's images spread over ranks; keep final x0 ----
        prompt_gen = seeded_generator(torch.device("cpu"), args.seed, epoch)
        n, m = len(train_prompts), args.prompts_per_epoch  # m distinct prompts when there are enough
        chosen = torch.randperm(n, generator=prompt_gen)[:m] if n >= m else torch.randint(n, (m,), generator=prompt_gen)
        order = torch.randperm(images_per_epoch, generator=prompt_gen)
        group_ids = torch.arange(args.prompts_per_epoch).repeat_interleave(args.group_size)[order]  # (P*G,) all ranks
        my_groups = group_ids[rank * local_images : (rank + 1) * local_images].view(num_batches, args.batch_size)
        noise_gen = seeded_generator(device, args.seed, epoch, rank)
        transformer.eval()
        rollouts, futures = [], []
        for b in tqdm(range(num_batches), desc=f"epoch {epoch} sampling", disable=quiet, leave=False):
            idx = [int(chosen[g]) for g in my_groups[b]]
            prompts, meta = [train_prompts[i] for i in idx], [train_meta[i] for i in idx]
            batch_embeds, batch_pooled = encode(pipe, prompts, device, args.max_sequence_length)  # frozen: no graph
            noise = torch.randn((args.batch_size, *latent_shape), generator=noise_gen, device=device)
            cond = (batch_embeds, batch_pooled, *neg, args.guidance_scale, autocast, noise_gen)
            if args.sampler == "sa_solver":
                batch_x0 = sa_solver_rollout(transformer, solver, noise, sigmas, args.noise_level, args.tau_window, *cond)
            else:  # the shared Euler rollout, keeping only its last latent
                kind = "flow" if args.sampler == "flow_sde" else "ode"
                batch_x0 = rollout(transformer, noise, sigmas, kind, args.noise_level, *cond)[0][:, -1]  # (B, C, h, w)
            futures.append(executor.submit(reward_fn, decode(pipe.vae, batch_x0).cpu(), prompts, meta))
            rollouts.append((batch_embeds, batch_pooled, batch_x0))
        embeds, pooled, x0 = (torch.cat(z) for z in zip(*rollouts))  # (N, L, D), (N, D'), (N, C, h, w); N = local_images
        sampling_seconds = time.time() - epoch_start

        # ---- REWARD: wait for the scorer, gather every rank's rewards in rank order ----
        results = [f.result() for f in futures]
        info = {k: torch.cat([r[1][k] for r in results]) for k in results[0][1]}  # each (local_images,)
        all_rewards = all_gather_cat(torch.cat([r[0] for r in results]).float().to(device), world).cpu()  # (P*G,)
        all_components = {k: all_gather_cat(info[k].to(device), world).cpu() for k in reward_fn.weights}
        extras = rank_mean({f"reward/{k}": v.mean().item() for k, v in info.items() if k not in reward_fn.weights},
                           world, device)  # info beyond the weighted components, e.g. pickscore_raw
        if reward_fn.group_transform is not None:  # groupwise rewards (pickscore_rank) see whole groups only here
            all_rewards, all_components = reward_fn.group_transform(all_components, group_ids)

        # ---- ADVANTAGE: per-prompt mean, global (or per-group) std ----
        advantages = compute_advantages(all_rewards, all_components, reward_fn.weights, group_ids,
                                        args.advantage_aggregation, args.per_group_std)
        check_finite(f"epoch {epoch}", run_dir, reward=all_rewards, advantage=advantages)
        my_adv = advantages[rank * local_images : (rank + 1) * local_images].to(device)  # (local_images,)
        group_std = torch.stack([all_rewards[group_ids == g].std(unbiased=False) for g in range(args.prompts_per_epoch)])

        # ---- TRAINING: K stratified timesteps per micro-batch, fresh noise; grads accumulate into ONE step ----
        transformer.train()
        train_gen = seeded_generator(device, args.seed, epoch, rank, 1)  # training timesteps and noise
        stats = {"policy_loss": [], "kl": [], "anchor_kl": [], "fm_loss": []}
        k, bs = args.train_timesteps, args.train_batch_size
        for start in tqdm(range(0, local_images, bs), desc=f"epoch {epoch} training", disable=quiet, leave=False):
            mb = slice(start, start + bs)
            t_idx = stratified_timestep_indices(args.num_steps, k, args.timestep_fraction, args.time_type, train_gen)
            t = sigmas[t_idx.to(device)].repeat_interleave(bs)  # (K*B,) timestep-major: K blocks of the B samples
            x0_k = x0[mb].repeat(k, 1, 1, 1)  # (K*B, C, h, w)
            noise = torch.randn(x0_k.shape, generator=train_gen, device=device)
            xt = (1 - t.view(-1, 1, 1, 1)) * x0_k + t.view(-1, 1, 1, 1) * noise
            cond = (embeds[mb].repeat(k, 1, 1), pooled[mb].repeat(k, 1))  # (K*B, L, D), (K*B, D')
            with torch.no_grad(), autocast:  # both reference forwards run before the graph-building one
                if args.kl_beta > 0:
                    with adapters_disabled(transformer):
                        v_base = predict_velocity(transformer, xt, t, *cond, *neg, args.guidance_scale)
                if args.anchor_beta > 0:
                    with swapped(lora_params, anchor_params):  # the anchor: upstream's "ema" adapter
                        v_anchor = predict_velocity(transformer, xt, t, *cond, *neg, args.guidance_scale)
            with autocast:
                v = predict_velocity(transformer, xt, t, *cond, *neg, args.guidance_scale)  # (K*B, C, h, w)
            log_prob = awm_log_prob(v, x0_k, noise, t, args.weighting, args.ghuber_power)  # (K*B,) float64
            policy_loss, _ = awm_policy_loss(log_prob, log_prob.detach(),  # on-policy as upstream: logp_old = logp
                                             my_adv[mb].repeat(k), args.clip_range, args.adv_clip)  # so ratio == 1
            kl = ((v - v_base) ** 2).mean() if args.kl_beta > 0 else v.new_zeros(())
            anchor_kl = ((v - v_anchor) ** 2).mean() if args.anchor_beta > 0 else v.new_zeros(())
            loss = policy_loss.float() + args.kl_beta * kl + args.anchor_beta * anchor_kl
            scaler.scale(loss / num_micro).backward()
            fm_loss = ((v.detach() - (noise - x0_k)) ** 2).mean()
            for key, value in zip(stats, (policy_loss, kl, anchor_kl, fm_loss)):
                stats[key].append(value.item())

        # the epoch's one optimizer step: average LoRA grads over ranks in one flat all-reduce, clip, step, EMA
        if world > 1:
            flat = torch.cat([p.grad.flatten() for p in lora_params])
            dist.all_reduce(flat)
            for p, g in zip(lora_params, flat.div_(world).split([p.numel() for p in lora_params])):
                p.grad.copy_(g.view_as(p))
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm)
        if not scaler.is_enabled():  # (fp16's scaler skips non-finite steps itself)
            check_finite(f"epoch {epoch}, step {global_step}", run_dir, loss=loss, gradient=grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        global_step += 1
        decay = min(args.ema_decay, (1 + global_step) / (10 + global_step))  # upstream EMA warm-up
        d_anchor = min(args.anchor_decay_max, args.anchor_decay_rate * global_step)  # upstream 'linear' anchor decay
        for e, a, p in zip(ema_params, anchor_params, lora_params):  # plain tensors: no autograd graph
            e.mul_(decay).add_(p.detach(), alpha=1 - decay)
            a.mul_(d_anchor).add_(p.detach(), alpha=1 - d_anchor)

        # ---- LOGGING, CHECKPOINT ----
        epoch_seconds = time.time() - epoch_start
        metrics.update(rank_mean({f"losses/{k}": float(np.mean(v)) for k, v in stats.items()}, world, device))
        metrics.update({"losses/grad_norm": float(grad_norm), "charts/anchor_decay": d_anchor,
            "reward/mean": all_rewards.mean().item(), "reward/std": all_rewards.std(unbiased=False).item(),
            "reward/zero_std_group_frac": (group_std == 0).float().mean().item(),
            **{f"reward/{k}": v.mean().item() for k, v in all_components.items()}, **extras,
            "charts/global_step": global_step, "charts/learning_rate": args.learning_rate,
            "perf/images_per_sec": images_per_epoch / sampling_seconds, "perf/epoch_seconds": epoch_seconds,
            "perf/max_mem_gb": peak_memory_gb(device), "charts/x0_norm": (x0**2).mean().item()})
        if epoch + 1 == args.epochs:
            metrics.update(run_eval(epoch + 1, prefix="eval/final_"))
        log(metrics, epoch)
        if rank == 0 and (group_std == 0).all():  # warnings.warn shows this once per run
            warnings.warn("an epoch where every group's rewards are all equal: zero advantages, nothing to learn")
        if rank == 0:
            print(f"epoch {epoch}: reward {metrics['reward/mean']:.4f} ± {metrics['reward/std']:.4f} | policy "
                  f"{metrics['losses/policy_loss']:.3e} kl {metrics['losses/kl']:.3e} anchor {metrics['losses/anchor_kl']:.3e}"
                  f" | fm {metrics['losses/fm_loss']:.3e} | {metrics['perf/images_per_sec']:.2f} img/s | {epoch_seconds:.0f}s"
                  + (f" | eval {metrics['eval/reward_mean']:.4f}" if "eval/reward_mean" in metrics else ""))
        if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                save_checkpoint(os.path.join(run_dir, "checkpoints", f"epoch_{epoch + 1:05d}"), transformer,
                                lora_params, ema_params, optimizer, epoch + 1, global_step, args,
                                extra={"anchor": [a.cpu() for a in anchor_params]})
            if world > 1:
                dist.barrier()
    executor.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
