"""What CRD's bf16 master weights (issue 56, upstream's default) do on the toy world.

The CRD demo (`crd_sd35.py --toy`) trains in fp32. This runs it under `--mixed-precision bf16`
twice per training seed, with the master weights (LoRA, AdamW's state, EMA, snapshots) in bf16
(the default) and in fp32 (`--fp32-master-weights`), saving every epoch. It reports:

- how far each snapshot moves per epoch: the share of its gap to the LoRA that the epoch's
  blend closed, ||s_e - s_(e-1)|| / ||lora_e - s_(e-1)|| (1 - decay in exact arithmetic);
- the gain on the reporting noise (eval seeds 100-115), as benchmarks/toy_demos.py scores it.

    python benchmarks/crd_precision.py                  # seed 42 (CPU: ~6 min)
    python benchmarks/crd_precision.py --seeds 42 1 2
    python benchmarks/crd_precision.py --extra="--old-decay 0 0.999 0 0.999"   # the long run's

Writes one JSON line per run to --log (benchmarks/crd_precision.jsonl) and prints the table.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from toy_demos import REPORTING, evaluate, run  # noqa: E402

SCRIPT = "crd_sd35.py"
FLAGS = ["--toy", "--mixed-precision", "bf16", "--save-every", "1"]
MASTERS = {"bf16": [], "fp32": ["--fp32-master-weights"]}


def closed_gaps(run_dir: Path) -> dict[str, list[float]]:
    """Per snapshot, the share of its gap to the LoRA each epoch's blend closed."""
    saves = sorted((run_dir / "checkpoints").iterdir())
    states = [torch.load(save / "state.pt", map_location="cpu") for save in saves]
    shares = {}
    for name in states[0]["extra"]:
        shares[name] = []
        for before, after in zip(states, states[1:]):
            snapshot = torch.cat([p.double().flatten() for p in before["extra"][name]])
            lora = torch.cat([p.double().flatten() for p in after["lora"]])
            moved = torch.cat([p.double().flatten() for p in after["extra"][name]])
            gap = (lora - snapshot).norm()
            shares[name].append(float((moved - snapshot).norm() / gap) if gap else 0.0)
    return shares


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[42])
    parser.add_argument("--extra", default="", help="flags appended to the demo's")
    parser.add_argument("--log", default=str(REPO / "benchmarks" / "crd_precision.jsonl"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="crd-precision-"))
    base = evaluate(SCRIPT, FLAGS, REPORTING, work, None)
    rows = []
    for seed in args.seeds:
        for master, extra in MASTERS.items():
            out = work / f"{master}-{seed}"
            out.mkdir()
            flags = FLAGS + extra + args.extra.split()
            run([SCRIPT, *flags, "--seed", str(seed), "--output-dir", str(out)],
                out / "log.txt")
            (run_dir,) = [path for path in out.iterdir() if path.is_dir()]
            final = sorted((run_dir / "checkpoints").iterdir())[-1]
            after = evaluate(SCRIPT, flags, REPORTING, work, final)
            gain = after["eval/reward_mean"] - base["eval/reward_mean"]
            stderr = (after["eval/reward_stderr"] ** 2 + base["eval/reward_stderr"] ** 2) ** 0.5
            rows.append({"master": master, "seed": seed, "flags": flags,
                         "before": base["eval/reward_mean"], "after": after["eval/reward_mean"],
                         "gain": gain, "gain_stderr": stderr,
                         "closed_per_epoch": closed_gaps(run_dir)})
    with open(args.log, "a") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")
    print(f"extra flags: {args.extra or 'none'}")
    print("| master weights | seed | gain (± s.e.) | old: gap closed per epoch, first / last "
          "| sampling: first / last |\n|---|---|---|---|---|")
    for row in rows:
        old = row["closed_per_epoch"]["old"]
        sampling = row["closed_per_epoch"]["sampling"]
        print(f"| {row['master']} | {row['seed']} | {row['gain']:+.3f} ± "
              f"{row['gain_stderr']:.3f} | {old[0]:.4f} / {old[-1]:.4f} "
              f"| {sampling[0]:.4f} / {sampling[-1]:.4f} |")


if __name__ == "__main__":
    main()
