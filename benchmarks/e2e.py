"""End-to-end speed of the five training scripts: two short epochs each at the paper's per-GPU
shapes.

Micro-benchmarks (throughput.py, throughput_flux.py) time one rollout or one training micro-step;
a user pays for whole epochs: text encoding, sampling, reward, training, eval and whatever runs
between them. This runs each script through its normal `__main__` (a subprocess `python SCRIPT.py
--model DIR ...`) and reads the per-phase seconds it logs in metrics.jsonl (`perf/*`).

    python benchmarks/e2e.py --arch tiny                   # CPU, all five scripts, eager: a minute
    python benchmarks/e2e.py --arch full --scripts grpo --variants eager compiled --json e2e.json
    python benchmarks/e2e.py --arch full --scripts dance --build-only  # time a build, no runs

- Models: `--arch full` builds, once, complete pipeline directories under --model-dir with random
  weights from the public configs (text encoders below, diffusion models in throughput*.py):
  SD3.5-Medium (transformer, VAE, CLIP-L, OpenCLIP bigG, T5-XXL encoder) and FLUX.1-dev
  (transformer, VAE, CLIP-L, the same T5-XXL, shared by a symlink), each model initialised on the
  GPU in bf16 (the VAE in fp32) and saved with save_pretrained, so the scripts load them through
  their normal `from_pretrained(path)`. Tokenizers: tests/tiny.py's offline ones; the text
  encoders keep the real vocabulary sizes. `--arch tiny` builds the same way at tests/tiny.py's
  sizes.
- Runs: each script's own defaults (the paper's per-GPU micro-batch, resolution, steps, CFG, LoRA
  rank, text length) except --micro-batches micro-batches per epoch (group size = micro-batch),
  two epochs, eval every epoch on one eval batch, a brightness reward (no model, no download),
  and on tiny 32 px, 16 text tokens, fp32. Variant `eager` passes `--no-compile`, `compiled`
  `--compile` (a script without the flag runs eager and has no compiled variant).
- Report: epoch 1 is the steady state; warm-up = epoch 0 - epoch 1 (compilation, eval's graphs).
  Per phase seconds (absent while a script does not log it), images/s, MFU of sampling and
  training, peak memory. MFU = transformer FLOPs (torch.utils.flop_counter on a meta-device copy
  with the LoRA, one row at the script's token counts; CFG doubles the rows) x the rows each phase
  sends through the transformer (`passes`, from the script's parsed Args) / the phase's seconds /
  a matmul peak measured here. With --micro-log (throughput*.py's --log), the phases that a
  micro-benchmark times exactly are predicted from it: GRPO's and DanceGRPO's sampling and
  training, NFT's and AWM's training.
"""

import contextlib
import dataclasses
import datetime
import importlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import diffusers
import peft
import torch
import transformers
import tyro
from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                       FluxTransformer2DModel, SD3Transformer2DModel, StableDiffusion3Pipeline)
from peft import LoraConfig
from torch.utils.flop_counter import FlopCounterMode
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config,
                          T5EncoderModel)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), os.path.join(REPO, "benchmarks")]
from throughput import SD3_VAE, SD35M_TRANSFORMER, device_name, matmul_peak  # noqa: E402
from throughput_flux import FLUX_DEV_TRANSFORMER, FLUX_VAE  # noqa: E402
from tiny import clip_tokenizer, t5_tokenizer  # noqa: E402

SCRIPTS = {"grpo": "grpo_sd35", "nft": "nft_sd35", "awm": "awm_sd35", "crd": "crd_sd35",
           "dance": "dance_grpo_flux"}
PHASES = ("text_encoding", "sampling", "reward", "training", "eval")
REWARD = os.path.join(REPO, "tests", "toy_rewards.py") + ":brightness"

