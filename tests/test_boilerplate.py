"""The SD3.5 scripts share their boilerplate verbatim (copy, don't abstract), so that
`diff grpo_sd35.py nft_sd35.py` shows only the algorithm. grpo_sd35.py is the template; the
budgets that keep every script readable in one sitting."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # all of this file: `pytest -m quick`

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "grpo_sd35.py"
SD35_SCRIPTS = ["grpo_sd35.py", "nft_sd35.py", "awm_sd35.py", "crd_sd35.py"]
SCRIPTS = SD35_SCRIPTS + ["dance_grpo_flux.py"]
SHARED = ["Text", "fail", "check_ranges", "check_args", "load_prompts", "all_gather_cat",
          "seeded_generator", "encode", "predict_velocity", "ode_sample", "decode",
          "optimizer_step", "save_checkpoint", "swapped", "adapters_disabled", "prepare_run_dir",
          "rank_mean", "clock", "check_finite", "write_card", "stop", "log", "run_eval"]
# Functions and classes that dance_grpo_flux.py defines for FLUX in its own way; every other
# top-level name two scripts share is one verbatim copy.
# (Text: FLUX's are T5 tokens and a pooled CLIP-L; swapped: FSDP2 reads its own shards, so
# dance copies in place where the LoRA scripts swap storage.)
# (run_eval: FLUX's drift, decode and full fine-tuning; main: its own blocks.)
FLUX_OWN = {"Args", "check_args", "encode", "predict_velocity", "decode",
            "save_checkpoint", "optimizer_step", "rollout", "grpo_loss", "Rollout",
            "LORA_TARGETS", "Text", "swapped", "TOY", "run_eval", "compute_advantages", "main"}
# ALGO LOGIC names that differ between SD3.5 scripts by design (TOY: each its demo's flags;
# compute_advantages: each algorithm's own; main: the loop, its ALGO LOGIC blocks among the rest)
ALGO_OWN = {"Args", "rollout", "Rollout", "TOY", "compute_advantages", "main"}
SHARED_TAG, ALGO_TAG = "# TRY NOT TO MODIFY:", "# ALGO LOGIC:"
SHARED_ARGS = "    # Shared arguments"


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
    """Every top-level function, class and constant: {name: its source}."""
    tree = ast.parse(text)
    named = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            named[node.name] = ast.get_source_segment(text, node)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            named[node.targets[0].id] = ast.get_source_segment(text, node)
    return named


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
    """Args' shared fields: from `# Shared arguments` (after the algorithm's and the recipe's
    own) to the end of the class."""
    start = text.index(SHARED_ARGS, text.index("class Args:"))
    return text[start : text.index("\n\n\n", start)]


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


def imported_names(text: str) -> set[str]:
    """The names a module's top-level imports bind (`import a.b` binds a)."""
    names = set()
    for node in ast.parse(text).body:
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_what_the_shared_blocks_use_is_imported(script):
    """A copied block needs its imports copied too: every name the template imports that a
    script's shared segments use is imported by that script (a missing `import
    huggingface_hub` once broke --push-to-hub in three scripts while their blocks matched)."""
    text = read_tagged(script)
    shared = "\n".join(shared_segments(text))
    used = {name for name in imported_names(read(TEMPLATE))
            if re.search(rf"(?<![.\w]){name}\b", shared)}
    missing = sorted(used - imported_names(text))
    assert not missing, f"{script} uses {missing} in its shared blocks without importing them"


@pytest.mark.parametrize("script", SD35_SCRIPTS[1:])
def test_generic_args_are_verbatim_copies_of_the_template(script):
    other = generic_args(read_tagged(script))
    assert other == generic_args(read(TEMPLATE)), f"{script}: generic Args differ"


@pytest.mark.parametrize("first,second", [(a, b) for i, a in enumerate(SCRIPTS)
                                          for b in SCRIPTS[i + 1:]])
def test_a_name_two_scripts_define_is_one_copy(first, second):
    """The copies the segments do not cover: a helper or constant of the same name in two
    scripts (an ALGO LOGIC sampler, dance's model-independent helpers) is the same code."""
    own = FLUX_OWN if "dance_grpo_flux.py" in (first, second) else ALGO_OWN
    one, other = functions(read(first)), functions(read(second))
    for name in sorted(set(one) & set(other) - own):
        assert one[name] == other[name], f"{name} differs between {first} and {second}"


