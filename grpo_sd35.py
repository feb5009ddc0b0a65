"""Flow-GRPO on Stable Diffusion 3.5 Medium: GRPO with a PPO-clipped ratio of SDE-step log-probs.

Paper: Flow-GRPO (arXiv:2505.05470). Upstream: yifan123/flow_grpo, scripts/train_sd3.py.
Defaults = the paper's OCR run (§B.3; upstream config/grpo.py::general_ocr_sd3), rescaled to any GPU count:
    torchrun --nproc_per_node 8 grpo_sd35.py --train-prompts ocr/train.txt --test-prompts ocr/test.txt
PickScore run: add `--reward pickscore --kl-beta 0.01` (and the pickscore prompt files).
One-minute CPU demo, Flow-GRPO-Fast on the committed toy world (prints held-out counting accuracy before and after):
    python grpo_sd35.py --model tests/assets/toy-sd3 --train-prompts tests/assets/toy_train.txt \
        --test-prompts tests/assets/toy_test.txt --reward tests/toy_rewards.py:counting_partial \
        --eval-reward tests/toy_rewards.py:counting --resolution 32 --max-sequence-length 24 --mixed-precision no \
        --eval-num-steps 10 --eval-batch-size 48 --group-size 16 --prompts-per-epoch 6 --batch-size 16 \
        --updates-per-epoch 1 --lora-rank 8 --lora-alpha 8 --learning-rate 1e-3 --kl-beta 0 --ema-decay 0 \
        --guidance-scale 1 --sde-window-size 3 --sde-window-range 0 5 --sde-kind cps --noise-level 0.8 --epochs 10
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
from dataclasses import asdict, dataclass, replace
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
from sde import flow_sigma_t, sde_step


@dataclass
class Args:
    # ---- experiment ----
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
    # ---- model ----
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
    max_sequence_length: int = 128
    """T5 tokens per prompt (upstream: 128)"""
    # ---- data and reward ----
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
    # ---- sampling ----
    resolution: int = 512
    """image height and width in pixels"""
    num_steps: int = 10
    """SDE steps per rollout"""
    eval_num_steps: int = 40
    """ODE steps for eval"""
    guidance_scale: float = 4.5
    """CFG scale in rollouts, training and reference forwards (1 = no CFG: no unconditional forward anywhere)"""
    eval_guidance_scale: float | None = None
    """CFG scale of eval; None = --guidance-scale"""
    noise_level: float = 0.7
    """a of the SDE: Flow-GRPO's sigma_t = a sqrt(sigma / (1 - sigma)) (kind flow), or CPS's sin(a pi / 2) (kind cps)"""
    sde_kind: Literal["flow", "cps"] = "flow"
    """SDE of the stochastic steps (sde.py): Flow-GRPO's, or coefficient-preserving (upstream: clip 1e-5, a 0.8)"""
    sde_window_size: int = 0
    """K > 0: per micro-batch, SDE on K consecutive steps only (ODE elsewhere), and train just those (Flow-GRPO-Fast)"""
    sde_window_range: tuple[int, int] | None = None
    """A B: the window lies in steps [A, B), its start drawn uniformly from A..B-K; None = (0, num_steps // 2)"""
    # ---- batch sizes (global ones do not depend on the GPU count) ----
    group_size: int = 24
    """images per prompt (the GRPO group)"""
    prompts_per_epoch: int = 48
    """prompts (groups) per epoch, over all GPUs"""
    batch_size: int = 9
    """per-GPU micro-batch, identical in rollout and training (SD3's output depends on batch composition)"""
    eval_batch_size: int = 8
    """per-GPU eval batch"""
    updates_per_epoch: int = 2
    """optimizer steps per epoch (the first is exactly on-policy)"""
    epochs: int = 1000
    """epochs to train (each = sample, score, update)"""
    # ---- optimisation ----
    learning_rate: float = 3e-4
    """AdamW learning rate (constant)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    ema_decay: float = 0.9
    """EMA decay of the LoRA weights used for eval and the saved `ema` LoRA (0 disables)"""
    ema_interval: int = 8
    """EMA stepped after every micro-batch, moving only while (optimizer steps + 1) % N == 0 (upstream); 0 = per step"""
    # ---- algorithm ----
    clip_range: float = 1e-4
    """PPO clip on the ratio of mean-over-elements log-probs (sde.py), hence tiny"""
    kl_beta: float = 0.04
    """weight of the KL to the base model (LoRA disabled), upstream form mean((mu - mu_ref)^2) / (2 sigma_t^2)"""
    timestep_fraction: float = 0.99
    """train on the first int(num_steps * fraction) steps (the last step's Gaussian is too sharp)"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip"""
    per_group_std: bool = False
    """normalise advantages by each group's std instead of the epoch's global std (upstream default: global)"""
    ratio_norm: bool = False
    """GRPO-Guard's RatioNorm (kind flow): centred, rescaled log-ratio and loss / |dt| (ratio_norm_log_ratio)"""
    on_policy_tol: float = 1e-3
    """warn when the epoch's first micro-step (exactly on-policy) has max |ratio - 1| above this"""
    # ---- logging, eval, checkpoints ----
    eval_every: int = 60
    """evaluate every N epochs (and after the last)"""
    eval_sheet_size: int = 16
    """images of the first eval prompts in the contact sheet"""
    save_every: int = 60
    """checkpoint every N epochs (and after the last)"""


LORA_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]  # the 8 joint-attention projections
STATE_FLAGS = ["model", "lora_rank", "lora_alpha"]  # --resume refuses a checkpoint saved with other values


