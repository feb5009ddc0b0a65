"""Learning on the toy world: every script, plus Flow-GRPO-Fast, GRPO-Guard and KL variants, at an equal image budget.

Each variant is launched exactly as a user would (subprocess, CPU, fp32) on the committed pretrained toy pipelines
(tests/assets/toy-sd3 for the SD3.5 scripts, toy-flux for DanceGRPO) with tests/scripts_harness.py:toy_flags: train on
the 18 training prompts with partial-credit counting, 96 images per epoch; eval = exact accuracy on the 96 held-out
lines (6 held-out prompts, deterministic ODE from noise fixed per line, so an unchanged model scores the same).
After each run its final LoRA is loaded into a fresh pipeline (`load_lora_weights`, as a user would) to measure
diversity: 8 samples per held-out prompt, mean pairwise pixel L2 distance within a prompt (lower = mode collapse).
Writes benchmarks/toy_learning.png (accuracy vs images and vs wall-clock) and prints the table of benchmarks/RESULTS.md
section 2. Needs matplotlib (`pip install matplotlib`).

    python benchmarks/toy_learning.py                                # all variants, 3 seeds, 960 images (~25 min)
    python benchmarks/toy_learning.py --variants nft grpo --seeds 0  # a subset
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import tyro

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from scripts_harness import TOY_FLUX, TOY_SD3, toy_flags  # noqa: E402

IMAGES_PER_EPOCH = 96  # toy_flags: 6 prompts x group 16
# Per-variant flags on top of toy_flags. Each script's learning rate is the best of a sweep over {1e-3, 3e-3, 1e-2}
# at seed 42 (5-10 epochs, RESULTS.md section 2); everything not listed is the script's default.
GRPO = ["--batch-size", "16", "--updates-per-epoch", "1", "--guidance-scale", "1"]  # one on-policy update per epoch
VARIANTS = {
    "grpo": ("grpo_sd35.py", GRPO + ["--learning-rate", "1e-3"]),
    "grpo+kl": ("grpo_sd35.py", GRPO + ["--learning-rate", "1e-3", "--kl-beta", "0.04"]),  # the paper's KL
    "grpo-fast": ("grpo_sd35.py", GRPO + ["--learning-rate", "1e-3", "--sde-window-size", "3", "--sde-window-range",
                                          "0", "5", "--sde-kind", "cps", "--noise-level", "0.8", "--clip-range", "1e-5"]),
    "grpo-guard": ("grpo_sd35.py", GRPO + ["--learning-rate", "3e-3", "--ratio-norm"]),
    "nft": ("nft_sd35.py", ["--batch-size", "16", "--learning-rate", "3e-3"]),
    "awm": ("awm_sd35.py", ["--batch-size", "16", "--train-batch-size", "8", "--anchor-beta", "0", "--sampler", "ode",
                            "--learning-rate", "1e-3"]),
    "crd": ("crd_sd35.py", ["--batch-size", "16", "--num-train-timesteps", "5", "--learning-rate", "3e-3"]),
    "crd+kl": ("crd_sd35.py", ["--batch-size", "16", "--num-train-timesteps", "5", "--learning-rate", "3e-3",
                               "--kl-beta", "0.1"]),  # the paper's KL
    "dance": ("dance_grpo_flux.py", ["--batch-size", "16", "--updates-per-epoch", "1", "--learning-rate", "1e-3"]),
}


@dataclass
class Args:
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    """which variants to run (keys of VARIANTS)"""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """seeds per variant"""
    images: int = 960
    """sampled-image budget per run (identical for every variant; a multiple of 96)"""
    eval_every: int = 2
    """epochs between held-out evals (the accuracy-vs-images curve)"""
    levels: list[float] = field(default_factory=lambda: [0.45, 0.5, 0.55])
    """accuracies for the "images to reach X" columns"""
    jobs: int = 2
    """runs in parallel (each with OMP_NUM_THREADS=1)"""
    out: str = os.path.join(REPO, "benchmarks", "toy_learning.png")
    """where the figure goes"""
    log: str = os.path.join(REPO, "benchmarks", "toy_learning.jsonl")
    """per-run results (one JSON line each), rewritten by every call"""


def flags_of(variant: str) -> tuple[str, list[str]]:
    script, extra = VARIANTS[variant]
    model = TOY_FLUX if "flux" in script else TOY_SD3
    flags = toy_flags(model, "OUT") + extra
    if "flux" in script:  # DanceGRPO has no KL term
        i = flags.index("--kl-beta")
        del flags[i:i + 2]
    for flag in {f for f in extra if f.startswith("--")} & {f for f in toy_flags(model, "OUT") if f.startswith("--")}:
        i = flags.index(flag)  # a variant's value replaces toy_flags' (argparse would keep the last; keep it tidy)
        del flags[i:i + 2]
    return script, flags


@torch.no_grad()
def diversity(run_dir: str, script: str, samples: int = 8) -> float:
    """Mean pairwise L2 distance (pixels in [0, 1], per image) between `samples` images of each held-out prompt, from
    the run's final LoRA loaded into a fresh pipeline (or the base model when run_dir is None)."""
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    flux = "flux" in script
    pipe = (FluxPipeline if flux else StableDiffusion3Pipeline).from_pretrained(os.path.join(REPO, TOY_FLUX if flux
                                                                                              else TOY_SD3))
    pipe.set_progress_bar_config(disable=True)
    if run_dir is not None:
        (ckpt,) = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))[-1:]
        pipe.load_lora_weights(os.path.join(run_dir, "checkpoints", ckpt, "lora"))
    with open(os.path.join(REPO, "tests/assets/toy_test.txt")) as f:
        prompts = sorted(set(f.read().split("\n")) - {""})
    dists = []
    for prompt in prompts:
        images = pipe([prompt] * samples, num_inference_steps=10, height=32, width=32, max_sequence_length=24,
                      output_type="pt", generator=torch.Generator().manual_seed(0),
                      **({} if flux else {"guidance_scale": 4.5})).images.flatten(1)
        d = torch.cdist(images, images) / images.shape[1] ** 0.5
        dists.append(d.sum() / (samples * (samples - 1)))
    return torch.stack(dists).mean().item()


