"""DanceGRPO on FLUX.1-dev: GRPO with a PPO-clipped ratio of DanceGRPO SDE-step log-probs, no CFG, no KL.

Paper: DanceGRPO (arXiv:2505.07818). Upstream: XueZeyue/DanceGRPO, fastvideo/train_grpo_flux.py (+ _lora.py).
Defaults = the 8-GPU LoRA recipe (scripts/finetune/finetune_flux_grpo_8gpus_lora.sh), rescaled to any GPU count:
    torchrun --nproc_per_node 8 dance_grpo_flux.py --train-prompts hpd_prompts.txt --test-prompts hpd_test.txt
PickScore instead of HPS v2.1: add `--reward pickscore`. The paper's full fine-tuning (FSDP2, 16 GPUs): README.
One-minute CPU demo on the committed toy world (prints held-out counting accuracy before and after):
    python dance_grpo_flux.py --model tests/assets/toy-flux --train-prompts tests/assets/toy_train.txt \
        --test-prompts tests/assets/toy_test.txt --reward tests/toy_rewards.py:counting_partial \
        --eval-reward tests/toy_rewards.py:counting --resolution 32 --max-sequence-length 24 --mixed-precision no \
        --num-steps 10 --eval-num-steps 10 --eval-batch-size 48 --group-size 16 --prompts-per-epoch 6 \
        --batch-size 16 --updates-per-epoch 1 --lora-rank 8 --lora-alpha 8 --learning-rate 1e-3 --epochs 10
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
from diffusers import FluxPipeline, FluxTransformer2DModel
from huggingface_hub import hf_hub_download, save_torch_state_dict
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from PIL import Image
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.fsdp import fully_shard
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
    model: str = "black-forest-labs/FLUX.1-dev"
    """hub id or local path of a diffusers FluxPipeline"""
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    """dtype of the frozen text encoders and transformer base, with autocast (LoRA and VAE stay fp32); no = all fp32"""
    gradient_checkpointing: bool = True
    """recompute transformer activations in the backward pass (FLUX is 12B; upstream always does)"""
    full_finetune: bool = False
    """train every transformer weight, as the paper (fp32 master weights sharded per block with FSDP2, bf16 autocast)"""
    lora_rank: int = 128
    """LoRA rank on to_q/to_k/to_v/to_out.0 of every attention (upstream LoRA script)"""
    lora_alpha: int = 256
    """LoRA alpha (scale = alpha / rank)"""
    max_sequence_length: int = 512
    """T5 tokens per prompt (FLUX.1-dev: 512)"""
    train_prompts: str = "prompts/train.txt"
    """training prompts: one per line, or JSONL with a `prompt` field (other fields are passed to the reward)"""
    test_prompts: str = "prompts/test.txt"
    """eval prompts, same format"""
    reward: str = "hpsv2"
    """a rewards.py name, a weighted list `hpsv2=1.0,clipscore=1.0`, or `path/to/file.py:function`"""
    eval_reward: str | None = None
    """reward for eval; None = the training reward"""
    resolution: int = 720
    """image height and width in pixels"""
    num_steps: int = 12
    """SDE steps per rollout (upstream LoRA script: 12; full fine-tuning scripts: 16)"""
    eval_num_steps: int = 28
    """ODE steps for eval (same shift-3 grid)"""
    shift: float = 3.0
    """static SD3 time shift of the uniform sigma grid (upstream `--shift 3`; not FLUX's resolution-dependent shift)"""
    guidance_scale: float = 3.5
    """FLUX.1-dev's distilled guidance embedding (no CFG: one forward per step), in rollouts, training and eval"""
    noise_level: float = 0.3
    """eta, DanceGRPO's constant diffusion coefficient (sde.py, kind='dance')"""
    init_same_noise: bool = True
    """every image of a group starts from the same initial latent (upstream --init_same_noise)"""
    sde_window_size: int = 0
    """K > 0: per micro-batch, the dance SDE on K consecutive steps only (ODE elsewhere), trained on just those"""
    sde_window_range: tuple[int, int] | None = None
    """A B: the window lies in steps [A, B), its start drawn uniformly from A..B-K; None = (0, num_steps // 2)"""
    group_size: int = 12
    """images per prompt (the GRPO group)"""
    prompts_per_epoch: int = 16
    """prompts (groups) per epoch, over all GPUs"""
    batch_size: int = 1
    """per-GPU micro-batch, identical in rollout and training (upstream: 1, so the on-policy ratio is exactly 1)"""
    eval_batch_size: int = 8
    """per-GPU eval batch"""
    updates_per_epoch: int = 2
    """optimizer steps per epoch (the first is exactly on-policy; upstream 8 GPUs x 24 samples / GA 12 = 2)"""
    epochs: int = 300
    """epochs to train (each = sample, score, update)"""
    learning_rate: float = 3e-4
    """AdamW learning rate (constant)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    ema_decay: float = 0.0
    """EMA decay of the LoRA weights used for eval and the saved `ema` LoRA (0 disables, as the upstream LoRA script)"""
    clip_range: float = 1e-4
    """PPO clip on the ratio of mean-over-elements log-probs (sde.py), hence tiny"""
    timestep_fraction: float = 0.6
    """each sample trains on a random int((num_steps - 1) * fraction) of its first num_steps - 1 transitions"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip"""
    on_policy_tol: float = 1e-3
    """warn when the epoch's first micro-step (exactly on-policy) has max |ratio - 1| above this"""
    eval_every: int = 50
    """evaluate every N epochs (and after the last)"""
    eval_sheet_size: int = 16
    """images of the first eval prompts in the contact sheet"""
    save_every: int = 50
    """checkpoint every N epochs (and after the last)"""


LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # upstream LoRA targets (double- and single-stream blocks)
STEP_STREAM, GROUP_NOISE_STREAM = 1, 2  # extra seed keys keeping the timestep-subset and group-noise RNGs apart


# ---- Algorithm: per-group advantages, timestep subsets, the clipped GRPO loss, the SDE window ----
def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(reward - its group's mean) / (its group's std + eps), std UNBIASED as upstream's torch `.std()`
    (train_grpo_flux.py::train_one_step, --use_group). rewards, group_ids: (N,); every group needs >= 2 members.
    A group whose rewards are all equal gets zeros."""
    rewards, count = rewards.double(), torch.bincount(group_ids).double()
    centered = rewards - (torch.bincount(group_ids, rewards) / count)[group_ids]
    var = torch.bincount(group_ids, centered**2) / (count - 1)
    return (centered / (var.sqrt()[group_ids] + eps)).float()


def select_train_steps(batch: int, num_steps: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """(batch, K) step indices: per sample an independent random K = int((num_steps - 1) * fraction) of the first
    num_steps - 1 transitions (the last, sharpest one is never trained, as upstream's hard-coded `[:, :-1]`)."""
    return torch.rand(batch, num_steps - 1, generator=generator).argsort(dim=1)[:, : int((num_steps - 1) * fraction)]


def grpo_loss(log_prob, old_log_prob, advantages, clip_range: float, adv_clip: float):
    """PPO-clipped policy loss on per-sample (B,) log-probs; returns (loss, ratio). Upstream train_sd3.py."""
    adv = advantages.clamp(-adv_clip, adv_clip)
    ratio = torch.exp(log_prob - old_log_prob)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range)).mean(), ratio