# ---- public configs of the text encoders (the diffusion models' are in throughput*.py) ----
# openai/clip-vit-large-patch14 text model: SD3.5's text_encoder and FLUX.1-dev's text_encoder
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, hidden_act="quick_gelu", vocab_size=49408)
# laion/CLIP-ViT-bigG-14-laion2B-39B-b160k text model (projection 1280): SD3.5's text_encoder_2
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
              num_attention_heads=20, projection_dim=1280, hidden_act="gelu", vocab_size=49408)
# google/t5-v1_1-xxl encoder: SD3.5's text_encoder_3 and FLUX.1-dev's text_encoder_2
T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
              relative_attention_num_buckets=32, relative_attention_max_distance=128,
              vocab_size=32128)

# tests/tiny.py's sizes: 4 latent channels, VAE downsampling 4, patch 1, text widths 16 / 24 / 48
TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[8, 8, 16],
                down_block_types=["DownEncoderBlock2D"] * 3,
                up_block_types=["UpDecoderBlock2D"] * 3, layers_per_block=1, norm_num_groups=4,
                sample_size=32, use_quant_conv=False, use_post_quant_conv=False)
TINY_CLIP_VOCAB, TINY_T5_VOCAB = len(clip_tokenizer()), len(t5_tokenizer())
ARCHS = {
    "full": {
        "sd35m": dict(transformer=SD35M_TRANSFORMER, vae=SD3_VAE, clip_l=CLIP_L, clip_g=CLIP_G),
        "flux-dev": dict(transformer=FLUX_DEV_TRANSFORMER, vae=FLUX_VAE, clip_l=CLIP_L),
        "t5": T5_XXL, "dtype": torch.bfloat16,
    },
    "tiny": {
        "sd35m": dict(
            transformer=dict(sample_size=8, patch_size=1, in_channels=4, out_channels=4,
                             num_layers=2, attention_head_dim=8, num_attention_heads=4,
                             caption_projection_dim=32, joint_attention_dim=48,
                             pooled_projection_dim=40, pos_embed_max_size=64, qk_norm="rms_norm"),
            vae=dict(TINY_VAE, scaling_factor=1.5305, shift_factor=0.0609),
            clip_l=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, projection_dim=16, vocab_size=TINY_CLIP_VOCAB),
            clip_g=dict(hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=2, projection_dim=24, vocab_size=TINY_CLIP_VOCAB)),
        "flux-dev": dict(
            transformer=dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                             pooled_projection_dim=16, axes_dims_rope=(4, 4, 8),
                             guidance_embeds=True),
            vae=dict(TINY_VAE, scaling_factor=0.3611, shift_factor=0.1159),
            clip_l=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, projection_dim=16, vocab_size=TINY_CLIP_VOCAB)),
        "t5": dict(d_model=48, d_ff=64, d_kv=8, num_heads=2, num_layers=2,
                   relative_attention_num_buckets=8, vocab_size=TINY_T5_VOCAB),
        "dtype": torch.float32,
    },
}
# the scripts' tiny-run overrides: CPU-sized images and text, fp32 (bf16 matmuls are slow on CPU)
TINY_FLAGS = ["--resolution", "32", "--max-sequence-length", "16", "--mixed-precision", "no"]


@dataclass
class Args:
    arch: Literal["tiny", "full"] = "tiny"
    """full: SD3.5-Medium / FLUX.1-dev architectures (GPU); tiny: tests/tiny.py's sizes (CPU)"""
    scripts: tuple[Literal["grpo", "nft", "awm", "crd", "dance"], ...] = tuple(SCRIPTS)
    """scripts to run, in this order"""
    variants: tuple[Literal["eager", "compiled"], ...] | None = None
    """per script, in this order; None = eager on tiny, eager and compiled on full"""
    micro_batches: int = 2
    """micro-batches per epoch (each the script's paper micro-batch); group size = micro-batch"""
    model_dir: str = os.path.join(tempfile.gettempdir(), "flowrl-e2e", "models")
    """where the random-weight pipelines are built (reused when already there)"""
    output_dir: str = os.path.join(tempfile.gettempdir(), "flowrl-e2e", "runs")
    """run directories and logs (each run's checkpoints are deleted after it)"""
    json: str | None = None
    """write the report here, rewritten after every run (a timeout keeps what finished)"""
    micro_log: tuple[str, ...] = ()
    """JSONL files written by throughput.py / throughput_flux.py --log: predicted phases"""
    timeout: int | None = None
    """seconds per run before it is killed and reported as a timeout; None = no limit"""
    script_args: str = ""
    """more flags for every script, as --script-args="--eval-num-steps 10" (last: they win)"""
    build_only: bool = False
    """build (and time) the pipelines that --scripts need, then stop: no runs"""


