"""DanceGRPO on FLUX.1-dev: GRPO on the dance SDE's step log-probs, no CFG, no KL.

Paper: DanceGRPO, https://arxiv.org/abs/2505.07818
The defaults are upstream's 8-GPU LoRA recipe (XueZeyue/DanceGRPO, HPS v2.1 reward,
finetune_flux_grpo_8gpus_lora.sh), rescaled to any number of GPUs. The paper's FLUX tables
come from full fine-tuning (`--full-finetune`, README). PickScore: add `--reward pickscore`.
    torchrun --nproc_per_node 8 dance_grpo_flux.py --train-prompts hpd/train.txt \
        --test-prompts hpd/test.txt

CPU demo on the toy world (a few minutes): README.md, "Running a script".

Provenance: XueZeyue/DanceGRPO@15cc71d, fastvideo/train_grpo_flux.py unless named.
    dance_sigmas, sde.py's "dance"   sd3_time_shift, flux_step
    rollout, predict_velocity        run_sample_step (the timestep floored to 1/1000)
    the SDE window (sde.py)          MixGRPO; flow_grpo sd3_pipeline_with_logprob_fast.py
    grpo_loss                        train_one_step (--use_group), grpo_one_step
    select_train_steps               train_one_step (the last step is never trained)
    LORA_TARGETS and the LoRA init   train_grpo_flux_lora.py
    shard_for_full_finetune          fastvideo/utils/fsdp_util.py (FSDP1 there)
    the EMA warm-up                  yifan123/flow_grpo, flow_grpo/ema.py
"""

import glob
import json
import math
import os
import resource
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import diffusers
import torch
import torch.distributed as dist
import transformers
import tyro
from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel
from huggingface_hub import save_torch_state_dict
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from PIL import Image
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from tqdm import tqdm

import rewards
from sde import group_advantages, sde_step, sde_window, shift_sigmas

@dataclass
class Args:
    # Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of the experiment (wandb group, run-directory prefix)"""
    seed: int = 42
    """seed of the LoRA init and prompt draws; noise is seeded per (seed, epoch, rank)"""
    track: bool = False
    """log to Weights & Biases (stdout and metrics.jsonl are always written)"""
    wandb_project: str = "flowrl"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (None: your default one)"""
    output_dir: str = "runs"
    """runs are written to OUTPUT_DIR/RUN_NAME"""
    resume: str | None = None
    """checkpoint directory to continue from; `latest`: this exp-name and seed's newest, if any"""
    eval_only: bool = False
    """only evaluate (the EMA weights of --resume, or the base model), then exit"""
    # Model
    model: str = "black-forest-labs/FLUX.1-dev"
    """hub id or local path of a diffusers FluxPipeline"""
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    """autocast dtype, and that of the frozen weights (trained ones and VAE: fp32)"""
    gradient_checkpointing: bool = True
    """recompute activations in the backward pass (FLUX has 12B parameters)"""
    compile: bool = torch.cuda.is_available()
    """torch.compile each transformer block (~2x faster on a GPU; default: on with CUDA)"""
    full_finetune: bool = False
    """train every weight, as the paper (not LoRA): fp32, FSDP2-sharded, bf16 autocast"""
    lora_rank: int = 128
    """LoRA rank on to_q/to_k/to_v/to_out.0 of every attention"""
    lora_alpha: int = 256
    """LoRA alpha (scale = alpha / rank)"""
    max_sequence_length: int = 512
    """T5 tokens per prompt"""
    # Data and reward
    train_prompts: str = "prompts/train.txt"
    """one prompt per line (blank lines skipped), or JSONL: `prompt`, the rest to the reward"""
    test_prompts: str = "prompts/test.txt"
    """eval prompts, same format"""
    reward: str = "hpsv2"
    """a rewards.py name, a weighted sum `hpsv2=1.0,clipscore=1.0`, or `file.py:function`"""
    eval_reward: str | None = None
    """reward of eval (None: the training reward)"""
    # Sampling
    resolution: int = 720
    """image height and width in pixels"""
    num_steps: int = 12
    """SDE steps per rollout (upstream: 12 with LoRA, 16 in full fine-tuning)"""
    eval_num_steps: int = 28
    """Euler ODE steps of eval, on the same grid"""
    shift: float = 3.0
    """static SD3 time shift of the uniform sigma grid (not FLUX's dynamic one)"""
    guidance_scale: float = 3.5
    """FLUX.1-dev's guidance embedding (no CFG: one forward per step)"""
    noise_level: float = 0.3
    """eta, the dance SDE's constant diffusion coefficient (sde.py)"""
    sde_window_size: int = 0
    """K > 0: SDE on K consecutive steps of each micro-batch (ODE elsewhere), all trained"""
    sde_window_range: tuple[int, int] | None = None
    """A B: the window lies in steps [A, B) (None: 0 and num_steps // 2)"""
    window_shift_every: int | None = None
    """N: the window slides every N epochs (MixGRPO; None: a random start per micro-batch)"""
    # Batch sizes (global ones do not depend on the GPU count)
    group_size: int = 12
    """images per prompt (a group: its rewards normalise each other)"""
    prompts_per_epoch: int = 16
    """prompts (groups) per epoch, over all GPUs"""
    batch_size: int = 1
    """per-GPU micro-batch of rollout and training (1: the on-policy ratio is exactly 1)"""
    eval_batch_size: int = 8
    """per-GPU eval batch"""
    updates_per_epoch: int = 2
    """optimizer steps per epoch (the first is exactly on-policy)"""
    epochs: int = 300
    """epochs to train (each: sample, score, update)"""
    # Optimisation
    learning_rate: float = 3e-4
    """AdamW learning rate (constant)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    ema_decay: float = 0.0
    """EMA decay of the trained weights, which eval uses and checkpoints save (0: off)"""
    # Logging, eval, checkpoints
    eval_every: int = 50
    """evaluate every N epochs (and after the last)"""
    eval_sheet_size: int = 16
    """eval images in the contact sheet: a row per distinct test prompt, as many as fit"""
    save_every: int = 50
    """checkpoint every N epochs (and after the last)"""
    # Algorithm-specific arguments (defaults: upstream's LoRA recipe)
    clip_range: float = 1e-4
    """PPO clip of the ratio (tiny: log-probs are means over elements, sde.py)"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip"""
    timestep_fraction: float = 0.6
    """each sample trains a random int((num_steps - 1) x fraction) of its first steps"""
    init_same_noise: bool = True
    """every image of a group starts from the same initial latent"""

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # of double- and single-stream blocks
STATE_FLAGS = ["model", "lora_rank", "lora_alpha"]  # --resume refuses other values
STEP_STREAM, GROUP_NOISE_STREAM = 1, 2  # seed keys: separate random streams

