"""Helpers shared by the end-to-end script tests: launch a script (python or torchrun/gloo) and
read its outputs."""

import ast
import contextlib
import io
import json
import math
import os
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
TOY_REWARD = "tests/toy_rewards.py:brightness"
PROMPTS = "tests/assets/ocr_prompts.txt"
# The toy world (tests/toy_world.py): pretrained tiny pipelines, held-out counting prompts, a
# verifiable reward.
TOY_SD3, TOY_FLUX = "tests/assets/toy-sd3", "tests/assets/toy-flux"
TOY_TRAIN, TOY_TEST = "tests/assets/toy_train.txt", "tests/assets/toy_test.txt"
COUNTING = "tests/toy_rewards.py:counting"


def tiny_sd35_flags(model: str, out, precision: str = "no") -> list[str]:
    """Flags shared by the SD3.5 scripts for a seconds-long CPU run on the tiny pipeline.

    fp32 by default: bf16 matmuls are several times slower on CPU; the default bf16 path gets a
    run of its own in each script's test.
    """
    return ["--model", str(model), "--output-dir", str(out),
            "--train-prompts", PROMPTS, "--test-prompts", PROMPTS, "--reward", TOY_REWARD,
            "--resolution", "32", "--num-steps", "4", "--eval-num-steps", "3",
            "--group-size", "4", "--prompts-per-epoch", "2",
            "--batch-size", "4", "--eval-batch-size", "2",
            "--eval-every", "1", "--save-every", "1",
            "--max-sequence-length", "16", "--mixed-precision", precision]


# The contract's runs (tests/test_contract.py), each made once a session and shared with the
# shipped script's own tests. Their flags make each algorithm's state move every step (its EMA,
# its snapshots; a KL weight that is not the default), so a resume that forgot one shows; a copy
# of a script (any other name) runs with the flags of the script it comes from (origin).
ONE_PROCESS_FLAGS = {
    "grpo_sd35.py": ["--kl-beta", "0.1", "--ema-interval", "0"],
    "nft_sd35.py": ["--decay-type", "1", "--updates-per-epoch", "1", "--kl-beta", "0.01"],
    "awm_sd35.py": ["--train-batch-size", "2", "--train-timesteps", "2", "--kl-beta", "0.01",
                    "--anchor-beta", "0.5"],
    "crd_sd35.py": ["--num-train-timesteps", "4", "--kl-beta", "0.3"],
    "dance_grpo_flux.py": ["--ema-decay", "0.5", "--updates-per-epoch", "1"]}
TWO_PROCESS_FLAGS = {
    "nft_sd35.py": ["--kl-beta", "1e-4"],
    "awm_sd35.py": ["--train-batch-size", "2", "--train-timesteps", "2"],
    "crd_sd35.py": ["--kl-beta", "0.1", "--num-train-timesteps", "4"],
    "dance_grpo_flux.py": ["--no-init-same-noise", "--ema-decay", "0.9", "--eval-seeds", "42",
                           "7", "--updates-per-epoch", "1"]}
CONTRACT_RUNS: dict = {}  # (script, nproc) -> its run directory


