"""dance_grpo_flux.py --full-finetune: FSDP2-sharded full fine-tuning on the tiny FLUX pipeline
(1 and 2 processes, gloo on CPU), its torch.distributed.checkpoint resume, the diffusers-format
export, its checkpoints' checks (the shards' checksums), a relaunch that finishes the run,
preemption and the bad-input checks."""

import hashlib
import math
import shutil
from pathlib import Path
import subprocess
import sys

import numpy as np
import pytest
import torch
import tyro
from PIL import Image
from torch.distributed.checkpoint import FileSystemReader

import dance_grpo_flux
import rewards
from dance_grpo_flux import (Args, contact_sheet, dance_sigmas, decode, encode, ode_sample,
                             predict_velocity, seeded_generator)
from scripts_harness import (PROMPTS, REPO, TOY_REWARD, ModelLoaded, assert_bad_input,
                             assert_eval_only_reproduces, cut_back_copy, read_metrics, run_script,
                             script_env)
from test_dance_grpo_flux import SCRIPT, image_ids, tiny_flux_flags
from test_faults import FAULTY_REWARD

# weight decay 0: every change of a weight comes from its gradient; lr and clip large enough
# to move the tiny model
FULL = ["--full-finetune", "--learning-rate", "1e-3", "--clip-range", "0.2",
        "--weight-decay", "0"]


def flags(tiny_flux, out, precision="bf16") -> list[str]:
    return tiny_flux_flags(tiny_flux, out, precision) + FULL


def dcp_entries(checkpoint: Path) -> set[str]:
    """The top-level entries (model, optimizer, ema) of a checkpoint's dcp/ state."""
    metadata = FileSystemReader(str(checkpoint / "dcp")).read_metadata()
    return {key.split(".")[0] for key in metadata.state_dict_metadata}


def assert_readable_as_state_pt(checkpoint: Path, folder: str):
    """The exported safetensors files have state.pt's mode (safetensors 0.8 writes 0600)."""
    files = list((checkpoint / folder).glob("*.safetensors"))
    mode = (checkpoint / "state.pt").stat().st_mode
    assert files and all(path.stat().st_mode == mode for path in files), oct(mode)


def exported(checkpoint, name="transformer") -> dict:
    from diffusers import FluxTransformer2DModel

    return dict(FluxTransformer2DModel.from_pretrained(checkpoint / name).named_parameters())


