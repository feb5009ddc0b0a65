"""Rewards a tiny random model can actually move, for learning tests and the toy benchmark.

Used as `--reward tests/toy_rewards.py:brightness`: a plain function with the rewards.py contract
fn(images (B, 3, H, W) in [0, 1], prompts, metadata) -> (scores (B,) float32 CPU, info dict).
"""

import torch


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