def args_fields(script: str) -> set[str]:
    """The names of a script's Args fields (read, not imported)."""
    tree = ast.parse((REPO / script).read_text())
    (args,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args"]
    return {node.target.id for node in args.body if isinstance(node, ast.AnnAssign)}


def origin(script: str) -> str:
    """The shipped script a copy comes from: the one whose Args fields it shares most (a copy
    runs with its origin's flags, which its own Args still take)."""
    if script in ONE_PROCESS_FLAGS:
        return script
    mine = args_fields(script)

    def shared(shipped: str) -> float:
        theirs = args_fields(shipped)
        return len(mine & theirs) / len(mine | theirs)
    return max(ONE_PROCESS_FLAGS, key=shared)


def is_flux(script: str) -> bool:
    """A FLUX script (the tiny FLUX pipeline) or an SD3.5 one."""
    return "FluxPipeline" in (REPO / script).read_text()


def contract_flags(script: str, model: str, out, nproc: int = 1) -> list[str]:
    """A contract run's flags: the tiny ones (bf16 under torchrun, as a cluster runs), the
    script's own (above), two epochs."""
    precision = "bf16" if nproc > 1 else "no"
    own = (ONE_PROCESS_FLAGS if nproc == 1 else TWO_PROCESS_FLAGS).get(origin(script), [])
    extra = ["--batch-size", "2"] if nproc > 1 else []
    return tiny_sd35_flags(model, out, precision) + own + ["--epochs", "2"] + extra


def contract_run(script: str, model: str, root: Path, nproc: int = 1) -> Path:
    """The contract's run of `script` under `nproc` processes (one process: pushed to the
    recorder Hub), made on first use."""
    if (script, nproc) not in CONTRACT_RUNS:
        out = root / f"{script[:-3]}-np{nproc}"
        flags = contract_flags(script, model, out, nproc)
        run = pushed_run(script, flags) if nproc == 1 else run_script(script, flags, nproc)
        CONTRACT_RUNS[script, nproc] = run
    return CONTRACT_RUNS[script, nproc]


def script_env() -> dict:
    """The environment of a launched script: offline, no wandb, one thread, the repo importable,
    and no RANK left over from a launcher around pytest."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    env.pop("RANK", None)
    return env


def run_script(script: str, flags: list[str], nproc: int = 1, check: bool = True,
               env: dict | None = None, faults: dict | None = None):
    """Run a training script to completion; returns its run directory (the only one under
    --output-dir), or with check=False the finished process. env: variables to override;
    faults: tests/faults.py's variables, the script then runs under it (one process)."""
    if faults:
        env = {**(env or {}), **faults}
        command = [sys.executable, "tests/faults.py", script]
    elif nproc == 1:
        command = [sys.executable, script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(nproc), script]
    process = subprocess.run(command + flags, cwd=REPO, env={**script_env(), **(env or {})},
                             capture_output=True, text=True, timeout=900)
    if not check:
        return process
    assert process.returncode == 0, (f"{' '.join(command + flags)}\n"
                                     f"STDOUT:\n{process.stdout[-4000:]}\n"
                                     f"STDERR:\n{process.stderr[-6000:]}")
    out = Path(flags[flags.index("--output-dir") + 1])
    runs = [path for path in out.iterdir() if path.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def pushed_run(script: str, flags: list[str]) -> Path:
    """run_script with --push-to-hub and the Hub a recorder (tests/faults.py FAULT_HUB): its
    calls go to hub.jsonl beside --output-dir's folder, read by assert_pushed."""
    out = Path(flags[flags.index("--output-dir") + 1])
    hub = out.parent / f"{out.name}.hub.jsonl"
    return run_script(script, flags + ["--push-to-hub"], faults={"FAULT_HUB": str(hub)})


def assert_pushed(run_dir: Path, script: str, epochs: int):
    """What pushed_run's script sent: it made the public repository tester/EXP_NAME and uploaded
    the last checkpoint's ema_lora/ alone (the weights, readable by all like state.pt, the eval
    sheet, and a model card in the Hub's format with an import line in its snippet, the Hub id
    to load, and the command that trains it again)."""
    import huggingface_hub

    hub = run_dir.parent.parent / f"{run_dir.parent.name}.hub.jsonl"
    calls = [json.loads(line) for line in hub.read_text().splitlines()]
    repo = f"tester/{script[:-3]}"
    last = run_dir / "checkpoints" / f"epoch_{epochs:05d}" / "ema_lora"
    assert calls == [
        {"call": "create_repo", "args": [repo], "private": False, "exist_ok": True},
        {"call": "upload_folder", "args": [], "repo_id": repo, "folder_path": str(last)}]
    assert sorted(path.name for path in last.iterdir()) == [
        "README.md", "eval_sheet.png", "pytorch_lora_weights.safetensors"]
    card = huggingface_hub.ModelCard((last / "README.md").read_text())
    assert set(card.data.tags) == {"diffusers", "lora", "text-to-image", script[:-3]}
    assert ("from diffusers import DiffusionPipeline\n"
            f'pipe = DiffusionPipeline.from_pretrained("{card.data.base_model}")\n'
            f'pipe.load_lora_weights("{repo}")\n') in card.text
    assert f"Trained with `python {script} " in card.text
    metrics = read_metrics(run_dir)[-1]
    assert f"{metrics['eval/final_reward_mean']:.4f} ± " in card.text
    sheet = run_dir / f"eval_{epochs:05d}.png"
    assert (last / "eval_sheet.png").read_bytes() == sheet.read_bytes()
    mode = (last.parent / "state.pt").stat().st_mode
    assert (last / "pytorch_lora_weights.safetensors").stat().st_mode == mode


def assert_bad_input(script: str, flags: list[str], message: str, env: dict | None = None,
                     in_process: bool = True):
    """The script exits non-zero with a one-line `error: ...` naming the problem (`message` in
    it, or the whole line if `message` starts with "error: "), loads no model, and leaves no
    run directory.

    in_process=False runs the real command line (a fresh interpreter: ~15 s of imports per
    case, so each script's tests keep one such case). in_process=True runs the script's
    __main__ here, its imports already loaded, with every from_pretrained (diffusers pipelines
    and models, transformers models) raising instead of loading.
    """
    if in_process:
        stderr = io.StringIO()
        try:
            with (script_context(env), contextlib.redirect_stdout(io.StringIO()),
                  contextlib.redirect_stderr(stderr)):
                sys.argv = [script] + flags
                runpy.run_path(str(REPO / script), run_name="__main__")
        except SystemExit as exit_:
            last = exit_.code
        else:
            raise AssertionError(f"{script} {flags} did not exit\n{stderr.getvalue()[-3000:]}")
        # a string exit code is printed to stderr with exit status 1
        assert isinstance(last, str) and "\n" not in last, (last, stderr.getvalue()[-3000:])
    else:
        process = subprocess.run([sys.executable, script] + flags, cwd=REPO,
                                 env={**script_env(), **(env or {})}, capture_output=True,
                                 text=True, timeout=300)
        assert process.returncode != 0
        last = process.stderr.strip().splitlines()[-1]
    if message.startswith("error: "):  # the whole line
        assert last == message, last
    assert last.startswith("error:") and message in last, last
    out = Path(flags[flags.index("--output-dir") + 1])
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


class ModelLoaded(Exception):
    """Raised by from_pretrained inside assert_bad_input(in_process=True): the input was
    accepted up to the model."""


@contextlib.contextmanager
def script_context(env: dict | None):
    """What a fresh `python script.py` would see (cwd, environment, argv), with loading a
    model an error."""
    from diffusers import DiffusionPipeline, ModelMixin
    from transformers import PreTrainedModel

    def loaded(*args, **kwargs):
        raise ModelLoaded(f"from_pretrained{args} was called")

    cwd, argv = os.getcwd(), sys.argv
    with contextlib.ExitStack() as stack:
        for cls in (DiffusionPipeline, ModelMixin, PreTrainedModel):
            stack.enter_context(mock.patch.object(cls, "from_pretrained", side_effect=loaded))
        environment = {**script_env(), **(env or {})}
        stack.enter_context(mock.patch.dict(os.environ, environment, clear=True))
        os.chdir(REPO)
        try:
            yield
        finally:
            os.chdir(cwd)
            sys.argv = argv


def cut_back_copy(run_dir: Path, out: Path, epoch: int = 1) -> Path:
    """A copy of a finished run under `out` without the checkpoints after `epoch`.

    Its metrics.jsonl keeps the later epochs, which a resume must drop: resuming its epoch
    checkpoint must continue this copy and redo the original's later epochs exactly. Saves
    each resume test a run of its own to stop at `epoch`.
    """
    copy = out / run_dir.name
    shutil.copytree(run_dir, copy)
    for checkpoint in (copy / "checkpoints").iterdir():
        if int(checkpoint.name.split("_")[1]) > epoch:
            shutil.rmtree(checkpoint)
    return copy


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def toy_flags(model: str, out, steps: int = 10) -> list[str]:
    """Flags shared by all five scripts for a toy-world run.

    Train on the 18 training prompts with partial-credit counting (denser than exact: a group
    of all-wrong 3-object images still ranks), eval exact accuracy (ODE, 10 steps) on the 96
    held-out lines; 32 px, the 24 T5 tokens the toy models were trained with; a rank-8 LoRA at
    scale 1, 96 images per epoch (6 prompts x 16), no KL and no EMA (eval scores the trained
    weights themselves).
    """
    return ["--model", model, "--output-dir", str(out),
            "--train-prompts", TOY_TRAIN, "--test-prompts", TOY_TEST,
            "--reward", COUNTING + "_partial", "--eval-reward", COUNTING,
            "--resolution", "32", "--max-sequence-length", "24", "--mixed-precision", "no",
            "--num-steps", str(steps), "--eval-num-steps", "10", "--eval-batch-size", "48",
            "--group-size", "16", "--prompts-per-epoch", "6",
            "--lora-rank", "8", "--lora-alpha", "8", "--ema-decay", "0",
            "--eval-every", "1000", "--save-every", "1000"] + (
            [] if model == TOY_FLUX else ["--kl-beta", "0"])  # DanceGRPO has no KL term


# The five toy-world learning tests train for minutes on one thread each, while the rest of the
# suite mostly runs one single-threaded script at a time. conftest.py starts the selected ones
# as background processes when the session starts, at the lowest CPU priority (the suite's own
# script keeps a core; they share the other and whatever the suite leaves idle), and runs their
# tests last, so that the suite waits for them only once it has nothing else to do. The runs are
# deterministic, so load does not change their numbers.
LEARNING_TEST = "test_learning_toy_accuracy_rises"


class LearningRun(NamedTuple):
    process: subprocess.Popen  # its process group: the script, or bash running two in turn
    out: Path  # runs/ (training), final/ (--eval-only), stdout.txt, stderr.txt
    scorer: str  # the script whose run scores the base model: itself, or a SHARED_BASE one


LEARNING_RUNS: dict[str, LearningRun] = {}
# The learning runs score before and after on the reporting noise of docs/toy_world.md: eval
# seeds no recipe was chosen on (benchmarks/toy_demos.py's), 16 per held-out line, 1,536
# samples, so that a gain of ~0.03 stands out of the eval's noise (s.e. ~0.013 per eval).
REPORTING_SEEDS = [str(seed) for seed in range(100, 116)]
# Evals at epoch 0 and after the last epoch alone, in batches of 48 in every run: the batch
# size moves a LoRA's score by a sample or two (AWM's demo checkpoint: 0.5566 at 48, 0.5579 at
# 8), so the tests' numbers, measured at 48, hold at 48. (At 48 to 384 an eval took the same
# CPU time.)
LEARNING_EVALS = ["--eval-batch-size", "48", "--eval-every", "1000", "--save-every", "1000"]
# The scripts whose evals of the base model are one computation: the SD3 toy, the scheduler's σ
# grid, no CFG, the eval code test_boilerplate.py keeps verbatim. On the reporting noise every
# number they log matched to the last digit (accuracy 0.5279947916666666, its s.e., diversity,
# the detector's counts; 2026-12-07). crd_sd35.py evaluates on its own σ grid (0.536), dance
# another model.
SHARED_BASE = {"grpo_sd35.py", "nft_sd35.py", "awm_sd35.py"}


def start_learning_run(script: str, flags: list[str], out: Path):
    """Launch `script` on the toy world (its flags, output under `out`) without waiting; its
    stdout and stderr go to files in `out`.

    A run scores the base model and its final EMA LoRA on the reporting noise in its own evals
    (at epoch 0, the LoRA still a no-op, and after the last epoch). But a SHARED_BASE script
    whose base another run of this session already scores evals on its default tuning seed
    while it trains (96 samples), then scores its last checkpoint's EMA LoRA with `--eval-only
    --resume` (benchmarks/toy_demos.py's method): the base's 1,536 samples are scored once.
    """
    out.mkdir(parents=True, exist_ok=True)
    scorers = [run.scorer for name, run in LEARNING_RUNS.items() if name != script]
    scorer = next((name for name in scorers if {name, script} <= SHARED_BASE), script)
    train = [script, *flags, "--output-dir", str(out / "runs"), *LEARNING_EVALS]
    if scorer == script:
        command = [sys.executable, *train, "--eval-seeds", *REPORTING_SEEDS]
    else:  # bash: "$0" is python, "$1" the script
        epochs = int(flags[flags.index("--epochs") + 1])
        final = f"{shlex.quote(str(out))}/runs/*/checkpoints/epoch_{epochs:05d}"
        score = (f'exec "$0" "$1" --eval-only --resume {final} --output-dir '
                 f'{shlex.quote(str(out / "final"))} --eval-seeds {" ".join(REPORTING_SEEDS)}')
        command = ["bash", "-c", f'"$0" "$@" && {score}', sys.executable, *train]
    with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(command, cwd=REPO, env=script_env(), stdout=stdout,
                                   stderr=stderr, start_new_session=True,
                                   preexec_fn=lambda: os.nice(19))
    LEARNING_RUNS[script] = LearningRun(process, out, scorer)


def only_run(out: Path) -> Path:
    runs = [path for path in out.iterdir() if path.is_dir()] if out.is_dir() else []
    assert len(runs) == 1, (out, runs)
    return runs[0]


def learning_run(script: str, flags: list[str], out: Path) -> tuple[dict, dict, list[dict]]:
    """Wait for the background run of `script` (starting it now if the session did not).

    Returns the base model's eval and the trained EMA LoRA's on the reporting noise (each
    `eval/*`: reward_mean, reward_stderr, diversity, lora_drift, ...) and the training run's
    metrics.
    """
    if script not in LEARNING_RUNS:
        start_learning_run(script, flags, out)
    process, out, scorer = LEARNING_RUNS[script]
    assert process.wait(timeout=1800) == 0, (out / "stderr.txt").read_text()[-6000:]
    metrics = read_metrics(only_run(out / "runs"))
    if scorer == script:
        final = {key.replace("/final_", "/"): value for key, value in metrics[-1].items()
                 if key.startswith("eval/final_")}
        return metrics[0], final, metrics
    (final,) = read_metrics(only_run(out / "final"))
    process, scorer_out, _ = LEARNING_RUNS[scorer]
    process.wait(timeout=1800)  # its test (before this one) asserts that it succeeded
    return read_metrics(only_run(scorer_out / "runs"))[0], final, metrics


def stop_learning_runs():
    for process, out, _ in LEARNING_RUNS.values():
        if process.poll() is None:  # the script, and bash's second one
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        shutil.rmtree(out, ignore_errors=True)


def assert_accuracy_rose(base: dict, trained: dict) -> float:
    """Held-out exact accuracy of the trained EMA LoRA beats the base model's by more than the
    gain's standard error, both scored on the reporting noise (learning_run's evals); returns the
    gain.

    Eval is a deterministic ODE from noise fixed per test line and eval seed, so a run that
    changes nothing gains exactly 0; the standard error says how far another draw of eval noise
    could move the gain (each eval's std of its samples / sqrt(count), combined).
    """
    # the base is the model itself (the LoRA's B starts at 0), the trained LoRA moved it
    assert base["eval/lora_drift"] == 0 < trained["eval/lora_drift"], (base, trained)
    gain = trained["eval/reward_mean"] - base["eval/reward_mean"]
    stderr = math.hypot(base["eval/reward_stderr"], trained["eval/reward_stderr"])
    # 1,536 samples of a 0/1 score give a s.e. of at most 0.013 per eval; one seed's 96, ~0.05
    assert stderr < 0.02, stderr
    assert gain > stderr, (base["eval/reward_mean"], trained["eval/reward_mean"], stderr)
    # the toy test file repeats each prompt: eval logs the diversity of its samples
    diversity = base["eval/diversity"], trained["eval/diversity"]
    assert all(0 < value < 1 for value in diversity), diversity
    return gain


def assert_eval_only_reproduces(run_dir: Path, trained_run: Path, epoch: int = 2):
    """An --eval-only run of trained_run's epoch checkpoint logs one finite eval and its sheet
    and saves nothing; eval being deterministic (a fixed seed per prompt), it reproduces the
    training run's final eval of the same weights."""
    all_metrics = read_metrics(run_dir)
    assert len(all_metrics) == 1, all_metrics
    metrics = all_metrics[0]
    assert metrics["epoch"] == epoch and math.isfinite(metrics["eval/reward_mean"])
    assert (run_dir / f"eval_{epoch:05d}.png").is_file()
    assert not (run_dir / "checkpoints").exists()
    final = read_metrics(trained_run)[-1]["eval/final_reward_mean"]
    assert abs(metrics["eval/reward_mean"] - final) <= 1e-6, (metrics["eval/reward_mean"], final)


def assert_same_state(got: Path, want: Path):
    """Two checkpoints hold the same training state, bit for bit (a resume on the CPU must
    reproduce the uninterrupted run exactly): the LoRA, its EMA, the algorithm's snapshots,
    AdamW's state (its step counts and both moments) and the counters."""
    got, want = (torch.load(path / "state.pt", map_location="cpu", weights_only=False)
                 for path in (got, want))
    assert (got["next_epoch"], got["global_step"]) == (want["next_epoch"], want["global_step"])
    pairs = [("lora", got["lora"], want["lora"]), ("ema", got["ema"], want["ema"])]
    pairs += [(name, got["extra"][name], copies)  # the algorithm's (dance: none)
              for name, copies in want.get("extra", {}).items()]
    for name, mine, theirs in pairs:
        assert len(mine) == len(theirs) > 0 or name == "ema", name
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), name
    moments = [(got["optimizer"]["state"][i], state)
               for i, state in want["optimizer"]["state"].items()]
    assert len(moments) == len(got["optimizer"]["state"]) > 0
    for mine, theirs in moments:
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[key], theirs[key]) for key in theirs), sorted(theirs)


