"""Reward models of the Flow-GRPO / DanceGRPO / DiffusionNFT / AWM / CRD papers behind one contract:
    fn = build_reward("ocr=1.0,pickscore=0.5", device="cuda"); scores, info = fn(images, prompts, metadata)

`images` float (B, 3, H, W) in [0, 1] or a list of PIL; `metadata` the extra fields of a JSONL prompt file. `scores`
is float32 CPU (B,); `info` holds each component's score under its name plus extras. A spec is comma-separated
`name[option=value;...]=weight` terms or `path/to/file.py:function`; a combination scores the weighted **sum** of its
components (upstream flow_grpo `multi_score`). `python rewards.py --serve SPEC` serves a reward to other machines.
"""

import base64
import ctypes
import hmac
import importlib
import io
import json
import os
import pickle
import re
import runpy
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from PIL import Image


# ---- helpers: images, optional imports, HTTP with retries, replies read as data ----
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


def one_line(text, limit: int = 300) -> str:
    text = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
    return " ".join(text.split())[:limit]


def call(url: str, body: bytes | None = None, content_type="application/json", timeout=30.0, retries=0, token=""):
    """POST `body` with a timeout per try: timeouts and 5xx retry with backoff (1 s, 2 s, 4 s, ...), nothing listening
    there or a 4xx stops at once. Without a body, the probe of a reward being built: one GET, where any answer but a
    401/403 (a missing or wrong `token`) means a server listens. Every failure is one line naming the URL."""
    error = ValueError if body is None else RuntimeError  # failing while a reward is built is bad input
    headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {token}"} if token else {})}
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=timeout) as response:
                return response.read(64 << 20)  # a reply is a few numbers per image: a longer one is cut, unreadable
        except (OSError, ValueError) as e:  # HTTPError: an answer; URLError: none; ValueError: not an http(s) URL
            code, why = getattr(e, "code", 0), getattr(e, "reason", e)
            if code in (401, 403) or (body is not None and 0 < code < 500):
                raise error(f"reward server {url} answered HTTP {code}: {one_line(e.read(500))}") from None
            if body is None and code:  # any other answer to the probe: a server listens
                return b""
            if body is None or isinstance(why, ConnectionRefusedError):
                raise error(f"reward server {url} is not reachable: {one_line(getattr(why, 'strerror', 0) or why)}"
                            " (is the server running there?)") from None
            last = e  # a 5xx, unreachable, reset, timeout: maybe transient
        if attempt < retries:
            time.sleep(2**attempt)
    raise error(f"reward server {url} failed after {retries + 1} tries ({timeout:g}s timeout each): {one_line(last)}")


def read_reply(url: str, raw: bytes, n: int, parse) -> dict:
    """parse(raw) -> {name: n numbers} as float32 tensors; a malformed, wrongly sized or non-finite one is one line."""
    try:
        out = {k: torch.tensor(v, dtype=torch.float32) for k, v in parse(raw).items()}
        if bad := [v for v in out.values() if v.shape != (n,) or not v.isfinite().all()]:
            raise ValueError(f"expected {n} finite numbers, got {one_line(repr(bad[0].tolist()), 120)}")
        return out
    except Exception as e:
        raise RuntimeError(f"reward server {url} sent a malformed reply ({type(e).__name__}: {one_line(e)})") from None


