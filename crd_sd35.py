"""Centered Reward Distillation (CRD, arXiv:2603.14128) on SD3.5 Medium: forward-process RL that regresses a centered
implicit reward onto the centered external reward. Upstream: the paper author's port, X-GenGroup/Flow-Factory
trainers/crd.py (CRDTrainer). Rollouts from a "sampling" LoRA snapshot; r_theta = flow-matching-error gap of the
current LoRA to an "old" snapshot; KL to the base model with CFG. Defaults = paper Table 3 (OCR), port's PR #121:
    torchrun --nproc_per_node 8 crd_sd35.py --kl-beta 0.1 --train-prompts ocr/train.txt --test-prompts ocr/test.txt
Toy-world CPU demo (~1 min; the held-out exact counting accuracy, `eval`, rises):
    python crd_sd35.py --model tests/assets/toy-sd3 --train-prompts tests/assets/toy_train.txt \
        --test-prompts tests/assets/toy_test.txt --reward tests/toy_rewards.py:counting_partial \
        --eval-reward tests/toy_rewards.py:counting --resolution 32 --max-sequence-length 24 --mixed-precision no \
        --eval-num-steps 10 --group-size 16 --prompts-per-epoch 6 --batch-size 16 --lora-rank 8 --lora-alpha 8 \
        --kl-beta 0 --ema-decay 0 --num-train-timesteps 5 --learning-rate 3e-3 --epochs 8
"""

import glob
import json
import math
import os
import re
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
from diffusers import StableDiffusion3Pipeline
from huggingface_hub import hf_hub_download
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from PIL import Image
from tqdm import tqdm

import rewards
from sde import sde_step, shift_sigmas


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (wandb group and run-directory prefix)"""
    seed: int = 42
    """seed of LoRA init and prompt draws (identical on all ranks); sampling noise is seeded per rank and epoch"""
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
    """LoRA rank on the 8 joint-attention projections of every block"""
    lora_alpha: int = 64
    """LoRA alpha (scale = alpha / rank)"""
    max_sequence_length: int = 256
    """T5 tokens per prompt (the port: diffusers' default 256)"""
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
    num_steps: int = 10
    """Euler ODE steps per rollout on `sigma_grid` (the grid, but its final 0, is also the training timestep grid)"""
    eval_num_steps: int = 40
    """Euler ODE steps for eval"""
    guidance_scale: float = 1.0
    """classifier-free guidance scale in rollouts, the trained forward and eval (CRD is CFG-free: 1.0)"""
    group_size: int = 24
    """images per prompt (the centering group)"""
    prompts_per_epoch: int = 48
    """prompts (groups) per epoch, over all GPUs"""
    batch_size: int = 8
    """per-GPU micro-batch in rollout and training"""
    eval_batch_size: int = 8
    """per-GPU eval batch"""
    updates_per_epoch: int = 2
    """optimizer steps per epoch"""
    epochs: int = 1000
    """epochs to train (each = sample, score, update)"""
    learning_rate: float = 3e-4
    """AdamW learning rate (constant)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    ema_decay: float = 0.995
    """EMA decay (power warm-up min(d, (1+n)/(10+n))) of the LoRA used for eval and the saved `ema` LoRA (0 disables)"""
    ema_every: int = 10
    """update the EMA once every N epochs, n = epoch (the port); 0 = after every optimizer step, n = optimizer steps"""
    crd_beta: float = 1.0
    """scale of the implicit reward in the regression crd_beta (r - r_mean) ~ (a - a_mean)"""
    weight_temp: float = -1.0
    """centering weights: < 0 uniform; > 0 softmax(+-a / T), two centerings averaged; 0 hard pools a >< 0.5"""
    center_by: Literal["group", "batch"] = "group"
    """centering set: each prompt's group in the gathered micro-batch (cancels log Z(c)), or all of it (the port)"""
    adaptive_logp: bool = True
    """divide each squared velocity error by its detached per-sample mean |error| (self-normalised ELBO gap)"""
    old_decay: str = "0-0.25-0.005-0.999"
    """old snapshot (implicit-reward reference) schedule "S-v0-k-vmax" over optimizer steps (see snapshot_decay)"""
    sampling_decay: str = "75-0.0-0.0075-0.999"
    """sampling snapshot (generates rollouts) schedule, same format (decay <= 0: hard copy, on-policy)"""
    kl_beta: float = 0.1
    """weight of the per-sample KL mean((v_theta - v_teacher)^2) to the base model (LoRA disabled) with CFG kl_cfg"""
    kl_cfg: float = 4.5
    """CFG scale of the KL teacher (the base model as it is used at inference)"""
    reward_adaptive_kl: bool = True
    """weight each sample's KL by c_min + a (1 - c_min), c_min = 1e-4 / kl_beta: good samples stay near the teacher"""
    num_train_timesteps: int = 20
    """training timesteps per micro-batch (shared by its samples), continuous strata over the eligible grid points"""
    timestep_range: float = 0.99
    """train on rollout-grid sigmas >= 1 - timestep_range"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip, then mapped to a = clip(A) / (2 adv_clip) + 0.5 in [0, 1]"""
    per_group_std: bool = False
    """normalise advantages by each group's std instead of the epoch's global std (upstream default: global)"""
    eval_every: int = 20
    """evaluate every N epochs (and after the last)"""
    eval_sheet_size: int = 16
    """images of the first eval prompts in the contact sheet"""
    save_every: int = 20
    """checkpoint every N epochs (and after the last)"""


LORA_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]  # the 8 joint-attention projections
STATE_FLAGS = ["model", "lora_rank", "lora_alpha"]  # --resume refuses a checkpoint saved with other values


