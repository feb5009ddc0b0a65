"""The SD3.5 scripts share their boilerplate verbatim (copy, don't abstract), so that
`diff grpo_sd35.py nft_sd35.py` shows only the algorithm. grpo_sd35.py is the template."""

import ast
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "grpo_sd35.py"
SD35_SCRIPTS = ["grpo_sd35.py", "nft_sd35.py", "awm_sd35.py", "crd_sd35.py"]
SHARED = ["fail", "check_args", "load_prompts", "all_gather_cat", "seeded_generator", "encode",
          "predict_velocity", "rollout", "decode", "optimizer_step", "save_checkpoint", "swapped",
          "adapters_disabled", "prepare_run_dir", "rank_mean", "clock", "check_finite"]
SHARED_TAG, ALGO_TAG = "# TRY NOT TO MODIFY:", "# ALGO LOGIC:"
ALGO_ARGS = "    # Algorithm-specific arguments"


def read(script: str) -> str:
    path = REPO / script
    if not path.exists():
        pytest.skip(f"{script} not written yet")
    return path.read_text()


def read_tagged(script: str) -> str:
    """The script's text; skipped until it is ported onto the tagged template."""
    text = read(script)
    if SHARED_TAG not in text:
        pytest.skip(f"{script} has no `{SHARED_TAG}` tags yet")
    return text


def functions(text: str) -> dict[str, str]:
    tree = ast.parse(text)
    return {node.name: ast.get_source_segment(text, node) for node in tree.body
            if isinstance(node, ast.FunctionDef)}


def shared_segments(text: str) -> list[str]:
    """Each `# TRY NOT TO MODIFY:` segment: its tag line up to the next tag of either kind."""
    segments, current = [], None
    for line in text.splitlines():
        if line.strip().startswith((SHARED_TAG, ALGO_TAG)):
            if current is not None:
                segments.append("\n".join(current).rstrip())
            current = [] if line.strip().startswith(SHARED_TAG) else None
        if current is not None:
            current.append(line)
    if current is not None:
        segments.append("\n".join(current).rstrip())
    return segments


def generic_args(text: str) -> str:
    """The Args fields before `# Algorithm-specific arguments`."""
    start = text.index("class Args:")
    return text[start : text.index(ALGO_ARGS, start)]


@pytest.mark.parametrize("script", SD35_SCRIPTS[1:])
def test_shared_functions_are_verbatim_copies_of_the_template(script):
    template, other = functions(read(TEMPLATE)), functions(read_tagged(script))
    for name in SHARED:
        assert other.get(name) == template[name], f"{script}: {name}() differs from {TEMPLATE}"


@pytest.mark.parametrize("script", SD35_SCRIPTS[1:])
def test_shared_segments_are_verbatim_copies_of_the_template(script):
    template, other = shared_segments(read(TEMPLATE)), shared_segments(read_tagged(script))
    tags = [segment.splitlines()[0].strip() for segment in template]
    assert len(other) == len(template), f"{script}: {len(other)} shared segments, want {tags}"
    for tag, want, got in zip(tags, template, other):
        assert got == want, f"{script}: the segment `{tag}` differs from {TEMPLATE}'s"


@pytest.mark.parametrize("script", SD35_SCRIPTS[1:])
def test_generic_args_are_verbatim_copies_of_the_template(script):
    other = generic_args(read_tagged(script))
    assert other == generic_args(read(TEMPLATE)), f"{script}: generic Args differ"


def test_the_template_tags_its_segments():
    segments = shared_segments(read(TEMPLATE))
    assert len(segments) >= 6 and ALGO_ARGS in read(TEMPLATE)
    assert all(f"\ndef {name}(" in segments[0] for name in SHARED)  # one block of helpers


@pytest.mark.parametrize("script", SD35_SCRIPTS + ["dance_grpo_flux.py"])
def test_script_fits_800_lines(script):
    assert len(read(script).splitlines()) <= 800


@pytest.mark.parametrize("script", SD35_SCRIPTS + ["dance_grpo_flux.py"])
def test_script_fits_100_columns(script):
    lines = read_tagged(script).splitlines()
    wide = [number for number, line in enumerate(lines, 1) if len(line) > 100]
    assert not wide, f"{script}: lines over 100 columns: {wide}"


def test_every_python_file_fits_100_columns():
    """The ≤ 100 columns rule holds for every tracked .py file: scripts, shared modules, tests,
    benchmarks."""
    try:
        listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.splitlines()
        paths = [REPO / name for name in listed]
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout
        # skip hidden folders: .venv, .git and local scratch copies hold no project files
        paths = [path for path in REPO.rglob("*.py")
                 if not any(part.startswith(".") for part in path.relative_to(REPO).parts)]
    assert paths, "no .py files found"
    wide = []
    for path in sorted(paths):
        if not path.exists():  # deleted in the work tree, not yet in the index
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if len(line) > 100:
                wide.append(f"{path.relative_to(REPO)}:{number} ({len(line)})")
    assert not wide, f"{len(wide)} lines over 100 columns: " + ", ".join(wide)
