"""Speed, memory and MFU of the SD3.5 scripts' rollout loop and training micro-steps, on random weights.

Nothing is downloaded: `--arch sd35m` builds SD3.5-Medium's transformer and VAE from their public configs (written
below) with random weights; `--arch tiny` uses tests/tiny.py's pipeline (CPU: only the ratios mean anything).
Text encoders are not needed: every measurement feeds random prompt embeddings of the real shapes.

    python benchmarks/throughput.py --arch tiny --device cpu                  # ratios, seconds on a laptop
    python benchmarks/throughput.py --arch sd35m --device cuda --variants base grad-ckpt compile   # on a GPU

Measured in one run, so ratios compare like with like:
- rollout: images/s of grpo_sd35.rollout + decode vs StableDiffusion3Pipeline.__call__ (same batch, steps, CFG,
  resolution, dtype, latents), and the ratio ours / diffusers;
- train micro-step, GRPO: CFG forward + backward through both branches, log-prob of the stored next latent, and a
  no-grad reference forward with LoRA disabled (what grpo_sd35.py does per (micro-batch, step));
- train micro-step, forward-process (NFT/AWM/CRD): one no-CFG forward + backward plus two no-grad forwards (the
  old/anchor/teacher velocities), the common cost shape of those scripts;
- MFU: FLOPs counted by torch.utils.flop_counter on the very same calls, over time, against a dense matmul peak
  measured in this run on this device with the same dtype;
- options: base weights in fp32 instead of bf16, gradient checkpointing, torch.compile (and whether the on-policy
  ratio stays exactly 1 when both rollout and training run the compiled model).
"""

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from peft import LoraConfig
from torch.utils.flop_counter import FlopCounterMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
from grpo_sd35 import LORA_TARGETS, adapters_disabled, decode, predict_velocity, rollout  # noqa: E402
from sde import sde_step  # noqa: E402

# stabilityai/stable-diffusion-3.5-medium transformer/config.json and vae/config.json (public)
SD35M_TRANSFORMER = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                         num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                         pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384, qk_norm="rms_norm",
                         dual_attention_layers=tuple(range(13)))
SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
               down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
               layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
               use_quant_conv=False, use_post_quant_conv=False)


