"""Reward models of the Flow-GRPO / DanceGRPO / DiffusionNFT / AWM / CRD papers, one contract for all of them.

    fn = build_reward("ocr=1.0,pickscore=0.5", device="cuda")
    scores, info = fn(images, prompts, metadata)

- `images`: float (B, 3, H, W) in [0, 1] (or a list of PIL images); `prompts`: list[str]; `metadata`: list[dict]
  (the extra fields of a JSONL prompt file, e.g. GenEval's `include`/`exclude`).
- `scores`: float32 CPU tensor (B,). `info`: dict of per-sample values worth logging; it always holds every
  component's score under its name, so scripts can log components and normalise them separately.
- A spec is a comma-separated list of `name[option=value;...]=weight` terms (weight 1 if omitted), e.g.
  `geneval[url=http://10.0.0.2:18085]=1,ocr=0.5`, or `path/to/file.py:function` for your own reward.
  The score of a combination is the weighted **sum** of its components (upstream flow_grpo `multi_score`).
- Groupwise rewards (`pickscore_rank`) need the whole group of images of a prompt. Called directly they return their
  pointwise base score; `fn.group_transform(components, group_ids)` turns the gathered components of a full epoch into
  the groupwise scores (the scripts call it after gathering all ranks). `group_transform` is None for pointwise rewards.
- Model weights load with `from_pretrained(id_or_path)` (options `model=`, `processor=`), so local copies work.
  Heavy imports are lazy; a missing optional package names its `pip install` command.
- Network rewards retry with exponential backoff, then fail naming the URL; every request has a timeout.

Serve any reward from another process/machine/env (the way upstream isolates rewards with conflicting deps):
    python rewards.py --serve hpsv2 --port 18090          # then train with --reward "remote[url=http://host:18090]"
"""

import base64
import importlib
import importlib.util
import io
import json
import math
import os
import pickle
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

# ---------------------------------------------------------------------------------------------------------------
# Small helpers: image conversion, optional imports, HTTP with retries
# ---------------------------------------------------------------------------------------------------------------


def to_pil(images) -> list[Image.Image]:
    """(B, 3, H, W) float [0, 1] tensor or list of PIL -> list of RGB PIL, quantised as upstream (x*255 rounded)."""
    if isinstance(images, torch.Tensor):
        arr = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        return [Image.fromarray(a) for a in arr]
    return [img.convert("RGB") for img in images]


