"""Learning at toy scale: all five scripts on the tiny random pipelines with a reward the tiny model can move.

Every script is launched exactly as a user would (subprocess, CPU, fp32) on tests/tiny.py's pipelines with
`--reward tests/toy_rewards.py:brightness`, at an equal budget of sampled images, for a few seeds; reward is read from
each run's metrics.jsonl. Writes benchmarks/toy_learning.png (reward vs images and vs wall-clock) and prints a
markdown table for benchmarks/RESULTS.md. Needs matplotlib (`pip install matplotlib`). About 10 minutes on 2 cores:

    python benchmarks/toy_learning.py --seeds 0 1 2 --images 256
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
          "--save-every", "100000", "--max-sequence-length", "16", "--mixed-precision", "no", "--learning-rate", "1e-2"]
# Per-script settings for the toy: each algorithm's own knobs relaxed the same way its learning test does
# (no KL to the base model, wider trust regions), everything else at the script's defaults.
ALGORITHMS = {
    "grpo_sd35.py": ["--kl-beta", "0", "--clip-range", "0.2"],
    "nft_sd35.py": ["--kl-beta", "0"],
    "awm_sd35.py": ["--kl-beta", "0"],
    "crd_sd35.py": ["--kl-beta", "0"],
    "dance_grpo_flux.py": ["--clip-range", "0.2", "--noise-level", "1.0", "--timestep-fraction", "1.0"],
}


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """seeds per algorithm"""
    images: int = 256
    """sampled-image budget per run (identical for every algorithm)"""
    out: str = os.path.join(REPO, "benchmarks", "toy_learning.png")
    """where the figure goes"""


def run(script: str, model: str, seed: int, images: int, workdir: str) -> list[dict]:
    out = tempfile.mkdtemp(dir=workdir)
    epochs = images // 8  # 2 prompts x 4 images per epoch
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

    fig, (ax_img, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    rows = []
    for script, runs in curves.items():
        name = script[: -len(".py")]
        for i, metrics in enumerate(runs):
            images = [8 * (m["epoch"] + 1) for m in metrics]
            seconds, total = [], 0.0
            for m in metrics:
                total += m["perf/epoch_seconds"]
                seconds.append(total)
            rewards = [m["reward/mean"] for m in metrics]
            color = f"C{list(curves).index(script)}"
            ax_img.plot(images, rewards, color=color, alpha=0.7, label=name if i == 0 else None)
            ax_time.plot(seconds, rewards, color=color, alpha=0.7, label=name if i == 0 else None)
        first = [r[0]["reward/mean"] for r in runs]
        last = [sum(m["reward/mean"] for m in r[-4:]) / len(r[-4:]) for r in runs]
        gains = [b - a for a, b in zip(first, last)]
        secs = [sum(m["perf/epoch_seconds"] for m in r) for r in runs]
        eval_gains = [r[-1]["eval/final_reward_mean"] - r[0]["eval/reward_mean"] for r in runs]  # fixed eval noise
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        std = lambda xs: (sum((x - mean(xs)) ** 2 for x in xs) / len(xs)) ** 0.5  # noqa: E731
        rows.append(f"| {name} | {len(runs)} | {mean(first):.4f} | {mean(last):.4f} ± {std(last):.4f} | "
                    f"{mean(gains):+.4f} ± {std(gains):.4f} | {mean(eval_gains):+.4f} ± {std(eval_gains):.4f} | "
                    f"{mean(secs):.0f} |")
    for ax, xlabel in ((ax_img, "sampled images"), (ax_time, "training wall-clock (s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean brightness reward of the epoch's rollouts")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"\n{args.images} sampled images per run; reward = mean image brightness; final = mean of the last 4 epochs\n")
    print("| script | seeds | first-epoch reward | final reward | gain | eval gain (fixed noise, ODE) | seconds |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main(tyro.cli(Args))
