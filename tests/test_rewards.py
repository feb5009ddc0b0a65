"""rewards.py: every formula against a hand computation, real OCR, tiny CLIP models, local HTTP servers."""

import base64
import builtins
import http.client
import io
import itertools
import json
import math
import os
import pickle
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw, ImageFont
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

import rewards
from tiny import clip_tokenizer


def text_image(text: str) -> torch.Tensor:
    """Black text on white, (3, 96, 320) in [0, 1]."""
    img = Image.new("RGB", (320, 96), "white")
    ImageDraw.Draw(img).text((10, 25), text, fill="black", font=ImageFont.load_default(size=36))
    return torch.from_numpy(__import__("numpy").asarray(img).copy()).permute(2, 0, 1).float() / 255


# ---------------------------------------------------------------- OCR
def test_levenshtein_and_ocr_formula_by_hand():
    assert rewards.levenshtein("kitten", "sitting") == 3
    assert rewards.levenshtein("", "abc") == 3 and rewards.levenshtein("abc", "abc") == 0
    assert rewards.ocr_score("A sign: Hello World!", "hello world") == 1.0  # substring after lower/no-space
    assert rewards.ocr_score("helo", "hello") == pytest.approx(1 - 1 / 5)
    assert rewards.ocr_score("", "hello") == 0.0  # distance 5 capped at len 5
    assert rewards.ocr_score("completely different text", "abc") == 0.0  # capped: never negative
    assert rewards.ocr_target('A sign that says "Open Now" and "x"') == "Open Now"
    assert rewards.ocr_target("no quotes") is None


def test_ocr_real_rapidocr_on_rendered_text():
    fn = rewards.build_reward("ocr")
    images = torch.stack([text_image("FLOW GRPO"), text_image("FLOW GRAPE"), torch.ones(3, 96, 320)])
    prompts = ['A sign that says "Flow GRPO"'] * 3
    scores, info = fn(images, prompts, [{}] * 3)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    assert scores[0] == pytest.approx(1.0)
    assert scores[2] == 0.0  # blank image: nothing recognised
    # "flowgrape" vs target "flowgrpo": the formula on what PP-OCR read (2 edits for a correct read)
    assert 0.0 < scores[1] < 1.0 and scores[1] == pytest.approx(1 - 2 / 8, abs=1 / 8 + 1e-6)
    assert torch.equal(info["ocr"], scores)
    with pytest.raises(ValueError, match="no quoted target"):
        fn(images[:1], ["no quotes here"], [{}])
    pil = [Image.fromarray((text_image("FLOW GRPO").permute(1, 2, 0).numpy() * 255).astype("uint8"))]
    assert fn(pil, prompts[:1], [{}])[0][0] == pytest.approx(1.0)  # a list of PIL images works too


FONT_FILES = [f"/usr/share/fonts/truetype/dejavu/{name}.ttf" for name in ("DejaVuSerif-Bold", "DejaVuSansMono")]


def test_ocr_reads_rendered_text_of_several_fonts_sizes_and_lengths(monkeypatch):
    """Upstream's engine settings (no angle classifier, PaddleOCR's detector defaults), and a perfect score on clean
    renders: PIL's built-in font (no system fonts needed) plus DejaVu where installed, 3 sizes, 3 lengths."""
    import rapidocr_onnxruntime

    made, real = [], rapidocr_onnxruntime.RapidOCR
    monkeypatch.setattr(rapidocr_onnxruntime, "RapidOCR", lambda **kw: made.append(kw) or real(**kw))
    fn = rewards.build_reward("ocr")
    assert made == [dict(use_cls=False, det_limit_side_len=960, det_limit_type="max", det_box_thresh=0.6,
                         det_unclip_ratio=1.5, det_use_dilation=False, text_score=0.5)]
    fonts = [lambda size: ImageFont.load_default(size=size)]
    fonts += [lambda size, path=path: ImageFont.truetype(path, size) for path in FONT_FILES if os.path.exists(path)]
    images, targets = [], []
    for make_font in fonts:
        for size, text in itertools.product((16, 28, 44), ("OPEN", "Hello World", "The quick brown fox jumps")):
            font = make_font(size)
            width = ImageDraw.Draw(Image.new("RGB", (1, 1))).textbbox((0, 0), text, font=font)[2]
            img = Image.new("RGB", (width + 40, 3 * size), (240, 235, 220))
            ImageDraw.Draw(img).text((20, size), text, fill=(20, 20, 60), font=font)
            images.append(img)
            targets.append(text)
    scores, _ = fn(images, [f'A sign that says "{t}"' for t in targets], [{}] * len(images))
    assert scores.tolist() == [1.0] * len(images)
    cut = fn(images[-1:], ['A sign that says "The quick brown fox jumps over"'], [{}])[0]
    assert cut.item() == pytest.approx(1 - 4 / 25)  # "over" missing: 4 of the 25 characters (spaces dropped)


