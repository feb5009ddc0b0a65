"""Issue 14: a checkpoint is the model that was trained, and a mistake is caught before the
model loads."""

import hashlib
import io
import socket
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from peft import LoraConfig
from PIL import Image

import dance_grpo_flux
import grpo_sd35
from scripts_harness import (REPO, ModelLoaded, assert_bad_input,
                             cut_back_copy, read_metrics, run_script, tiny_sd35_flags)
from test_dance_grpo_flux import image_ids, tiny_flux_flags

# LoRA scale alpha / rank = 2, and an EMA that differs from the LoRA
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--ema-decay", "0.5", "--learning-rate", "1e-2"]
SD35_SCRIPTS = ["grpo_sd35.py", "nft_sd35.py", "awm_sd35.py", "crd_sd35.py"]


def velocity(module, transformer, flux: bool) -> torch.Tensor:
    """The transformer's velocity on a fixed random input, through the script's own
    predict_velocity."""
    generator, config = torch.Generator().manual_seed(0), transformer.config
    embeds = torch.randn(2, 5, config.joint_attention_dim, generator=generator)
    pooled = torch.randn(2, config.pooled_projection_dim, generator=generator)
    text = module.Text(embeds, pooled)
    with torch.no_grad():
        if flux:  # 4x4 packed latent tokens
            latents = torch.randn(2, 16, config.in_channels, generator=generator)
            return module.predict_velocity(transformer, latents, 0.6, text,
                                           image_ids(4, 4, "cpu"), 3.5)
        latents = torch.randn(2, config.in_channels, 8, 8, generator=generator)
        return module.predict_velocity(transformer, latents, 0.6, text, None, 1.0)


GRPO_LORA = LORA + ["--ema-interval", "0", "--epochs", "2"]


@pytest.fixture(scope="module")
def grpo_lora_run(tiny_sd3, tmp_path_factory) -> Path:
    """2 epochs of GRPO at alpha / rank = 2 with an EMA that moves every optimizer step
    (ema_lora != initial LoRA)."""
    out = tmp_path_factory.mktemp("grpo")
    return run_script("grpo_sd35.py", tiny_sd35_flags(tiny_sd3, out) + GRPO_LORA)


@pytest.mark.parametrize("flux", [False, True], ids=["grpo_sd35", "dance_grpo_flux"])
def test_saved_loras_load_as_trained(tiny_sd3, tiny_flux, tmp_path, flux, request):
    """`Pipeline.load_lora_weights(dir)` (README's one call) of lora/ and ema_lora/ gives the
    training process's transformer (its LoRA, or its EMA swapped in) exactly, at the trained
    alpha / rank = 2 (not 1)."""
    if flux:
        module, pipeline, model = dance_grpo_flux, FluxPipeline, tiny_flux
        flags = tiny_flux_flags(model, tmp_path) + LORA + ["--epochs", "2"]
        run = run_script(module.__file__, flags)
    else:
        module, pipeline, model = grpo_sd35, StableDiffusion3Pipeline, tiny_sd3
        run = request.getfixturevalue("grpo_lora_run")
    checkpoint = run / "checkpoints" / "epoch_00002"
    state = torch.load(checkpoint / "state.pt", map_location="cpu")
    assert not all(torch.equal(lora, ema) for lora, ema in zip(state["lora"], state["ema"]))
    # the training process: add_adapter, then its weights
    trained = pipeline.from_pretrained(model).transformer
    trained.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                   target_modules=module.LORA_TARGETS))
    params = [param for param in trained.parameters() if param.requires_grad]
    untrained = velocity(module, pipeline.from_pretrained(model).transformer, flux)
    for name, folder in (("lora", "lora"), ("ema", "ema_lora")):
        for param, saved in zip(params, state[name]):
            param.data.copy_(saved)
        want = velocity(module, trained, flux)
        pipe = pipeline.from_pretrained(model)
        pipe.load_lora_weights(checkpoint / folder)
        scalings = {scaling for layer in pipe.transformer.modules() if hasattr(layer, "scaling")
                    for scaling in layer.scaling.values()}
        assert scalings == {2.0}
        got = velocity(module, pipe.transformer, flux)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (name, (got - want).abs().max())
        assert (got - untrained).abs().max() > 1e-4  # it trained


