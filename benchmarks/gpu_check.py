"""The GPU check of issue 44 in one command: benchmarks/gpu_check.sh installs the carried wheels
and runs this. BENCHMARKS/GPU_CHECK.md says how to call it, what each step costs and where the
results land.

Steps, in priority order (the issue's), each run only if its least useful time is left:

    build-sd35       e2e.py --build-only: SD3.5-Medium with random weights (timed)
    grpo-compiled    e2e.py grpo --compile at the paper's per-GPU shapes, 2 epochs
    grpo-eager       e2e.py grpo --no-compile, same
    demos            the toy-world demos of the docs, seeds 42/1/2, parallel processes
    ocr              reward_rate.py: the OCR reward's images/s vs grpo-compiled's rollout
    crd-compiled     e2e.py crd --compile
    nft-compiled     e2e.py nft --compile
    build-flux       e2e.py --build-only: FLUX.1-dev with random weights (timed)
    dance-compiled   e2e.py dance --compile
    grpo-no-tf32     e2e.py grpo --no-compile --no-allow-tf32: what TF32 buys, vs grpo-eager

Time: the budget counts from the shell's start (GPU_CHECK_STARTED). A step starts only if at
least its `need` seconds are left; it then has until the end of the budget, less the `need` of
the later steps marked `reserve` (short, cheap ones: the OCR row) when that still leaves it its
own `need`. At its deadline a step is killed with its processes and reports what it has (e2e.py
keeps the finished epochs, the demos their evals so far). Results are rewritten after every step
into the output folder: results.json, summary.md, gpu_check.log (this output) and logs.tar.gz
(every step's log and metrics.jsonl).

`--arch tiny` runs the same steps on tests/tiny.py-sized pipelines and one-epoch demos (CPU).
"""

import datetime
import glob
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Literal

import tyro

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
DEMO_SCRIPTS = {"grpo": "grpo_sd35.py", "nft": "nft_sd35.py", "awm": "awm_sd35.py",
                "crd": "crd_sd35.py", "dance": "dance_grpo_flux.py"}
VERSIONS = ("torch", "diffusers", "transformers", "peft", "tyro", "tokenizers", "huggingface_hub",
            "safetensors", "numpy", "rapidocr_onnxruntime", "onnxruntime")
# reward_rate.py settings: full = its defaults on the GPU machine's cores; tiny = two quick ones
OCR = {"full": [], "tiny": ["--settings", "workers=2", "workers=1,threads=1", "--resolution",
                            "256", "--batch-size", "4", "--batches", "2"]}


@dataclass
class Args:
    out: str = "gpu-check"
    """results folder (created): results.json, summary.md, gpu_check.log, logs.tar.gz"""
    arch: Literal["full", "tiny"] = "full"
    """full: the paper's shapes on a GPU; tiny: tests/tiny.py's sizes, one-epoch demos (CPU)"""
    budget: float = 540.0
    """seconds for everything, counted from the shell's start (GPU_CHECK_STARTED)"""
    only: tuple[str, ...] = ()
    """run only these steps (names in the docstring), still in priority order; () = all"""
    skip: tuple[str, ...] = ()
    """steps not to run"""
    work_dir: str = os.path.join(tempfile.gettempdir(), "flowrl-gpu-check")
    """models, runs and logs (the models are kept: a second call reuses them)"""
    demos: tuple[Literal["grpo", "nft", "awm", "crd", "dance"], ...] = tuple(DEMO_SCRIPTS)
    """which toy demos to run"""
    seeds: tuple[int, ...] = (42, 1, 2)
    """seeds of each demo"""
    demo_epochs: int | None = None
    """override the demos' epochs (and eval every that many); None: the docs' on full, 1 on
    tiny"""
    demo_jobs: int | None = None
    """demo processes at once; None: all on a GPU, one per core on CPU"""
    demo_flags: str = "--no-compile"
    """more flags for every demo run, last (they win). Eager by default: on the H100 (2026-11-27)
    15 demos compiling at once spent ~85 s each compiling toy models that gain nothing from it"""
    rollout_rate: float | None = None
    """images/s to hold the OCR rate against when grpo-compiled (or eager) measured none"""


