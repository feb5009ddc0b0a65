"""Speed, memory and MFU of dance_grpo_flux.py's rollout loop and training micro-step, on random
FLUX weights.

`--arch flux-dev` builds FLUX.1-dev's transformer (12B) and VAE from their public configs (below)
with random bf16 weights directly on the device; `--arch tiny` uses tests/tiny.py's FLUX pipeline
(CPU: ratios only). Random text embeddings of the real shapes replace the text encoders.

    python benchmarks/throughput_flux.py --arch tiny --device cpu
    python benchmarks/throughput_flux.py --arch flux-dev --variants base compile compile+sac

Measured in one run, per variant ('+'-joined modifiers, MODIFIERS below): rollout images/s of
dance_grpo_flux.rollout + decode and of FluxPipeline.__call__ (same batch, steps, resolution,
guidance embedding, dtype, initial latents, decode) and their ratio, diffusers' pipeline timed
eagerly once and again with the row's inference modifiers on (in a `compile` row both loops run the
same compiled blocks: the fair comparison); the DanceGRPO training micro-step (one forward +
backward, the SDE log-prob of the stored next latent) in samples/s and peak memory; MFU of both
(torch.utils.flop_counter FLOPs, counted once eagerly without recomputation / time / a bf16 matmul
peak measured here); the first micro-step's max |ratio - 1| against a rollout in the same mode;
compile warm-up seconds.
"""

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro
from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                       FluxTransformer2DModel)
from peft import LoraConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), os.path.join(REPO, "benchmarks")]
from dance_grpo_flux import (LORA_TARGETS, Text, dance_sigmas, decode,  # noqa: E402
                             predict_velocity, rollout)
from sde import sde_step  # noqa: E402
from throughput import (ATTENTION_BACKENDS, checkpoint_blocks, compile_blocks,  # noqa: E402
                        device_name, flops_of, matmul_peak, timed, timed_first,
                        transformer_attention_backend)

# black-forest-labs/FLUX.1-dev transformer/config.json and vae/config.json (public)
FLUX_DEV_TRANSFORMER = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
    guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611,
    shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)

MODIFIERS = {
    "base": "eager, diffusers' full gradient checkpointing of every block (the script's default)",
    "compile": "regional torch.compile: every double- and single-stream block compiled on its own",
    "sac": "selective activation checkpointing of every block instead of full checkpointing: keep "
           "matmul/attention outputs, recompute the rest",
    "no-ckpt": "no activation checkpointing",
    "attn-flash": "the transformer's SDPA restricted to the flash-attention backend",
    "attn-efficient": "the transformer's SDPA restricted to the memory-efficient backend",
    "attn-cudnn": "the transformer's SDPA restricted to the cuDNN backend (allowed for this row)",
}
INFERENCE_MODIFIERS = {"compile", "attn-flash", "attn-efficient", "attn-cudnn"}


@dataclass
class Args:
    arch: Literal["tiny", "flux-dev"] = "tiny"
    """tiny: tests/tiny.py's FLUX pipeline; flux-dev: FLUX.1-dev's architecture, random weights"""
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
    variants: list[str] = field(default_factory=lambda: ["base", "compile", "compile+sac"])
    """settings to measure, each a '+'-joined list of modifiers; see MODIFIERS"""
    log: str | None = None
    """append one JSON line per variant (all numbers, warm-up times) to this file"""


