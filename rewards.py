"""Reward models of the Flow-GRPO, DanceGRPO, DiffusionNFT, AWM and CRD papers, one contract:

    fn = build_reward("ocr=1.0,pickscore=0.5", device="cuda")  # a weighted SUM (multi_score)
    scores, info = fn(images, prompts, metadata)  # float32 CPU (B,), {component: scores, ...}

`images`: float (B, 3, H, W) in [0, 1] or PIL; `metadata`: a JSONL prompt file's extra fields.
A spec term is `name[option=value;...]=weight` or `path/to/file.py:function` (same contract:
tensors, also served; a `fn.check_prompts` vets prompts). docs/rewards.md: the whole story.
"""

import base64
import ctypes
import hmac
import importlib
import inspect
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

# ---- Helpers: images, optional imports, HTTP with retries, replies read as data ----
def to_pil(images) -> list[Image.Image]:
    """Float (B, 3, H, W) in [0, 1] or PIL images -> RGB PIL, quantised as upstream."""
    if not isinstance(images, torch.Tensor):
        return [image.convert("RGB") for image in images]
    pixels = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(array) for array in pixels.permute(0, 2, 3, 1).numpy()]

def encoded(image: Image.Image, file_format: str, **options) -> bytes:
    image.save(buffer := io.BytesIO(), format=file_format, **options)
    return buffer.getvalue()

def require(module: str, pip_name: str, reward: str):
    """Import an optional package, or fail with the exact install command."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        message = f"reward {reward!r} needs an extra package: pip install {pip_name}"
        raise ImportError(message) from error

def one_line(text, limit: int = 300) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return " ".join(str(text).split())[:limit]

WAIT_LINE_EVERY, WAIT_POLL = 60.0, 1.0  # s between waiting lines, polls
cancelled = threading.Event()  # set: every wait ends now (a script stops)
said = {}  # url -> time of its last line (one for all requests)

class RewardError(ValueError):
    """A failed reward, in one line naming it (`.reward`)."""
    def __init__(self, reward: str, what: str):
        super().__init__(f"reward {reward!r}: {what}")
        self.reward = reward

def answer(url, body, headers, timeout, reward, start):
    """One try, on a daemon thread (an exit never waits for it): (HTTP
    status, reply or error), or (0, None): no reply in `timeout` s."""
    box = []
    def run():
        try:
            try:
                request = urllib.request.Request(url, body, headers)
                with urllib.request.urlopen(request, timeout=timeout) as got:
                    box.append((200, got.read(64 << 20)))  # longer is cut
            except urllib.request.HTTPError as error:  # an answer: why
                box.append((error.code, one_line(error.read(500))))
        except Exception as failure:  # none, or not an http(s) URL
            box.append((0, failure))
    thread = threading.Thread(target=run, daemon=True)
    deadline = time.monotonic() + timeout
    if not cancelled.is_set():
        thread.start()
    while thread.is_alive() and not cancelled.is_set():
        now = time.monotonic()
        if now >= deadline:
            return 0, None
        if now - max(said.get(url, start), start) >= WAIT_LINE_EVERY:
            said[url], waited = now, f"{now - start:.0f} s"
            print(f"still waiting for {reward} at {url} ({waited})", flush=True)
        thread.join(min(WAIT_POLL, deadline - now))
    if cancelled.is_set():
        raise RewardError(reward, f"stopped waiting for {url}")
    return box[0]

def call(reward, url, body=None, content_type="application/json",
         timeout=30.0, retries=0, token=""):
    """POST `body` for `reward`: the reply, or RewardError. Timeouts and
    5xx retry after 1 s, 2 s, 4 s, ...; a 4xx or nothing listening fails
    at once. No body: the build-time probe, a GET: any answer but
    401/403 means a server listens."""
    timeout, retries = float(timeout), int(retries)  # options are str
    probing, start = body is None, time.monotonic()
    headers = {"Content-Type": content_type}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    server = f"reward server {url}"
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(2 ** (attempt - 1))
        status, reply = answer(url, body, headers, timeout, reward, start)
        if status == 200:
            return reply
        if status in (401, 403) or (not probing and 0 < status < 500):
            raise RewardError(reward, f"{server} answered HTTP {status}: {reply}")
        if probing and status:
            return b""  # any other answer to the probe: a server listens
        reason = getattr(reply, "reason", reply)
        if reply is None or isinstance(reason, TimeoutError):
            reason = f"no reply in {timeout:g} s"
        if probing or isinstance(reason, ConnectionRefusedError):
            detail = one_line(getattr(reason, "strerror", 0) or reason)
            raise RewardError(reward, f"{server} is not reachable: "
                              f"{detail} (is the server running there?)")
        last = f"HTTP {status}: {reply}" if status else one_line(reason)
    tries = f"{retries + 1} tries ({timeout:g} s each)"
    raise RewardError(reward, f"{server} failed after {tries}: {last}")

def read_reply(reward, url, raw: bytes, count: int, parse):
    """parse(raw) -> (scores, info), `count` finite float32 numbers each, or a one-line error."""
    try:
        scores, info = parse(raw)
        scores = torch.tensor(scores, dtype=torch.float32)
        info = {name: torch.tensor(values, dtype=torch.float32) for name, values in info.items()}
        for numbers in [scores, *info.values()]:
            if numbers.shape != (count,) or not numbers.isfinite().all():
                shown = one_line(repr(numbers.tolist()), 120)
                raise ValueError(f"expected {count} finite numbers, got {shown}")
    except Exception as error:  # the cause in the one line, not a chained traceback
        raise RewardError(reward, f"reward server {url} sent a malformed reply "
                                  f"({type(error).__name__}: {one_line(error)})") from None
    return scores, info

# ---- OCR (Flow-GRPO's text-rendering reward) ----
def ocr_target(prompt: str) -> str | None:
    """The text between the first pair of double quotes, or None."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None