# ALGO LOGIC: the sigma grid, the SDE rollout, advantages, trained steps, the loss
def dance_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """(num_steps + 1,) sigmas from 1 to 0: a uniform grid, time-shifted."""
    return shift_sigmas(torch.linspace(1, 0, num_steps + 1), shift)

@torch.no_grad()
def rollout(transformer, noise, sigmas, window, noise_level, cond, guidance_scale, autocast,
            generator):
    """Sample sigma = 1 -> 0: the dance SDE on steps window[0] <= i < window[1], Euler ODE
    elsewhere; cond = (embeds, pooled, text_ids, img_ids) -> the window's latents (K+1 of
    (B, L, 4C)), log-probs (K of (B,)), the last x0_hat = x - sigma v (scored), all fp32."""
    x = noise.float()
    latents, log_probs = [], []
    for i in range(len(sigmas) - 1):
        if i == window[0]:
            latents.append(x)
        with autocast:
            v = predict_velocity(transformer, x, sigmas[i], *cond, guidance_scale)
        x0_hat = x - sigmas[i] * v
        kind = "dance" if window[0] <= i < window[1] else "ode"
        x, log_prob, _, _ = sde_step(v, x, sigmas[i], sigmas[i + 1], kind, noise_level,
                                     generator=generator)
        if kind == "dance":
            latents.append(x)
            log_probs.append(log_prob)
    return latents, log_probs, x0_hat

def select_train_steps(batch: int, num_steps: int, fraction: float, generator):
    """(batch, K) step indices: each sample's own random K = int((num_steps - 1) * fraction)
    of its first num_steps - 1 steps. Upstream never trains the last, sharpest step."""
    candidates = num_steps - 1
    order = torch.rand(batch, candidates, generator=generator).argsort(dim=1)
    return order[:, : int(candidates * fraction)]

def grpo_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip, accum_steps):
    """One micro-step's loss (a trained step of each sample) -> (loss to backward, policy
    loss, ratio); log_prob, old_log_prob, advantages: (B,). The factors:
    - advantages clipped to +-adv_clip: a few outliers cannot dominate;
    - PPO's max(-A ratio, -A clip(ratio, 1 +- clip_range)): the epoch's first optimizer step
      is on-policy (ratio 1), the clip keeps the later ones near the rollout policy;
    - / accum_steps: an optimizer step sums accum_steps micro-steps' gradients."""
    advantages = advantages.clamp(-adv_clip, adv_clip)
    ratio = torch.exp(log_prob - old_log_prob)
    clipped_ratio = ratio.clamp(1 - clip_range, 1 + clip_range)
    policy_loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio).mean()
    return policy_loss / accum_steps, policy_loss, ratio

# TRY NOT TO MODIFY: input checks, prompts, the model, eval, sharding, checkpoints
def fail(message: str):
    raise SystemExit(f"error: {message}")