def test_check_prompts_and_spec_errors():
    with pytest.raises(ValueError, match="double quotes"):
        rewards.check_prompts("ocr=1,jpeg_compressibility=0.1", ['ok "x"', "missing"])
    rewards.check_prompts("jpeg_compressibility", ["missing is fine here"])
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        rewards.parse_spec("ocr,nope")
    with pytest.raises(ValueError, match="file.py:function"):
        rewards.parse_spec("does/not/exist.py:fn")
    assert rewards.parse_spec("geneval[url=http://h:1/a;timeout=3]=0.5,ocr") == [
        ("geneval", {"url": "http://h:1/a", "timeout": "3"}, 0.5), ("ocr", {}, 1.0)]
    assert rewards.parse_weights("tests/toy_rewards.py:brightness=2,ocr=0.5") == {"brightness": 2.0, "ocr": 0.5}


# ---------------------------------------------------------------- JPEG and combinations
def test_jpeg_by_hand_and_weighted_sum():
    images = torch.rand(2, 3, 32, 32)
    images[1] = 0.5  # flat image: much smaller file
    expected = []
    for img in rewards.to_pil(images):
        buffer = io.BytesIO()
        img.save(buffer, format="JPEG", quality=95)
        expected.append(len(buffer.getvalue()) / 1000)
    expected = torch.tensor(expected)
    inc, _ = rewards.build_reward("jpeg_incompressibility")(images, ["a", "b"], [{}, {}])
    comp, _ = rewards.build_reward("jpeg_compressibility")(images, ["a", "b"], [{}, {}])
    assert torch.allclose(inc, expected) and torch.allclose(comp, -expected / 500) and inc[0] > inc[1]
    fn = rewards.build_reward("jpeg_incompressibility=0.5,tests/toy_rewards.py:brightness=2")
    total, info = fn(images, ["a", "b"], [{}, {}])
    brightness = images.mean(dim=(1, 2, 3))
    assert torch.allclose(total, 0.5 * expected + 2 * brightness, atol=1e-5)  # weighted SUM, not mean
    assert torch.allclose(info["jpeg_incompressibility"], expected) and torch.allclose(info["brightness"], brightness)
    assert fn.weights == {"jpeg_incompressibility": 0.5, "brightness": 2.0} and fn.group_transform is None


# ---------------------------------------------------------------- CLIP family on a tiny random CLIP
@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip")
    tok = clip_tokenizer()
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=len(tok) - 2,
                         eos_token_id=len(tok) - 1, pad_token_id=len(tok) - 1),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=12)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(path)
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                  tokenizer=tok).save_pretrained(path)
    return str(path)


