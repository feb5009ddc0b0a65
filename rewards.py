"""Reward models of the Flow-GRPO / DanceGRPO / DiffusionNFT / AWM / CRD papers behind one contract:
    fn = build_reward("ocr=1.0,pickscore=0.5", device="cuda"); scores, info = fn(images, prompts, metadata)

`images` float (B, 3, H, W) in [0, 1] or a list of PIL; `metadata` the extra fields of a JSONL prompt file. `scores`
is float32 CPU (B,); `info` holds each component's score under its name plus extras. A spec is comma-separated
`name[option=value;...]=weight` terms or `path/to/file.py:function`; a combination scores the weighted **sum** of its
components (upstream flow_grpo `multi_score`). Groupwise rewards (`pickscore_rank`) score pointwise when called and
expose `fn.group_transform(components, group_ids)` for the gathered epoch (None for pointwise ones). Models load with
`from_pretrained(id_or_path)`; heavy imports are lazy, a missing package names its `pip install`; network rewards
are probed when built, retry timeouts and 5xx with backoff, stop at once on a refused connection, and read replies as
data only (never code). Serve any reward from another process/env (loopback unless `--host`; README "Running rewards
on another machine"): `python rewards.py --serve hpsv2 --port 18090`, then `--reward "remote[url=http://host:18090]"`.
"""

import base64
import ctypes
import hmac
import importlib
import importlib.util
import io
import json
import math
import os
import pickle
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image


# ---- helpers: image conversion, optional imports, HTTP with retries ----
def to_pil(images) -> list[Image.Image]:
    """(B, 3, H, W) float [0, 1] tensor or list of PIL -> list of RGB PIL, quantised as upstream (x*255 rounded)."""
    if isinstance(images, torch.Tensor):
        arr = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        return [Image.fromarray(a) for a in arr]
    return [img.convert("RGB") for img in images]


def encoded(img: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def require(module: str, pip: str, reward: str):
    """Import an optional package or fail with the exact install command."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"reward {reward!r} needs an extra package: pip install {pip}") from e


MAX_REPLY = 64 << 20  # bytes: a network reward's reply is a few numbers per image


def one_line(text, limit: int = 300) -> str:
    text = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
    return " ".join(text.split())[:limit]


def post(url: str, body: bytes, content_type: str, timeout: float, retries: int, headers: dict | None = None) -> bytes:
    """POST with a timeout per try; timeouts and 5xx retry with backoff (1 s, 2 s, 4 s, ...); a refused connection or
    a 4xx stops at once (retrying cannot help). Every failure is one line naming the URL."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type, **(headers or {})},
                                     method="POST")
    last = None
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                reply = response.read(MAX_REPLY + 1)
            if len(reply) > MAX_REPLY:
                raise RuntimeError(f"reward server {url} sent a reply over {MAX_REPLY >> 20} MiB")
            return reply
        except urllib.error.HTTPError as e:
            if e.code < 500:
                raise RuntimeError(f"reward server {url} rejected the request (HTTP {e.code}): "
                                   f"{one_line(e.read(500))}") from None
            last = e
        except (urllib.error.URLError, OSError) as e:
            if isinstance(getattr(e, "reason", e), ConnectionRefusedError):
                raise RuntimeError(f"reward server {url} refused the connection (nothing listens there)") from None
            last = e  # unreachable, reset, timeout: maybe transient
        if attempt < retries:
            time.sleep(2**attempt)
    raise RuntimeError(f"reward server {url} failed after {retries + 1} tries ({timeout:g}s timeout each): "
                       f"{one_line(last)}")


def probe(url: str, timeout: float = 3.0):
    """At build time, before any model loads: one TCP connect to the URL's host:port (nothing is sent)."""
    parts = urllib.parse.urlsplit(url)
    try:
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http(s)://host:port URL")
        socket.create_connection((parts.hostname, parts.port or {"https": 443}.get(parts.scheme, 80)), timeout).close()
    except (OSError, ValueError) as e:
        raise ValueError(f"reward server {url} is not reachable: {one_line(getattr(e, 'strerror', None) or e)} "
                         f"(is the server running there?)") from None