def levenshtein(first: str, second: str) -> int:
    """Edit distance: fewest insertions, deletions and substitutions."""
    previous = list(range(len(second) + 1))  # distances of first[:i-1] to second[:j]
    for i, first_char in enumerate(first, 1):
        current = [i]
        for j, second_char in enumerate(second, 1):
            substitute = previous[j - 1] + int(first_char != second_char)
            current.append(min(previous[j] + 1, current[j - 1] + 1, substitute))
        previous = current
    return previous[-1]

def ocr_score(recognised: str, target: str) -> float:
    """1 if target is in recognised, else 1 - min(edit distance, len) / len (flow_grpo/ocr.py)."""
    recognised = recognised.replace(" ", "").lower()
    target = target.replace(" ", "").lower()
    if target in recognised:  # an empty target is always contained
        return 1.0
    return 1.0 - min(levenshtein(recognised, target), len(target)) / len(target)

def ocr(workers: int = 8, threads: int = 0, rec_model: str = "", rec_keys: str = ""):
    """PP-OCR accuracy on the prompt's quoted text as flow_grpo/ocr.py (docs/rewards.md),
    `workers` images at once, a call on `threads` onnxruntime threads (0: one per core)."""
    files = {"rec_model_path": rec_model, "rec_keys_path": rec_keys}
    files = {option: path for option, path in files.items() if path}
    for path in files.values():
        if not os.path.isfile(path):  # rec_model, rec_keys
            raise ValueError(f"ocr reward: no such file {path!r}")
    pool_size = {"intra_op_num_threads": int(threads)} if int(threads) else {}
    engine = require("rapidocr_onnxruntime", "rapidocr-onnxruntime", "ocr").RapidOCR(
        use_cls=False, det_limit_side_len=960, det_limit_type="max", det_box_thresh=0.6,
        det_unclip_ratio=1.5, det_use_dilation=False, text_score=0.5, **files, **pool_size)
    pool = ThreadPoolExecutor(max_workers=int(workers))
    def read_text(image: Image.Image) -> str:
        lines = engine(np.asarray(image))[0] or []  # [(box, text, confidence)]
        return "".join(text for _, text, confidence in lines if float(confidence) > 0)
    def fn(images, prompts, metadata):
        targets = [ocr_target(prompt) for prompt in prompts]
        if None in targets:
            prompt = prompts[targets.index(None)]
            raise ValueError(f"ocr reward: prompt {prompt!r} has no quoted target text")
        texts = pool.map(read_text, to_pil(images))
        return torch.tensor([ocr_score(*pair) for pair in zip(texts, targets)]), {}
    return fn

