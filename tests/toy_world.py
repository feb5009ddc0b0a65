"""Toy world: pretrained tiny SD3- and FLUX-shaped text-to-image models that make countable
mistakes.

Images are rendered on the fly (PIL, deterministic by seed): 32x32, black background, 1-3
objects of one color (red, yellow, green, blue) and one shape (square, triangle), captioned
like GenEval's counting/color prompts ("two red squares"). 6 of the 24 (count, color, shape)
combinations are held out as test prompts. tests/toy_rewards.py:counting scores an image 1
when the detector finds exactly what the prompt asks for.

    python tests/toy_world.py OUT_DIR  # OUT_DIR/toy-sd3, OUT_DIR/toy-flux from scratch

The committed copies live in tests/assets/toy-sd3 and tests/assets/toy-flux (prompt files
next to them), so tests, benchmarks and the demo never train. Time to build, 1 thread on the
shared 2-core dev box: VAE 1 min, SD3 (4,000 steps at batch 64) 16 min, FLUX (8,000 steps)
17 min: about 35 min. CPU training is not bit-reproducible across thread counts, and
held-out accuracy varies between builds (10 Euler steps, 96 samples; SD3 at CFG 4.5, FLUX
without): two SD3 builds with transformer init seeds 0 (the committed one) and 1 gave 0.552
and 0.594; FLUX 0.521. The committed toys keep the encoders and VAE of an earlier build; only
SD3's transformer and FLUX's transformer and T5 were retrained. SD3 trains 4,000 steps, not
the earlier 1,500: at 1,500 it drew 40 % of its objects as blends of a square and a triangle
(trapezoids, mounds), on training prompts too, which capped exact credit for every RL method;
at 4,000, 16 % (benchmarks/DANCE_DIAGNOSIS.md section 10). FLUX trains its T5 with the
transformer, 8,000 steps: with tests/tiny.py's random T5 (its only per-token text route) no
RL recipe moved its held-out color or accuracy (DANCE_DIAGNOSIS.md sections 9 and 11).

Both pipelines use tests/tiny.py's text encoders and tokenizers (random; CLIP tokenizers cut
at 24 tokens: prompts are short; FLUX's T5 then trained), share one VAE trained as an
autoencoder (4 latent channels, 4x down), and each has a ~0.5M-parameter transformer trained
with rectified flow (x_s = (1-s) x0 + s eps, target eps - x0, s drawn on the shift-3 schedule
the scripts sample with, 10% empty prompts so CFG works). Pass `--max-sequence-length 24`
(the length the transformers were trained with) and `--resolution 32` to the scripts.
"""

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from PIL import Image, ImageDraw
from transformers import CLIPTextModel, CLIPTextModelWithProjection

import tiny
from toy_rewards import COLORS, SHAPES, counting, parse_prompt

RESOLUTION, MAX_SEQUENCE_LENGTH, SHIFT = 32, 24, 3.0
RGB = {
    "red": (220, 40, 40),
    "yellow": (230, 210, 30),
    "green": (40, 180, 40),
    "blue": (40, 70, 230),
}
WORDS = {1: "a", 2: "two", 3: "three"}
ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


def prompt_of(count: int, color: str, shape: str) -> str:
    return f"{WORDS[count]} {color} {shape}{'s' if count > 1 else ''}"


def split() -> tuple[list[str], list[str]]:
    """(train, test) prompts: a combination is held out when
    (count + color index + shape index) % 4 == 0, so every count, color and shape is seen in
    training and each count appears twice among the 6 test combinations."""
    train, test = [], []
    for count in WORDS:
        for ci, color in enumerate(COLORS):
            for si, shape in enumerate(SHAPES):
                (test if (count - 1 + ci + si) % 4 == 0 else train).append(
                    prompt_of(count, color, shape))
    return train, test


def render(prompt: str, seed: int, size: int = RESOLUTION) -> np.ndarray:
    """(size, size, 3) uint8 image of the prompt: non-overlapping objects 28-38% of the side,
    3 px apart."""
    count, color, shape = parse_prompt(prompt)
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (size, size))
    draw, boxes = ImageDraw.Draw(img), []
    while len(boxes) < count:
        s = int(rng.integers(round(0.28 * size), round(0.38 * size) + 1))
        x, y = (int(v) for v in rng.integers(1, size - s, size=2))
        if all(x + s + 3 <= bx or bx + bs + 3 <= x or y + s + 3 <= by or by + bs + 3 <= y
               for bx, by, bs in boxes):
            boxes.append((x, y, s))
        elif rng.random() < 0.05:  # crowded: start over
            boxes = []
    for x, y, s in boxes:
        if shape == "square":
            draw.rectangle([x, y, x + s - 1, y + s - 1], fill=RGB[color])
        else:  # pointing up
            draw.polygon([(x, y + s - 1), (x + s - 1, y + s - 1), (x + (s - 1) / 2, y)],
                         fill=RGB[color])
    return np.asarray(img)