class PlainData(pickle.Unpickler):
    """Builds dict, list, tuple, set, str, bytes, int, float, bool and None only: every class or function lookup
    (the way a pickle runs code) is refused. Upstream's GenEval server replies with lists and dicts of Python floats
    (yifan123/reward-server app_geneval.py, reward_server/gen_eval.py::compute_geneval): no numpy needed."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it references {module}.{name}; only plain data is accepted")


def numbers(values, n: int) -> torch.Tensor:
    """values as float32 (n,), or ValueError for a wrong length or type or a non-finite value."""
    out = torch.tensor(values, dtype=torch.float32)
    if out.shape != (n,) or not out.isfinite().all():
        raise ValueError(f"expected {n} finite numbers, got {one_line(repr(values), 120)}")
    return out


def read_reply(url: str, parse):
    """parse() with any failure as one line naming the URL: a malformed reply is an error, not a traceback."""
    try:
        return parse()
    except Exception as e:
        raise RuntimeError(f"reward server {url} sent a malformed reply ({type(e).__name__}: {one_line(e)})") from None


def floats(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ---- OCR (Flow-GRPO's text-rendering reward) ----
def ocr_target(prompt: str) -> str | None:
    """The text between the first pair of double quotes, or None."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute; cost 1 each)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognised: str, target: str) -> float:
    """1 if target in recognised, else 1 - min(edit distance, len)/len; lower-cased, no spaces (flow_grpo/ocr.py)."""
    recognised, target = recognised.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not target:
        return 1.0
    dist = 0 if target in recognised else min(levenshtein(recognised, target), len(target))
    return 1.0 - dist / len(target)


def ocr(workers: int = 8, rec_model: str = "", rec_keys: str = ""):
    """PP-OCR (rapidocr-onnxruntime, weights inside the wheel, CPU) accuracy of the quoted text of each prompt.
    Set up as upstream's `PaddleOCR(lang="en", use_angle_cls=False)` (flow_grpo/ocr.py; PaddleOCR 2.9.1 defaults in
    tools/infer/utility.py): no angle classifier, detector resized to at most 960 px, box threshold 0.6, unclip 1.5,
    no dilation, drop score 0.5. The wheel ships only the Chinese+English PP-OCRv4 recognizer (upstream: English
    en_PP-OCRv4_rec); `rec_model`/`rec_keys`: a local English .onnx and its character list instead."""
    paths = {"rec_model_path": rec_model, "rec_keys_path": rec_keys}
    if missing := [path for path in paths.values() if path and not os.path.isfile(path)]:
        raise ValueError(f"ocr reward: no such file {missing[0]!r} (rec_model / rec_keys)")
    engine = require("rapidocr_onnxruntime", "rapidocr-onnxruntime", "ocr").RapidOCR(
        use_cls=False, det_limit_side_len=960, det_limit_type="max", det_box_thresh=0.6, det_unclip_ratio=1.5,
        det_use_dilation=False, text_score=0.5, **{k: v for k, v in paths.items() if v})
    pool = ThreadPoolExecutor(max_workers=int(workers))

    def read(img: Image.Image) -> str:
        result, _ = engine(np.asarray(img))
        return "".join(text for _, text, conf in (result or []) if float(conf) > 0)

    def fn(images, prompts, metadata):
        targets = [ocr_target(p) for p in prompts]
        if None in targets:
            raise ValueError(f"ocr reward: prompt {prompts[targets.index(None)]!r} has no quoted target text")
        return floats([ocr_score(t, g) for t, g in zip(pool.map(read, to_pil(images)), targets)]), {}
    return fn


# ---- CLIP family (PickScore, CLIPScore, LAION aesthetic), HPS v2.1, ImageReward ----
def clip_features(model, processor, images, prompts, device):
    """L2-normalised image (B, D) and text (B, D) embeddings of a transformers CLIPModel."""
    inputs = processor(images=to_pil(images), text=prompts, padding=True, truncation=True, max_length=77,
                       return_tensors="pt").to(device)
    with torch.no_grad():
        img = model.get_image_features(pixel_values=inputs["pixel_values"])
        txt = model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    img, txt = getattr(img, "pooler_output", img), getattr(txt, "pooler_output", txt)  # transformers 5: model outputs
    return torch.nn.functional.normalize(img.float(), dim=-1), torch.nn.functional.normalize(txt.float(), dim=-1)


