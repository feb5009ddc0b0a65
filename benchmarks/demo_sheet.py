"""README's before/after picture: run README's CPU demo and set its first and last eval contact
sheets side by side.

The demo's command is read from README.md (the bash block after "CPU demo", as
tests/test_readme.py reads it), run once into a temporary output directory, and its
eval_00000.png (before training) and last eval sheet (after) are scaled up, labelled with the
held-out scores the run logged (eval/reward_mean, eval/final_reward_mean) and saved as one
small PNG. Each sheet is a grid: a row per distinct test prompt, its first samples left to
right.

    OMP_NUM_THREADS=1 python benchmarks/demo_sheet.py   # a few minutes on one CPU core
    python benchmarks/demo_sheet.py --out docs/images/crd_demo_sheet.png --scale 2
"""

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro
from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Args:
    out: str = "docs/images/crd_demo_sheet.png"
    """where the picture goes (relative to the repository)"""
    scale: int = 2
    """each eval sheet is scaled up this many times (nearest neighbour: the pixels stay sharp)"""


def readme_demo() -> list[str]:
    """argv (script and flags) of the `OMP_NUM_THREADS=1 python X.py --toy` command in README's
    CPU demo: the ```bash block right after a paragraph that says "CPU demo" (as
    tests/test_readme.py finds it); the variables set before `python` are left out."""
    parts = (REPO / "README.md").read_text().split("```")  # prose, code, prose, code, ...
    blocks = [parts[i][len("bash"):] for i in range(1, len(parts), 2) if parts[i].startswith(
        "bash\n") and "CPU demo" in parts[i - 1].rstrip().split("\n\n")[-1]]
    commands = []
    for block in blocks:
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            argv = shlex.split(line)
            while argv and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # OMP_NUM_THREADS=1
                argv = argv[1:]
            if argv[:1] == ["python"]:
                commands.append(argv[1:])
    assert len(commands) == 1, commands
    return commands[0]


def demo_test_prompts(argv: list[str]) -> str:
    """The demo's --test-prompts as the script's main parses its flags (with --toy, TOY's flags
    are the defaults and those given win)."""
    sys.path.insert(0, str(REPO))
    module = importlib.import_module(argv[0][: -len(".py")])
    args = tyro.cli(module.Args, args=argv[1:])
    if args.toy:
        args = tyro.cli(module.Args, args=argv[1:], default=module.Args(**module.TOY, toy=True))
    return args.test_prompts


def run_demo(argv: list[str], out: Path) -> Path:
    """Run the demo (its output streams through) and return its run directory."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    print(" ".join(["python"] + argv + ["--output-dir", str(out)]), flush=True)
    subprocess.run([sys.executable] + argv + ["--output-dir", str(out)], cwd=REPO, env=env,
                   check=True)
    (run_dir,) = [path for path in out.iterdir() if path.is_dir()]
    return run_dir


def panel(sheet: Path, title: str, scale: int, font) -> Image.Image:
    """One eval sheet, scaled up, with a title above it."""
    image = Image.open(sheet).convert("RGB")
    image = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
    height = font.size + 10
    canvas = Image.new("RGB", (image.width, image.height + height), "white")
    canvas.paste(image, (0, height))
    ImageDraw.Draw(canvas).text((2, 3), title, fill="black", font=font)
    return canvas


def main(args: Args):
    argv = readme_demo()
    script, test_file = argv[0], REPO / demo_test_prompts(argv)
    samples = sum(1 for line in test_file.open() if line.strip())
    with tempfile.TemporaryDirectory(prefix="demo-sheet-") as tmp:
        run_dir = run_demo(argv, Path(tmp))
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        before = lines[0]["eval/reward_mean"]  # epoch 0's eval: the base model
        after = lines[-1]["eval/final_reward_mean"]  # after the last epoch
        sheets = sorted(run_dir.glob("eval_*.png"))
        epochs = int(sheets[-1].stem.split("_")[1])
        font = ImageFont.load_default(size=14)
        panels = [panel(sheets[0], f"before: {before:.3f}", args.scale, font),
                  panel(sheets[-1], f"after {epochs} epochs: {after:.3f}", args.scale, font)]
        caption = f"{script}: held-out exact accuracy, {samples} samples"
        gap, bottom = 12, font.size + 10
        width = sum(p.width for p in panels) + gap
        picture = Image.new("RGB", (width, panels[0].height + bottom), "white")
        for i, part in enumerate(panels):
            picture.paste(part, (i * (part.width + gap), 0))
        ImageDraw.Draw(picture).text((2, panels[0].height + 4), caption, fill="black",
                                     font=font)
        path = REPO / args.out
        path.parent.mkdir(parents=True, exist_ok=True)
        picture.quantize(colors=256).save(path, optimize=True)
    print(f"before {before:.4f}, after {after:.4f}: {path.relative_to(REPO)} "
          f"({path.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main(tyro.cli(Args))