@dataclass
class Step:
    name: str
    run: Callable  # (ctx, deadline) -> result dict with "status"
    need: dict  # {arch: least seconds worth starting with}
    reserve: bool = False  # earlier steps leave it its need


class Context:
    """The check's state: arguments, paths, the clock, the results so far, the output."""

    def __init__(self, args: Args):
        self.args = args
        self.started = float(os.environ.get("GPU_CHECK_STARTED") or time.time())
        self.out = os.path.abspath(args.out)
        self.work = os.path.abspath(os.path.join(args.work_dir, args.arch))
        self.logs = os.path.join(self.work, "logs")
        for path in (self.out, self.logs):
            os.makedirs(path, exist_ok=True)
        self.log_file = open(os.path.join(self.out, "gpu_check.log"), "a")
        self.results = {"meta": {}, "steps": [], "builds": {}, "e2e": [], "demos": [],
                        "reward": None}
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
                        PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        # a cold compile cache per call, as on a fresh machine: warm-up is a first run's
        self.env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
            self.work, f"inductor-cache-{int(self.started)}"))
        self.running = []  # processes to kill if this one is stopped

    def now(self) -> float:
        return time.time() - self.started

    def say(self, text: str):
        line = f"[{self.now():5.0f} s] {text}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()


# ---------------------------------------------------------------- processes
def descendants(pid: int) -> list[int]:
    """pid's descendants (from /proc), also those in sessions of their own (e2e.py's scripts)."""
    children = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen):
    """SIGKILL a process started in its own session, its group and every descendant's group."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        for kill in (lambda p: os.killpg(os.getpgid(p), signal.SIGKILL),
                     lambda p: os.kill(p, signal.SIGKILL)):
            try:
                kill(pid)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait()


def start(ctx: Context, command: list[str], log: str, env: dict | None = None):
    """Start `command` in the repo in a session of its own, output to `log`."""
    shown = [os.path.relpath(part, REPO) if part.startswith(REPO) else part for part in command]
    ctx.say(f"$ {shlex.join(shown)}")
    handle = open(log, "w")
    proc = subprocess.Popen(command, cwd=REPO, env=env or ctx.env, stdout=handle,
                            stderr=subprocess.STDOUT, start_new_session=True)
    ctx.running.append(proc)
    return proc


def wait(ctx: Context, procs: list, deadline: float) -> list:
    """Wait for all until the deadline (seconds since the start); kill the rest. -> statuses."""
    while any(p.poll() is None for p in procs) and ctx.now() < deadline:
        time.sleep(0.5)
    statuses = []
    for proc in procs:
        if proc.poll() is None:
            kill_tree(proc)
            statuses.append("cut at the deadline")
        else:
            statuses.append("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})")
    return statuses


def tail(path: str, lines: int = 12) -> str:
    try:
        return "".join(open(path, errors="replace").readlines()[-lines:])
    except OSError:
        return ""


def notable_lines(path: str, limit: int = 8) -> list[str]:
    """Warnings worth a look in a run's log: on-policy ratio, recompiles, errors."""
    pattern = re.compile(r"WARNING: on-policy|recompil|Traceback|Error|non-finite|out of memory",
                         re.I)
    try:
        found = [line.strip() for line in open(path, errors="replace") if pattern.search(line)]
    except OSError:
        return []
    return found[:limit] + ([f"... {len(found) - limit} more"] if len(found) > limit else [])


# ---------------------------------------------------------------- e2e.py steps
def e2e_command(ctx: Context, scripts: list[str], json_path: str) -> list[str]:
    return [sys.executable, os.path.join(BENCH, "e2e.py"), "--arch", ctx.args.arch,
            "--scripts", *scripts, "--model-dir", os.path.join(ctx.work, "models"),
            "--json", json_path]