# ---- OCR (Flow-GRPO's text-rendering reward) ----
def ocr_target(prompt: str) -> str | None:
    """The text between the first pair of double quotes, or None."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def levenshtein(a: str, b: str) -> int:
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
    dist = 0 if target in recognised else min(levenshtein(recognised, target), len(target))
    return 1.0 - dist / max(len(target), 1)  # an empty target is always contained


def ocr(workers: int = 8, rec_model: str = "", rec_keys: str = ""):
    """PP-OCR accuracy of the prompt's quoted text, set up as upstream's `PaddleOCR(lang="en", use_angle_cls=False)`
    (flow_grpo/ocr.py; README "OCR deviation"); `rec_model`/`rec_keys`: a local recognizer .onnx and its charset."""
    paths = {"rec_model_path": rec_model, "rec_keys_path": rec_keys}
    if missing := [path for path in paths.values() if path and not os.path.isfile(path)]:
        raise ValueError(f"ocr reward: no such file {missing[0]!r} (rec_model / rec_keys)")
    engine = require("rapidocr_onnxruntime", "rapidocr-onnxruntime", "ocr").RapidOCR(
        use_cls=False, det_limit_side_len=960, det_limit_type="max", det_box_thresh=0.6, det_unclip_ratio=1.5,
        det_use_dilation=False, text_score=0.5, **{k: v for k, v in paths.items() if v})
    pool = ThreadPoolExecutor(max_workers=int(workers))
    def fn(images, prompts, metadata):
        targets = [ocr_target(p) for p in prompts]
        if None in targets:
            raise ValueError(f"ocr reward: prompt {prompts[targets.index(None)]!r} has no quoted target text")
        found = pool.map(lambda img: engine(np.asarray(img))[0] or [], to_pil(images))  # [(box, text, confidence)]
        read = ["".join(text for _, text, conf in result if float(conf) > 0) for result in found]
        return torch.tensor([ocr_score(r, t) for r, t in zip(read, targets)]), {}
    return fn


# ---- CLIP family (PickScore, CLIPScore, LAION aesthetic), HPS v2.1, ImageReward, JPEG size ----
def load_clip(model: str, processor: str | None, device):
    """CLIPModel, features(images, prompts) -> unit image and text embeddings, logits(...) -> logit_scale * cos."""
    transformers = importlib.import_module("transformers")
    clip = transformers.CLIPModel.from_pretrained(model).to(device).eval().requires_grad_(False)
    proc = transformers.CLIPProcessor.from_pretrained(processor or model)
    def features(images, prompts):
        inputs = proc(images=to_pil(images), text=prompts, padding=True, truncation=True, max_length=77,
                      return_tensors="pt").to(device)
        img = clip.get_image_features(pixel_values=inputs["pixel_values"])
        txt = clip.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        img, txt = getattr(img, "pooler_output", img), getattr(txt, "pooler_output", txt)  # transformers 5: outputs
        return torch.nn.functional.normalize(img.float(), dim=-1), torch.nn.functional.normalize(txt.float(), dim=-1)

    def logits(images, prompts):
        img, txt = features(images, prompts)
        return (clip.logit_scale.exp() * (img * txt).sum(-1)).cpu().float()
    return clip, features, logits


def pickscore(device="cpu", model="yuvalkirstain/PickScore_v1", processor="laion/CLIP-ViT-H-14-laion2B-s32B-b79K"):
    """logit_scale * cos / 26 as upstream (flow_grpo/pickscore_scorer.py); tables use the raw `pickscore_raw` (~22)."""
    logits = load_clip(model, processor, device)[2]
    def fn(images, prompts, metadata):
        raw = logits(images, prompts)
        return raw / 26, {"pickscore_raw": raw}
    return fn


def clipscore(device="cpu", model="openai/clip-vit-large-patch14", processor=None):
    """CLIP ViT-L/14 logit_scale * cos(image, text) / 30 (flow_grpo/clip_scorer.py: logits_per_image diagonal / 30)."""
    logits = load_clip(model, processor, device)[2]
    return lambda images, prompts, metadata: (logits(images, prompts) / 30, {})


def aesthetic(device="cpu", model="openai/clip-vit-large-patch14", processor=None,
              head="https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
                   "sac+logos+ava1-l14-linearMSE.pth"):
    """LAION improved-aesthetic MLP on unit CLIP ViT-L/14 image features (~5-6); `head`: path/URL of its weights."""
    clip, features, _ = load_clip(model, processor, device)
    state = (torch.load(head, map_location="cpu") if os.path.exists(head)
             else torch.hub.load_state_dict_from_url(head, map_location="cpu"))
    nn = torch.nn
    mlp = nn.Sequential(nn.Linear(clip.config.projection_dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128),
                        nn.Dropout(0.2), nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))
    mlp.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})  # the released `layers.i` keys
    mlp = mlp.to(device).eval().requires_grad_(False)
    return lambda images, prompts, metadata: (mlp(features(images, [""] * len(prompts))[0]).squeeze(-1).cpu(), {})


def hpsv2(device="cpu", checkpoint="xswu/HPSv2:HPS_v2.1_compressed.pt"):
    """HPS v2.1 (DanceGRPO): open_clip ViT-H-14 cos(image, text) (~0.3); `checkpoint`: .pt path or `repo:file`."""
    open_clip = require("open_clip", "open-clip-torch", "hpsv2")
    model, _, preprocess = open_clip.create_model_and_transforms("ViT-H-14", pretrained=None, precision="fp32")
    if not os.path.exists(checkpoint):
        checkpoint = importlib.import_module("huggingface_hub").hf_hub_download(*checkpoint.split(":"))
    state = torch.load(checkpoint, map_location="cpu")
    model.load_state_dict(state.get("state_dict", state))
    model, tokenizer = model.to(device).eval().requires_grad_(False), open_clip.get_tokenizer("ViT-H-14")
    def fn(images, prompts, metadata):
        pixels = torch.stack([preprocess(img) for img in to_pil(images)]).to(device)
        img = torch.nn.functional.normalize(model.encode_image(pixels).float(), dim=-1)
        txt = torch.nn.functional.normalize(model.encode_text(tokenizer(prompts).to(device)).float(), dim=-1)
        return (img * txt).sum(-1).cpu(), {}
    return fn


def imagereward(device="cpu", model="ImageReward-v1.0"):
    """ImageReward v1.0 raw score (BLIP-based; ~-2..2), one `score(prompt, image)` call per image as upstream."""
    rm = require("ImageReward", "image-reward", "imagereward").load(model, device=str(device)).requires_grad_(False)
    return lambda images, prompts, metadata: (
        torch.tensor([float(rm.score(p, img)) for p, img in zip(prompts, to_pil(images))]), {})


def jpeg(scale: float):
    """scale * kB of each image as JPEG at quality 95 (DDPO; flow_grpo/rewards.py::jpeg_compressibility: -kB/500)."""
    return lambda images, prompts, metadata: (
        torch.tensor([scale * len(encoded(img, "JPEG", quality=95)) / 1000 for img in to_pil(images)]), {})


# ---- network rewards: GenEval server, VLM judges (OpenAI-compatible), generic remote reward server ----
def geneval(url="http://127.0.0.1:18085", timeout=120.0, retries=5, batch_size=64, key="scores"):
    """GenEval reward-server client (yifan123/reward-server; flow_grpo/rewards.py::geneval_score): partial-credit
    `scores` (`key=rewards`: official-style correctness, the paper metric); logs `strict_rewards`."""
    if key not in ("scores", "rewards", "strict_rewards"):
        raise ValueError(f"geneval key must be scores, rewards or strict_rewards, not {key!r}")
    call(url)
    class PlainData(pickle.Unpickler):  # upstream pickles its replies, lists and dicts of floats (reward-server
        def find_class(self, module, name):  # gen_eval.py::compute_geneval): a class or function (code) is refused
            raise pickle.UnpicklingError(f"it references {module}.{name}; only plain data is accepted")

    def parse(raw: bytes) -> dict:
        reply = PlainData(io.BytesIO(raw)).load()
        return {"score": reply[key], "strict": reply.get("strict_rewards", reply["scores"])}

    def fn(images, prompts, metadata):
        pil, n, parts = to_pil(images), int(batch_size), []
        for i in range(0, len(pil), n):
            body = pickle.dumps({"images": [encoded(img, "JPEG") for img in pil[i : i + n]],
                                 "meta_datas": list(metadata[i : i + n]), "only_strict": key != "rewards"})
            raw = call(url, body, "application/octet-stream", float(timeout), int(retries))
            parts.append(read_reply(url, raw, len(pil[i : i + n]), parse))
        return torch.cat([p["score"] for p in parts]), {"geneval_strict": torch.cat([p["strict"] for p in parts])}
    return fn


def chat_reward(url, model, api_key, text, timeout, retries, workers, score_reply, resize=0, **extra):
    """Score each (image, prompt) by one OpenAI-compatible /chat/completions call; score_reply(json) -> float."""
    call(url, token=api_key)
    pool = ThreadPoolExecutor(max_workers=int(workers))
    def score(img, prompt):
        png = base64.b64encode(encoded(img.resize((int(resize),) * 2) if int(resize) else img, "PNG")).decode()
        body = {"model": model, "temperature": 0.0, **extra, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
            {"type": "text", "text": text.format(prompt=prompt)}]}]}
        raw = call(url.rstrip("/") + "/chat/completions", json.dumps(body).encode(), "application/json",
                   float(timeout), int(retries), api_key)
        return read_reply(url, raw, 1, lambda raw: {"": [score_reply(json.loads(raw))]})[""]
    return lambda images, prompts, metadata: (torch.cat(list(pool.map(score, to_pil(images), prompts))), {})


def vlm_judge(url="http://127.0.0.1:17140/v1", model="UnifiedReward-7b-v1.5", api_key="flowgrpo",
              instruction="You are given a text prompt and an image generated from it. Judge how well the image "
                          "follows the prompt and how good it looks. Give a score from 1 to 5, then write 'Final "
                          "Score: x'.\nPrompt: {prompt}", timeout=60.0, retries=3, workers=16, resize=512):
    """UnifiedReward-style judge (flow_grpo unifiedreward_score_sglang): `Final Score: x` -> x/5, no score -> 0."""
    def score_reply(reply):
        found = re.findall(r"Final Score:\s*([1-5](?:\.\d+)?)", reply["choices"][0]["message"]["content"] or "")
        return float(found[0]) / 5 if found else 0.0
    return chat_reward(url, model, api_key, instruction, timeout, retries, workers, score_reply, resize, max_tokens=512)


def vlm_yesno(url="http://127.0.0.1:17140/v1", model="Qwen/Qwen2.5-VL-7B-Instruct", api_key="",
              question="Does this image match the description: \"{prompt}\"? Answer Yes or No.", timeout=60.0,
              retries=3, workers=16, top_logprobs=20):
    """P(Yes): summed probability of first-token top logprobs reading `yes` (server must return logprobs)."""
    def score_reply(reply):
        top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        return sum(np.exp(t["logprob"]) for t in top if t["token"].strip().lower() == "yes")
    return chat_reward(url, model, api_key, question, timeout, retries, workers, score_reply, max_tokens=1,
                       logprobs=True, top_logprobs=int(top_logprobs))


def remote(url="http://127.0.0.1:18090", timeout=300.0, retries=5, token=""):
    """Any reward served by `python rewards.py --serve SPEC`; `token`: its secret (default $REWARD_SERVER_TOKEN)."""
    token = token or os.environ.get("REWARD_SERVER_TOKEN", "")
    call(url, token=token)
    def fn(images, prompts, metadata):
        pngs = [base64.b64encode(encoded(img, "PNG")).decode() for img in to_pil(images)]
        body = json.dumps({"images": pngs, "prompts": list(prompts), "metadata": list(metadata)}).encode()
        raw = call(url, body, "application/json", float(timeout), int(retries), token)
        info = read_reply(url, raw, len(pngs), lambda r: {None: (reply := json.loads(r))["scores"], **reply["info"]})
        return info.pop(None), info  # the scores sat under None, which no JSON key can be
    return fn


# ---- specs: parsing, building, combining ----
REWARDS = {"ocr": ocr, "pickscore": pickscore, "clipscore": clipscore, "aesthetic": aesthetic, "hpsv2": hpsv2,
           "imagereward": imagereward, "jpeg_compressibility": lambda: jpeg(-1 / 500),
           "jpeg_incompressibility": lambda: jpeg(1.0), "geneval": geneval, "vlm_judge": vlm_judge,
           "vlm_yesno": vlm_yesno, "remote": remote,
           "pickscore_rank": pickscore}  # groupwise (Flow-Factory reward guide): ranked by build_reward.group_transform
USES_DEVICE = {"pickscore", "clipscore", "aesthetic", "hpsv2", "imagereward", "pickscore_rank"}


def group_rank(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Rank within its group scaled to [0, 1] (worst 0, best 1, ties share their mean rank; a lone image 0.5)."""
    s, same = scores.float(), group_ids[None, :] == group_ids[:, None]
    below, tied = ((s[None, :] < s[:, None]) & same).sum(1), ((s[None, :] == s[:, None]) & same).sum(1) - 1
    return torch.where(same.sum(1) > 1, (below + tied / 2) / (same.sum(1) - 1).clamp(min=1), 0.5)