def render_batch(prompts: list[str], seeds) -> torch.Tensor:
    """(B, 3, H, W) float images in [0, 1]."""
    images = [torch.from_numpy(render(p, int(s)).copy()).permute(2, 0, 1)
              for p, s in zip(prompts, seeds)]
    return torch.stack(images) / 255


def write_prompt_files(out_dir: str = ASSETS, repeats: int = 16):
    """toy_train.txt (the 18 training prompts) and toy_test.txt (each of the 6 held-out
    prompts `repeats` times: eval seeds noise by line, so repeats are independent samples)."""
    train, test = split()
    with open(os.path.join(out_dir, "toy_train.txt"), "w") as f:
        f.write("\n".join(train) + "\n")
    with open(os.path.join(out_dir, "toy_test.txt"), "w") as f:
        f.write("\n".join(p for p in test for _ in range(repeats)) + "\n")


# ---------------------------------------------------------------- training
def train_vae(steps: int, batch: int, log) -> "torch.nn.Module":
    """tests/tiny.py's VAE architecture, trained as an autoencoder (MSE + a tiny KL) on
    rendered images of every combination; scaling/shift factors are then set so the latents
    have zero mean and unit std, as in SD3/FLUX."""
    vae = tiny.vae(1.0, 0.0)
    prompts = split()[0] + split()[1]
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    rng = np.random.default_rng(0)
    for step in range(steps):
        idx = rng.integers(len(prompts), size=batch)
        x = render_batch([prompts[i] for i in idx], rng.integers(2**31, size=batch)) * 2 - 1
        post = vae.encode(x).latent_dist
        recon = vae.decode(post.sample()).sample
        loss = (recon - x).pow(2).mean() + 1e-6 * post.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 200 == 0 or step == steps - 1:
            log(f"vae step {step} loss {loss.item():.5f}")
    vae.eval().requires_grad_(False)
    x = render_batch([prompts[i % len(prompts)] for i in range(512)],
                     range(10**6, 10**6 + 512)) * 2 - 1
    z = vae.encode(x).latent_dist.mode()
    vae.register_to_config(shift_factor=round(z.mean().item(), 4),
                           scaling_factor=round(1 / z.std().item(), 4))
    return vae


