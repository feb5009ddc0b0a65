"""The healthy range of every logged metric, from each script's toy-world demo at three seeds.

Each script's `--toy` demo (docs/toy_world.md) trains at seeds 42, 1 and 2 exactly as a reader
runs it; this reads every epoch line of their metrics.jsonl and reports, per metric, the range
the three runs spanned (min and max over all epochs and seeds) and each seed's own range. The
docs pages quote these ranges as "healthy": a run of the demo outside them is unlike all three.

    python benchmarks/healthy_ranges.py                     # 5 demos x 3 seeds (CPU: ~40 min)
    python benchmarks/healthy_ranges.py --scripts crd --seeds 42
    python benchmarks/healthy_ranges.py --report --keys losses/ charts/ reward/mean   # the log's

Writes one JSON line per run to --log (benchmarks/healthy_ranges.jsonl: the demo, the seed,
{metric: [min, max]} over its epochs) and prints a Markdown table per demo. Timings (perf/*) and
counters (charts/global_step) are left out: they say how fast, not how healthy.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"grpo": "grpo_sd35.py", "nft": "nft_sd35.py", "awm": "awm_sd35.py",
           "crd": "crd_sd35.py", "dance": "dance_grpo_flux.py"}
SKIPPED = ("perf/", "charts/global_step", "charts/learning_rate")


def one_run(name: str, seed: int, work: Path) -> dict:
    """The demo at one seed; {metric: [min, max]} over its epoch lines."""
    out = work / f"{name}-{seed}"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, SCRIPTS[name], "--toy", "--seed", str(seed),
               "--output-dir", str(out)]
    process = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{process.stderr[-3000:]}")
    (run_dir,) = [path for path in out.iterdir() if path.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and key != "epoch" and not key.startswith(SKIPPED):
                values.setdefault(key, []).append(value)
    ranges = {key: [min(v), max(v)] for key, v in sorted(values.items())
              if all(math.isfinite(x) for x in v)}
    return {"demo": name, "seed": seed, "epochs": len(rows), "ranges": ranges}


def table(rows: list[dict], keys: tuple[str, ...] = ("",)) -> str:
    """Markdown: metric | the three seeds' range | each seed's range (the metrics that start
    with one of `keys`)."""
    seeds = [row["seed"] for row in rows]
    lines = [f"| metric | seeds {', '.join(map(str, seeds))} | "
             + " | ".join(f"seed {seed}" for seed in seeds) + " |",
             "|---" * (2 + len(seeds)) + "|"]
    for key in [key for key in rows[0]["ranges"] if key.startswith(keys)]:
        each = [row["ranges"].get(key) for row in rows]
        known = [pair for pair in each if pair]
        low, high = min(p[0] for p in known), max(p[1] for p in known)
        cells = [f"{p[0]:.3g} – {p[1]:.3g}" if p else "–" for p in each]
        lines.append(f"| `{key}` | {low:.3g} – {high:.3g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--log", default=str(REPO / "benchmarks" / "healthy_ranges.jsonl"))
    parser.add_argument("--report", action="store_true", help="tables of --log's runs, no run")
    parser.add_argument("--keys", nargs="+", default=[""], help="metric prefixes to report")
    args = parser.parse_args()
    if args.report:
        rows = [json.loads(line) for line in Path(args.log).read_text().splitlines()]
        rows = [row for row in rows if row["demo"] in args.scripts and row["seed"] in args.seeds]
    else:
        work = Path(tempfile.mkdtemp(prefix="healthy-"))
        jobs = [(name, seed) for name in args.scripts for seed in args.seeds]
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(lambda job: one_run(*job, work), jobs))
        with open(args.log, "a") as file:
            for row in rows:
                file.write(json.dumps(row) + "\n")
    for name in args.scripts:
        print(f"\n{name} ({SCRIPTS[name]} --toy)\n")
        print(table([row for row in rows if row["demo"] == name], tuple(args.keys)))


if __name__ == "__main__":
    main()