def parse_spec(spec: str) -> list[tuple[str, dict, float]]:
    """`a[k=v;k2=v2]=0.5,b` -> [(a, {k: v, k2: v2}, 0.5), (b, {}, 1.0)]; `file.py:fn=w` keeps the path as name."""
    parsed = []
    for term in (t.strip() for t in re.split(r",(?![^\[]*\])", spec)):  # commas outside [...]
        match = re.fullmatch(r"([^\[\]=]+?)(?:\[(.*)\])?(?:=([-+0-9.eE]+))?", term)
        if not match:
            raise ValueError(f"cannot parse reward term {term!r}; expected name[option=value;...]=weight")
        name, opts, weight = match.groups()
        if name not in REWARDS and not (re.fullmatch(r".+\.py:\w+", name) and os.path.isfile(name.rsplit(":", 1)[0])):
            raise ValueError(f"unknown reward {name!r}; choose from {', '.join(REWARDS)} or path/to/file.py:function")
        parsed.append((name, dict(kv.split("=", 1) for kv in (opts or "").split(";") if kv), float(weight or 1.0)))
    return parsed


def check_prompts(spec: str, prompts: list[str]):
    """Cheap checks before any model loads: the spec parses, and OCR prompts carry a quoted target."""
    if "ocr" in [name for name, _, _ in parse_spec(spec)] and (bad := [p for p in prompts if ocr_target(p) is None]):
        raise ValueError(f"the ocr reward needs the target text in double quotes in every prompt, e.g. "
                         f"'A sign that says \"hello\"'; {len(bad)} prompt(s) have none, first: {bad[0]!r}")


