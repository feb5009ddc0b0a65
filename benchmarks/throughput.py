"""Speed, memory and MFU of the SD3.5 scripts' rollout loop and training micro-steps, on random
weights.

Nothing is downloaded: `--arch sd35m` builds SD3.5-Medium's transformer and VAE from their public
configs (written below) with random weights; `--arch tiny` uses tests/tiny.py's pipeline (CPU: only
the ratios mean anything). Text encoders are not needed: every measurement feeds random prompt
embeddings of the real shapes.

    python benchmarks/throughput.py --arch tiny --device cpu          # ratios, seconds on a laptop
    python benchmarks/throughput.py --arch sd35m --device cuda --variants base compile compile+sac

Measured in one run, so ratios compare like with like:
- rollout: images/s of grpo_sd35.rollout + decode, and of StableDiffusion3Pipeline.__call__ (same
  batch, steps, CFG, resolution, dtype, latents, fp32 decode). Diffusers' pipeline is timed eagerly
  once per build, and again in every row whose modifiers change inference (compile, attn-*, nolora)
  with the same modifiers on: in a `compile` row both loops run the very same compiled
  blocks, so "time ours/diffusers" is the fair comparison of the two loops, compiled the same way;
- train micro-step, GRPO: CFG forward + backward through both branches, log-prob of the stored next
  latent, and a no-grad reference forward with LoRA disabled (what grpo_sd35.py does per step);
- train micro-step, forward-process (NFT/AWM/CRD): one no-CFG forward + backward plus two no-grad
  forwards (the old/anchor/teacher velocities), the common cost shape of those scripts;
- MFU: FLOPs counted by torch.utils.flop_counter on the very same calls, over time, against a dense
  matmul peak measured in this run on this device with the same dtype;
- variants: '+'-joined modifiers (MODIFIERS below), each with its on-policy exactness: the first
  GRPO micro-step's max |ratio - 1| against a rollout run in the same mode, and the forward-process
  step's max |v - v_old| between its no-grad and grad forwards of the same weights;
- model FLOPs are counted once per build, eagerly and without recomputation, so MFU never credits a
  checkpointing variant for its recompute; "compile s" = the warm-up calls' extra seconds over the
  timed ones (ours and diffusers').
"""

import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Literal

import torch
import tyro
from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                       StableDiffusion3Pipeline)
from peft import LoraConfig
from peft.helpers import disable_input_dtype_casting
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts, noop_context_fn)
from torch.utils.flop_counter import FlopCounterMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
from grpo_sd35 import (LORA_TARGETS, Text, adapters_disabled, decode,  # noqa: E402
                       predict_velocity, rollout)
from sde import sde_step  # noqa: E402

# stabilityai/stable-diffusion-3.5-medium transformer/config.json and vae/config.json (public)
SD35M_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
    pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384, qk_norm="rms_norm",
    dual_attention_layers=tuple(range(13)))
SD3_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305,
    shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False)


MODIFIERS = {
    "base": "eager, PyTorch's default attention backend, peft's fp32 cast of every LoRA input "
            "(the scripts' setting)",
    "other-dtype": "frozen base weights in the other dtype (bf16 <-> fp32)",
    "compile": "regional torch.compile: every transformer block compiled on its own (identical "
               "blocks share code)",
    "attn-flash": "the transformer's SDPA restricted to the flash-attention backend",
    "attn-cudnn": "the transformer's SDPA restricted to the cuDNN backend",
    "attn-efficient": "the transformer's SDPA restricted to the memory-efficient backend",
    "nocast": "peft.helpers.disable_input_dtype_casting: LoRA inputs stay bf16 (autocast casts "
              "them to bf16 anyway)",
    "nolora": "rollout with the LoRA switched off: what peft's extra matmuls cost (rollout only)",
    "grad-ckpt": "diffusers' gradient checkpointing of every block",
    "sac": "selective activation checkpointing of every block: keep matmul/attention outputs, "
           "recompute the rest",
    "ckpt-every3": "full activation checkpointing of every third block (8 of 24)",
}
# modifiers that change a no-grad forward: diffusers' pipeline is re-timed under them (not nocast:
# the pipeline runs without autocast, so its bf16 inputs need peft's cast to meet the fp32 LoRA)
INFERENCE_MODIFIERS = {"compile", "attn-flash", "attn-cudnn", "attn-efficient", "nolora"}
ATTENTION_BACKENDS = {"attn-flash": SDPBackend.FLASH_ATTENTION,
                      "attn-cudnn": SDPBackend.CUDNN_ATTENTION,
                      "attn-efficient": SDPBackend.EFFICIENT_ATTENTION}


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
    """settings to measure, each a '+'-joined list of modifiers (e.g. compile+sac); see MODIFIERS"""
    log: str | None = None
    """append one JSON line per variant (all numbers, warm-up times) to this file"""


