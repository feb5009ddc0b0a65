"""Rewards for learning tests and the toy benchmark: toy-world counting, and pixel statistics.

Used as `--reward tests/toy_rewards.py:counting` (or `:counting_partial`, `:brightness`, ...):
plain functions with the rewards.py contract
fn(images (B, 3, H, W) in [0, 1], prompts, metadata) -> (scores (B,) float32 CPU, info dict);
the counting rewards also carry a prompt check (`fn.check_prompts`, run before any model loads).

`counting` is a verifiable GenEval-style reward for the toy world of tests/toy_world.py ("two red
squares": 1-3 squares or triangles of one color on black). RL optimises whatever its judge lets
through, so the detector is strict. The fill-ratio detector it replaces passed 45-degree diamonds
and L-shapes as triangles, hollow squares as squares, a correct image with a small extra object or
~30 colored specks beside it, and lattice garbage as 'a blue triangle' (6 of the 8 SD3 toy samples
of that held-out prompt at CFG 4.5 are lattices; NFT runs drew more).
  - Object: a 4-connected component of bright, saturated pixels covering >= 2 % of the image.
  - Color: the most common palette hue among its pixels ('other' if most are off the palette);
    'mixed' if more than 10 % of its pixels have another palette hue.
  - Shape: the world's shape (axis-aligned square, isosceles triangle pointing up; ideal masks drawn
    with the renderer's PIL calls) that fits it best over position, size and a little stretch,
    with IoU >= 0.88 for a square, 0.8 for a triangle; it must fit that shape about as well as
    the shape's rounded twin (a dome for the triangle, a disc for the square), enclose no holes
    and span at most half the image. Anything else is a 'blob': diamonds, rotated squares,
    L-shapes, hollow, rounded and lattice shapes.
  - Debris: every visible (not black) pixel more than one pixel from an object. One pixel is
    the VAE's blur; gray and dim pixels count, not only colored ones.
The exact score is 1 when exactly the prompted number of objects is found, all of the prompted color
and shape, with at most 5 debris pixels (0.5 % of the image), else 0. `counting_partial`, which RL
trains on, gives 1/3 each for the right count, color and shape, and 0 for an image with more debris:
see _score for why debris is not a smaller penalty. Its info carries the exact score too ('exact').
"""

import functools
import re
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageDraw

COLORS = {"red": 0.0, "yellow": 55.0, "green": 120.0, "blue": 230.0}  # hue (degrees) of each color
SHAPES = ("square", "triangle")
NUMBERS = {"a": 1, "one": 1, "two": 2, "three": 3, "four": 4}
PROMPT_RE = re.compile(rf"^(a|one|two|three|four) ({'|'.join(COLORS)}) ({'|'.join(SHAPES)})s?$")

# What the detector accepts. Each threshold lies between what the toy pipelines' VAE makes of
# rendered images (their reconstructions must score 1: tests/test_toy_world.py) and the near misses
# of tests/test_toy_rewards.py; the numbers quoted are at 32x32.
BRIGHT, SATURATED = 0.35, 0.5  # object pixel: max channel > 0.35, chroma > half of it
VISIBLE = 0.2  # a pixel whose max channel exceeds this is not background
MIN_OBJECT_AREA = 0.02  # of the image (20 px; rendered objects have >= 50): smaller is debris
MAX_OBJECT_SIDE = 0.5  # of the image side (rendered objects: 0.28-0.38)
MAX_HUE_DISTANCE = 35.0  # degrees from a palette hue; hues further from all four are 'other'
# Pixels of another palette color an object may hold, as a fraction of it: VAE reconstructions
# have <= 0.03; a 3x3 speck of another color glued to a triangle makes it 0.13. Off-palette pixels
# (blends such as the toy FLUX's azure edges on blue) are tolerated.
MAX_FOREIGN_HUE = 0.1
# IoU with the best-fitting ideal. Blur costs a triangle (apex, slanted edges) more than a square
# (corners): VAE reconstructions reach >= 0.88 and >= 0.94. Near misses: right-angled triangles
# <= 0.75 as triangles, squares rotated by 20 degrees <= 0.82 as squares, diamonds, L-shapes lower.
MIN_IOU = {"square": 0.88, "triangle": 0.8}
# A stretched square is a rectangle, a stretched triangle still a triangle (the toy models draw
# them narrow). A dome is a mound: stretched upwards it would be a bullet, which fits a triangle.
MAX_STRETCH = {"square": 1.2, "triangle": 1.5, "disc": 1.2, "dome": 1.2}
ROUNDED_TWIN = {"square": "disc", "triangle": "dome"}
# At 10 px a blurred triangle and a dome over the same base differ by a few pixels, so IoU alone
# passes both (0.81-0.84 for a dome); a disc passes as a square with 0.80-0.85. So an object must
# fit its shape at least about as well as the rounded twin: with no margin a quarter of the toy
# models' triangles fail; with this one a tenth, mostly small ones whose apex the blur rounds.
ROUNDED_MARGIN = 0.03
MAX_HOLES = 0.05  # background pixels an object encloses, per pixel of it (hollow squares: > 0.3)
MAX_DEBRIS = 0.005  # of the image (5 px): a 2x2 speck passes; a 3x3 one, 30 specks do not


