"""The toy-world demo table on noise the recipes were not tuned on (docs/toy_world.md).

Each demo line of docs/toy_world.md ("CPU demo") trains at the given seeds exactly as printed
(its evals use the tuning noise, --eval-seeds 42, on which the recipes were chosen). Its final
EMA LoRA and the base model are then scored with `--eval-only` on the reporting noise: the 96
held-out lines, each sampled once per reporting seed (default 16 seeds, 1,536 samples), seeds
no recipe was ever chosen on. The gain is after - before on that noise; its standard error
combines the two evals' (each the std of the samples / sqrt(count)).

    python benchmarks/toy_demos.py                      # 5 demos x seeds 42 1 2 (CPU: ~1 h)
    python benchmarks/toy_demos.py --scripts grpo --seeds 42 --jobs 1
    python benchmarks/toy_demos.py --flags grpo="--learning-rate 2e-3"   # a recipe to try

Writes one JSON line per run to --log (benchmarks/toy_demos.jsonl) and prints the table.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"grpo": "grpo_sd35.py", "nft": "nft_sd35.py", "awm": "awm_sd35.py",
           "crd": "crd_sd35.py", "dance": "dance_grpo_flux.py"}
REPORTING = list(range(100, 116))  # never used to choose a recipe
sys.path.insert(0, str(REPO / "benchmarks"))
from same_behaviour import readme_demos as demo_lines  # noqa: E402  (the five demo lines)


def run(command: list[str], log: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    with open(log, "w") as out:
        process = subprocess.run([sys.executable, *command], cwd=REPO, env=env, stdout=out,
                                 stderr=subprocess.STDOUT)
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: see {log}")


def evaluate(script: str, flags: list[str], seeds: list[int], work: Path,
             checkpoint: Path | None) -> dict:
    """--eval-only on the given eval seeds: of the checkpoint's EMA, or of the base model."""
    out = Path(tempfile.mkdtemp(dir=work))
    extra = ["--resume", str(checkpoint)] if checkpoint else []
    run([script, *flags, "--eval-only", *extra, "--output-dir", str(out),
         "--eval-seeds", *map(str, seeds)], out / "log.txt")
    (run_dir,) = [path for path in out.iterdir() if path.is_dir()]
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


def one_run(name: str, flags: list[str], seed: int, seeds: list[int], work: Path,
            base: dict) -> dict:
    script = SCRIPTS.get(name, name)  # a copy of a script: its file name
    out = work / f"{name}-{seed}"
    out.mkdir()
    run([script, *flags, "--seed", str(seed), "--output-dir", str(out)], out / "log.txt")
    (run_dir,) = [path for path in out.iterdir() if path.is_dir()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = sorted((run_dir / "checkpoints").iterdir())[-1]
    after = evaluate(script, flags, seeds, work, final)
    gain = after["eval/reward_mean"] - base["eval/reward_mean"]
    stderr = (after["eval/reward_stderr"] ** 2 + base["eval/reward_stderr"] ** 2) ** 0.5
    return {"demo": name, "seed": seed, "flags": flags, "reporting_seeds": seeds,
            "tuning_before": metrics[0]["eval/reward_mean"],
            "tuning_after": metrics[-1]["eval/final_reward_mean"],
            "before": base["eval/reward_mean"], "after": after["eval/reward_mean"],
            "gain": gain, "gain_stderr": stderr,
            "diversity": after.get("eval/diversity"), "checkpoint": final.name}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", default=list(SCRIPTS),
                        help="demo names, or a copy's file (rloo_sd35.py: its --toy)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 1, 2])
    parser.add_argument("--report-seeds", nargs="+", type=int, default=REPORTING)
    parser.add_argument("--flags", nargs="*", default=[],
                        help="name=\"flags\": appended to that demo's line")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--log", default=str(REPO / "benchmarks" / "toy_demos.jsonl"))
    args = parser.parse_args()
    lines = demo_lines()
    extra = dict(item.split("=", 1) for item in args.flags)
    work = Path(tempfile.mkdtemp(prefix="toy-demos-"))
    flags = {name: lines.get(SCRIPTS.get(name, name), ["--toy"])
             + shlex.split(extra.get(name, "")) for name in args.scripts}
    with ThreadPoolExecutor(args.jobs) as pool:  # the base model, once per demo line
        bases = dict(zip(args.scripts, pool.map(
            lambda name: evaluate(SCRIPTS.get(name, name), flags[name], args.report_seeds,
                                  work, None),
            args.scripts)))
        jobs = [(name, seed) for name in args.scripts for seed in args.seeds]
        rows = list(pool.map(lambda job: one_run(job[0], flags[job[0]], job[1],
                                                 args.report_seeds, work, bases[job[0]]),
                             jobs))
    with open(args.log, "a") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")
    print(f"reporting noise: seeds {args.report_seeds[0]}..{args.report_seeds[-1]} "
          f"({len(args.report_seeds)} per held-out line)")
    print("| demo | before | gain at seeds " + " / ".join(map(str, args.seeds))
          + " (± s.e.) | mean gain |\n|---|---|---|---|")
    for name in args.scripts:
        mine = [row for row in rows if row["demo"] == name]
        gains = " / ".join(f"{row['gain']:+.3f} ± {row['gain_stderr']:.3f}" for row in mine)
        mean = sum(row["gain"] for row in mine) / len(mine)
        print(f"| {name} | {mine[0]['before']:.3f} | {gains} | {mean:+.3f} |")


if __name__ == "__main__":
    main()