def build_reward(spec: str, device="cpu"):
    """The weighted-sum reward of a spec; `.weights` {component (`fn` of `file.py:fn`): weight}; `.group_transform(
    components, group_ids)` -> (total, components) ranked in their groups (None without groupwise components)."""
    fns, weights = {}, {}
    for name, options, weight in parse_spec(spec):
        if name in REWARDS:
            key, fns[name] = name, REWARDS[name](**options, **({"device": device} if name in USES_DEVICE else {}))
        else:  # path/to/file.py:function, checked by parse_spec
            path, key = name.rsplit(":", 1)
            try:
                fns[key] = runpy.run_path(path).get(key)
            except Exception as e:  # a syntax error or a failing import in the user's file: one line, not a traceback
                raise ValueError(f"reward file {path!r} does not load: {type(e).__name__}: {one_line(e)}") from None
            if not callable(fns[key]):
                raise ValueError(f"reward file {path!r} has no function {key!r}")
        weights[key] = weight

    def combined(images, prompts, metadata):
        total, info = torch.zeros(len(prompts)), {}
        for key, fn in fns.items():
            score, extra = fn(images, prompts, metadata)
            info.update({k: torch.as_tensor(v, dtype=torch.float32).cpu() for k, v in extra.items()})
            info[key] = torch.as_tensor(score, dtype=torch.float32).cpu().reshape(len(prompts))
            total += weights[key] * info[key]
        return total, info

    def group_transform(components: dict, group_ids: torch.Tensor):
        components = {**components, "pickscore_rank": group_rank(components["pickscore_rank"], group_ids)}
        return sum(weights[k] * components[k] for k in fns), components

    combined.group_transform = group_transform if "pickscore_rank" in fns else None  # the groupwise reward
    combined.weights = weights
    return combined