# ---------------------------------------------------------------- building the pipelines
@contextlib.contextmanager
def init_on(device, dtype):
    """Random init directly on the device in `dtype`: a 12B transformer takes seconds on a GPU in
    bf16, minutes on a CPU in fp32 (and twice the memory)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def clip_encoder(cls, dims: dict, tokenizer):
    """A CLIP text model whose pooled output reads the tokenizer's <|endoftext|> (non-legacy
    ids, as in tests/tiny.py)."""
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = CLIPTextConfig(max_position_embeddings=77, bos_token_id=eos - 1, eos_token_id=eos,
                            pad_token_id=tokenizer.pad_token_id, **dims)
    return cls(config)


def t5_config(dims: dict) -> T5Config:
    return T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0,
                    eos_token_id=1, decoder_start_token_id=0, **dims)  # T5 v1.1's layout


def save_pipeline(pipe, path: str, linked: dict[str, str]):
    """save_pretrained, except that the components in `linked` become symlinks to a directory saved
    once; written to a temp dir and renamed, so a crash never leaves a half-built pipeline."""
    parent = os.path.dirname(path)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
    os.chmod(tmp, 0o755)
    pipe.save_config(tmp)  # model_index.json
    for name, component in pipe.components.items():
        if name in linked:
            os.symlink(os.path.relpath(linked[name], path), os.path.join(tmp, name))
        elif component is not None:
            component.save_pretrained(os.path.join(tmp, name))
    os.rename(tmp, path)


def build_pipeline(arch: str, family: str, model_dir: str, device) -> str:
    """Build (once) model_dir/arch/family, a StableDiffusion3Pipeline ("sd35m") or FluxPipeline
    ("flux-dev") with random weights; returns its path."""
    root = os.path.join(model_dir, arch)
    path = os.path.join(root, family)
    if os.path.exists(os.path.join(path, "model_index.json")):
        return path
    os.makedirs(root, exist_ok=True)
    sizes, dtype = ARCHS[arch][family], ARCHS[arch]["dtype"]
    t5_path = os.path.join(root, "t5-encoder")
    if not os.path.exists(os.path.join(t5_path, "config.json")):
        with init_on(device, dtype):
            torch.manual_seed(0)
            T5EncoderModel(t5_config(ARCHS[arch]["t5"])).save_pretrained(t5_path)
    with torch.device("meta"):  # only names the class in model_index.json: the weights are linked
        t5 = T5EncoderModel(t5_config(ARCHS[arch]["t5"]))
    torch.manual_seed(0)
    with init_on(device, torch.float32):
        vae = AutoencoderKL(**sizes["vae"])  # the scripts decode in fp32
    with init_on(device, dtype):
        if family == "sd35m":
            tokenizer, tokenizer_2 = clip_tokenizer(), clip_tokenizer(pad_token="!")  # as SD3's
            pipe = StableDiffusion3Pipeline(
                transformer=SD3Transformer2DModel(**sizes["transformer"]), vae=vae,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                text_encoder=clip_encoder(CLIPTextModelWithProjection, sizes["clip_l"], tokenizer),
                tokenizer=tokenizer,
                text_encoder_2=clip_encoder(CLIPTextModelWithProjection, sizes["clip_g"],
                                            tokenizer_2),
                tokenizer_2=tokenizer_2, text_encoder_3=t5, tokenizer_3=t5_tokenizer())
            linked = {"text_encoder_3": t5_path}
        else:
            tokenizer = clip_tokenizer()
            scheduler = FlowMatchEulerDiscreteScheduler(  # black-forest-labs/FLUX.1-dev's
                shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                base_image_seq_len=256, max_image_seq_len=4096)
            pipe = FluxPipeline(
                transformer=FluxTransformer2DModel(**sizes["transformer"]), vae=vae,
                scheduler=scheduler, text_encoder=clip_encoder(CLIPTextModel, sizes["clip_l"],
                                                               tokenizer),
                tokenizer=tokenizer, text_encoder_2=t5, tokenizer_2=t5_tokenizer())
            linked = {"text_encoder_2": t5_path}
    save_pipeline(pipe, path, linked)
    del pipe
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


# ---------------------------------------------------------------- what each script computes
@dataclass
class Passes:
    """Rows through the transformer per sampled image, from a script's parsed Args (a row: one
    sample in one call; CFG sends 2). Read off the scripts' loops; a test counts them."""
    sampling: int  # no-grad rows of the rollout
    train_steps: int  # training micro-steps per micro-batch
    train_grad: int  # rows with grad (forward + backward)
    train_nograd: int  # no-grad rows in training: reference, old, anchor, teacher
    eval: int  # rows per eval image