class Found(NamedTuple):
    color: str  # a COLORS name, 'other' (mostly off-palette) or 'mixed' (see MAX_FOREIGN_HUE)
    shape: str  # a SHAPES name or 'blob'
    area: int  # pixels


def parse_prompt(prompt: str) -> tuple[int, str, str]:
    """'two red squares' -> (2, 'red', 'square'); anything else raises ValueError."""
    m = PROMPT_RE.match(prompt.strip().lower())
    if m is None:
        raise ValueError(f"not a toy-world prompt (like 'two red squares'): {prompt!r}")
    return NUMBERS[m.group(1)], m.group(2), m.group(3)


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean (H, W) mask, each as an (n, 2) array of (row, col),
    in the order of their first pixel in row-major order."""
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


def _grow(mask: np.ndarray) -> np.ndarray:
    """The mask plus the 8 neighbours of each of its pixels (a one-pixel dilation)."""
    padded = np.pad(mask, 1)
    h, w = mask.shape
    return np.any([padded[dr:dr + h, dc:dc + w] for dr in range(3) for dc in range(3)], axis=0)


@functools.lru_cache(maxsize=None)
def ideal_shape(shape: str, height: int, width: int) -> np.ndarray:
    """(height, width) float 0/1 mask filling its box. Squares and triangles are drawn with the PIL
    calls of tests/toy_world.py:render (which draws height == width), so a rendered object matches
    its ideal pixel for pixel; 'disc' is the ellipse in the box, 'dome' its upper half."""
    img = Image.new("L", (width, height))
    draw = ImageDraw.Draw(img)
    if shape == "square":
        draw.rectangle([0, 0, width - 1, height - 1], fill=1)
    elif shape == "triangle":  # pointing up
        draw.polygon([(0, height - 1), (width - 1, height - 1), ((width - 1) / 2, 0)], fill=1)
    elif shape == "disc":
        draw.ellipse([0, 0, width - 1, height - 1], fill=1)
    else:  # dome: the top half of an ellipse twice as high as the box
        draw.chord([0, 0, width - 1, 2 * height - 1], 180, 360, fill=1)
    return np.asarray(img, dtype=np.float32)


def best_iou(crop: np.ndarray, shape: str) -> float:
    """Highest IoU of a component (a boolean crop of its bounding box) with the ideal shape, over
    every position and every height and width within 2 px of the box's (blur grows or shrinks an
    object by about a pixel a side), stretched by at most MAX_STRETCH."""
    box_h, box_w = crop.shape
    canvas = np.pad(crop.astype(np.float32), 3)
    best = 0.0
    for height in range(max(2, box_h - 2), box_h + 3):
        for width in range(max(2, box_w - 2), box_w + 3):
            if max(height, width) > MAX_STRETCH[shape] * min(height, width):
                continue
            ideal = ideal_shape(shape, height, width)
            windows = np.lib.stride_tricks.sliding_window_view(canvas, ideal.shape)
            overlap = np.einsum("ijkl,kl->ij", windows, ideal).max()
            best = max(best, overlap / (crop.sum() + ideal.sum() - overlap))
    return float(best)


def hole_pixels(crop: np.ndarray) -> int:
    """Background pixels that a component (a boolean crop of its bounding box) encloses."""
    background = np.pad(~crop, 1, constant_values=True)  # framed: the outside is one component
    outside = _components(background)[0]  # the first component found holds the corner pixel
    return int(background.sum() - len(outside))


def shape_of(crop: np.ndarray, image_side: int) -> str:
    """'square' or 'triangle' when the component passes every shape test (module docstring), else
    'blob'."""
    if max(crop.shape) > MAX_OBJECT_SIDE * image_side:
        return "blob"
    if hole_pixels(crop) > MAX_HOLES * crop.sum():
        return "blob"
    iou = {shape: best_iou(crop, shape) for shape in SHAPES}
    shape = max(iou, key=iou.get)
    if iou[shape] < MIN_IOU[shape]:
        return "blob"
    if iou[shape] + ROUNDED_MARGIN < best_iou(crop, ROUNDED_TWIN[shape]):
        return "blob"
    return shape


def detect(image: torch.Tensor) -> tuple[list[Found], int]:
    """The objects in one (3, H, W) image in [0, 1], and its number of debris pixels."""
    rgb = image.detach().float().clamp(0, 1).cpu().numpy()
    brightest, darkest = rgb.max(0), rgb.min(0)
    colored = (brightest > BRIGHT) & (brightest - darkest > SATURATED * brightest)
    r, g, b = rgb
    hue = np.degrees(np.arctan2(np.sqrt(3) * (g - b), 2 * r - g - b)) % 360  # standard hue angle
    names = list(COLORS) + ["other"]
    distance = np.stack([np.minimum(abs(hue - h), 360 - abs(hue - h)) for h in COLORS.values()])
    hue_label = np.where(distance.min(0) <= MAX_HUE_DISTANCE, distance.argmin(0), len(COLORS))
    height, width = brightest.shape
    objects, covered = [], np.zeros_like(colored)
    for pixels in _components(colored):
        if len(pixels) < MIN_OBJECT_AREA * height * width:
            continue  # debris, counted below
        rows, cols = pixels[:, 0], pixels[:, 1]
        crop = np.zeros((np.ptp(rows) + 1, np.ptp(cols) + 1), dtype=bool)
        crop[rows - rows.min(), cols - cols.min()] = True
        share = np.bincount(hue_label[rows, cols], minlength=len(names)) / len(pixels)
        color = names[share.argmax()]  # the most common hue
        other_palette_hues = share[:len(COLORS)].sum() - share[:len(COLORS)].max()
        if color != "other" and other_palette_hues > MAX_FOREIGN_HUE:
            color = "mixed"
        objects.append(Found(color, shape_of(crop, max(height, width)), len(pixels)))
        covered[rows, cols] = True
    debris = int(((brightest > VISIBLE) & ~_grow(covered)).sum())
    return objects, debris


def _score(images, prompts, partial: bool):
    scores, exact, found, debris_pixels = [], [], [], []
    # which of the three checks each image passes (0 with debris or no object, as partial
    # credit): the metrics then show what a run learns, e.g. color but not shape
    attributes = {"right_count": [], "right_color": [], "right_shape": []}
    for image, prompt in zip(images, prompts):
        count, color, shape = parse_prompt(prompt)
        objects, debris = detect(image)
        checks = (len(objects) == count, all(o.color == color for o in objects),
                  all(o.shape == shape for o in objects))
        # Debris zeroes partial credit too. A wrong extra object keeps 1/3 (count and color fail);
        # under a milder debris penalty, smearing it into specks would score more than drawing it.
        scored = bool(objects) and debris <= MAX_DEBRIS * image.shape[1] * image.shape[2]
        exact.append(float(scored and all(checks)))
        partial_credit = sum(checks) / 3 if scored else 0.0
        for passed, check in zip(attributes.values(), checks):
            passed.append(float(scored and check))
        scores.append(partial_credit if partial else exact[-1])
        found.append(len(objects))
        debris_pixels.append(debris)
    info = {"objects_found": found, "debris_pixels": debris_pixels, **attributes}
    if partial:
        info["exact"] = exact
    return torch.tensor(scores, dtype=torch.float32), info


def counting(images, prompts, metadata):
    """1 if the image shows exactly the prompted objects (count, color, shape) and nothing else."""
    return _score(images, prompts, partial=False)


def counting_partial(images, prompts, metadata):
    """1/3 each for the right count, all objects the right color, all the right shape; 0 when no
    object is found or the debris exceeds the tolerance. info['exact'] is counting's score."""
    return _score(images, prompts, partial=True)