def load_clip(model: str, processor: str, device):
    """A transformers CLIPModel, its processor, and logits(images, prompts) -> logit_scale * cos (B,) on the CPU."""
    transformers = importlib.import_module("transformers")
    clip = transformers.CLIPModel.from_pretrained(model).to(device).eval()
    proc = transformers.CLIPProcessor.from_pretrained(processor)

    def logits(images, prompts):
        img, txt = clip_features(clip, proc, images, prompts, device)
        return (clip.logit_scale.exp() * (img * txt).sum(-1)).cpu().float()
    return clip, proc, logits


def pickscore(device="cpu", model="yuvalkirstain/PickScore_v1", processor="laion/CLIP-ViT-H-14-laion2B-s32B-b79K"):
    """logit_scale * cos / 26 as upstream (flow_grpo/pickscore_scorer.py); tables use the raw `pickscore_raw` (~22)."""
    _, _, logits = load_clip(model, processor, device)

    def fn(images, prompts, metadata):
        raw = logits(images, prompts)
        return raw / 26, {"pickscore_raw": raw}
    return fn


def clipscore(device="cpu", model="openai/clip-vit-large-patch14", processor=None):
    """CLIP ViT-L/14 logit_scale * cos(image, text) / 30 (flow_grpo/clip_scorer.py: logits_per_image diagonal / 30)."""
    _, _, logits = load_clip(model, processor or model, device)
    return lambda images, prompts, metadata: (logits(images, prompts) / 30, {})


def aesthetic_head(dim: int) -> torch.nn.Sequential:
    """The LAION improved-aesthetic MLP (dropouts are identity in eval); indices match the released state dict."""
    return torch.nn.Sequential(torch.nn.Linear(dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
                               torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
                               torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))


def aesthetic(device="cpu", model="openai/clip-vit-large-patch14", processor=None,
              head="https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
                   "sac+logos+ava1-l14-linearMSE.pth"):
    """LAION aesthetic MLP on normalised CLIP ViT-L/14 image features (~5-6); `head`: path/URL of its weights."""
    clip, proc, _ = load_clip(model, processor or model, device)
    state = (torch.load(head, map_location="cpu") if os.path.exists(head)
             else torch.hub.load_state_dict_from_url(head, map_location="cpu"))
    mlp = aesthetic_head(clip.config.projection_dim)
    mlp.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
    mlp = mlp.to(device).eval()

    def fn(images, prompts, metadata):
        img, _ = clip_features(clip, proc, images, [""] * len(prompts), device)
        with torch.no_grad():
            return mlp(img).squeeze(-1).cpu().float(), {}
    return fn


def hpsv2(device="cpu", checkpoint="xswu/HPSv2:HPS_v2.1_compressed.pt"):
    """HPS v2.1 (DanceGRPO): open_clip ViT-H-14 cos(image, text) (~0.3); `checkpoint`: .pt path or `repo:file`."""
    open_clip = require("open_clip", "open-clip-torch", "hpsv2")
    model, _, preprocess = open_clip.create_model_and_transforms("ViT-H-14", pretrained=None, precision="fp32")
    if not os.path.exists(checkpoint):
        checkpoint = importlib.import_module("huggingface_hub").hf_hub_download(*checkpoint.split(":"))
    state = torch.load(checkpoint, map_location="cpu")
    model.load_state_dict(state.get("state_dict", state))
    model = model.to(device).eval()
    tokenizer = open_clip.get_tokenizer("ViT-H-14")

    def fn(images, prompts, metadata):
        pixels = torch.stack([preprocess(img) for img in to_pil(images)]).to(device)
        with torch.no_grad():
            img = torch.nn.functional.normalize(model.encode_image(pixels).float(), dim=-1)
            txt = torch.nn.functional.normalize(model.encode_text(tokenizer(prompts).to(device)).float(), dim=-1)
        return (img * txt).sum(-1).cpu(), {}
    return fn


def imagereward(device="cpu", model="ImageReward-v1.0"):
    """ImageReward v1.0 raw score (BLIP-based; ~-2..2), one `score(prompt, image)` call per image as upstream."""
    rm = require("ImageReward", "image-reward", "imagereward").load(model, device=str(device))

    def fn(images, prompts, metadata):
        with torch.no_grad():
            return floats([float(rm.score(p, img)) for p, img in zip(prompts, to_pil(images))]), {}
    return fn


# ---- JPEG (in)compressibility (DDPO; flow_grpo/rewards.py::jpeg_compressibility) ----
def jpeg_kilobytes(images) -> torch.Tensor:
    """Size in kB (1000 bytes) of each image saved as JPEG at quality 95."""
    return floats([len(encoded(img, "JPEG", quality=95)) / 1000 for img in to_pil(images)])