# ---- reward server: `python rewards.py --serve SPEC --port N` answers the `remote` reward's JSON protocol ----
def make_server(serve: str, host: str = "127.0.0.1", port: int = 18090, token: str = "", max_body_mb: float = 64.0,
                max_images: int = 256, max_pixels: int = 2048**2, timeout: float = 120.0,
                device: str = "cuda" if torch.cuda.is_available() else "cpu") -> ThreadingHTTPServer:
    """Serve a reward spec (`--serve hpsv2`, `--serve 'ocr=1,pickscore=0.5'`) to `--reward remote[url=...]`: POST
    {images: [base64 PNG], prompts, metadata} -> {scores, info}, scored one at a time; GET -> {reward}.

    Args:
        host: address to bind: loopback by default; 0.0.0.0 opens the server to the network (set a token then).
        token: secret every request must carry (401 missing, 403 wrong); default $REWARD_SERVER_TOKEN (not in ps).
        max_body_mb: largest request body in MiB (over this or the next two limits: 413, before anything is decoded).
        max_images: most images in one request.
        max_pixels: most pixels (width x height) of one image.
        timeout: seconds a client may take to send its request (408 after).
    """
    token = token or os.environ.get("REWARD_SERVER_TOKEN", "")
    fn, lock, max_body = build_reward(serve, device=device), threading.Lock(), int(max_body_mb * 2**20)
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if os.name == "posix" else None  # glibc keeps freed heap
    status_of = {TimeoutError: 408, Image.DecompressionBombError: 413}  # other errors: 400
    class Refused(Exception):  # Refused(HTTP status, message): a request the server will not score
        pass

    def check(ok, status: int, message: str):
        if not ok:
            raise Refused(status, message)

    def score(request: dict) -> dict:
        pngs, prompts, metadata = (list(request[key]) for key in ("images", "prompts", "metadata"))
        check(len(pngs) <= max_images, 413, f"{len(pngs)} images is over this server's limit of {max_images} "
                                            "(--max-images)")
        # Image.open reads the header only: sizes are checked before any pixel is decoded
        opened = [Image.open(io.BytesIO(base64.b64decode(b, validate=True)), formats=["PNG"]) for b in pngs]
        for i, img in enumerate(opened):
            check(img.width * img.height <= max_pixels, 413, f"image {i} has {img.width}x{img.height} pixels, over "
                                                             f"this server's limit of {max_pixels} (--max-pixels)")
        with lock:  # one request's images in memory at a time
            scores, info = fn([img.convert("RGB") for img in opened], prompts, metadata)
        return {"scores": scores.tolist(), "info": {k: v.tolist() for k, v in info.items()}}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # and GET
            length, given = self.headers.get("Content-Length", "0"), self.headers.get("Authorization", "")
            authorised = not token or hmac.compare_digest(given.encode(), f"Bearer {token}".encode())
            body, deadline = [], time.monotonic() + timeout
            try:
                check(length.isdigit(), 400, f"bad Content-Length {length!r}")
                left, keep = int(length), authorised and int(length) <= max_body
                while left > 0:  # a refused body is read too, and dropped, so that the client reads the refusal
                    chunk = self.rfile.read1(min(left, 1 << 20))  # TimeoutError after `timeout` s without data
                    check(chunk and time.monotonic() < deadline, 408, f"request body not received in {timeout:g} s")
                    left -= len(chunk)
                    body += [chunk] if keep else []
                check(authorised, 403 if given else 401, "wrong token" if given else
                      "this reward server needs a token: remote[token=...] or $REWARD_SERVER_TOKEN")
                check(keep, 413, f"request body of {int(length) / 2**20:.1f} MiB is over this server's limit of "
                                 f"{max_body_mb:g} MiB (--max-body-mb)")
                status, answer = 200, score(json.loads(b"".join(body))) if self.command == "POST" else {"reward": serve}
            except Exception as e:  # the client sees the reason, not a dropped connection
                status, message = e.args if isinstance(e, Refused) else (status_of.get(type(e), 400), one_line(repr(e)))
                answer = {"error": message}
            if trim:
                trim(0)  # the request's images are gone by now: memory returns to its baseline
            reply = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))  # HTTP/1.0: one request per connection
            self.end_headers()
            self.wfile.write(reply)
        do_GET = do_POST

    Handler.timeout = timeout  # socket timeout of every read and write; the body also has a total deadline
    server = ThreadingHTTPServer((host, port), Handler)
    print(f"serving reward {serve!r} on http://{host}:{server.server_address[1]} "
          f"({'token required' if token else 'no token'})", flush=True)
    if not token and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: {host} is reachable from other machines and no token is set", flush=True)
    return server


if __name__ == "__main__":
    importlib.import_module("tyro").cli(make_server).serve_forever()
