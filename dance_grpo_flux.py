"""DanceGRPO on FLUX.1-dev: GRPO on the dance SDE's step log-probs, no CFG, no KL.

Paper: DanceGRPO, https://arxiv.org/abs/2505.07818
Docs: docs/dance_grpo.md (recipes, metrics, the toy-world demo).

The defaults: upstream's LoRA recipe (finetune_flux_grpo_8gpus_lora.sh, HPS v2.1):
    torchrun --nproc_per_node 8 dance_grpo_flux.py --train-prompts hpd/train.txt \
        --test-prompts hpd/test.txt

Provenance: XueZeyue/DanceGRPO@15cc71d, MixGRPO@e5cdd6a (the window, Flash); the
upstream lines of each detail: docs/dance_grpo.md.
"""

import glob
import hashlib
import io
import json
import logging
import math
import os
import resource
import shutil
import shlex
import signal
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from functools import partial
from typing import Annotated, Literal, NamedTuple

import huggingface_hub
import numpy as np
import torch
import torch.distributed as dist
import transformers
import tyro
logging.getLogger("transformers.utils.import_utils").addFilter(  # we use PIL, not torchvision
    lambda record: "requires torchvision" not in record.getMessage())
import diffusers  # noqa: E402 (after the filter)
from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel
import peft
from PIL import Image, ImageDraw, ImageFont
from safetensors import SafetensorError
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.fsdp import fully_shard
from tqdm import tqdm

import rewards
from sde import dpm_step, flash_sigmas, sde_step, sde_window, shift_sigmas

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


@dataclass
class Args:
    # The algorithm (defaults: upstream's LoRA recipe)
    group_size: Annotated[int, ">= 2"] = 12
    """images per prompt (a group: normalised together)"""
    num_steps: Annotated[int, ">= 1"] = 12
    """SDE steps per rollout (upstream: 12; full: 16)"""
    shift: Annotated[float, "> 0"] = 3.0
    """SD3's time shift of the uniform sigma grid"""
    guidance_scale: float = 3.5
    """FLUX.1-dev's guidance input (no CFG)"""
    noise_level: float = 0.3
    """eta, the dance SDE's diffusion (sde.py)"""
    sde_window_size: int = 0
    """K > 0: SDE on K consecutive steps, all trained; else ODE"""
    sde_window_range: tuple[int, int] | None = None
    """A B: the window lies in [A, B) (None: 0, num_steps // 2)"""
    window_shift_every: Annotated[int | None, ">= 1"] = None
    """slide the window every N epochs (MixGRPO; None: random)"""
    window_stride: int = 1
    """steps it slides by (MixGRPO: --prog_overlap_step; 0: stays)"""
    window_roll_back: bool = True
    """after the empty window at B, back to A (MixGRPO: --roll_back)"""
    flash_ratio: float = 0.0
    """MixGRPO-Flash: DPM-Solver++ after the window (0.4, Flash* 0.2)"""
    prompts_per_epoch: Annotated[int, ">= 1"] = 16
    """prompts (groups) per epoch, over all GPUs"""
    batch_size: Annotated[int, ">= 1"] = 1
    """per-GPU micro-batch of rollout and training"""
    updates_per_epoch: Annotated[int, ">= 1"] = 2
    """optimizer steps per epoch (the first is on-policy)"""
    timestep_fraction: Annotated[float, "in (0, 1]"] = 0.6
    """a sample trains int((num_steps - 1) x this) random steps"""
    clip_range: float = 1e-4
    """PPO clip (tiny: log-probs are means over elements, sde.py)"""
    adv_clip: Annotated[float, "> 0"] = 5.0
    """advantages are clipped to +-adv_clip"""
    init_same_noise: bool = True
    """a group's images start from one initial latent"""
    ema_decay: Annotated[float, "in [0, 1)"] = 0.0
    """EMA decay of the trained weights, for eval (0: off)"""
    # This recipe's run settings (upstream's values for this algorithm)
    allow_tf32: bool = True
    """TF32 for fp32 matmuls on CUDA (VAE, rewards), as upstream"""
    max_sequence_length: Annotated[int, ">= 1"] = 512
    """T5 tokens per prompt"""
    eval_every: Annotated[int, ">= 1"] = 50
    """evaluate every N epochs (and after the last)"""
    save_every: Annotated[int, ">= 1"] = 50
    """keep every N-th epoch's save (--full-finetune: only these)"""
    # Shared arguments (the SD3.5 scripts' and full fine-tuning)
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """wandb group and run-directory prefix"""
    seed: int = 42
    """seed of the LoRA init, prompt draws and noise"""
    track: bool = False
    """also log to wandb (WANDB_PROJECT, WANDB_ENTITY: where)"""
    toy: bool = False
    """the toy-world demo: TOY's flags as the defaults"""
    output_dir: str = "runs"
    """runs go to OUTPUT_DIR/RUN_NAME"""
    resume: str | None = None
    """checkpoint to continue (`latest`: this run name's newest)"""
    eval_only: bool = False
    """evaluate --resume's EMA with its flags, or the base"""
    model: str = "black-forest-labs/FLUX.1-dev"
    """hub id or path of a diffusers FluxPipeline"""
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    """frozen weights' dtype, with autocast (FLUX overflows fp16)"""
    gradient_checkpointing: bool = True
    """recompute activations in backward (FLUX is 12B)"""
    compile: bool = torch.cuda.is_available()
    """torch.compile each block (~2x faster; on with CUDA)"""
    full_finetune: bool = False
    """train all weights (fp32, FSDP2-sharded), as the paper"""
    lora_rank: Annotated[int, ">= 1"] = 128
    """LoRA rank"""
    lora_alpha: Annotated[int, "> 0"] = 256
    """LoRA alpha (scale = alpha / rank)"""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """layers to adapt (peft's target_modules)"""
    train_prompts: str = "prompts/train.txt"
    """a prompt per line, or JSONL: `prompt` and fields for the reward"""
    test_prompts: str = "prompts/test.txt"
    """eval prompts, same format"""
    reward: str = "hpsv2"
    """rewards.py name, `ocr=1,pickscore=0.5`, or `file.py:fn`"""
    eval_reward: str | None = None
    """eval's reward (None: --reward)"""
    resolution: Annotated[int, ">= 1"] = 720
    """image height and width in pixels"""
    eval_num_steps: Annotated[int, ">= 1"] = 28
    """Euler ODE steps of eval"""
    eval_batch_size: Annotated[int, ">= 1"] = 8
    """per-GPU eval batch"""
    epochs: Annotated[int, ">= 1"] = 300
    """epochs to train (each: sample, score, update)"""
    learning_rate: float = 3e-4
    """AdamW learning rate (constant)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: Annotated[float, "> 0"] = 1.0
    """gradient-norm clip"""
    eval_seeds: tuple[int, ...] = (42,)
    """eval noise: a sample per test prompt and seed"""
    checkpoints_total_limit: Annotated[int | None, ">= 1"] = None
    """keep the newest N of the --save-every grid (None: all)"""
    push_to_hub: bool = False
    """upload the final ema_lora/ and its card to the Hub"""
    hub_model_id: str | None = None
    """its Hub repository (None: YOUR_HUB_NAME/EXP_NAME)"""
    hub_private: bool = False
    """make that repository private"""


# ALGO LOGIC: --toy, the CPU demo (docs/toy_world.md)
TOY = dict(model="tests/assets/toy-flux", train_prompts="tests/assets/toy_train.txt",
           test_prompts="tests/assets/toy_test.txt",
           reward="tests/toy_rewards.py:counting_partial",
           eval_reward="tests/toy_rewards.py:counting", resolution=32, max_sequence_length=24,
           mixed_precision="no", num_steps=10, eval_num_steps=10, eval_batch_size=48,
           group_size=16, prompts_per_epoch=6, batch_size=16, lora_rank=8, lora_alpha=8,
           learning_rate=1e-3, noise_level=0.7, ema_decay=0.9, epochs=64, eval_every=8)

# ALGO LOGIC: the sampler, the advantages and the loss


def dance_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    return shift_sigmas(torch.linspace(1, 0, num_steps + 1), shift)


class Rollout(NamedTuple):
    start: int  # the window's first step
    latents: torch.Tensor  # (B, K+1, L, 4C): x at the window's steps and after
    log_probs: torch.Tensor  # (B, K): log-probs, element means
    sigmas: torch.Tensor  # (K+1,): the window's sigmas
    noise_level: float  # the SDE's eta
    sample: torch.Tensor  # (B, L, 4C): the last x0_hat, scored


@torch.no_grad()
def rollout(velocity, noise, sigmas, window, noise_level, generator, dpm_from=None) -> Rollout:
    """Dance SDE in the window, Euler elsewhere; DPM-Solver++(2M) from dpm_from."""
    start, end = window
    x = noise.float()
    latents = []
    log_probs = []
    x0_hat = None
    for i in range(len(sigmas) - 1):
        if i == start:
            latents.append(x)
        v = velocity(x, sigmas[i])
        if dpm_from is not None and i >= dpm_from:  # history: the last x0_hat
            x, x0_hat = dpm_step(v, x, sigmas, i, x0_hat)
            continue
        x0_hat = x - sigmas[i] * v
        kind = "dance" if start <= i < end else "ode"
        x, log_prob, _, _ = sde_step(v, x, sigmas[i], sigmas[i + 1], kind,
                                     noise_level, generator=generator)
        if kind == "dance":
            latents.append(x)
            log_probs.append(log_prob)
    if start == end:  # MixGRPO's empty window
        return Rollout(start=start, latents=None, log_probs=None, sigmas=None,
                       noise_level=noise_level, sample=x0_hat)
    return Rollout(start=start, latents=torch.stack(latents, 1),
                   log_probs=torch.stack(log_probs, 1), sigmas=sigmas[start : end + 1],
                   noise_level=noise_level, sample=x0_hat)


def compute_advantages(rewards, group_ids):
    """(reward - group mean) / (unbiased group std + 1e-8), as upstream."""
    rewards = rewards.double()
    count = torch.bincount(group_ids).double()
    centered = rewards - (torch.bincount(group_ids, rewards) / count)[group_ids]
    std = (torch.bincount(group_ids, centered**2) / (count - 1)).sqrt()[group_ids]
    return (centered / (std + 1e-8)).float()


def select_train_steps(batch: int, num_steps: int, fraction: float, generator):
    """(batch, K): each sample's K random steps, not the last."""
    order = torch.rand(batch, num_steps - 1, generator=generator).argsort(dim=1)
    return order[:, : int((num_steps - 1) * fraction)]


