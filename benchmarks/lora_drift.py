"""How far the LoRA moves the model along the toy-world demos: eval/lora_drift's healthy values.

Every script logs eval/lora_drift at each eval (eval/final_lora_drift after the last epoch): per
eval sample, |v_lora - v_base| / |v_base| of the transformer's velocity at the first eval sigma,
v_base being the same transformer with its LoRA adapters disabled, averaged over the samples.
It is 0 before training (LoRA B matrices start at 0). This runs the five CPU demo lines of
docs/toy_world.md exactly as printed, plus `--eval-every epochs/4` (about 5 evals each, the
epoch-0 one included) at the default eval seed, and reads the drift and the eval reward of each
eval from the run's metrics.jsonl.

    python benchmarks/lora_drift.py                    # 5 demos, 2 at a time (CPU: ~30 min)
    python benchmarks/lora_drift.py --scripts nft crd --jobs 1

Writes one JSON line per run to --log (benchmarks/lora_drift.jsonl):
{"script", "flags", "evals": [[epochs trained, eval reward, drift], ...]}; prints the table.
"""

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from same_behaviour import main_args, readme_demos  # noqa: E402  (the five demo lines)
from toy_demos import SCRIPTS, run  # noqa: E402  (run: one CPU process, toy_demos' env)


def evals(metrics: list[dict]) -> list[list]:
    """[epochs trained, eval reward, drift] of each eval: eval/* rows log the epoch they were
    made before, eval/final_* the last epoch, after which they are made."""
    rows = []
    for row in metrics:
        for prefix, trained in (("eval/", row["epoch"]), ("eval/final_", row["epoch"] + 1)):
            if prefix + "reward_mean" in row:
                rows.append([trained, row[prefix + "reward_mean"],
                             row.get(prefix + "lora_drift")])
    return rows


def one_run(name: str, flags: list[str], work: Path) -> dict:
    epochs = main_args(SCRIPTS[name], flags).epochs  # `--toy`: TOY's, unless --epochs is given
    flags = [*flags, "--eval-every", str(max(1, round(epochs / 4)))]
    out = work / name
    out.mkdir()
    run([SCRIPTS[name], *flags, "--output-dir", str(out)], out / "log.txt")
    (run_dir,) = [path for path in out.iterdir() if path.is_dir()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"script": SCRIPTS[name], "flags": flags, "evals": evals(metrics)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--log", default=str(REPO / "benchmarks" / "lora_drift.jsonl"))
    args = parser.parse_args()
    lines = readme_demos()
    work = Path(tempfile.mkdtemp(prefix="lora-drift-"))
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda name: one_run(name, lines[SCRIPTS[name]], work),
                             args.scripts))
    with open(args.log, "a") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")
    print("| script | lora_drift at epochs trained | final eval reward |\n|---|---|---|")
    for row in rows:
        drifts = ", ".join(f"{epochs}: {drift:.3f}" if drift is not None else f"{epochs}: -"
                           for epochs, _, drift in row["evals"])
        print(f"| {row['script']} | {drifts} | {row['evals'][-1][1]:.3f} |")


if __name__ == "__main__":
    main()