def eval_in_this_process(tiny_flux, run_flags, export_dir):
    """The script's eval on one process (its seeds, batches, autocast, ODE sampler and decode)
    of FluxPipeline.from_pretrained(tiny, transformer=export): (mean reward, contact sheet: a
    labelled row per prompt)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    args = tyro.cli(Args, args=run_flags)
    # the text encoders in the dtype the script gives them
    dtype = {"bf16": torch.bfloat16, "no": torch.float32}[args.mixed_precision]
    transformer = FluxTransformer2DModel.from_pretrained(export_dir)
    pipe = FluxPipeline.from_pretrained(tiny_flux, transformer=transformer,
                                        dtype={"default": dtype, "vae": torch.float32})
    assert pipe.transformer.dtype == torch.float32  # the fp32 master weights
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    cpu = torch.device("cpu")
    grid = args.resolution // pipe.vae_scale_factor // 2  # packed tokens per side
    shape = (grid**2, pipe.transformer.config.in_channels)
    sigmas = dance_sigmas(args.eval_num_steps, args.shift)
    prompts = [p.strip() for p in open(PROMPTS).read().split("\n") if p.strip()]
    # 4 distinct prompts, one eval seed (42, as the run's --seed 42 drew before eval seeds)
    assert len(set(prompts)) == len(prompts) == 4 and args.eval_seeds == (42,)
    reward_fn = rewards.build_reward(TOY_REWARD)
    scores = []
    cells = []
    for start in range(0, len(prompts), args.eval_batch_size):
        ids = range(start, min(start + args.eval_batch_size, len(prompts)))
        noise = torch.stack([torch.randn(shape, generator=seeded_generator(cpu, 42, i))
                             for i in ids])
        text = encode(pipe, [prompts[i] for i in ids], cpu, args.max_sequence_length)

        def velocity(x, sigma, text=text):
            with autocast:
                return predict_velocity(pipe.transformer, x, sigma, text,
                                        image_ids(grid, grid, cpu), args.guidance_scale)

        images = decode(pipe, ode_sample(velocity, noise, sigmas), args.resolution)
        scores += reward_fn(images, [prompts[i] for i in ids], [{}] * len(ids))[0].tolist()
        cells += list((images.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8))
    rows = [(f"{score:.3f}  {prompt}", [cell]) for score, prompt, cell in zip(scores, prompts,
                                                                             cells)]
    mean, stderr = float(np.mean(scores)), float(np.std(scores, ddof=1) / len(scores) ** 0.5)
    title = f"{SCRIPT} after {args.epochs} epochs: {mean:.4f} ± {stderr:.4f}"
    return mean, np.asarray(contact_sheet(title, rows))


@pytest.fixture(scope="module")
def base_weights(tiny_flux) -> dict:
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(tiny_flux, subfolder="transformer")
    return dict(model.named_parameters())


def test_sharded_gradients_equal_unsharded_ones(tiny_flux):
    """FSDP2 over a 1-rank group, with gradient checkpointing, gives the plain model's gradients
    (FSDP2 warns that FLUX blocks return views; FLUX does no in-place op on them, which this
    checks)."""
    import copy

    import torch.distributed as dist
    from diffusers import FluxPipeline
    from torch.distributed.tensor import DTensor

    from dance_grpo_flux import shard_for_full_finetune

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    text = encode(pipe, ["a cat", "a dog"], torch.device("cpu"), 16)
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))
    ids = image_ids(4, 4, "cpu")
    plain = pipe.transformer.requires_grad_(True)
    sharded = copy.deepcopy(plain)
    sharded.enable_gradient_checkpointing()
    try:
        shard_for_full_finetune(sharded)
        for model in (plain, sharded):
            v = predict_velocity(model.train(), x, torch.tensor([0.7, 0.3]), text, ids, 3.5)
            (v**2).mean().backward()
        for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
            assert isinstance(q, DTensor) and q.grad is not None, name
            assert torch.allclose(p.grad, q.grad.full_tensor(), atol=1e-6, rtol=1e-5), name
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def full_run(tiny_flux, tmp_path_factory):
    run_flags = flags(tiny_flux, tmp_path_factory.mktemp("full1")) + ["--epochs", "2"]
    return run_script(SCRIPT, run_flags), run_flags


def test_one_process_full_finetune(full_run, base_weights, tiny_flux):
    run_dir, run_flags = full_run
    metrics = read_metrics(run_dir)
    assert [m["epoch"] for m in metrics] == [0, 1] and metrics[-1]["charts/global_step"] == 4
    for m in metrics:
        # the first micro-step re-scores the rollout's exact weights
        assert m["losses/on_policy_ratio_dev"] == 0.0
        keys = ("losses/policy_loss", "losses/grad_norm", "reward/mean")
        assert all(math.isfinite(m[k]) for k in keys)
    ckpt = run_dir / "checkpoints" / "epoch_00002"
    state = torch.load(ckpt / "state.pt")
    assert "lora" not in state and state["next_epoch"] == 2  # a full fine-tune's
    assert state["metrics"]["charts/global_step"] == 4  # the last epoch's, for a relaunch
    assert (ckpt / "dcp" / ".metadata").is_file() and not (ckpt / "lora").exists()
    assert not list(run_dir.glob("checkpoints/*/*/README.md"))  # model cards are a LoRA's
    # checked on resume: state.pt by its checksum (written last), the shards by theirs in it
    digest = hashlib.sha256((ckpt / "state.pt").read_bytes()).hexdigest()
    assert (ckpt / "state.pt.sha256").read_text() == digest
    shards = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
              for path in (ckpt / "dcp").iterdir()}
    assert state["dcp_sha256"] == shards and sorted(shards) == [".metadata", "__0_0.distcp"]
    # --ema-decay 0 (the default): the EMA is the weights, kept once, and saved once
    assert dcp_entries(ckpt) == {"model", "optimizer"}
    assert not (ckpt / "ema_transformer").exists()
    assert_readable_as_state_pt(ckpt, "transformer")
    assert not (run_dir / "checkpoints" / "epoch_00001" / "transformer").exists()
    trained = exported(ckpt)
    assert trained.keys() == base_weights.keys()
    assert all(torch.isfinite(p).all() for p in trained.values())
    changed = [n for n, p in trained.items() if not torch.equal(p, base_weights[n])]
    assert len(changed) >= 0.9 * len(trained), sorted(set(trained) - set(changed))
    # the export loads into FluxPipeline and, evaluated here, reproduces the run's final eval
    # (reward and sheet)
    mean, sheet = eval_in_this_process(tiny_flux, run_flags, ckpt / "transformer")
    assert mean == pytest.approx(metrics[-1]["eval/final_reward_mean"], abs=1e-6)
    assert abs(mean - metrics[0]["eval/reward_mean"]) > 1e-6  # ... which is not the base model's
    assert np.array_equal(sheet, np.asarray(Image.open(run_dir / "eval_00002.png")))


def test_resume_latest_of_sharded_state_matches_uninterrupted_run(tiny_flux, tmp_path, full_run):
    run_dir, _ = full_run
    first = cut_back_copy(run_dir, tmp_path / "a")  # as if it had stopped after epoch 1
    resume = ["--epochs", "2", "--resume", "latest"]
    process = run_script(SCRIPT, flags(tiny_flux, tmp_path / "a") + resume, check=False)
    assert process.returncode == 0, process.stderr[-6000:]
    assert f"resuming from {first}/checkpoints/epoch_00001" in process.stdout
    (resumed,) = (tmp_path / "a").iterdir()
    assert resumed == first  # the resumed run continues in its own run dir
    assert [m["epoch"] for m in read_metrics(resumed)] == [0, 1]
    want = exported(run_dir / "checkpoints" / "epoch_00002")
    got = exported(resumed / "checkpoints" / "epoch_00002")
    assert all(torch.allclose(want[n], got[n], atol=1e-6, rtol=0) for n in want)


def test_eval_only_of_a_sharded_checkpoint(tmp_path, full_run):
    """Only the checkpoint: --full-finetune and every other flag come from its state."""
    run_dir, _ = full_run
    ckpt = run_dir / "checkpoints" / "epoch_00002"
    eval_flags = ["--eval-only", "--resume", str(ckpt), "--output-dir", str(tmp_path)]
    assert_eval_only_reproduces(run_script(SCRIPT, eval_flags), run_dir)


def test_two_process_full_finetune_shards_and_exports(tiny_flux, tmp_path, base_weights):
    run_flags = flags(tiny_flux, tmp_path, precision="no") + [
        "--epochs", "2", "--batch-size", "2", "--ema-decay", "0.9", "--no-init-same-noise"]
    run_dir = run_script(SCRIPT, run_flags, nproc=2)
    metrics = read_metrics(run_dir)
    for m in metrics:
        assert m["losses/on_policy_ratio_dev"] == 0.0 and math.isfinite(m["losses/policy_loss"])
    ckpt = run_dir / "checkpoints" / "epoch_00002"
    shards = sorted(p.name for p in (ckpt / "dcp").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    state = torch.load(ckpt / "state.pt")  # both ranks' shards checksummed
    assert sorted(state["dcp_sha256"]) == [".metadata"] + shards
    assert dcp_entries(ckpt) == {"model", "optimizer", "ema"}
    for folder in ("transformer", "ema_transformer"):
        assert_readable_as_state_pt(ckpt, folder)
    trained, ema = exported(ckpt), exported(ckpt, "ema_transformer")
    # FSDP2 keeps dim-0 chunk r of every weight on rank r: both ranks' shards of the big
    # weights moved
    big = [n for n, p in trained.items() if p.shape[0] >= 2 and p.numel() >= 64]
    for n in big:
        for shard, base in zip(trained[n].chunk(2), base_weights[n].chunk(2)):
            assert not torch.equal(shard, base), n
    assert all(not torch.equal(trained[n], ema[n]) for n in big)  # EMA (0.9) lags the weights
    # both ranks evaluated half the prompts each with their shards gathered: one process
    # reproduces that eval
    mean, _ = eval_in_this_process(tiny_flux, run_flags, ckpt / "ema_transformer")
    assert mean == pytest.approx(metrics[-1]["eval/final_reward_mean"], abs=1e-5)


def test_full_finetune_bad_input(tiny_flux, tmp_path, full_run):
    """(fp16, refused for FLUX in every mode: test_dance_grpo_flux.py's bad-input cases.)
    --lora-rank and --lora-alpha are no error: a full fine-tune does not use them;
    --push-to-hub is (it uploads a LoRA's folder). --resume takes --full-finetune from the
    checkpoint: only one given that differs is refused; so are fewer --epochs than saved."""
    base = flags(tiny_flux, tmp_path / "out")
    assert_bad_input(SCRIPT, base + ["--push-to-hub"], "--push-to-hub uploads a LoRA")
    with pytest.raises(ModelLoaded):
        assert_bad_input(SCRIPT, base + ["--lora-rank", "8", "--lora-alpha", "8"], "never reached")
    full_checkpoint = str(full_run[0] / "checkpoints" / "epoch_00002")
    mismatch = "needs the --full-finetune it was saved with"
    assert_bad_input(SCRIPT, tiny_flux_flags(tiny_flux, tmp_path / "out") + [
        "--no-full-finetune", "--resume", full_checkpoint], mismatch)
    assert_bad_input(SCRIPT, base + ["--epochs", "1", "--resume", full_checkpoint],
                     "--epochs 1 < the checkpoint's 2")
    lora_checkpoint = tmp_path / "lora_ckpt"
    lora_checkpoint.mkdir()
    torch.save({"script": SCRIPT, "args": {}}, lora_checkpoint / "state.pt")
    digest = hashlib.sha256((lora_checkpoint / "state.pt").read_bytes()).hexdigest()
    (lora_checkpoint / "state.pt.sha256").write_text(digest)
    assert_bad_input(SCRIPT, base + ["--resume", str(lora_checkpoint)], mismatch)


def rewrite_state(checkpoint: Path, **changes):
    """state.pt with `changes` (None: the key dropped), and its checksum to match."""
    state = torch.load(checkpoint / "state.pt")
    state = {key: value for key, value in {**state, **changes}.items() if value is not None}
    torch.save(state, checkpoint / "state.pt")
    digest = hashlib.sha256((checkpoint / "state.pt").read_bytes()).hexdigest()
    (checkpoint / "state.pt.sha256").write_text(digest)


def test_a_corrupt_or_missing_shard_fails_its_checksum(tiny_flux, tmp_path, full_run, capsys):
    """state.pt keeps each dcp/ file's sha256: a shard with flipped bytes, or missing, ends
    --resume in one line before the model loads, and --resume latest skips that checkpoint for
    the one before, as for a corrupt state.pt. An older checkpoint, saved before the checksums,
    is still found by the load, in one line, with nothing in the run directory changed. With no
    good state.pt, --resume latest starts anew."""
    copy = tmp_path / "out" / full_run[0].name
    shutil.copytree(full_run[0], copy)
    older, newest = (copy / "checkpoints" / name for name in ("epoch_00001", "epoch_00002"))
    shard = newest / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, the size unchanged
    shard.write_bytes(bytes(data))
    corrupt = "corrupt: its dcp/__0_0.distcp does not match its checksum"
    for _ in ("flipped", "missing"):
        assert_bad_input(SCRIPT, flags(tiny_flux, tmp_path / "elsewhere") + [
            "--epochs", "3", "--resume", str(newest)], f"error: --resume '{newest}': {corrupt}")
        args = Args(model=tiny_flux, output_dir=str(tmp_path / "out"), resume="latest",
                    epochs=3, full_finetune=True)
        assert dance_grpo_flux.check_args(args)["next_epoch"] == 1 and args.resume == str(older)
        assert f"skipping {newest}: {corrupt}\nresuming from {older}" in capsys.readouterr().out
        shard.unlink(missing_ok=True)
    shutil.copy(full_run[0] / "checkpoints" / "epoch_00002" / "dcp" / shard.name, shard)
    shard.write_bytes(shard.read_bytes()[:-8])  # cut short, in a checkpoint with no checksums
    rewrite_state(newest, dcp_sha256=None)
    run_flags = flags(tiny_flux, tmp_path / "out") + ["--epochs", "3", "--resume", str(newest)]
    process = run_script(SCRIPT, run_flags, check=False)
    assert process.returncode == 1, process.stderr[-3000:]
    errors = [line for line in process.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"error: --resume '{newest}': its dcp/ shards do not load "
                      "(CheckpointException)"], process.stderr[-3000:]
    assert [m["epoch"] for m in read_metrics(copy)] == [0, 1] and newest.is_dir()
    for save in (older, newest):  # none good: start anew
        (save / "state.pt.sha256").unlink()
    args = Args(model=tiny_flux, output_dir=str(tmp_path / "out"), resume="latest", epochs=3,
                full_finetune=True)
    assert dance_grpo_flux.check_args(args) is None and args.resume is None


def test_a_relaunch_after_the_last_save_finishes_the_run(tiny_flux, tmp_path, full_run,
                                                         capsys):
    """Stopped after saving the last epoch, before the final eval's line: --resume latest
    loads that checkpoint's dcp/ and evaluates the loaded weights (the run's final eval, to the
    bit) and logs the line the run would have. Then the run has finished: a relaunch says so
    and exits 0 before the model loads."""
    run_dir, _ = full_run
    copy = tmp_path / "out" / run_dir.name
    shutil.copytree(run_dir, copy)
    lines = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
    (copy / "metrics.jsonl").write_text("".join(lines[:-1]))
    relaunch = flags(tiny_flux, tmp_path / "out") + ["--epochs", "2", "--resume", "latest"]
    process = run_script(SCRIPT, relaunch, check=False)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "eval after 2 epochs" in process.stdout and "epoch 1:" not in process.stdout
    assert read_metrics(copy) == read_metrics(run_dir)  # the same line, the same final eval
    args = Args(model=tiny_flux, output_dir=str(tmp_path / "out"), resume="latest", epochs=2,
                full_finetune=True)
    with pytest.raises(SystemExit) as finished:
        dance_grpo_flux.check_args(args)
    assert finished.value.code == 0 and f"{copy} has finished" in capsys.readouterr().out


def test_preemption_of_a_full_finetune_loses_up_to_save_every_epochs(tiny_flux, tmp_path):
    """SIGTERM at epoch 1's first reward (the reward's 3rd call) with --save-every 2: a full
    fine-tune saves only every --save-every epochs (a LoRA run would have saved epoch 1), so
    the one line says there is nothing to continue from yet."""
    reward = tmp_path / "faulty_reward.py"
    reward.write_text(FAULTY_REWARD)
    run_flags = flags(tiny_flux, tmp_path / "out") + [
        "--epochs", "2", "--save-every", "2", "--reward", f"{reward}:brightness",
        "--eval-reward", TOY_REWARD]
    process = subprocess.run([sys.executable, SCRIPT] + run_flags, cwd=REPO,
                             env={**script_env(), "FAULT_AT": "3", "FAULT_DO": "sigterm"},
                             capture_output=True, text=True, timeout=600)
    assert process.returncode == 128 + 15, process.stderr[-3000:]
    last = process.stdout.strip().splitlines()[-1]
    assert last == "stopped by SIGTERM; --resume latest continues from none saved yet"
    (run_dir,) = (tmp_path / "out").iterdir()
    assert [m["epoch"] for m in read_metrics(run_dir)] == [0]  # epoch 0 was logged
    assert not (run_dir / "checkpoints").exists()