def grpo_loss(*, log_prob, old_log_prob, advantages, clip_range, adv_clip, accum_steps):
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    advantages = advantages.clamp(-adv_clip, adv_clip)
    clipped_ratio = ratio.clamp(1 - clip_range, 1 + clip_range)
    policy_loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio).mean()
    stats = {"policy_loss": policy_loss.item(),
             "approx_kl": 0.5 * (log_ratio**2).mean().item(),
             "clipfrac": ((ratio - 1).abs() > clip_range).float().mean().item()}
    return policy_loss / accum_steps, ratio, stats


def main():
    """The run; a shared block's tag says what it reads."""
    # TRY NOT TO MODIFY: input checks and rewards, before the model loads
    toy = Args(**TOY, toy=True) if "--toy" in sys.argv else None  # given flags win
    args = tyro.cli(Args, description=__doc__.split("\n\n")[0], default=toy)
    state = check_args(args)
    train_prompts, train_meta = ([], []) if args.eval_only else load_prompts(args.train_prompts)
    test_prompts, test_meta = load_prompts(args.test_prompts)
    rank = int(os.environ.get("RANK", 0))  # torchrun's
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
        # NaN or a crash in backward (torch 2.11)
        torch.backends.cuda.enable_cudnn_sdp(False)
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    quiet = rank != 0 or not sys.stderr.isatty()
    if quiet:  # loading bars too
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()  # every truncated prompt
    try:  # a bad reward file or server fails
        rewards.check_prompts(args.reward, train_prompts)
        rewards.check_prompts(args.eval_reward or args.reward, test_prompts)
        reward_fn = rewards.build_reward(args.reward, device=device)
        eval_reward_fn = reward_fn
        if args.eval_reward:
            eval_reward_fn = rewards.build_reward(args.eval_reward, device=device)
    except ValueError as error:
        fail(str(error))
    eval_samples = len(test_prompts) * len(args.eval_seeds)
    # FSDP2: every rank runs each eval forward
    if args.full_finetune and eval_samples % world:
        fail(f"--full-finetune: {eval_samples} eval samples do not split into {world} GPUs")
    images_per_epoch = args.prompts_per_epoch * args.group_size
    if images_per_epoch % (world * args.batch_size):
        fail(f"prompts-per-epoch x group-size = {images_per_epoch} images do not split "
             f"into {world} GPUs x --batch-size {args.batch_size}")
    num_batches = images_per_epoch // world // args.batch_size
    run_dir = None
    parent = os.path.dirname(os.path.abspath(args.resume or "."))
    if args.resume and not args.eval_only and os.path.basename(parent) == "checkpoints":
        run_dir = os.path.dirname(parent)  # it goes on in its run

    # ALGO LOGIC: images to optimizer steps (on 8 GPUs: 2 x 12 x 6)
    if num_batches % args.updates_per_epoch:
        fail(f"{num_batches} micro-batches per GPU per epoch do not split into "
             f"--updates-per-epoch {args.updates_per_epoch}")
    window_size = args.sde_window_size
    window_range = args.sde_window_range or (0, args.num_steps // 2)
    low, high = window_range
    if window_size and not 0 <= low <= high - window_size < high <= args.num_steps:
        fail(f"--sde-window-size {window_size} does not fit --sde-window-range "
             f"{low} {high} (0 <= A <= B - K, B <= --num-steps)")
    if args.flash_ratio and not (window_size and high < args.num_steps):
        fail("--flash-ratio needs an SDE window that ends before --num-steps")
    num_train_steps = window_size or int((args.num_steps - 1) * args.timestep_fraction)
    if num_train_steps < 1:
        fail(f"--timestep-fraction {args.timestep_fraction} trains no step of "
             f"{args.num_steps - 1}")
    sigmas = dance_sigmas(args.num_steps, args.shift).to(device)
    eval_sigmas = dance_sigmas(args.eval_num_steps, args.shift).to(device)
    if not args.eval_only:
        say(f"{world} process(es) x {num_batches} micro-batches x {args.batch_size} = "
            f"{images_per_epoch} images/epoch; {args.updates_per_epoch} updates/epoch "
            f"of {num_batches // args.updates_per_epoch * num_train_steps} micro-steps each")

    # TRY NOT TO MODIFY: the model: frozen base in bf16, LoRA (or all) in fp32
    dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    pipe = FluxPipeline.from_pretrained(
        args.model, dtype={"default": dtype, "vae": torch.float32}).to(device)
    transformer = pipe.transformer.requires_grad_(False)  # in eval mode throughout
    torch.manual_seed(args.seed)  # the LoRA init, on all ranks
    if args.full_finetune:
        shard_for_full_finetune(transformer)
    else:  # peft's default init, as upstream
        lora = peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                               init_lora_weights=True, target_modules=list(args.lora_targets))
        transformer.add_adapter(lora)
    params = [p for p in transformer.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if args.compile:
        torch._dynamo.config.recompile_limit = 64
        for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
            block.compile(dynamic=False)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    ema_params = [p.detach().clone() for p in params if not args.full_finetune or args.ema_decay]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    grid_size = args.resolution // pipe.vae_scale_factor // 2  # 2x2 latents a token
    latent_shape = (grid_size**2, transformer.config.in_channels)
    img_ids = pipe._prepare_latent_image_ids(1, grid_size, grid_size, device, torch.float32)
    def velocity(x, sigma, text: Text):
        with autocast:
            return predict_velocity(transformer, x, sigma, text, img_ids, args.guidance_scale)

    # TRY NOT TO MODIFY: resume, run dir, eval; reads eval_sigmas
    start_epoch = state["next_epoch"] if state else 0
    global_step = state["global_step"] if state else 0
    if state and args.full_finetune:  # on any GPU count
        try:  # they may not fit
            dist.checkpoint.load(sharded_state(transformer, optimizer, ema_params),
                                 checkpoint_id=f"{args.resume}/dcp")
        except (Exception, dist.checkpoint.CheckpointException) as error:
            fail(f"--resume {args.resume!r}: its dcp/ shards do not load ({type(error).__name__})")
    elif state:
        for p, saved in zip(params + ema_params, state["lora"] + state["ema"]):
            p.data.copy_(saved)
        optimizer.load_state_dict(state["optimizer"])
    if rank == 0 and run_dir is None:  # a failed start leaves none
        name = f"{args.exp_name}__{args.seed}__{int(time.time())}_"
        run_dir = tempfile.mkdtemp(prefix=name, dir=args.output_dir)
        os.chmod(run_dir, 0o755)  # mkdtemp's is private
    shared = [run_dir]
    if world > 1:
        dist.broadcast_object_list(shared, src=0)
    run_dir = shared[0]
    if rank == 0:
        print(f"run dir {run_dir}")
        prepare_run_dir(run_dir, start_epoch)
    if args.track and rank == 0:
        import wandb
        wandb.init(name=os.path.basename(run_dir), config=vars(args), save_code=True, dir=run_dir)
    for number in (signal.SIGTERM, signal.SIGINT):  # preemption, Ctrl-C
        signal.signal(number, lambda number, _: stop(
            f"stopped by {signal.Signals(number).name}", run_dir, 128 + number))
    evaluate = partial(run_eval, args=args, pipe=pipe, velocity=velocity, params=params,
                       ema_params=ema_params, eval_sigmas=eval_sigmas, latent_shape=latent_shape,
                       eval_reward_fn=eval_reward_fn, test_prompts=test_prompts,
                       test_meta=test_meta, run_dir=run_dir)
    if args.eval_only:
        log(evaluate(start_epoch), start_epoch, run_dir, args.track)
    executor = ThreadPoolExecutor(max_workers=1)  # scores while sampling
    metrics = state.get("metrics", {}) if state else {}  # a relaunch's
    for epoch in range(start_epoch, 0 if args.eval_only else args.epochs):
        epoch_start = clock(device)
        metrics = evaluate(epoch) if epoch % args.eval_every == 0 else {}
        text_start = clock(device)
        # the epoch's prompts, alike on all ranks
        prompt_gen = seeded_generator(torch.device("cpu"), args.seed, epoch)
        num_prompts = len(train_prompts)
        if num_prompts >= args.prompts_per_epoch:
            chosen = torch.randperm(num_prompts, generator=prompt_gen)[: args.prompts_per_epoch]
        else:
            chosen = torch.randint(num_prompts, (args.prompts_per_epoch,), generator=prompt_gen)
        epoch_prompts = [train_prompts[i] for i in chosen]  # group g's is row g
        epoch_meta = [train_meta[i] for i in chosen]
        epoch_text = encode(pipe, epoch_prompts, device, args.max_sequence_length)
        sampling_start = clock(device)

        # ALGO LOGIC: sampling; images shuffled alike on all ranks
        group_ids = torch.randperm(images_per_epoch, generator=prompt_gen) // args.group_size
        my_groups = group_ids.view(world, num_batches, args.batch_size)[rank]
        noise_gen = seeded_generator(device, args.seed, epoch, rank)
        batches = []  # (Text, Rollout) a micro-batch
        futures = []  # their rewards
        for groups in tqdm(my_groups, f"epoch {epoch} sampling", disable=quiet, leave=False):
            text = Text(epoch_text.embeds[groups], epoch_text.pooled[groups])
            if args.init_same_noise:
                noise = torch.stack([
                    torch.randn(latent_shape, device=device, generator=seeded_generator(
                        device, args.seed, epoch, int(group), 2))  # 2: a group's latent
                    for group in groups])
            else:
                noise = torch.randn(len(groups), *latent_shape, generator=noise_gen, device=device)
            window = sde_window(window_size, window_range, args.num_steps, noise_gen,
                                epoch, args.window_shift_every, args.window_stride,
                                args.window_roll_back, shrink=True)
            flash = args.flash_ratio  # MixGRPO-Flash's coarser grid
            grid = flash_sigmas(sigmas, window[1], flash, args.shift) if flash else sigmas
            dpm_from = window[1] if flash else None
            out = rollout(partial(velocity, text=text), noise, grid, window,
                          args.noise_level, noise_gen, dpm_from)
            images = decode(pipe, out.sample, args.resolution).cpu()
            prompts = [epoch_prompts[group] for group in groups]
            meta = [epoch_meta[group] for group in groups]
            futures.append(executor.submit(reward_fn, images, prompts, meta))
            batches.append((text, out))

        # TRY NOT TO MODIFY: all ranks' rewards; reads futures, group_ids
        reward_start = clock(device)
        try:
            scores, infos = zip(*[future.result() for future in futures])
        except rewards.RewardError as error:
            stop(f"error: {error} at epoch {epoch}", run_dir)
        info = {name: torch.cat([part[name] for part in infos]) for name in infos[0]}
        my_rewards = torch.cat(scores).float().to(device)
        all_rewards = all_gather_cat(my_rewards, world).cpu()  # (P*G,)
        all_components = {name: all_gather_cat(info[name].to(device), world).cpu()
                          for name in reward_fn.weights}
        extras = {f"reward/{name}": values.mean().item()  # pickscore_raw, ...
                  for name, values in info.items() if name not in reward_fn.weights}
        extras = rank_mean(extras, world, device)
        if reward_fn.group_transform is not None:  # e.g. ranks within each group
            all_rewards, all_components = reward_fn.group_transform(all_components, group_ids)
        check_finite(f"epoch {epoch}", run_dir, reward=all_rewards)
        group_std = torch.stack([all_rewards[group_ids == group].std(unbiased=False)
                                 for group in group_ids.unique()])
        training_start = clock(device)

        # ALGO LOGIC: the advantages; training: re-score the stored steps
        advantages = compute_advantages(all_rewards, group_ids)
        k = window[1] - window[0] if window_size else num_train_steps
        accum_steps = num_batches // args.updates_per_epoch * k
        my_advantages = advantages.to(device).view(world, num_batches, args.batch_size)[rank]
        step_gen = seeded_generator(torch.device("cpu"), args.seed, epoch, rank, 1)
        stats = defaultdict(list)
        on_policy = []  # |ratio - 1| before the epoch's first update
        grad_norm = float("nan")
        micro_step = 0
        rows = torch.arange(args.batch_size, device=device)
        progress = tqdm(batches, f"epoch {epoch} training", disable=quiet, leave=False)
        for (text, out), batch_advantages in zip(progress, my_advantages):
            steps = torch.arange(k).expand(args.batch_size, -1)  # (B, K)
            if not window_size:
                steps = select_train_steps(args.batch_size, args.num_steps,
                                           args.timestep_fraction, step_gen)
            for step in steps.to(device).T:  # (B,): a step per sample
                sigma = out.sigmas[step]
                sigma_next = out.sigmas[step + 1]
                x = out.latents[rows, step]
                log_prob = sde_step(velocity(x, sigma, text), x, sigma, sigma_next, "dance",
                                    out.noise_level, prev_sample=out.latents[rows, step + 1])[1]
                loss, ratio, step_stats = grpo_loss(
                    log_prob=log_prob, old_log_prob=out.log_probs[rows, step],
                    advantages=batch_advantages, clip_range=args.clip_range,
                    adv_clip=args.adv_clip, accum_steps=accum_steps)
                loss.backward()
                for name, value in step_stats.items():
                    stats[name].append(value)
                if micro_step < accum_steps:  # the rollout's weights
                    on_policy.append((ratio.detach() - 1).abs())
                micro_step += 1
                if micro_step % accum_steps == 0:
                    grad_norm = optimizer_step(
                        optimizer, params, args.max_grad_norm, world, loss,
                        f"epoch {epoch}, step {global_step}", run_dir, args.full_finetune)
                    global_step += 1
                    decay = min(args.ema_decay, (1 + global_step) / (10 + global_step))
                    for ema, p in zip(ema_params, params):
                        ema.mul_(decay).add_(p.detach(), alpha=1 - decay)

        # ALGO LOGIC: its metrics and its part of the epoch's line
        summary = "empty SDE window (MixGRPO's start = B): no update"
        if k:
            losses = {f"losses/{name}": float(np.mean(values)) for name, values in stats.items()}
            metrics.update(rank_mean(losses, world, device))
            deviations = torch.cat(on_policy)
            on_policy_dev = deviations.max().item()
            metrics["losses/on_policy_ratio_dev"] = on_policy_dev
            clipped = (deviations > args.clip_range).float().mean().item()
            metrics["losses/on_policy_clipfrac"] = clipped
            if on_policy_dev > args.clip_range / 10:
                say(f"WARNING: on-policy |ratio - 1| = {on_policy_dev:.1e}")
            summary = (f"policy {metrics['losses/policy_loss']:.3e} | ratio dev "
                       f"{on_policy_dev:.1e} | clipfrac {metrics['losses/clipfrac']:.3f}")

        # TRY NOT TO MODIFY: the line, checkpoint; reads grad_norm, summary
        epoch_end = clock(device)
        epoch_seconds = epoch_end - epoch_start
        # ru_maxrss is in KiB on Linux
        max_mem_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        if device.type == "cuda":
            max_mem_gb = torch.cuda.max_memory_allocated(device) / 1e9
        metrics.update({
            "losses/grad_norm": float(grad_norm),
            "reward/mean": all_rewards.mean().item(),
            "reward/std": all_rewards.std(unbiased=False).item(),
            "reward/zero_std_group_frac": (group_std == 0).float().mean().item(),
            **{f"reward/{name}": part.mean().item() for name, part in all_components.items()},
            **extras,
            "charts/global_step": global_step,
            "charts/learning_rate": args.learning_rate,
            "perf/images_per_sec": images_per_epoch / (reward_start - sampling_start),
            "perf/epoch_seconds": epoch_seconds,
            "perf/eval_seconds": text_start - epoch_start,
            "perf/text_encoding_seconds": sampling_start - text_start,
            "perf/sampling_seconds": reward_start - sampling_start,
            "perf/reward_seconds": training_start - reward_start,
            "perf/training_seconds": epoch_end - training_start,
            "perf/compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            "perf/max_mem_gb": max_mem_gb})
        if rank == 0:
            line = (f"epoch {epoch}: reward {metrics['reward/mean']:.4f} ± "
                    f"{metrics['reward/std']:.4f} | {summary} | "
                    f"{metrics['perf/images_per_sec']:.2f} img/s | {epoch_seconds:.0f}s")
            if "eval/reward_mean" in metrics:
                line += (f" | eval {metrics['eval/reward_mean']:.4f} ± "
                         f"{metrics['eval/reward_stderr']:.4f}")
            print(line + " (nan: a reward gave no number)" * ("nan" in line))
        path = os.path.join(run_dir, "checkpoints", f"epoch_{epoch + 1:05d}")
        last = epoch + 1 == args.epochs
        try:  # preemption loses --save-every epochs
            if not last:  # a resume redoes it
                log(metrics, epoch, run_dir, args.track)
            if last or not args.full_finetune or (epoch + 1) % args.save_every == 0:
                save_checkpoint(path, transformer, params, ema_params, optimizer,
                                epoch + 1, global_step, args, rank, metrics)
                if rank == 0:
                    prune_checkpoints(run_dir, path, args.save_every, args.checkpoints_total_limit)
            if rank == 0 and not (last or args.full_finetune):  # the last's: below
                write_card(run_dir, args, images_per_epoch)
        except (OSError, SafetensorError) as error:
            stop(f"error: {error} (saving epoch {epoch + 1})", run_dir)
        if world > 1:
            dist.barrier()

    # TRY NOT TO MODIFY: the final eval of the saved file, card, push, line
    if not args.eval_only:  # --full-finetune: in memory
        path = os.path.join(run_dir, "checkpoints", f"epoch_{args.epochs:05d}")
        metrics.update(evaluate(args.epochs, "eval/final_", f"{path}/ema_lora"))
        try:
            if rank == 0 and not args.full_finetune:  # a LoRA's card
                write_card(run_dir, args, images_per_epoch, final=metrics)
            if rank == 0 and args.push_to_hub:  # the final EMA LoRA alone
                hub = huggingface_hub.HfApi()
                hub.create_repo(args.hub_model_id, private=args.hub_private, exist_ok=True)
                hub.upload_folder(repo_id=args.hub_model_id, folder_path=f"{path}/ema_lora")
                print(f"pushed to https://huggingface.co/{args.hub_model_id}")
            log(metrics, args.epochs - 1, run_dir, args.track)
        except OSError as error:
            stop(f"error: {error} (finishing after {args.epochs} epochs)", run_dir)
    executor.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


# TRY NOT TO MODIFY: the shared helpers
class Text(NamedTuple):
    """T5 tokens (B, L, 4096), pooled CLIP-L (B, 768)."""
    embeds: torch.Tensor
    pooled: torch.Tensor


def fail(message: str):
    """Stop with one line, printed once (by rank 0 under torchrun)."""
    raise SystemExit(1 if os.environ.get("RANK", "0") != "0" else f"error: {message}")


def say(message: str):
    if os.environ.get("RANK", "0") == "0":
        print(message, flush=True)


def check_ranges(args):
    ranges = {">= 0": lambda x: x >= 0, ">= 1": lambda x: x >= 1, ">= 2": lambda x: x >= 2,
              "> 0": lambda x: x > 0, "in [0, 1)": lambda x: 0 <= x < 1,
              "in (0, 1]": lambda x: 0 < x <= 1, "in [0, 1]": lambda x: 0 <= x <= 1}
    for field in fields(args):
        value = getattr(args, field.name)
        allowed = getattr(field.type, "__metadata__", [">= 0"])[0]
        flag = "--" + field.name.replace("_", "-")
        for number in value if isinstance(value, tuple) else [value]:
            if isinstance(number, float) and not math.isfinite(number):
                fail(f"{flag} must be a finite number, got {number}")
            if isinstance(number, (int, float)) and not ranges[allowed](number):
                fail(f"{flag} must be {allowed}, got {value}")


def check_args(args) -> dict | None:
    state = None
    if args.resume == "latest":  # torchrun --max-restarts
        runs = os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__*")
        saves = glob.glob(os.path.join(runs, "checkpoints", "epoch_*"))
        args.resume = None  # sorted by start time, then epoch
        for save in sorted(saves, reverse=True):
            state = load_checked(save)
            if isinstance(state, dict):
                args.resume = save
                break
            say(f"skipping {save}: {state}")
    elif args.resume:
        state = load_checked(args.resume)
        if isinstance(state, str):
            fail(f"--resume {args.resume!r}: {state}")
    script = os.path.basename(__file__)
    if args.resume:  # its flags, but those given
        if state.get("script") != script:
            fail(f"--resume {args.resume!r} is not a checkpoint of {script}")
        say(f"resuming from {args.resume}")
        given = {word[2:].split("=")[0].removeprefix("no-").replace("-", "_")
                 for word in sys.argv[1:] if word.startswith("--")}
        for name, value in state["args"].items():
            if name not in given | {"resume", "eval_only"}:
                setattr(args, name, value)
    check_ranges(args)
    if args.mixed_precision == "fp16":
        fail("--mixed-precision fp16: FLUX overflows in fp16 (bf16 or no)")
    try:  # found now, not after the model loads
        os.makedirs(args.output_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=args.output_dir).close()
    except OSError as error:
        fail(f"--output-dir {args.output_dir!r}: {error.strerror}")
    try:  # configs only, before the weights
        vae = AutoencoderKL.load_config(args.model, subfolder="vae")
        dit = FluxTransformer2DModel.load_config(args.model, subfolder="transformer")
    except Exception as error:
        fail(f"model {args.model!r}: no local pipeline directory, no hub answer "
             f"({type(error).__name__}; offline? gated: hf auth login)")
    factor = 2 ** (len(vae["block_out_channels"]) - 1) * dit.get("patch_size", 1) * 2
    if args.resolution % factor:
        fail(f"--resolution {args.resolution} is not a positive multiple of {factor} "
             "(VAE downsampling x 2x2 packing)")
    with torch.device("meta"):  # the layers' names
        names = [f".{name}" for name, _ in FluxTransformer2DModel.from_config(dit).named_modules()]
    for target in args.lora_targets:  # matched as peft does
        if not any(name.endswith(f".{target}") for name in names):
            fail(f"--lora-targets {target} names no layer of {args.model}")
    if args.track and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        import wandb
        if not wandb.login(prompt=False):
            fail("--track needs a wandb login (`wandb login` or WANDB_API_KEY), "
                 "or WANDB_MODE=offline")
    if args.push_to_hub and args.full_finetune:
        fail("--push-to-hub uploads a LoRA (full fine-tune: hf upload transformer/)")
    if args.push_to_hub and not args.eval_only:
        try:
            user = huggingface_hub.whoami()["name"]
        except Exception as error:  # no token, offline, no answer
            fail(f"--push-to-hub needs a Hub login (hf auth login): {type(error).__name__}")
        args.hub_model_id = args.hub_model_id or f"{user}/{args.exp_name}"
    if not args.resume:
        return None
    if os.path.isdir(f"{args.resume}/dcp") != args.full_finetune:
        fail(f"--resume {args.resume!r} needs the --full-finetune it was saved with")
    for name in ["model", "lora_rank", "lora_alpha", "lora_targets"]:
        if state["args"][name] != getattr(args, name):
            fail(f"--{name.replace('_', '-')} {getattr(args, name)!r} differs from the "
                 f"checkpoint's {state['args'][name]!r}")
    if not args.eval_only and state["next_epoch"] > args.epochs:
        fail(f"--epochs {args.epochs} < the checkpoint's {state['next_epoch']}")
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(args.resume)))
    path = os.path.join(run_dir, "metrics.jsonl")  # finished: its final eval logged
    lines = open(path).readlines() if os.path.exists(path) else []
    row = json.loads(lines[-1]) if lines and lines[-1].endswith("\n") else {}
    at_end = state["next_epoch"] == args.epochs == row.get("epoch", -2) + 1
    if not args.eval_only and at_end and "eval/final_sheet" in row:
        say(f"{run_dir} has finished")
        raise SystemExit(0)
    return state


def load_state(save: str) -> dict | str:
    """A checkpoint's state if its checksum (written last) matches, else why."""
    try:
        with open(os.path.join(save, "state.pt"), "rb") as file:
            data = file.read()
        with open(os.path.join(save, "state.pt.sha256")) as file:
            digest = file.read().strip()
    except OSError as error:
        return f"not a checkpoint directory ({error.strerror}: {error.filename})"
    if hashlib.sha256(data).hexdigest() != digest:
        return "corrupt: its state.pt does not match state.pt.sha256"
    return torch.load(io.BytesIO(data), map_location="cpu")


def load_checked(save: str) -> dict | str:
    """load_state, then its dcp/ shards by their checksums."""
    state = load_state(save)
    digests = state.get("dcp_sha256", {}) if isinstance(state, dict) else {}
    for name, digest in digests.items():
        if sha256_of(f"{save}/dcp/{name}") != digest:
            return f"corrupt: its dcp/{name} does not match its checksum"
    return state


def load_prompts(path: str) -> tuple[list[str], list[dict]]:
    if not os.path.isfile(path):
        fail(f"prompt file {path!r} does not exist (docs/usage.md: prompt sets)")
    with open(path, encoding="utf-8-sig") as file:  # a BOM is no part of a prompt
        lines = [line.strip() for line in file if line.strip()]
    if not lines:
        fail(f"prompt file {path!r} is empty")
    if not path.endswith(".jsonl"):
        return lines, [{} for _ in lines]
    try:
        rows = [json.loads(line) for line in lines]
        return [row["prompt"] for row in rows], rows
    except (ValueError, TypeError, KeyError) as error:
        fail(f"every line of {path!r} must be a JSON object with a 'prompt' ({error!r})")


def all_gather_cat(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's equally shaped tensor, concatenated in rank order."""
    if world == 1:
        return tensor
    gathered = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(gathered, tensor.contiguous())
    return torch.cat(gathered)


def seeded_generator(device: torch.device, *keys: int) -> torch.Generator:
    """Seeded from (seed, epoch, rank, ...): resumes exactly, no state saved."""
    seed = np.random.SeedSequence(list(keys)).generate_state(1)[0]
    return torch.Generator(device).manual_seed(int(seed))


@torch.no_grad()
def encode(pipe, prompts: list[str], device, max_sequence_length: int) -> Text:
    embeds, pooled, _ = pipe.encode_prompt(prompts, None, device=device,
                                           max_sequence_length=max_sequence_length)
    return Text(embeds, pooled)


def predict_velocity(transformer, x, sigma, text: Text, img_ids,
                     guidance_scale: float) -> torch.Tensor:
    sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32)
    timestep = torch.floor(sigma.expand(len(x)) * 1000) / 1000
    distilled = transformer.config.guidance_embeds
    guidance = torch.full_like(timestep, guidance_scale) if distilled else None
    return transformer(hidden_states=x, timestep=timestep, guidance=guidance, img_ids=img_ids,
                       encoder_hidden_states=text.embeds, pooled_projections=text.pooled,
                       txt_ids=x.new_zeros(text.embeds.shape[1], 3), return_dict=False)[0].float()


@torch.no_grad()
def ode_sample(velocity, noise, sigmas) -> torch.Tensor:
    """Euler ODE along sigmas: every script's eval sampler, so evals compare."""
    x = noise.float()
    for i in range(len(sigmas) - 1):
        v = velocity(x, sigmas[i])
        x = sde_step(v, x, sigmas[i], sigmas[i + 1], "ode", 0.0)[0]
    return x


@torch.no_grad()
def decode(pipe, latents, resolution: int) -> torch.Tensor:
    latents = pipe._unpack_latents(latents, resolution, resolution, pipe.vae_scale_factor)
    latents = latents.float() / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    return (pipe.vae.decode(latents, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)


def shard_for_full_finetune(transformer):
    transformer.float().requires_grad_(True)
    if not dist.is_initialized():  # one process: one rank
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
        fully_shard(block)
    fully_shard(transformer)


def optimizer_step(optimizer, params, max_grad_norm, world, loss, where, run_dir, sharded):
    if world > 1 and not sharded:  # FSDP2 reduces its own
        flat = torch.nn.utils.parameters_to_vector(p.grad for p in params)
        dist.all_reduce(flat)
        torch.nn.utils.vector_to_parameters(flat / world, [p.grad for p in params])
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    check_finite(where, run_dir, loss=loss, gradient=grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def sharded_state(transformer, optimizer, ema_params) -> dict:
    model, optim = dcp_state.get_state_dict(transformer, optimizer)
    return {"model": model, "optimizer": optim, "ema": dict(zip(model, ema_params))}


def sha256_of(path: str) -> str | None:
    if os.path.isfile(path):  # else None
        with open(path, "rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()


def save_checkpoint(path, transformer, params, ema_params, optimizer, next_epoch,
                    global_step, args, rank: int, metrics: dict):
    """(ema_)lora/ or dcp/ (the last: (ema_)transformer/), state.pt, checksum."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    state = {"next_epoch": next_epoch, "global_step": global_step, "args": asdict(args),
             "metrics": metrics, "script": os.path.basename(__file__)}
    if args.full_finetune:
        dist.checkpoint.save(sharded_state(transformer, optimizer, ema_params),
                             checkpoint_id=f"{tmp}/dcp")
        # all ranks' shards
        shards = sorted(os.listdir(f"{tmp}/dcp")) if rank == 0 else []
        state["dcp_sha256"] = {name: sha256_of(f"{tmp}/dcp/{name}") for name in shards}
        folders = {f"{tmp}/transformer": []} if next_epoch == args.epochs else {}
        if folders and ema_params:
            folders[f"{tmp}/ema_transformer"] = ema_params
        options = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
        for folder, copies in folders.items():
            with swapped(params, copies):  # on rank 0's CPU
                weights = dcp_state.get_model_state_dict(transformer, options=options)
            if rank == 0:  # save_pretrained's layout
                os.makedirs(folder)
                pattern = "diffusion_pytorch_model{suffix}.safetensors"
                huggingface_hub.save_torch_state_dict(weights, folder, filename_pattern=pattern)
                config = {**transformer.config, "_class_name": "FluxTransformer2DModel"}
                with open(f"{folder}/config.json", "w") as file:
                    json.dump(config, file, indent=2)
    elif rank == 0:
        for name, copies in [("lora", []), ("ema_lora", ema_params)]:
            with swapped(params, copies):
                FluxPipeline.save_lora_weights(
                    f"{tmp}/{name}", peft.get_peft_model_state_dict(transformer),
                    transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict())
        state |= {"lora": [p.detach().cpu() for p in params], "ema": [p.cpu() for p in ema_params],
                  "optimizer": optimizer.state_dict()}
    if rank == 0:
        data = io.BytesIO()  # a full disk: an OSError naming it
        torch.save(state, data)
        with open(f"{tmp}/state.pt", "wb") as file:
            file.write(data.getvalue())
        # safetensors 0.8 writes 0600
        for weights in glob.glob(f"{tmp}/*/*.safetensors"):
            shutil.copymode(f"{tmp}/state.pt", weights)
        with open(f"{tmp}/state.pt.sha256", "w") as file:
            file.write(hashlib.sha256(data.getvalue()).hexdigest())
        os.rename(tmp, path)


def prune_checkpoints(run_dir: str, current: str, save_every: int, limit: int | None):
    """Keep current and the newest `limit` (None: all) on the --save-every grid."""
    saves = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "epoch_*")))
    grid = [save for save in saves if int(save[-5:]) % save_every == 0]
    kept = set(grid[-limit:] if limit else grid) | {current}
    for save in set(saves) - kept:
        shutil.rmtree(save)


def write_card(run_dir: str, args, images_per_epoch: int, final=None):
    """Each evaluated checkpoint's cards (docs/model_card.md) and eval sheets.
    final: the last epoch's metrics, unlogged."""
    def score(row, key):  # mean ± standard error; null: NaN
        numbers = [row[key + "reward_mean"], row[key + "reward_stderr"]]
        numbers = [math.nan if x is None else x for x in numbers]
        return "{:.4f} ± {:.4f}".format(*numbers)
    with open(os.path.join(run_dir, "metrics.jsonl")) as file:
        rows = [json.loads(line) for line in file] + [final or {}]
    evals = [(row[key + "sheet"], score(row, key)) for row in rows
             for key in ["eval/", "eval/final_"] if key + "sheet" in row]
    name = os.path.basename(__file__)
    template = os.path.join(os.path.dirname(__file__), "docs", "model_card.md")
    about = " ".join(__doc__[: __doc__.index("Docs:")].split())
    for sheet, after in evals:
        epochs = int(sheet[5:10])  # eval_00060.png
        save = os.path.join(run_dir, "checkpoints", f"epoch_{epochs:05d}")
        if not os.path.isdir(save):  # the base model's, or pruned
            continue
        pushed = args.hub_model_id or f"{save}/ema_lora"
        for folder, where in [("lora", f"{save}/lora"), ("ema_lora", pushed)]:
            card = huggingface_hub.ModelCard.from_template(
                huggingface_hub.ModelCardData(), template, name=name, about=about,
                args=args, before=evals[0][1], after=after, epochs=epochs,
                images=epochs * images_per_epoch, where=where, command=command_line(args))
            card.save(f"{save}/{folder}/README.md")
            shutil.copy(f"{run_dir}/{sheet}", f"{save}/{folder}/eval_sheet.png")


def command_line(args) -> str:
    """The command that trains args again (defaults left out)."""
    defaults = asdict(Args(**TOY) if args.toy else Args())  # --toy shows
    words = ["python", os.path.basename(__file__)]
    for name, value in asdict(args).items():
        flag = "--" + name.replace("_", "-")
        skipped = ["resume", "push_to_hub", "hub_model_id"]
        if value == defaults[name] or name in skipped:
            continue
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{flag[2:]}")
        else:
            values = value if isinstance(value, (tuple, list)) else [value]
            words += [flag, *map(str, values)]
    return shlex.join(words)


@contextmanager
def swapped(params, copies):
    """Swap `copies` (the EMA) into the parameters, in place (FSDP2)."""
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
    """Drop crashed saves, and the saves and metrics lines after start_epoch."""
    folder = os.path.join(run_dir, "checkpoints")
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name[0] == "." or int(name[-5:]) > start_epoch:  # hidden: a crashed save
            shutil.rmtree(os.path.join(folder, name))
    path = os.path.join(run_dir, "metrics.jsonl")
    lines = open(path).readlines() if os.path.exists(path) else []
    if lines and not lines[-1].endswith("\n"):
        say(f"dropping the last line of {path}: a full disk cut it short")
        lines.pop()
    with open(path + ".tmp", "w") as file:
        file.writelines(x for x in lines if json.loads(x)["epoch"] < start_epoch)
    os.replace(path + ".tmp", path)


def contact_sheet(title: str, rows: list) -> Image.Image:
    """A title, then rows: a label over its images (H, W, 3); 640 px wide."""
    columns = max(len(images) for _, images in rows)
    size = max(rows[0][1][0].shape[0], 640 // columns)
    sheet = Image.new("RGB", (size * columns, 24 + len(rows) * (size + 24)), "white")
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default(14)
    draw.text((4, 4), title, "black", font)
    for row, (label, images) in enumerate(rows):
        top = 24 + row * (size + 24)
        draw.text((4, top + 4), label, "black", font)
        for column, image in enumerate(images):
            image = Image.fromarray(image).resize((size, size), Image.NEAREST)
            sheet.paste(image, (column * size, top + 24))
    return sheet


def rank_mean(values: dict[str, float], world: int, device) -> dict[str, float]:
    """Each value's mean over ranks: the run's statistics, not rank 0's."""
    local = torch.tensor([list(values.values())], dtype=torch.float64, device=device)
    return dict(zip(values, all_gather_cat(local, world).mean(0).tolist()))


def clock(device) -> float:
    """Seconds, once the GPU has run its queued work (phase timings)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def check_finite(where: str, run_dir: str, **values):
    saves = glob.glob(os.path.join(run_dir, "checkpoints", "epoch_*"))
    for name, value in values.items():
        if not torch.isfinite(torch.as_tensor(value)).all():
            fail(f"non-finite {name} at {where}; stopping. Last checkpoint: "
                 f"{max(saves, default='none saved yet')}")


def stop(reason: str, run_dir: str, code: int = 1):
    """End at once, queued rewards dropped: the run is in its checkpoints."""
    saves = glob.glob(os.path.join(run_dir, "checkpoints", "epoch_*"))
    say(f"{reason}; --resume latest continues from {max(saves, default='none saved yet')}")
    rewards.cancelled.set()
    os._exit(code)


def log(metrics: dict, epoch: int, run_dir: str, track: bool):
    if os.environ.get("RANK", "0") != "0":
        return
    strict = {name: None if isinstance(value, float) and not math.isfinite(value)
              else value for name, value in metrics.items()}  # JSON has no NaN
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as file:
        file.write(json.dumps({"epoch": epoch, **strict}) + "\n")
    if track:  # the eval sheets as images
        import wandb
        sheets = {name: wandb.Image(os.path.join(run_dir, value))
                  for name, value in metrics.items() if name.endswith("sheet")}
        wandb.log(metrics | sheets, step=epoch)


@torch.no_grad()
def run_eval(epoch: int, prefix: str = "eval/", saved: str | None = None, *, args, pipe,
             velocity, params, ema_params, eval_sigmas, latent_shape,
             eval_reward_fn, test_prompts, test_meta, run_dir) -> dict:
    """Score ODE samples of the EMA or LoRA folder `saved`: prompt i, seed s."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = params[0].device
    if saved and not args.full_finetune:  # FSDP2's: in memory
        with warnings.catch_warnings(action="ignore"):
            pipe.load_lora_weights(saved, adapter_name="saved")
    items = [(i, seed) for seed in args.eval_seeds for i in range(len(test_prompts))]
    by_prompt = {}  # test prompt -> its items
    for item in items:
        by_prompt.setdefault(test_prompts[item[0]], []).append(item)
    shown = [item for row in list(by_prompt.values())[:4] for item in row[:4]]
    results = {}  # item -> scores, 32x32 thumbnail, image
    mine = items[rank::world]
    for start in range(0, len(mine), args.eval_batch_size):
        batch = mine[start : start + args.eval_batch_size]
        prompts = [test_prompts[i] for i, _ in batch]
        noise = torch.stack([
            torch.randn(latent_shape, device=device,
                        generator=seeded_generator(device, seed, i))
            for i, seed in batch])
        text = encode(pipe, prompts, device, args.max_sequence_length)
        drift = {}  # none in full fine-tuning
        with swapped(params, ema_params):  # with EMA 0: the weights
            final = ode_sample(partial(velocity, text=text), noise, eval_sigmas)
            if not args.full_finetune:
                moved = velocity(noise, eval_sigmas[0], text)
                pipe.transformer.disable_adapters()
                base = velocity(noise, eval_sigmas[0], text)
                pipe.transformer.enable_adapters()
                drift = (moved - base).flatten(1).norm(dim=1)
                drift = {"lora_drift": drift / base.flatten(1).norm(dim=1)}
        images = decode(pipe, final, args.resolution)
        meta = [test_meta[i] for i, _ in batch]
        try:
            batch_scores, info = eval_reward_fn(images.cpu(), prompts, meta)
        except rewards.RewardError as error:
            stop(f"error: {error} in the eval after {epoch} epochs", run_dir)
        columns = {"reward_mean": batch_scores, **drift, **info}
        pixels = (images.permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
        small = torch.nn.functional.interpolate(images, size=32, mode="area")
        for j, item in enumerate(batch):
            row = {name: float(values[j]) for name, values in columns.items()}
            image = pixels[j] if item in shown else None
            results[item] = (row, small[j].flatten().cpu(), image)
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        results = {item: result for part in gathered for item, result in part.items()}
    rows = [results[item][0] for item in items]
    means = {name: float(np.mean([row[name] for row in rows])) for name in rows[0]}
    values = [row["reward_mean"] for row in rows]
    means["reward_stderr"] = float(np.std(values, ddof=1) / len(rows) ** 0.5)
    groups = [torch.stack([results[item][1] for item in row])
              for row in by_prompt.values()]
    distances = [torch.pdist(group).mean() / group.shape[1] ** 0.5
                 for group in groups if len(group) > 1]
    if distances:  # RMS pixel distance in a prompt
        means["diversity"] = float(torch.stack(distances).mean())
    if rank == 0:  # a row per prompt, its mean reward
        labelled = []
        for text, row in by_prompt.items():
            reward = np.mean([results[item][0]["reward_mean"] for item in row])
            images = [results[item][2] for item in row if item in shown]
            if images:
                labelled.append((f"{reward:.3f}  {text}", images))
        means["sheet"] = f"eval_{epoch:05d}.png"
        score = f"{means['reward_mean']:.4f} ± {means['reward_stderr']:.4f}"
        title = f"{os.path.basename(__file__)} after {epoch} epochs: {score}"
        contact_sheet(title, labelled).save(os.path.join(run_dir, means["sheet"]))
        name = args.eval_reward or args.reward
        print(f"eval after {epoch} epochs: {name} = {means['reward_mean']:.4f}")
        if epoch and means.get("lora_drift") == 0:
            print("WARNING: eval/lora_drift is 0: does the LoRA train?")
    return {prefix + name: value for name, value in means.items()}


if __name__ == "__main__":
    main()
