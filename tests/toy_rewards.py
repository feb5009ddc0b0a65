"""Rewards for learning tests and the toy benchmark: toy-world counting/color/shape checks, and pixel statistics.

Used as `--reward tests/toy_rewards.py:counting` (or `:counting_partial`, `:brightness`, ...): plain functions with the
rewards.py contract fn(images (B, 3, H, W) in [0, 1], prompts, metadata) -> (scores (B,) float32 CPU, info dict).

`counting` is a verifiable GenEval-style reward for the toy world of tests/toy_world.py ("two red squares" on a black
background): a deterministic detector (color masks, connected components, shape from the fill ratio of the bounding
box: a square fills it, a triangle about half -- robust to a tiny VAE's blur, unlike circle vs square) finds the
objects; the score is 1 when exactly the prompted number of objects of the prompted color and shape is present and
nothing else, else 0. `counting_partial` gives partial credit (count, color, shape: 1/3 each).
"""

import re

import numpy as np
import torch

COLORS = {"red": 0.0, "yellow": 55.0, "green": 120.0, "blue": 230.0}  # hue (degrees) of each toy color
SHAPES = ("square", "triangle")
NUMBERS = {"a": 1, "one": 1, "two": 2, "three": 3, "four": 4}
PROMPT_RE = re.compile(rf"^(a|one|two|three|four) ({'|'.join(COLORS)}) ({'|'.join(SHAPES)})s?$")


def parse_prompt(prompt: str) -> tuple[int, str, str]:
    """'two red squares' -> (2, 'red', 'square'); anything else raises ValueError."""
    m = PROMPT_RE.match(prompt.strip().lower())
    if m is None:
        raise ValueError(f"not a toy-world prompt (like 'two red squares'): {prompt!r}")
    return NUMBERS[m.group(1)], m.group(2), m.group(3)


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean (H, W) mask, each as an (n, 2) array of (row, col)."""
    seen, out = np.zeros_like(mask), []
    h, w = mask.shape
    for r0, c0 in zip(*np.nonzero(mask)):
        if seen[r0, c0]:
            continue
        stack, pixels = [(r0, c0)], []
        seen[r0, c0] = True
        while stack:
            r, c = stack.pop()
            pixels.append((r, c))
            for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                if 0 <= rr < h and 0 <= cc < w and mask[rr, cc] and not seen[rr, cc]:
                    seen[rr, cc] = True
                    stack.append((rr, cc))
        out.append(np.array(pixels))
    return out


def detect(image: torch.Tensor) -> tuple[list[tuple[str, str]], int]:
    """Objects in one (3, H, W) image in [0, 1]: a list of (color, shape) -- shape 'blob' for a component that is
    neither a square nor a triangle, color 'other' for an off-palette hue -- and the number of stray colored pixels
    (components too small to be an object)."""
    rgb = image.detach().float().clamp(0, 1).cpu().numpy()
    mx, mn = rgb.max(0), rgb.min(0)
    colored = (mx > 0.35) & (mx - mn > 0.5 * mx)  # bright and saturated; the background is black
    r, g, b = rgb
    hue = np.degrees(np.arctan2(np.sqrt(3) * (g - b), 2 * r - g - b)) % 360  # standard hue angle
    names = list(COLORS)
    dist = np.stack([np.minimum(abs(hue - h), 360 - abs(hue - h)) for h in COLORS.values()])
    label = np.where(dist.min(0) <= 35, dist.argmin(0), len(names))  # len(names) = off-palette
    min_area = max(4, round(0.02 * rgb.shape[1] * rgb.shape[2]))  # 20 px at 32x32 (objects are >= 50)
    objects, stray = [], 0
    for k in range(len(names) + 1):
        for pix in _components(colored & (label == k)):
            if len(pix) < min_area:
                stray += len(pix)
                continue
            hgt, wid = np.ptp(pix[:, 0]) + 1, np.ptp(pix[:, 1]) + 1
            fill = len(pix) / (hgt * wid)
            shape = "blob"
            if max(hgt, wid) <= 1.4 * min(hgt, wid):
                shape = "square" if fill >= 0.78 else "triangle" if fill >= 0.35 else "blob"  # exact: 1.0, ~0.55
            objects.append((names[k] if k < len(names) else "other", shape))
    return objects, stray


def _score(images, prompts, partial: bool):
    scores, found = [], []
    for image, prompt in zip(images, prompts):
        count, color, shape = parse_prompt(prompt)
        objects, stray = detect(image)
        tolerance = 0.03 * image.shape[1] * image.shape[2]  # a few stray pixels (soft edges) are not an object
        if not objects or stray > tolerance:
            s = 0.0
        else:
            checks = (len(objects) == count, all(c == color for c, _ in objects), all(s == shape for _, s in objects))
            s = sum(checks) / 3 if partial else float(all(checks))
        scores.append(s)
        found.append(len(objects))
    return torch.tensor(scores, dtype=torch.float32), {"objects_found": found}


def counting(images, prompts, metadata):
    """1 if the image shows exactly the prompted count of objects of the prompted color and shape, nothing else."""
    return _score(images, prompts, partial=False)


def counting_partial(images, prompts, metadata):
    """Partial credit: 1/3 each for the right count, all objects the right color, all the right shape (0 if none)."""
    return _score(images, prompts, partial=True)


def brightness(images, prompts, metadata):
    """Mean pixel value of each image, in [0, 1]."""
    scores = images.float().mean(dim=(1, 2, 3)).cpu()
    return scores, {"brightness": scores.tolist()}


def redness(images, prompts, metadata):
    """Mean red minus mean of green and blue, in [-1, 1]."""
    images = images.float()
    scores = (images[:, 0] - images[:, 1:].mean(dim=1)).mean(dim=(1, 2)).cpu()
    return scores, {"redness": scores.tolist()}


_calls = {"n": 0}


def nan_after_two_batches(images, prompts, metadata):
    """Brightness for the first two calls, then NaN: drives a run into a non-finite loss on purpose."""
    _calls["n"] += 1
    scores = brightness(images, prompts, metadata)[0]
    return (scores if _calls["n"] <= 2 else torch.full_like(scores, float("nan"))), {}