def jpeg(scale: float):
    """scale * JPEG kB: -1/500 for `jpeg_compressibility` (small files win), 1 for `jpeg_incompressibility`."""
    return lambda images, prompts, metadata: (scale * jpeg_kilobytes(images), {})


# ---- network rewards: GenEval server, VLM judges (OpenAI-compatible), generic remote reward server ----
def geneval(url="http://127.0.0.1:18085", timeout=120.0, retries=5, batch_size=64, key="scores"):
    """GenEval reward-server client (yifan123/reward-server; flow_grpo/rewards.py::geneval_score): POSTs pickled
    {images: [JPEG], meta_datas, only_strict} for GenEval JSONL prompts; scores with the reply's partial-credit
    `scores` (`key=rewards`: official-style correctness, the paper metric), logs `strict_rewards`."""
    timeout, retries, batch_size = float(timeout), int(retries), int(batch_size)
    if key not in ("scores", "rewards", "strict_rewards"):
        raise ValueError(f"geneval key must be scores, rewards or strict_rewards, not {key!r}")
    probe(url)

    def fn(images, prompts, metadata):
        pil, scores, strict = to_pil(images), [], []
        for start in range(0, len(pil), batch_size):
            batch = pil[start : start + batch_size]
            body = pickle.dumps({"images": [encoded(img, "JPEG") for img in batch],
                                 "meta_datas": list(metadata[start : start + batch_size]),
                                 "only_strict": key != "rewards"})
            raw = post(url, body, "application/octet-stream", timeout, retries)
            reply = read_reply(url, lambda: PlainData(io.BytesIO(raw)).load())  # upstream pickles: read data only
            scores.append(read_reply(url, lambda: numbers(reply[key], len(batch))))
            strict.append(read_reply(url, lambda: numbers(reply.get("strict_rewards", reply["scores"]), len(batch))))
        return torch.cat(scores), {"geneval_strict": torch.cat(strict)}
    return fn


JUDGE_INSTRUCTION = ("You are given a text prompt and an image generated from it. Judge how well the image follows "
                     "the prompt and how good it looks. Give a score from 1 to 5, then write 'Final Score: x'.\n"
                     "Prompt: {prompt}")
YESNO_QUESTION = "Does this image match the description: \"{prompt}\"? Answer Yes or No."


def chat_reward(url, model, api_key, text, timeout, retries, workers, score_reply, resize=0, **extra):
    """Score each (image, prompt) by one OpenAI-compatible /chat/completions call; score_reply(json) -> float."""
    probe(url)
    pool = ThreadPoolExecutor(max_workers=int(workers))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def score(img, prompt):
        png = base64.b64encode(encoded(img.resize((int(resize),) * 2) if int(resize) else img, "PNG")).decode()
        body = {"model": model, "temperature": 0.0, **extra, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
            {"type": "text", "text": text.format(prompt=prompt)}]}]}
        reply = post(url.rstrip("/") + "/chat/completions", json.dumps(body).encode(), "application/json",
                     float(timeout), int(retries), headers)
        return read_reply(url, lambda: numbers([score_reply(json.loads(reply))], 1)[0])

    return lambda images, prompts, metadata: (torch.stack(list(pool.map(score, to_pil(images), prompts))), {})


def vlm_judge(url="http://127.0.0.1:17140/v1", model="UnifiedReward-7b-v1.5", api_key="flowgrpo",
              instruction=JUDGE_INSTRUCTION, timeout=60.0, retries=3, workers=16, resize=512):
    """UnifiedReward-style judge (flow_grpo unifiedreward_score_sglang): `Final Score: x` -> x/5, no score -> 0."""
    pattern = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")

    def score_reply(reply):
        match = pattern.search(reply["choices"][0]["message"]["content"] or "")
        return float(match.group(1)) / 5 if match else 0.0
    return chat_reward(url, model, api_key, instruction, timeout, retries, workers, score_reply, resize,
                       max_tokens=512)


