"""Same behaviour: run the training scripts in a reference tree and a candidate tree, and check
that every output is identical (issue 39, item 8: a refactor must change nothing, bit for bit).

For each named configuration (CONFIGS below: tiny random pipelines, the README's toy-world demos)
it runs the script in both trees, on CPU, and compares each pair of runs:
- metrics.jsonl: every line, every key but perf/* (timings), exactly (NaN equals NaN, and an int
  is not a float);
- eval_*.png: the same files with the same pixels;
- checkpoints/epoch_*: state.pt (every tensor: LoRA, EMA, snapshots, optimizer state; next_epoch,
  global_step, the args but IGNORED_ARGS), every *.safetensors (names, tensors and metadata: the
  adapter config), *.json, the sharded DCP state of full fine-tuning, any other file byte by byte;
- stdout (and a failing run's last stderr line) with timings and paths masked: reported, a
  failure only with --strict-stdout.
It prints one line per configuration and process count (`same`, or `DIFFERENT:` and the first
difference: file, key or tensor, max abs difference) and exits 1 if any differs or fails.

Reference runs are cached in --cache, keyed by (revision, script, configuration, nproc), so
re-checking a candidate re-runs only the candidate. A revision is checked out once with
`git worktree add --detach` into the cache; --reference may also be any directory.

    source venv/bin/activate    # from the repository root; the candidate is this tree
    python benchmarks/same_behaviour.py --reference ce4f031 --scripts grpo --configs 'tiny*'
    python benchmarks/same_behaviour.py --reference ce4f031    # all: ~1 h of one CPU core
    python benchmarks/same_behaviour.py --reference ce4f031 --candidate ../other-tree \
        --configs demo-short --jobs 2
    python benchmarks/same_behaviour.py --list                 # the configurations and flags

One tree's runs took, on one core of a shared CPU machine (each line prints the seconds of the
reference and the candidate runs): the 64 tiny* checks (configuration x process count) ~11 min,
the five demo-short ~3 min, the five demos ~17 min; up to 3x that while other jobs load the
machine. Runs use one thread each (OMP_NUM_THREADS=1), HF_HUB_OFFLINE=1, WANDB_MODE=disabled,
no GPU (CUDA_VISIBLE_DEVICES=""), and `torch.distributed.run --standalone` (gloo) for 2
processes.
"""

import argparse
import contextlib
import dataclasses
import fcntl
import fnmatch
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ["grpo_sd35.py", "nft_sd35.py", "awm_sd35.py", "crd_sd35.py", "dance_grpo_flux.py"]
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                     "flowrl-same-behaviour")
# Saved args that name this run's own directories, which differ between any two runs.
IGNORED_ARGS = {"output_dir", "resume"}