def test_the_template_tags_its_segments():
    """The reading order: Args (the algorithm's flags first), ALGO LOGIC (sampler, advantages,
    loss), main() with the loop in the file's first half, then the shared helpers, last, in
    one block."""
    text = read(TEMPLATE)
    segments = shared_segments(text)
    assert len(segments) >= 6 and SHARED_ARGS in text
    helpers = segments[-1]
    assert helpers.startswith("# TRY NOT TO MODIFY: the shared helpers")
    assert all(f"\ndef {name}(" in helpers or f"class {name}(" in helpers for name in SHARED)
    lines = text.splitlines()
    loop = next(i for i, line in enumerate(lines) if line.startswith("    for epoch in range("))
    assert loop < len(lines) / 2, f"the epoch loop starts at line {loop + 1} of {len(lines)}"
    order = [text.index(mark) for mark in ["class Args:", "def compute_advantages(",
                                            "def main():", "# TRY NOT TO MODIFY: the shared"]]
    assert order == sorted(order)


def algo_segments(text: str) -> list[str]:
    """Each `# ALGO LOGIC:` segment, up to the next tag of either kind."""
    flipped = text.replace(SHARED_TAG, "# SWAP:").replace(ALGO_TAG, SHARED_TAG)
    return [segment.replace(SHARED_TAG, ALGO_TAG, 1)
            for segment in shared_segments(flipped.replace("# SWAP:", ALGO_TAG))]


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_shared_block_names_what_it_reads_of_algo_logic(script):
    """A shared block's tag ends `reads a, b`: names an ALGO LOGIC block sets and this block
    reads (a researcher who rewrites an ALGO block knows what to keep). Every name an ALGO
    block sets that a later shared block of main() reads is named there."""
    text = read(script)
    algo = "\n".join(algo_segments(text))
    named = {}
    for segment in shared_segments(text):
        tag = segment.splitlines()[0]
        names = tag.split("; reads ", 1)[1].split(", ") if "; reads " in tag else []
        for name in names:
            assert re.search(rf"\b{name}\b.*=|\bfor .*\b{name}\b", algo), f"{name} is not set"
            body = segment.split("\n", 1)[1]
            assert re.search(rf"\b{name}\b", body), f"{tag}: {name} is not read there"
            named[name] = tag
    want = {"eval_sigmas", "group_ids", "futures", "grad_norm", "summary"}
    want |= {"snapshots"} if script in SD35_SCRIPTS else set()
    assert set(named) == want, named


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_fits_its_budget(script):
    """<= 1,100 lines with PEP 8's two blank lines between top-level definitions, a mean <= 55
    characters per non-blank line: clarity, not packing."""
    lines = read(script).splitlines()
    filled = [line for line in lines if line.strip()]
    assert len(lines) <= 1100, f"{script}: {len(lines)} lines"
    mean = sum(map(len, filled)) / len(filled)
    assert mean <= 55, f"{script}: {mean:.2f} characters per non-blank line"


@pytest.mark.parametrize("script", SCRIPTS)
def test_top_level_definitions_stand_between_two_blank_lines(script):
    """PEP 8: two blank lines before each top-level function or class (before its decorators
    and the comment lines that introduce it), so the line budget is not met by packing."""
    text = read(script)
    lines = text.splitlines()
    packed = []
    for node in ast.parse(text).body[1:]:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            while lines[first - 1].startswith("#"):  # its introducing comment
                first -= 1
            if lines[first - 2 : first] != ["", ""]:
                packed.append(f"{node.name} (line {node.lineno})")
    assert not packed, f"{script}: no two blank lines before " + ", ".join(packed)


@pytest.mark.parametrize("module,cap", [("sde.py", 280), ("rewards.py", 600)])
def test_shared_modules_fit_their_budget(module, cap):
    assert len(read(module).splitlines()) <= cap


@pytest.mark.parametrize("script", SCRIPTS)
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
