"""The toy world's counting reward (tests/toy_rewards.py): rendered ground truth scores 1, and each
near miss that fooled its fill-ratio predecessor (issue 26) scores 0, at every rendered size."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from toy_rewards import (MAX_DEBRIS, MIN_IOU, SHAPES, Found, best_iou, counting, counting_partial,
                         detect, hole_pixels, parse_prompt)
from toy_world import ASSETS, RGB, render

SIDES = range(9, 13)  # every object side the renderer draws at 32x32


def batch(*images: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 images -> (B, 3, H, W) floats in [0, 1], as the scripts pass them."""
    return torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1) for im in images]) / 255


def exact(image: np.ndarray, prompt: str) -> float:
    return counting(batch(image), [prompt], None)[0].item()


def partial(image: np.ndarray, prompt: str) -> float:
    return counting_partial(batch(image), [prompt], None)[0].item()


def paint(image: np.ndarray, mask: np.ndarray, color, row: int, col: int) -> np.ndarray:
    """A copy of the image with the mask's pixels at (row, col) set to a color name or RGB."""
    out = image.copy()
    h, w = mask.shape
    out[row:row + h, col:col + w][mask] = RGB.get(color, color)
    return out


def black(size: int = 32) -> np.ndarray:
    return np.zeros((size, size, 3), np.uint8)


def free_pixels(image: np.ndarray, margin: int = 2) -> np.ndarray:
    """(n, 2) (row, col) of the black pixels with nothing lit within `margin` pixels."""
    lit = np.pad(image.max(-1) > 0, margin)
    h, w = image.shape[:2]
    near = np.any([lit[r:r + h, c:c + w] for r in range(2 * margin + 1)
                   for c in range(2 * margin + 1)], axis=0)
    return np.argwhere(~near)


def free_spot(image: np.ndarray, size: int) -> tuple[int, int]:
    """Top-left corner of a size x size patch at least 2 px from everything lit."""
    free = np.zeros(image.shape[:2], bool)
    free[tuple(free_pixels(image).T)] = True
    for r, c in np.argwhere(free):
        if free[r:r + size, c:c + size].sum() == size * size:
            return int(r), int(c)
    raise AssertionError("no free spot")


# ---- near misses, each filling a side x side box (drawn without the detector's ideals) ----
def grid(side: int):
    return (np.mgrid[0:side, 0:side] + 0.5) / side  # pixel centres, in units of the side


def diamond(side):  # a square turned 45 degrees
    y, x = grid(side)
    return abs(x - 0.5) + abs(y - 0.5) <= 0.5


def rotated_square(side, degrees=20):
    y, x = grid(side) - 0.5
    a = np.radians(degrees)
    half = 0.5 / (abs(np.cos(a)) + abs(np.sin(a)))  # the largest such square that fits the box
    u, v = x * np.cos(a) + y * np.sin(a), y * np.cos(a) - x * np.sin(a)
    return np.maximum(abs(u), abs(v)) <= half


def l_shape(side):
    y, x = grid(side)
    return (x < 1 / 3) | (y > 2 / 3)


def hollow_square(side):
    mask = np.ones((side, side), bool)
    mask[2:-2, 2:-2] = False
    return mask


def square_with_hole(side):  # thick walls: it fills its box like a square
    mask = np.ones((side, side), bool)
    hole = side // 3
    mask[hole:2 * hole, hole:2 * hole] = False
    return mask


def hollow_triangle(side):
    img = Image.new("L", (side, side))
    ImageDraw.Draw(img).polygon([(0, side - 1), (side - 1, side - 1), ((side - 1) / 2, 0)],
                                outline=1, width=2)
    return np.asarray(img) > 0


def dome(side):  # a rounded mound: the top half of an ellipse
    y, x = grid(side)
    return ((x - 0.5) / 0.5) ** 2 + (1 - y) ** 2 <= 1


def disc(side):
    y, x = grid(side)
    return (x - 0.5) ** 2 + (y - 0.5) ** 2 <= 0.25


def upside_down_triangle(side):
    y, x = grid(side)
    return abs(x - 0.5) <= (1 - y) / 2


def right_angled_triangle(side):
    y, x = grid(side)
    return x <= y


NEAR_MISSES = [diamond, rotated_square, l_shape, hollow_square, square_with_hole, hollow_triangle,
               dome, disc, upside_down_triangle, right_angled_triangle]


# ---- ground truth ----
def test_parse_prompt():
    assert parse_prompt("two red squares") == (2, "red", "square")
    assert parse_prompt("a blue square") == (1, "blue", "square")
    with pytest.raises(ValueError, match="toy-world prompt"):
        parse_prompt("a sign that says hi")