def timed(fn, repeats: int, device) -> float:
    """Median seconds of fn() after one warm-up call."""
    return timed_first(fn, repeats, device)[0]


def timed_first(fn, repeats: int, device) -> tuple[float, float]:
    """(median seconds of fn() over `repeats` calls, seconds of the warm-up call before them)."""
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    rest = sorted(times[1:])
    return rest[len(rest) // 2], times[0]


def flops_of(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def matmul_peak(device, dtype) -> float:
    """Dense matmul FLOP/s measured here: the denominator of MFU."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, 5, device)


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def build(args, device, dtype):
    if args.arch == "tiny":
        from tiny import build_tiny_sd3

        pipe = StableDiffusion3Pipeline.from_pretrained(
            build_tiny_sd3(tempfile.mkdtemp()), text_encoder=None, text_encoder_2=None,
            text_encoder_3=None, tokenizer=None, tokenizer_2=None, tokenizer_3=None, dtype=dtype)
    else:
        with torch.device(device):  # random init on the device: seconds instead of CPU minutes
            transformer = SD3Transformer2DModel(**SD35M_TRANSFORMER).to(dtype)
            vae = AutoencoderKL(**SD3_VAE)
        pipe = StableDiffusion3Pipeline(
            transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
            text_encoder_3=None, tokenizer_3=None)
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


# ---- levers shared with throughput_flux.py ----
def repeated_blocks(transformer) -> list:
    """The transformer's repeated blocks: SD3's joint blocks; FLUX's double- and single-stream
    blocks."""
    return [*transformer.transformer_blocks, *getattr(transformer, "single_transformer_blocks", [])]


# ops whose outputs selective activation checkpointing keeps; everything else is recomputed
SAC_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention.default}


def sac_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_blocks(transformer, every: int, selective: bool):
    """Wrap every `every`-th repeated block's forward in non-reentrant activation checkpointing
    (with the SAC policy above if `selective`) while grad is on. Returns a function that undoes
    it."""
    wrapped = []
    for block in repeated_blocks(transformer)[::every]:
        def forward(*a, _forward=block.forward, **k):
            if not torch.is_grad_enabled():
                return _forward(*a, **k)
            context = noop_context_fn
            if selective:
                context = functools.partial(create_selective_checkpoint_contexts, sac_policy)
            return checkpoint(_forward, *a, use_reentrant=False, context_fn=context, **k)

        block.forward = forward
        wrapped.append(block)
    return lambda: [delattr(b, "forward") for b in wrapped]


def compile_blocks(transformer):
    """Regional compilation: each repeated block compiled in place; blocks of one structure share
    the compiled code (parameters are graph inputs), so compile time does not grow with depth."""
    # grad on/off x LoRA on/off x batch sizes x block kinds x ours/diffusers' input dtypes
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch._dynamo.config.automatic_dynamic_shapes = False  # static shapes: no dynamic kernels
    for block in repeated_blocks(transformer):
        block.compile()


@contextlib.contextmanager
def transformer_attention_backend(transformer, backend: SDPBackend):
    """Restrict SDPA to one backend inside the transformer's forward only. A global `sdpa_kernel`
    would also bind the fp32 VAE's attention, which flash attention (bf16/fp16 only) cannot run."""
    forward = transformer.forward

    def restricted(*args, **kwargs):
        with sdpa_kernel(backend):
            return forward(*args, **kwargs)

    transformer.forward = restricted
    try:
        yield
    finally:
        del transformer.forward


def set_modifiers(stack: contextlib.ExitStack, S, mods: list[str]):
    """Enter every modifier of a variant on S.tr; the stack undoes them. Compilation is permanent
    (the first compile row compiles the blocks), so rows without `compile` run with eager stance."""
    tr = S.tr
    if "compile" in mods and not S.compiled:
        compile_blocks(tr)
        S.compiled = True
    if S.compiled and "compile" not in mods:
        stack.enter_context(torch.compiler.set_stance("force_eager"))
    for m in mods:
        if m in ATTENTION_BACKENDS:
            stack.enter_context(transformer_attention_backend(tr, ATTENTION_BACKENDS[m]))
    if "nocast" in mods:
        stack.enter_context(disable_input_dtype_casting(tr))
    if "grad-ckpt" in mods:
        tr.enable_gradient_checkpointing()
        stack.callback(tr.disable_gradient_checkpointing)
    if "sac" in mods or "ckpt-every3" in mods:
        stack.callback(checkpoint_blocks(tr, 1 if "sac" in mods else 3, selective="sac" in mods))
    if "nolora" in mods:
        stack.enter_context(adapters_disabled(tr))


# ---- the measured calls ----
def setup(args, device, base_dtype):
    """Model, inputs and what is measured once per build: matmul peak, diffusers' eager pipeline,
    model FLOPs."""
    dtype = torch.bfloat16 if base_dtype == "bf16" else torch.float32
    pipe, lora = build(args, device, dtype)
    tr = pipe.transformer
    res = args.resolution or (512 if args.arch == "sd35m" else 32)
    h, B, cfg = res // pipe.vae_scale_factor, args.batch_size, tr.config
    gen = torch.Generator(device).manual_seed(0)
    S = SimpleNamespace(pipe=pipe, tr=tr, lora=lora, dtype=dtype, base_dtype=base_dtype, gen=gen,
                        compiled=False,
                        autocast=torch.autocast(device.type, dtype=dtype,
                                                enabled=dtype != torch.float32))
    S.noise = torch.randn(B, cfg.in_channels, h, h, device=device, generator=gen)
    S.embeds = torch.randn(B, args.text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype,
                           generator=gen)
    S.pooled = torch.randn(B, cfg.pooled_projection_dim, device=device, dtype=dtype, generator=gen)
    S.neg = (S.embeds[:1].clone(), S.pooled[:1].clone())
    pipe.scheduler.set_timesteps(args.num_steps, device=device)
    S.sigmas = pipe.scheduler.sigmas.float()

    def diffusers_call():
        latents = pipe(prompt_embeds=S.embeds, pooled_prompt_embeds=S.pooled,
                       negative_prompt_embeds=S.neg[0].expand_as(S.embeds),
                       negative_pooled_prompt_embeds=S.neg[1].expand_as(S.pooled),
                       latents=S.noise.to(dtype), height=res, width=res,
                       num_inference_steps=args.num_steps, guidance_scale=args.guidance_scale,
                       output_type="latent").images
        return decode(pipe.vae, latents)  # our fp32 decode (the pipeline would decode in its dtype)

    S.diffusers_call = diffusers_call
    S.peak = matmul_peak(device, dtype)
    S.t_diffusers = timed(diffusers_call, args.repeats, device)
    steps = make_steps(args, S)
    count = device.type == "cuda"  # tiny CPU matmuls make a peak-based MFU meaningless
    steps["rollout"]()  # sets S.rollout / S.old_lp for the training steps
    S.flops = {k: flops_of(fn) if count else None for k, fn in steps.items()}  # eager, no recompute
    for p in lora:
        p.grad = None
    if count:
        print(f"\n{args.arch} base={base_dtype}: diffusers StableDiffusion3Pipeline (eager) "
              f"{B / S.t_diffusers:.3g} img/s; matmul peak {S.peak / 1e12:.0f} TFLOP/s", flush=True)
    return S


def make_steps(args, S):
    """The three measured calls, reading the current S (rollout writes S.rollout and S.old_lp)."""
    tr, autocast, g = S.tr, S.autocast, args.guidance_scale
    text, negative = Text(S.embeds, S.pooled), Text(*S.neg)

    def velocity(x, sigma, guidance_scale=g):
        with autocast:
            return predict_velocity(tr, x, sigma, text, negative, guidance_scale)

    def ours():
        every_step = range(len(S.sigmas) - 1)  # the SDE at every step, as full Flow-GRPO samples
        out = rollout(velocity, S.noise, S.sigmas, every_step, "flow", 0.7, S.gen)
        S.rollout, S.old_lp = out, out.log_probs
        return decode(S.pipe.vae, out.sample)

    def grpo_step():
        latents, sigmas = S.rollout.latents, S.sigmas
        v = velocity(latents[:, 0], sigmas[0])
        _, lp, mean, _ = sde_step(v, latents[:, 0], sigmas[0], sigmas[1], "flow", 0.7,
                                  prev_sample=S.rollout.next_latents[:, 0],
                                  second_sigma=sigmas[1])
        with torch.no_grad(), adapters_disabled(tr):
            v_ref = velocity(latents[:, 0], sigmas[0])
        loss = -torch.exp(lp - S.old_lp[:, 0]).mean() + ((v - v_ref) ** 2).mean()
        loss.backward()
        return lp

    def forward_process_step():
        xt = 0.5 * S.rollout.sample + 0.5 * S.noise
        with torch.no_grad():
            v_old = velocity(xt, 0.5, 1.0)
            with adapters_disabled(tr):
                v_ref = velocity(xt, 0.5, 1.0)
        v = velocity(xt, 0.5, 1.0)
        (((v - v_old) ** 2).mean() + ((v - v_ref) ** 2).mean()).backward()
        return (v.detach() - v_old).abs().max()  # on-policy: the same weights with and without grad

    return {"rollout": ours, "grpo": grpo_step, "fwd": forward_process_step}


def measure(args, device, S, mods: list[str]) -> dict:
    """Time the rollout, diffusers' pipeline (if the row changes inference) and both training steps
    with the modifiers on; every field of the result table."""
    steps = make_steps(args, S)
    with contextlib.ExitStack() as stack:
        set_modifiers(stack, S, mods)
        r = {}
        r["rollout_s"], r["rollout_first_s"] = timed_first(steps["rollout"], args.repeats, device)
        r["diffusers_s"] = S.t_diffusers
        if INFERENCE_MODIFIERS & set(mods):
            r["diffusers_s"], r["diffusers_first_s"] = timed_first(S.diffusers_call, args.repeats,
                                                                   device)
        if "nolora" in mods:  # no trainable parameters: nothing to train
            return r
        for key in ("grpo", "fwd"):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                r[f"{key}_s"], r[f"{key}_first_s"] = timed_first(steps[key], args.repeats, device)
                if device.type == "cuda":
                    r[f"{key}_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                out = steps[key]().detach()
                if key == "grpo":
                    r["grpo_dev"] = (torch.exp(out - S.old_lp[:, 0]) - 1).abs().max().item()
                else:
                    r["fwd_dev"] = out.item()
            except torch.OutOfMemoryError:  # reported as such: micro-batch 9 may need checkpointing
                r[f"{key}_s"] = r[f"{key}_gib"] = float("inf")
                torch.cuda.empty_cache()
            for p in S.lora:
                p.grad = None
    return r


def main(args: Args):
    device = torch.device(args.device)
    for v in args.variants:
        bad = [m for m in v.split("+") if m not in MODIFIERS]
        if bad:
            raise SystemExit(f"error: unknown modifier(s) {bad} in variant {v!r}; "
                             f"known: {', '.join(MODIFIERS)}")
    res = args.resolution or (512 if args.arch == "sd35m" else 32)
    print(f"device: {device_name(device)}; torch {torch.__version__}; batch {args.batch_size}, "
          f"{res} px, {args.num_steps} steps, CFG {args.guidance_scale}", flush=True)
    table = ["| setting | rollout img/s | diffusers img/s, same setting | time ours/diffusers | "
             "rollout MFU | GRPO step samples/s | GRPO step peak GiB | GRPO step MFU | "
             "on-policy max abs(ratio-1) | fwd-process samples/s | fwd-process peak GiB | "
             "fwd-process MFU | fwd-process max abs(v-v_old) | compile s |", "|" + "---|" * 14]
    S, B, nan = None, args.batch_size, float("nan")
    other = "fp32" if args.dtype == "bf16" else "bf16"
    for variant in args.variants:
        mods = variant.split("+")
        base_dtype = other if "other-dtype" in mods else args.dtype
        if S is None or S.base_dtype != base_dtype:
            S = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            S = setup(args, device, base_dtype)
        label = f"{args.arch} base={base_dtype}" + "".join(
            f" +{m}" for m in mods if m not in ("base", "other-dtype"))
        try:
            r = measure(args, device, S, mods)
        except Exception as e:  # one failing lever must not cost the other rows of a lent-GPU run
            print(f"| {label} | failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)
            table.append(f"| {label} | failed: {type(e).__name__} |")
            for p in S.lora:
                p.grad = None
            continue
        f = S.flops

        def per_s(key, r=r):  # this row's r (bound now, not when called)
            return B / r[key] if r.get(key) else nan

        def mfu(key, r=r, f=f, peak=S.peak):
            return f[key] / r[f"{key}_s"] / peak if f[key] and r.get(f"{key}_s") else nan

        compile_s = nan
        if "compile" in mods:
            compile_s = sum(r[k] - r[k.replace("_first", "")] for k in r if k.endswith("_first_s"))
        row = (f"| {label} | {per_s('rollout_s'):.3g} | {per_s('diffusers_s'):.3g} | "
               f"{r['rollout_s'] / r['diffusers_s']:.3f} | {mfu('rollout'):.3g} | "
               f"{per_s('grpo_s'):.3g} | {r.get('grpo_gib', nan):.3g} | {mfu('grpo'):.3g} | "
               f"{r.get('grpo_dev', nan):.1e} | {per_s('fwd_s'):.3g} | "
               f"{r.get('fwd_gib', nan):.3g} | {mfu('fwd'):.3g} | {r.get('fwd_dev', nan):.1e} | "
               f"{compile_s:.0f} |")
        print(row, flush=True)
        table.append(row)
        if args.log:
            shapes = dict(batch_size=B, resolution=res, num_steps=args.num_steps,
                          cfg=args.guidance_scale != 1, text_tokens=args.text_tokens,
                          lora_rank=args.lora_rank)
            with open(args.log, "a") as fh:
                fh.write(json.dumps(dict(bench="throughput", arch=args.arch, variant=variant,
                                         label=label, device=device_name(device), **shapes,
                                         diffusers_eager_s=S.t_diffusers, peak=S.peak,
                                         flops=S.flops, **r)) + "\n")
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main(tyro.cli(Args))