# ---- CLIP family (PickScore, CLIPScore, LAION aesthetic), HPS v2.1, ImageReward, JPEG ----
def load_clip(model: str, processor: str | None, device):
    """(CLIPModel, features, logits) of (images, prompts): unit embeddings, scaled cos (CPU)."""
    transformers = importlib.import_module("transformers")
    clip = transformers.CLIPModel.from_pretrained(model).to(device).eval().requires_grad_(False)
    preprocess = transformers.CLIPProcessor.from_pretrained(processor or model)
    normalize = torch.nn.functional.normalize
    def features(images, prompts):
        inputs = preprocess(images=to_pil(images), text=prompts, padding=True,
                            truncation=True, max_length=77, return_tensors="pt").to(device)
        image = clip.get_image_features(pixel_values=inputs["pixel_values"])
        text = clip.get_text_features(input_ids=inputs["input_ids"],
                                      attention_mask=inputs["attention_mask"])
        # transformers 5 returns output objects; 4 returned the tensors
        image = getattr(image, "pooler_output", image)
        text = getattr(text, "pooler_output", text)
        return normalize(image.float(), dim=-1), normalize(text.float(), dim=-1)
    def logits(images, prompts):
        image, text = features(images, prompts)
        return (clip.logit_scale.exp() * (image * text).sum(-1)).cpu().float()
    return clip, features, logits

def pickscore(device="cpu", model="yuvalkirstain/PickScore_v1",
              processor="laion/CLIP-ViT-H-14-laion2B-s32B-b79K"):
    """logit_scale * cos / 26 (flow_grpo/pickscore_scorer.py); tables quote `pickscore_raw`."""
    _, _, logits = load_clip(model, processor, device)
    def fn(images, prompts, metadata):
        raw = logits(images, prompts)
        return raw / 26, {"pickscore_raw": raw}
    return fn

def clipscore(device="cpu", model="openai/clip-vit-large-patch14", processor=None):
    """CLIP ViT-L/14 logit_scale * cos(image, text) / 30 (flow_grpo/clip_scorer.py)."""
    _, _, logits = load_clip(model, processor, device)
    return lambda images, prompts, metadata: (logits(images, prompts) / 30, {})

def aesthetic(device="cpu", model="openai/clip-vit-large-patch14", processor=None,
              head="https://github.com/christophschuhmann/improved-aesthetic-predictor/"
                   "raw/main/sac+logos+ava1-l14-linearMSE.pth"):
    """LAION improved-aesthetic MLP on unit CLIP ViT-L/14 image features (~5-6)."""
    clip, features, _ = load_clip(model, processor, device)
    state = (torch.load(head, map_location="cpu") if os.path.exists(head)
             else torch.hub.load_state_dict_from_url(head, map_location="cpu"))
    nn = torch.nn
    mlp = nn.Sequential(nn.Linear(clip.config.projection_dim, 1024), nn.Dropout(0.2),
                        nn.Linear(1024, 128), nn.Dropout(0.2), nn.Linear(128, 64),
                        nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))
    # the released file names the weights `layers.0.weight`, ...
    mlp.load_state_dict({key.removeprefix("layers."): value for key, value in state.items()})
    mlp = mlp.to(device).eval().requires_grad_(False)
    def fn(images, prompts, metadata):
        image_features, _ = features(images, [""] * len(prompts))
        return mlp(image_features).squeeze(-1).cpu(), {}
    return fn

def hpsv2(device="cpu", checkpoint="xswu/HPSv2:HPS_v2.1_compressed.pt"):
    """HPS v2.1 (DanceGRPO): open_clip ViT-H-14 cos(image, text); checkpoint: .pt or repo:file."""
    open_clip = require("open_clip", "open-clip-torch", "hpsv2")
    model, _, preprocess = open_clip.create_model_and_transforms(
        "ViT-H-14", pretrained=None, precision="fp32")
    if not os.path.exists(checkpoint):
        hub = importlib.import_module("huggingface_hub")
        checkpoint = hub.hf_hub_download(*checkpoint.split(":"))
    state = torch.load(checkpoint, map_location="cpu")
    model.load_state_dict(state.get("state_dict", state))
    model = model.to(device).eval().requires_grad_(False)
    tokenizer = open_clip.get_tokenizer("ViT-H-14")
    normalize = torch.nn.functional.normalize
    def fn(images, prompts, metadata):
        pixels = torch.stack([preprocess(image) for image in to_pil(images)])
        image = normalize(model.encode_image(pixels.to(device)).float(), dim=-1)
        text = normalize(model.encode_text(tokenizer(prompts).to(device)).float(), dim=-1)
        return (image * text).sum(-1).cpu(), {}
    return fn