def test_every_rendered_prompt_scores_one():
    """All prompts of toy_train.txt and toy_test.txt, 20 renders each: exactly the prompted objects,
    no debris, exact and partial credit 1. The renderer keeps objects 3 px apart, so no overlaps."""
    prompts = set()
    for name in ("toy_train.txt", "toy_test.txt"):
        with open(f"{ASSETS}/{name}") as f:
            prompts |= set(f.read().splitlines())
    assert len(prompts) == 24
    for prompt in prompts:
        count, color, shape = parse_prompt(prompt)
        images = batch(*(render(prompt, seed) for seed in range(20)))
        for image in images:
            objects, debris = detect(image)
            assert [(o.color, o.shape) for o in objects] == [(color, shape)] * count, prompt
            assert debris == 0, prompt
        assert counting(images, [prompt] * 20, None)[0].min() == 1.0, prompt
        assert counting_partial(images, [prompt] * 20, None)[0].min() == 1.0, prompt


def test_ideal_shapes_are_the_renderers_pixel_for_pixel():
    """A rendered object fits its ideal with IoU exactly 1 (and the other shape below its bar)."""
    for shape in SHAPES:
        other = SHAPES[1 - SHAPES.index(shape)]
        for seed in range(40):
            crop = render(f"a red {shape}", seed).max(-1) > 0
            rows, cols = np.nonzero(crop)
            crop = crop[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
            assert best_iou(crop, shape) == 1.0
            assert best_iou(crop, other) < MIN_IOU[other]


def test_ground_truth_at_64_pixels_scores_one():
    """Thresholds are fractions of the image, so a 64x64 world scores like the 32x32 one."""
    prompts = ["a red square", "two green triangles", "three blue squares", "three red triangles"]
    images = batch(*(render(p, seed, size=64) for p in prompts for seed in range(2)))
    assert counting(images, [p for p in prompts for _ in range(2)], None)[0].min() == 1.0


def test_blank_gray_and_noise_score_zero():
    prompts = ["a red square", "two green triangles", "three blue squares"]
    noise = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for images in (torch.zeros(3, 3, 32, 32), torch.ones(3, 3, 32, 32),
                   torch.full((3, 3, 32, 32), 0.5), noise):
        assert counting(images, prompts, None)[0].max() == 0.0
        assert counting_partial(images, prompts, None)[0].max() == 0.0


# ---- near misses: shapes ----
@pytest.mark.parametrize("near_miss", NEAR_MISSES, ids=lambda f: f.__name__)
def test_near_miss_shapes_are_blobs(near_miss):
    """Each near miss, at every rendered size and in every color, alone in the image: a 'blob',
    exact credit 0 as a square and as a triangle, partial credit 2/3 (count and color right)."""
    for side in SIDES:
        for color in RGB:
            image = paint(black(), near_miss(side), color, 10, 9)
            objects, debris = detect(batch(image)[0])
            assert [(o.color, o.shape) for o in objects] == [(color, "blob")], side
            assert debris == 0
            for shape in SHAPES:
                assert exact(image, f"a {color} {shape}") == 0.0
                assert partial(image, f"a {color} {shape}") == pytest.approx(2 / 3)


def test_near_miss_beside_correct_objects_fails_exact_credit():
    """Two rendered red triangles plus a red diamond or dome: three objects, one a blob."""
    base = render("two red triangles", 1)
    for near_miss in (diamond, dome, l_shape):
        image = paint(base, near_miss(10), "red", *free_spot(base, 10))
        assert exact(image, "three red triangles") == 0.0
        assert partial(image, "three red triangles") == pytest.approx(2 / 3)  # count, color


def test_hole_pixels():
    ring = np.ones((5, 5), bool)
    ring[1:4, 1:4] = False
    c_shape = ring.copy()
    c_shape[2, 4] = False  # opened: the inside reaches the border
    assert hole_pixels(ring) == 9 and hole_pixels(c_shape) == 0
    assert hole_pixels(np.ones((4, 4), bool)) == 0
    assert hole_pixels(hollow_square(11)) == 49


# ---- near misses: extra objects and debris ----
def test_correct_image_plus_small_extra_object_fails_exact_credit():
    base = render("two red squares", 3)
    assert exact(base, "two red squares") == 1.0
    for side in (3, 4, 5, 6):  # 9 and 16 px are debris, 25 and 36 px a third object
        image = paint(base, np.ones((side, side), bool), "blue", *free_spot(base, side))
        assert exact(image, "two red squares") == 0.0, side
    # glued to an object instead: a 3x3 blue speck on a red triangle's base corner
    base = render("a red triangle", 0)
    rows, cols = np.nonzero(base.max(-1))
    image = paint(base, np.ones((3, 3), bool), "blue", rows.max() - 2, cols.max() + 1)
    assert [o.color for o in detect(batch(image)[0])[0]] == ["mixed"]
    assert exact(image, "a red triangle") == 0.0


def test_scattered_pixels_fail_exact_and_partial_credit():
    """~30 specks of the prompted color (or gray) away from correct objects: debris, score 0."""
    base = render("three green triangles", 2)
    rng = np.random.default_rng(0)
    free = free_pixels(base)
    specks = free[rng.choice(len(free), 30, replace=False)]
    for color in ("green", (150, 150, 150), (0, 90, 0)):  # gray and dim pixels are debris too
        image = base.copy()
        image[specks[:, 0], specks[:, 1]] = RGB.get(color, color)
        assert detect(batch(image)[0])[1] == 30
        assert exact(image, "three green triangles") == 0.0
        assert partial(image, "three green triangles") == 0.0


def test_debris_tolerance_is_a_2x2_speck():
    base = render("a yellow square", 4)
    tolerance = MAX_DEBRIS * 32 * 32
    for side, expected in ((2, 1.0), (3, 0.0)):
        image = paint(base, np.ones((side, side), bool), "yellow", *free_spot(base, side))
        assert detect(batch(image)[0])[1] == side * side
        assert (side * side <= tolerance) == bool(expected)
        assert exact(image, "a yellow square") == expected


def test_lattice_frames_score_zero():
    """Full-frame lattice garbage (what NFT learned to draw): a bright one-pixel grid every 3 px,
    or a blue lattice over dim haze, is a blob or debris -- never 'a blue triangle'."""
    lattice = black()
    lattice[::3, :] = RGB["blue"]
    lattice[:, ::3] = RGB["blue"]
    haze = np.full((32, 32, 3), (20, 30, 70), np.uint8)  # visible, too dim for an object
    haze[8:22:3, 8:22] = RGB["blue"]
    haze[8:22, 8:22:3] = RGB["blue"]
    for image in (lattice, haze):
        assert [o.shape for o in detect(batch(image)[0])[0]] == ["blob"]
        for prompt in ("a blue triangle", "a blue square"):
            assert exact(image, prompt) == 0.0
    assert partial(haze, "a blue triangle") == 0.0  # the haze is debris


# ---- partial credit ----
def test_partial_credit_by_hand():
    """1/3 each for count, color and shape; debris zeroes it."""
    two_red_squares = render("two red squares", 3)
    expected = {"two red squares": 1, "three red squares": 2 / 3, "two blue squares": 2 / 3,
                "two red triangles": 2 / 3, "three blue squares": 1 / 3, "a blue triangle": 0}
    for prompt, score in expected.items():
        assert partial(two_red_squares, prompt) == pytest.approx(score), prompt
        assert exact(two_red_squares, prompt) == float(score == 1), prompt
    red_and_blue = paint(render("a red square", 0), np.ones((10, 10), bool), "blue",
                         *free_spot(render("a red square", 0), 10))
    assert partial(red_and_blue, "two red squares") == pytest.approx(2 / 3)  # color wrong
    assert partial(red_and_blue, "a red square") == pytest.approx(1 / 3)  # count, color wrong
    square_and_diamond = paint(render("a red square", 0), diamond(11), "red",
                               *free_spot(render("a red square", 0), 11))
    assert partial(square_and_diamond, "two red squares") == pytest.approx(2 / 3)  # shape wrong


def test_smearing_a_wrong_object_into_specks_never_pays():
    """The hack partial credit must not reward: a wrong extra object scores 1/3 for 'a red
    square'; the same pixels scattered as specks score 0, not the 1 of a correct image."""
    base = render("a red square", 0)
    wrong = paint(base, np.ones((6, 6), bool), "blue", *free_spot(base, 6))
    free = free_pixels(base)
    specks = base.copy()
    pick = free[np.random.default_rng(1).choice(len(free), 36, replace=False)]
    specks[pick[:, 0], pick[:, 1]] = RGB["blue"]
    scores = [partial(im, "a red square") for im in (base, wrong, specks)]
    assert scores == pytest.approx([1, 1 / 3, 0])


def test_info_reports_exact_score_objects_debris_and_attributes():
    images = batch(render("two red squares", 3), black(), render("a blue square", 1))
    prompts = ["two red squares", "two red squares", "two red squares"]
    scores, info = counting_partial(images, prompts, None)
    assert scores.tolist() == pytest.approx([1, 0, 1 / 3])
    assert info["exact"] == counting(images, prompts, None)[0].tolist() == [1, 0, 0]
    assert info["objects_found"] == [2, 0, 1] and info["debris_pixels"] == [0, 0, 0]
    # 'a blue square' for 'two red squares': only the shape is right
    assert info["right_count"] == info["right_color"] == [1, 0, 0]
    assert info["right_shape"] == [1, 0, 1]
    attribute_mean = [sum(checks) / 3 for checks in
                      zip(info["right_count"], info["right_color"], info["right_shape"])]
    assert attribute_mean == pytest.approx(scores.tolist())
    objects, debris = detect(images[0])
    assert [(o.color, o.shape) for o in objects] == [("red", "square")] * 2 and debris == 0
    assert sum(o.area for o in objects) == (images[0].amax(0) > 0).sum()
    assert all(isinstance(o, Found) for o in objects)
