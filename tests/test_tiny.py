"""tests/tiny.py: the tiny pipelines save, reload offline through from_pretrained, tokenize
anything, and generate."""

import os

import pytest
import torch
from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                       FluxTransformer2DModel, SD3Transformer2DModel, StableDiffusion3Pipeline)
from safetensors.torch import load_file
from transformers import (CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel,
                          T5TokenizerFast)

from tiny import build_tiny_sd3

PROMPT = 'A sign that says "hello", it\'s 3 o\'clock!'


@pytest.fixture(scope="module")
def sd3(tiny_sd3):
    return StableDiffusion3Pipeline.from_pretrained(tiny_sd3)


@pytest.fixture(scope="module")
def flux(tiny_flux):
    return FluxPipeline.from_pretrained(tiny_flux)


def assert_image(image: torch.Tensor, shape):
    assert image.shape == shape
    assert torch.isfinite(image).all()
    assert image.min() >= 0 and image.max() <= 1
    assert image.std() > 0  # a real decode, not a constant fill


def test_sd3_generates_requested_size(sd3):
    # Non-square catches height/width swaps; guidance > 1 runs the CFG (negative prompt) branch too.
    image = sd3([PROMPT, "a cat"], height=32, width=48, num_inference_steps=2, guidance_scale=4.0,
                output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert_image(image, (2, 3, 32, 48))


def test_flux_generates_requested_size(flux):
    image = flux([PROMPT, "a cat"], height=32, width=48, num_inference_steps=2, output_type="pt",
                 generator=torch.Generator().manual_seed(0)).images
    assert_image(image, (2, 3, 32, 48))


def test_sd3_config(sd3):
    assert sd3.vae_scale_factor == 4 and sd3.vae.config.latent_channels == 4
    assert (sd3.vae.config.scaling_factor, sd3.vae.config.shift_factor) == (1.5305, 0.0609)
    assert sd3.scheduler.config.shift == 3.0 and not sd3.scheduler.config.use_dynamic_shifting
    assert sd3.default_sample_size * sd3.vae_scale_factor == 32
    # CLIP-L + CLIP-G pooled -> pooled_projection_dim; T5 width -> joint_attention_dim.
    clip_dims = sd3.text_encoder.config.projection_dim + sd3.text_encoder_2.config.projection_dim
    assert sd3.transformer.config.pooled_projection_dim == clip_dims == 40
    assert sd3.transformer.config.joint_attention_dim == sd3.text_encoder_3.config.d_model == 48


def test_flux_config(flux):
    assert flux.vae_scale_factor == 4 and flux.vae.config.latent_channels == 4
    assert (flux.vae.config.scaling_factor, flux.vae.config.shift_factor) == (0.3611, 0.1159)
    scheduler = flux.scheduler.config
    assert scheduler.use_dynamic_shifting
    assert (scheduler.base_shift, scheduler.max_shift) == (0.5, 1.15)
    assert (scheduler.base_image_seq_len, scheduler.max_image_seq_len) == (256, 4096)
    transformer = flux.transformer.config
    assert transformer.in_channels == 4 * flux.vae.config.latent_channels
    assert transformer.guidance_embeds
    assert transformer.pooled_projection_dim == flux.text_encoder.config.hidden_size == 16
    assert transformer.joint_attention_dim == flux.text_encoder_2.config.d_model == 48


def test_sd3_encode_prompt_shapes(sd3):
    embeds, negative, pooled, negative_pooled = sd3.encode_prompt(
        PROMPT, PROMPT, PROMPT, max_sequence_length=256)
    # CLIP tokens (zero-padded to the T5 width), then T5 tokens
    assert embeds.shape == negative.shape == (1, 77 + 256, 48)
    assert pooled.shape == negative_pooled.shape == (1, 40)


def test_flux_encode_prompt_shapes(flux):
    embeds, pooled, text_ids = flux.encode_prompt(PROMPT, PROMPT, max_sequence_length=512)
    assert embeds.shape == (1, 512, 48)
    assert pooled.shape == (1, 16)
    assert text_ids.shape == (512, 3)


COMPONENTS = [
    ("tiny_sd3", "transformer", SD3Transformer2DModel),
    ("tiny_sd3", "vae", AutoencoderKL),
    ("tiny_sd3", "text_encoder", CLIPTextModelWithProjection),
    ("tiny_sd3", "text_encoder_2", CLIPTextModelWithProjection),
    ("tiny_sd3", "text_encoder_3", T5EncoderModel),
    ("tiny_sd3", "tokenizer", CLIPTokenizer),
    ("tiny_sd3", "tokenizer_2", CLIPTokenizer),
    ("tiny_sd3", "tokenizer_3", T5TokenizerFast),
    ("tiny_sd3", "scheduler", FlowMatchEulerDiscreteScheduler),
    ("tiny_flux", "transformer", FluxTransformer2DModel),
    ("tiny_flux", "vae", AutoencoderKL),
    ("tiny_flux", "text_encoder", CLIPTextModel),
    ("tiny_flux", "text_encoder_2", T5EncoderModel),
    ("tiny_flux", "tokenizer", CLIPTokenizer),
    ("tiny_flux", "tokenizer_2", T5TokenizerFast),
    ("tiny_flux", "scheduler", FlowMatchEulerDiscreteScheduler),
]


@pytest.mark.parametrize("pipe_name,subfolder,cls", COMPONENTS)
def test_components_load_one_by_one(request, pipe_name, subfolder, cls):
    """The scripts load components separately: each comes back as the class the scripts name."""
    path = request.getfixturevalue(pipe_name)
    assert isinstance(cls.from_pretrained(path, subfolder=subfolder), cls)


@pytest.mark.parametrize("name", ["tokenizer", "tokenizer_2"])
def test_clip_tokenizer_handles_any_text(sd3, name):
    tokenizer = getattr(sd3, name)
    text_encoder = getattr(sd3, name.replace("tokenizer", "text_encoder"))
    assert len(tokenizer) <= text_encoder.config.vocab_size
    for text in (PROMPT, "naïve café ☕ — 100%"):
        ids = tokenizer(text).input_ids
        # CLIP's unk is <|endoftext|>, so "no unk" means eos only at the end.
        assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
        assert tokenizer.eos_token_id not in ids[1:-1]
        # Decode the inner ids: skip_special_tokens would also drop tokenizer_2's pad token "!".
        assert tokenizer.decode(ids[1:-1]).replace(" ", "") == text.lower().replace(" ", "")
    padded = tokenizer(PROMPT, padding="max_length", max_length=77, truncation=True).input_ids
    assert len(padded) == 77 and padded[-1] == tokenizer.pad_token_id
    assert sd3.tokenizer_2.pad_token == "!"  # as in SD3's real CLIP-G tokenizer


def test_t5_tokenizer_round_trips(sd3):
    tokenizer = sd3.tokenizer_3
    assert len(tokenizer) <= sd3.text_encoder_3.config.vocab_size
    ids = tokenizer(PROMPT).input_ids
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == PROMPT
    assert len(tokenizer(PROMPT, padding="max_length", max_length=256).input_ids) == 256


def saved_weights(path: str, subfolder: str) -> dict:
    """Every tensor in the .safetensors files of one component folder."""
    folder = os.path.join(path, subfolder)
    weights = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            weights.update(load_file(os.path.join(folder, file)))
    return weights


def test_build_is_idempotent_and_deterministic(tiny_sd3, tmp_path):
    path = build_tiny_sd3(tmp_path)
    stamp = os.path.getmtime(os.path.join(path, "model_index.json"))
    assert build_tiny_sd3(tmp_path) == path  # second call: returned as is, not rebuilt
    assert os.path.getmtime(os.path.join(path, "model_index.json")) == stamp
    for subfolder in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        fresh, session = saved_weights(path, subfolder), saved_weights(tiny_sd3, subfolder)
        assert fresh and fresh.keys() == session.keys(), subfolder
        for name in fresh:
            assert torch.equal(fresh[name], session[name]), (subfolder, name)
