"""Centered Reward Distillation on Stable Diffusion 3.5 Medium: the LoRA's implicit
reward, centered per prompt, regressed on the centered advantages.

Paper: Centered Reward Distillation (CRD), https://arxiv.org/abs/2603.14128
Docs: docs/crd.md (recipes, metrics, the toy-world demo).

Defaults: the paper's OCR run (Table 3, as upstream's PR #121 maps it), on any
number of GPUs:
    torchrun --nproc_per_node 8 crd_sd35.py --train-prompts ocr/train.txt \
        --test-prompts ocr/test.txt

Provenance: X-GenGroup/Flow-Factory@a0b2bc5 (by the paper's first author):
trainers/crd.py (the loop, the schedules, crd_implicit_reward, crd_loss, the
EMA); the upstream lines of each detail: docs/crd.md.
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
# Without torchvision, transformers warns it uses PIL processors: we do.
logging.getLogger("transformers.utils.import_utils").addFilter(
    lambda record: "requires torchvision" not in record.getMessage())
import diffusers  # noqa: E402 (after the filter)
from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from PIL import Image, ImageDraw, ImageFont
from safetensors import SafetensorError
from tqdm import tqdm

import rewards
from sde import sde_step, shift_sigmas

# The joint-attention projections of every MMDiT block, as flow_grpo, NFT and AWM
LORA_TARGETS = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj",
                "attn.to_add_out", "attn.to_k", "attn.to_out.0", "attn.to_q",
                "attn.to_v")


@dataclass
class Args:
    # The algorithm (defaults: the paper's headline run)
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    """normalise the rewards' weighted sum, or each, then sum (GDPO)"""
    per_group_std: bool = False
    """advantages / their group's std, not the epoch's (upstream's)"""
    group_size: Annotated[int, ">= 2"] = 24
    """images per prompt (a group; its mean reward is the baseline)"""
    num_steps: Annotated[int, ">= 1"] = 10
    """Euler ODE steps per rollout (their sigmas: the training timesteps)"""
    guidance_scale: float = 1.0
    """CFG scale of rollouts, training and eval (1: CRD trains without CFG)"""
    prompts_per_epoch: Annotated[int, ">= 1"] = 48
    """prompts (groups) per epoch, over all GPUs"""
    batch_size: Annotated[int, ">= 1"] = 8
    """per-GPU micro-batch of rollout and training"""
    updates_per_epoch: Annotated[int, ">= 1"] = 2
    """optimizer steps per epoch"""
    num_train_timesteps: Annotated[int, ">= 1"] = 20
    """timesteps per micro-batch (shared by its images), stratified on the grid"""
    adv_clip: Annotated[float, "> 0"] = 5.0
    """advantages: clipped to +-adv_clip, mapped to [0, 1] (see crd_loss)"""
    crd_beta: Annotated[float, "> 0"] = 1.0
    """implicit-reward scale: regress crd_beta (r - r_mean) on a - a_mean"""
    old_decay: tuple[int, float, float, float] = (0, 0.25, 0.005, 0.999)
    """decays S v0 k vmax of the old snapshot, the implicit reward's reference"""
    sampling_decay: tuple[int, float, float, float] = (75, 0.0, 0.0075, 0.999)
    """schedule of the rollout snapshot (decay 0: a copy, on-policy)"""
    kl_beta: float = 0.1
    """weight of the KL to the base model at CFG --kl-cfg (see crd_loss)"""
    kl_cfg: float = 4.5
    """CFG scale of the KL teacher (the base model as used at inference)"""
    ema_decay: Annotated[float, "in [0, 1)"] = 0.995
    """EMA decay of the LoRA for eval and the saved `ema_lora` (0: off)"""
    ema_every: Annotated[int, ">= 1"] = 10
    """the EMA moves every N epochs, its warm-up counts epochs"""
    fp32_master_weights: bool = False
    """LoRA, AdamW state, EMA, snapshots in fp32 (upstream: bf16)"""
    # This recipe's run settings (upstream's values for this algorithm)
    allow_tf32: bool = False
    """TF32 for fp32 matmuls on CUDA (VAE, rewards), as upstream"""
    max_sequence_length: Annotated[int, ">= 1"] = 256
    """T5 tokens per prompt"""
    eval_every: Annotated[int, ">= 1"] = 20
    """evaluate every N epochs (and after the last)"""
    save_every: Annotated[int, ">= 1"] = 20
    """checkpoint every N epochs (and after the last)"""
    # Shared arguments: the same in every SD3.5 script
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
    model: str = "stabilityai/stable-diffusion-3.5-medium"
    """hub id or path of a diffusers StableDiffusion3Pipeline"""
    mixed_precision: Literal["bf16", "fp16", "no"] = "bf16"
    """dtype of the frozen weights (LoRA, VAE: fp32), with autocast"""
    gradient_checkpointing: bool = False
    """recompute activations in backward (less memory, slower)"""
    compile: bool = torch.cuda.is_available()
    """torch.compile each block (~2x faster; on with CUDA)"""
    lora_rank: Annotated[int, ">= 1"] = 32
    """LoRA rank"""
    lora_alpha: Annotated[int, "> 0"] = 64
    """LoRA alpha (scale = alpha / rank)"""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """layers to adapt (peft's target_modules)"""
    train_prompts: str = "prompts/train.txt"
    """a prompt per line, or JSONL: `prompt` and fields for the reward"""
    test_prompts: str = "prompts/test.txt"
    """eval prompts, same format"""
    reward: str = "ocr"
    """rewards.py name, `ocr=1,pickscore=0.5`, or `file.py:fn`"""
    eval_reward: str | None = None
    """eval's reward (None: --reward)"""
    resolution: Annotated[int, ">= 1"] = 512
    """image height and width in pixels"""
    eval_num_steps: Annotated[int, ">= 1"] = 40
    """Euler ODE steps of eval"""
    eval_batch_size: Annotated[int, ">= 1"] = 8
    """per-GPU eval batch"""
    epochs: Annotated[int, ">= 1"] = 1000
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
TOY = dict(model="tests/assets/toy-sd3", train_prompts="tests/assets/toy_train.txt",
           test_prompts="tests/assets/toy_test.txt",
           reward="tests/toy_rewards.py:counting_partial",
           eval_reward="tests/toy_rewards.py:counting", resolution=32,
           max_sequence_length=24, mixed_precision="no", eval_num_steps=10,
           group_size=16, prompts_per_epoch=6, batch_size=16, lora_rank=8,
           lora_alpha=8, num_train_timesteps=5, ema_decay=0.0, learning_rate=3e-3,
           epochs=16, eval_every=4)