def cfg_rows(guidance_scale: float) -> int:
    return 1 if guidance_scale == 1 else 2


def passes(script: str, a) -> Passes:
    """Passes of `script` per sampled image under its parsed Args `a` (its training loop, read)."""
    # Eval: its ODE steps, and two velocities at its first sigma (eval/lora_drift: the LoRA's
    # and the base's), but in a full fine-tune, which has no adapter to switch off.
    if script == "dance":  # FLUX.1-dev: guidance is an embedding, never a second branch
        steps = a.sde_window_size or int((a.num_steps - 1) * a.timestep_fraction)
        drift = 0 if a.full_finetune else 2
        return Passes(a.num_steps, steps, steps, 0, a.eval_num_steps + drift)
    g = cfg_rows(a.guidance_scale)
    eval_scale = getattr(a, "eval_guidance_scale", None)
    eval_cfg = cfg_rows(a.guidance_scale if eval_scale is None else eval_scale)
    eval_rows = (a.eval_num_steps + 2) * eval_cfg
    if script == "grpo":  # CFG forward with grad, the KL's reference forward with CFG
        steps = a.sde_window_size or int(a.num_steps * a.timestep_fraction)
        reference = g if a.kl_beta > 0 else 0
        return Passes(a.num_steps * g, steps, steps * g, steps * reference, eval_rows)
    if script == "nft":  # old-policy forward, grad forward, the KL's reference forward
        steps = int(a.num_steps * a.timestep_fraction)
        others = 2 if a.kl_beta > 0 else 1
        return Passes(a.num_steps * g, steps, steps * g, steps * g * others, eval_rows)
    if script == "awm":  # K timesteps per image in one call: base (KL) and anchor forwards
        others = int(a.kl_beta > 0) + int(a.anchor_beta > 0)
        k = a.train_timesteps
        return Passes(a.num_steps * g, k, k * g, k * g * others, eval_rows)
    if script == "crd":  # old-snapshot forward, the KL's CFG teacher, grad forward
        k = a.num_train_timesteps
        teacher = cfg_rows(a.kl_cfg) if a.kl_beta > 0 else 0
        return Passes(a.num_steps * g, k, k * g, k * (g + teacher), eval_rows)
    raise ValueError(script)


def text_tokens(script: str, a) -> int:
    """Text tokens per row: SD3 joins CLIP's 77 and T5's; FLUX reads T5's only."""
    return a.max_sequence_length + (0 if script == "dance" else 77)