def require(module: str, pip: str, reward: str):
    """Import an optional package or fail with the exact install command."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"reward {reward!r} needs an extra package: pip install {pip}") from e


def post(url: str, body: bytes, content_type: str, timeout: float, retries: int, headers: dict | None = None) -> bytes:
    """POST with a timeout per try and exponential backoff (1 s, 2 s, 4 s, ...); never hangs forever."""
    request_headers = {"Content-Type": content_type, **(headers or {})}
    last = None
    for attempt in range(retries + 1):
        try:
            request = urllib.request.Request(url, data=body, headers=request_headers, method="POST")
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            if e.code < 500:  # the request itself is wrong: retrying cannot help
                raise RuntimeError(f"reward server {url} rejected the request (HTTP {e.code}): "
                                   f"{e.read()[:500].decode(errors='replace')}") from e
            last = e
            if attempt < retries:
                time.sleep(2**attempt)
        except (urllib.error.URLError, OSError) as e:  # refused, unreachable, timeout
            last = e
            if attempt < retries:
                time.sleep(2**attempt)
    raise RuntimeError(f"reward server {url} failed after {retries + 1} tries ({timeout:g}s timeout each): {last}")


def png_base64(img: Image.Image) -> str:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def pil_from_base64(data: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


def pointwise(fn):
    fn.group_transform = None
    return fn


# ---------------------------------------------------------------------------------------------------------------
# OCR (Flow-GRPO's text-rendering reward)
# ---------------------------------------------------------------------------------------------------------------


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
    """1 if the target is a substring of the recognised text, else 1 - min(edit distance, len) / len, both texts
    lower-cased with spaces removed (upstream flow_grpo/ocr.py::OcrScorer.__call__)."""
    recognised = recognised.replace(" ", "").lower()
    target = target.replace(" ", "").lower()
    if not target:
        return 1.0
    dist = 0 if target in recognised else min(levenshtein(recognised, target), len(target))
    return 1.0 - dist / len(target)


def ocr(workers: int = 8):
    """PP-OCR (rapidocr-onnxruntime, weights inside the wheel, CPU) accuracy of the quoted text of each prompt."""
    engine = require("rapidocr_onnxruntime", "rapidocr-onnxruntime", "ocr").RapidOCR()
    pool = ThreadPoolExecutor(max_workers=int(workers))

    def read(img: Image.Image) -> str:
        result, _ = engine(np.asarray(img))
        return "".join(text for _, text, conf in (result or []) if float(conf) > 0)

    @pointwise
    def fn(images, prompts, metadata):
        targets = [ocr_target(p) for p in prompts]
        if None in targets:
            raise ValueError(f"ocr reward: prompt {prompts[targets.index(None)]!r} has no quoted target text")
        texts = list(pool.map(read, to_pil(images)))
        scores = torch.tensor([ocr_score(t, g) for t, g in zip(texts, targets)], dtype=torch.float32)
        return scores, {"ocr": scores}

    return fn


# ---------------------------------------------------------------------------------------------------------------
# CLIP-family rewards (PickScore, CLIPScore, LAION aesthetic) and HPS v2.1 / ImageReward
# ---------------------------------------------------------------------------------------------------------------


def clip_features(model, processor, images, prompts, device):
    """L2-normalised image (B, D) and text (B, D) embeddings of a transformers CLIPModel."""
    inputs = processor(images=to_pil(images), text=prompts, padding=True, truncation=True, max_length=77,
                       return_tensors="pt").to(device)
    with torch.no_grad():
        img = model.get_image_features(pixel_values=inputs["pixel_values"])
        txt = model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    img = getattr(img, "pooler_output", img)  # transformers 5 may return a model output
    txt = getattr(txt, "pooler_output", txt)
    return torch.nn.functional.normalize(img.float(), dim=-1), torch.nn.functional.normalize(txt.float(), dim=-1)


def load_clip(model: str, processor: str, device):
    transformers = importlib.import_module("transformers")
    return (transformers.CLIPModel.from_pretrained(model).to(device).eval(),
            transformers.CLIPProcessor.from_pretrained(processor))


def pickscore(device="cpu", model="yuvalkirstain/PickScore_v1", processor="laion/CLIP-ViT-H-14-laion2B-s32B-b79K"):
    """PickScore = logit_scale * cos(image, text), divided by 26 as upstream (flow_grpo/pickscore_scorer.py); the
    paper tables report the raw value (info `pickscore_raw`, ~21-24 on SD3.5-M)."""
    clip, proc = load_clip(model, processor, device)

    @pointwise
    def fn(images, prompts, metadata):
        img, txt = clip_features(clip, proc, images, prompts, device)
        raw = (clip.logit_scale.exp() * (img * txt).sum(-1)).cpu().float()
        return raw / 26, {"pickscore": raw / 26, "pickscore_raw": raw}

    return fn


def clipscore(device="cpu", model="openai/clip-vit-large-patch14", processor=None):
    """CLIP ViT-L/14 logit_scale * cos(image, text) / 30 (flow_grpo/clip_scorer.py: logits_per_image diagonal / 30)."""
    clip, proc = load_clip(model, processor or model, device)

    @pointwise
    def fn(images, prompts, metadata):
        img, txt = clip_features(clip, proc, images, prompts, device)
        score = (clip.logit_scale.exp() * (img * txt).sum(-1)).cpu().float() / 30
        return score, {"clipscore": score}

    return fn


AESTHETIC_URL = ("https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
                 "sac+logos+ava1-l14-linearMSE.pth")


def aesthetic_head(dim: int) -> torch.nn.Sequential:
    """The LAION improved-aesthetic MLP (dropouts are identity in eval); indices match the released state dict."""
    return torch.nn.Sequential(torch.nn.Linear(dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
                               torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
                               torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))


def aesthetic(device="cpu", model="openai/clip-vit-large-patch14", processor=None, head=AESTHETIC_URL):
    """LAION aesthetic predictor v2: MLP on L2-normalised CLIP ViT-L/14 image features (~5-6 for SD3.5-M images).
    `head` is a path or URL of `sac+logos+ava1-l14-linearMSE.pth`."""
    clip, proc = load_clip(model, processor or model, device)
    state = (torch.load(head, map_location="cpu") if os.path.exists(head)
             else torch.hub.load_state_dict_from_url(head, map_location="cpu"))
    mlp = aesthetic_head(clip.config.projection_dim)
    mlp.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
    mlp = mlp.to(device).eval()

    @pointwise
    def fn(images, prompts, metadata):
        img, _ = clip_features(clip, proc, images, [""] * len(prompts), device)
        with torch.no_grad():
            score = mlp(img).squeeze(-1).cpu().float()
        return score, {"aesthetic": score}

    return fn


def hpsv2(device="cpu", checkpoint="xswu/HPSv2:HPS_v2.1_compressed.pt"):
    """HPS v2.1 (DanceGRPO's reward): open_clip ViT-H-14 fine-tuned on HPD v2; score = cos(image, text) (~0.3).
    `checkpoint` is a local .pt path or `hub_repo:filename`."""
    open_clip = require("open_clip", "open-clip-torch", "hpsv2")
    model, _, preprocess = open_clip.create_model_and_transforms("ViT-H-14", pretrained=None, precision="fp32")
    if not os.path.exists(checkpoint):
        repo, filename = checkpoint.split(":")
        checkpoint = importlib.import_module("huggingface_hub").hf_hub_download(repo, filename)
    state = torch.load(checkpoint, map_location="cpu")
    model.load_state_dict(state.get("state_dict", state))
    model = model.to(device).eval()
    tokenizer = open_clip.get_tokenizer("ViT-H-14")

    @pointwise
    def fn(images, prompts, metadata):
        pixels = torch.stack([preprocess(img) for img in to_pil(images)]).to(device)
        with torch.no_grad():
            img = torch.nn.functional.normalize(model.encode_image(pixels).float(), dim=-1)
            txt = torch.nn.functional.normalize(model.encode_text(tokenizer(prompts).to(device)).float(), dim=-1)
        score = (img * txt).sum(-1).cpu()
        return score, {"hpsv2": score}

    return fn


def imagereward(device="cpu", model="ImageReward-v1.0"):
    """ImageReward v1.0 raw score (BLIP-based; ~-2..2), one `score(prompt, image)` call per image as upstream."""
    rm = require("ImageReward", "image-reward", "imagereward").load(model, device=str(device))

    @pointwise
    def fn(images, prompts, metadata):
        with torch.no_grad():
            score = torch.tensor([float(rm.score(p, img)) for p, img in zip(prompts, to_pil(images))],
                                 dtype=torch.float32)
        return score, {"imagereward": score}

    return fn


# ---------------------------------------------------------------------------------------------------------------
# JPEG (in)compressibility (DDPO; flow_grpo/rewards.py::jpeg_compressibility)
# ---------------------------------------------------------------------------------------------------------------


def jpeg_kilobytes(images) -> torch.Tensor:
    """Size in kB (1000 bytes) of each image saved as JPEG at quality 95."""
    sizes = []
    for img in to_pil(images):
        buffer = io.BytesIO()
        img.save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


def jpeg_compressibility():
    """-(JPEG kB at quality 95) / 500: smaller files score higher."""

    @pointwise
    def fn(images, prompts, metadata):
        score = -jpeg_kilobytes(images) / 500
        return score, {"jpeg_compressibility": score}

    return fn


def jpeg_incompressibility():
    """JPEG kB at quality 95: larger (more detailed) files score higher."""

    @pointwise
    def fn(images, prompts, metadata):
        score = jpeg_kilobytes(images)
        return score, {"jpeg_incompressibility": score}

    return fn


# ---------------------------------------------------------------------------------------------------------------
# Network rewards: GenEval server, VLM judges (OpenAI-compatible), generic remote reward server
# ---------------------------------------------------------------------------------------------------------------


def geneval(url="http://127.0.0.1:18085", timeout=120.0, retries=5, batch_size=64, key="scores"):
    """Client of the GenEval reward server (yifan123/reward-server protocol, flow_grpo/rewards.py::geneval_score):
    a pickled {images: [JPEG bytes], meta_datas, only_strict} is POSTed; the reply's `scores` (partial credit per
    include-clause) is the training reward, `strict_rewards` (exact GenEval correctness) is logged.
    The prompt file must be the GenEval JSONL (metadata with `include`/`exclude`/`tag`). `key=rewards` scores with
    the official-style GenEval correctness instead (the paper metric; use it as --eval-reward)."""
    timeout, retries, batch_size = float(timeout), int(retries), int(batch_size)
    if key not in ("scores", "rewards", "strict_rewards"):
        raise ValueError(f"geneval key must be scores, rewards or strict_rewards, not {key!r}")

    @pointwise
    def fn(images, prompts, metadata):
        pil = to_pil(images)
        scores, strict = [], []
        for start in range(0, len(pil), batch_size):
            jpegs = []
            for img in pil[start : start + batch_size]:
                buffer = io.BytesIO()
                img.save(buffer, format="JPEG")
                jpegs.append(buffer.getvalue())
            body = pickle.dumps({"images": jpegs, "meta_datas": list(metadata[start : start + batch_size]),
                                 "only_strict": key != "rewards"})
            reply = pickle.loads(post(url, body, "application/octet-stream", timeout, retries))
            scores += reply[key]
            strict += reply.get("strict_rewards", reply["scores"])
        score = torch.tensor(scores, dtype=torch.float32)
        return score, {"geneval": score, "geneval_strict": torch.tensor(strict, dtype=torch.float32)}

    return fn


JUDGE_INSTRUCTION = ("You are given a text prompt and an image generated from it. Judge how well the image follows "
                     "the prompt and how good it looks. Give a score from 1 to 5, then write 'Final Score: x'.\n"
                     "Prompt: {prompt}")
YESNO_QUESTION = "Does this image match the description: \"{prompt}\"? Answer Yes or No."


def chat(url, model, api_key, img, text, timeout, retries, **extra) -> dict:
    """One OpenAI-compatible /chat/completions call with an image (base64 PNG) and a text message."""
    body = {"model": model, "temperature": 0.0, **extra, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_base64(img)}"}},
        {"type": "text", "text": text}]}]}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = url.rstrip("/") + "/chat/completions"
    return json.loads(post(endpoint, json.dumps(body).encode(), "application/json", timeout, retries, headers))


def vlm_judge(url="http://127.0.0.1:17140/v1", model="UnifiedReward-7b-v1.5", api_key="flowgrpo",
              instruction=JUDGE_INSTRUCTION, timeout=60.0, retries=3, workers=16, resize=512):
    """VLM judge on any OpenAI-compatible server (vLLM, SGLang), UnifiedReward style (flow_grpo/rewards.py::
    unifiedreward_score_sglang): score = x / 5 from `Final Score: x` (x in 1..5), 0 when the reply has none."""
    pool = ThreadPoolExecutor(max_workers=int(workers))
    pattern = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")

    def judge(img, prompt):
        img = img.resize((int(resize), int(resize))) if resize else img
        reply = chat(url, model, api_key, img, instruction.format(prompt=prompt), float(timeout), int(retries),
                     max_tokens=512)
        match = pattern.search(reply["choices"][0]["message"]["content"] or "")
        return float(match.group(1)) / 5 if match else 0.0

    @pointwise
    def fn(images, prompts, metadata):
        score = torch.tensor(list(pool.map(judge, to_pil(images), prompts)), dtype=torch.float32)
        return score, {"vlm_judge": score}

    return fn


def vlm_yesno(url="http://127.0.0.1:17140/v1", model="Qwen/Qwen2.5-VL-7B-Instruct", api_key="",
              question=YESNO_QUESTION, timeout=60.0, retries=3, workers=16, top_logprobs=20):
    """P(Yes) of a VLM asked a yes/no question about the image: the summed probability of the first answer token's
    top logprobs that read `yes` (any case/whitespace). Needs a server that returns logprobs (vLLM, SGLang)."""
    pool = ThreadPoolExecutor(max_workers=int(workers))

    def p_yes(img, prompt):
        reply = chat(url, model, api_key, img, question.format(prompt=prompt), float(timeout), int(retries),
                     max_tokens=1, logprobs=True, top_logprobs=int(top_logprobs))
        top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        return sum(math.exp(t["logprob"]) for t in top if t["token"].strip().lower() == "yes")

    @pointwise
    def fn(images, prompts, metadata):
        score = torch.tensor(list(pool.map(p_yes, to_pil(images), prompts)), dtype=torch.float32)
        return score, {"vlm_yesno": score}

    return fn


def remote(url="http://127.0.0.1:18090", timeout=300.0, retries=5):
    """Any reward served by `python rewards.py --serve NAME` (JSON: base64 PNGs, prompts, metadata -> scores, info)."""

    @pointwise
    def fn(images, prompts, metadata):
        body = json.dumps({"images": [png_base64(img) for img in to_pil(images)], "prompts": list(prompts),
                           "metadata": list(metadata)}).encode()
        reply = json.loads(post(url, body, "application/json", float(timeout), int(retries)))
        return (torch.tensor(reply["scores"], dtype=torch.float32),
                {k: torch.tensor(v, dtype=torch.float32) for k, v in reply["info"].items()})

    return fn


# ---------------------------------------------------------------------------------------------------------------
# Groupwise: rank of PickScore within the prompt's group
# ---------------------------------------------------------------------------------------------------------------


def group_rank(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Rank of each score within its group scaled to [0, 1] (worst 0, best 1; ties share their mean rank; a group
    of one scores 0.5)."""
    out = torch.empty_like(scores, dtype=torch.float32)
    for g in group_ids.unique():
        members = (group_ids == g).nonzero().squeeze(1)
        s = scores[members]
        below = (s[None, :] < s[:, None]).sum(1).float()
        ties = (s[None, :] == s[:, None]).sum(1).float() - 1
        out[members] = (below + ties / 2) / (len(s) - 1) if len(s) > 1 else 0.5
    return out