# ALGO LOGIC: its schedules, the advantages and the loss


def snapshot_decay(step: int, schedule: tuple) -> float:
    """Upstream's "S-v0-k-vmax" decay: v0 before optimizer step S, then + k a step, <= vmax."""
    start, v0, slope, vmax = schedule
    if step < start:
        return v0
    return min(v0 + (step - start) * slope, vmax)


def blend_snapshot(snapshot, params, decay: float):
    """snapshot <- decay snapshot + (1 - decay) params, in place."""
    decay = min(max(decay, 0.0), 1.0)  # a copy at 0, frozen at 1
    for copy, p in zip(snapshot, params):
        copy.mul_(decay).add_(p.detach(), alpha=1 - decay)


def sigma_grid(num_steps: int, shift: float) -> torch.Tensor:
    """(T+1,) the rollout grid: SD3's shift of linspace(1, 1/T, T), then 0."""
    u = torch.linspace(1, 1 / num_steps, num_steps, dtype=torch.float64)
    return torch.cat([shift_sigmas(u, shift), u.new_zeros(1)]).float()


def train_timesteps(sigmas, count: int, generator) -> torch.Tensor:
    """(count,) of the sigmas, stratified: draw j lies in the j-th of count
    equal strata of the grid."""
    offsets = torch.rand(count, generator=generator, device=generator.device)
    strata = torch.arange(count, device=offsets.device) + offsets
    return sigmas[(strata * len(sigmas) / count).floor().long()]


def compute_advantages(rewards, components, weights, group_ids, aggregation, per_group_std):
    """(reward - group mean) / (std + 1e-4); docs/crd.md, Advantages."""
    def normalised(values, per_group: bool):
        values = values.double()
        count = torch.bincount(group_ids).double()
        centered = values - (torch.bincount(group_ids, values) / count)[group_ids]
        std = values.std(unbiased=False)
        if per_group:
            std = (torch.bincount(group_ids, centered**2) / count).sqrt()[group_ids]
        return (centered / (std + 1e-4)).float()
    if aggregation == "sum" or len(components) <= 1:
        return normalised(rewards, per_group_std)
    summed = sum(weight * normalised(components[name], per_group=True)
                 for name, weight in weights.items())
    return (summed - summed.mean()) / (summed.std(unbiased=False) + 1e-4)