def transformer_flops(model_path: str, module, a, tokens: int) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of one row through the script's transformer with its
    LoRA, counted on a meta-device copy (no memory, seconds of CPU even for FLUX); the base is
    frozen, so backward computes input gradients and the LoRA's only, as in the scripts."""
    is_flux = "Flux" in json.load(open(os.path.join(model_path, "model_index.json")))["_class_name"]
    cls = FluxTransformer2DModel if is_flux else SD3Transformer2DModel
    config = cls.load_config(os.path.join(model_path, "transformer"))
    vae = json.load(open(os.path.join(model_path, "vae", "config.json")))
    latent = a.resolution // 2 ** (len(vae["block_out_channels"]) - 1)
    with torch.device("meta"):
        tr = cls.from_config(config)
        tr.requires_grad_(False)
        tr.add_adapter(LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha,
                                  target_modules=module.LORA_TARGETS))
        t = torch.full((1,), 0.5)
        if is_flux:
            n = (latent // 2) ** 2  # 2x2-packed latent tokens
            inputs = dict(hidden_states=torch.randn(1, n, config["in_channels"]), timestep=t,
                          guidance=t, encoder_hidden_states=torch.randn(
                              1, tokens, config["joint_attention_dim"]),
                          pooled_projections=torch.randn(1, config["pooled_projection_dim"]),
                          txt_ids=torch.zeros(tokens, 3), img_ids=torch.zeros(n, 3))
        else:
            inputs = dict(hidden_states=torch.randn(1, config["in_channels"], latent, latent),
                          timestep=t, encoder_hidden_states=torch.randn(
                              1, tokens, config["joint_attention_dim"]),
                          pooled_projections=torch.randn(1, config["pooled_projection_dim"]))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        tr(**inputs, return_dict=False)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        tr(**inputs, return_dict=False)[0].float().mean().backward()
    return forward, counter.get_total_flops()


# ---------------------------------------------------------------- one run
def script_flags(module, arch: str, micro_batches: int, variant: str) -> list[str]:
    """The run's flags beyond the paper defaults (see the docstring), without paths."""
    defaults = module.Args()
    batch = defaults.batch_size
    group = batch if batch >= 2 else micro_batches  # a group needs 2 images (DanceGRPO: batch 1)
    flags = ["--reward", REWARD, "--epochs", "2", "--eval-every", "1", "--save-every", "1000",
             "--group-size", str(group),
             "--prompts-per-epoch", str(micro_batches * batch // group)]
    if hasattr(defaults, "updates_per_epoch"):  # optimizer steps must divide the micro-batches
        updates = math.gcd(defaults.updates_per_epoch, micro_batches)
        flags += ["--updates-per-epoch", str(updates)]
    if arch == "tiny":
        flags += TINY_FLAGS
    if has_compile_flag(module):
        flags.append("--compile" if variant == "compiled" else "--no-compile")
    return flags


def has_compile_flag(module) -> bool:
    return "compile" in {f.name for f in dataclasses.fields(module.Args)}


def write_prompts(train: str, test: str, eval_batch_size: int):
    """Generated prompt files (short: tiny runs keep 16 tokens); the test file is one eval batch."""
    with open(train, "w") as f:
        f.writelines(f"prompt {i}\n" for i in range(64))
    with open(test, "w") as f:
        f.writelines(f"test {i}\n" for i in range(eval_batch_size))


def run_script(module, flags: list[str], log_path: str, timeout: int | None):
    """`python SCRIPT.py FLAGS` in the repo, output to log_path -> (status, wall seconds). On a
    timeout the run's process group (the script and its compile workers) is killed."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    command = [sys.executable, module.__name__ + ".py", *flags]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timeout"
    return status, time.perf_counter() - start


def read_epochs(output_dir: str) -> list[dict]:
    """metrics.jsonl of the one run under output_dir (whatever epochs finished); its checkpoints
    (LoRA and Adam state: GBs for FLUX) are deleted."""
    runs = [entry.path for entry in os.scandir(output_dir) if entry.is_dir()]
    if len(runs) != 1 or not os.path.exists(os.path.join(runs[0], "metrics.jsonl")):
        return []
    shutil.rmtree(os.path.join(runs[0], "checkpoints"), ignore_errors=True)
    return [json.loads(line) for line in open(os.path.join(runs[0], "metrics.jsonl"))]


def training_epoch_seconds(metrics: dict) -> float | None:
    """An epoch's seconds without its eval (a real run evaluates every 10-60 epochs, this one every
    epoch): the epoch minus eval if the epoch contains it (its logged phases sum to no more), the
    epoch if not; None while the eval time is not logged."""
    epoch_s, eval_s = metrics["perf/epoch_seconds"], metrics.get("perf/eval_seconds")
    if eval_s is None:
        return None
    logged = sum(metrics.get(f"perf/{name}_seconds", 0) for name in PHASES)
    return epoch_s - eval_s if logged <= epoch_s * 1.001 else epoch_s


def summarize(epochs: list[dict], images: int, p: Passes, flops: tuple[int, int], peak: float):
    """The steady-state (last) epoch's phases, throughput, MFU and memory; warm-up vs epoch 0."""
    last, first = epochs[-1], epochs[0]
    phases = {name: last.get(f"perf/{name}_seconds") for name in PHASES}
    forward, forward_backward = flops
    work = {"sampling": images * p.sampling * forward,
            "training": images * (p.train_grad * forward_backward + p.train_nograd * forward)}
    mfu = {k: work[k] / phases[k] / peak if phases[k] else None for k in work}
    epoch_s, without_eval_s = last["perf/epoch_seconds"], training_epoch_seconds(last)
    return {
        "epoch_s": epoch_s, "phases_s": phases, "training_epoch_s": without_eval_s,
        "images_per_sec": last.get("perf/images_per_sec"),
        "epoch_images_per_sec": images / without_eval_s if without_eval_s else None,
        "mfu": mfu, "tflop": {k: v / 1e12 for k, v in work.items()},
        "warmup_s": first["perf/epoch_seconds"] - epoch_s if len(epochs) > 1 else None,
        "compiled_graphs": last.get("perf/compiled_graphs"),
        "peak_gib": max(e["perf/max_mem_gb"] for e in epochs) * 1e9 / 2**30,
    }


# ---------------------------------------------------------------- micro-benchmark predictions
# the micro-benchmark steps that are exactly a script's phase: (bench, {phase: its seconds key})
MICRO_STEPS = {"grpo": ("throughput", {"sampling": "rollout_s", "training": "grpo_s"}),
               "nft": ("throughput", {"training": "fwd_s"}),
               "awm": ("throughput", {"training": "fwd_s"}),
               "dance": ("throughput_flux", {"sampling": "rollout_s", "training": "dance_s"})}
MICRO_VARIANT = {"eager": "base", "compiled": "compile"}


def micro_prediction(script, variant, a, images: int, p: Passes, micro_rows: list[dict]) -> dict:
    """Phase seconds predicted from the last micro-benchmark row of the same variant, resolution
    and LoRA rank: sampling = images / its batch x one rollout (same steps and CFG only); training
    = grad rows / its grad rows per step x one step."""
    if script not in MICRO_STEPS:
        return {}
    bench, steps = MICRO_STEPS[script]
    rows = [r for r in micro_rows if r.get("bench") == bench
            and r.get("variant") == MICRO_VARIANT[variant]
            and r.get("resolution") == a.resolution and r.get("lora_rank") == a.lora_rank]
    if not rows:
        return {}
    r = rows[-1]
    cfg = 2 if r["cfg"] else 1
    predicted = {}
    if "sampling" in steps and r["num_steps"] * cfg == p.sampling:
        predicted["sampling"] = images / r["batch_size"] * r[steps["sampling"]]
    if r.get(steps["training"]) is not None:
        grad_rows_per_step = r["batch_size"] * (cfg if script == "grpo" else 1)
        predicted["training"] = images * p.train_grad / grad_rows_per_step * r[steps["training"]]
    return {"micro_variant": r["variant"], "predicted_s": predicted}


def compare_with_micro(run: dict, predicted: dict) -> dict:
    """e2e / predicted seconds per phase, and for the whole epoch without eval when both phases
    are predicted (the target: within 15 %)."""
    phases = run["phases_s"]
    ratios = {k: phases[k] / v for k, v in predicted.items() if phases.get(k)}
    if len(predicted) == 2 and run["training_epoch_s"]:
        ratios["epoch"] = run["training_epoch_s"] / sum(predicted.values())
    return ratios


# ---------------------------------------------------------------- report
def fmt(x, spec=".3g") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:{spec}}"


TABLE_HEAD = ("| script | variant | images/epoch | text enc. s | sampling s | reward s | "
              "training s | eval s | epoch s | warm-up s | sampling img/s | epoch img/s (no eval) "
              "| sampling MFU | training MFU | peak GiB | e2e/micro sampling, training, epoch |\n"
              + "|" + "---|" * 16)


def table_row(run: dict) -> str:
    head = f"| {run['script']} | {run['variant']} | {run.get('images_per_epoch', '–')} |"
    if "epoch_s" not in run:
        return head + f" {run['status']} |"
    ratios = run.get("e2e_over_micro")
    micro = "–"
    if ratios:
        micro = ", ".join(fmt(ratios.get(k), ".2f") for k in ("sampling", "training", "epoch"))
    cells = [fmt(run["phases_s"][k]) for k in PHASES] + [
        fmt(run["epoch_s"]), fmt(run["warmup_s"]), fmt(run["images_per_sec"]),
        fmt(run["epoch_images_per_sec"]), fmt(run["mfu"]["sampling"], ".2f"),
        fmt(run["mfu"]["training"], ".2f"), fmt(run["peak_gib"]), micro]
    return head + " " + " | ".join(cells) + " |"


def write_json(path: str | None, report: dict):
    """Atomically: a run killed mid-write still leaves the previous report."""
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)