def check_args(args) -> dict | None:
    """Checks that need no weights; returns the --resume checkpoint's state."""
    for name in ["epochs", "batch_size", "eval_batch_size", "updates_per_epoch", "eval_every",
                 "save_every", "group_size", "prompts_per_epoch", "num_steps", "eval_num_steps",
                 "lora_rank", "max_sequence_length", "eval_sheet_size", "window_shift_every"]:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    ranges = {">= 0": lambda value: value >= 0, "> 0": lambda value: value > 0,
              "in [0, 1)": lambda value: 0 <= value < 1, "in (0, 1]": lambda value: 0 < value <= 1}
    limits = {"learning_rate": ">= 0", "weight_decay": ">= 0", "max_grad_norm": "> 0",
              "kl_beta": ">= 0", "clip_range": ">= 0", "adv_clip": "> 0", "noise_level": ">= 0",
              "ema_decay": "in [0, 1)", "timestep_fraction": "in (0, 1]"}
    for name, allowed in limits.items():
        value = getattr(args, name, 0.5)  # not every script has every value
        if not ranges[allowed](value):
            fail(f"--{name.replace('_', '-')} must be {allowed}, got {value}")
    if args.mixed_precision == "fp16" and not torch.cuda.is_available():
        fail("--mixed-precision fp16 needs a GPU (on CPU: bf16 or no)")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        fail(f"--output-dir {args.output_dir!r} is a file")
    if args.group_size < 2:
        fail(f"--group-size {args.group_size}: a group needs at least 2 images for its std")
    lora_changed = (args.lora_rank, args.lora_alpha) != (Args.lora_rank, Args.lora_alpha)
    if args.full_finetune and (lora_changed or args.mixed_precision == "fp16"):
        fail("--full-finetune trains every weight in fp32 under bf16 autocast: no LoRA-only "
             "--lora-rank/--lora-alpha, no --mixed-precision fp16")
    try:  # the configs give the resolution's factor before the weights load
        vae = AutoencoderKL.load_config(args.model, subfolder="vae")
        dit = FluxTransformer2DModel.load_config(args.model, subfolder="transformer")
    except Exception as error:
        fail(f"model {args.model!r}: no local pipeline directory, and the hub could not be "
             f"read ({type(error).__name__}; offline? gated: accept the licence, hf auth login)")
    factor = 2 ** (len(vae["block_out_channels"]) - 1) * dit.get("patch_size", 1) * 2
    if args.resolution < 1 or args.resolution % factor:
        fail(f"--resolution {args.resolution} is not a positive multiple of {factor} "
             "(VAE downsampling x 2x2 packing)")
    if args.track and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        import wandb
        if not wandb.login(prompt=False):
            fail("--track needs a wandb login (`wandb login` or WANDB_API_KEY), "
                 "or WANDB_MODE=offline")
    if args.resume == "latest":  # e.g. torchrun --max-restarts: start, or continue
        runs = os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__*")
        saves = glob.glob(os.path.join(runs, "checkpoints", "epoch_*"))
        args.resume = max(saves, key=os.path.getmtime, default=None)
    if not args.resume:
        return None
    path = os.path.join(args.resume, "state.pt")
    if os.path.basename(os.path.abspath(args.resume)).startswith(".") or not os.path.isfile(path):
        fail(f"--resume {args.resume!r} is not a checkpoint directory (no state.pt; hidden ones "
             "are unfinished saves)")
    if os.path.isdir(os.path.join(args.resume, "dcp")) != args.full_finetune:
        kind = "is not" if args.full_finetune else "is"
        fail(f"--resume {args.resume!r} {kind} a --full-finetune checkpoint: match the flag")
    state = torch.load(path, map_location="cpu")
    if state.get("script") != os.path.basename(__file__):  # e.g. a GRPO run's, in DanceGRPO
        fail(f"--resume {args.resume!r} is not a checkpoint of {os.path.basename(__file__)}")
    for flag in STATE_FLAGS:
        saved, given = state["args"][flag], getattr(args, flag)
        if saved != given:
            fail(f"--{flag.replace('_', '-')} {given!r} differs from the checkpoint's {saved!r}")
    if not args.eval_only and state["next_epoch"] >= args.epochs:
        fail(f"--epochs {args.epochs} is not past the checkpoint's {state['next_epoch']} "
             "epochs: nothing to train")
    return state

def load_prompts(path: str) -> tuple[list[str], list[dict]]:
    """One prompt per line, or JSONL with a `prompt` field -> (prompts, their JSONL rows)."""
    if not os.path.isfile(path):
        fail(f"prompt file {path!r} does not exist (README.md, Prompt sets: how to fetch them)")
    lines = [line.strip() for line in open(path, encoding="utf-8") if line.strip()]
    if not lines:
        fail(f"prompt file {path!r} is empty")
    if not path.endswith(".jsonl"):
        return lines, [{} for _ in lines]
    try:
        rows = [json.loads(line) for line in lines]
        return [row["prompt"] for row in rows], rows
    except (ValueError, TypeError, KeyError) as error:  # not JSON, not an object, no prompt
        fail(f"every line of {path!r} must be a JSON object with a 'prompt' field ({error!r})")

def all_gather_cat(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """Concatenate equally-shaped tensors of all ranks, in rank order."""
    if world == 1:
        return tensor
    gathered = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(gathered, tensor.contiguous())
    return torch.cat(gathered)

def seeded_generator(device: torch.device, *keys: int) -> torch.Generator:
    """Seeded by (seed, epoch, rank, ...): draws repeat on resume, with no state to save."""
    seed = int(np.random.SeedSequence(list(keys)).generate_state(1)[0])
    return torch.Generator(device).manual_seed(seed)

def image_ids(height: int, width: int, device) -> torch.Tensor:
    """(height * width, 3) RoPE positions (0, row, col) of the packed latent tokens."""
    return FluxPipeline._prepare_latent_image_ids(1, height, width, device, torch.float32)

def predict_velocity(transformer, x, sigma, embeds, pooled, text_ids, img_ids, guidance_scale):
    """Velocity of packed latents x (B, L, 4C) at sigma (a float or (B,), floored to 1/1000)."""
    sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).expand(x.shape[0])
    timestep = torch.floor(sigma * 1000) / 1000
    has_guidance = transformer.config.guidance_embeds
    guidance = torch.full_like(timestep, guidance_scale) if has_guidance else None
    return transformer(hidden_states=x, timestep=timestep, guidance=guidance,
                       encoder_hidden_states=embeds, pooled_projections=pooled, txt_ids=text_ids,
                       img_ids=img_ids, return_dict=False)[0].float()