def reference_logits(path, images, prompts):
    """logits_per_image.diagonal() from the model's own full forward: an independent path to logit_scale * cos."""
    model, proc = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    inputs = proc(images=rewards.to_pil(images), text=prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    return out.logits_per_image.diagonal(), out.image_embeds


def test_pickscore_clipscore_aesthetic_on_tiny_clip(tiny_clip, tmp_path):
    images, prompts = torch.rand(3, 3, 40, 48), ["a cat", "a red dog on a hill", "x"]
    logits, image_embeds = reference_logits(tiny_clip, images, prompts)
    score, info = rewards.build_reward(f"pickscore[model={tiny_clip};processor={tiny_clip}]")(images, prompts, [{}] * 3)
    assert score.dtype == torch.float32 and score.shape == (3,)
    assert torch.allclose(score, logits / 26, atol=1e-5) and torch.allclose(info["pickscore_raw"], logits, atol=1e-4)
    score, _ = rewards.build_reward(f"clipscore[model={tiny_clip}]")(images, prompts, [{}] * 3)
    assert torch.allclose(score, logits / 30, atol=1e-5)
    torch.manual_seed(1)
    head = rewards.aesthetic_head(12)
    torch.save({f"layers.{k}": v for k, v in head.state_dict().items()}, tmp_path / "head.pth")  # released layout
    score, _ = rewards.build_reward(f"aesthetic[model={tiny_clip};head={tmp_path / 'head.pth'}]")(images, prompts,
                                                                                                 [{}] * 3)
    with torch.no_grad():
        expected = head.eval()(torch.nn.functional.normalize(image_embeds, dim=-1)).squeeze(-1)
    assert torch.allclose(score, expected, atol=1e-5)


def test_pickscore_rank_is_groupwise(tiny_clip):
    fn = rewards.build_reward(f"pickscore_rank[model={tiny_clip};processor={tiny_clip}]=1,jpeg_compressibility=0")
    assert fn.group_transform is not None
    images = torch.rand(6, 3, 32, 32)
    score, info = fn(images, ["a"] * 3 + ["b"] * 3, [{}] * 6)
    logits, _ = reference_logits(tiny_clip, images, ["a"] * 3 + ["b"] * 3)
    assert torch.allclose(score, logits / 26, atol=1e-5)  # direct call: the pointwise base score
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    total, comps = fn.group_transform(info, group_ids)
    for g in (0, 1):
        order = info["pickscore_rank"][group_ids == g].argsort()
        assert torch.equal(comps["pickscore_rank"][group_ids == g][order], torch.tensor([0.0, 0.5, 1.0]))
    assert torch.equal(total, comps["pickscore_rank"])
    assert torch.equal(rewards.group_rank(torch.tensor([1.0, 1.0, 3.0]), torch.zeros(3, dtype=torch.long)),
                       torch.tensor([0.25, 0.25, 1.0]))  # ties share their mean rank


def test_missing_optional_dependency_names_pip_command(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.split(".")[0] in ("open_clip", "ImageReward", "rapidocr_onnxruntime"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(rewards.importlib, "import_module", lambda name: fake_import(name))
    with pytest.raises(ImportError, match="pip install open-clip-torch"):
        rewards.build_reward("hpsv2")
    with pytest.raises(ImportError, match="pip install image-reward"):
        rewards.build_reward("imagereward")
    with pytest.raises(ImportError, match="pip install rapidocr-onnxruntime"):
        rewards.build_reward("ocr")


# ---------------------------------------------------------------- network rewards against local servers
def serve(handler_fn, delay: float = 0.0):
    """Start a local HTTP server whose POST reply is handler_fn(body: bytes) -> (status, bytes)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(delay)
            status, reply = handler_fn(self.path, body)
            self.send_response(status)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_geneval_client_protocol():
    seen = {}

    def handler(path, body):
        request = pickle.loads(body)
        seen.update(request)
        assert all(Image.open(io.BytesIO(b)).format == "JPEG" for b in request["images"])
        n = len(request["images"])
        return 200, pickle.dumps({"scores": [0.5] * n, "rewards": [1.0] * n, "strict_rewards": [0.0] * n,
                                  "group_rewards": {}, "group_strict_rewards": {}})

    server, url = serve(handler)
    meta = [{"tag": "counting", "include": [{"class": "cat", "count": 2}]}] * 3
    score, info = rewards.build_reward(f"geneval[url={url};batch_size=2]")(torch.rand(3, 3, 16, 16), ["p"] * 3, meta)
    assert score.tolist() == [0.5] * 3 and info["geneval_strict"].tolist() == [0.0] * 3
    assert seen["only_strict"] is True and seen["meta_datas"] == meta[2:]  # the last of two batches
    score, _ = rewards.build_reward(f"geneval[url={url};key=rewards]")(torch.rand(1, 3, 16, 16), ["p"], meta[:1])
    assert score.tolist() == [1.0] and seen["only_strict"] is False  # the official-style correctness
    server.shutdown()


def test_vlm_judge_and_yesno_against_fake_openai_server():
    requests = []

    def handler(path, body):
        request = json.loads(body)
        requests.append((path, request))
        content = request["messages"][0]["content"]
        assert content[0]["image_url"]["url"].startswith("data:image/png;base64,")
        if request.get("logprobs"):
            top = [{"token": "Yes", "logprob": -0.5}, {"token": " yes", "logprob": -3.0}, {"token": "No", "logprob": -1.2}]
            reply = {"choices": [{"message": {"content": "Yes"}, "logprobs": {"content": [{"top_logprobs": top}]}}]}
        else:
            text = "The image is fine.\nFinal Score: 4" if "cat" in content[1]["text"] else "no verdict"
            reply = {"choices": [{"message": {"content": text}}]}
        return 200, json.dumps(reply).encode()

    server, url = serve(handler)
    images = torch.rand(2, 3, 16, 16)
    score, _ = rewards.build_reward(f"vlm_judge[url={url}/v1;resize=64]")(images, ["a cat", "a dog"], [{}, {}])
    assert score.tolist() == pytest.approx([0.8, 0.0])  # "Final Score: 4" -> 4/5; no score -> 0
    score, _ = rewards.build_reward(f"vlm_yesno[url={url}/v1]")(images, ["a cat", "a dog"], [{}, {}])
    assert score.tolist() == pytest.approx([math.exp(-0.5) + math.exp(-3.0)] * 2)
    server.shutdown()
    assert all(path == "/v1/chat/completions" for path, _ in requests)
    assert requests[0][1]["model"] == "UnifiedReward-7b-v1.5" and requests[-1][1]["max_tokens"] == 1


def test_network_reward_down_or_slow_fails_clearly():
    server, url = serve(lambda path, body: (200, b"{}"))
    server.shutdown()
    server.server_close()  # nothing listens any more
    start = time.time()
    with pytest.raises(RuntimeError, match=f"reward server {url}.* failed after 2 tries"):
        rewards.build_reward(f"remote[url={url};timeout=1;retries=1]")(torch.rand(1, 3, 8, 8), ["p"], [{}])
    slow, slow_url = serve(lambda path, body: (200, b"{}"), delay=3.0)
    with pytest.raises(RuntimeError, match="timeout"):
        rewards.build_reward(f"vlm_judge[url={slow_url};timeout=0.5;retries=0]")(torch.rand(1, 3, 8, 8), ["p"], [{}])
    slow.shutdown()
    assert time.time() - start < 15  # backoff 1 s, then the timeouts: bounded, never hangs


def test_shipped_reward_server_serves_jpeg_end_to_end():
    server = rewards.make_server("jpeg_compressibility", "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    images = torch.rand(2, 3, 24, 24)
    local, _ = rewards.build_reward("jpeg_compressibility")(images, ["a", "b"], [{}, {}])
    served, info = rewards.build_reward(f"remote[url={url}]")(images, ["a", "b"], [{}, {}])
    assert torch.allclose(served, local) and torch.allclose(info["jpeg_compressibility"], local)  # PNG is lossless
    with pytest.raises(RuntimeError, match="HTTP 400"):  # a server-side error is reported, not retried
        rewards.build_reward(f"remote[url={url}]")(images, ["a"], [{}, {}])
    server.shutdown()