def imagereward(device="cpu", model="ImageReward-v1.0"):
    """ImageReward v1.0 raw score (~-2..2), one `score(prompt, image)` per image as upstream."""
    package = require("ImageReward", "image-reward", "imagereward")
    scorer = package.load(model, device=str(device)).requires_grad_(False)
    def fn(images, prompts, metadata):
        pairs = zip(prompts, to_pil(images))
        return torch.tensor([float(scorer.score(prompt, image)) for prompt, image in pairs]), {}
    return fn

def jpeg(scale: float):
    """scale * kB as JPEG at quality 95 (DDPO; flow_grpo jpeg_compressibility: -kB / 500)."""
    def fn(images, prompts, metadata):
        sizes = [len(encoded(image, "JPEG", quality=95)) for image in to_pil(images)]
        return torch.tensor([scale * size / 1000 for size in sizes]), {}
    return fn

# ---- Network rewards: GenEval server, VLM judges (OpenAI API), any served reward ----
def geneval(url="http://127.0.0.1:18085", timeout=120.0, retries=1,
            batch_size=64, key="scores"):
    """GenEval reward-server client (yifan123/reward-server; flow_grpo geneval_score): partial
    credit, or `key=rewards`: official-style correctness, the paper metric; logs the strict."""
    if key not in ("scores", "rewards", "strict_rewards"):
        raise ValueError(f"geneval key must be scores, rewards or strict_rewards, not {key!r}")
    call("geneval", url)
    class PlainData(pickle.Unpickler):  # replies are pickles: build plain data, run no code
        def find_class(self, module, name):
            message = f"it references {module}.{name}; only plain data is accepted"
            raise pickle.UnpicklingError(message)
    def parse(raw: bytes):
        reply = PlainData(io.BytesIO(raw)).load()
        return reply[key], {"strict": reply.get("strict_rewards", reply["scores"])}
    def fn(images, prompts, metadata):
        images = to_pil(images)
        scores, strict = [], []  # per request of batch_size images
        for start in range(0, len(images), int(batch_size)):
            end = start + int(batch_size)
            request = {"images": [encoded(image, "JPEG") for image in images[start:end]],
                       "meta_datas": list(metadata[start:end]), "only_strict": key != "rewards"}
            raw = call("geneval", url, pickle.dumps(request),
                       "application/octet-stream", timeout, retries)
            batch_scores, info = read_reply("geneval", url, raw, len(request["images"]), parse)
            scores.append(batch_scores)
            strict.append(info["strict"])
        return torch.cat(scores), {"geneval_strict": torch.cat(strict)}
    return fn

def chat_reward(reward, url, model, api_key, text, timeout, retries,
                workers, score_reply, resize=0, **request_options):
    """Score each (image, prompt) by one OpenAI-compatible /chat/completions call of `text`:
    score_reply(reply JSON) -> float; `resize`: side of the square image sent (0: as is)."""
    call(reward, url, token=api_key)
    pool = ThreadPoolExecutor(max_workers=int(workers))
    endpoint = url.rstrip("/") + "/chat/completions"
    def parse(raw: bytes):
        return [score_reply(json.loads(raw))], {}
    def score(image: Image.Image, prompt: str) -> torch.Tensor:
        if int(resize):
            image = image.resize((int(resize), int(resize)))
        png = base64.b64encode(encoded(image, "PNG")).decode()
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                   {"type": "text", "text": text.format(prompt=prompt)}]
        body = json.dumps({"model": model, "temperature": 0.0, **request_options,
                           "messages": [{"role": "user", "content": content}]}).encode()
        raw = call(reward, endpoint, body, "application/json", timeout, retries, api_key)
        return read_reply(reward, url, raw, 1, parse)[0]  # (1,)
    def fn(images, prompts, metadata):
        futures = [pool.submit(score, *pair) for pair in zip(to_pil(images), prompts)]
        try:
            return torch.cat([done.result() for done in futures]), {}
        finally:  # after a failure, what is queued is not sent
            for future in futures:
                future.cancel()
    return fn

