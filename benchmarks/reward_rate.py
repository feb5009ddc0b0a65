"""Reward-phase speed: images/s that a reward (a rewards.py spec) scores, against the rollout rate
it has to keep up with.

The scripts score batch i in a background thread while batch i+1 is sampled, so a reward keeps
up when it scores at least the rollout's images/s. The images are rendered signs (a word in a
box on a noisy background, the prompt quoting it), so the OCR reward detects and reads text as
it would on a model that renders text; its mean score is reported as a check that it reads them.

Each setting runs in fresh processes (`procs` of them at once, as the ranks of one node share
its CPU): every process builds the reward, scores one warm-up batch, waits for the others, then
times `--batches` batches of `--batch-size`. Setting keys: `procs` (processes at once, default
1), `workers` and `threads` (the ocr reward's options: images scored at once, onnxruntime
threads per model call, 0 = its default), `cores` (the processes pinned to the first N cores;
default all).

    python benchmarks/reward_rate.py                   # ocr, 512², the default settings
    python benchmarks/reward_rate.py --settings workers=8 workers=16,threads=1 --rollout-rate 8.2
"""

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import tyro
from PIL import Image, ImageDraw, ImageFont

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import rewards  # noqa: E402

WORDS = ("OPEN", "FLOW", "Hello", "GRPO", "reward", "Coffee", "EXIT", "Sale 50%", "Bakery",
         "NO PARKING", "Welcome", "Books")


@dataclass
class Args:
    reward: str = "ocr"
    """the reward spec to time (rewards.py); `workers`/`threads` settings apply to ocr"""
    reference: str | None = os.path.join(REPO, "tests", "toy_rewards.py") + ":brightness"
    """a second spec timed in this process on the same images (None: none)"""
    settings: tuple[str, ...] = ("workers=8", "workers=16,threads=1", "workers=4,threads=4",
                                 "procs=8,workers=8", "procs=8,workers=2,threads=1")
    """comma-joined key=value settings (module docstring), one row each"""
    resolution: int = 512
    """image side (Flow-GRPO's OCR runs: 512)"""
    batch_size: int = 9
    """images per call (the scripts' per-GPU micro-batch)"""
    batches: int = 4
    """timed batches per process, after one warm-up batch"""
    rollout_rate: float | None = None
    """images/s of the rollout to compare with (per GPU); None: no verdict"""
    json: str | None = None
    """write the rows here"""
    child: str | None = None
    """(internal) run one process of a setting, given as JSON"""


def parse_setting(text: str) -> dict:
    setting = {"procs": 1, "workers": None, "threads": None, "cores": None}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        if key not in setting:
            raise ValueError(f"setting {text!r}: unknown key {key!r}; keys: {', '.join(setting)}")
        setting[key] = int(value)
    return setting


def spec_with(spec: str, setting: dict) -> str:
    """The spec with the setting's ocr options (workers, threads) added to its ocr term."""
    extra = {key: setting[key] for key in ("workers", "threads") if setting[key] is not None}
    if not extra:
        return spec
    terms = rewards.parse_spec(spec)
    if "ocr" not in [name for name, _, _ in terms]:
        raise ValueError(f"workers/threads are options of the ocr reward, not in {spec!r}")
    parts = []
    for name, options, weight in terms:
        inner = ";".join(f"{k}={v}" for k, v in {**options, **(extra if name == "ocr" else {})}
                         .items())
        parts.append(name + (f"[{inner}]" if inner else "") + ("" if weight == 1 else
                                                               f"={weight:g}"))
    return ",".join(parts)