@dataclass
class Args:
    arch: Literal["tiny", "sd35m"] = "tiny"
    """tiny: tests/tiny.py's pipeline; sd35m: SD3.5-Medium's architecture with random weights"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """torch device"""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """dtype of the frozen base weights (LoRA stays fp32; autocast as in the scripts)"""
    batch_size: int = 9
    """micro-batch (the paper's per-GPU 9)"""
    resolution: int | None = None
    """pixels; None = 512 for sd35m, 32 for tiny"""
    num_steps: int = 10
    """rollout steps"""
    guidance_scale: float = 4.5
    """CFG scale"""
    text_tokens: int = 205
    """prompt tokens: 77 CLIP + 128 T5, as the scripts"""
    lora_rank: int = 32
    """LoRA rank on the 8 joint-attention projections"""
    repeats: int = 3
    """timed repeats after one warm-up (the median is reported)"""
    variants: list[str] = field(default_factory=lambda: ["base", "other-dtype", "grad-ckpt"])
    """settings to measure: base (--dtype), other-dtype (bf16 <-> fp32 base weights), grad-ckpt, compile"""


def timed(fn, repeats: int, device) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def flops_of(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def matmul_peak(device, dtype) -> float:
    """Dense matmul FLOP/s measured here: the denominator of MFU."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, 5, device)


def build(args, device, dtype):
    if args.arch == "tiny":
        from tiny import build_tiny_sd3

        pipe = StableDiffusion3Pipeline.from_pretrained(build_tiny_sd3(tempfile.mkdtemp()), text_encoder=None,
                                                        text_encoder_2=None, text_encoder_3=None, tokenizer=None,
                                                        tokenizer_2=None, tokenizer_3=None, dtype=dtype)
    else:
        with torch.device(device):  # random init directly on the device: seconds instead of minutes on a CPU
            transformer, vae = SD3Transformer2DModel(**SD35M_TRANSFORMER).to(dtype), AutoencoderKL(**SD3_VAE)
        pipe = StableDiffusion3Pipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                        text_encoder_3=None, tokenizer_3=None)
    pipe.vae.to(torch.float32)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.requires_grad_(False)
    torch.manual_seed(0)
    pipe.transformer.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                            init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    lora = [p for p in pipe.transformer.parameters() if p.requires_grad]
    for p in lora:
        p.data = p.data.float()
    return pipe, lora


def main(args: Args):
    device = torch.device(args.device)
    res = args.resolution or (512 if args.arch == "sd35m" else 32)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"batch {args.batch_size}, {res} px, {args.num_steps} steps, CFG {args.guidance_scale}\n")
    print("| setting | rollout img/s (ours) | rollout img/s (diffusers) | time ours/diffusers | GRPO step samples/s | "
          "GRPO step peak GiB | fwd-process step samples/s | rollout MFU | GRPO step MFU | on-policy max abs(ratio-1) |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    other = "fp32" if args.dtype == "bf16" else "bf16"
    settings = {"base": (args.dtype, False, False), "other-dtype": (other, False, False),
                "grad-ckpt": (args.dtype, True, False), "compile": (args.dtype, False, True)}
    variants = [settings[v] for v in args.variants]
    for base_dtype, checkpointing, compiled in variants:  # (base weight dtype, gradient checkpointing, torch.compile)
        dtype = torch.bfloat16 if base_dtype == "bf16" else torch.float32
        pipe, lora = build(args, device, dtype)
        tr = pipe.transformer
        if checkpointing:
            tr.enable_gradient_checkpointing()
        model = torch.compile(tr) if compiled else tr
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        cfg = tr.config
        h = res // pipe.vae_scale_factor
        B = args.batch_size
        gen = torch.Generator(device).manual_seed(0)
        noise = torch.randn(B, cfg.in_channels, h, h, device=device, generator=gen)
        embeds = torch.randn(B, args.text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype, generator=gen)
        pooled = torch.randn(B, cfg.pooled_projection_dim, device=device, dtype=dtype, generator=gen)
        neg = (embeds[:1].clone(), pooled[:1].clone())
        pipe.scheduler.set_timesteps(args.num_steps, device=device)
        sigmas = pipe.scheduler.sigmas.float()

        def ours():
            latents, _ = rollout(model, noise, sigmas, "flow", 0.7, embeds, pooled, *neg, args.guidance_scale,
                                 autocast, gen)
            return decode(pipe.vae, latents[:, -1])

        def diffusers_call():
            latents = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=neg[0].expand_as(embeds),
                        negative_pooled_prompt_embeds=neg[1].expand_as(pooled), latents=noise.to(dtype), height=res,
                        width=res, num_inference_steps=args.num_steps, guidance_scale=args.guidance_scale,
                        output_type="latent").images
            return decode(pipe.vae, latents)  # the same fp32 decode as ours (the pipeline would decode in its dtype)

        latents, old_lp = rollout(model, noise, sigmas, "flow", 0.7, embeds, pooled, *neg, args.guidance_scale,
                                  autocast, gen)

        def grpo_step():
            with autocast:
                v = predict_velocity(model, latents[:, 0], sigmas[0], embeds, pooled, *neg, args.guidance_scale)
            _, lp, mean, _ = sde_step(v, latents[:, 0], sigmas[0], sigmas[1], "flow", 0.7, prev_sample=latents[:, 1],
                                      sigma_max=sigmas[1])
            with torch.no_grad(), adapters_disabled(tr), autocast:
                v_ref = predict_velocity(model, latents[:, 0], sigmas[0], embeds, pooled, *neg, args.guidance_scale)
            loss = -torch.exp(lp - old_lp[:, 0]).mean() + ((v - v_ref) ** 2).mean()
            loss.backward()
            return lp

        def forward_process_step():
            xt = 0.5 * latents[:, -1] + 0.5 * noise
            with torch.no_grad(), autocast:
                v_old = predict_velocity(model, xt, 0.5, embeds, pooled, *neg, 1.0)
                with adapters_disabled(tr):
                    v_ref = predict_velocity(model, xt, 0.5, embeds, pooled, *neg, 1.0)
            with autocast:
                v = predict_velocity(model, xt, 0.5, embeds, pooled, *neg, 1.0)
            (((v - v_old) ** 2).mean() + ((v - v_ref) ** 2).mean()).backward()

        label = f"{args.arch} base={base_dtype}" + (" +grad-ckpt" if checkpointing else "") + (" +compile" if compiled else "")
        peak = matmul_peak(device, dtype)
        t_ours, t_diff = timed(ours, args.repeats, device), timed(diffusers_call, args.repeats, device)
        count_flops = device.type == "cuda" and not compiled  # tiny CPU matmuls make a peak-based MFU meaningless
        rollout_flops = flops_of(ours) if count_flops else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            t_grpo = timed(grpo_step, args.repeats, device)
            mem_grpo = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
            grpo_flops = flops_of(grpo_step) if count_flops else None
            ratio_dev = (torch.exp(grpo_step().detach() - old_lp[:, 0]) - 1).abs().max().item()
        except torch.OutOfMemoryError:  # reported as such: the paper micro-batch may need --gradient-checkpointing
            t_grpo, mem_grpo, grpo_flops, ratio_dev = float("inf"), float("inf"), None, float("nan")
            for p in lora:
                p.grad = None
            torch.cuda.empty_cache()
        t_fp = timed(forward_process_step, args.repeats, device)
        for p in lora:
            p.grad = None
        r = (label, B / t_ours, B / t_diff, t_ours / t_diff, B / t_grpo, mem_grpo, B / t_fp,
             rollout_flops / t_ours / peak if rollout_flops else float("nan"),
             grpo_flops / t_grpo / peak if grpo_flops else float("nan"), ratio_dev)
        print(f"| {r[0]} | {r[1]:.3g} | {r[2]:.3g} | {r[3]:.3f} | {r[4]:.3g} | {r[5]:.3g} | {r[6]:.3g} | {r[7]:.3g} | "
              f"{r[8]:.3g} | {r[9]:.1e} |", flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