def draw_sde_window(size: int, window_range: tuple[int, int], num_steps: int, generator) -> tuple[int, int]:
    """SDE steps [start, start + size) of a micro-batch, start uniform in A..B-size, BOTH ends included (upstream
    random.randint, flow_grpo sd3_pipeline_with_logprob_fast.py): inside [A, B). size 0: every step (paper run)."""
    if size == 0:
        return 0, num_steps
    start = int(torch.randint(window_range[0], window_range[1] - size + 1, (), generator=generator,
                              device=generator.device))
    return start, start + size


def window_rollout(transformer, noise, sigmas, window, noise_level, cond, guidance_scale, autocast, generator):
    """The dance SDE on steps window[0] <= i < window[1], ODE elsewhere (MixGRPO's / DiffSynth-Studio's noise window);
    cond = (embeds, pooled, text_ids, img_ids). -> the window's latents (B, K+1, L, 4C), log-probs (B, K), x0_hat."""
    def run(x, grid, kind, eta, gen):
        return rollout(transformer, x, grid, kind, eta, *cond, guidance_scale, autocast, gen)
    start, end = window
    x = noise if start == 0 else run(noise, sigmas[: start + 1], "ode", 0.0, None)[0][:, -1]
    latents, log_probs, x0_hat = run(x, sigmas[start : end + 1], "dance", noise_level, generator)
    if end < len(sigmas) - 1:
        x0_hat = run(latents[:, -1], sigmas[end:], "ode", 0.0, None)[2]
    return latents, log_probs, x0_hat