def crd_implicit_reward(v, v_old, target):
    """(B,) -mean(e^2 / w - e_old^2 / w_old) ~ log p(x0) - log p_old(x0), e, e_old the LoRA's
    and old snapshot's flow-matching errors, w their detached mean |e| per image (large errors
    do not dominate)."""
    def scaled_sq_err(velocity):  # e^2 / w
        err = (velocity.double() - target.double()).flatten(1)
        return err**2 / err.detach().abs().mean(1, True).clamp_min(1e-5)
    return -(scaled_sq_err(v) - scaled_sq_err(v_old.detach())).mean(1).float()


def crd_loss(*, implicit_reward, all_implicit_rewards, advantages, group_ids,
             rank, world, v, v_teacher, crd_beta, adv_clip, kl_beta, accum_steps):
    """A micro-step's (loss to backward, {statistic: float}).

    all_implicit_rewards r (detached), advantages A, group_ids: (N,), all ranks'
    micro-batches in rank order; implicit_reward: (B,) this rank's r, with a
    gradient; v, v_teacher: the LoRA's and CFG teacher's velocities (None: no
    KL).
    - a = clip(A, +-adv_clip) / (2 adv_clip) + 0.5, in [0, 1];
    - residuals crd_beta (r - r_mean) - (a - a_mean) per prompt, r_mean
      detached: the optimum's reward beta log(p / p_ref) + beta log Z(c) less
      its prompt's mean loses log Z(c);
    - their mean square x adv_clip / crd_beta: at r = 0 (LoRA == old), r_i's
      gradient is -(clip(A_i) - its prompt's mean) / N, the advantage;
    - x world: a rank backpropagates its B of the N; optimizer_step averages the
      ranks;
    - + kl_beta x the KL (B,) to the teacher, weighted by floor + a (1 - floor),
      floor = 1e-4 / kl_beta: good images stay near it; the sum / accum_steps.
    """
    targets = advantages.clamp(-adv_clip, adv_clip) / (2 * adv_clip) + 0.5
    batch = len(implicit_reward)
    mine = rank * batch + torch.arange(batch, device=implicit_reward.device)
    r_theta = all_implicit_rewards.index_copy(0, mine, implicit_reward)
    policy_loss = r_theta.new_zeros(())
    for group in group_ids.unique():
        r_group = r_theta[group_ids == group]
        a_group = targets[group_ids == group]
        r_centered = r_group - r_group.mean().detach()
        residuals = crd_beta * r_centered - (a_group - a_group.mean())
        policy_loss = policy_loss + (residuals**2).sum()
    policy_loss = policy_loss / len(r_theta) * adv_clip / crd_beta
    kl_loss = policy_loss.new_zeros(())
    kl = None
    if v_teacher is not None:
        kl = ((v - v_teacher) ** 2).mean(dim=tuple(range(1, v.dim())))  # (B,)
        floor = 1e-4 / kl_beta
        weight = floor + targets[mine] * (1 - floor)
        kl_loss = kl_beta * (weight * kl).mean()
    stats = {"policy_loss": policy_loss.item(), "kl_loss": kl_loss.item(),
             "r_theta": implicit_reward.mean().item()}
    if kl is not None:
        stats["kl"] = kl.mean().item()
    loss = (world * policy_loss + kl_loss) / accum_steps
    return loss, stats