def pickscore_rank(device="cpu", **options):
    """Groupwise (Flow-Factory's reward guide): the rank of an image's PickScore among the images of its prompt.
    Called directly it returns PickScore/26; `group_transform` ranks the gathered scores within each group."""
    base = pickscore(device, **options)

    def fn(images, prompts, metadata):
        score, info = base(images, prompts, metadata)
        return score, {"pickscore_rank": score, "pickscore_raw": info["pickscore_raw"]}

    fn.group_transform = lambda components, group_ids: group_rank(components["pickscore_rank"], group_ids)
    return fn


REWARDS = {"ocr": ocr, "pickscore": pickscore, "clipscore": clipscore, "aesthetic": aesthetic, "hpsv2": hpsv2,
           "imagereward": imagereward, "jpeg_compressibility": jpeg_compressibility,
           "jpeg_incompressibility": jpeg_incompressibility, "geneval": geneval, "vlm_judge": vlm_judge,
           "vlm_yesno": vlm_yesno, "remote": remote, "pickscore_rank": pickscore_rank}
USES_DEVICE = {"pickscore", "clipscore", "aesthetic", "hpsv2", "imagereward", "pickscore_rank"}

# ---------------------------------------------------------------------------------------------------------------
# Specs: parsing, building, combining
# ---------------------------------------------------------------------------------------------------------------