BAD = [
    (["--save-every", "0"], "--save-every must be >= 1"),
    (["--eval-every", "0"], "--eval-every must be >= 1"),
    (["--updates-per-epoch", "0"], "--updates-per-epoch must be >= 1"),
    (["--batch-size", "0"], "--batch-size must"),
    (["--eval-batch-size", "0"], "--eval-batch-size must"),
    (["--learning-rate", "-1e-3"], "--learning-rate must"),
    (["--learning-rate", "nan"], "--learning-rate must"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--resolution", "34"], "--resolution 34 is not a positive multiple of 4"),
    # issue 27: every value is checked, in one line, before the model loads
    (["--resolution", "0"], "--resolution must be >= 1"),
    (["--max-sequence-length", "0"], "--max-sequence-length must be >= 1"),
    (["--eval-sheet-size", "0"], "--eval-sheet-size must be >= 1"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
    (["--ema-decay", "1.5"], "--ema-decay must be in [0, 1)"),
    (["--kl-beta", "-1"], "--kl-beta must be >= 0"),
    (["--clip-range", "-1"], "--clip-range must be >= 0"),
    (["--noise-level", "-1"], "--noise-level must be >= 0"),
    (["--guidance-scale", "nan"], "--guidance-scale must be a finite number"),
    (["--reward", "pickscore[bogus=1]"], "reward 'pickscore' has no option bogus"),
    (["--model", "/nonexistent/model"], "no local pipeline directory"),
    (["--resume", "/tmp"], "not a checkpoint directory"),
]


@pytest.mark.quick
@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is a GPU mode")
@pytest.mark.parametrize("script", SD35_SCRIPTS + ["dance_grpo_flux.py"])
def test_files_and_modes_that_cannot_work_fail_before_the_model_loads(tiny_sd3, tiny_flux,
                                                                       tmp_path, script):
    """A file as --output-dir, a malformed JSONL prompt file, fp16 on CPU (FLUX: anywhere), a
    LoRA target no layer has, --push-to-hub without the Hub (HF_HUB_OFFLINE=1 here): one line
    each, no run directory (a repeated flag: the last one counts, the harness reads the
    first)."""
    model = tiny_flux if script.startswith("dance") else tiny_sd3
    flags = tiny_sd35_flags(configs_only(model, tmp_path), tmp_path / "out")
    if script == "awm_sd35.py":
        flags += ["--train-batch-size", "2"]
    fp16 = "FLUX overflows in fp16" if script.startswith("dance") else "fp16 needs a GPU"
    (tmp_path / "a_file").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "a dog"\n')
    (tmp_path / "no_prompt.jsonl").write_text('{"text": "a cat"}\n')
    for extra, message in [
            (["--output-dir", str(tmp_path / "a_file")], "a_file': File exists"),
            (["--train-prompts", str(tmp_path / "bad.jsonl")], "must be a JSON object with"),
            (["--test-prompts", str(tmp_path / "no_prompt.jsonl")], "with a 'prompt'"),
            (["--mixed-precision", "fp16"], fp16),
            (["--lora-targets", "to_q", "attn.to_qq"], "--lora-targets attn.to_qq names no"),
            (["--push-to-hub"], "error: --push-to-hub needs a Hub login (hf auth login): "
                                "LocalTokenNotFoundError")]:
        assert_bad_input(script, flags + extra, message)


def configs_only(tiny_sd3, tmp_path) -> Path:
    """A model dir with only the vae/ and transformer/ config files: nothing could load."""
    model = tmp_path / "configs-only"
    for subfolder in ("vae", "transformer"):
        (model / subfolder).mkdir(parents=True)
        config = (Path(tiny_sd3) / subfolder / "config.json").read_text()
        (model / subfolder / "config.json").write_text(config)
    return model


@pytest.mark.quick
@pytest.mark.parametrize("script", SD35_SCRIPTS)
@pytest.mark.parametrize("extra,message", BAD, ids=[message for _, message in BAD])
def test_bad_input_fails_before_the_model_loads(tiny_sd3, tmp_path, script, extra, message):
    """One line, no run directory, no from_pretrained call (and a configs-only model dir). The
    first case goes through the real command line of nft/awm/crd (grpo's: the wandb case
    below); the rest run in this process."""
    field = extra[0][2:].replace("-", "_")
    if f"    {field}:" not in (REPO / script).read_text():
        pytest.skip(f"{script} has no {extra[0]}")  # awm_sd35.py: one update per epoch
    flags = tiny_sd35_flags(configs_only(tiny_sd3, tmp_path), tmp_path / "out") + extra
    in_process = extra != BAD[0][0] or script == "grpo_sd35.py"
    assert_bad_input(script, flags, message, in_process=in_process)


@pytest.mark.quick
@pytest.mark.parametrize("script", SD35_SCRIPTS + ["dance_grpo_flux.py"])
def test_in_process_bad_input_check_stops_at_the_model_load(tiny_sd3, tiny_flux, tmp_path,
                                                            script):
    """What makes assert_bad_input(in_process=True) mean "before the model loads": good input
    reaches the script's from_pretrained, which raises there instead of loading."""
    if script.startswith("dance"):
        flags = tiny_flux_flags(tiny_flux, tmp_path)
    else:
        flags = tiny_sd35_flags(tiny_sd3, tmp_path)
    if script == "awm_sd35.py":  # 8 images do not split into the default 3 per train batch
        flags += ["--train-batch-size", "2"]
    with pytest.raises(ModelLoaded):
        assert_bad_input(script, flags, "never reached")


def test_bad_reward_file_and_wandb_login_fail_before_the_model_loads(tiny_sd3, tmp_path):
    flags = tiny_sd35_flags(configs_only(tiny_sd3, tmp_path), tmp_path / "out")
    broken = tmp_path / "broken.py"
    broken.write_text("def reward(images, prompts, metadata:\n")
    assert_bad_input("grpo_sd35.py", flags + ["--reward", f"{broken}:reward"], str(broken))
    other = tmp_path / "ok.py"
    other.write_text("def other(images, prompts, metadata):\n"
                     "    return images.mean((1, 2, 3)), {}\n")
    assert_bad_input("grpo_sd35.py", flags + ["--reward", f"{other}:reward"],
                     "has no function 'reward'")
    no_login = {"WANDB_MODE": "online", "HOME": str(tmp_path), "WANDB_API_KEY": "",
                "NETRC": str(tmp_path / "n")}
    assert_bad_input("grpo_sd35.py", flags + ["--track"], "--track needs a wandb login",
                     in_process=False, env=no_login)
    assert_bad_input("dance_grpo_flux.py", flags + ["--resolution", "36"],
                     "not a positive multiple of 8 (VAE downsampling x 2x2")


def test_unreachable_reward_server_fails_fast_before_the_model_loads(tiny_sd3, tmp_path):
    """Connection refused (nothing listens on a port we just freed): the build-time probe's
    one line naming the URL (not the training-time client's retries), and no model loaded."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    flags = tiny_sd35_flags(configs_only(tiny_sd3, tmp_path), tmp_path / "out")
    for reward in (f"geneval[url={url}]", f"remote[url={url}]"):
        assert_bad_input("grpo_sd35.py", flags + ["--reward", reward],
                         f"reward server {url} is not reachable")


def test_resume_refuses_what_it_cannot_continue(tiny_sd3, tmp_path, grpo_lora_run):
    run = cut_back_copy(grpo_lora_run, tmp_path / "a")  # as if it had stopped after epoch 1
    checkpoint = run / "checkpoints" / "epoch_00001"
    base = tiny_sd35_flags(tiny_sd3, tmp_path / "b")
    resume = ["--epochs", "2", "--resume", str(checkpoint)]
    assert_bad_input("grpo_sd35.py", base + resume + ["--lora-rank", "8", "--lora-alpha", "8"],
                     "--lora-rank 8 differs")
    assert_bad_input("grpo_sd35.py", base + resume + ["--lora-rank", "4", "--lora-alpha", "4"],
                     "--lora-alpha 4 differs")
    last = grpo_lora_run / "checkpoints" / "epoch_00002"
    assert_bad_input("grpo_sd35.py", base + LORA + ["--epochs", "1", "--resume", str(last)],
                     "error: --epochs 1 < the checkpoint's 2")
    # a checkpoint of grpo_sd35.py in any other script: refused before the model loads
    for other in ["crd_sd35.py", "nft_sd35.py", "awm_sd35.py"]:
        assert_bad_input(other, base + resume, "is not a checkpoint of " + other)
    hidden = run / "checkpoints" / ".epoch_00002.tmp"  # what a save that crashed leaves
    hidden.mkdir()
    (hidden / "state.pt").write_bytes((checkpoint / "state.pt").read_bytes())  # no checksum
    assert_bad_input("grpo_sd35.py", base + LORA + ["--epochs", "3", "--resume", str(hidden)],
                     "not a checkpoint directory")
    # a resumed run continues its checkpoint's run dir, cleans the crashed save, prints its
    # final eval
    flags = tiny_sd35_flags(tiny_sd3, tmp_path / "a") + GRPO_LORA + ["--resume", str(checkpoint)]
    resumed = run_script("grpo_sd35.py", flags, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "eval after 2 epochs" in resumed.stdout and "process(es)" in resumed.stdout
    assert [epoch["epoch"] for epoch in read_metrics(run)] == [0, 1] and not hidden.exists()
    assert (run / "checkpoints" / "epoch_00002" / "state.pt").is_file()
    assert not any((tmp_path / "b").iterdir())  # --output-dir checked, no run directory


def test_dance_refuses_an_sd35_checkpoint(tiny_flux, tmp_path, grpo_lora_run):
    checkpoint = grpo_lora_run / "checkpoints" / "epoch_00001"
    flags = tiny_flux_flags(tiny_flux, tmp_path) + ["--epochs", "2", "--resume", str(checkpoint)]
    assert_bad_input("dance_grpo_flux.py", flags, "is not a checkpoint of dance_grpo_flux.py")


def test_extra_reward_values_are_logged_and_flat_epochs_show(tiny_sd3, tmp_path):
    (tmp_path / "r.py").write_text(
        "import torch\n"
        "def flat(images, prompts, metadata):\n"
        "    return torch.ones(len(prompts)), {'flat_raw': images.mean((1, 2, 3))}\n")
    flags = tiny_sd35_flags(tiny_sd3, tmp_path / "out")
    flags += ["--reward", f"{tmp_path / 'r.py'}:flat", "--epochs", "2"]
    process = run_script("grpo_sd35.py", flags, check=False)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "reward 1.0000 ± 0.0000" in process.stdout  # a flat epoch: nothing to learn
    runs = list((tmp_path / "out").iterdir())
    assert len(runs) == 1, runs
    first, last = read_metrics(runs[0])
    assert 0 < first["reward/flat_raw"] < 1 and 0 < first["eval/flat_raw"] < 1
    assert "eval/final_flat_raw" in last
    assert first["reward/zero_std_group_frac"] == last["reward/zero_std_group_frac"] == 1


@pytest.mark.quick
def test_non_finite_stop_names_the_value_and_only_an_existing_checkpoint(tmp_path):
    message = r"^error: non-finite reward at epoch 3; stopping. Last checkpoint: none saved"
    with pytest.raises(SystemExit, match=message):
        grpo_sd35.check_finite("epoch 3", str(tmp_path), reward=torch.tensor([1.0, float("nan")]),
                               advantage=0.0)
    (tmp_path / "checkpoints" / "epoch_00002").mkdir(parents=True)
    (tmp_path / "checkpoints" / ".epoch_00004.tmp").mkdir()  # an unfinished save: no checkpoint
    message = r"non-finite gradient at s; stopping. Last checkpoint: .*/epoch_00002$"
    with pytest.raises(SystemExit, match=message):
        grpo_sd35.check_finite("s", str(tmp_path), loss=torch.tensor(0.5),
                               gradient=torch.tensor(float("inf")))
    # all finite: returns
    grpo_sd35.check_finite("s", str(tmp_path), loss=torch.tensor(0.5), gradient=1.0)


@pytest.mark.quick
def test_a_checkpoint_loads_only_when_its_checksum_matches(tmp_path):
    """load_state: state.pt as saved loads; one flipped byte, a truncated file or a missing
    checksum is refused with why (--resume then stops in one line, `latest` skips it)."""
    save = tmp_path / "epoch_00001"
    save.mkdir()
    data = io.BytesIO()
    torch.save({"next_epoch": 1, "lora": [torch.arange(4.0)]}, data)
    (save / "state.pt").write_bytes(data.getvalue())
    (save / "state.pt.sha256").write_text(hashlib.sha256(data.getvalue()).hexdigest())
    assert torch.equal(grpo_sd35.load_state(str(save))["lora"][0], torch.arange(4.0))
    flipped = bytearray(data.getvalue())
    flipped[len(flipped) // 2] ^= 0xFF
    corrupt = "corrupt: its state.pt does not match state.pt.sha256"
    for garbled in (bytes(flipped), data.getvalue()[:-8]):
        (save / "state.pt").write_bytes(garbled)
        assert grpo_sd35.load_state(str(save)) == corrupt
    (save / "state.pt.sha256").unlink()
    assert grpo_sd35.load_state(str(save)).startswith("not a checkpoint directory")


@pytest.mark.quick
def test_prepare_run_dir_drops_redone_epochs_and_crashed_saves(tmp_path):
    (tmp_path / "checkpoints" / ".epoch_00003.tmp").mkdir(parents=True)
    lines = [f'{{"epoch": {epoch}}}\n' for epoch in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    grpo_sd35.prepare_run_dir(str(tmp_path), start_epoch=2)
    assert [epoch["epoch"] for epoch in read_metrics(tmp_path)] == [0, 1]
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_short_relaunch_finishes_what_a_kill_after_the_last_checkpoint_left(
        tiny_sd3, tmp_path, grpo_lora_run):
    """`--resume latest` as a launcher's restart loop or a scheduler's requeue uses it. No save
    of this exp-name and seed yet: a run starts. Killed (SIGKILL, tests/faults.py) as its final
    eval loads the saved LoRA, after the last checkpoint: a relaunch with `--resume latest
    --output-dir OUT` and no other flag takes every flag from the checkpoint and does what was
    left (the final eval of the saved file, the cards, the last line), the same as the
    uninterrupted run's (grpo_lora_run, same flags), and exits 0. Launched again, it says the
    run has finished and exits 0; with a larger --epochs it continues in the same run."""
    out = tmp_path / "out"
    flags = tiny_sd35_flags(tiny_sd3, out) + GRPO_LORA + ["--resume", "latest"]
    killed = run_script("grpo_sd35.py", flags, check=False,
                        faults={"FAULT_KILL_ON_LORA_LOAD": "1"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    (run_dir,) = out.iterdir()
    assert [m["epoch"] for m in read_metrics(run_dir)] == [0]  # the last line comes last
    assert not (run_dir / "checkpoints" / "epoch_00002" / "ema_lora" / "README.md").exists()
    short = ["--resume", "latest", "--output-dir", str(out)]
    assert run_script("grpo_sd35.py", short) == run_dir
    without_timings = [{key: value for key, value in row.items() if not key.startswith("perf/")}
                       for row in read_metrics(run_dir)]
    assert without_timings == [{key: value for key, value in row.items()
                                if not key.startswith("perf/")}
                               for row in read_metrics(grpo_lora_run)]
    assert (run_dir / "checkpoints" / "epoch_00002" / "ema_lora" / "README.md").is_file()
    logged = (run_dir / "metrics.jsonl").read_text()
    again = run_script("grpo_sd35.py", short, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{run_dir} has finished" in again.stdout.splitlines()
    assert (run_dir / "metrics.jsonl").read_text() == logged
    assert run_script("grpo_sd35.py", short + ["--epochs", "3"]) == run_dir
    assert [m["epoch"] for m in read_metrics(run_dir)] == [0, 1, 2]
    assert (run_dir / "checkpoints" / "epoch_00003" / "state.pt").is_file()


def test_sheet_has_a_row_per_distinct_test_prompt(tiny_sd3, tmp_path):
    """2 prompts x 6 samples: under the title, a labelled row per prompt of its first 4
    samples, cells of 160 px (4 fill the 640 px) under a 24 px label (the first 16 lines
    would fill 4 x 3 with mixed prompts)."""
    prompts = tmp_path / "repeated.txt"
    prompts.write_text("a red square\n" * 6 + "a blue circle\n" * 6)
    flags = tiny_sd35_flags(tiny_sd3, tmp_path / "out") + ["--test-prompts", str(prompts),
                                                          "--epochs", "1"]
    run_dir = run_script("grpo_sd35.py", flags)
    with Image.open(run_dir / "eval_00000.png") as sheet:  # 4 cells of 160 px a row
        assert sheet.size == (640, 24 + 2 * (160 + 24))
    assert read_metrics(run_dir)[0]["eval/diversity"] > 0  # 2 groups of 6