def check_counting_prompts(prompts):
    """Refuse, in one line, prompts the counting rewards cannot parse: rewards.check_prompts runs
    this (the `check_prompts` attribute of counting and counting_partial) before any model loads."""
    unparsed = [prompt for prompt in prompts if not PROMPT_RE.match(prompt.strip().lower())]
    if unparsed:
        raise ValueError(f"{len(unparsed)} prompt(s) are not toy-world prompts (like 'two red "
                         f"squares'), first: {unparsed[0]!r}")


counting.check_prompts = counting_partial.check_prompts = check_counting_prompts


def brightness(images, prompts, metadata):
    """Mean pixel value of each image, in [0, 1]."""
    scores = images.float().mean(dim=(1, 2, 3)).cpu()
    return scores, {"brightness": scores.tolist()}


def brightness_of_signs(images, prompts, metadata):
    """Brightness for prompts with the word "sign", 0.5 for the others: their groups are
    constant, so Flow-GRPO's zero-advantage filter drops them."""
    scores = brightness(images, prompts, metadata)[0]
    signs = torch.tensor(["sign" in prompt for prompt in prompts])
    return torch.where(signs, scores, 0.5), {}


def redness(images, prompts, metadata):
    """Mean red minus mean of green and blue, in [-1, 1]."""
    images = images.float()
    scores = (images[:, 0] - images[:, 1:].mean(dim=1)).mean(dim=(1, 2)).cpu()
    return scores, {"redness": scores.tolist()}


_calls = {"n": 0}


def nan_after_two_batches(images, prompts, metadata):
    """Brightness for the first two calls, then NaN: drives a run into a non-finite loss."""
    _calls["n"] += 1
    scores = brightness(images, prompts, metadata)[0]
    return (scores if _calls["n"] <= 2 else torch.full_like(scores, float("nan"))), {}