def dance_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """(num_steps + 1,) sigmas from 1 to 0: the static time shift of linspace(1, 0, N + 1) (upstream sd3_time_shift)."""
    return shift_sigmas(torch.linspace(1, 0, num_steps + 1), shift)


# ---- Boilerplate (as grpo_sd35.py where the function is the same): checks, prompts, FLUX model, rollout, eval ----
def fail(msg: str):
    raise SystemExit(f"error: {msg}")


def check_args(args) -> dict | None:
    """Checks that need no weights (sizes, config files, wandb login, --resume); returns the checkpoint's state."""
    bad = [n for n in ("epochs", "batch_size", "eval_batch_size", "train_batch_size", "updates_per_epoch", "eval_every",
                       "save_every", "group_size", "prompts_per_epoch", "num_steps", "eval_num_steps", "lora_rank")
           if getattr(args, n, 1) < 1] + ["learning_rate"] * (args.learning_rate < 0)
    if bad:
        fail(f"--{bad[0].replace('_', '-')} must be {'>= 0' if bad[0] == 'learning_rate' else '>= 1'}, got "
             f"{getattr(args, bad[0])}")
    try:  # the small config files give the resolution's factor before the weights load
        vae, dit = (json.load(open(os.path.join(args.model, f"{d}/config.json") if os.path.exists(args.model) else
                                   hf_hub_download(args.model, f"{d}/config.json"))) for d in ("vae", "transformer"))
    except Exception as e:
        fail(f"model {args.model!r} is neither an existing local path nor a hub id like 'org/name' with vae/ and "
             f"transformer/ config.json ({type(e).__name__})")
    factor = 2 ** (len(vae["block_out_channels"]) - 1) * dit.get("patch_size", 1) * 2
    if args.resolution < 1 or args.resolution % factor:
        fail(f"--resolution {args.resolution} is not a multiple of {factor} (VAE downsampling x 2x2 packing)")
    if args.track and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        import wandb
        if not wandb.login(prompt=False):
            fail("--track needs a wandb login (`wandb login` or WANDB_API_KEY), or WANDB_MODE=offline")
    if not args.resume:
        return None
    path = os.path.join(args.resume, "state.pt")
    if os.path.basename(os.path.abspath(args.resume)).startswith(".") or not os.path.isfile(path):
        fail(f"--resume {args.resume!r} is not a checkpoint directory (no state.pt; hidden ones are unfinished saves)")
    if os.path.isdir(os.path.join(args.resume, "dcp")) != args.full_finetune:
        fail(f"--resume {args.resume!r} is {'not ' * args.full_finetune}a --full-finetune checkpoint: match the flag")
    state = torch.load(path, map_location="cpu")
    for flag in ("model", "lora_rank", "lora_alpha"):  # --resume refuses a checkpoint saved with other values
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


def image_ids(height: int, width: int, device) -> torch.Tensor:
    """(height * width, 3) RoPE positions (0, row, col) of the packed latent tokens (FluxPipeline's layout)."""
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float().to(device)