# ---- the configurations --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    """A run of a script: `flags` (--output-dir is added; TINY_MODEL becomes the tiny pipeline
    built in the cache) under 1 or 2 processes (--batch-size is divided by the count).
    kind: `train`; `resume`: train, then a copy of the run resumed from its epoch_00001;
    `eval-only`: train, then --eval-only of its last checkpoint; `fails`: the run must exit
    non-zero (a non-finite loss)."""
    flags: list[str]
    nprocs: tuple[int, ...] = (1,)
    kind: str = "train"


TINY_MODEL = "<tiny>"


def tiny(*extra: str) -> list[str]:
    """tests/scripts_harness.py tiny_sd35_flags (fp32), which the FLUX tests use too, + extra."""
    return ["--model", TINY_MODEL, "--train-prompts", "tests/assets/ocr_prompts.txt",
            "--test-prompts", "tests/assets/ocr_prompts.txt",
            "--reward", "tests/toy_rewards.py:brightness", "--resolution", "32",
            "--num-steps", "4", "--eval-num-steps", "3", "--group-size", "4",
            "--prompts-per-epoch", "2", "--batch-size", "4", "--eval-batch-size", "2",
            "--eval-every", "1", "--save-every", "1", "--max-sequence-length", "16",
            "--mixed-precision", "no", *extra]


def readme_demos() -> dict[str, list[str]]:
    """{script: flags} of the five CPU demo lines (docs/toy_world.md, "CPU demo"):
    `OMP_NUM_THREADS=1 python SCRIPT --toy`, so flags == ["--toy"] (TOY's flags the defaults,
    any flag after it wins); the variables set before `python` are left out."""
    text = (REPO / "docs" / "toy_world.md").read_text()
    block = text.split("CPU demo", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    demos = {}
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        argv = shlex.split(line)
        while argv and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # OMP_NUM_THREADS=1
            argv = argv[1:]
        if argv[:1] == ["python"]:
            demos[argv[1]] = argv[2:]
    return demos


def main_args(script: str, flags: list[str]):
    """The Args that `script`'s main makes of `flags`: with --toy, the script's TOY are the
    defaults and the flags given win (what a `--toy` demo line trains with, spelled out)."""
    import importlib

    import tyro
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    module = importlib.import_module(script[: -len(".py")])
    args = tyro.cli(module.Args, args=flags)
    if args.toy:
        args = tyro.cli(module.Args, args=flags, default=module.Args(**module.TOY, toy=True))
    return args


BF16 = ["--mixed-precision", "bf16"]
NAN = ["--epochs", "3", "--reward", "tests/toy_rewards.py:nan_after_two_batches",
       "--eval-reward", "tests/toy_rewards.py:brightness"]
SHORT = ["--epochs", "3", "--eval-every", "1", "--save-every", "1"]  # demo-short


def standard(base: list[str], nan: bool = True) -> dict[str, Config]:
    """What every script runs: its test flags (base, 2 epochs) under 1 and 2 processes, in
    bf16 too, resumed, evaluated from a checkpoint, and stopped by a non-finite loss."""
    configs = {"tiny": Config(tiny(*base), (1, 2)),
               "tiny-bf16": Config(tiny(*base, *BF16), (1, 2)),
               "tiny-resume": Config(tiny(*base), kind="resume"),
               "tiny-eval-only": Config(tiny(*base), kind="eval-only")}
    if nan:
        configs["tiny-nan"] = Config(tiny(*base, *NAN), kind="fails")
    return configs


# Recipes of the tests (tests/test_*_sd35.py, tests/test_dance_grpo_flux*.py).
GRPO_FAST = ["--sde-window-size", "2", "--sde-window-range", "0", "3", "--sde-kind", "cps",
             "--noise-level", "0.8", "--clip-range", "1e-5", "--guidance-scale", "1",
             "--kl-beta", "0.04"]  # Flow-GRPO-Fast and CPS without CFG
GRPO_GUARD = ["--trust-region", "ratio-norm", "--clip-range", "2e-6", "--learning-rate", "1e-4",
              "--kl-beta", "0", "--per-group-std"]  # GRPO-Guard over every step
GRPO_DPPO = ["--trust-region", "dppo", "--sde-window-size", "2", "--sde-window-range", "0", "3",
             "--kl-beta", "0", "--learning-rate", "1e-2", "--updates-per-epoch", "2"]
GRPO_MIX = ["--sde-window-size", "2", "--sde-window-range", "0", "4",
            "--window-shift-every", "1", "--epochs", "3"]  # MixGRPO's sliding window
GDPO = ["--reward", "tests/toy_rewards.py:brightness,tests/toy_rewards.py:redness=0.5",
        "--advantage-aggregation", "gdpo", "--per-group-std"]  # two rewards
AWM_FAST = ["--train-batch-size", "2", "--train-timesteps", "2"]
CRD = ["--kl-beta", "0.1", "--num-train-timesteps", "4"]
CRD_FROZEN = ["--old-decay", "0", "1", "0", "1", "--sampling-decay", "0", "0.5", "0", "0.5",
              "--batch-size", "8", "--updates-per-epoch", "1", "--ema-every", "1",
              "--num-train-timesteps", "6"]  # frozen old, half-blended sampler, EMA each epoch
DANCE_FULL = ["--full-finetune", "--learning-rate", "1e-3", "--clip-range", "0.2",
              "--weight-decay", "0"]
DANCE_EMA = ["--ema-decay", "0.9", "--no-init-same-noise"]
E2 = ["--epochs", "2"]

CONFIGS: dict[str, dict[str, Config]] = {
    "grpo_sd35.py": {
        **standard([*E2, "--kl-beta", "0.04"]),
        "tiny-fast": Config(tiny(*GRPO_FAST, *E2), (1, 2)),
        "tiny-fast-resume": Config(tiny(*GRPO_FAST, *E2), kind="resume"),
        "tiny-guard": Config(tiny(*GRPO_GUARD, *E2)),
        "tiny-guard-window": Config(tiny(*GRPO_GUARD, "--sde-window-size", "2", *E2), (1, 2)),
        "tiny-dppo": Config(tiny(*GRPO_DPPO, *E2), (1, 2)),
        "tiny-mix": Config(tiny(*GRPO_MIX)),
        "tiny-gdpo": Config(tiny(*GDPO, *E2)),
        "tiny-ema-interval": Config(tiny("--updates-per-epoch", "1", "--ema-interval", "2",
                                         "--kl-beta", "0", *E2)),
    },
    "nft_sd35.py": {
        **standard([*E2, "--kl-beta", "1e-4"], nan=False),  # its tests have no NaN run
        "tiny-decay0": Config(tiny(*E2, "--kl-beta", "1e-4", "--decay-type", "0")),
        "tiny-decay1": Config(tiny(*E2, "--kl-beta", "1e-4", "--decay-type", "1")),
        "tiny-gdpo": Config(tiny(*GDPO, *E2, "--kl-beta", "1e-4")),
    },
    "awm_sd35.py": {
        **standard([*AWM_FAST, *E2, "--kl-beta", "0.01"]),  # SA-Solver rollouts
        "tiny-flow-sde": Config(tiny(*AWM_FAST, *E2, "--sampler", "flow_sde",
                                     "--noise-level", "0.7")),
        "tiny-ode": Config(tiny(*AWM_FAST, *E2, "--sampler", "ode", "--anchor-beta", "0")),
        "tiny-discrete": Config(tiny(*AWM_FAST, *E2, "--time-type", "discrete")),
    },
    "crd_sd35.py": {
        **standard([*CRD, *E2]),
        "tiny-frozen": Config(tiny(*CRD, *CRD_FROZEN, *E2), (1, 2)),
        "tiny-gdpo": Config(tiny(*CRD, *GDPO, *E2)),
    },
    "dance_grpo_flux.py": {
        **standard(E2),
        "tiny-ema": Config(tiny(*DANCE_EMA, *BF16, *E2), (1, 2)),
        "tiny-window": Config(tiny("--sde-window-size", "2", "--sde-window-range", "0", "3",
                                   *E2), (1, 2)),
        "tiny-mix": Config(tiny("--sde-window-size", "2", "--sde-window-range", "0", "4",
                                "--window-shift-every", "1", "--epochs", "3")),
        "tiny-full": Config(tiny(*DANCE_FULL, *BF16, *E2)),
        "tiny-full-ema": Config(tiny(*DANCE_FULL, *DANCE_EMA, *E2), (1, 2)),
        "tiny-full-resume": Config(tiny(*DANCE_FULL, *BF16, *E2), kind="resume"),
        "tiny-full-eval-only": Config(tiny(*DANCE_FULL, *BF16, *E2), kind="eval-only"),
    },
}
# the README's demo, and 3 epochs of it: `--toy` (the reference tree must have it too)
for _script, _demo in readme_demos().items():
    CONFIGS[_script]["demo-short"] = Config(_demo + SHORT)
    CONFIGS[_script]["demo"] = Config(_demo)


# ---- running a configuration ---------------------------------------------------------------
def script_env(tree: Path) -> dict:
    """tests/scripts_harness.py script_env(), on CPU, with no launcher variables left over."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return env | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
                  "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(tree)}


