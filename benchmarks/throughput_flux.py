"""Speed, memory and MFU of dance_grpo_flux.py's rollout loop and training micro-step, on random FLUX weights.

`--arch flux-dev` builds FLUX.1-dev's transformer (12B) and VAE from their public configs (below) with random bf16
weights directly on the device; `--arch tiny` uses tests/tiny.py's FLUX pipeline (CPU: ratios only). Random text
embeddings of the real shapes replace the text encoders.

    python benchmarks/throughput_flux.py --arch tiny --device cpu
    python benchmarks/throughput_flux.py --arch flux-dev --device cuda

Measured in one run: rollout images/s of dance_grpo_flux.rollout + decode vs FluxPipeline.__call__ (same batch,
steps, resolution, guidance embedding, dtype, initial latents, decode) and their ratio; the DanceGRPO training
micro-step (one forward + backward with gradient checkpointing, the SDE log-prob of the stored next latent) in
samples/s and peak memory; MFU of both (torch.utils.flop_counter FLOPs / time / a bf16 matmul peak measured here).
"""

import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from peft import LoraConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), os.path.join(REPO, "benchmarks")]
from dance_grpo_flux import (LORA_TARGETS, dance_sigmas, decode, image_ids, predict_velocity,  # noqa: E402
                             rollout, unpack)
from sde import sde_step  # noqa: E402
from throughput import flops_of, matmul_peak, timed  # noqa: E402

# black-forest-labs/FLUX.1-dev transformer/config.json and vae/config.json (public)
FLUX_DEV_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                            guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False)


@dataclass
class Args:
    arch: Literal["tiny", "flux-dev"] = "tiny"
    """tiny: tests/tiny.py's FLUX pipeline; flux-dev: FLUX.1-dev's architecture with random weights"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """torch device"""
    batch_size: int = 1
    """micro-batch (DanceGRPO: 1 per GPU)"""
    resolution: int | None = None
    """pixels; None = 720 for flux-dev, 32 for tiny"""
    num_steps: int = 12
    """rollout steps (the LoRA recipe's 12)"""
    text_tokens: int = 512
    """T5 tokens (FLUX.1-dev: 512)"""
    lora_rank: int = 128
    """LoRA rank on to_q/to_k/to_v/to_out.0"""
    repeats: int = 3
    """timed repeats after one warm-up (the median is reported)"""
    gradient_checkpointing: bool = True
    """recompute activations in the training step's backward (the script's default for FLUX)"""
    cudnn_attention: bool = False
    """allow PyTorch's cuDNN SDPA backend (its backward fails on FLUX.1-dev shapes with torch 2.11 on an H100)"""


def build(args, device, dtype):
    if args.arch == "tiny":
        from tiny import build_tiny_flux

        pipe = FluxPipeline.from_pretrained(build_tiny_flux(tempfile.mkdtemp()), text_encoder=None, text_encoder_2=None,
                                            tokenizer=None, tokenizer_2=None, dtype=dtype)
    else:
        torch.set_default_dtype(dtype)  # random init in bf16 on the device: 24 GB, not 48 GB of fp32 first
        with torch.device(device):
            transformer = FluxTransformer2DModel(**FLUX_DEV_TRANSFORMER)
        torch.set_default_dtype(torch.float32)
        with torch.device(device):
            vae = AutoencoderKL(**FLUX_VAE)
        pipe = FluxPipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15), text_encoder=None, tokenizer=None,
            text_encoder_2=None, tokenizer_2=None)
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
    if args.gradient_checkpointing:
        pipe.transformer.enable_gradient_checkpointing()
    return pipe, lora


def main(args: Args):
    device, dtype = torch.device(args.device), torch.bfloat16
    torch.backends.cuda.enable_cudnn_sdp(args.cudnn_attention)  # as dance_grpo_flux.py: off by default
    res = args.resolution or (720 if args.arch == "flux-dev" else 32)
    pipe, lora = build(args, device, dtype)
    tr, B = pipe.transformer, args.batch_size
    autocast = torch.autocast(device.type, dtype=dtype)
    latent = res // pipe.vae_scale_factor  # unpacked latent height = width
    gen = torch.Generator(device).manual_seed(0)
    noise = torch.randn(B, (latent // 2) ** 2, tr.config.in_channels, device=device, generator=gen)  # packed tokens
    embeds = torch.randn(B, args.text_tokens, tr.config.joint_attention_dim, device=device, dtype=dtype, generator=gen)
    pooled = torch.randn(B, tr.config.pooled_projection_dim, device=device, dtype=dtype, generator=gen)
    text_ids = torch.zeros(args.text_tokens, 3, device=device)
    img_ids = image_ids(latent // 2, latent // 2, device)
    sigmas = dance_sigmas(args.num_steps, 3.0).to(device)

    def ours():
        _, _, x0_hat = rollout(tr, noise, sigmas, "dance", 0.3, embeds, pooled, text_ids, img_ids, 3.5, autocast, gen)
        return decode(pipe.vae, unpack(x0_hat, latent, latent))

    def diffusers_call():
        packed = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, latents=noise.to(dtype), height=res, width=res,
                      num_inference_steps=args.num_steps, guidance_scale=3.5, output_type="latent").images
        return decode(pipe.vae, unpack(packed, latent, latent))  # the same fp32 decode as ours

    latents, old_lp, _ = rollout(tr, noise, sigmas, "dance", 0.3, embeds, pooled, text_ids, img_ids, 3.5, autocast, gen)

    def dance_step():
        with autocast:
            v = predict_velocity(tr, latents[:, 0], sigmas[0], embeds, pooled, text_ids, img_ids, 3.5)
        _, lp, _, _ = sde_step(v, latents[:, 0], sigmas[0], sigmas[1], "dance", 0.3, prev_sample=latents[:, 1])
        (-torch.exp(lp - old_lp[:, 0]).mean()).backward()
        return lp

    peak = matmul_peak(device, dtype)
    nan = float("nan")
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"batch {B}, {res} px, {args.num_steps} steps, guidance embedding 3.5, bf16 base, "
          f"grad-ckpt {args.gradient_checkpointing}\n", flush=True)
    t_ours, t_diff = timed(ours, args.repeats, device), timed(diffusers_call, args.repeats, device)
    rollout_flops = flops_of(ours) if device.type == "cuda" else None
    print(f"rollout: ours {B / t_ours:.3g} img/s, diffusers {B / t_diff:.3g} img/s, time ours/diffusers "
          f"{t_ours / t_diff:.3f}, MFU {rollout_flops / t_ours / peak if rollout_flops else nan:.3g}", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_step = timed(dance_step, args.repeats, device)
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else nan
    step_flops = flops_of(dance_step) if device.type == "cuda" else None
    ratio_dev = (torch.exp(dance_step().detach() - old_lp[:, 0]) - 1).abs().max().item()
    print(f"DanceGRPO step: {B / t_step:.3g} samples/s, peak {mem:.3g} GiB, "
          f"MFU {step_flops / t_step / peak if step_flops else nan:.3g}, on-policy max abs(ratio-1) {ratio_dev:.1e}")

if __name__ == "__main__":
    main(tyro.cli(Args))