# ---- Algorithm: advantages, snapshot schedules, implicit reward, centered loss, KL ----------------------------------
def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, per_group_std: bool, eps: float = 1e-4):
    """(reward - its group's mean) / (std + eps), std over all rewards (upstream `global_std`) or within the group;
    rewards, group_ids: (N,). Population std as upstream's np.std. A group whose rewards are all equal gets zeros."""
    rewards = rewards.double()
    n_groups = int(group_ids.max()) + 1
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_ids, torch.ones_like(rewards))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_ids, rewards) / count
    centered = rewards - mean[group_ids]
    if per_group_std:
        var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_ids, centered**2) / count
        std = var.sqrt()[group_ids]
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


def snapshot_decay(step: int, spec: str) -> float:
    """"S-v0-k-vmax" -> decay after `step` optimizer steps: v0 if step < S, else min(v0 + (step - S) k, vmax)."""
    number = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"  # 1e-3 has a dash of its own
    match = re.fullmatch(rf"(\d+)-{number}-{number}-{number}", spec.strip())
    if match is None:
        raise ValueError(f"decay schedule {spec!r} is not 'S-v0-k-vmax' (S an integer), e.g. '75-0.0-0.0075-0.999'")
    start, v0, slope, vmax = int(match[1]), float(match[2]), float(match[3]), float(match[4])
    return v0 if step < start else min(v0 + (step - start) * slope, vmax)


def blend_snapshot(snapshot: list[torch.Tensor], params: list[torch.Tensor], decay: float):
    """snapshot <- decay snapshot + (1 - decay) current, in place; decay <= 0 copies, decay >= 1 freezes."""
    decay = min(max(decay, 0.0), 1.0)  # exact in floating point at 0 (x 0 + p) and 1 (s + 0 p)
    for s, p in zip(snapshot, params):
        s.mul_(decay).add_(p.detach(), alpha=1 - decay)


def sigma_grid(num_steps: int, shift: float) -> torch.Tensor:
    """(T+1,) the port's grid: SD3's shift of linspace(1, 1/T, T), then 0 (Flow-Factory set_scheduler_timesteps)."""
    u = torch.linspace(1, 1 / num_steps, num_steps, dtype=torch.float64)
    return torch.cat([shift_sigmas(u, shift), u.new_zeros(1)]).float()


def train_timestep_indices(num_eligible: int, num_train: int, generator: torch.Generator) -> torch.Tensor:
    """(num_train,) indices into the eligible grid, stratified: draw j falls in [j n / T, (j + 1) n / T)."""
    u = torch.rand(num_train, generator=generator, device=generator.device)
    return ((torch.arange(num_train, device=u.device) + u) * num_eligible / num_train).floor().long()


def crd_implicit_reward(v, v_old, target, adaptive: bool = True) -> torch.Tensor:
    """Per-sample implicit reward (B,) -mean(e^2 / w - e_old^2 / w_old); e = v - target, target = eps - x0, all
    (B, ...); w = detached per-sample mean |e| clamped >= 1e-5 if `adaptive`, else 1. Grad through v (port: step 4)."""
    dims = tuple(range(1, v.dim()))
    err, err_old = v.double() - target.double(), v_old.detach().double() - target.double()
    w, w_old = (e.detach().abs().mean(dims, True).clamp_min(1e-5) if adaptive else 1.0 for e in (err, err_old))  # port
    return -(err**2 / w - err_old**2 / w_old).mean(dim=dims).float()