def parse_spec(spec: str) -> list[tuple[str, dict, float]]:
    """`a[k=v;k2=v2]=0.5,b` -> [(a, {k: v, k2: v2}, 0.5), (b, {}, 1.0)]; `file.py:fn=w` keeps the path as name."""
    terms, depth, current = [], 0, ""
    for ch in spec:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    terms.append(current)
    parsed = []
    for term in (t.strip() for t in terms):
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
        if name == "ocr":
            bad = [p for p in prompts if ocr_target(p) is None]
            if bad:
                raise ValueError(f"the ocr reward needs the target text in double quotes in every prompt, e.g. "
                                 f"'A sign that says \"hello\"'; {len(bad)} prompt(s) have none, first: {bad[0]!r}")


def load_custom(name: str):
    """`path/to/file.py:function` -> that function (called as fn(images, prompts, metadata) -> (scores, info))."""
    path, attr = name.split(":")
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, attr)
    fn.group_transform = getattr(fn, "group_transform", None)
    return fn


def build_reward(spec: str, device="cpu"):
    """Build the (weighted-sum) reward of a spec; see the module docstring."""
    terms = parse_spec(spec)
    fns, weights = {}, {}
    for name, options, weight in terms:
        key = component_name(name)
        if key in REWARDS:
            fns[key] = REWARDS[key](device=device, **options) if key in USES_DEVICE else REWARDS[key](**options)
        else:
            fns[key] = load_custom(name)
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

    def group_transform(components: dict, group_ids: torch.Tensor):
        """(total, components) after groupwise components are replaced by their group transform."""
        components = dict(components)
        for key, fn in fns.items():
            if fn.group_transform is not None:
                components[key] = fn.group_transform(components, group_ids)
        return sum(weights[k] * components[k] for k in fns), components

    combined.group_transform = group_transform if any(f.group_transform for f in fns.values()) else None
    combined.weights = weights
    return combined


# ---------------------------------------------------------------------------------------------------------------
# Reward server: `python rewards.py --serve SPEC --port N` answers the `remote` reward's JSON protocol
# ---------------------------------------------------------------------------------------------------------------


def make_server(spec: str, host: str, port: int, device="cpu"):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    fn = build_reward(spec, device=device)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            try:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                scores, info = fn([pil_from_base64(s) for s in request["images"]], request["prompts"],
                                  request["metadata"])
                body, status = json.dumps({"scores": scores.tolist(),
                                           "info": {k: v.tolist() for k, v in info.items()}}).encode(), 200
            except Exception as e:  # the client sees the reason, not a dropped connection
                body, status = json.dumps({"error": repr(e)}).encode(), 400
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer((host, port), Handler)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Serve a rewards.py reward over HTTP for `--reward remote[url=...]`")
    parser.add_argument("--serve", required=True, help="reward spec, e.g. hpsv2 or 'ocr=1,pickscore=0.5'")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=18090)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    cli = parser.parse_args()
    server = make_server(cli.serve, cli.host, cli.port, cli.device)
    print(f"serving reward {cli.serve!r} on http://{cli.host}:{cli.port}", flush=True)
    server.serve_forever()