def build_step(family: str, script: str):
    def run(ctx: Context, deadline: float) -> dict:
        json_path = os.path.join(ctx.work, f"build-{family}.json")
        log = os.path.join(ctx.logs, f"build-{family}.log")
        proc = start(ctx, e2e_command(ctx, [script], json_path) + ["--build-only"], log)
        (status,) = wait(ctx, [proc], deadline)
        builds = json.load(open(json_path))["builds"] if os.path.exists(json_path) else {}
        result = {"status": status, **builds.get(family, {})}
        if status == "ok":
            ctx.results["builds"][family] = result
        else:
            result["log_tail"] = tail(log)
        return result
    return run


E2E_OVERHEAD = {"full": 45.0, "tiny": 15.0}  # e2e.py's own start: imports, matmul peak, FLOPs


def e2e_step(script: str, variant: str, script_args: str = "", label: str = ""):
    family = "flux-dev" if script == "dance" else "sd35m"

    def run(ctx: Context, deadline: float) -> dict:
        if family not in ctx.results["builds"]:  # its build step skipped, failed or not chosen
            built = build_step(family, script)(ctx, deadline)
            if built["status"] != "ok":
                return {"status": f"skipped: no {family} pipeline ({built['status']})",
                        "log_tail": built.get("log_tail", "")}
        name = label or f"{script}-{variant}"
        json_path = os.path.join(ctx.work, f"e2e-{name}.json")
        timeout = int(deadline - ctx.now() - E2E_OVERHEAD[ctx.args.arch])
        command = e2e_command(ctx, [script], json_path) + [
            "--variants", variant, "--output-dir", os.path.join(ctx.work, "runs"),
            "--timeout", str(max(timeout, 1)), f"--script-args={script_args}"]
        log = os.path.join(ctx.logs, f"e2e-{name}.log")
        (status,) = wait(ctx, [start(ctx, command, log)], deadline + 15)
        runs = json.load(open(json_path))["runs"] if os.path.exists(json_path) else []
        if not runs:
            return {"status": f"{status}: e2e.py reported no run", "log_tail": tail(log)}
        run = runs[0]
        run["variant"] = f"{variant} {script_args}".strip()
        graphs = [e.get("perf/compiled_graphs") for e in run.get("epochs", [])]
        run["graphs_per_epoch"] = graphs
        if len(graphs) > 1 and None not in graphs:
            run["recompiles_after_epoch_0"] = graphs[-1] - graphs[0]
        run["notable"] = notable_lines(run.get("log", ""))
        run["meta"] = json.load(open(json_path))["meta"]
        ctx.results["e2e"].append(run)
        return {"status": run["status"], "run": name}
    return run