def with_nproc(flags: list[str], nproc: int) -> list[str]:
    """The last --batch-size (the one that counts) divided among nproc processes; one process
    keeps the flags as they are (a `--toy` demo gives no --batch-size)."""
    flags = list(flags)
    if nproc == 1:
        return flags
    where = len(flags) - 1 - flags[::-1].index("--batch-size")
    flags[where + 1] = str(int(flags[where + 1]) // nproc)
    return flags


def launch(tree: Path, script: str, flags: list[str], nproc: int, stage: Path,
           timeout: float) -> dict:
    """Run a script in `tree` with its outputs under stage/out; returns what run.json holds."""
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "out").mkdir(parents=True)
    command = [sys.executable, script]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(nproc), script]
    start = time.perf_counter()
    with open(stage / "stdout.txt", "w") as out, open(stage / "stderr.txt", "w") as err:
        process = subprocess.run(command + flags + ["--output-dir", str(stage / "out")],
                                 cwd=tree, env=script_env(tree), stdout=out, stderr=err,
                                 timeout=timeout)
    run = {"returncode": process.returncode, "seconds": round(time.perf_counter() - start, 1)}
    (stage / "run.json").write_text(json.dumps(run))
    return run


def run_dir_of(stage: Path) -> Path | None:
    runs = [path for path in (stage / "out").iterdir() if path.is_dir()]
    return runs[0] if len(runs) == 1 else None