def main():
    """The run. A shared block's tag names what it reads ("reads")."""
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
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    quiet = rank != 0 or not sys.stderr.isatty()
    if quiet:  # the model-loading bars too
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()  # e.g. every truncated prompt
    try:  # a bad reward file or a silent server fails here
        rewards.check_prompts(args.reward, train_prompts)
        rewards.check_prompts(args.eval_reward or args.reward, test_prompts)
        reward_fn = rewards.build_reward(args.reward, device=device)
        eval_reward_fn = reward_fn
        if args.eval_reward:
            eval_reward_fn = rewards.build_reward(args.eval_reward, device=device)
    except ValueError as error:
        fail(str(error))
    images_per_epoch = args.prompts_per_epoch * args.group_size
    if images_per_epoch % (world * args.batch_size):
        fail(f"prompts-per-epoch x group-size = {images_per_epoch} images do not split "
             f"into {world} GPUs x --batch-size {args.batch_size}")
    num_batches = images_per_epoch // world // args.batch_size  # this rank's
    run_dir = None
    parent = os.path.dirname(os.path.abspath(args.resume or "."))
    if args.resume and not args.eval_only and os.path.basename(parent) == "checkpoints":
        run_dir = os.path.dirname(parent)  # a resume goes on in its run

    # ALGO LOGIC: images to optimizer steps (docs/crd.md: a step's images)
    if num_batches % args.updates_per_epoch:
        fail(f"{num_batches} micro-batches per GPU per epoch do not split "
             f"into --updates-per-epoch {args.updates_per_epoch}")
    if math.gcd(args.group_size, args.batch_size) < 2:
        fail(f"--group-size {args.group_size} and --batch-size {args.batch_size} leave "
             "a single image of a prompt in some micro-step; give them a common factor")
    accum_steps = num_batches // args.updates_per_epoch * args.num_train_timesteps
    if not args.eval_only:
        say(f"{world} process(es) x {num_batches} micro-batches x {args.batch_size} = "
            f"{images_per_epoch} images/epoch; {args.updates_per_epoch} updates/epoch "
            f"of {accum_steps} micro-steps each")

    # TRY NOT TO MODIFY: the model: frozen base in bf16/fp16, LoRA in fp32
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}
    dtype = dtypes[args.mixed_precision]
    pipe = StableDiffusion3Pipeline.from_pretrained(
        args.model, dtype={"default": dtype, "vae": torch.float32}).to(device)
    transformer = pipe.transformer
    transformer.requires_grad_(False)
    torch.manual_seed(args.seed)  # the LoRA init, alike on all ranks
    transformer.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                                       init_lora_weights="gaussian",
                                       target_modules=list(args.lora_targets)))
    lora_params = [p for p in transformer.parameters() if p.requires_grad]
    for p in lora_params:
        p.data = p.data.float()
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if args.compile:  # regional: each block on its own
        torch._dynamo.config.recompile_limit = 64
        for block in transformer.transformer_blocks:
            block.compile(dynamic=False)
    optimizer = torch.optim.AdamW(lora_params, lr=args.learning_rate,
                                  weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(enabled=args.mixed_precision == "fp16")
    ema_params = [p.detach().clone() for p in lora_params]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    latent_size = args.resolution // pipe.vae_scale_factor
    latent_shape = (transformer.config.in_channels, latent_size, latent_size)
    negative = encode(pipe, [""], device, args.max_sequence_length)  # CFG's, once

    def velocity(x, sigma, text: Text, guidance_scale=args.guidance_scale):
        with autocast:
            return predict_velocity(transformer, x, sigma, text, negative, guidance_scale)

    # ALGO LOGIC: upstream's bf16 master weights; the sigma grids, the LoRA snapshots
    if args.mixed_precision != "no" and not args.fp32_master_weights:
        for p in lora_params + ema_params:  # AdamW's state follows
            p.data = p.data.bfloat16()
    shift = pipe.scheduler.config.shift
    sigmas = sigma_grid(args.num_steps, shift).to(device)
    eval_sigmas = sigma_grid(args.eval_num_steps, shift).to(device)
    snapshots = {name: [p.detach().clone() for p in lora_params]
                 for name in ("old", "sampling")}

    # TRY NOT TO MODIFY: resume, run dir, eval; reads snapshots, eval_sigmas
    start_epoch = 0
    global_step = 0
    if state is not None:
        saved = state["lora"] + state["ema"] + sum(state["extra"].values(), [])
        for p, value in zip(lora_params + ema_params + sum(snapshots.values(), []), saved):
            p.data.copy_(value)
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["next_epoch"]
        global_step = state["global_step"]
    if rank == 0 and run_dir is None:  # made only now: a failed start leaves none
        name = f"{args.exp_name}__{args.seed}__{int(time.time())}_"
        run_dir = tempfile.mkdtemp(prefix=name, dir=args.output_dir)  # unique
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
    evaluate = partial(run_eval, args=args, pipe=pipe, velocity=velocity,
                       lora_params=lora_params, ema_params=ema_params,
                       eval_sigmas=eval_sigmas, latent_shape=latent_shape,
                       eval_reward_fn=eval_reward_fn, test_prompts=test_prompts,
                       test_meta=test_meta, run_dir=run_dir)
    if args.eval_only:
        log(evaluate(start_epoch), start_epoch, run_dir, args.track)
    executor = ThreadPoolExecutor(max_workers=1)  # scores while sampling goes on
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

        # ALGO LOGIC: sampling by ode_sample; rank k's batch s: images (k S + s) B + [0, B)
        image_ids = torch.arange(images_per_epoch).view(world, num_batches, -1)
        image_ids = image_ids.transpose(0, 1)  # (S, W, B): upstream's group_contiguous
        group_ids = image_ids.transpose(0, 1).flatten() // args.group_size
        my_groups = group_ids.view(world, num_batches, -1)[rank]
        noise_gen = seeded_generator(device, args.seed, epoch, rank)
        transformer.eval()
        batches = []  # (Text, x0) of each micro-batch
        futures = []  # their rewards
        for groups in tqdm(my_groups, f"epoch {epoch} sampling", disable=quiet, leave=False):
            text = Text(epoch_text.embeds[groups], epoch_text.pooled[groups])
            noise = torch.randn((args.batch_size, *latent_shape),
                                generator=noise_gen, device=device)
            with swapped(lora_params, snapshots["sampling"]):
                x0 = ode_sample(partial(velocity, text=text), noise, sigmas)
            images = decode(pipe.vae, x0).cpu()
            prompts = [epoch_prompts[group] for group in groups]
            meta = [epoch_meta[group] for group in groups]
            futures.append(executor.submit(reward_fn, images, prompts, meta))
            batches.append((text, x0))

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
        extras = {f"reward/{name}": values.mean().item()  # e.g. pickscore_raw
                  for name, values in info.items() if name not in reward_fn.weights}
        extras = rank_mean(extras, world, device)
        if reward_fn.group_transform is not None:  # e.g. ranks within each group
            all_rewards, all_components = reward_fn.group_transform(all_components, group_ids)
        check_finite(f"epoch {epoch}", run_dir, reward=all_rewards)
        group_std = torch.stack([all_rewards[group_ids == group].std(unbiased=False)
                                 for group in group_ids.unique()])
        training_start = clock(device)

        # ALGO LOGIC: the advantages; training. Row s of (S, W*B): all ranks' batch s
        advantages = compute_advantages(all_rewards, all_components, reward_fn.weights,
                                        group_ids, args.advantage_aggregation, args.per_group_std)
        step_advantages = advantages.view(world, num_batches, -1)
        step_advantages = step_advantages.transpose(0, 1).flatten(1).to(device)
        step_groups = (image_ids.flatten(1) // args.group_size).to(device)
        transformer.train()
        time_gen = seeded_generator(device, args.seed, epoch, 1)  # timesteps: all ranks
        train_gen = seeded_generator(device, args.seed, epoch, rank, 1)  # noise: a rank's
        stats = defaultdict(list)  # a value per micro-step
        micro_step = 0
        progress = tqdm(batches, f"epoch {epoch} training", disable=quiet, leave=False)
        for index, (text, x0) in enumerate(progress):
            for sigma in train_timesteps(sigmas[:-1], args.num_train_timesteps, time_gen):
                noise = torch.randn(x0.shape, generator=train_gen, device=device)
                x_t = (1 - sigma) * x0 + sigma * noise
                target = noise - x0  # the flow-matching velocity
                with torch.no_grad(), swapped(lora_params, snapshots["old"]):
                    v_old = velocity(x_t, sigma, text)
                v_teacher = None  # the base model with CFG, for the KL
                if args.kl_beta > 0:
                    with torch.no_grad(), adapters_disabled(transformer):
                        v_teacher = velocity(x_t, sigma, text, args.kl_cfg)
                v = velocity(x_t, sigma, text)
                implicit_reward = crd_implicit_reward(v, v_old, target)
                gathered = all_gather_cat(implicit_reward.detach(), world)
                loss, step_stats = crd_loss(
                    implicit_reward=implicit_reward,
                    all_implicit_rewards=gathered,
                    advantages=step_advantages[index],
                    group_ids=step_groups[index], rank=rank, world=world,
                    v=v, v_teacher=v_teacher, crd_beta=args.crd_beta,
                    adv_clip=args.adv_clip, kl_beta=args.kl_beta,
                    accum_steps=accum_steps)
                scaler.scale(loss).backward()
                if micro_step == 0:  # exactly 0 while the old snapshot is the LoRA
                    metrics["losses/first_r_theta_abs"] = implicit_reward.abs().max().item()
                for name, value in step_stats.items():
                    stats[name].append(value)
                micro_step += 1
                if micro_step % accum_steps == 0:
                    grad_norm = optimizer_step(
                        optimizer, scaler, lora_params, args.max_grad_norm, world,
                        loss, f"epoch {epoch}, step {global_step}", run_dir)
                    global_step += 1
        # Upstream's EMAModuleWrapper, every ema_every epochs (warm-up: epochs); 0: the LoRA
        if (epoch + 1) % args.ema_every == 0 or args.ema_decay == 0:
            decay = min(args.ema_decay, (1 + epoch) / (10 + epoch))
            blend_snapshot(ema_params, lora_params, decay)
        decays = {"old": snapshot_decay(global_step, args.old_decay),
                  "sampling": snapshot_decay(global_step, args.sampling_decay)}
        for name, decay in decays.items():
            blend_snapshot(snapshots[name], lora_params, decay)

        # ALGO LOGIC: the algorithm's metrics, its part of the summary line
        losses = {f"losses/{name}": float(np.mean(values))
                  for name, values in stats.items()}
        metrics.update(rank_mean(losses, world, device))
        for name, decay in decays.items():
            metrics[f"charts/{name}_decay"] = decay
        kl = metrics.get("losses/kl", 0.0)  # none without a KL
        summary = (f"policy {metrics['losses/policy_loss']:.3e} "
                   f"kl {kl:.3e} | r_theta {metrics['losses/r_theta']:.1e} "
                   f"| old decay {decays['old']:.3f}")

        # TRY NOT TO MODIFY: the line, checkpoint; reads grad_norm, summary, snapshots
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
        try:  # each epoch: a preemption loses one at most
            if not last:  # before its checkpoint: a resume redoes it whole
                log(metrics, epoch, run_dir, args.track)
            if rank == 0:
                save_checkpoint(path, transformer, lora_params, ema_params, snapshots,
                                optimizer, epoch + 1, global_step, args, metrics)
                prune_checkpoints(run_dir, path, args.save_every, args.checkpoints_total_limit)
                if not last:  # the last's waits for the final eval
                    write_card(run_dir, args, images_per_epoch)
        except (OSError, SafetensorError) as error:
            stop(f"error: {error} (saving epoch {epoch + 1})", run_dir)
        if world > 1:
            dist.barrier()

    # TRY NOT TO MODIFY: the final eval of the saved file, card, push, line
    if not args.eval_only:
        path = os.path.join(run_dir, "checkpoints", f"epoch_{args.epochs:05d}")
        metrics.update(evaluate(args.epochs, "eval/final_", f"{path}/ema_lora"))
        try:
            if rank == 0:
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
    """T5 + CLIP tokens (B, L, 4096), pooled CLIP (B, 2048)."""
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
    """Checks that need no weights; the checkpoint's state if resuming."""
    state = None
    if args.resume == "latest":  # torchrun --max-restarts: start or go on
        runs = os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__*")
        saves = glob.glob(os.path.join(runs, "checkpoints", "epoch_*"))
        args.resume = None  # sorted by start time, then epoch
        for save in sorted(saves, reverse=True):
            state = load_state(save)
            if isinstance(state, dict):
                args.resume = save
                break
            say(f"skipping {save}: {state}")
    elif args.resume:
        state = load_state(args.resume)
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
    if args.mixed_precision == "fp16" and not torch.cuda.is_available():
        fail("--mixed-precision fp16 needs a GPU (on CPU: bf16 or no)")
    try:  # found now, not after the model loads
        os.makedirs(args.output_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=args.output_dir).close()
    except OSError as error:
        fail(f"--output-dir {args.output_dir!r}: {error.strerror}")
    try:  # configs only, before the weights
        vae = AutoencoderKL.load_config(args.model, subfolder="vae")
        dit = SD3Transformer2DModel.load_config(args.model, subfolder="transformer")
    except Exception as error:
        fail(f"model {args.model!r}: no local pipeline directory, no hub answer "
             f"({type(error).__name__}; offline? gated: hf auth login)")
    factor = 2 ** (len(vae["block_out_channels"]) - 1) * dit.get("patch_size", 1)
    if args.resolution % factor:
        fail(f"--resolution {args.resolution} is not a positive multiple of {factor} "
             "(VAE downsampling x patch size)")
    with torch.device("meta"):  # the layers' names, not their weights
        names = [f".{name}" for name, _ in SD3Transformer2DModel.from_config(dit).named_modules()]
    for target in args.lora_targets:  # matched as peft does
        if not any(name.endswith(f".{target}") for name in names):
            fail(f"--lora-targets {target} names no layer of {args.model}")
    if args.track and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        import wandb
        if not wandb.login(prompt=False):
            fail("--track needs a wandb login (`wandb login` or WANDB_API_KEY), "
                 "or WANDB_MODE=offline")
    if args.push_to_hub and not args.eval_only:
        try:
            user = huggingface_hub.whoami()["name"]
        except Exception as error:  # no token, offline, no answer
            fail(f"--push-to-hub needs a Hub login (hf auth login): {type(error).__name__}")
        args.hub_model_id = args.hub_model_id or f"{user}/{args.exp_name}"
    if not args.resume:
        return None
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
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompts, None, None, device=device, do_classifier_free_guidance=False,
        max_sequence_length=max_sequence_length)
    return Text(embeds, pooled)


def predict_velocity(transformer, x, sigma, text: Text, negative: Text,
                     guidance_scale: float) -> torch.Tensor:
    """CFG's velocity u + g (c - u) at sigma (a float or (B,)), one forward."""
    cfg = guidance_scale != 1.0
    timestep = 1000 * torch.as_tensor(sigma, device=x.device, dtype=torch.float32).expand(len(x))
    embeds, pooled = text
    if cfg:
        x = torch.cat([x, x])
        timestep = torch.cat([timestep, timestep])
        embeds = torch.cat([negative.embeds.expand_as(embeds), embeds])
        pooled = torch.cat([negative.pooled.expand_as(pooled), pooled])
    v = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds,
                    pooled_projections=pooled, return_dict=False)[0].float()
    if not cfg:
        return v
    v_uncond, v_cond = v.chunk(2)
    return v_uncond + guidance_scale * (v_cond - v_uncond)