def run(variant: str, seed: int, args: Args, workdir: str) -> dict:
    script, flags = flags_of(variant)
    out = tempfile.mkdtemp(dir=workdir)
    epochs = args.images // IMAGES_PER_EPOCH
    flags[flags.index("OUT")] = out
    for flag, value in (("--eval-every", args.eval_every), ("--save-every", epochs)):
        flags[flags.index(flag) + 1] = str(value)
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    start = time.time()
    cmd = [sys.executable, script, *flags, "--seed", str(seed), "--epochs", str(epochs)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    seconds, curve = 0.0, []
    for m in metrics:  # eval/reward_mean on epoch e's line = accuracy after e epochs (before that epoch's training)
        if "eval/reward_mean" in m:
            curve.append((m["epoch"] * IMAGES_PER_EPOCH, seconds, m["eval/reward_mean"]))
        seconds += m["perf/epoch_seconds"]
    curve.append((epochs * IMAGES_PER_EPOCH, seconds, metrics[-1]["eval/final_reward_mean"]))
    result = dict(variant=variant, seed=seed, curve=curve, diversity=diversity(run_dir, script),
                  wall=time.time() - start)
    print(f"{variant} seed {seed}: accuracy {curve[0][2]:.3f} -> {curve[-1][2]:.3f}, diversity "
          f"{result['diversity']:.4f}, {result['wall']:.0f}s", flush=True)
    return result


def main(args: Args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if unknown := set(args.variants) - set(VARIANTS):
        sys.exit(f"error: unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    workdir = tempfile.mkdtemp()
    base = {s: diversity(None, s) for s in {"grpo_sd35.py", "dance_grpo_flux.py"}}
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda vs: run(*vs, args, workdir), [(v, s) for v in args.variants for s in args.seeds]))
    with open(args.log, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    std = lambda xs: (sum((x - mean(xs)) ** 2 for x in xs) / len(xs)) ** 0.5  # noqa: E731
    fig, (ax_img, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    print(f"\n{args.images} sampled images per run, {len(args.seeds)} seeds; accuracy = exact held-out accuracy "
          f"(96 samples); gain = final - base (per seed: mean ± std); diversity: base SD3 {base['grpo_sd35.py']:.4f}, "
          f"base FLUX {base['dance_grpo_flux.py']:.4f}\n")
    print("| variant | base | final | gain | per-seed gains | " + " | ".join(f"images to {x:.0%}" for x in args.levels)
          + " | diversity | training s |")
    print("|---|---|---|---|---|" + "---|" * len(args.levels) + "---|---|")
    for i, variant in enumerate(args.variants):
        runs = [r for r in results if r["variant"] == variant]
        images = [p[0] for p in runs[0]["curve"]]
        acc = [mean(col) for col in zip(*[[p[2] for p in r["curve"]] for r in runs])]
        secs = [mean(col) for col in zip(*[[p[1] for p in r["curve"]] for r in runs])]
        lo, hi = ([f(col) for col in zip(*[[p[2] for p in r["curve"]] for r in runs])] for f in (min, max))
        style = dict(color=f"C{i % 10}", ls="--" if "+" in variant or "-" in variant else "-")
        for ax, x in ((ax_img, images), (ax_time, secs)):
            ax.plot(x, acc, label=f"{variant} ({len(runs)} seeds)", **style)
            ax.fill_between(x, lo, hi, color=style["color"], alpha=0.12)
        gains = [r["curve"][-1][2] - r["curve"][0][2] for r in runs]
        reach = [next((str(n) for n, a in zip(images, acc) if a >= x), "—") for x in args.levels]
        print(f"| {variant} | {acc[0]:.3f} | {acc[-1]:.3f} | {mean(gains):+.3f} ± {std(gains):.3f} | "
              f"{', '.join(f'{g:+.3f}' for g in gains)} | " + " | ".join(reach)
              + f" | {mean([r['diversity'] for r in runs]):.4f} | {secs[-1]:.0f} |")
    for ax, xlabel in ((ax_img, "sampled images"), (ax_time, "training wall-clock, seed mean (s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out exact accuracy")
        ax.legend(fontsize=7)
    fig.suptitle("Toy world: held-out accuracy, seed mean; bands = min-max over seeds")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main(tyro.cli(Args))