def crd_loss(r_theta, a, group_ids, crd_beta: float = 1.0, weight_temp: float = -1.0, adv_clip: float = 5.0):
    """Centered reward distillation loss (scalar). r_theta, a (mapped to [0, 1]), group_ids: (N,); equal ids form a
    centering set. Per set and weight vector p: a_bar = sum p a, r_bar = stopgrad(sum p r), d = crd_beta (r - r_bar)
    - (a - a_bar); loss = mean_N d^2 (mean over the p's) x adv_clip / crd_beta (port: _compute_crd_loss)."""
    total = r_theta.new_zeros(())
    for g in group_ids.unique():
        r, ag = r_theta[group_ids == g], a[group_ids == g].to(r_theta.dtype)
        uniform = torch.full_like(ag, 1 / len(ag))
        if weight_temp != 0:  # uniform (< 0), or two softmax centerings (> 0)
            weights = [uniform] if weight_temp < 0 else [torch.softmax(x / weight_temp, dim=0) for x in (ag, -ag)]
        else:  # hard pools split at a = 0.5 (the raw advantage's sign); the port splits the mapped a at 0 (degenerate)
            weights = [torch.softmax(ag.masked_fill(~pool, -math.inf), dim=0) if pool.any() else uniform
                       for pool in (ag > 0.5, ag < 0.5)]
        for p in weights:
            d = crd_beta * (r - (p * r).sum().detach()) - (ag - (p * ag).sum())
            total = total + (d**2).sum() / len(weights)
    return total / len(r_theta) * adv_clip / crd_beta