@torch.no_grad()
def ode_sample(velocity, noise, sigmas) -> torch.Tensor:
    """Euler ODE along sigmas: every script's eval sampler, so evals compare."""
    x = noise.float()
    for i in range(len(sigmas) - 1):
        v = velocity(x, sigmas[i])
        x = sde_step(v, x, sigmas[i], sigmas[i + 1], "ode", 0.0)[0]
    return x


@torch.no_grad()
def decode(vae, latents) -> torch.Tensor:
    """Latents -> images (B, 3, H, W) in [0, 1], decoded in fp32."""
    latents = latents.float() / vae.config.scaling_factor + vae.config.shift_factor
    return (vae.decode(latents, return_dict=False)[0] / 2 + 0.5).clamp(0, 1)


def optimizer_step(optimizer, scaler, params, max_grad_norm, world, loss, where, run_dir):
    if world > 1:
        flat = torch.nn.utils.parameters_to_vector(p.grad for p in params)
        dist.all_reduce(flat)
        torch.nn.utils.vector_to_parameters(flat / world, [p.grad for p in params])
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)  # before the clip
    if not scaler.is_enabled():  # fp16's scaler skips non-finite steps itself
        check_finite(where, run_dir, loss=loss, gradient=grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def save_checkpoint(path, transformer, lora_params, ema_params, snapshots,
                    optimizer, next_epoch, global_step, args, metrics):
    """lora/, ema_lora/ (diffusers LoRAs), state.pt (metrics: the epoch's,
    for a relaunch) and its checksum, written last; then renamed."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, copies in [("lora", []), ("ema_lora", ema_params)]:
        with swapped(lora_params, copies):  # [] swaps nothing in
            StableDiffusion3Pipeline.save_lora_weights(
                os.path.join(tmp, name), get_peft_model_state_dict(transformer),
                transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict())
    extra = {name: [p.cpu() for p in copies] for name, copies in snapshots.items()}
    state = io.BytesIO()  # Python writes it: a full disk is an OSError naming it
    torch.save({"lora": [p.detach().cpu() for p in lora_params],
                "ema": [p.cpu() for p in ema_params],
                "optimizer": optimizer.state_dict(), "next_epoch": next_epoch,
                "global_step": global_step, "args": asdict(args), "extra": extra,
                "metrics": metrics, "script": os.path.basename(__file__)}, state)
    with open(f"{tmp}/state.pt", "wb") as file:
        file.write(state.getvalue())
    for name in ["lora", "ema_lora"]:  # safetensors' are private
        weights = f"{tmp}/{name}/pytorch_lora_weights.safetensors"
        shutil.copymode(f"{tmp}/state.pt", weights)
    with open(f"{tmp}/state.pt.sha256", "w") as file:
        file.write(hashlib.sha256(state.getvalue()).hexdigest())
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
    """Swap `copies` (the EMA, a snapshot) into the parameters, and back."""
    for p, copy in zip(params, copies):
        p.data, copy.data = copy.data, p.data
    try:
        yield
    finally:
        for p, copy in zip(params, copies):
            p.data, copy.data = copy.data, p.data


@contextmanager
def adapters_disabled(transformer):
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


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
             velocity, lora_params, ema_params, eval_sigmas, latent_shape,
             eval_reward_fn, test_prompts, test_meta, run_dir) -> dict:
    """Score ODE samples of the EMA or LoRA folder `saved`: prompt i, seed s."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = lora_params[0].device
    if saved:
        with warnings.catch_warnings(action="ignore"):
            pipe.load_lora_weights(saved, adapter_name="saved")
    items = [(i, seed) for seed in args.eval_seeds for i in range(len(test_prompts))]
    by_prompt = {}  # test prompt -> its items
    for item in items:
        by_prompt.setdefault(test_prompts[item[0]], []).append(item)
    shown = [item for row in list(by_prompt.values())[:4] for item in row[:4]]
    pipe.transformer.eval()  # as in sampling: compiled graphs depend on the mode
    results = {}  # item -> its scores, 32x32 thumbnail, image if shown
    mine = items[rank::world]
    for start in range(0, len(mine), args.eval_batch_size):
        batch = mine[start : start + args.eval_batch_size]
        prompts = [test_prompts[i] for i, _ in batch]
        noise = torch.stack([
            torch.randn(latent_shape, device=device,
                        generator=seeded_generator(device, seed, i))
            for i, seed in batch])
        text = encode(pipe, prompts, device, args.max_sequence_length)
        with swapped(lora_params, ema_params):
            final = ode_sample(partial(velocity, text=text), noise, eval_sigmas)
            moved = velocity(noise, eval_sigmas[0], text)
        with adapters_disabled(pipe.transformer):
            base = velocity(noise, eval_sigmas[0], text)
        drift = (moved - base).flatten(1).norm(dim=1) / base.flatten(1).norm(dim=1)
        images = decode(pipe.vae, final)
        meta = [test_meta[i] for i, _ in batch]
        try:
            batch_scores, info = eval_reward_fn(images.cpu(), prompts, meta)
        except rewards.RewardError as error:
            stop(f"error: {error} in the eval after {epoch} epochs", run_dir)
        columns = {"reward_mean": batch_scores, "lora_drift": drift, **info}
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
    if distances:  # RMS pixel distance of two samples of one prompt
        means["diversity"] = float(torch.stack(distances).mean())
    if rank == 0:  # a row per prompt, labelled with its mean reward
        labelled = []
        for text, row in by_prompt.items():
            reward = np.mean([results[item][0]["reward_mean"] for item in row])
            images = [results[item][2] for item in row if item in shown]
            if images:
                labelled.append((f"{reward:.3f}  {text}", images))
        path = os.path.join(run_dir, f"eval_{epoch:05d}.png")
        score = f"{means['reward_mean']:.4f} ± {means['reward_stderr']:.4f}"
        title = f"{os.path.basename(__file__)} after {epoch} epochs: {score}"
        contact_sheet(title, labelled).save(path)
        name = args.eval_reward or args.reward
        print(f"eval after {epoch} epochs: {name} = {means['reward_mean']:.4f}")
        if epoch and not means["lora_drift"]:
            print("WARNING: eval/lora_drift is 0: does the LoRA train?")
        means["sheet"] = os.path.basename(path)
    return {prefix + name: value for name, value in means.items()}


if __name__ == "__main__":
    main()