# ---------------------------------------------------------------- the toy demos
def commands(text: str) -> list[list[str]]:
    """`python X.py ...` lines of a shell block, continuations joined, as argv lists."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [shlex.split(line.strip())[1:] for line in joined.splitlines()
            if line.strip().startswith("python ") and ".py" in line]


def demo_commands() -> tuple[str, dict[str, list[str]]]:
    """(file, {script: flags}): the first bash block, in README.md and then docs/*.md, that
    runs each of the five scripts on the toy pipelines (tests/assets/toy-*). The one place the
    demo flags are read from."""
    paths = [os.path.join(REPO, "README.md")]
    paths += sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
    for path in paths:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", open(path).read(), re.S):
            demos = {argv[0]: argv[1:] for argv in commands(block)
                     if argv and "tests/assets/toy-" in " ".join(argv)}
            if set(DEMO_SCRIPTS.values()) <= set(demos):
                return os.path.relpath(path, REPO), demos
    raise RuntimeError("no bash block with the five toy-world demos in README.md or docs/*.md")


def flag_value(flags: list[str], flag: str) -> str | None:
    """The last value of a flag (the one the script keeps)."""
    values = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == flag]
    return values[-1] if values else None


def demo_result(name: str, seed: int, status: str, out: str, seconds: float,
                epochs: int, log: str) -> dict:
    """One demo run: held-out accuracy before (epoch 0's eval) and at the end (the final eval,
    or the last one before a cut), epochs done."""
    lines = []
    for path in glob.glob(os.path.join(out, "*", "metrics.jsonl")):
        lines = [json.loads(line) for line in open(path)]
    evals = [(m["epoch"], m["eval/reward_mean"]) for m in lines if "eval/reward_mean" in m]
    final = next((m["eval/final_reward_mean"] for m in lines if "eval/final_reward_mean" in m),
                 None)
    result = {"demo": name, "seed": seed, "status": status, "seconds": seconds,
              "epochs": epochs, "epochs_done": len(lines), "evals": evals, "final": final,
              "base": evals[0][1] if evals else None,
              "ended_at": final if final is not None else (evals[-1][1] if evals else None),
              "ended_after_epochs": epochs if final is not None else
              (evals[-1][0] if evals else None),
              "notable": notable_lines(log)}
    if result["base"] is not None and result["ended_at"] is not None:
        result["gain"] = result["ended_at"] - result["base"]
    return result


def demos_step(ctx: Context, deadline: float) -> dict:
    source, flags_of = demo_commands()
    epochs = ctx.args.demo_epochs or (1 if ctx.args.arch == "tiny" else None)
    env = dict(ctx.env, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    todo, planned = [], {}
    for name in ctx.args.demos:
        script = DEMO_SCRIPTS[name]
        for seed in ctx.args.seeds:
            out = os.path.join(ctx.work, "demos", f"{name}-{seed}")
            shutil.rmtree(out, ignore_errors=True)
            flags = [*flags_of[script], "--seed", str(seed), "--output-dir", out]
            if epochs:
                flags += ["--epochs", str(epochs), "--eval-every", str(epochs)]
            flags += shlex.split(ctx.args.demo_flags)
            todo.append((name, seed, out, [sys.executable, script, *flags]))
            planned[name] = int(flag_value(flags, "--epochs"))
    gpu = ctx.args.arch == "full"
    jobs = ctx.args.demo_jobs or (len(todo) if gpu else os.cpu_count() or 1)
    ctx.say(f"demos from {source}: {len(todo)} runs, {jobs} at a time")
    running, done = [], []
    while (todo or running) and ctx.now() < deadline:
        while todo and len(running) < jobs:
            name, seed, out, command = todo.pop(0)
            log = os.path.join(ctx.logs, f"demo-{name}-{seed}.log")
            running.append((name, seed, out, log, time.time(), start(ctx, command, log, env)))
        time.sleep(0.5)
        for item in [r for r in running if r[-1].poll() is not None]:
            running.remove(item)
            done.append((*item, None, time.time()))
    for item in running:
        kill_tree(item[-1])
        done.append((*item, "cut at the deadline", time.time()))
    runs = []
    for name, seed, out, log, started, proc, cut, ended in done:
        status = cut or ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})")
        runs.append(demo_result(name, seed, status, out, ended - started, planned[name], log))
    runs += [{"demo": name, "seed": seed, "status": "not started: no time left"}
             for name, seed, _, _ in todo]
    ctx.results["demos"] = sorted(runs, key=lambda r: (list(DEMO_SCRIPTS).index(r["demo"]),
                                                        ctx.args.seeds.index(r["seed"])))
    finished = sum(r["status"] == "ok" for r in runs)
    return {"status": "ok" if finished == len(runs) else f"{finished}/{len(runs)} finished",
            "source": source}


# ---------------------------------------------------------------- the reward phase
def rollout_rate(ctx: Context) -> tuple[float | None, str]:
    for variant in ("compiled", "eager"):
        for run in ctx.results["e2e"]:
            if run["script"] == "grpo" and run["variant"] == variant and run.get(
                    "images_per_sec"):
                return run["images_per_sec"], f"grpo {variant} sampling, this check"
    if ctx.args.rollout_rate:
        return ctx.args.rollout_rate, "--rollout-rate"
    return None, "none measured"


def ocr_step(ctx: Context, deadline: float) -> dict:
    if importlib.util.find_spec("rapidocr_onnxruntime") is None:  # gpu_wheels.sh --no-ocr
        return {"status": "skipped: rapidocr-onnxruntime is not installed"}
    rate, source = rollout_rate(ctx)
    json_path = os.path.join(ctx.work, "reward_rate.json")
    command = [sys.executable, os.path.join(BENCH, "reward_rate.py"), "--json", json_path,
               *OCR[ctx.args.arch]] + (["--rollout-rate", f"{rate:.4g}"] if rate else [])
    log = os.path.join(ctx.logs, "reward_rate.log")
    (status,) = wait(ctx, [start(ctx, command, log)], deadline)
    rows = json.load(open(json_path))["rows"] if os.path.exists(json_path) else []
    ctx.results["reward"] = {"rows": rows, "rollout_rate": rate, "rollout_source": source}
    result = {"status": status if rows else f"{status}: no row"}
    if not rows or status != "ok":
        result["log_tail"] = tail(log)
    return result


# ---------------------------------------------------------------- schedule and report
STEPS = [
    Step("build-sd35", build_step("sd35m", "grpo"), {"full": 60, "tiny": 10}),
    Step("grpo-compiled", e2e_step("grpo", "compiled"), {"full": 150, "tiny": 60}),
    Step("grpo-eager", e2e_step("grpo", "eager"), {"full": 90, "tiny": 20}),
    Step("demos", demos_step, {"full": 60, "tiny": 20}),
    Step("ocr", ocr_step, {"full": 80, "tiny": 15}, reserve=True),
    Step("crd-compiled", e2e_step("crd", "compiled"), {"full": 200, "tiny": 60}),
    Step("nft-compiled", e2e_step("nft", "compiled"), {"full": 200, "tiny": 60}),
    Step("build-flux", build_step("flux-dev", "dance"), {"full": 90, "tiny": 10}),
    Step("dance-compiled", e2e_step("dance", "compiled"), {"full": 180, "tiny": 60}),
    Step("grpo-no-tf32", e2e_step("grpo", "eager", "--no-allow-tf32", "grpo-no-tf32"),
         {"full": 90, "tiny": 20}),
]


def deadline_for(now: float, end: float, need: float, reserved: float) -> float | None:
    """Seconds-since-start deadline of a step with `need` at `now`, the budget ending at `end`
    and `reserved` seconds kept for later reserve steps; None: not enough time to start it."""
    if end - now < need:
        return None
    return end - reserved if end - reserved - now >= need else end


def selected(args: Args) -> list[Step]:
    names = [step.name for step in STEPS]
    unknown = sorted((set(args.only) | set(args.skip)) - set(names))
    if unknown:
        raise SystemExit(f"unknown steps {unknown}; steps: {', '.join(names)}")
    return [step for step in STEPS if (not args.only or step.name in args.only)
            and step.name not in args.skip]


def versions() -> dict:
    found = {}
    for name in VERSIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def machine(ctx: Context) -> dict:
    info = {"python": platform.python_version(), "cpus": len(os.sched_getaffinity(0)),
            "date": datetime.date.today().isoformat(), "arch": ctx.args.arch,
            "budget_s": ctx.args.budget, "versions": versions(),
            "disk_free_gib": shutil.disk_usage(ctx.work).free / 2**30}
    try:
        query = "--query-gpu=name,memory.total,driver_version"
        info["gpu"] = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["gpu"] = None
    return info


def fmt(x, spec=".3g") -> str:
    return "–" if x is None else f"{x:{spec}}"


def summary(ctx: Context) -> str:
    meta, results = ctx.results["meta"], ctx.results
    v = meta["versions"]
    lines = [f"# GPU check ({meta['arch']}), {meta['date']}", "",
             f"{meta.get('gpu') or 'no GPU'} · {meta['cpus']} CPUs · Python {meta['python']} · "
             + " · ".join(f"{k} {v[k]}" for k in VERSIONS if v.get(k)), "",
             f"Budget {meta['budget_s']:.0f} s; {ctx.now():.0f} s used so far.", "",
             "| step | status | seconds | note |", "|---|---|---|---|"]
    for step in results["steps"]:
        note = step.get("note", "")
        lines.append(f"| {step['step']} | {step['status']} | {fmt(step.get('seconds'), '.0f')} "
                     f"| {note} |")
    if results["builds"]:
        lines += ["", "Random-weight pipeline builds (e2e.py --build-only):", "",
                  "| pipeline | seconds | reused |", "|---|---|---|"]
        lines += [f"| {family} | {fmt(b.get('seconds'))} | {b.get('reused')} |"
                  for family, b in results["builds"].items()]
    if results["e2e"]:
        lines += ["", "## End to end (benchmarks/e2e.py; epoch 1 of 2, 2 micro-batches)", ""]
        try:
            sys.path.insert(0, BENCH)
            import e2e  # the same table as e2e.py prints
            lines += [e2e.TABLE_HEAD] + [e2e.table_row(run) for run in results["e2e"]]
        except Exception as error:  # a broken install still gets its JSON and logs
            lines.append(f"(e2e.py's table unavailable: {error!r}; see results.json)")
        lines += ["", "| script | variant | status | wall s | compiled graphs per epoch | "
                  "new graphs after epoch 0 | matmul peak TFLOP/s | notable log lines |",
                  "|---|---|---|---|---|---|---|---|"]
        for run in results["e2e"]:
            notable = "<br>".join(run["notable"]).replace("|", "/") or "–"
            lines.append(f"| {run['script']} | {run['variant']} | {run['status']} | "
                         f"{fmt(run.get('wall_s'), '.0f')} | {run['graphs_per_epoch']} | "
                         f"{fmt(run.get('recompiles_after_epoch_0'))} | "
                         f"{fmt(run['meta'].get('matmul_peak_tflops'))} | {notable} |")
    if results["demos"]:
        lines += ["", "## Toy-world demos (held-out exact accuracy, eval at epoch 0 -> end)", "",
                  "| demo | seed | status | epochs done / planned | base | end (after epochs) | "
                  "gain | seconds | notable |", "|---|---|---|---|---|---|---|---|---|"]
        for r in results["demos"]:
            lines.append(
                f"| {r['demo']} | {r['seed']} | {r['status']} | {r.get('epochs_done', '–')} / "
                f"{r.get('epochs', '–')} | {fmt(r.get('base'), '.3f')} | "
                f"{fmt(r.get('ended_at'), '.3f')} ({r.get('ended_after_epochs', '–')}) | "
                f"{fmt(r.get('gain'), '+.3f')} | {fmt(r.get('seconds'), '.0f')} | "
                f"{len(r.get('notable', []))} |")
        lines += ["", "| demo | gains per seed | mean ± std (finished runs) |", "|---|---|---|"]
        for name in ctx.args.demos:
            gains = [r["gain"] for r in results["demos"]
                     if r["demo"] == name and r["status"] == "ok" and "gain" in r]
            spread = "–"
            if gains:
                mean = sum(gains) / len(gains)
                std = (sum((g - mean) ** 2 for g in gains) / len(gains)) ** 0.5
                spread = f"{mean:+.3f} ± {std:.3f} ({len(gains)} seeds)"
            per_seed = " / ".join(fmt(r.get("gain"), "+.3f") for r in results["demos"]
                                  if r["demo"] == name)
            lines.append(f"| {name} | {per_seed} | {spread} |")
    reward = results["reward"]
    if reward and reward["rows"]:
        lines += ["", "## Reward phase (benchmarks/reward_rate.py)", "",
                  f"Rollout rate held against: {fmt(reward['rollout_rate'])} img/s "
                  f"({reward['rollout_source']}).", ""]
        try:
            sys.path.insert(0, BENCH)
            import reward_rate
            lines += reward_rate.table(reward["rows"], reward["rollout_rate"]) + [""]
            lines += reward_rate.advice(reward["rows"], reward["rollout_rate"])
        except Exception as error:
            lines.append(f"(reward_rate.py's table unavailable: {error!r}; see results.json)")
    return "\n".join(lines) + "\n"


def save(ctx: Context) -> str:
    """results.json, summary.md and logs.tar.gz, each written whole (a kill keeps the last);
    returns the summary."""
    def write(name: str, text: str):
        with open(os.path.join(ctx.out, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(ctx.out, name + ".tmp"), os.path.join(ctx.out, name))
    text = summary(ctx)
    write("results.json", json.dumps(ctx.results, indent=1, default=str))
    write("summary.md", text)
    wanted = (glob.glob(os.path.join(ctx.logs, "*.log"))
              + glob.glob(os.path.join(ctx.work, "runs", "*", "log.txt"))
              + glob.glob(os.path.join(ctx.work, "runs", "*", "*", "metrics.jsonl"))
              + glob.glob(os.path.join(ctx.work, "demos", "*", "*", "metrics.jsonl"))
              + glob.glob(os.path.join(ctx.work, "demos", "*", "*", "eval_*.png"))
              + glob.glob(os.path.join(ctx.work, "*.json")))
    path = os.path.join(ctx.out, "logs.tar.gz")
    with tarfile.open(path + ".tmp", "w:gz") as tar:
        for file in wanted:
            if os.path.getsize(file) < 2 << 20:  # a 512² eval sheet of noise: left out
                tar.add(file, arcname=os.path.relpath(file, ctx.work))
    os.replace(path + ".tmp", path)
    return text


def main(args: Args) -> dict:
    ctx = Context(args)
    steps = selected(args)

    def stop(signum, frame):  # killed from outside (a timeout): no orphans on the GPU
        for proc in ctx.running:
            if proc.poll() is None:
                kill_tree(proc)
        ctx.say(f"stopped by signal {signum}")
        sys.exit(128 + signum)
    previous = {signum: signal.signal(signum, stop)
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        return run_steps(ctx, steps)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_steps(ctx: Context, steps: list[Step]) -> dict:
    args = ctx.args
    ctx.results["meta"] = machine(ctx)
    ctx.say(f"GPU check, {args.arch}: {json.dumps(ctx.results['meta'])}")
    ctx.say(f"steps: {', '.join(step.name for step in steps)}; budget {args.budget:.0f} s")
    save(ctx)
    for i, step in enumerate(steps):
        reserved = sum(later.need[args.arch] for later in steps[i + 1:] if later.reserve)
        now = ctx.now()
        deadline = deadline_for(now, args.budget, step.need[args.arch], reserved)
        record = {"step": step.name, "started_s": now}
        if deadline is None:
            record["status"] = "skipped: not enough time"
            record["note"] = (f"{args.budget - now:.0f} s left, needs "
                              f"{step.need[args.arch]:.0f} s")
            ctx.say(f"{step.name}: {record['status']} ({record['note']})")
        else:
            ctx.say(f"{step.name}: start, deadline at {deadline:.0f} s")
            try:
                result = step.run(ctx, deadline)
            except Exception as error:  # one broken step must not cost the others
                result = {"status": f"failed: {type(error).__name__}: {error}"}
            record.update(result, seconds=ctx.now() - now)
            last_lines = record.get("log_tail", "").strip().splitlines()[-1:]
            record["note"] = " ".join(last_lines).replace("|", "/")[:200]
            ctx.say(f"{step.name}: {record['status']} in {record['seconds']:.0f} s")
        ctx.results["steps"].append(record)
        save(ctx)
    ctx.say("done; results in " + ctx.out)
    print("\n" + save(ctx), flush=True)
    return ctx.results


if __name__ == "__main__":
    main(tyro.cli(Args))