def crd_kl(v, v_teacher, a, kl_beta: float, reward_adaptive: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(kl_beta * weighted mean of per-sample KL, per-sample KL (B,)), KL = mean((v - v_teacher)^2); the weight is
    c_min + a (1 - c_min) with c_min = 1e-4 / kl_beta when reward-adaptive, else 1 (port: step 7)."""
    kl = ((v - v_teacher.detach()) ** 2).mean(dim=tuple(range(1, v.dim())))  # (B,)
    weight = 1e-4 / kl_beta + a * (1 - 1e-4 / kl_beta) if reward_adaptive and kl_beta > 0 else 1.0  # port's c_min
    return kl_beta * (weight * kl).mean(), kl.detach()


# ---- Boilerplate shared verbatim by the SD3.5 scripts: input checks, prompts, model, rollout, decode, eval, checkpoint
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
        snapshot_decay(0, args.old_decay), snapshot_decay(0, args.sampling_decay)
        reward_fn = rewards.build_reward(args.reward, device=device)
        eval_reward_fn = rewards.build_reward(args.eval_reward, device=device) if args.eval_reward else reward_fn
    except ValueError as e:
        fail(str(e))
    if args.num_train_timesteps < 1 or args.timestep_range <= 0:
        fail(f"--num-train-timesteps {args.num_train_timesteps} and --timestep-range {args.timestep_range} must be > 0")
    images_per_epoch = args.prompts_per_epoch * args.group_size
    if images_per_epoch % (world * args.batch_size):
        fail(f"prompts-per-epoch x group-size = {images_per_epoch} images do not split into {world} GPUs x "
             f"batch-size {args.batch_size}; change --prompts-per-epoch, --group-size or --batch-size")
    local_images = images_per_epoch // world  # images sampled by this rank per epoch
    num_batches = local_images // args.batch_size
    if num_batches % args.updates_per_epoch:
        fail(f"{num_batches} micro-batches per GPU per epoch do not split into --updates-per-epoch "
             f"{args.updates_per_epoch}; change --updates-per-epoch or --batch-size")
    if args.center_by == "group" and math.gcd(args.group_size, world * args.batch_size) < 2:  # smallest group piece
        fail(f"--group-size {args.group_size} and {world} GPUs x --batch-size {args.batch_size} leave a prompt with a "
             "single image in some micro-step, which group centering cannot use; make them share a factor >= 2")
    accum = num_batches // args.updates_per_epoch * args.num_train_timesteps  # micro-steps per optimizer step
    run_name = [f"{args.exp_name}__{args.seed}__{int(time.time())}"]
    if world > 1:
        dist.broadcast_object_list(run_name, src=0)
    parent = os.path.dirname(os.path.abspath(args.resume or "."))  # a resumed run continues its checkpoint's run dir
    resumed = args.resume and not args.eval_only and os.path.basename(parent) == "checkpoints"
    run_dir = os.path.dirname(parent) if resumed else os.path.join(args.output_dir, run_name[0])
    if rank == 0:
        print(f"{world} {'GPU(s)' if device.type == 'cuda' else 'process(es)'} x {num_batches} "
              f"micro-batches x {args.batch_size} = {images_per_epoch} images/epoch "
              f"({args.prompts_per_epoch} prompts x {args.group_size}); {args.updates_per_epoch} updates/epoch of "
              f"{accum} micro-steps each; run dir {run_dir}")

    # ---- model: frozen base in bf16/fp16, LoRA in fp32 (same init on every rank), VAE in fp32 ----
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}[args.mixed_precision]
    pipe = StableDiffusion3Pipeline.from_pretrained(args.model, dtype={"default": dtype, "vae": torch.float32}).to(device)
    transformer = pipe.transformer
    for module in filter(None, (transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3)):
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
    # fp32 copies: EMA, old (implicit-reward reference, `swapped` into the LoRA), sampling (generates the rollouts)
    ema_params, old_params, sampling_params = ([p.detach().clone() for p in lora_params] for _ in range(3))
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    latent_shape = (transformer.config.in_channels, *[args.resolution // pipe.vae_scale_factor] * 2)
    sigmas = sigma_grid(args.num_steps, pipe.scheduler.config.shift).to(device)  # (T+1,) the port's grid, 1 to 0
    train_sigmas = sigmas[:-1][sigmas[:-1] >= 1 - args.timestep_range]  # (n,) training timesteps, sigma 1 always in
    eval_sigmas = sigma_grid(args.eval_num_steps, pipe.scheduler.config.shift).to(device)
    if rank == 0 and args.num_train_timesteps > len(train_sigmas):
        print(f"note: --num-train-timesteps {args.num_train_timesteps} > {len(train_sigmas)} eligible grid points "
              f"{[round(x, 4) for x in train_sigmas.tolist()]}: each is trained several times per micro-batch")
    neg = encode(pipe, [""], device, args.max_sequence_length)  # empty prompt: eval CFG and the CFG KL teacher
    start_epoch, global_step = (0, 0) if state is None else (state["next_epoch"], state["global_step"])
    if state is not None:
        for params, saved in ((lora_params, state["lora"]), (ema_params, state["ema"]),
                              (old_params, state["extra"]["old"]), (sampling_params, state["extra"]["sampling"])):
            for p, value in zip(params, saved):
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
    # image i: prompt i // G, gathered micro-step i // (W B), rank (i // B) % W: groups contiguous, centered per step
    layout = torch.arange(images_per_epoch).view(num_batches, world, args.batch_size)  # image ids (steps, W, B)
    group_ids = layout.transpose(0, 1).flatten() // args.group_size  # (P*G,) in gathered (rank-major) order
    step_groups = (layout.flatten(1) // args.group_size * (args.center_by == "group")).to(device)  # (steps, W*B)
    my_groups = group_ids[rank * local_images : (rank + 1) * local_images].view(num_batches, args.batch_size)
    executor = ThreadPoolExecutor(max_workers=1)  # scores batch i while batch i+1 is sampled
    for epoch in range(start_epoch, 0 if args.eval_only else args.epochs):
        epoch_start = time.time()
        metrics = run_eval(epoch) if epoch % args.eval_every == 0 else {}
        # ---- SAMPLING: Euler ODE at CFG guidance_scale with the sampling snapshot; keep only x0 ----
        prompt_gen = seeded_generator(torch.device("cpu"), args.seed, epoch)
        chosen = (torch.randperm(len(train_prompts), generator=prompt_gen)[: args.prompts_per_epoch]
                  if len(train_prompts) >= args.prompts_per_epoch
                  else torch.randint(len(train_prompts), (args.prompts_per_epoch,), generator=prompt_gen))
        noise_gen = seeded_generator(device, args.seed, epoch, rank)
        transformer.eval()
        batches, futures = [], []
        with swapped(lora_params, sampling_params), torch.no_grad():
            for b in tqdm(range(num_batches), desc=f"epoch {epoch} sampling", disable=quiet, leave=False):
                idx = [int(chosen[g]) for g in my_groups[b]]
                prompts, meta = [train_prompts[i] for i in idx], [train_meta[i] for i in idx]
                embeds, pooled = encode(pipe, prompts, device, args.max_sequence_length)
                noise = torch.randn((args.batch_size, *latent_shape), generator=noise_gen, device=device)
                x0 = rollout(transformer, noise, sigmas, "ode", 0.0, embeds, pooled, *neg, args.guidance_scale,
                             autocast, None)[0][:, -1]  # (B, C, h, w)
                futures.append(executor.submit(reward_fn, decode(pipe.vae, x0).cpu(), prompts, meta))
                batches.append((embeds, pooled, x0))
        sampling_seconds = time.time() - epoch_start
        # ---- REWARD: wait for the scorer, gather every rank's rewards in rank order ----
        results = [f.result() for f in futures]
        info = {k: torch.cat([r[1][k] for r in results]) for k in results[0][1]}  # each (local_images,)
        all_rewards = all_gather_cat(torch.cat([r[0] for r in results]).float().to(device), world).cpu()  # (P*G,)
        all_components = {k: all_gather_cat(info[k].to(device), world).cpu() for k in reward_fn.weights}
        extras = rank_mean({f"reward/{k}": v.mean().item() for k, v in info.items()  # e.g. pickscore_raw
                            if k not in reward_fn.weights}, world, device)
        if reward_fn.group_transform is not None:  # groupwise rewards (pickscore_rank) see whole groups only here
            all_rewards, all_components = reward_fn.group_transform(all_components, group_ids)
        # ---- ADVANTAGE: per-prompt mean, global (or per-group) std, clipped and mapped to a in [0, 1] ----
        advantages = compute_advantages(all_rewards, all_components, reward_fn.weights, group_ids,
                                        args.advantage_aggregation, args.per_group_std)
        mapped = (advantages.clamp(-args.adv_clip, args.adv_clip) / (2 * args.adv_clip) + 0.5).to(device)
        step_a = mapped.view(world, num_batches, args.batch_size).transpose(0, 1).flatten(1)  # (steps, W*B)
        group_std = torch.stack([all_rewards[group_ids == g].std(unbiased=False) for g in range(args.prompts_per_epoch)])
        # ---- TRAINING: re-noise x0 at shared grid timesteps; old, current and CFG-teacher velocities at x_t ----
        transformer.train()
        time_gen = seeded_generator(device, args.seed, epoch, 1)  # same timesteps on every rank (shared centering)
        train_gen = seeded_generator(device, args.seed, epoch, rank, 1)  # this rank's re-noising
        stats = {"policy_loss": [], "kl": [], "kl_loss": [], "r_theta": [], "old_deviate": [], "old_kl": []}
        first_r_theta, micro = float("nan"), 0
        mine = torch.arange(rank * args.batch_size, (rank + 1) * args.batch_size, device=device)  # own part of a step
        for b, (embeds, pooled, x0) in enumerate(tqdm(batches, f"epoch {epoch} training", disable=quiet, leave=False)):
            for t in train_sigmas[train_timestep_indices(len(train_sigmas), args.num_train_timesteps, time_gen)]:
                noise = torch.randn(x0.shape, generator=train_gen, device=device)
                xt, target = (1 - t) * x0 + t * noise, noise - x0
                with torch.no_grad(), autocast, swapped(lora_params, old_params):
                    v_old = predict_velocity(transformer, xt, t, embeds, pooled, *neg, args.guidance_scale)
                if args.kl_beta > 0:  # the CFG teacher: 2 extra forwards, skipped when there is no KL term
                    with torch.no_grad(), autocast, adapters_disabled(transformer):
                        v_teacher = predict_velocity(transformer, xt, t, embeds, pooled, *neg, args.kl_cfg)
                with autocast:
                    v = predict_velocity(transformer, xt, t, embeds, pooled, *neg, args.guidance_scale)
                r_local = crd_implicit_reward(v, v_old, target, args.adaptive_logp)  # (B,)
                r_step = all_gather_cat(r_local.detach(), world).index_copy(0, mine, r_local)  # (W*B,), own with grad
                policy_loss = crd_loss(r_step, step_a[b], step_groups[b], args.crd_beta, args.weight_temp, args.adv_clip)
                kl_loss = torch.zeros((), device=device)
                if args.kl_beta > 0:
                    kl_loss, kl = crd_kl(v, v_teacher, step_a[b, mine], args.kl_beta, args.reward_adaptive_kl)
                    stats["kl"].append(kl.mean().item())
                    stats["old_kl"].append(((v_old - v_teacher) ** 2).mean().item())  # old vs the teacher
                # only this rank's B of the W*B terms carry gradient: x world = the gathered mean's (port: rank mean)
                scaler.scale((world * policy_loss + kl_loss) / accum).backward()
                if micro == 0:  # r_theta is exactly 0 while old == current (the first epoch, or old decay <= 0)
                    first_r_theta = r_local.abs().max().item()
                for k, value in (("policy_loss", policy_loss), ("kl_loss", kl_loss), ("r_theta", r_local.mean()),
                                 ("old_deviate", ((v.detach() - v_old) ** 2).mean())):
                    stats[k].append(value.item())
                micro += 1
                if micro % accum:
                    continue
                # one optimizer step: average LoRA grads over ranks in one flat all-reduce, clip, step, EMA
                if world > 1:
                    flat = torch.cat([p.grad.flatten() for p in lora_params])
                    dist.all_reduce(flat)
                    for p, g in zip(lora_params, (flat / world).split([p.numel() for p in lora_params])):
                        p.grad.copy_(g.view_as(p))
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm)
                if not scaler.is_enabled():  # (fp16's scaler skips non-finite steps itself)
                    check_finite(f"epoch {epoch}, step {global_step}", run_dir, loss=policy_loss + kl_loss, gradient=grad_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                if args.ema_every == 0 or args.ema_decay == 0:  # per optimizer step (decay 0: EMA = live weights)
                    blend_snapshot(ema_params, lora_params, min(args.ema_decay, (1 + global_step) / (10 + global_step)))
        if args.ema_decay > 0 and args.ema_every > 0 and (epoch + 1) % args.ema_every == 0:  # Flow-Factory crd.py
            blend_snapshot(ema_params, lora_params, min(args.ema_decay, (1 + epoch) / (10 + epoch)))  # ema_step(epoch)
        # ---- SNAPSHOTS: old, then sampling <- decay snapshot + (1 - decay) current, decays from optimizer steps ----
        old_decay, sampling_decay = (snapshot_decay(global_step, s) for s in (args.old_decay, args.sampling_decay))
        blend_snapshot(old_params, lora_params, old_decay)
        blend_snapshot(sampling_params, lora_params, sampling_decay)
        # ---- LOGGING, CHECKPOINT ----
        epoch_seconds = time.time() - epoch_start
        metrics.update(rank_mean({f"losses/{k}": float(np.mean(v)) for k, v in stats.items() if v}, world, device))
        metrics.update({"losses/first_r_theta_abs": first_r_theta, "losses/grad_norm": float(grad_norm),
            "charts/old_decay": old_decay, "charts/sampling_decay": sampling_decay, "charts/global_step": global_step,
            "charts/learning_rate": args.learning_rate, "perf/max_mem_gb": peak_memory_gb(device),
            "reward/mean": all_rewards.mean().item(), "reward/std": all_rewards.std(unbiased=False).item(),
            "reward/zero_std_group_frac": (group_std == 0).float().mean().item(),
            **{f"reward/{k}": v.mean().item() for k, v in all_components.items()}, **extras,
            "perf/images_per_sec": images_per_epoch / sampling_seconds, "perf/epoch_seconds": epoch_seconds})
        if epoch + 1 == args.epochs:
            metrics.update(run_eval(epoch + 1, prefix="eval/final_"))
        log(metrics, epoch)
        if rank == 0 and (group_std == 0).all():  # warnings.warn shows this once per run
            warnings.warn("an epoch where every group's rewards are all equal: zero advantages, nothing to learn")
        if rank == 0:
            print(f"epoch {epoch}: reward {metrics['reward/mean']:.4f} ± {metrics['reward/std']:.4f} | policy "
                  f"{metrics['losses/policy_loss']:.3e} kl {metrics.get('losses/kl', 0.0):.3e} | r_theta "
                  f"{metrics['losses/r_theta']:.1e} | decay old {old_decay:.3f} sampling {sampling_decay:.3f} "
                  f"| {metrics['perf/images_per_sec']:.2f} img/s | {epoch_seconds:.0f}s"
                  + (f" | eval {metrics['eval/reward_mean']:.4f}" if "eval/reward_mean" in metrics else ""))
        if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                save_checkpoint(os.path.join(run_dir, "checkpoints", f"epoch_{epoch + 1:05d}"), transformer,
                                lora_params, ema_params, optimizer, epoch + 1, global_step, args,
                                extra={"old": [o.cpu() for o in old_params], "sampling": [s.cpu() for s in sampling_params]})
            if world > 1:
                dist.barrier()
    executor.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