def sign_images(count: int, resolution: int, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """(count, 3, R, R) float images in [0, 1] of a quoted word on a sign, and their prompts."""
    rng = random.Random(seed)
    font = ImageFont.load_default(size=max(12, resolution // 10))
    images, prompts = [], []
    for _ in range(count):
        word = rng.choice(WORDS)
        pixels = np.random.default_rng(rng.randrange(2**32))
        noise = pixels.integers(0, 60, (resolution, resolution, 3))
        background = np.array([rng.randrange(120, 200) for _ in range(3)]) + noise
        image = Image.fromarray(background.clip(0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
        x = rng.randrange(8, max(9, resolution - (right - left) - 8))
        y = rng.randrange(8, max(9, resolution - (bottom - top) - 8))
        draw.rectangle((x - 8, y - 8, x + right + 8, y + bottom + 8), fill=(235, 230, 215))
        draw.text((x, y), word, fill=(rng.randrange(60), 20, 40), font=font)
        images.append(torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1))
        prompts.append(f'A photo of a sign that says "{word}"')
    return torch.stack(images).float() / 255, prompts


def time_reward(fn, images, prompts, batch_size: int, batches: int, ready=None) -> dict:
    """One warm-up batch, `ready()` (a barrier), then `batches` timed batches."""
    def score(i: int) -> torch.Tensor:
        start = i * batch_size % len(prompts)
        batch = slice(start, start + batch_size)
        return fn(images[batch], prompts[batch], [{}] * batch_size)[0]
    score(0)
    if ready:
        ready()
    scores, start = [], time.perf_counter()
    for i in range(batches):
        scores.append(score(i + 1))
    seconds = time.perf_counter() - start
    return {"images": batches * batch_size, "seconds": seconds,
            "images_per_sec": batches * batch_size / seconds,
            "mean_score": float(torch.cat(scores).mean())}


def child(config: dict):
    """One process of a setting: pinned, the reward built, warm, then on "go" timed."""
    if config["cores"]:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: config["cores"]])
    fn = rewards.build_reward(config["spec"])
    images, prompts = sign_images(config["batch_size"] * (config["batches"] + 1),
                                  config["resolution"], seed=config["seed"])

    def ready():
        print("ready", flush=True)
        sys.stdin.readline()  # "go": every process of the setting is warm
    row = time_reward(fn, images, prompts, config["batch_size"], config["batches"], ready)
    print(json.dumps(row), flush=True)


def run_setting(args: Args, text: str) -> dict:
    """All processes of one setting at once; per-process and total images/s."""
    setting = parse_setting(text)
    spec = spec_with(args.reward, setting)
    procs = []
    for rank in range(setting["procs"]):
        config = dict(spec=spec, cores=setting["cores"], resolution=args.resolution,
                      batch_size=args.batch_size, batches=args.batches, seed=rank)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", json.dumps(config)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for proc in procs:  # wait until every process is warm, then start them together
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"setting {text!r}: a process failed before timing ({line!r})")
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    rows = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"setting {text!r}: a process exited with {proc.returncode}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    per_proc = [row["images_per_sec"] for row in rows]
    cores = setting["cores"] or len(os.sched_getaffinity(0))
    return {"setting": text, "spec": spec, **setting, "cores": cores,
            "cores_per_proc": cores / setting["procs"],
            "images_per_sec_per_proc": min(per_proc), "images_per_sec_total": sum(per_proc),
            "mean_score": float(np.mean([row["mean_score"] for row in rows])),
            "batch_size": args.batch_size, "resolution": args.resolution}


def verdict(rate: float, rollout_rate: float | None) -> str:
    if rollout_rate is None:
        return "–"
    return f"{'yes' if rate >= rollout_rate else 'NO'} ({rate / rollout_rate:.2f}x)"


def main(args: Args) -> list[dict]:
    if args.child:
        child(json.loads(args.child))
        return []
    rows = []
    if args.reference:
        images, prompts = sign_images(args.batch_size * (args.batches + 1), args.resolution)
        row = time_reward(rewards.build_reward(args.reference), images, prompts,
                          args.batch_size, args.batches)
        rows.append({"setting": "in-process", "spec": args.reference, "procs": 1,
                     "cores_per_proc": len(os.sched_getaffinity(0)),
                     "images_per_sec_per_proc": row["images_per_sec"],
                     "images_per_sec_total": row["images_per_sec"],
                     "mean_score": row["mean_score"], "batch_size": args.batch_size,
                     "resolution": args.resolution})
    for text in args.settings:
        try:
            rows.append(run_setting(args, text))
        except (RuntimeError, ValueError) as error:
            rows.append({"setting": text, "spec": args.reward, "error": str(error)})
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rollout_rate": args.rollout_rate, "rows": rows}, f, indent=1)
    print(f"\n{args.resolution}² images, batches of {args.batch_size}, "
          f"{len(os.sched_getaffinity(0))} cores here; keeps up = per-process img/s >= "
          f"rollout {args.rollout_rate or '–'} img/s\n")
    print("\n".join(table(rows, args.rollout_rate) + [""] + advice(rows, args.rollout_rate)))
    return rows


def advice(rows: list[dict], rollout_rate: float | None) -> list[str]:
    """The fastest ocr setting for one process and for several at once (ranks of one node)."""
    lines = []
    for label, several in (("one process", False), ("processes sharing the CPU", True)):
        candidates = [row for row in rows if "error" not in row and row["spec"].startswith("ocr")
                      and (row["procs"] > 1) == several]
        if candidates:
            best = max(candidates, key=lambda row: row["images_per_sec_per_proc"])
            rate = best["images_per_sec_per_proc"]
            lines.append(f"- fastest for {label}: `{short(best['spec'])}` with {best['procs']} "
                         f"process(es) on {best['cores']} cores, {rate:.3g} img/s per process; "
                         f"keeps up with the rollout: {verdict(rate, rollout_rate)}")
    return lines


def short(spec: str) -> str:
    return spec.replace(REPO + os.sep, "")


def table(rows: list[dict], rollout_rate: float | None) -> list[str]:
    lines = ["| reward | setting | cores per process | img/s per process | img/s total | "
             "mean score | keeps up with the rollout |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {short(row['spec'])} | {row['setting']} | {row['error']} |||||")
            continue
        rate = row["images_per_sec_per_proc"]
        lines.append(f"| {short(row['spec'])} | {row['setting']} | {row['cores_per_proc']:.3g} | "
                     f"{rate:.3g} | {row['images_per_sec_total']:.3g} | "
                     f"{row['mean_score']:.3f} | {verdict(rate, rollout_rate)} |")
    return lines


if __name__ == "__main__":
    main(tyro.cli(Args))