@torch.no_grad()
def decode(pipe, latents, resolution: int) -> torch.Tensor:
    """Packed latents -> images (B, 3, H, W) in [0, 1], decoded in fp32."""
    latents = pipe._unpack_latents(latents, resolution, resolution, pipe.vae_scale_factor)
    latents = latents.float() / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    return (pipe.vae.decode(latents, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)


@torch.no_grad()
def evaluate(pipe, args, prompts, metadata, reward_fn, sigmas, img_ids, rank, world, device,
             autocast, shape):
    """ODE-sample the test prompts (i on rank i % world, seed i) -> (means, contact sheet)."""
    scores, sheet, thumbs, by_prompt = [], {}, {}, {}
    for i, text in enumerate(prompts):  # the indices of each distinct test prompt
        by_prompt.setdefault(text, []).append(i)
    cols = math.ceil(math.sqrt(args.eval_sheet_size))  # a row: a prompt's first samples
    sheet_ids = [i for ids in by_prompt.values() for i in ids[:cols]][: args.eval_sheet_size]
    for start in range(rank, len(prompts), world * args.eval_batch_size):
        ids = range(start, len(prompts), world)[: args.eval_batch_size]  # this rank's next
        noise = torch.stack([torch.randn(shape, generator=seeded_generator(device, args.seed, i),
                                         device=device) for i in ids])
        batch_prompts = [prompts[i] for i in ids]
        embeds, pooled, text_ids = pipe.encode_prompt(
            batch_prompts, None, device=device, max_sequence_length=args.max_sequence_length)
        cond = (embeds, pooled, text_ids, img_ids)
        x0_hat = rollout(pipe.transformer, noise, sigmas, (0, 0), 0.0, cond,
                         args.guidance_scale, autocast, None)[2]  # at sigma 0: the sample
        images = decode(pipe, x0_hat, args.resolution)
        batch_scores, info = reward_fn(images.cpu(), batch_prompts, [metadata[i] for i in ids])
        columns = {"reward_mean": batch_scores, **info}
        scores += [{name: float(values[j]) for name, values in columns.items()}
                   for j in range(len(ids))]
        pixels = (images.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
        sheet.update({i: image for i, image in zip(ids, pixels) if i in sheet_ids})
        small = torch.nn.functional.interpolate(images, size=32, mode="area").flatten(1)
        thumbs.update(zip(ids, small.cpu()))  # (3 * 32 * 32,) thumbnails
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (scores, sheet, thumbs))
        scores = [score for rank_scores, _, _ in gathered for score in rank_scores]
        sheet = {i: image for _, rank_sheet, _ in gathered for i, image in rank_sheet.items()}
        thumbs = {i: small for *_, part in gathered for i, small in part.items()}
    means = {name: float(np.mean([score[name] for score in scores])) for name in scores[0]}
    groups = [torch.stack([thumbs[i] for i in ids]) for ids in by_prompt.values()]
    distances = [torch.pdist(group).mean() / group.shape[1] ** 0.5
                 for group in groups if len(group) > 1]
    if distances:  # diversity: RMS pixel distance of two samples of one test prompt
        means["diversity"] = float(torch.stack(distances).mean())
    images = [sheet[i] for i in sheet_ids]  # rows of cols cells; black cells end the last
    images += [np.zeros_like(images[0])] * (-len(images) % cols)
    rows = [np.concatenate(images[i : i + cols], axis=1) for i in range(0, len(images), cols)]
    return means, np.concatenate(rows, axis=0)

def shard_for_full_finetune(transformer):
    """fp32 and trainable, then FSDP2-sharded: each FLUX block, then the root."""
    transformer.float().requires_grad_(True)
    if not dist.is_initialized():  # one process: a 1-rank group
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
        fully_shard(block)
    fully_shard(transformer)

def optimizer_step(optimizer, scaler, params, max_grad_norm, world, loss, where, run_dir, sharded):
    """Average grads over ranks (FSDP2 already did), unscale, clip, check, step -> grad norm."""
    if world > 1 and not sharded:  # one flat all-reduce
        flat = torch.nn.utils.parameters_to_vector(p.grad for p in params)
        dist.all_reduce(flat)
        torch.nn.utils.vector_to_parameters(flat / world, [p.grad for p in params])
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if not scaler.is_enabled():  # fp16's scaler skips non-finite steps
        check_finite(where, run_dir, loss=loss, gradient=grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm

def sharded_state(transformer, optimizer, ema_params) -> dict:
    """What torch.distributed.checkpoint saves, and loads in place: this rank's shards."""
    model, optim = get_state_dict(transformer, optimizer)
    return {"model": model, "optimizer": optim, "ema": dict(zip(model, ema_params))}

def save_checkpoint(path, transformer, params, ema_params, optimizer, next_epoch, global_step,
                    args, rank: int):
    """On all ranks; atomic (a hidden directory, renamed). LoRA: diffusers `lora/`, `ema_lora/`;
    --full-finetune: `dcp/` shards and, at the end, diffusers `(ema_)transformer/`."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    state = {"next_epoch": next_epoch, "global_step": global_step, "args": asdict(args),
             "script": os.path.basename(__file__)}
    if args.full_finetune:
        dist.checkpoint.save(sharded_state(transformer, optimizer, ema_params),
                             checkpoint_id=f"{tmp}/dcp")
        exports = {"transformer": []} if next_epoch == args.epochs else {}  # at the end
        if exports and args.ema_decay:
            exports["ema_transformer"] = ema_params
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        for name, copies in exports.items():
            with swapped(params, copies):  # gathered on rank 0's CPU
                weights = get_model_state_dict(transformer, options=options)
            if rank == 0:  # as FluxTransformer2DModel.save_pretrained writes them
                os.makedirs(f"{tmp}/{name}")
                pattern = "diffusion_pytorch_model{suffix}.safetensors"
                save_torch_state_dict(weights, f"{tmp}/{name}", filename_pattern=pattern)
                config = {**transformer.config, "_class_name": "FluxTransformer2DModel"}
                with open(f"{tmp}/{name}/config.json", "w") as file:
                    json.dump(config, file, indent=2)
        state["kind"] = "full_finetune"
    elif rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        config = transformer.peft_config["default"].to_dict()
        for name, copies in (("lora", []), ("ema_lora", ema_params)):
            with swapped(params, copies):
                lora_weights = get_peft_model_state_dict(transformer)
                FluxPipeline.save_lora_weights(os.path.join(tmp, name), lora_weights,
                                               transformer_lora_adapter_metadata=config)
        state.update(lora=[p.detach().cpu() for p in params], ema=[p.cpu() for p in ema_params],
                     optimizer=optimizer.state_dict())
    if rank == 0:
        torch.save(state, os.path.join(tmp, "state.pt"))
        if os.path.exists(path):
            os.rename(path, path + ".old")
        os.rename(tmp, path)
        shutil.rmtree(path + ".old", ignore_errors=True)

@contextmanager
def swapped(params, copies):
    """Copy `copies` (the EMA; []: nothing) in, and back out (FSDP2's shards keep storage)."""
    def swap():
        for p, copy in zip(params, copies):
            live = p.data.clone()
            p.data.copy_(copy)
            copy.copy_(live)
    swap()
    try:
        yield
    finally:
        swap()

def prepare_run_dir(run_dir: str, start_epoch: int):
    """Create it; a resumed one drops a crashed save's and the redone epochs' metrics."""
    for tmp in glob.glob(os.path.join(run_dir, "checkpoints", ".*")):
        shutil.rmtree(tmp)
    path = os.path.join(run_dir, "metrics.jsonl")
    lines = open(path).readlines() if os.path.exists(path) else []
    os.makedirs(run_dir, exist_ok=True)
    with open(path, "w") as file:
        file.writelines(line for line in lines if json.loads(line)["epoch"] < start_epoch)

def rank_mean(values: dict[str, float], world: int, device) -> dict[str, float]:
    """Each value's mean over ranks (logged statistics are the run's, not rank 0's)."""
    row = torch.tensor([list(values.values())], dtype=torch.float64, device=device)
    return dict(zip(values, all_gather_cat(row, world).mean(0).tolist()))

def clock(device) -> float:
    """Seconds (monotonic), read once the GPU has run its queued work: phase timings."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

def check_finite(where: str, run_dir: str, **values):
    """Stop with one line naming the first non-finite value and the last checkpoint."""
    for name, value in values.items():
        if not torch.isfinite(torch.as_tensor(value)).all():
            saved = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "epoch_*")))
            last = saved[-1] if saved else "none saved yet"
            fail(f"non-finite {name} at {where}; stopping. Last checkpoint: {last}")

if __name__ == "__main__":
    # TRY NOT TO MODIFY: input checks, rewards, run directory, all before the model loads
    args = tyro.cli(Args)
    train_prompts, train_meta = load_prompts(args.train_prompts) if not args.eval_only else ([], [])
    test_prompts, test_meta = load_prompts(args.test_prompts)
    state = check_args(args)
    rank, world, device = 0, 1, torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(device)
        # cuDNN attention's backward crashed or returned NaN on FLUX (torch 2.11, H100)
        torch.backends.cuda.enable_cudnn_sdp(False)
    if "RANK" in os.environ:  # set by torchrun
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    quiet = rank != 0 or not sys.stderr.isatty()  # progress bars: rank 0's terminal only
    if quiet:  # the model-loading bars too
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    try:  # a bad reward file, or a reward server not answering, fails here
        rewards.check_prompts(args.reward, train_prompts)
        rewards.check_prompts(args.eval_reward or args.reward, test_prompts)
        reward_fn = rewards.build_reward(args.reward, device=device)
        eval_reward_fn = reward_fn
        if args.eval_reward:  # a stricter judge than the training reward
            eval_reward_fn = rewards.build_reward(args.eval_reward, device=device)
    except ValueError as error:
        fail(str(error))
    if args.full_finetune and len(test_prompts) % world:  # FSDP2: every rank runs every forward
        fail(f"--full-finetune: {len(test_prompts)} test prompts do not split into {world} GPUs")
    images_per_epoch = args.prompts_per_epoch * args.group_size
    if images_per_epoch % (world * args.batch_size):
        fail(f"prompts-per-epoch x group-size = {images_per_epoch} images do not split into "
             f"{world} GPUs x batch-size {args.batch_size}; change --prompts-per-epoch, "
             "--group-size or --batch-size")
    num_batches = images_per_epoch // world // args.batch_size  # per rank and epoch
    run_name = [f"{args.exp_name}__{args.seed}__{int(time.time())}"]
    if world > 1:
        dist.broadcast_object_list(run_name, src=0)
    run_dir = os.path.join(args.output_dir, run_name[0])
    parent = os.path.dirname(os.path.abspath(args.resume or "."))
    if args.resume and not args.eval_only and os.path.basename(parent) == "checkpoints":
        run_dir = os.path.dirname(parent)  # a resumed run continues in its directory

    # ALGO LOGIC: from images to optimizer steps, the sigma grids. Defaults on 8 GPUs: 192 images
    # per epoch, 24 micro-batches of 1 per GPU; each sample trains 6 of its first 11 steps (a
    # micro-step each); 2 updates per epoch, each averaging 12 x 6 = 72 micro-steps, then 8 GPUs.
    if num_batches % args.updates_per_epoch:
        fail(f"{num_batches} micro-batches per GPU per epoch do not split into "
             f"--updates-per-epoch {args.updates_per_epoch}; change --updates-per-epoch "
             "or --batch-size")
    window_size = args.sde_window_size
    window_range = args.sde_window_range or (0, args.num_steps // 2)
    low, high = window_range
    if window_size != 0 and not 0 <= low <= high - window_size < high <= args.num_steps:
        fail(f"--sde-window-size {window_size} does not fit --sde-window-range {low} {high} "
             "(0 <= A <= B - K, B <= --num-steps)")
    num_train_steps = window_size or int((args.num_steps - 1) * args.timestep_fraction)
    if num_train_steps < 1:
        fail(f"--timestep-fraction {args.timestep_fraction} trains no step of the first "
             f"--num-steps {args.num_steps} - 1 transitions; raise either")
    accum_steps = num_batches // args.updates_per_epoch * num_train_steps
    sigmas = dance_sigmas(args.num_steps, args.shift).to(device)  # (T+1,) from 1 to 0
    eval_sigmas = dance_sigmas(args.eval_num_steps, args.shift).to(device)
    if rank == 0 and not args.eval_only:
        devices = "GPU(s)" if device.type == "cuda" else "process(es)"
        print(f"{world} {devices} x {num_batches} micro-batches x {args.batch_size} = "
              f"{images_per_epoch} images/epoch ({args.prompts_per_epoch} prompts x "
              f"{args.group_size}); {args.updates_per_epoch} updates/epoch of {accum_steps} "
              f"micro-steps each; run dir {run_dir}")

    # TRY NOT TO MODIFY: the model. Frozen base in bf16/fp16, fp32 LoRA (or all weights)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}
    dtype = dtypes[args.mixed_precision]
    pipe = FluxPipeline.from_pretrained(args.model, dtype={"default": dtype, "vae": torch.float32})
    pipe.to(device)
    transformer = pipe.transformer  # eval mode throughout: no dropout
    for module in (transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        module.requires_grad_(False)
    torch.manual_seed(args.seed)  # the same LoRA init on every rank
    if args.full_finetune:
        shard_for_full_finetune(transformer)
    else:  # peft's default init (Kaiming-uniform A), as upstream
        transformer.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                                           init_lora_weights=True, target_modules=LORA_TARGETS))
    params = [p for p in transformer.parameters() if p.requires_grad]  # LoRA, or all
    for p in params:
        p.data = p.data.float()
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if args.compile:  # regional: the repeated blocks, each in place (benchmarks/RESULTS.md)
        # graphs per block kind: rollout, training, eval's batch sizes
        torch._dynamo.config.recompile_limit = 64
        for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
            block.compile(dynamic=False)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=args.mixed_precision == "fp16")
    ema_params = [p.detach().clone() for p in params]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    grid_size = args.resolution // pipe.vae_scale_factor // 2  # FLUX packs 2x2 into a token
    latent_shape = (grid_size**2, transformer.config.in_channels)  # (tokens, 4 x VAE channels)
    img_ids = image_ids(grid_size, grid_size, device)

    # TRY NOT TO MODIFY: resume, logging, eval
    start_epoch, global_step = (state["next_epoch"], state["global_step"]) if state else (0, 0)
    if state is not None and args.full_finetune:  # each rank reads its shards, any GPU count
        dist.checkpoint.load(sharded_state(transformer, optimizer, ema_params),
                             checkpoint_id=os.path.join(args.resume, "dcp"))
    elif state is not None:
        for p, saved in zip(params + ema_params, state["lora"] + state["ema"]):
            p.data.copy_(saved)
        optimizer.load_state_dict(state["optimizer"])
    if rank == 0:  # only now: a run failing earlier leaves no directory
        prepare_run_dir(run_dir, start_epoch)
    if args.track and rank == 0:
        import wandb
        wandb.init(project=args.wandb_project, entity=args.wandb_entity,
                   name=os.path.basename(run_dir), config=vars(args), save_code=True, dir=run_dir)

    def log(metrics: dict, epoch: int):
        if rank == 0:
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as file:
                file.write(json.dumps({"epoch": epoch, **metrics}) + "\n")
            if args.track:  # the eval sheets as images, at the step of their epoch's line
                wandb.log({name: wandb.Image(os.path.join(run_dir, value)) if name.endswith("sheet")
                           else value for name, value in metrics.items()}, step=epoch)

    def run_eval(epoch: int, prefix: str = "eval/") -> dict:
        with swapped(params, ema_params):  # --ema-decay 0: the EMA is the live weights
            means, sheet = evaluate(pipe, args, test_prompts, test_meta, eval_reward_fn,
                                    eval_sigmas, img_ids, rank, world, device, autocast,
                                    latent_shape)
        if rank == 0:
            path = os.path.join(run_dir, f"eval_{epoch:05d}.png")
            Image.fromarray(sheet).save(path)
            reward_name = args.eval_reward or args.reward
            print(f"eval after {epoch} epochs: {reward_name} = {means['reward_mean']:.4f}")
            means["sheet"] = os.path.basename(path)  # in the run directory
        return {prefix + name: value for name, value in means.items()}

    if args.eval_only:
        log(run_eval(start_epoch), start_epoch)
    executor = ThreadPoolExecutor(max_workers=1)  # scores batch i while batch i+1 is sampled
    for epoch in range(start_epoch, 0 if args.eval_only else args.epochs):
        epoch_start = clock(device)
        metrics = run_eval(epoch) if epoch % args.eval_every == 0 else {}
        text_start = clock(device)
        prompt_gen = seeded_generator(torch.device("cpu"), args.seed, epoch)  # as on all ranks
        num_prompts, per_epoch = len(train_prompts), args.prompts_per_epoch
        if num_prompts >= per_epoch:  # distinct prompts when there are enough
            chosen = torch.randperm(num_prompts, generator=prompt_gen)[:per_epoch]
        else:
            chosen = torch.randint(num_prompts, (per_epoch,), generator=prompt_gen)

        # ALGO LOGIC: sampling. Images are shuffled alike on all ranks, so a group spans ranks
        group_ids = torch.arange(args.prompts_per_epoch).repeat_interleave(args.group_size)
        group_ids = group_ids[torch.randperm(images_per_epoch, generator=prompt_gen)]  # (P*G,)
        my_groups = group_ids.view(world, num_batches, args.batch_size)[rank]
        noise_gen = seeded_generator(device, args.seed, epoch, rank)
        unique_groups = my_groups.unique()  # sorted; each prompt encoded once
        with torch.no_grad():  # T5 (U, L, 4096), CLIP-L pooled (U, 768), text ids (L, 3)
            all_embeds, all_pooled, text_ids = pipe.encode_prompt(
                [train_prompts[int(chosen[group])] for group in unique_groups], None,
                device=device, max_sequence_length=args.max_sequence_length)
        sampling_start = clock(device)
        batches, futures = [], []
        for batch_groups in tqdm(my_groups, f"epoch {epoch} sampling", disable=quiet, leave=False):
            prompts = [train_prompts[chosen[group]] for group in batch_groups]
            meta = [train_meta[chosen[group]] for group in batch_groups]
            embed_rows = torch.searchsorted(unique_groups, batch_groups).to(device)
            cond = (all_embeds[embed_rows], all_pooled[embed_rows], text_ids, img_ids)
            if args.init_same_noise:  # one initial latent per group, on any rank
                group_noise = []
                for group in batch_groups:
                    gen = seeded_generator(device, args.seed, epoch, int(group), GROUP_NOISE_STREAM)
                    group_noise.append(torch.randn(latent_shape, device=device, generator=gen))
                noise = torch.stack(group_noise)
            else:
                noise = torch.randn((args.batch_size, *latent_shape), generator=noise_gen,
                                    device=device)
            window = sde_window(window_size, window_range, args.num_steps, noise_gen, epoch,
                                args.window_shift_every)
            latents, log_probs, x0_hat = rollout(transformer, noise, sigmas, window,
                                                 args.noise_level, cond, args.guidance_scale,
                                                 autocast, noise_gen)
            futures.append(executor.submit(reward_fn, decode(pipe, x0_hat, args.resolution).cpu(),
                                           prompts, meta))
            batches.append({"cond": cond, "sigmas": sigmas[window[0] :],  # from the window on
                            "latents": torch.stack(latents, dim=1),  # (B, K+1, L, 4C)
                            "log_probs": torch.stack(log_probs, dim=1)})  # (B, K)

        # TRY NOT TO MODIFY: all ranks' rewards, in rank order, and the advantages
        reward_start = clock(device)
        scores, infos = zip(*[future.result() for future in futures])  # per micro-batch
        info = {name: torch.cat([batch[name] for batch in infos]) for name in infos[0]}
        all_rewards = all_gather_cat(torch.cat(scores).float().to(device), world).cpu()  # (P*G,)
        all_components = {name: all_gather_cat(info[name].to(device), world).cpu()
                          for name in reward_fn.weights}
        extras = rank_mean({f"reward/{name}": values.mean().item()  # e.g. pickscore_raw
                            for name, values in info.items() if name not in reward_fn.weights},
                           world, device)
        if reward_fn.group_transform is not None:  # groupwise rewards: whole groups
            all_rewards, all_components = reward_fn.group_transform(all_components, group_ids)
        # upstream's per-group torch .std() (unbiased), eps 1e-8
        advantages = group_advantages(all_rewards, group_ids, True, eps=1e-8, ddof=1)
        check_finite(f"epoch {epoch}", run_dir, reward=all_rewards, advantage=advantages)
        group_std = torch.stack([all_rewards[group_ids == group].std(unbiased=False)
                                 for group in range(args.prompts_per_epoch)])
        training_start = clock(device)

        # ALGO LOGIC: training. A micro-step re-scores one step per sample, backprops grpo_loss
        my_advantages = advantages.to(device).view(world, num_batches, args.batch_size)[rank]
        step_gen = seeded_generator(torch.device("cpu"), args.seed, epoch, rank, STEP_STREAM)
        stats = {"policy_loss": [], "approx_kl": [], "clipfrac": []}
        on_policy_dev, micro_step = float("nan"), 0
        rows = torch.arange(args.batch_size, device=device)
        progress = tqdm(batches, f"epoch {epoch} training", disable=quiet, leave=False)
        for batch, batch_advantages in zip(progress, my_advantages):
            steps = torch.arange(window_size).expand(args.batch_size, -1)  # a window: all steps
            if window_size == 0:  # the paper: random steps per sample
                steps = select_train_steps(args.batch_size, args.num_steps,
                                           args.timestep_fraction, step_gen)
            steps = steps.to(device)  # (B, K): indices into the window
            for j in range(num_train_steps):
                step = steps[:, j]  # (B,) each sample's own step
                sigma, sigma_next = batch["sigmas"][step], batch["sigmas"][step + 1]
                x, x_next = batch["latents"][rows, step], batch["latents"][rows, step + 1]
                with autocast:
                    v = predict_velocity(transformer, x, sigma, *batch["cond"], args.guidance_scale)
                _, log_prob, _, _ = sde_step(v, x, sigma, sigma_next, "dance", args.noise_level,
                                             prev_sample=x_next)
                old_log_prob = batch["log_probs"][rows, step]
                loss, policy_loss, ratio = grpo_loss(log_prob, old_log_prob, batch_advantages,
                                                     args.clip_range, args.adv_clip, accum_steps)
                scaler.scale(loss).backward()
                if micro_step == 0:  # the first micro-step runs the rollout's weights
                    on_policy_dev = (ratio - 1).abs().max().item()
                    if on_policy_dev > args.clip_range / 10 and rank == 0:
                        print(f"WARNING: on-policy max |ratio - 1| = {on_policy_dev:.2e} > "
                              "clip-range / 10: the rollout and training forwards differ")
                stats["policy_loss"].append(policy_loss.item())
                stats["approx_kl"].append(0.5 * ((log_prob - old_log_prob) ** 2).mean().item())
                clipped = (ratio - 1).abs() > args.clip_range
                stats["clipfrac"].append(clipped.float().mean().item())
                micro_step += 1
                if micro_step % accum_steps == 0:
                    where = f"epoch {epoch}, step {global_step}"
                    grad_norm = optimizer_step(optimizer, scaler, params, args.max_grad_norm, world,
                                               policy_loss, where, run_dir, args.full_finetune)
                    global_step += 1
                    decay = min(args.ema_decay, (1 + global_step) / (10 + global_step))  # warm-up
                    for ema, p in zip(ema_params, params):
                        ema.mul_(decay).add_(p.detach(), alpha=1 - decay)

        # ALGO LOGIC: this algorithm's metrics and its part of the summary line
        losses = {f"losses/{name}": float(np.mean(values)) for name, values in stats.items()}
        metrics.update(rank_mean(losses, world, device))
        metrics["losses/on_policy_ratio_dev"] = on_policy_dev
        summary = (f"policy {metrics['losses/policy_loss']:.3e} | ratio dev {on_policy_dev:.1e} "
                   f"| clipfrac {metrics['losses/clipfrac']:.3f}")

        # TRY NOT TO MODIFY: shared metrics, final eval, the summary line, checkpoints
        epoch_end = clock(device)
        epoch_seconds = epoch_end - epoch_start
        eval_seconds = text_start - epoch_start
        compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        max_mem_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: KiB
        if device.type == "cuda":
            max_mem_gb = torch.cuda.max_memory_allocated(device) / 1e9
        metrics.update({
            "losses/grad_norm": float(grad_norm),
            "reward/mean": all_rewards.mean().item(),
            "reward/std": all_rewards.std(unbiased=False).item(),
            "reward/zero_std_group_frac": (group_std == 0).float().mean().item(),
            **{f"reward/{name}": values.mean().item() for name, values in all_components.items()},
            **extras,
            "charts/global_step": global_step,
            "charts/learning_rate": args.learning_rate,
            "perf/images_per_sec": images_per_epoch / (reward_start - sampling_start),
            "perf/epoch_seconds": epoch_seconds,
            "perf/eval_seconds": eval_seconds,
            "perf/text_encoding_seconds": sampling_start - text_start,
            "perf/sampling_seconds": reward_start - sampling_start,
            "perf/reward_seconds": training_start - reward_start,
            "perf/training_seconds": epoch_end - training_start,
            "perf/compiled_graphs": compiled_graphs,
            "perf/max_mem_gb": max_mem_gb,
        })
        if rank == 0:
            line = (f"epoch {epoch}: reward {metrics['reward/mean']:.4f} "
                    f"± {metrics['reward/std']:.4f} | {summary} "
                    f"| {metrics['perf/images_per_sec']:.2f} img/s | {epoch_seconds:.0f}s")
            if "eval/reward_mean" in metrics:
                line += f" | eval {metrics['eval/reward_mean']:.4f}"
            print(line)
        if epoch + 1 == args.epochs:  # logged with the last epoch, printed after its line
            metrics.update(run_eval(epoch + 1, prefix="eval/final_"))
        log(metrics, epoch)
        if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
            path = os.path.join(run_dir, "checkpoints", f"epoch_{epoch + 1:05d}")
            save_checkpoint(path, transformer, params, ema_params, optimizer, epoch + 1,
                            global_step, args, rank)
            if world > 1:
                dist.barrier()
    executor.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
