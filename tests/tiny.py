"""Tiny random SD3 and FLUX pipelines, built offline and saved to disk for tests.

The training scripts load a model with `from_pretrained(path)` (the whole pipeline, or one
`subfolder` at a time); saving tiny random pipelines with `save_pretrained` lets tests run that
very code path on CPU in seconds.

    python tests/tiny.py OUT_DIR  # builds OUT_DIR/tiny-sd3 and OUT_DIR/tiny-flux, prints --model

or, from Python/pytest: `build_tiny_sd3(out_dir)` / `build_tiny_flux(out_dir)` (see conftest.py).

Both use a 4-channel latent, a VAE that downsamples by 4 (real models: 16 channels, 8x) and
patch size 1, so any resolution that is a multiple of 4 (SD3, up to 256 px: pos_embed_max_size=64)
or of 8 (FLUX: 2x2 latent packing) works; 32-64 px is cheap. The text widths all differ, so a
mixed-up embedding fails loudly: CLIP-L 16, CLIP-G 24, T5 48. Building is deterministic (fixed
seeds) and idempotent (an existing pipeline directory is returned as is).
"""

import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub: a typo never reaches it

import torch
from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                       FluxTransformer2DModel, SD3Transformer2DModel, StableDiffusion3Pipeline)
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection,
                          CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast)

CLIP_L_DIM, CLIP_G_DIM, T5_DIM = 16, 24, 48  # stand-ins for 768, 1280, 4096
LATENT_CHANNELS = 4


# ---------------------------------------------------------------- tokenizers
def clip_tokenizer(pad_token: str = "<|endoftext|>") -> CLIPTokenizer:
    """Byte-level BPE with no merges: every byte, alone and as end-of-word (`x</w>`), is a
    token, so any text tokenizes without <unk>. Real CLIP's id layout: 512 byte tokens, then
    <|startoftext|>, <|endoftext|>."""
    chars = sorted(ByteLevel.alphabet())  # the 256 printable stand-ins byte-level BPE uses
    tokens = chars + [char + "</w>" for char in chars] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=[], pad_token=pad_token, model_max_length=77)


def t5_tokenizer() -> T5TokenizerFast:
    """Character-level Unigram in T5's layout (<pad>=0, </s>=1, <unk>=2, then pieces);
    appends </s> like T5."""
    pieces = ["▁"] + [chr(code) for code in range(33, 127)]  # word-start marker, printable ASCII
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(piece, -1.0) for piece in pieces]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)


# ---------------------------------------------------------------- text encoders
def clip_config(dim: int, vocab_size: int) -> CLIPTextConfig:
    # vocab_size - 2 / - 1 are <|startoftext|> / <|endoftext|>; a non-legacy eos id makes the
    # pooled output read the first <|endoftext|>, as in the real configs. 2 layers, so that
    # hidden_states[-2] (SD3's choice) is a real layer.
    return CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=dim, projection_dim=dim, intermediate_size=2 * dim,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
        bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)


def t5_encoder(vocab_size: int) -> T5EncoderModel:
    torch.manual_seed(0)
    # T5 v1.1 style (gated-gelu); relative position buckets, so any max_sequence_length
    # (256 SD3, 512 FLUX) works.
    config = T5Config(
        vocab_size=vocab_size, d_model=T5_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0)
    return T5EncoderModel(config)


# ---------------------------------------------------------------- VAE
def vae(scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    torch.manual_seed(0)
    # 3 blocks -> vae_scale_factor = 2 ** (3 - 1) = 4. No quant convs, like the SD3.5/FLUX VAEs.
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
        down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
        block_out_channels=[8, 8, 16], layers_per_block=1, norm_num_groups=4, sample_size=32,
        scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=False, use_post_quant_conv=False)


# ---------------------------------------------------------------- pipelines
def save_atomically(pipe, path: str) -> str:
    """Save to a temporary directory, then rename it to `path`: a crash (or a concurrent
    builder) never leaves a half-written pipeline."""
    staging = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".tmp-")
    os.chmod(staging, 0o755)  # mkdtemp makes it owner-only
    pipe.save_pretrained(staging)
    try:
        os.rename(staging, path)
    except OSError:  # another process finished first
        shutil.rmtree(staging)
    return path


def build_tiny_sd3(out_dir) -> str:
    """Tiny SD3.5-shaped pipeline at OUT_DIR/tiny-sd3 (default resolution 32 px); its path."""
    path = os.path.join(os.fspath(out_dir), "tiny-sd3")
    if os.path.exists(os.path.join(path, "model_index.json")):
        return path
    os.makedirs(out_dir, exist_ok=True)

    tokenizer = clip_tokenizer()
    tokenizer_2 = clip_tokenizer(pad_token="!")  # SD3's CLIP-G really pads with "!"
    tokenizer_3 = t5_tokenizer()
    torch.manual_seed(0)
    text_encoder = CLIPTextModelWithProjection(clip_config(CLIP_L_DIM, len(tokenizer)))
    torch.manual_seed(1)
    text_encoder_2 = CLIPTextModelWithProjection(clip_config(CLIP_G_DIM, len(tokenizer_2)))
    torch.manual_seed(0)
    # SD3 concatenates both CLIP sequences (16 + 24 = 40) and zero-pads them to the T5 width (48),
    # so joint_attention_dim = T5 width; pooled = both CLIP projections concatenated (40).
    # qk_norm like SD3.5.
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=1, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
        num_layers=2, attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
        joint_attention_dim=T5_DIM, pooled_projection_dim=CLIP_L_DIM + CLIP_G_DIM,
        pos_embed_max_size=64, qk_norm="rms_norm")
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae(1.5305, 0.0609),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=t5_encoder(len(tokenizer_3)), tokenizer_3=tokenizer_3)
    return save_atomically(pipe, path)


def build_tiny_flux(out_dir) -> str:
    """Tiny FLUX.1-shaped pipeline at OUT_DIR/tiny-flux; its path. Pass height/width
    explicitly: FluxPipeline hard-codes a default of 128 latent pixels (512 px here)."""
    path = os.path.join(os.fspath(out_dir), "tiny-flux")
    if os.path.exists(os.path.join(path, "model_index.json")):
        return path
    os.makedirs(out_dir, exist_ok=True)

    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(0)
    # pooled output = the CLIP hidden width
    text_encoder = CLIPTextModel(clip_config(CLIP_L_DIM, len(tokenizer)))
    torch.manual_seed(0)
    # in_channels = 4 latent channels x 2x2 packing; the RoPE axes dims sum to attention_head_dim.
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=T5_DIM,
        pooled_projection_dim=CLIP_L_DIM, axes_dims_rope=[4, 4, 8], guidance_embeds=True)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(
        transformer=transformer, vae=vae(0.3611, 0.1159), scheduler=scheduler,
        text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=t5_encoder(len(tokenizer_2)), tokenizer_2=tokenizer_2)
    return save_atomically(pipe, path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} OUT_DIR")
    print("--model", build_tiny_sd3(sys.argv[1]))
    print("--model", build_tiny_flux(sys.argv[1]))