def unpack(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed (B, h/2 * w/2, 4C) tokens -> latent image (B, C, h, w): the inverse of FLUX's 2x2 packing."""
    b, _, c4 = latents.shape
    latents = latents.view(b, height // 2, width // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, c4 // 4, height, width)


def predict_velocity(transformer, x, sigma, embeds, pooled, text_ids, img_ids, guidance_scale: float):
    """FLUX velocity of packed latents x (B, L, 4C); `sigma` a float or per-sample (B,) tensor. One forward, no CFG:
    the guidance value goes in as an embedding. The timestep input is sigma quantised to 1/1000 as upstream
    (run_sample_step: int(sigma * 1000) / 1000); FLUX multiplies timestep and guidance by 1000 itself."""
    sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).expand(x.shape[0])  # (B,)
    timestep = torch.floor(sigma * 1000) / 1000
    guidance = torch.full_like(timestep, guidance_scale) if transformer.config.guidance_embeds else None
    return transformer(hidden_states=x, timestep=timestep, guidance=guidance, encoder_hidden_states=embeds,
                       pooled_projections=pooled, txt_ids=text_ids, img_ids=img_ids, return_dict=False)[0].float()


@torch.no_grad()
def rollout(transformer, noise, sigmas, kind, noise_level, embeds, pooled, text_ids, img_ids, guidance_scale,
            autocast, generator):
    """Sample from sigma = 1 to 0. Returns latents (B, T+1, L, 4C), log-probs (B, T) and the last step's clean
    estimate x0_hat = x - sigma v (B, L, 4C) -- the latent upstream decodes for the reward. All fp32."""
    x, latents, log_probs = noise.float(), [noise.float()], []
    for i in range(len(sigmas) - 1):
        with autocast:
            v = predict_velocity(transformer, x, sigmas[i], embeds, pooled, text_ids, img_ids, guidance_scale)
        x0_hat = x - sigmas[i] * v
        x, log_prob, _, _ = sde_step(v, x, sigmas[i], sigmas[i + 1], kind, noise_level, generator=generator)
        latents.append(x)
        log_probs.append(log_prob)
    return torch.stack(latents, dim=1), torch.stack(log_probs, dim=1), x0_hat


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
def evaluate(pipe, args, prompts, metadata, reward_fn, eval_sigmas, img_ids, rank, world, device, autocast, shape):
    """ODE-sample the test prompts (prompt i on rank i % world, noise seed i) -> (means of reward and info, sheet)."""
    scores, sheet = [], []
    latent_size = args.resolution // pipe.vae_scale_factor
    for start in range(rank, len(prompts), world * args.eval_batch_size):
        idx = range(start, len(prompts), world)[: args.eval_batch_size]  # this rank's next prompts
        noise = torch.stack([torch.randn(shape, generator=seeded_generator(device, args.seed, i), device=device)
                             for i in idx])
        embeds, pooled, text_ids = pipe.encode_prompt([prompts[i] for i in idx], None, device=device,
                                                      max_sequence_length=args.max_sequence_length)
        x0_hat = rollout(pipe.transformer, noise, eval_sigmas, "ode", 0.0, embeds, pooled, text_ids, img_ids,
                         args.guidance_scale, autocast, None)[2]  # ODE to sigma 0: x0_hat = the final sample
        images = decode(pipe.vae, unpack(x0_hat, latent_size, latent_size))
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


def shard_for_full_finetune(transformer):
    """fp32, trainable, FSDP2-sharded per FLUX block then the root (upstream fsdp_util.py: FSDP1, fp32 params)."""
    transformer.float().requires_grad_(True)
    if not dist.is_initialized():  # one process: a 1-rank group (gloo, nccl), the same code path
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
        fully_shard(block)
    fully_shard(transformer)


def save_checkpoint(path: str, transformer, params, ema_params, optimizer, next_epoch, global_step, args, rank: int):
    """All ranks. Atomic: written to a hidden temp dir (--resume refuses it, `epoch_*` never matches it), then renamed.
    state.pt resumes. LoRA: `lora/`, `ema_lora/` are diffusers LoRAs with their peft config (trained alpha).
    --full-finetune: `dcp/` shards, after the last epoch diffusers `transformer/` (and `ema_transformer/`)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    state = {"next_epoch": next_epoch, "global_step": global_step, "args": asdict(args)}
    if args.full_finetune:
        model, optim = get_state_dict(transformer, optimizer)  # sharded, keyed by name
        dist.checkpoint.save({"model": model, "optimizer": optim, "ema": dict(zip(model, ema_params))},
                             checkpoint_id=f"{tmp}/dcp")
        exports = [("transformer", []), ("ema_transformer", ema_params)] if next_epoch == args.epochs else []
        for name, ema in exports[: 1 + bool(args.ema_decay)]:  # all weights, gathered on rank 0's CPU
            with swapped(params, ema):  # [] swaps nothing in
                full = get_model_state_dict(transformer, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
            if rank == 0:  # sharded safetensors + config, as FluxTransformer2DModel.save_pretrained writes them
                out = f"{tmp}/{name}"
                os.makedirs(out)
                save_torch_state_dict(full, out, filename_pattern="diffusion_pytorch_model{suffix}.safetensors")
                with open(f"{out}/config.json", "w") as f:
                    json.dump({**transformer.config, "_class_name": "FluxTransformer2DModel"}, f, indent=2)
        state["kind"] = "full_finetune"
    elif rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        config = transformer.peft_config["default"].to_dict()
        for name, ema in (("lora", []), ("ema_lora", ema_params)):
            with swapped(params, ema):
                FluxPipeline.save_lora_weights(os.path.join(tmp, name), get_peft_model_state_dict(transformer),
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
def swapped(params, ema):
    """Temporarily put the EMA values into the live LoRA parameters (for eval and the saved `ema_lora`)."""
    def swap():
        for p, e in zip(params, ema):
            live = p.data.clone()
            p.data.copy_(e)
            e.copy_(live)
    swap()
    try:
        yield
    finally:
        swap()


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
    if args.full_finetune and ((args.lora_rank, args.lora_alpha) != (128, 256) or args.mixed_precision == "fp16"):
        fail("--full-finetune trains every weight in fp32 under bf16 autocast: no LoRA-only --lora-rank/--lora-alpha, "
             "no --mixed-precision fp16")
    if args.group_size < 2:
        fail(f"--group-size {args.group_size}: a group needs at least 2 images for its (unbiased) std")
    lo, hi = window_range = args.sde_window_range or (0, args.num_steps // 2)
    if (k := args.sde_window_size) and not 0 <= lo <= hi - k < hi <= args.num_steps:  # also rejects K < 0
        fail(f"--sde-window-size {k} does not fit --sde-window-range {lo} {hi} (0 <= A <= B - K, B <= --num-steps)")
    num_train_steps = k or int((args.num_steps - 1) * args.timestep_fraction)  # a window trains its K steps
    if num_train_steps < 1:
        fail(f"--timestep-fraction {args.timestep_fraction} trains no step of the first --num-steps {args.num_steps} "
             f"- 1 transitions; raise either")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":  # cuDNN attention's backward crashes or returns NaN on FLUX (torch 2.11, H100): use flash
        torch.cuda.set_device(device)
        torch.backends.cuda.enable_cudnn_sdp(False)
    if "RANK" in os.environ:  # torchrun sets RANK/WORLD_SIZE: nccl on CUDA, gloo on CPU; `python` runs one process
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if "RANK" in os.environ else (0, 1)
    quiet = rank != 0 or not sys.stderr.isatty()  # progress bars only on rank 0's terminal, not in log files
    try:  # rewards are built before the model: a bad file or a server that does not answer fails here
        rewards.check_prompts(args.reward, train_prompts)
        rewards.check_prompts(args.eval_reward or args.reward, test_prompts)
        reward_fn = rewards.build_reward(args.reward, device=device)
        eval_reward_fn = rewards.build_reward(args.eval_reward, device=device) if args.eval_reward else reward_fn
    except ValueError as e:
        fail(str(e))
    if args.full_finetune and len(test_prompts) % world:  # FSDP: every forward runs on all ranks
        fail(f"--full-finetune: {len(test_prompts)} test prompts do not split evenly into {world} GPUs")
    if args.full_finetune and world == 1:  # fp32 weights, grads, AdamW's 2 moments: 16 bytes/parameter (meta device)
        with torch.device("meta"):
            config = FluxTransformer2DModel.load_config(args.model, subfolder="transformer")
            need = 16e-9 * sum(p.numel() for p in FluxTransformer2DModel.from_config(config).parameters())
        have = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 1e9
        if need > have:
            fail(f"--full-finetune needs {need:.0f} GB (fp32 weights+grads+AdamW), one {device.type} has {have:.0f} GB")
    images_per_epoch = args.prompts_per_epoch * args.group_size
    if images_per_epoch % (world * args.batch_size):
        fail(f"prompts-per-epoch x group-size = {images_per_epoch} images do not split into {world} GPUs x "
             f"batch-size {args.batch_size}; change --prompts-per-epoch, --group-size or --batch-size")
    local_images = images_per_epoch // world  # images sampled by this rank per epoch
    num_batches = local_images // args.batch_size
    if num_batches % args.updates_per_epoch:
        fail(f"{num_batches} micro-batches per GPU per epoch do not split into --updates-per-epoch "
             f"{args.updates_per_epoch}; change --updates-per-epoch or --batch-size")
    accum = num_batches // args.updates_per_epoch * num_train_steps  # micro-steps (batch, step) per optimizer step
    run_name = [f"{args.exp_name}__{args.seed}__{int(time.time())}"]
    if world > 1:
        dist.broadcast_object_list(run_name, src=0)
    run_dir = os.path.join(args.output_dir, run_name[0])
    parent = os.path.dirname(os.path.abspath(args.resume or "."))
    if args.resume and not args.eval_only and os.path.basename(parent) == "checkpoints":
        run_dir = os.path.dirname(parent)  # a resumed run continues its checkpoint's run directory
    if rank == 0:
        print(f"{world} {'GPU(s)' if device.type == 'cuda' else 'process(es)'} x {num_batches} "
              f"micro-batches x {args.batch_size} = {images_per_epoch} images/epoch "
              f"({args.prompts_per_epoch} prompts x {args.group_size}); {args.updates_per_epoch} updates/epoch of "
              f"{accum} micro-steps each; run dir {run_dir}")

    # ---- model: frozen base in bf16/fp16, LoRA in fp32 (same init on every rank), VAE in fp32 ----
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}[args.mixed_precision]
    pipe = FluxPipeline.from_pretrained(args.model, dtype={"default": dtype, "vae": torch.float32}).to(device)
    transformer = pipe.transformer
    for module in (transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        module.requires_grad_(False)
    torch.manual_seed(args.seed)
    if args.full_finetune:
        shard_for_full_finetune(transformer)
    else:
        transformer.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, init_lora_weights=True,
                                           target_modules=LORA_TARGETS))  # peft's default (Kaiming-uniform A): upstream
    lora_params = [p for p in transformer.parameters() if p.requires_grad]  # the trained ones (all: --full-finetune)
    for p in lora_params:
        p.data = p.data.float()
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW(lora_params, lr=args.learning_rate, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=args.mixed_precision == "fp16")
    ema_params = [p.detach().clone() for p in lora_params]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    latent_size = args.resolution // pipe.vae_scale_factor  # h = w of the unpacked latent
    latent_shape = ((latent_size // 2) ** 2, transformer.config.in_channels)  # packed: (tokens, 4 x VAE channels)
    img_ids = image_ids(latent_size // 2, latent_size // 2, device)
    sigmas = dance_sigmas(args.num_steps, args.shift).to(device)  # (T+1,) from 1 to 0
    eval_sigmas = dance_sigmas(args.eval_num_steps, args.shift).to(device)
    start_epoch, global_step = (state["next_epoch"], state["global_step"]) if state is not None else (0, 0)
    if state is not None and args.full_finetune:  # each rank reads its shards in place, from any GPU count's checkpoint
        model_sd, optim_sd = get_state_dict(transformer, optimizer)
        dist.checkpoint.load({"model": model_sd, "optimizer": optim_sd, "ema": dict(zip(model_sd, ema_params))},
                             checkpoint_id=os.path.join(args.resume, "dcp"))
    elif state is not None:
        for p, saved in zip(lora_params + ema_params, state["lora"] + state["ema"]):
            p.data.copy_(saved)
        optimizer.load_state_dict(state["optimizer"])
    if rank == 0:  # the run dir is created only now: a run that fails earlier leaves no directory behind
        for tmp in glob.glob(os.path.join(run_dir, "checkpoints", ".*")):  # a crashed save's temp dirs
            shutil.rmtree(tmp)
        metrics_path = os.path.join(run_dir, "metrics.jsonl")  # a resumed run drops the epochs it redoes
        lines = open(metrics_path).readlines() if os.path.exists(metrics_path) else []
        os.makedirs(run_dir, exist_ok=True)
        with open(metrics_path, "w") as f:
            f.writelines(line for line in lines if json.loads(line)["epoch"] < start_epoch)
        if args.track:
            import wandb
            wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=os.path.basename(run_dir),
                       config=vars(args), save_code=True)

    def log(metrics: dict, epoch: int):
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps({"epoch": epoch, **metrics}) + "\n")
            if args.track:
                wandb.log(metrics, step=epoch)

    def run_eval(epoch: int, prefix: str = "eval/") -> dict:
        with swapped(lora_params, ema_params):  # with --ema-decay 0 the EMA equals the live weights
            means, sheet = evaluate(pipe, args, test_prompts, test_meta, eval_reward_fn, eval_sigmas, img_ids, rank,
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
        chosen = (torch.randperm(len(train_prompts), generator=prompt_gen)[: args.prompts_per_epoch]
                  if len(train_prompts) >= args.prompts_per_epoch  # without replacement while there are enough
                  else torch.randint(len(train_prompts), (args.prompts_per_epoch,), generator=prompt_gen))
        order = torch.randperm(images_per_epoch, generator=prompt_gen)
        group_ids = torch.arange(args.prompts_per_epoch).repeat_interleave(args.group_size)[order]  # (P*G,) all ranks
        my_groups = group_ids[rank * local_images : (rank + 1) * local_images].view(num_batches, args.batch_size)
        noise_gen = seeded_generator(device, args.seed, epoch, rank)
        transformer.eval()
        groups_here = my_groups.unique()  # sorted; text conditioning once per prompt this rank samples (U of them)
        with torch.no_grad():  # T5 (U, L, 4096), CLIP-L pooled (U, 768), text ids (L, 3)
            all_embeds, all_pooled, text_ids = pipe.encode_prompt(
                [train_prompts[int(chosen[g])] for g in groups_here], None, device=device,
                max_sequence_length=args.max_sequence_length)
        batches, futures = [], []
        for b in tqdm(range(num_batches), desc=f"epoch {epoch} sampling", disable=quiet, leave=False):
            pos = torch.searchsorted(groups_here, my_groups[b]).to(device)  # (B,) rows of all_embeds
            idx = [int(chosen[g]) for g in my_groups[b]]
            if args.init_same_noise:  # the group's shared initial latent, the same on whichever rank draws it
                noise = torch.stack([torch.randn(latent_shape, device=device, generator=seeded_generator(
                    device, args.seed, epoch, int(g), GROUP_NOISE_STREAM)) for g in my_groups[b]])
            else:
                noise = torch.randn((args.batch_size, *latent_shape), generator=noise_gen, device=device)
            window = draw_sde_window(k, window_range, args.num_steps, noise_gen)  # default (0, T): every step
            latents, log_probs, x0_hat = window_rollout(transformer, noise, sigmas, window, args.noise_level,
                                                        (all_embeds[pos], all_pooled[pos], text_ids, img_ids),
                                                        args.guidance_scale, autocast, noise_gen)  # (B, K+1, L, 4C)
            images = decode(pipe.vae, unpack(x0_hat, latent_size, latent_size))  # the last step's x0_hat, as upstream
            futures.append(executor.submit(reward_fn, images.cpu(), [train_prompts[i] for i in idx],
                                           [train_meta[i] for i in idx]))
            batches.append({"pos": pos, "latents": latents, "log_probs": log_probs, "sigmas": sigmas[window[0] :]})
        sampling_seconds = time.time() - epoch_start

        # ---- REWARD: wait for the scorer, gather every rank's rewards in rank order ----
        results = [f.result() for f in futures]
        info = {k: torch.cat([r[1][k] for r in results]) for k in results[0][1]}  # each (local_images,)
        all_rewards = all_gather_cat(torch.cat([r[0] for r in results]).float().to(device), world).cpu()  # (P*G,)
        all_components = {k: all_gather_cat(info[k].to(device), world).cpu() for k in reward_fn.weights}  # same order
        extras = rank_mean({f"reward/{k}": v.mean().item() for k, v in info.items() if k not in reward_fn.weights},
                           world, device)  # info beyond the weighted components, e.g. pickscore_raw
        if reward_fn.group_transform is not None:  # groupwise rewards (pickscore_rank) see whole groups only here
            all_rewards, all_components = reward_fn.group_transform(all_components, group_ids)

        # ---- ADVANTAGE: per-prompt mean and std (clipped to +-adv_clip inside the loss) ----
        advantages = group_advantages(all_rewards, group_ids)
        check_finite(f"epoch {epoch}", run_dir, reward=all_rewards, advantage=advantages)
        my_adv = advantages[rank * local_images : (rank + 1) * local_images].to(device).view(num_batches, -1)
        group_std = torch.stack([all_rewards[group_ids == g].std(unbiased=False) for g in group_ids.unique()])

        # ---- TRAINING: per micro-batch, K random steps per sample (mixed in one forward), clipped ratio ----
        transformer.train()
        step_gen = seeded_generator(torch.device("cpu"), args.seed, epoch, rank, STEP_STREAM)
        stats = {"policy_loss": [], "approx_kl": [], "clipfrac": []}
        on_policy_dev, micro = float("nan"), 0
        for b, batch in enumerate(tqdm(batches, desc=f"epoch {epoch} training", disable=quiet, leave=False)):
            latents, rows, sig = batch["latents"], torch.arange(args.batch_size, device=device), batch["sigmas"]
            steps = (select_train_steps(args.batch_size, args.num_steps, args.timestep_fraction, step_gen) if not k
                     else torch.arange(k).expand(args.batch_size, k)).to(device)  # a window trains all its K steps
            for j in range(num_train_steps):
                t = steps[:, j]  # (B,) each sample's own transition t -> t + 1
                with autocast:
                    v = predict_velocity(transformer, latents[rows, t], sig[t], all_embeds[batch["pos"]],
                                         all_pooled[batch["pos"]], text_ids, img_ids, args.guidance_scale)
                _, log_prob, _, _ = sde_step(v, latents[rows, t], sig[t], sig[t + 1], "dance", args.noise_level,
                                             prev_sample=latents[rows, t + 1])
                old_log_prob = batch["log_probs"][rows, t]
                policy_loss, ratio = grpo_loss(log_prob, old_log_prob, my_adv[b], args.clip_range, args.adv_clip)
                scaler.scale(policy_loss / accum).backward()
                if micro == 0:  # the epoch's first micro-step runs the rollout's exact weights: ratio must be 1
                    on_policy_dev = (ratio - 1).abs().max().item()
                    if on_policy_dev > args.on_policy_tol and rank == 0:
                        print(f"WARNING: on-policy max |ratio - 1| = {on_policy_dev:.2e} > {args.on_policy_tol}: "
                              "the rollout and training forwards differ")
                stats["policy_loss"].append(policy_loss.item())
                stats["approx_kl"].append(0.5 * ((log_prob - old_log_prob) ** 2).mean().item())
                stats["clipfrac"].append(((ratio - 1).abs() > args.clip_range).float().mean().item())
                micro += 1
                if micro % accum:
                    continue
                # optimizer step: average LoRA grads in a flat all-reduce (FSDP2 did full FT's), clip, step, EMA
                if world > 1 and not args.full_finetune:
                    flat = torch.cat([p.grad.flatten() for p in lora_params])
                    dist.all_reduce(flat)
                    for p, g in zip(lora_params, (flat / world).split([p.numel() for p in lora_params])):
                        p.grad.copy_(g.view_as(p))
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm)
                if not scaler.is_enabled():  # (fp16's scaler skips non-finite steps itself)
                    check_finite(f"epoch {epoch}, step {global_step}", run_dir, loss=policy_loss, gradient=grad_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                decay = min(args.ema_decay, (1 + global_step) / (10 + global_step))  # upstream EMA warm-up
                for e, p in zip(ema_params, lora_params):  # e needs no grad, p.detach() builds no graph
                    e.mul_(decay).add_(p.detach(), alpha=1 - decay)

        # ---- LOGGING, CHECKPOINT ----
        epoch_seconds = time.time() - epoch_start
        max_mem_gb = (torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda"
                      else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)  # Linux reports KiB
        metrics.update(rank_mean({f"losses/{k}": float(np.mean(v)) for k, v in stats.items()}, world, device))
        metrics.update({
            "losses/on_policy_ratio_dev": on_policy_dev, "losses/grad_norm": float(grad_norm),
            "reward/mean": all_rewards.mean().item(), "reward/std": all_rewards.std(unbiased=False).item(),
            "reward/zero_std_group_frac": (group_std == 0).float().mean().item(),
            **{f"reward/{k}": v.mean().item() for k, v in all_components.items()}, **extras,
            "charts/global_step": global_step, "charts/learning_rate": args.learning_rate,
            "perf/images_per_sec": images_per_epoch / sampling_seconds, "perf/epoch_seconds": epoch_seconds,
            "perf/max_mem_gb": max_mem_gb})
        if epoch + 1 == args.epochs:
            metrics.update(run_eval(epoch + 1, prefix="eval/final_"))
        log(metrics, epoch)
        if rank == 0:
            if (group_std == 0).all():  # warnings.warn shows this once per run
                warnings.warn("an epoch where every group's rewards are all equal: zero advantages, nothing to learn")
            eval_note = f" | eval {metrics['eval/reward_mean']:.4f}" if "eval/reward_mean" in metrics else ""
            print(f"epoch {epoch}: reward {metrics['reward/mean']:.4f} ± {metrics['reward/std']:.4f} | policy "
                  f"{metrics['losses/policy_loss']:.3e} | ratio dev {on_policy_dev:.1e} | clipfrac "
                  f"{metrics['losses/clipfrac']:.3f} | {metrics['perf/images_per_sec']:.2f} img/s | "
                  f"{epoch_seconds:.0f}s{eval_note}")
        if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
            save_checkpoint(os.path.join(run_dir, "checkpoints", f"epoch_{epoch + 1:05d}"), transformer, lora_params,
                            ema_params, optimizer, epoch + 1, global_step, args, rank)
            if world > 1:
                dist.barrier()
    executor.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