NAN_REWARD = ["--reward", "tests/toy_rewards.py:nan_after_two_batches",
              "--eval-reward", TOY_REWARD, "--epochs", "3"]


def assert_stopped_at_the_nan_reward(process: subprocess.CompletedProcess, out: Path):
    """A run of NAN_REWARD (epoch 0's two reward batches finite, epoch 1's first NaN) stops
    before it trains on the NaN, in one line naming the value, where, and the checkpoint to
    continue from, which is intact."""
    (run_dir,) = [path for path in out.iterdir() if path.is_dir()]
    last = run_dir / "checkpoints" / "epoch_00001"
    assert process.returncode == 1, process.stderr[-3000:]
    assert process.stderr.strip().splitlines()[-1] == (
        f"error: non-finite reward at epoch 1; stopping. Last checkpoint: {last}")
    assert sorted(path.name for path in last.parent.iterdir()) == ["epoch_00001"]
    state = torch.load(last / "state.pt", map_location="cpu", weights_only=False)
    tensors = state["lora"] + state["ema"] + sum(state.get("extra", {}).values(), [])
    assert tensors and all(torch.isfinite(tensor).all() for tensor in tensors)


def assert_ema_moves_once_a_step(run_dir: Path, decay: float):
    """A run of one optimizer step an epoch, saved after epochs 1 and 2: its EMA after step n
    is d EMA_(n-1) + (1 - d) LoRA_n with upstream's warm-up, d = min(decay, (1 + n) / (10 +
    n)), and it is not the LoRA itself. (An EMA moved by 1 - d instead of d misses by half a
    step's change, ~1e-4 in the tiny runs: hundreds of times the float32 tolerance.)"""
    one, two = (torch.load(run_dir / "checkpoints" / f"epoch_{epoch:05d}" / "state.pt",
                           map_location="cpu", weights_only=False) for epoch in (1, 2))
    step = two["global_step"]
    assert step == one["global_step"] + 1, (one["global_step"], step)
    d = min(decay, (1 + step) / (10 + step))
    for before, lora, after in zip(one["ema"], two["lora"], two["ema"], strict=True):
        assert torch.allclose(after, d * before + (1 - d) * lora, rtol=1e-6, atol=1e-9)
    assert any(not torch.equal(ema, lora) for ema, lora in zip(two["ema"], two["lora"]))