def build(args, device, dtype):
    if args.arch == "tiny":
        from tiny import build_tiny_flux

        pipe = FluxPipeline.from_pretrained(build_tiny_flux(tempfile.mkdtemp()), text_encoder=None,
                                            text_encoder_2=None, tokenizer=None, tokenizer_2=None,
                                            dtype=dtype)
    else:
        torch.set_default_dtype(dtype)  # random init in bf16 on the device: 24 GB, not 48 of fp32
        with torch.device(device):
            transformer = FluxTransformer2DModel(**FLUX_DEV_TRANSFORMER)
        torch.set_default_dtype(torch.float32)
        with torch.device(device):
            vae = AutoencoderKL(**FLUX_VAE)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True,
                                                    base_shift=0.5, max_shift=1.15)
        pipe = FluxPipeline(transformer=transformer, vae=vae, scheduler=scheduler,
                            text_encoder=None, tokenizer=None, text_encoder_2=None,
                            tokenizer_2=None)
    pipe.vae.to(torch.float32)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.requires_grad_(False)
    torch.manual_seed(0)
    pipe.transformer.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                            init_lora_weights="gaussian",
                                            target_modules=LORA_TARGETS))
    lora = [p for p in pipe.transformer.parameters() if p.requires_grad]
    for p in lora:
        p.data = p.data.float()
    return pipe, lora


def set_modifiers(stack: contextlib.ExitStack, tr, mods: list[str], compiled: bool) -> bool:
    """Enter a variant's modifiers on the transformer; returns whether its blocks are now compiled
    (permanent: rows without `compile` after the first compiled one run with eager stance)."""
    if "compile" in mods and not compiled:
        compile_blocks(tr)
        compiled = True
    if compiled and "compile" not in mods:
        stack.enter_context(torch.compiler.set_stance("force_eager"))
    for m in mods:
        if m in ATTENTION_BACKENDS:
            if m == "attn-cudnn":  # the script disables it (its backward fails on FLUX shapes)
                torch.backends.cuda.enable_cudnn_sdp(True)
                stack.callback(torch.backends.cuda.enable_cudnn_sdp, False)
            stack.enter_context(transformer_attention_backend(tr, ATTENTION_BACKENDS[m]))
    if "sac" in mods:
        stack.callback(checkpoint_blocks(tr, 1, selective=True))
    elif "no-ckpt" not in mods:
        tr.enable_gradient_checkpointing()
        stack.callback(tr.disable_gradient_checkpointing)
    return compiled