def vlm_judge(url="http://127.0.0.1:17140/v1", model="UnifiedReward-7b-v1.5", api_key="flowgrpo",
              instruction="You are given a text prompt and an image generated from it. "
                          "Judge how well the image follows the prompt and how good it "
                          "looks. Give a score from 1 to 5, then write 'Final Score: x'."
                          "\nPrompt: {prompt}",
              timeout=60.0, retries=2, workers=16, resize=512):
    """UnifiedReward judge (flow_grpo unifiedreward_score_sglang): `Final Score: x` -> x / 5."""
    def score_reply(reply):
        answer = reply["choices"][0]["message"]["content"] or ""
        found = re.findall(r"Final Score:\s*([1-5](?:\.\d+)?)", answer)
        return float(found[0]) / 5 if found else 0.0
    return chat_reward("vlm_judge", url, model, api_key, instruction, timeout, retries,
                       workers, score_reply, resize, max_tokens=512)

def vlm_yesno(url="http://127.0.0.1:17140/v1", model="Qwen/Qwen2.5-VL-7B-Instruct", api_key="",
              question='Does this image match the description: "{prompt}"? Answer Yes or No.',
              timeout=60.0, retries=2, workers=16, top_logprobs=20):
    """P(Yes): summed probability of the first token's top logprobs that read `yes`."""
    def score_reply(reply):
        top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        yes = [entry for entry in top if entry["token"].strip().lower() == "yes"]
        return sum(np.exp(entry["logprob"]) for entry in yes)
    return chat_reward("vlm_yesno", url, model, api_key, question, timeout, retries, workers,
                       score_reply, max_tokens=1, logprobs=True, top_logprobs=int(top_logprobs))

def remote(url="http://127.0.0.1:18090", timeout=120.0, retries=1, token=""):
    """Any reward served by `python rewards.py --serve`; token: default $REWARD_SERVER_TOKEN."""
    token = token or os.environ.get("REWARD_SERVER_TOKEN", "")
    call("remote", url, token=token)
    def parse(raw: bytes):
        reply = json.loads(raw)
        return reply["scores"], reply["info"]
    def fn(images, prompts, metadata):
        pngs = [base64.b64encode(encoded(image, "PNG")).decode() for image in to_pil(images)]
        request = {"images": pngs, "prompts": list(prompts), "metadata": list(metadata)}
        body = json.dumps(request).encode()
        raw = call("remote", url, body, "application/json", timeout, retries, token)
        return read_reply("remote", url, raw, len(pngs), parse)
    return fn

# ---- Specs: parsing, building, combining ----
REWARDS = {
    "ocr": ocr, "pickscore": pickscore, "clipscore": clipscore, "aesthetic": aesthetic,
    "hpsv2": hpsv2, "imagereward": imagereward, "jpeg_compressibility": lambda: jpeg(-1 / 500),
    "jpeg_incompressibility": lambda: jpeg(1.0), "geneval": geneval, "vlm_judge": vlm_judge,
    "vlm_yesno": vlm_yesno, "remote": remote,
    "pickscore_rank": pickscore,  # groupwise (Flow-Factory): ranked by build_reward's transform
}
USES_DEVICE = {"pickscore", "clipscore", "aesthetic", "hpsv2", "imagereward", "pickscore_rank"}