def run_config(tree: Path, script: str, config: Config, nproc: int, root: Path,
               models: dict[str, str], timeout: float) -> list[dict]:
    """All stages of one configuration under root/<stage>; returns their run.json contents."""
    model = models["flux" if "flux" in script else "sd3"]
    flags = [model if flag == TINY_MODEL else flag for flag in with_nproc(config.flags, nproc)]
    first = launch(tree, script, flags, nproc, root / "run1", timeout)
    runs = [first | {"stage": "run1"}]
    trained = run_dir_of(root / "run1")
    if config.kind in ("train", "fails") or first["returncode"] or trained is None:
        return runs
    if config.kind == "resume":  # a copy without the later checkpoints, as if stopped at 1
        copy = root / "copy" / trained.name
        shutil.rmtree(root / "copy", ignore_errors=True)
        shutil.copytree(trained, copy)
        for checkpoint in (copy / "checkpoints").glob("epoch_*"):
            if int(checkpoint.name.split("_")[1]) > 1:
                shutil.rmtree(checkpoint)
        extra = ["--resume", str(copy / "checkpoints" / "epoch_00001")]
    else:  # eval-only: the last checkpoint
        extra = ["--eval-only", "--resume", str(max((trained / "checkpoints").glob("epoch_*")))]
    second = launch(tree, script, flags + extra, nproc, root / "run2", timeout)
    if config.kind == "resume":  # the resumed run writes to the copy: that is its run
        shutil.rmtree(root / "run2" / "out")
        shutil.move(root / "copy", root / "run2" / "out")
    return runs + [second | {"stage": "run2"}]


# ---- comparing two runs --------------------------------------------------------------------
def same_value(a, b) -> bool:
    """Exact equality of JSON-like values: NaN equals NaN, an int is not a float."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def diff_tensors(a: torch.Tensor, b: torch.Tensor, where: str) -> list[str]:
    if a.dtype != b.dtype or a.shape != b.shape:
        return [f"{where}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"]
    equal = a == b
    if a.is_floating_point() or a.is_complex():
        equal |= a.isnan() & b.isnan()
    if bool(equal.all()):
        return []
    delta = (a.double() - b.double()).abs().nan_to_num(math.inf)
    return [f"{where}: max abs diff {float(delta.max()):.3g} "
            f"({int((~equal).sum())} of {a.numel()} elements differ)"]


def diff_objects(a, b, where: str, ignored: frozenset = frozenset()) -> list[str]:
    """Every difference of two nested dicts/lists/tensors/scalars (a dict's keys in `ignored`
    are skipped), each as `where[key][index]: what`."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return diff_tensors(a, b, where)
    if isinstance(a, dict) and isinstance(b, dict):
        keys_a, keys_b = set(a) - ignored, set(b) - ignored
        if keys_a != keys_b:
            return [f"{where}: keys only in reference {sorted(keys_a - keys_b, key=str)}, "
                    f"only in candidate {sorted(keys_b - keys_a, key=str)}"]
        return [line for key in sorted(keys_a, key=str)
                for line in diff_objects(a[key], b[key], f"{where}[{key!r}]")]
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [line for i, (x, y) in enumerate(zip(a, b))
                for line in diff_objects(x, y, f"{where}[{i}]")]
    return [] if same_value(a, b) else [f"{where}: {short(a)} vs {short(b)}"]


