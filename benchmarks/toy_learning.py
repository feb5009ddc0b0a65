"""Learning at toy scale: all five scripts on the tiny random pipelines with a reward the tiny model can move.

Every script is launched exactly as a user would (subprocess, CPU, fp32) on tests/tiny.py's pipelines with
`--reward tests/toy_rewards.py:brightness`, at an equal budget of sampled images, for a few seeds; reward is read from
each run's metrics.jsonl. Writes benchmarks/toy_learning.png (reward vs images and vs wall-clock) and prints a
markdown table for benchmarks/RESULTS.md. Needs matplotlib (`pip install matplotlib`). About 7 minutes on 2 cores:

    python benchmarks/toy_learning.py                # 5 seeds x 512 images per script
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import tyro

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from tiny import build_tiny_flux, build_tiny_sd3  # noqa: E402

PROMPTS = "tests/assets/ocr_prompts.txt"
COMMON = ["--train-prompts", PROMPTS, "--test-prompts", PROMPTS, "--reward", "tests/toy_rewards.py:brightness",
          "--resolution", "32", "--num-steps", "4", "--eval-num-steps", "3", "--group-size", "4",
          "--prompts-per-epoch", "2", "--batch-size", "4", "--eval-batch-size", "4", "--eval-every", "100000",
          "--save-every", "100000", "--max-sequence-length", "16", "--mixed-precision", "no"]
# Per-script settings for the toy: each algorithm's own knobs relaxed the same way its learning test does (learning
# rate, no KL or anchor to the base model, wider trust regions, micro-batches that fit 4-step rollouts), eval EMA off
# so that the eval gain compares the trained weights themselves; everything else at the script's defaults.
ALGORITHMS = {
    "grpo_sd35.py": ["--learning-rate", "1e-2", "--kl-beta", "0", "--clip-range", "0.2", "--ema-decay", "0"],
    "nft_sd35.py": ["--learning-rate", "1e-2", "--kl-beta", "0", "--ema-decay", "0"],
    "awm_sd35.py": ["--learning-rate", "1e-2", "--kl-beta", "0", "--anchor-beta", "0", "--train-batch-size", "2",
                    "--train-timesteps", "2", "--ema-decay", "0"],
    "crd_sd35.py": ["--learning-rate", "1e-2", "--kl-beta", "0", "--num-train-timesteps", "4", "--ema-decay", "0"],
    "dance_grpo_flux.py": ["--learning-rate", "5e-3", "--clip-range", "0.2", "--noise-level", "1.0",
                           "--timestep-fraction", "1.0"],
}
IMAGES_PER_EPOCH = 8  # --prompts-per-epoch 2 x --group-size 4
SMOOTH = 4  # epochs in the trailing mean used for "final reward" and "images to reach GRPO's final reward"


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    """seeds per algorithm"""
    images: int = 512
    """sampled-image budget per run (identical for every algorithm)"""
    out: str = os.path.join(REPO, "benchmarks", "toy_learning.png")
    """where the figure goes"""


def run(script: str, model: str, seed: int, images: int, workdir: str) -> list[dict]:
    out = tempfile.mkdtemp(dir=workdir)
    epochs = images // IMAGES_PER_EPOCH
    cmd = [sys.executable, script, "--model", model, "--output-dir", out, "--seed", str(seed), "--epochs", str(epochs)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="2")
    subprocess.run(cmd + COMMON + ALGORITHMS[script], cwd=REPO, env=env, check=True, capture_output=True)
    (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(args: Args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workdir = tempfile.mkdtemp()
    models = {"sd3": build_tiny_sd3(workdir), "flux": build_tiny_flux(workdir)}
    curves = {}
    for script in ALGORITHMS:
        if not os.path.exists(os.path.join(REPO, script)):
            continue
        model = models["flux" if "flux" in script else "sd3"]
        for seed in args.seeds:
            start = time.time()
            curves.setdefault(script, []).append(run(script, model, seed, args.images, workdir))
            print(f"{script} seed {seed}: {time.time() - start:.0f}s", flush=True)

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    std = lambda xs: (sum((x - mean(xs)) ** 2 for x in xs) / len(xs)) ** 0.5  # noqa: E731
    smooth = lambda xs: [mean(xs[max(0, i + 1 - SMOOTH): i + 1]) for i in range(len(xs))]  # noqa: E731
    summary = {}  # script -> seed-mean curves and per-seed numbers
    for script, runs in curves.items():
        rewards = [[m["reward/mean"] for m in r] for r in runs]  # seeds x epochs
        seconds = [[sum(m["perf/epoch_seconds"] for m in r[: i + 1]) for i in range(len(r))] for r in runs]
        summary[script] = dict(
            images=[IMAGES_PER_EPOCH * (m["epoch"] + 1) for m in runs[0]],
            mean=[mean(col) for col in zip(*rewards)], low=[min(col) for col in zip(*rewards)],
            high=[max(col) for col in zip(*rewards)], seconds=[mean(col) for col in zip(*seconds)],
            first=[r[0] for r in rewards], final=[mean(r[-SMOOTH:]) for r in rewards],
            spread=[r[0]["reward/std"] for r in runs],  # within-epoch std of the first epoch's rewards
            eval_gain=[r[-1]["eval/final_reward_mean"] - r[0]["eval/reward_mean"] for r in runs],  # fixed eval noise
            total_seconds=[s[-1] for s in seconds])

    fig, (ax_img, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (script, c) in enumerate(summary.items()):
        label = f"{script[: -len('.py')]} ({len(curves[script])} seeds)"
        for ax, x in ((ax_img, c["images"]), (ax_time, c["seconds"])):
            ax.plot(x, smooth(c["mean"]), color=f"C{i}", label=label)
            ax.fill_between(x, smooth(c["low"]), smooth(c["high"]), color=f"C{i}", alpha=0.15)
    for ax, xlabel in ((ax_img, "sampled images"), (ax_time, "training wall-clock, seed mean (s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean brightness of the epoch's rollouts")
        ax.legend()
    fig.suptitle(f"Toy learning: seed mean, {SMOOTH}-epoch trailing mean; bands = min-max over seeds")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)

    # sample efficiency: images until an algorithm's smoothed seed-mean curve first reaches the reward GRPO's curve has
    # at half the budget, and at the full budget
    grpo = smooth(summary["grpo_sd35.py"]["mean"]) if "grpo_sd35.py" in summary else None
    targets = {} if grpo is None else {"half": grpo[len(grpo) // 2 - 1], "full": grpo[-1]}

    def images_to(c: dict, level: float) -> str:
        return next((str(n) for n, r in zip(c["images"], smooth(c["mean"])) if r >= level), "not reached")

    print(f"\n{args.images} sampled images per run; reward = mean image brightness in [0, 1]; final = mean of the "
          f"last {SMOOTH} epochs; gain/spread = (final - first) / first epoch's within-epoch reward std\n")
    print(f"| script | seeds | first-epoch reward | final reward | gain | gain / spread | eval gain (fixed noise, ODE) "
          f"| images to GRPO's reward at {args.images // 2} images | images to GRPO's reward at {args.images} images "
          "| training seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for script, c in summary.items():
        gains = [b - a for a, b in zip(c["first"], c["final"])]
        ratios = [g / s for g, s in zip(gains, c["spread"])]
        print(f"| {script[: -len('.py')]} | {len(c['first'])} | {mean(c['first']):.4f} | {mean(c['final']):.4f} ± "
              f"{std(c['final']):.4f} | {mean(gains):+.4f} ± {std(gains):.4f} | {mean(ratios):+.1f} ± {std(ratios):.1f} | "
              f"{mean(c['eval_gain']):+.4f} ± {std(c['eval_gain']):.4f} | "
              + " | ".join(images_to(c, level) for level in targets.values()) + f" | {mean(c['total_seconds']):.1f} |")


if __name__ == "__main__":
    main(tyro.cli(Args))