def group_rank(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Rank within the group scaled to [0, 1]: best 1, ties share their mean rank, alone 0.5."""
    scores = scores.float()
    same_group = group_ids[None, :] == group_ids[:, None]  # (B, B)
    group_size = same_group.sum(1)
    below = ((scores[None, :] < scores[:, None]) & same_group).sum(1)
    tied = ((scores[None, :] == scores[:, None]) & same_group).sum(1) - 1  # not itself
    rank = (below + tied / 2) / (group_size - 1).clamp(min=1)
    return torch.where(group_size > 1, rank, 0.5)

def parse_spec(spec: str) -> list[tuple[str, dict, float]]:
    """`a[k=v;k2=v2]=0.5,b` -> [(a, {k: v, k2: v2}, 0.5), (b, {}, 1.0)]; a file keeps its path."""
    parsed = []
    for term in re.split(r",(?![^\[]*\])", spec):  # the commas outside [...]
        term = term.strip()
        match = re.fullmatch(r"([^\[\]=]+?)(?:\[(.*)\])?(?:=([-+0-9.eE]+))?", term)
        if not match:
            raise ValueError(f"cannot parse reward term {term!r}; "
                             "expected name[option=value;...]=weight")
        name, options_text, weight = match.groups()
        is_file = re.fullmatch(r".+\.py:\w+", name) and os.path.isfile(name.rsplit(":", 1)[0])
        if name not in REWARDS and not is_file:
            raise ValueError(f"unknown reward {name!r}; choose from {', '.join(REWARDS)} "
                             "or path/to/file.py:function")
        options = dict(option.split("=", 1) for option in (options_text or "").split(";") if option)
        known = set(inspect.signature(REWARDS.get(name, lambda: None)).parameters) - {"device"}
        unknown = sorted(set(options) - known)  # a file takes none; the device is the script's
        if unknown:
            raise ValueError(f"reward {name!r} has no option {', '.join(unknown)}; "
                             f"its options: {', '.join(sorted(known)) or 'none'}")
        parsed.append((name, options, float(weight or 1.0)))
    return parsed

def file_reward(term: str):
    """`path/to/file.py:function` -> (name, function): the file runs."""
    path, name = term.rsplit(":", 1)
    try:
        namespace = runpy.run_path(path)
    except Exception as error:  # a syntax error or failing import: one line
        reason = f"{type(error).__name__}: {one_line(error)}"
        raise ValueError(f"reward file {path!r} does not load: {reason}") from None
    if not callable(namespace.get(name)):
        raise ValueError(f"reward file {path!r} has no function {name!r}")
    return name, namespace[name]

def check_prompts(spec: str, prompts: list[str]):
    """Cheap checks before any model loads: the spec parses, OCR prompts
    quote a target, file rewards' `fn.check_prompts(prompts)` pass."""
    names = [name for name, _, _ in parse_spec(spec)]
    untargeted = [prompt for prompt in prompts if ocr_target(prompt) is None]
    if "ocr" in names and untargeted:
        raise ValueError("the ocr reward needs the target text in double quotes in every prompt, "
                         f"e.g. 'A sign that says \"hello\"'; {len(untargeted)} prompt(s) have "
                         f"none, first: {untargeted[0]!r}")
    for term in [name for name in names if name not in REWARDS]:
        name, fn = file_reward(term)  # build_reward runs it again
        try:
            getattr(fn, "check_prompts", lambda prompts: None)(list(prompts))
        except ValueError as error:
            raise ValueError(f"reward {name!r}: {one_line(error)}") from None

def build_reward(spec: str, device="cpu"):
    """The weighted-sum reward of a spec. `.weights`: {component: weight}, components named
    like their rewards (`fn` for `file.py:fn`). `.group_transform(components, group_ids)` ->
    (total, components), groupwise components ranked in their groups (None: there are none)."""
    components, weights = {}, {}
    for name, options, weight in parse_spec(spec):
        if name in USES_DEVICE:
            components[name] = REWARDS[name](**options, device=device)
        elif name in REWARDS:
            components[name] = REWARDS[name](**options)
        else:  # path/to/file.py:function, checked by parse_spec
            name, function = file_reward(name)
            components[name] = function
        weights[name] = weight

    def combined(images, prompts, metadata):
        total, info = torch.zeros(len(prompts)), {}
        for name, fn in components.items():
            try:  # one line naming the reward
                score, extras = fn(images, prompts, metadata)
                for extra, values in extras.items():
                    info[extra] = torch.as_tensor(values, dtype=torch.float32).cpu()
                info[name] = torch.as_tensor(score, dtype=torch.float32).cpu().reshape(len(prompts))
            except RewardError:
                raise
            except Exception as error:
                raise RewardError(name, f"{type(error).__name__}: {one_line(error)}") from error
            total += weights[name] * info[name]
        return total, info

    def group_transform(scores: dict, group_ids: torch.Tensor):
        scores = {**scores, "pickscore_rank": group_rank(scores["pickscore_rank"], group_ids)}
        return sum(weights[name] * scores[name] for name in components), scores

    combined.weights = weights
    combined.group_transform = group_transform if "pickscore_rank" in components else None
    return combined

# ---- Reward server: `python rewards.py --serve SPEC --port N` answers `remote` ----
def make_server(serve: str, host: str = "127.0.0.1", port: int = 18090, token: str = "",
                max_body_mb: float = 64.0, max_images: int = 256, max_pixels: int = 2048**2,
                timeout: float = 120.0,
                device: str = "cuda" if torch.cuda.is_available() else "cpu"):
    """Serve a reward spec (`--serve hpsv2`, `--serve 'ocr=1,pickscore=0.5'`) to `remote[url=...]`:
    POST {images: [base64 PNG], prompts, metadata} -> {scores, info}; GET -> {reward}.
    The reward gets (B, 3, H, W) floats in [0, 1], as in-process.

    Args:
        host: address to bind: loopback by default; 0.0.0.0 opens it to the network.
        token: secret each request must carry (401 missing, 403 wrong); $REWARD_SERVER_TOKEN.
        max_body_mb: largest request body in MiB; over it, --max-images or --max-pixels: 413.
        timeout: seconds a client may take to send its request (408 after).
    """
    token = token or os.environ.get("REWARD_SERVER_TOKEN", "")
    reward_fn = build_reward(serve, device=device)
    one_at_a_time = threading.Lock()  # one request's images in memory at a time
    # glibc keeps freed heap memory: malloc_trim hands it back
    malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if os.name == "posix" else None
    status_of = {TimeoutError: 408, Image.DecompressionBombError: 413}  # others: 400

    class Refused(Exception):
        """A request the server will not score: Refused(HTTP status, message)."""

    def score(request: dict) -> dict:
        pngs = list(request["images"])
        prompts, metadata = list(request["prompts"]), list(request["metadata"])
        if len(pngs) > max_images:
            raise Refused(413, f"{len(pngs)} images is over this server's limit of "
                               f"{max_images} (--max-images)")
        # Image.open reads the header only: sizes are checked before any pixel is decoded
        images = [Image.open(io.BytesIO(base64.b64decode(png, validate=True)), formats=["PNG"])
                  for png in pngs]
        for i, image in enumerate(images):
            if image.width * image.height > max_pixels:
                raise Refused(413, f"image {i} has {image.width}x{image.height} pixels, "
                                   f"over this server's limit of {max_pixels} (--max-pixels)")
        with one_at_a_time:  # as in-process: (B, 3, H, W) in [0, 1]
            pixels = [np.asarray(image.convert("RGB")) for image in images]
            if len({array.shape for array in pixels}) > 1:
                raise Refused(400, "images of one request differ in size")
            batch = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float() / 255
            scores, info = reward_fn(batch, prompts, metadata)
        info = {name: values.tolist() for name, values in info.items()}
        return {"scores": scores.tolist(), "info": info}

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> dict:
            length = self.headers.get("Content-Length", "0")
            given = self.headers.get("Authorization", "")
            expected = f"Bearer {token}".encode()
            authorised = not token or hmac.compare_digest(given.encode(), expected)
            if not length.isdigit():
                raise Refused(400, f"bad Content-Length {length!r}")
            # a refused body is read too, and dropped, so that the client reads the refusal
            keep = authorised and int(length) <= int(max_body_mb * 2**20)
            chunks, left = [], int(length)
            deadline = time.monotonic() + timeout
            while left > 0:
                chunk = self.rfile.read1(min(left, 1 << 20))  # TimeoutError if nothing comes
                if not chunk or time.monotonic() >= deadline:
                    raise Refused(408, f"request body not received in {timeout:g} s")
                left -= len(chunk)
                if keep:
                    chunks.append(chunk)
            if not authorised and given:
                raise Refused(403, "wrong token")
            if not authorised:
                raise Refused(401, "this reward server needs a token: "
                                   "remote[token=...] or $REWARD_SERVER_TOKEN")
            if not keep:
                raise Refused(413, f"request body of {int(length) / 2**20:.1f} MiB is over "
                                   f"this server's limit of {max_body_mb:g} MiB (--max-body-mb)")
            if self.command == "POST":
                return score(json.loads(b"".join(chunks)))
            return {"reward": serve}

        def do_POST(self):
            try:
                status, answer = 200, self.answer()
            except Refused as refusal:
                status, message = refusal.args
                answer = {"error": message}
            except Exception as error:  # the client reads why, not a dropped connection
                status = status_of.get(type(error), 400)
                answer = {"error": one_line(repr(error))}
            if malloc_trim:
                malloc_trim(0)  # the request's images are gone: back to the baseline
            reply = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))  # HTTP/1.0: it ends the reply
            self.end_headers()
            self.wfile.write(reply)

        do_GET = do_POST

    Handler.timeout = timeout  # of every socket read and write; the body also has a deadline
    server = ThreadingHTTPServer((host, port), Handler)
    print(f"serving reward {serve!r} on http://{host}:{server.server_address[1]} "
          f"({'token required' if token else 'no token'})", flush=True)
    if not token and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: {host} is reachable from other machines and no token is set", flush=True)
    return server

if __name__ == "__main__":
    importlib.import_module("tyro").cli(make_server).serve_forever()