def main(args: Args):
    device, dtype = torch.device(args.device), torch.bfloat16
    for v in args.variants:
        bad = [m for m in v.split("+") if m not in MODIFIERS]
        if bad:
            raise SystemExit(f"error: unknown modifier(s) {bad} in variant {v!r}; "
                             f"known: {', '.join(MODIFIERS)}")
    torch.backends.cuda.enable_cudnn_sdp(False)  # as dance_grpo_flux.py
    res = args.resolution or (720 if args.arch == "flux-dev" else 32)
    pipe, lora = build(args, device, dtype)
    tr, B = pipe.transformer, args.batch_size
    autocast = torch.autocast(device.type, dtype=dtype)
    latent = res // pipe.vae_scale_factor  # unpacked latent height = width
    gen = torch.Generator(device).manual_seed(0)
    noise = torch.randn(B, (latent // 2) ** 2, tr.config.in_channels, device=device, generator=gen)
    embeds = torch.randn(B, args.text_tokens, tr.config.joint_attention_dim, device=device,
                         dtype=dtype, generator=gen)
    pooled = torch.randn(B, tr.config.pooled_projection_dim, device=device, dtype=dtype,
                         generator=gen)
    img_ids = FluxPipeline._prepare_latent_image_ids(1, latent // 2, latent // 2, device,
                                                     torch.float32)
    sigmas = dance_sigmas(args.num_steps, 3.0).to(device)
    state = {}

    def velocity(x, sigma):  # as the script's: autocast around the forward
        with autocast:
            return predict_velocity(tr, x, sigma, Text(embeds, pooled), img_ids, 3.5)

    def ours():
        out = rollout(velocity, noise, sigmas, (0, args.num_steps), 0.3, gen)  # all SDE steps
        state["latents"], state["old_lp"] = out.latents, out.log_probs
        return decode(pipe, out.sample, res)

    def diffusers_call():
        packed = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, latents=noise.to(dtype),
                      height=res, width=res, num_inference_steps=args.num_steps, guidance_scale=3.5,
                      output_type="latent").images
        return decode(pipe, packed, res)  # the same fp32 decode as ours

    def dance_step():
        latents, old_lp = state["latents"], state["old_lp"]
        v = velocity(latents[:, 0], sigmas[0])
        _, lp, _, _ = sde_step(v, latents[:, 0], sigmas[0], sigmas[1], "dance", 0.3,
                               prev_sample=latents[:, 1])
        (-torch.exp(lp - old_lp[:, 0]).mean()).backward()
        return lp

    peak = matmul_peak(device, dtype)
    t_diffusers = timed(diffusers_call, args.repeats, device)
    count = device.type == "cuda"  # tiny CPU matmuls make a peak-based MFU meaningless
    ours()
    flops = {"rollout": flops_of(ours) if count else None,
             "dance": flops_of(dance_step) if count else None}  # eager, no recompute
    for p in lora:
        p.grad = None
    print(f"device: {device_name(device)}; torch {torch.__version__}; batch {B}, {res} px, "
          f"{args.num_steps} steps, guidance embedding 3.5, bf16 base; diffusers FluxPipeline "
          f"(eager) {B / t_diffusers:.3g} img/s\n", flush=True)
    table = ["| setting | rollout img/s | diffusers img/s, same setting | time ours/diffusers | "
             "rollout MFU | DanceGRPO step samples/s | step peak GiB | step MFU | "
             "on-policy max abs(ratio-1) | compile s |", "|" + "---|" * 10]
    compiled, nan = False, float("nan")
    for variant in args.variants:
        mods = variant.split("+")
        label = f"{args.arch}" + "".join(f" +{m}" for m in mods if m != "base")
        r = {"diffusers_s": t_diffusers}
        try:
            with contextlib.ExitStack() as stack:
                compiled = set_modifiers(stack, tr, mods, compiled)
                r["rollout_s"], r["rollout_first_s"] = timed_first(ours, args.repeats, device)
                if INFERENCE_MODIFIERS & set(mods):
                    r["diffusers_s"], r["diffusers_first_s"] = timed_first(diffusers_call,
                                                                           args.repeats, device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                r["dance_s"], r["dance_first_s"] = timed_first(dance_step, args.repeats, device)
                if device.type == "cuda":
                    r["dance_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                lp = dance_step().detach()
                r["dance_dev"] = (torch.exp(lp - state["old_lp"][:, 0]) - 1).abs().max().item()
        except Exception as e:  # one failing lever must not cost the other rows of a lent-GPU run
            print(f"| {label} | failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)
            table.append(f"| {label} | failed: {type(e).__name__} |")
            if isinstance(e, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            continue
        finally:
            for p in lora:
                p.grad = None

        def mfu(key, r=r):  # this row's r (bound now, not when called)
            return flops[key] / r[f"{key}_s"] / peak if flops[key] else nan

        compile_s = nan
        if "compile" in mods:
            compile_s = sum(r[k] - r[k.replace("_first", "")] for k in r if k.endswith("_first_s"))
        row = (f"| {label} | {B / r['rollout_s']:.3g} | {B / r['diffusers_s']:.3g} | "
               f"{r['rollout_s'] / r['diffusers_s']:.3f} | {mfu('rollout'):.3g} | "
               f"{B / r['dance_s']:.3g} | {r.get('dance_gib', nan):.3g} | {mfu('dance'):.3g} | "
               f"{r['dance_dev']:.1e} | {compile_s:.0f} |")
        print(row, flush=True)
        table.append(row)
        if args.log:
            shapes = dict(batch_size=B, resolution=res, num_steps=args.num_steps,
                          cfg=False, text_tokens=args.text_tokens, lora_rank=args.lora_rank)
            with open(args.log, "a") as fh:
                fh.write(json.dumps(dict(bench="throughput_flux", arch=args.arch, variant=variant,
                                         label=label, device=device_name(device), **shapes,
                                         diffusers_eager_s=t_diffusers, peak=peak, flops=flops,
                                         **r)) + "\n")
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main(tyro.cli(Args))