# ---- Algorithm: advantages, the clipped GRPO loss, RatioNorm, the SDE window ----
def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, per_group_std: bool, eps: float = 1e-4):
    """(reward - its group's mean) / (std + eps), std over all rewards (upstream `global_std`) or within the group.
    rewards, group_ids: (N,). Population std as upstream's np.std. A group whose rewards are all equal gets zeros.
    """
    rewards, count = rewards.double(), torch.bincount(group_ids).double()
    centered = rewards - (torch.bincount(group_ids, rewards) / count)[group_ids]
    group_std = (torch.bincount(group_ids, centered**2) / count).sqrt()[group_ids]
    std = group_std if per_group_std else rewards.std(unbiased=False)
    return (centered / (std + eps)).float()


def compute_advantages(rewards: torch.Tensor, components: dict[str, torch.Tensor], weights: dict[str, float],
                       group_ids: torch.Tensor, aggregation: str, per_group_std: bool) -> torch.Tensor:
    """Advantages (N,) of the weighted reward `rewards`; with `gdpo`, each component is normalised within its group,
    weighted and summed, then the sum is normalised over the batch (GDPO, arXiv:2601.05242)."""
    if aggregation == "sum" or len(components) <= 1:
        return group_advantages(rewards, group_ids, per_group_std)
    summed = sum(w * group_advantages(components[k], group_ids, per_group_std=True) for k, w in weights.items())
    return (summed - summed.mean()) / (summed.std(unbiased=False) + 1e-4)


def grpo_loss(log_prob, old_log_prob, advantages, clip_range: float, adv_clip: float):
    """PPO-clipped policy loss on per-sample (B,) log-probs; returns (loss, ratio). Upstream train_sd3.py."""
    adv = advantages.clamp(-adv_clip, adv_clip)
    ratio = torch.exp(log_prob - old_log_prob)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range)).mean(), ratio


def ratio_norm_log_ratio(log_prob, old_log_prob, mean, old_mean, std):
    """GRPO-Guard's RatioNorm (arXiv:2510.22319; flow_grpo train_sd3_GRPO_Guard.py, `rationorm`) of a Gaussian step's
    (B,) log-ratio, std s (B,). With x' = old_mean + s eps, dmu = mean - old_mean, the raw log-ratio mean(eps dmu) / s -
    mean(dmu^2) / (2 s^2) sits below 0 (the clip then rarely stops positive-advantage samples) and its gradient per
    velocity, ~|dt| / s, starves high-noise steps. Adding the bias back and scaling by s leaves mean(eps dmu): centred,
    same spread at every step; the caller divides the loss by |dt| (upstream: sqrt_dt^2), finishing the reweighting."""
    bias = ((mean - old_mean) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * std**2)
    return (log_prob - old_log_prob + bias) * std