def vlm_yesno(url="http://127.0.0.1:17140/v1", model="Qwen/Qwen2.5-VL-7B-Instruct", api_key="",
              question=YESNO_QUESTION, timeout=60.0, retries=3, workers=16, top_logprobs=20):
    """P(Yes): summed probability of first-token top logprobs reading `yes` (server must return logprobs)."""

    def score_reply(reply):
        top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        return sum(math.exp(t["logprob"]) for t in top if t["token"].strip().lower() == "yes")
    return chat_reward(url, model, api_key, question, timeout, retries, workers, score_reply, max_tokens=1,
                       logprobs=True, top_logprobs=int(top_logprobs))


def remote(url="http://127.0.0.1:18090", timeout=300.0, retries=5, token=""):
    """Any reward served by `python rewards.py --serve NAME` (JSON: base64 PNGs, prompts, metadata -> scores, info);
    `token`: the server's shared secret (default $REWARD_SERVER_TOKEN), checked once here by a GET."""
    token = token or os.environ.get("REWARD_SERVER_TOKEN", "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    probe(url)
    try:
        urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=min(float(timeout), 30)).close()
    except urllib.error.HTTPError as e:
        raise ValueError(f"reward server {url} refused us (HTTP {e.code}): {one_line(e.read(300))}") from None
    except OSError as e:
        raise ValueError(f"reward server {url} did not answer: {one_line(getattr(e, 'reason', e))}") from None

    def fn(images, prompts, metadata):
        pngs = [base64.b64encode(encoded(img, "PNG")).decode() for img in to_pil(images)]
        body = json.dumps({"images": pngs, "prompts": list(prompts), "metadata": list(metadata)}).encode()
        raw = post(url, body, "application/json", float(timeout), int(retries), headers)
        reply = read_reply(url, lambda: json.loads(raw))
        return read_reply(url, lambda: (numbers(reply["scores"], len(pngs)),
                                        {str(k): numbers(v, len(pngs)) for k, v in dict(reply["info"]).items()}))
    return fn