def short(value, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


NEW_METRICS_OK = False  # --new-metrics-ok: a metric or flag only the candidate has is no difference


def diff_metrics(a: Path, b: Path, name: str) -> list[str]:
    lines_a, lines_b = a.read_text().splitlines(), b.read_text().splitlines()
    if len(lines_a) != len(lines_b):
        return [f"{name}: {len(lines_a)} lines vs {len(lines_b)}"]
    found = []
    for number, (line_a, line_b) in enumerate(zip(lines_a, lines_b), 1):
        row_a, row_b = json.loads(line_a), json.loads(line_b)
        timings = frozenset(key for key in {*row_a, *row_b} if key.startswith("perf/"))
        if NEW_METRICS_OK:
            timings |= frozenset(set(row_b) - set(row_a))
        where = f"{name} line {number} (epoch {row_a.get('epoch')})"
        found += diff_objects(row_a, row_b, where, timings)
    return found


def diff_png(a: Path, b: Path, name: str) -> list[str]:
    image_a, image_b = Image.open(a), Image.open(b)
    if (image_a.mode, image_a.size) != (image_b.mode, image_b.size):
        return [f"{name}: {image_a.mode} {image_a.size} vs {image_b.mode} {image_b.size}"]
    pixels_a, pixels_b = np.asarray(image_a, np.int16), np.asarray(image_b, np.int16)
    differ = (pixels_a != pixels_b).reshape(*pixels_a.shape[:2], -1).any(-1)
    if not differ.any():
        return []
    y, x = np.argwhere(differ)[0]
    return [f"{name}: {int(differ.sum())} pixels differ, max abs diff "
            f"{int(np.abs(pixels_a - pixels_b).max())}, the first at (x={x}, y={y})"]


def load_safetensors(path: Path) -> dict:
    """Tensors and metadata; a JSON metadata value (a LoRA's adapter config) parsed."""
    with safe_open(path, "pt") as file:
        metadata = file.metadata() or {}
        tensors = {key: file.get_tensor(key) for key in file.keys()}
    for key, value in metadata.items():
        with contextlib.suppress(ValueError):
            metadata[key] = json.loads(value)
        if not isinstance(metadata[key], dict):
            continue
        # Not behaviour: peft keeps target_modules in a set and writes the set's order, which
        # follows the process's random string-hash seed (PYTHONHASHSEED): two runs of the same
        # code write two orders. Compared as a set.
        for name, modules in metadata[key].items():
            if name.endswith("target_modules") and isinstance(modules, list):
                metadata[key][name] = sorted(modules)
    return {"metadata": metadata, "tensors": tensors}


def load_dcp(path: Path) -> dict:
    """A torch.distributed.checkpoint directory (full fine-tuning's shards), gathered."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, f"{tmp}/state.pt")
        return torch.load(f"{tmp}/state.pt", map_location="cpu")


def card_contents(path: Path) -> dict:
    """A model card's metadata and text, its `Trained with` command as a set of flags with
    their values (the order of Args' fields is no behaviour)."""
    import huggingface_hub
    text = re.sub(r"/(reference|candidate)/[^/]+/", "/<tree>/", path.read_text())
    text = re.sub(r"__\d+__\d+_\w+/", "__<RUN>/", text)  # the run's start time
    card = huggingface_hub.ModelCard(text)
    head, _, rest = card.text.partition("Trained with `")
    command, _, tail = rest.partition("`")
    groups, words = [], shlex.split(command)
    for word in words[2:]:  # after `python SCRIPT`
        if word.startswith("--"):
            groups.append([word])
        else:
            groups[-1].append(word)
    return {"data": card.data.to_dict(), "text": head + tail, "command": words[:2],
            "flags": sorted(map(tuple, groups))}


def diff_file(a: Path, b: Path, name: str) -> list[str]:
    if name.endswith("state.pt.sha256"):  # state.pt's timings differ; state.pt is compared
        return []
    if name.endswith("README.md"):
        return diff_objects(card_contents(a), card_contents(b), name)
    if name.endswith("metrics.jsonl"):
        return diff_metrics(a, b, name)
    if name.endswith(".png"):
        return diff_png(a, b, name)
    if name.endswith("state.pt"):
        state_a, state_b = (torch.load(path, map_location="cpu") for path in (a, b))
        args_a = state_a.pop("args", {})
        args_b = state_b.pop("args", {})
        new_args = set(args_b) - set(args_a) if NEW_METRICS_OK else set()
        found = diff_objects(args_a, args_b, f"{name} args", frozenset(IGNORED_ARGS | new_args))
        for state in (state_a, state_b):  # DCP's .metadata holds its path and a random id
            state.get("dcp_sha256", {}).pop(".metadata", None)
        metrics_a, metrics_b = state_a.pop("metrics", {}), state_b.pop("metrics", {})
        ignored = {key for key in {*metrics_a, *metrics_b} if key.startswith("perf/")}
        if NEW_METRICS_OK:
            ignored |= set(metrics_b) - set(metrics_a)
        found += diff_objects(metrics_a, metrics_b, f"{name} metrics", frozenset(ignored))
        return found + diff_objects(state_a, state_b, name)
    if name.endswith(".safetensors"):
        return diff_objects(load_safetensors(a), load_safetensors(b), name)
    if name.endswith(".json"):
        return diff_objects(json.loads(a.read_text()), json.loads(b.read_text()), name)
    if a.is_dir():  # a DCP directory
        return diff_objects(load_dcp(a), load_dcp(b), name)
    return [] if a.read_bytes() == b.read_bytes() else [f"{name}: bytes differ"]


def output_files(run_dir: Path) -> list[str]:
    """The run's files relative to it, a DCP directory (dcp/) counted as one; metrics.jsonl
    first, then the eval sheets, then the checkpoints (the first difference is the most
    readable one)."""
    names = []
    for path in sorted(run_dir.rglob("*"), key=lambda path: (
            path.name != "metrics.jsonl", path.suffix != ".png", path)):
        relative = path.relative_to(run_dir)
        if path.is_file() and "dcp" not in relative.parts[:-1]:
            names.append(str(relative))
        elif path.is_dir() and path.name == "dcp":
            names.append(str(relative))
    return names


def diff_runs(a: Path, b: Path) -> list[str]:
    """Every output difference of two run directories (empty: the same)."""
    files_a, files_b = output_files(a), output_files(b)
    if files_a != files_b:
        return [f"files only in reference {sorted(set(files_a) - set(files_b))}, "
                f"only in candidate {sorted(set(files_b) - set(files_a))}"]
    return [line for name in files_a for line in diff_file(a / name, b / name, name)]


def masked_output(stage: Path, tree: Path, failed: bool) -> list[str]:
    """stdout (and a failed run's last stderr line: its error message) with paths, run-name
    timestamps and timings masked."""
    text = (stage / "stdout.txt").read_text()
    if failed:
        text += f"stderr: {(stage / 'stderr.txt').read_text().strip().splitlines()[-1:]}\n"
    for path, mark in [(stage.parent, "<ROOT>"), (tree, "<TREE>")]:
        text = text.replace(str(path), mark)
    for pattern, mark in [(r"run dir \S+", "run dir <DIR>"), (r"__\d{9,}\b", "__<TIME>"),
                          (r"[\d.]+ img/s", "<N> img/s"), (r"\| \d+s\b", "| <N>s")]:
        text = re.sub(pattern, mark, text)
    return text.splitlines()


def compare(config: Config, ref: tuple[Path, Path], cand: tuple[Path, Path],
            runs: tuple[list, list]) -> tuple[list[str], list[str]]:
    """(differences, stdout notes) of two executions of one configuration: each stage's exit
    status, outputs, and masked stdout."""
    found, notes = [], []
    if len(runs[0]) != len(runs[1]):
        found.append(f"{len(runs[0])} stages ran vs {len(runs[1])}")
    for run_a, run_b in zip(*runs):
        stage = run_a["stage"]
        stage_a, stage_b = ref[1] / stage, cand[1] / stage
        if run_a["returncode"] != run_b["returncode"]:
            last = (stage_b / "stderr.txt").read_text().strip().splitlines()[-1:]
            found.append(f"{stage}: exit status {run_a['returncode']} vs "
                         f"{run_b['returncode']} (candidate: {last})")
            continue
        dirs = run_dir_of(stage_a), run_dir_of(stage_b)
        if None in dirs:
            found.append(f"{stage}: no single run directory in {dirs}")
        else:
            found += [f"{stage}: {line}" for line in diff_runs(*dirs)]
        failed = bool(run_a["returncode"])
        lines_a = masked_output(stage_a, ref[0], failed)
        lines_b = masked_output(stage_b, cand[0], failed)
        if lines_a != lines_b:
            differ = [i for i, pair in enumerate(zip(lines_a, lines_b)) if pair[0] != pair[1]]
            i = differ[0] if differ else min(len(lines_a), len(lines_b))
            shown = [lines[i] if i < len(lines) else "<end>" for lines in (lines_a, lines_b)]
            notes.append(f"{stage}: stdout line {i + 1}: {shown[0]!r} vs {shown[1]!r}")
    return found, notes


# ---- trees, cache, main --------------------------------------------------------------------
def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def resolve_tree(spec: str, cache: Path) -> tuple[Path, str]:
    """A directory as is, or a git revision checked out (once) into the cache; returns the tree
    and its cache key: the commit, or a hash of a directory's Python files."""
    if Path(spec).is_dir():
        tree = Path(spec).resolve()
        digest = hashlib.sha256()
        for path in sorted([*tree.glob("*.py"), *tree.glob("tests/*.py")]):
            digest.update(path.name.encode() + path.read_bytes())
        return tree, "dir-" + digest.hexdigest()[:12]
    commit = git("rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}")
    tree = cache / "trees" / commit[:12]
    with locked(cache / "trees.lock"):
        if not (tree / "grpo_sd35.py").is_file():
            git("worktree", "prune")
            git("worktree", "add", "--detach", str(tree), commit)
    return tree, commit[:12]


def tiny_models(cache: Path) -> dict[str, str]:
    """tests/tiny.py's random SD3 and FLUX pipelines, built once into the cache."""
    models = cache / "models"
    paths = {"sd3": str(models / "tiny-sd3"), "flux": str(models / "tiny-flux")}
    with locked(cache / "models.lock"):
        if not all(Path(path, "model_index.json").is_file() for path in paths.values()):
            subprocess.run([sys.executable, "tests/tiny.py", str(models)], cwd=REPO,
                           check=True, env=script_env(REPO), capture_output=True)
    return paths


def signature(config: Config, nproc: int, models: dict) -> dict:
    """What a cached reference was run with: a change of the table re-runs it."""
    return {"flags": with_nproc(config.flags, nproc), "nproc": nproc, "kind": config.kind,
            "models": models}


@contextlib.contextmanager
def locked(path: Path, shared: bool = False):
    """A lock file next to a cache entry: checks running at once (several sessions may share a
    cache) run a missing reference once, and never read one while it is being written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file:
        fcntl.flock(file, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield


def check_one(job: tuple, options, trees: dict, models: dict) -> tuple[bool, str]:
    """Reference (cached) and candidate runs of one configuration; (same?, report line)."""
    script, name, nproc = job
    config = CONFIGS[script][name]
    part = Path(script[: -len(".py")], name, f"np{nproc}")
    ref_root = options.cache / "reference" / trees["reference"][1] / part
    ref_lock = ref_root.with_name(ref_root.name + ".lock")
    done, wanted = ref_root / "done.json", signature(config, nproc, models)
    with locked(ref_lock):
        cached = json.loads(done.read_text()) if done.is_file() else None
        if options.rerun_reference or not cached or cached["signature"] != wanted:
            shutil.rmtree(ref_root, ignore_errors=True)
            runs = run_config(trees["reference"][0], script, config, nproc, ref_root, models,
                              options.timeout)
            cached = {"signature": wanted, "runs": runs}
            done.write_text(json.dumps(cached, indent=1))
    ref_runs = cached["runs"]
    ref_seconds = sum(run["seconds"] for run in ref_runs)
    line = f"{script:19} {name:20} np{nproc}  "
    statuses = [run["returncode"] for run in ref_runs]
    if any(bool(status) != (config.kind == "fails") for status in statuses):
        return False, line + f"ERROR: reference exit status {statuses} (logs in {ref_root})"
    if options.reference_only:
        return True, line + f"reference ready ({ref_seconds:.0f} s)"
    cand_root = options.cache / "candidate" / trees["candidate"][1] / part
    with locked(cand_root.with_name(cand_root.name + ".lock")):
        cand_runs = run_config(trees["candidate"][0], script, config, nproc, cand_root,
                               models, options.timeout)
        with locked(ref_lock, shared=True):
            if json.loads(done.read_text()) != cached:
                return False, line + "ERROR: the reference was re-run meanwhile; check again"
            found, notes = compare(config, (trees["reference"][0], ref_root),
                                   (trees["candidate"][0], cand_root), (ref_runs, cand_runs))
    if options.strict_stdout:
        found, notes = found + notes, []
    seconds = sum(run["seconds"] for run in cand_runs)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        line += f"DIFFERENT: {found[0]}{more}"
    else:
        line += f"same ({ref_seconds:.0f} s / {seconds:.0f} s)"
    return not found, "\n    ".join([line] + [f"note: {note}" for note in notes])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", default="HEAD",
                        help="git revision or directory of the reference tree (default HEAD)")
    parser.add_argument("--candidate", default=str(REPO),
                        help="git revision or directory of the candidate (default: this tree)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help=f"reference outputs, checkouts, models (default {DEFAULT_CACHE})")
    parser.add_argument("--scripts", nargs="+", default=SCRIPTS,
                        help="scripts, by name or prefix (grpo nft awm crd dance)")
    parser.add_argument("--configs", nargs="+", default=["*"],
                        help="configuration names or globs, e.g. tiny 'tiny*' demo-short")
    parser.add_argument("--nproc", nargs="+", type=int, default=[1, 2], choices=[1, 2],
                        help="process counts (a configuration runs those it defines)")
    parser.add_argument("--jobs", type=int, default=1, help="configurations run in parallel")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per script run")
    parser.add_argument("--strict-stdout", action="store_true",
                        help="a stdout difference (timings masked) is a failure")
    parser.add_argument("--rerun-reference", action="store_true",
                        help="re-run the reference even when cached")
    parser.add_argument("--reference-only", action="store_true",
                        help="only make sure the reference outputs are cached")
    parser.add_argument("--list", action="store_true", help="print the configurations, exit")
    parser.add_argument("--new-metrics-ok", action="store_true",
                        help="a metric key or flag only the candidate has is no difference")
    options = parser.parse_args(argv)
    global NEW_METRICS_OK
    NEW_METRICS_OK = options.new_metrics_ok
    scripts = [script for script in SCRIPTS
               if any(script.startswith(prefix) for prefix in options.scripts)]
    jobs = [(script, name, nproc) for script in scripts for name, config in
            CONFIGS[script].items() for nproc in config.nprocs
            if nproc in options.nproc and any(fnmatch.fnmatch(name, pattern)
                                             for pattern in options.configs)]
    if options.list:
        for script, name, nproc in jobs:
            config = CONFIGS[script][name]
            flags = shlex.join(with_nproc(config.flags, nproc))
            flags = flags.replace(shlex.join(tiny()), "<tiny flags>")  # the common part
            print(f"{script} {name} np{nproc} [{config.kind}]: {flags}")
        return 0
    if not jobs:
        parser.error("no configuration matches --scripts, --configs and --nproc")
    options.cache = options.cache.resolve()
    options.cache.mkdir(parents=True, exist_ok=True)
    trees = {"reference": resolve_tree(options.reference, options.cache)}
    if not options.reference_only:
        tree, _ = resolve_tree(options.candidate, options.cache)
        trees["candidate"] = tree, f"{tree.name}-{hashlib.sha256(bytes(tree)).hexdigest()[:8]}"
    models = tiny_models(options.cache)
    print(f"reference {trees['reference'][0]} ({trees['reference'][1]}); candidate "
          f"{trees.get('candidate', ['none'])[0]}; cache {options.cache}", flush=True)
    lock, results = threading.Lock(), []

    def one(job):
        try:
            same, line = check_one(job, options, trees, models)
        except Exception as error:  # e.g. a timeout: report it, go on with the others
            same, line = False, f"{job[0]:19} {job[1]:20} np{job[2]}  ERROR: {error!r}"
        with lock:
            results.append(same)
            print(line, flush=True)

    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        list(pool.map(one, jobs))
    done = "with reference outputs" if options.reference_only else "the same"
    print(f"{results.count(True)} of {len(results)} {done}")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