def draw_sde_window(size: int, window_range: tuple[int, int], num_steps: int, generator) -> tuple[int, int]:
    """SDE steps [start, start + size) of a micro-batch, start uniform in A..B-size, BOTH ends included (upstream
    random.randint, flow_grpo sd3_pipeline_with_logprob_fast.py): inside [A, B). size 0: every step (May-2025 run)."""
    if size == 0:
        return 0, num_steps
    start = int(torch.randint(window_range[0], window_range[1] - size + 1, (), generator=generator,
                              device=generator.device))
    return start, start + size


@torch.no_grad()
def window_rollout(transformer, noise, sigmas, window, kind, noise_level, cond, guidance_scale, autocast, generator):
    """Sample sigma = 1 -> 0 with the SDE `kind` on steps window[0] <= i < window[1], Euler ODE elsewhere (flow_grpo
    sd3_pipeline_with_logprob_fast.py::pipeline_with_logprob). cond = (embeds, pooled, neg_embeds, neg_pooled).
    Returns the window's latents (B, K+1, C, h, w), log-probs (B, K), step means (B, K, C, h, w), the final latent."""
    x, latents, log_probs, means = noise.float(), [], [], []
    for i in range(len(sigmas) - 1):
        with autocast:
            v = predict_velocity(transformer, x, sigmas[i], *cond, guidance_scale)
        sde = window[0] <= i < window[1]
        latents += [x] if i == window[0] else []
        x, log_prob, mean, _ = sde_step(v, x, sigmas[i], sigmas[i + 1], kind if sde else "ode", noise_level,
                                        generator=generator, sigma_max=sigmas[1])
        if sde:
            latents, log_probs, means = latents + [x], log_probs + [log_prob], means + [mean]
    return torch.stack(latents, dim=1), torch.stack(log_probs, dim=1), torch.stack(means, dim=1), x


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
    if num_batches % args.updates_per_epoch:
        fail(f"{num_batches} micro-batches per GPU per epoch do not split into --updates-per-epoch "
             f"{args.updates_per_epoch}; change --updates-per-epoch or --batch-size")
    lo, hi = window_range = args.sde_window_range or (0, args.num_steps // 2)
    if (k := args.sde_window_size) and not 0 <= lo <= hi - k < hi <= args.num_steps:  # also rejects K < 0
        fail(f"--sde-window-size {k} does not fit --sde-window-range {lo} {hi} (0 <= A <= B - K, B <= --num-steps)")
    num_train_steps = k or int(args.num_steps * args.timestep_fraction)  # a window trains its K steps
    if num_train_steps < 1:
        fail(f"--timestep-fraction {args.timestep_fraction} trains no step of --num-steps {args.num_steps}")
    if args.ratio_norm and args.sde_kind != "flow":
        fail("--ratio-norm needs --sde-kind flow (it normalises a Gaussian log-ratio; CPS's log-prob is not one)")
    accum = num_batches // args.updates_per_epoch * num_train_steps  # micro-steps (batch, step) per optimizer step
    run_name = [f"{args.exp_name}__{args.seed}__{int(time.time())}"]
    if world > 1:
        dist.broadcast_object_list(run_name, src=0)
    run_dir = os.path.join(args.output_dir, run_name[0])
    parent = os.path.dirname(os.path.abspath(args.resume or "."))
    if args.resume and not args.eval_only and os.path.basename(parent) == "checkpoints":
        run_dir = os.path.dirname(parent)  # a resumed run continues its checkpoint's run directory
    if rank == 0:
        print(f"{world} {'GPU(s)' if device.type == 'cuda' else 'process(es)'} x {num_batches} micro-batches x "
              f"{args.batch_size} = {images_per_epoch} images/epoch "
              f"({args.prompts_per_epoch} prompts x {args.group_size}); {args.updates_per_epoch} updates/epoch of "
              f"{accum} micro-steps each; run dir {run_dir}")

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
    ema_params = [p.detach().clone() for p in lora_params]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    latent_shape = (transformer.config.in_channels, *[args.resolution // pipe.vae_scale_factor] * 2)
    pipe.scheduler.set_timesteps(args.num_steps, device=device)
    sigmas = pipe.scheduler.sigmas.float()  # (T+1,) from 1 to 0, SD3's shifted schedule
    pipe.scheduler.set_timesteps(args.eval_num_steps, device=device)
    eval_sigmas = pipe.scheduler.sigmas.float()
    with torch.no_grad():
        neg = encode(pipe, [""], device, args.max_sequence_length)  # empty-prompt CFG embedding, computed once
    eval_args = args if args.eval_guidance_scale is None else replace(args, guidance_scale=args.eval_guidance_scale)
    start_epoch, global_step = 0, 0
    if state is not None:
        for p, saved in zip(lora_params + ema_params, state["lora"] + state["ema"]):
            p.data.copy_(saved)
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, global_step = state["next_epoch"], state["global_step"]
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
            means, sheet = evaluate(pipe, eval_args, test_prompts, test_meta, eval_reward_fn, eval_sigmas, neg, rank,
                                    world, device, autocast, latent_shape)
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

        # ---- SAMPLING: identical prompt draw on every rank; each group's images spread over ranks ----
        prompt_gen = seeded_generator(torch.device("cpu"), args.seed, epoch)
        if len(train_prompts) >= args.prompts_per_epoch:
            chosen = torch.randperm(len(train_prompts), generator=prompt_gen)[: args.prompts_per_epoch]
        else:
            chosen = torch.randint(len(train_prompts), (args.prompts_per_epoch,), generator=prompt_gen)
        order = torch.randperm(images_per_epoch, generator=prompt_gen)
        group_ids = torch.arange(args.prompts_per_epoch).repeat_interleave(args.group_size)[order]  # (P*G,) all ranks
        my_groups = group_ids[rank * local_images : (rank + 1) * local_images].view(num_batches, args.batch_size)
        noise_gen = seeded_generator(device, args.seed, epoch, rank)
        transformer.eval()
        batches, futures = [], []
        for b in tqdm(range(num_batches), desc=f"epoch {epoch} sampling", disable=quiet, leave=False):
            idx = [int(chosen[g]) for g in my_groups[b]]
            prompts, meta = [train_prompts[i] for i in idx], [train_meta[i] for i in idx]
            with torch.no_grad():  # cond = (embeds, pooled, neg_embeds, neg_pooled)
                cond = (*encode(pipe, prompts, device, args.max_sequence_length), *neg)
            noise = torch.randn((args.batch_size, *latent_shape), generator=noise_gen, device=device)
            window = draw_sde_window(args.sde_window_size, window_range, args.num_steps, noise_gen)  # default (0, T)
            latents, log_probs, means, final = window_rollout(transformer, noise, sigmas, window, args.sde_kind,
                                                              args.noise_level, cond, args.guidance_scale, autocast,
                                                              noise_gen)  # (B, K+1, ...)
            futures.append(executor.submit(reward_fn, decode(pipe.vae, final).cpu(), prompts, meta))
            batches.append({"cond": cond, "latents": latents, "log_probs": log_probs,
                            "means": means if args.ratio_norm else None, "start": window[0]})
        sampling_seconds = time.time() - epoch_start

        # ---- REWARD: wait for the scorer, gather every rank's rewards in rank order ----
        results = [f.result() for f in futures]
        local = {k: torch.cat([r[1][k] for r in results]) for k in results[0][1]}  # each (local_images,)
        all_rewards = all_gather_cat(torch.cat([r[0] for r in results]).float().to(device), world).cpu()  # (P*G,)
        all_components = {k: all_gather_cat(local[k].to(device), world).cpu() for k in reward_fn.weights}
        extras = rank_mean({f"reward/{k}": v.mean().item() for k, v in local.items() if k not in reward_fn.weights},
                           world, device)  # components without a weight, e.g. pickscore_raw
        if reward_fn.group_transform is not None:  # groupwise rewards (pickscore_rank) see whole groups only here
            all_rewards, all_components = reward_fn.group_transform(all_components, group_ids)

        # ---- ADVANTAGE: per-prompt mean, global (or per-group) std ----
        advantages = compute_advantages(all_rewards, all_components, reward_fn.weights, group_ids,
                                        args.advantage_aggregation, args.per_group_std)
        check_finite(f"epoch {epoch}", run_dir, reward=all_rewards, advantage=advantages)
        my_adv = advantages[rank * local_images : (rank + 1) * local_images].to(device).view(num_batches, -1)
        group_std = torch.stack([all_rewards[group_ids == g].std(unbiased=False) for g in range(args.prompts_per_epoch)])

        # ---- TRAINING: per micro-batch and trained step, CFG forward with grad, clipped ratio + beta * KL ----
        transformer.train()
        stats = {"policy_loss": [], "kl": [], "approx_kl": [], "clipfrac": []}
        on_policy_dev, micro = float("nan"), 0
        for b, batch in enumerate(tqdm(batches, desc=f"epoch {epoch} training", disable=quiet, leave=False)):
            for j in range(num_train_steps):
                t = batch["start"] + j  # schedule index of the window's j-th step
                x_t, x_next = batch["latents"][:, j], batch["latents"][:, j + 1]  # window latents: K+1 (T+1 if none)
                with autocast:
                    v = predict_velocity(transformer, x_t, sigmas[t], *batch["cond"], args.guidance_scale)
                _, log_prob, mean, std = sde_step(v, x_t, sigmas[t], sigmas[t + 1], args.sde_kind, args.noise_level,
                                                  prev_sample=x_next, sigma_max=sigmas[1])
                old_log_prob = batch["log_probs"][:, j]
                log_ratio = (ratio_norm_log_ratio(log_prob, old_log_prob, mean, batch["means"][:, j], std.flatten())
                             if args.ratio_norm else log_prob - old_log_prob)
                policy_loss, ratio = grpo_loss(log_ratio, 0.0, my_adv[b], args.clip_range, args.adv_clip)
                policy_loss = policy_loss / ((sigmas[t] - sigmas[t + 1]) if args.ratio_norm else 1)  # / |dt|
                kl = torch.zeros((), device=device)
                if args.kl_beta > 0:
                    with torch.no_grad(), adapters_disabled(transformer), autocast:
                        v_ref = predict_velocity(transformer, x_t, sigmas[t], *batch["cond"], args.guidance_scale)
                    mean_ref = sde_step(v_ref, x_t, sigmas[t], sigmas[t + 1], args.sde_kind, args.noise_level,
                                        prev_sample=x_next, sigma_max=sigmas[1])[2]
                    # KL as upstream train_sd3.py (since commit 2d76907), not the paper's exact Eq. 10:
                    # mean over elements of (mu_theta - mu_ref)^2 / (2 sigma_t^2), sigma_t = a sqrt(s / (1 - s)) with
                    # NO sqrt(-dt) factor (CPS: its step std); the exact Gaussian KL sums, divides by sigma_t^2 (-dt).
                    sigma_t = (flow_sigma_t(sigmas[t], args.noise_level, sigmas[1]) if args.sde_kind == "flow"
                               else std.flatten())
                    kl = (((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * sigma_t**2)).mean()
                loss = policy_loss + args.kl_beta * kl
                scaler.scale(loss / accum).backward()
                if micro == 0:  # the epoch's first micro-step runs the rollout's exact weights: ratio must be 1
                    on_policy_dev = (ratio - 1).abs().max().item()
                    if on_policy_dev > args.on_policy_tol and rank == 0:
                        print(f"WARNING: on-policy max |ratio - 1| = {on_policy_dev:.2e} > {args.on_policy_tol}: "
                              "the rollout and training forwards differ")
                stats["policy_loss"].append(policy_loss.item())
                stats["kl"].append(kl.item())
                stats["approx_kl"].append(0.5 * ((log_prob - old_log_prob) ** 2).mean().item())
                stats["clipfrac"].append(((ratio - 1).abs() > args.clip_range).float().mean().item())
                micro += 1
                if micro % accum:
                    continue
                # one optimizer step: average LoRA grads over ranks in one flat all-reduce, clip, step, EMA
                flat = torch.cat([p.grad.flatten() for p in lora_params])
                if world > 1:
                    dist.all_reduce(flat)
                    flat /= world
                for p, g in zip(lora_params, flat.split([p.numel() for p in lora_params])):
                    p.grad.copy_(g.view_as(p))
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm)
                if not scaler.is_enabled():  # (fp16's scaler skips non-finite steps itself)
                    check_finite(f"epoch {epoch}, step {global_step}", run_dir, loss=loss, gradient=grad_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
            # EMA as upstream (flow_grpo ema.py, update_step_interval 8, stepped per micro-batch by train_sd3.py):
            # it moves once per micro-batch while (global_step + 1) % 8 == 0; --ema-interval 0: per optimizer step
            per_step = args.ema_interval == 0 or args.ema_decay == 0  # decay 0: the EMA is the live weights
            if micro % accum == 0 if per_step else (global_step + 1) % args.ema_interval == 0:
                decay = min(args.ema_decay, (1 + global_step) / (10 + global_step))  # upstream EMA warm-up
                for e, p in zip(ema_params, lora_params):  # (the EMA copies never require grad)
                    e.mul_(decay).add_(p.detach(), alpha=1 - decay)

        # ---- LOGGING, CHECKPOINT ----
        epoch_seconds = time.time() - epoch_start
        metrics.update(rank_mean({f"losses/{k}": float(np.mean(v)) for k, v in stats.items()}, world, device))
        metrics.update({"losses/on_policy_ratio_dev": on_policy_dev, "losses/grad_norm": float(grad_norm),
                        "reward/mean": all_rewards.mean().item(), "reward/std": all_rewards.std(unbiased=False).item(),
                        "reward/zero_std_group_frac": (group_std == 0).float().mean().item(),
                        **{f"reward/{k}": v.mean().item() for k, v in all_components.items()}, **extras,
                        "charts/global_step": global_step, "charts/learning_rate": args.learning_rate,
                        "perf/images_per_sec": images_per_epoch / sampling_seconds,
                        "perf/epoch_seconds": epoch_seconds, "perf/max_mem_gb": peak_memory_gb(device)})
        if epoch + 1 == args.epochs:
            metrics.update(run_eval(epoch + 1, prefix="eval/final_"))
        log(metrics, epoch)
        if rank == 0 and (group_std == 0).all():  # warnings.warn shows this once per run
            warnings.warn("an epoch where every group's rewards are all equal: zero advantages, nothing to learn")
        if rank == 0:
            print(f"epoch {epoch}: reward {metrics['reward/mean']:.4f} ± {metrics['reward/std']:.4f} | policy "
                  f"{metrics['losses/policy_loss']:.3e} kl {metrics['losses/kl']:.3e} | ratio dev {on_policy_dev:.1e} "
                  f"| clipfrac {metrics['losses/clipfrac']:.3f} | {metrics['perf/images_per_sec']:.2f} img/s "
                  f"| {epoch_seconds:.0f}s" + (f" | eval {metrics['eval/reward_mean']:.4f}" if "eval/reward_mean" in metrics else ""))
        if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                save_checkpoint(os.path.join(run_dir, "checkpoints", f"epoch_{epoch + 1:05d}"), transformer,
                                lora_params, ema_params, optimizer, epoch + 1, global_step, args, extra={})
            if world > 1:
                dist.barrier()
    executor.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