# ---- groupwise: rank of PickScore within the prompt's group ----
def group_rank(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Rank within its group scaled to [0, 1] (worst 0, best 1, ties share their mean rank; a lone image 0.5)."""
    out = torch.empty(len(scores))
    for g in group_ids.unique():
        s = scores[group_ids == g].float()
        rank = (s[None, :] < s[:, None]).sum(1) + ((s[None, :] == s[:, None]).sum(1) - 1) / 2  # (number below, ties)
        out[group_ids == g] = rank / (len(s) - 1) if len(s) > 1 else 0.5
    return out


def pickscore_rank(device="cpu", **options):
    """Groupwise (Flow-Factory reward guide): PickScore/26 when called; `group_transform` ranks it in its group."""
    fn = pickscore(device, **options)  # a fresh closure: the attribute below is this reward's alone
    fn.group_transform = lambda components, group_ids: group_rank(components["pickscore_rank"], group_ids)
    return fn


REWARDS = {"ocr": ocr, "pickscore": pickscore, "clipscore": clipscore, "aesthetic": aesthetic, "hpsv2": hpsv2,
           "imagereward": imagereward, "jpeg_compressibility": lambda: jpeg(-1 / 500),
           "jpeg_incompressibility": lambda: jpeg(1.0), "geneval": geneval, "vlm_judge": vlm_judge,
           "vlm_yesno": vlm_yesno, "remote": remote, "pickscore_rank": pickscore_rank}
USES_DEVICE = {"pickscore", "clipscore", "aesthetic", "hpsv2", "imagereward", "pickscore_rank"}


# ---- specs: parsing, building, combining ----
def parse_spec(spec: str) -> list[tuple[str, dict, float]]:
    """`a[k=v;k2=v2]=0.5,b` -> [(a, {k: v, k2: v2}, 0.5), (b, {}, 1.0)]; `file.py:fn=w` keeps the path as name."""
    parsed = []
    for term in (t.strip() for t in re.split(r",(?![^\[]*\])", spec)):  # commas outside [...]
        match = re.fullmatch(r"([^\[\]=]+?)(?:\[(.*)\])?(?:=([-+0-9.eE]+))?", term)
        if not match:
            raise ValueError(f"cannot parse reward term {term!r}; expected name[option=value;...]=weight")
        name, opts, weight = match.groups()
        options = dict(kv.split("=", 1) for kv in opts.split(";") if kv) if opts else {}
        if name.split(":")[0].endswith(".py"):
            if not os.path.isfile(name.split(":")[0]) or ":" not in name:
                raise ValueError(f"custom reward {name!r} must be an existing `path/to/file.py:function`")
        elif name not in REWARDS:
            raise ValueError(f"unknown reward {name!r}; choose from {', '.join(REWARDS)} or path/to/file.py:function")
        parsed.append((name, options, float(weight) if weight else 1.0))
    return parsed


def component_name(name: str) -> str:
    return name.split(":")[1] if name.split(":")[0].endswith(".py") else name


def parse_weights(spec: str) -> dict[str, float]:
    """{component name: weight} of a spec (a custom `file.py:fn` is named `fn`)."""
    return {component_name(name): weight for name, _, weight in parse_spec(spec)}


def check_prompts(spec: str, prompts: list[str]):
    """Cheap checks before any model loads: the spec parses, and OCR prompts carry a quoted target."""
    for name, _, _ in parse_spec(spec):
        if name == "ocr" and (bad := [p for p in prompts if ocr_target(p) is None]):
            raise ValueError(f"the ocr reward needs the target text in double quotes in every prompt, e.g. "
                             f"'A sign that says \"hello\"'; {len(bad)} prompt(s) have none, first: {bad[0]!r}")


def load_custom(name: str):
    """`path/to/file.py:function` -> that function (called as fn(images, prompts, metadata) -> (scores, info))."""
    path, attr = name.rsplit(":", 1)
    if not os.path.isfile(path):
        raise ValueError(f"reward file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a syntax error or a failing import in the user's file: one line, not a traceback
        raise ValueError(f"reward file {path!r} does not load: {type(e).__name__}: {e}".splitlines()[0]) from None
    if not callable(getattr(module, attr, None)):
        raise ValueError(f"reward file {path!r} has no function {attr!r}")
    return getattr(module, attr)


def build_reward(spec: str, device="cpu"):
    """Build the (weighted-sum) reward of a spec; see the module docstring."""
    fns, weights = {}, {}
    for name, options, weight in parse_spec(spec):
        key = component_name(name)
        if key not in REWARDS:
            fns[key] = load_custom(name)
        else:
            fns[key] = REWARDS[key](**options, **({"device": device} if key in USES_DEVICE else {}))
        weights[key] = weight

    def combined(images, prompts, metadata):
        total, info = torch.zeros(len(prompts)), {}
        for key, fn in fns.items():
            score, extra = fn(images, prompts, metadata)
            score = torch.as_tensor(score, dtype=torch.float32).cpu().reshape(len(prompts))
            info.update({k: torch.as_tensor(v, dtype=torch.float32).cpu() for k, v in extra.items()})
            info[key] = score
            total += weights[key] * score
        return total, info

    groupwise = {k: f.group_transform for k, f in fns.items() if getattr(f, "group_transform", None)}

    def group_transform(components: dict, group_ids: torch.Tensor):
        """(total, components) with the groupwise components replaced by their group transform."""
        components = {**components, **{k: t(components, group_ids) for k, t in groupwise.items()}}
        return sum(weights[k] * components[k] for k in fns), components

    combined.group_transform = group_transform if groupwise else None
    combined.weights = weights
    return combined


# ---- reward server: `python rewards.py --serve SPEC --port N` answers the `remote` reward's JSON protocol ----
class Refused(Exception):
    """(HTTP status, message): the server's answer to a request it will not score."""


def make_server(spec: str, host: str = "127.0.0.1", port: int = 18090, device="cpu", token: str = "",
                max_body_mb: float = 64.0, max_images: int = 256, max_pixels: int = 2048**2, timeout: float = 120.0):
    """HTTP server of a reward spec. POST: JSON {images: [base64 PNG], prompts, metadata} -> {scores, info};
    GET: {reward, limits} (the client's token check). With a `token`, every request needs `Authorization: Bearer
    <token>` (401 missing, 403 wrong). Refused before anything is decoded: a body over `max_body_mb`, more than
    `max_images` images, an image over `max_pixels` (413); a client slower than `timeout` s is dropped (408).
    Requests are scored one at a time, and freed memory is handed back to the OS after each."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    fn, lock, max_body = build_reward(spec, device=device), threading.Lock(), int(max_body_mb * 2**20)
    limits = {"max_body_mb": max_body_mb, "max_images": max_images, "max_pixels": max_pixels, "timeout": timeout}
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if os.name == "posix" else None  # glibc keeps freed heap

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.answer(lambda body: {"reward": spec, "limits": limits})

        def do_POST(self):
            self.answer(lambda body: self.score(json.loads(body)))

        def answer(self, work):
            deadline, length = time.monotonic() + timeout, self.headers.get("Content-Length", "0")
            try:
                if not length.isdigit():
                    raise Refused(400, f"bad Content-Length {length!r}")
                try:
                    given = self.headers.get("Authorization", "")
                    if token and not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                        raise Refused(403, "wrong token") if given else Refused(
                            401, "this reward server needs a token: remote[token=...] or $REWARD_SERVER_TOKEN")
                    if int(length) > max_body:
                        raise Refused(413, f"request body of {int(length) / 2**20:.1f} MiB is over this server's "
                                           f"limit of {max_body_mb:g} MiB (--max-body-mb)")
                except Refused:
                    self.read(-int(length), deadline)  # discard the body so that the client reads the answer
                    raise
                status, payload = 200, work(self.read(int(length), deadline))
            except Refused as e:
                status, payload = e.args[0], {"error": e.args[1]}
            except Exception as e:  # the client sees the reason, not a dropped connection
                status, payload = 400, {"error": one_line(repr(e), 1000)}
            if trim:
                trim(0)  # the request's images are gone by now: memory returns to its baseline
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")  # HTTP/1.0: one request per connection
            self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def read(self, n: int, deadline: float) -> bytes:
            """n bytes of body (with n < 0: -n bytes discarded), or Refused(408) past the deadline."""
            chunks, left = [], abs(n)
            while left > 0:
                try:
                    chunk = self.rfile.read1(min(left, 1 << 20))
                except TimeoutError:
                    chunk = b""
                if not chunk or time.monotonic() > deadline:
                    raise Refused(408, f"request body not received within {timeout:g} s")
                left -= len(chunk)
                chunks.append(chunk) if n > 0 else None
            return b"".join(chunks)

        def score(self, request) -> dict:
            images, prompts, metadata = (list(request[key]) for key in ("images", "prompts", "metadata"))
            if len(images) > max_images:
                raise Refused(413, f"{len(images)} images is over this server's limit of {max_images} (--max-images)")
            try:  # Image.open reads the header only: sizes are checked before any pixel is decoded
                opened = [Image.open(io.BytesIO(base64.b64decode(b, validate=True)), formats=["PNG"]) for b in images]
            except Image.DecompressionBombError as e:
                raise Refused(413, one_line(e)) from None
            for i, img in enumerate(opened):
                if img.width * img.height > max_pixels:
                    raise Refused(413, f"image {i} has {img.width}x{img.height} pixels, over this server's limit of "
                                       f"{max_pixels} (--max-pixels)")
            with lock:  # one request's images in memory at a time
                scores, info = fn([img.convert("RGB") for img in opened], prompts, metadata)
            return {"scores": scores.tolist(), "info": {k: v.tolist() for k, v in info.items()}}

        def log_message(self, *args):
            pass

    Handler.timeout = timeout  # socket timeout of every read and write; the body also has a total deadline
    return ThreadingHTTPServer((host, port), Handler)


def serve(serve: str, host: str = "127.0.0.1", port: int = 18090, token: str = "", max_body_mb: float = 64.0,
          max_images: int = 256, max_pixels: int = 2048 * 2048, timeout: float = 120.0,
          device: str = "cuda" if torch.cuda.is_available() else "cpu"):
    """Serve the reward spec `--serve` (e.g. hpsv2, or 'ocr=1,pickscore=0.5') for `--reward remote[url=...]`.

    Args:
        host: address to bind: loopback by default; 0.0.0.0 opens the server to the network (set a token then).
        token: shared secret every request must carry (default $REWARD_SERVER_TOKEN, which keeps it out of ps).
        max_body_mb: largest request body accepted (MiB).
        max_images: most images in one request.
        max_pixels: most pixels (width x height) of one image.
        timeout: seconds a client may take to send its request.
    """
    token = token or os.environ.get("REWARD_SERVER_TOKEN", "")
    server = make_server(serve, host, port, device, token, max_body_mb, max_images, max_pixels, timeout)
    print(f"serving reward {serve!r} on http://{host}:{server.server_address[1]} "
          f"({'token required' if token else 'no token'})", flush=True)
    if not token and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: {host} is reachable from other machines and no token is set", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    importlib.import_module("tyro").cli(serve)
