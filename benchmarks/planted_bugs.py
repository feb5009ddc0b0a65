"""Plant small, realistic bugs one at a time and see which the quick test tier catches.

Each bug in BUGS is a one-line text change (an EMA decay inverted, a flag replaced by its
default, a checkpoint field not restored, ...): the bugs issue 54 found the suite let through,
and a few more. A bug in the plumbing the SD3.5 scripts share is planted in all four copies, as
a developer who keeps them in step would. For each, the tracked tree is copied to a temporary
folder, the change is made there (exactly once a file), and `pytest -m quick` runs on the copy,
without tests/test_boilerplate.py: its copy and budget checks would flag any edit, so a catch
here is a test of behaviour. The table says which test caught each first.

    python benchmarks/planted_bugs.py                # every bug, 2 at a time (CPU: ~10 min)
    python benchmarks/planted_bugs.py --bugs nft-ema-inverted --jobs 1
    python benchmarks/planted_bugs.py --pytest-args "-k not learning"   # the full suite's tests

Writes one JSON line per bug to --log (benchmarks/planted_bugs.jsonl) and prints the table.
The unchanged tree must pass the same tests first (checked once, as the row `none`).
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SD35 = ("grpo_sd35.py", "nft_sd35.py", "awm_sd35.py", "crd_sd35.py")
# name: (files, the text as it is, the text with the bug), each a realistic one-line slip
BUGS = {
    "nft-ema-inverted": (
        "nft_sd35.py", "ema.mul_(decay).add_(p.detach(), alpha=1 - decay)",
        "ema.mul_(1 - decay).add_(p.detach(), alpha=decay)"),
    "on-policy-check-vs-own-mean": (
        "grpo_sd35.py", "on_policy.append((ratio.detach() - 1).abs())",
        "on_policy.append((ratio.detach() - ratio.detach().mean()).abs())"),
    "grpo-kl-beta-fixed": (
        "grpo_sd35.py", "kl_beta=args.kl_beta, accum_steps=accum_steps)",
        "kl_beta=0.04, accum_steps=accum_steps)"),
    "card-prints-the-final-eval": (
        SD35, "before=evals[0][1], after=after,",
        "before=evals[0][1], after=evals[-1][1],"),
    "prompt-file-drops-unterminated-last-line": (
        SD35, "lines = [line.strip() for line in file if line.strip()]",
        'lines = [line.strip() for line in file if line.endswith("\\n") and line.strip()]'),
    "resume-forgets-the-ema": (
        SD35, "zip(lora_params + ema_params + sum(snapshots.values(), []), saved)",
        "zip(lora_params + [p.clone() for p in ema_params]"
        " + sum(snapshots.values(), []), saved)"),
    "nft-beta-mix-swapped": (
        "nft_sd35.py", "positive = normalised_error(beta * v + (1 - beta) * v_old)",
        "positive = normalised_error((1 - beta) * v + beta * v_old)"),
    "crd-missing-hub-import": (
        "crd_sd35.py", "import huggingface_hub\n", ""),
    "resume-forgets-the-optimizer": (
        SD35, 'optimizer.load_state_dict(state["optimizer"])',
        'optimizer.state_dict()  # load_state_dict(state["optimizer"])'),
    "checksum-never-verified": (
        SD35, "if hashlib.sha256(data).hexdigest() != digest:", "if False:"),
    "awm-anchor-weight-fixed": (
        "awm_sd35.py", "anchor_beta=args.anchor_beta, accum_steps=accum_steps)",
        "anchor_beta=1.0, accum_steps=accum_steps)"),
    "dance-ema-never-moves": (
        "dance_grpo_flux.py", "ema.mul_(decay).add_(p.detach(), alpha=1 - decay)",
        "ema.mul_(1.0).add_(p.detach(), alpha=0.0)"),
}


def planted_copy(bug: str | None) -> Path:
    """The tracked tree in a temporary folder, with `bug` planted (None: unchanged)."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.splitlines()
    copy = Path(tempfile.mkdtemp(prefix=f"planted-{bug or 'none'}-"))
    for name in listed:
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    if bug:
        files, before, after = BUGS[bug]
        for file in [files] if isinstance(files, str) else files:
            text = (copy / file).read_text()
            if text.count(before) != 1:
                raise SystemExit(f"{bug}: {before!r} is {text.count(before)} times in {file}")
            (copy / file).write_text(text.replace(before, after))
    return copy


def run_quick_tier(bug: str | None, pytest_args: list[str]) -> dict:
    copy = planted_copy(bug)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               CUDA_VISIBLE_DEVICES="")
    start = time.perf_counter()
    process = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *pytest_args],
        cwd=copy, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in process.stdout.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    shutil.rmtree(copy, ignore_errors=True)
    files = BUGS[bug][0] if bug else ""
    return {"bug": bug or "none", "file": files if isinstance(files, str) else "the SD3.5 four",
            "caught": process.returncode != 0, "by": failed[0] if failed else "",
            "seconds": round(seconds, 1), "pytest_args": pytest_args}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bugs", nargs="+", default=list(BUGS), choices=list(BUGS))
    parser.add_argument("--pytest-args", default="-m quick --ignore tests/test_boilerplate.py",
                        help="what pytest runs on each copy (default: the quick tier)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--log", default=str(REPO / "benchmarks" / "planted_bugs.jsonl"))
    args = parser.parse_args()
    pytest_args = shlex.split(args.pytest_args)
    clean = run_quick_tier(None, pytest_args)
    if clean["caught"]:
        raise SystemExit(f"the unchanged tree fails `pytest {args.pytest_args}`: {clean['by']}")
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda bug: run_quick_tier(bug, pytest_args), args.bugs))
    with open(args.log, "a") as file:
        for row in [clean, *rows]:
            file.write(json.dumps(row) + "\n")
    print(f"`pytest {args.pytest_args}` on each planted bug (unchanged tree: passes, "
          f"{clean['seconds']:.0f} s)\n\n| bug | file | caught by | seconds |\n|---|---|---|---|")
    for row in rows:
        by = f"`{row['by']}`" if row["caught"] else "**not caught**"
        print(f"| {row['bug']} | {row['file']} | {by} | {row['seconds']:.0f} |")
    print(f"\n{sum(row['caught'] for row in rows)} of {len(rows)} caught")


if __name__ == "__main__":
    main()