def encode_latents(vae, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        z = vae.encode(images * 2 - 1).latent_dist.mode()
    return (z - vae.config.shift_factor) * vae.config.scaling_factor


def train_transformer(transformer, forward, embeds, pooled, vae, steps: int, batch: int,
                      lr: float, log, name: str, pool: int = 8192, text_encoder=None):
    """Rectified flow on freshly rendered training images. `embeds`/`pooled`: one row per
    training prompt and a last row for the empty prompt (dropped in 10% of the time).
    `forward(transformer, x, sigma, embeds, pooled)` -> v. With `text_encoder`, `embeds` are
    its token ids, `forward` encodes them, and the encoder trains too (FLUX's T5: see build).

    The pooled-text path (time_text_embed.text_embedder) is zeroed and frozen: with
    tests/tiny.py's random encoders the pooled vector is a per-sentence hash the model
    memorises (held-out prompts then get an arbitrary image), while the per-token path
    composes color, count and shape (held-out accuracy 41 % vs 33 % at 1,500 steps,
    measured)."""
    for p in transformer.time_text_embed.text_embedder.parameters():
        p.data.zero_()
        p.requires_grad_(False)
    train = split()[0]
    # a pool of rendered, encoded training images (cheaper than rendering every step)
    pool_labels = np.arange(pool) % len(train)
    pool_latents = torch.cat([
        encode_latents(vae, render_batch([train[i] for i in pool_labels[k:k + 256]],
                                         range(k, min(k + 256, pool))))
        for k in range(0, pool, 256)])
    params = [p for p in transformer.parameters() if p.requires_grad]
    if text_encoder is not None:
        params += list(text_encoder.requires_grad_(True).train().parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    rng, gen = np.random.default_rng(1), torch.Generator().manual_seed(1)
    transformer.train()
    for step in range(steps):
        pick = rng.integers(pool, size=batch)
        idx, x0 = pool_labels[pick], pool_latents[pick]
        cond = torch.from_numpy(np.where(rng.random(batch) < 0.1, len(train), idx))
        u = torch.rand(batch, generator=gen)
        # the scripts' shift-3 schedule, sampled uniformly in u
        sigma = SHIFT * u / (1 + (SHIFT - 1) * u)
        eps = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1)
        v = forward(transformer, (1 - s) * x0 + s * eps, sigma, embeds[cond], pooled[cond])
        loss = (v - (eps - x0)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 200 == 0 or step == steps - 1:
            log(f"{name} step {step} loss {loss.item():.4f}")
    if text_encoder is not None:
        text_encoder.eval().requires_grad_(False)
    return transformer.eval().requires_grad_(False)


@torch.no_grad()
def accuracy(transformer, forward, embeds, pooled, neg, vae, prompts, steps: int = 10,
             guidance: float = 4.5) -> float:
    """Exact accuracy (toy_rewards.counting) of CFG Euler samples on the shift-3 grid, noise
    seeded by index."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((len(prompts), 4, RESOLUTION // 4, RESOLUTION // 4), generator=gen)
    t = torch.linspace(1, 0, steps + 1)
    sigmas = SHIFT * t / (1 + (SHIFT - 1) * t)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        v_c = forward(transformer, x, s.expand(len(x)), embeds, pooled)
        v_u = forward(transformer, x, s.expand(len(x)),
                      neg[0].expand_as(embeds), neg[1].expand_as(pooled))
        x = x + (s_next - s) * (v_u + guidance * (v_c - v_u))
    images = (
        vae.decode(x / vae.config.scaling_factor + vae.config.shift_factor).sample / 2 + 0.5
    ).clamp(0, 1)
    return counting(images, prompts, None)[0].mean().item()


def sd3_forward(transformer, x, sigma, embeds, pooled):
    return transformer(hidden_states=x, timestep=1000 * sigma, encoder_hidden_states=embeds,
                       pooled_projections=pooled, return_dict=False)[0]


def pack(x):  # (B, C, h, w) -> (B, h/2 * w/2, 4C), FLUX's 2x2 packing
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(
        b, (h // 2) * (w // 2), 4 * c)


def flux_forward_fn(img_ids, text_ids):
    def forward(transformer, x, sigma, embeds, pooled):
        v = transformer(hidden_states=pack(x), timestep=sigma, encoder_hidden_states=embeds,
                        pooled_projections=pooled, txt_ids=text_ids, img_ids=img_ids,
                        return_dict=False)[0]
        b, c, h, w = x.shape
        return v.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
    return forward


def tokenizers(pad_token="<|endoftext|>"):
    tok = tiny.clip_tokenizer(pad_token)
    # the pipelines pad CLIP to this; prompts are <= 22 tokens
    tok.model_max_length = MAX_SEQUENCE_LENGTH
    return tok


def build(out_dir: str, vae_steps: int = 900, transformer_steps: int = 4000,
          flux_steps: int = 8000, batch: int = 64, lr: float = 2e-3, pool: int = 8192,
          log=print):
    """Train the VAE, then SD3 and FLUX transformers; save OUT_DIR/toy-sd3 and
    OUT_DIR/toy-flux. Returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    vae = train_vae(vae_steps, 16, log)
    train, test = split()
    test = [p for p in test for _ in range(16)]
    gt = render_batch(test, range(len(test)))
    with torch.no_grad():
        recon = (vae.decode(vae.encode(gt * 2 - 1).latent_dist.mode()).sample / 2 + 0.5).clamp(0, 1)
    log(f"vae done in {time.time() - t0:.0f}s: "
        f"scaling {vae.config.scaling_factor} shift {vae.config.shift_factor}; "
        f"reconstructions of held-out prompts score "
        f"{counting(recon, test, None)[0].mean().item():.3f}")

    # ---- SD3: the encoders of tests/tiny.py (same seeds), CLIP cut at 24 tokens ----
    tok, tok2, tok3 = tokenizers(), tokenizers(pad_token="!"), tiny.t5_tokenizer()
    torch.manual_seed(0)
    te = CLIPTextModelWithProjection(tiny.clip_config(tiny.CLIP_L_DIM, len(tok)))
    torch.manual_seed(1)
    te2 = CLIPTextModelWithProjection(tiny.clip_config(tiny.CLIP_G_DIM, len(tok2)))
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=1, in_channels=4, out_channels=4, num_layers=4,
        attention_head_dim=16, num_attention_heads=4, caption_projection_dim=64,
        joint_attention_dim=tiny.T5_DIM, pooled_projection_dim=tiny.CLIP_L_DIM + tiny.CLIP_G_DIM,
        pos_embed_max_size=16, qk_norm="rms_norm")
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        text_encoder=te, tokenizer=tok, text_encoder_2=te2, tokenizer_2=tok2,
        text_encoder_3=tiny.t5_encoder(len(tok3)), tokenizer_3=tok3)
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(
            train + [""] + test, None, None, do_classifier_free_guidance=False,
            max_sequence_length=MAX_SEQUENCE_LENGTH)
    t1 = time.time()
    train_transformer(transformer, sd3_forward, embeds, pooled, vae, transformer_steps, batch,
                      lr, log, "sd3", pool)
    n = len(train) + 1
    acc = accuracy(transformer, sd3_forward, embeds[n:], pooled[n:],
                   (embeds[n - 1], pooled[n - 1]), vae, test)
    log(f"sd3: held-out accuracy (10 Euler steps, CFG 4.5) {acc:.3f}")
    log(f"sd3 transformer ({sum(p.numel() for p in transformer.parameters())} params) "
        f"done in {time.time() - t1:.0f}s")
    sd3_path = os.path.join(out_dir, "toy-sd3")
    pipe.save_pretrained(sd3_path)

    # ---- FLUX: CLIP-L + T5 of tests/tiny.py (T5 trained below), no guidance embedding ----
    # (a plain conditional model, like FLUX.1-schnell)
    tok, tok2 = tokenizers(), tiny.t5_tokenizer()
    torch.manual_seed(0)
    te = CLIPTextModel(tiny.clip_config(tiny.CLIP_L_DIM, len(tok)))
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=tiny.T5_DIM,
        pooled_projection_dim=tiny.CLIP_L_DIM, axes_dims_rope=[4, 6, 6], guidance_embeds=False)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=SHIFT, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    t5 = tiny.t5_encoder(len(tok2))
    pipe = FluxPipeline(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=te,
                        tokenizer=tok, text_encoder_2=t5, tokenizer_2=tok2)
    with torch.no_grad():
        _, pooled, text_ids = pipe.encode_prompt(train + [""], None,
                                                 max_sequence_length=MAX_SEQUENCE_LENGTH)
    half = RESOLUTION // 4 // 2
    rows, cols = torch.meshgrid(torch.arange(half), torch.arange(half), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    t1 = time.time()
    forward = flux_forward_fn(img_ids, text_ids)
    # T5 is FLUX's only per-token text route, and a random one passes color too faintly for
    # RL to move it (benchmarks/DANCE_DIAGNOSIS.md section 9): it trains with the transformer,
    # as FLUX's T5 is a trained encoder. (SD3 also reads CLIP's tokens; its encoders stay.)
    token_ids = tok2(train + [""], padding="max_length", max_length=MAX_SEQUENCE_LENGTH,
                     truncation=True, return_tensors="pt").input_ids
    train_transformer(
        transformer, lambda tr, x, sigma, ids, pooled: forward(tr, x, sigma, t5(ids)[0], pooled),
        token_ids, pooled, vae, flux_steps, batch, lr, log, "flux", pool, text_encoder=t5)
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(train + [""] + test, None,
                                               max_sequence_length=MAX_SEQUENCE_LENGTH)
    acc = accuracy(transformer, forward, embeds[n:], pooled[n:],
                   (embeds[n - 1], pooled[n - 1]), vae, test, guidance=1.0)
    log(f"flux: held-out accuracy (10 Euler steps, no CFG) {acc:.3f}")
    log(f"flux transformer ({sum(p.numel() for p in transformer.parameters())} params) "
        f"done in {time.time() - t1:.0f}s")
    flux_path = os.path.join(out_dir, "toy-flux")
    pipe.save_pretrained(flux_path)
    log(f"total {time.time() - t0:.0f}s")
    return sd3_path, flux_path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} OUT_DIR")
    for path in build(sys.argv[1]):
        print("--model", path)