def measure(args: Args, script: str, variant: str, model: str, peak: float, cache: dict,
            micro_rows: list[dict]) -> dict:
    """One run of one script in one variant: flags, FLOPs, the subprocess, its report row."""
    module = importlib.import_module(SCRIPTS[script])
    run = {"script": script, "variant": variant}
    if variant == "compiled" and not has_compile_flag(module):
        run["status"] = "skipped: the script has no --compile flag"
        return run
    out = os.path.join(args.output_dir, f"{script}-{variant}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    train, test = os.path.join(out, "train.txt"), os.path.join(out, "test.txt")
    flags = ["--model", model, "--output-dir", out, "--train-prompts", train,
             "--test-prompts", test, *script_flags(module, args.arch, args.micro_batches, variant),
             *shlex.split(args.script_args)]
    try:
        a = tyro.cli(module.Args, args=flags)  # what the script will see
    except SystemExit:  # tyro printed why: a flag this script does not have
        run["status"] = "failed: flags rejected by the script's Args"
        return run
    eval_images = a.eval_batch_size
    write_prompts(train, test, eval_images)
    p, tokens = passes(script, a), text_tokens(script, a)
    images = a.prompts_per_epoch * a.group_size
    key = (model, a.resolution, a.lora_rank, tokens)
    if key not in cache:
        cache[key] = transformer_flops(model, module, a, tokens)
    run.update(images_per_epoch=images, eval_images=eval_images, passes=dataclasses.asdict(p),
               flops_per_row=dict(zip(("forward", "forward_backward"), cache[key])),
               shapes=dict(batch_size=a.batch_size, resolution=a.resolution,
                           num_steps=a.num_steps, guidance_scale=a.guidance_scale,
                           lora_rank=a.lora_rank, text_tokens=tokens,
                           eval_num_steps=a.eval_num_steps), flags=flags)
    run["log"] = os.path.join(out, "log.txt")
    run["status"], run["wall_s"] = run_script(module, flags, run["log"], args.timeout)
    epochs = read_epochs(out)
    run["epochs"] = [{k: v for k, v in e.items() if k.startswith("perf/")} for e in epochs]
    if not epochs:
        return run
    run.update(summarize(epochs, images, p, cache[key], peak))
    micro = micro_prediction(script, variant, a, images, p, micro_rows)
    if micro:
        run["micro"] = micro
        run["e2e_over_micro"] = compare_with_micro(run, micro["predicted_s"])
    return run


def build_all(args: Args, device, report: dict):
    """Every pipeline that --scripts need, built once, in report["builds"][family]: its path,
    the build's seconds, and whether it was reused (already under --model-dir: no build)."""
    for family in dict.fromkeys("flux-dev" if s == "dance" else "sd35m" for s in args.scripts):
        reused = os.path.exists(os.path.join(args.model_dir, args.arch, family, "model_index.json"))
        start = time.perf_counter()
        model = build_pipeline(args.arch, family, args.model_dir, device)
        seconds = time.perf_counter() - start
        report["builds"][family] = {"path": model, "seconds": seconds, "reused": reused}
        write_json(args.json, report)
        print(f"{'reused' if reused else 'built'} {model} in {seconds:.0f} s", flush=True)


def main(args: Args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    variants = args.variants or (("eager",) if args.arch == "tiny" else ("eager", "compiled"))
    micro_rows = [json.loads(line) for path in args.micro_log for line in open(path)]
    if args.build_only:
        report = {"meta": {"device": device_name(device), "arch": args.arch,
                           "date": datetime.date.today().isoformat()}, "builds": {}, "runs": []}
        build_all(args, device, report)
        return report
    peak = matmul_peak(device, ARCHS[args.arch]["dtype"])
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the GPU belongs to the scripts
    meta = {"device": device_name(device), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__,
            "arch": args.arch, "micro_batches": args.micro_batches,
            "matmul_peak_tflops": peak / 1e12, "peak_dtype": str(ARCHS[args.arch]["dtype"])}
    versions = (f"{meta['device']} · torch {meta['torch']} · diffusers {meta['diffusers']} · "
                f"transformers {meta['transformers']} · peft {meta['peft']} · {meta['date']}")
    print(f"{versions}; {args.arch} arch; matmul peak {peak / 1e12:.3g} TFLOP/s", flush=True)
    report, flops_cache = {"meta": meta, "builds": {}, "runs": []}, {}
    os.makedirs(args.output_dir, exist_ok=True)
    build_all(args, device, report)
    for script in args.scripts:
        model = report["builds"]["flux-dev" if script == "dance" else "sd35m"]["path"]
        for variant in variants:
            run = measure(args, script, variant, model, peak, flops_cache, micro_rows)
            report["runs"].append(run)
            write_json(args.json, report)
            took = ""
            if "wall_s" in run:
                took = f" in {run['wall_s']:.0f} s, {len(run['epochs'])} epochs logged"
            print(f"{script} {variant}: {run['status']}{took}\n{table_row(run)}", flush=True)
            if run["status"] != "ok" and "log" in run:
                print("".join(open(run["log"]).readlines()[-15:]), flush=True)
    print(f"\n{versions} · {args.micro_batches} micro-batches per epoch, epoch 1 of 2\n\n"
          + TABLE_HEAD + "\n" + "\n".join(table_row(run) for run in report["runs"]))
    return report


if __name__ == "__main__":
    main(tyro.cli(Args))