def lora_tensors(checkpoint: Path) -> list[torch.Tensor]:
    return torch.load(checkpoint / "state.pt", map_location="cpu")["lora"]


PHASES = ["eval", "text_encoding", "sampling", "reward", "training"]


def assert_phases_add_up(metrics: dict):
    """The per-phase seconds (perf/*) are logged, do not overlap and account for the epoch."""
    phases = [metrics[f"perf/{name}_seconds"] for name in PHASES]
    assert all(seconds >= 0 for seconds in phases), phases
    epoch = metrics["perf/epoch_seconds"]
    assert abs(sum(phases) - epoch) <= 0.1 * epoch + 0.5, (phases, epoch)
    assert metrics["perf/images_per_sec"] > 0 and metrics["perf/max_mem_gb"] > 0
    assert metrics["perf/compiled_graphs"] >= 0  # 0 unless --compile


def assert_common_run(run_dir: Path, epochs: int) -> list[dict]:
    """What every training script must leave behind after `epochs` epochs with --eval-every 1
    --save-every 1."""
    metrics = read_metrics(run_dir)
    assert [epoch["epoch"] for epoch in metrics] == list(range(epochs))
    for epoch in metrics:
        for key, value in epoch.items():
            if key.startswith("losses/") and key != "losses/on_policy_ratio_dev":
                assert math.isfinite(value), (key, value)
        assert math.isfinite(epoch["reward/mean"])
        assert_phases_add_up(epoch)
    assert (run_dir / "eval_00000.png").is_file()
    assert (run_dir / f"eval_{epochs:05d}.png").is_file()
    last = run_dir / "checkpoints" / f"epoch_{epochs:05d}"
    assert (last / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (last / "ema_lora" / "pytorch_lora_weights.safetensors").is_file()
    assert not any(path.name.startswith(".") for path in (run_dir / "checkpoints").iterdir())
    state = torch.load(last / "state.pt", map_location="cpu")
    assert state["next_epoch"] == epochs
    for folder in ["lora", "ema_lora"]:  # readable as state.pt (safetensors writes 0600)
        weights = last / folder / "pytorch_lora_weights.safetensors"
        assert weights.stat().st_mode == (last / "state.pt").stat().st_mode
    lora = load_file(last / "lora" / "pytorch_lora_weights.safetensors")
    lora_b = [tensor for name, tensor in lora.items() if "lora_B" in name]
    # LoRA B starts at zero: nonzero means it trained
    assert lora_b and any(tensor.abs().sum() > 0 for tensor in lora_b)
    return metrics
