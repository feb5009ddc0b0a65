"""The docs stay true to the scripts: README's CPU demo and each algorithm page's
(`OMP_NUM_THREADS=1 python SCRIPT --toy`) are accepted by their script up to the model load,
each page spells out the flags `--toy` expands to (the script's TOY), the learning tests run the
same recipes to completion, each script's docstring points to its page, and every relative link
and image in the Markdown resolves."""

import contextlib
import importlib
import io
import re
import shlex
from unittest import mock

import pytest

from scripts_harness import REPO, ModelLoaded, assert_bad_input

pytestmark = pytest.mark.quick  # all of this file: `pytest -m quick`

PAGES = {"grpo_sd35.py": "docs/grpo.md", "nft_sd35.py": "docs/nft.md",
         "awm_sd35.py": "docs/awm.md", "crd_sd35.py": "docs/crd.md",
         "dance_grpo_flux.py": "docs/dance_grpo.md"}
README_DEMO = "crd_sd35.py"  # the strongest learner of the five


ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")  # a shell variable set for the command


def command_lines(path: str, marker: str = "CPU demo") -> list[str]:
    """The `[VAR=value ...] python X.py ...` lines of the ```bash block right after a paragraph
    that says `marker` (backslash continuations joined)."""
    parts = (REPO / path).read_text().split("```")  # prose, code, prose, code, ...
    blocks = [parts[i][len("bash"):] for i in range(1, len(parts), 2)
              if parts[i].startswith("bash\n")
              and marker in parts[i - 1].rstrip().split("\n\n")[-1]]  # its last paragraph
    assert len(blocks) == 1, f"{path}: {len(blocks)} {marker!r} blocks"
    lines = re.sub(r"\\\n\s*", " ", blocks[0]).splitlines()
    return [line.strip() for line in lines if without_env(shlex.split(line))[:1] == ["python"]]


def without_env(words: list[str]) -> list[str]:
    """A shell command's words without the variables set before it (`OMP_NUM_THREADS=1`)."""
    while words and ENV_WORD.match(words[0]):
        words = words[1:]
    return words


def demo_commands(path: str, marker: str = "CPU demo") -> list[list[str]]:
    """argv lists (the script and its flags) of the `python X.py ...` commands in a page's CPU
    demo, or in the block after the paragraph that says `marker`."""
    return [without_env(shlex.split(line))[1:] for line in command_lines(path, marker)]


def parsed_as_main(script: str, flags: list[str]) -> dict:
    """vars() of the Args that the script's main makes of `flags`: with --toy, TOY's flags are
    the defaults and those given win; the `toy` field itself left out."""
    import tyro
    module = importlib.import_module(script[: -len(".py")])
    with contextlib.redirect_stderr(io.StringIO()):
        args = tyro.cli(module.Args, args=flags)
        if args.toy:
            args = tyro.cli(module.Args, args=flags, default=module.Args(**module.TOY, toy=True))
    return {key: value for key, value in vars(args).items() if key != "toy"}


def markdown_files() -> list[str]:
    """The documents (docs/model_card.md is the card template: its links are the card's)."""
    docs = [path for path in (REPO / "docs").glob("*.md") if path.name != "model_card.md"]
    return ["README.md", *sorted(str(p.relative_to(REPO)) for p in docs),
            *sorted(str(p.relative_to(REPO)) for p in (REPO / "benchmarks").rglob("*.md"))]


def test_readme_has_one_demo_and_each_page_its_own():
    """Each demo is one short line, `OMP_NUM_THREADS=1 python SCRIPT --toy`: the command that was
    timed (torch's default thread count oversubscribes a shared box several times over)."""
    assert [argv[0] for argv in demo_commands("README.md")] == [README_DEMO]
    for page in ["README.md", "docs/toy_world.md", *PAGES.values()]:
        for line in command_lines(page):
            assert line.startswith("OMP_NUM_THREADS=1 python "), f"{page}: {line}"
            assert shlex.split(line)[3:] == ["--toy"], f"{page}: {line}"
    for script, page in PAGES.items():
        assert [argv[0] for argv in demo_commands(page)] == [script], page
    assert demo_commands("README.md") == demo_commands(PAGES[README_DEMO])  # the same line
    pages = [argv for page in PAGES.values() for argv in demo_commands(page)]
    assert sorted(demo_commands("docs/toy_world.md")) == sorted(pages)  # all five, alike


@pytest.mark.parametrize("page", ["README.md", *PAGES.values()])
def test_demo_is_accepted_up_to_the_model(page, tmp_path):
    ((script, *flags),) = demo_commands(page)
    flags = flags + ["--output-dir", str(tmp_path / "out")]  # the last --output-dir wins
    # every flag is valid: the script gets as far as loading, and loads the toy world's
    # pretrained pipeline, not random weights
    with pytest.raises(ModelLoaded, match="tests/assets/toy-"):
        assert_bad_input(script, flags, "never reached")


@pytest.mark.parametrize("script", PAGES)
def test_toy_expands_to_the_documented_flags(script):
    """The page's "`--toy` expands to" line is the script's TOY, flag for flag (no field but
    `toy` differs), and docs/toy_world.md's expansion block holds the five pages' lines."""
    module = importlib.import_module(script[: -len(".py")])
    ((shown, *flags),) = demo_commands(PAGES[script], "`--toy` expands to")
    assert shown == script and "--toy" not in flags
    toy = {key: value for key, value in vars(module.Args(**module.TOY)).items() if key != "toy"}
    assert parsed_as_main(script, flags) == toy
    assert parsed_as_main(script, ["--toy"]) == toy
    pages = [argv for page in PAGES.values() for argv in demo_commands(page, "`--toy` expands to")]
    assert sorted(demo_commands("docs/toy_world.md", "`--toy` expands to")) == sorted(pages)


@pytest.mark.parametrize("script", PAGES)
def test_docstring_points_to_the_page(script):
    doc = (REPO / script).read_text().split('"""')[1]
    assert f"Docs: {PAGES[script]} (recipes, metrics, the toy-world demo)." in doc


def anchors(path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, - for space."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_relative_links_and_images_resolve():
    broken = []
    for name in markdown_files():
        text = (REPO / name).read_text()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
        targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text,
                                                                     flags=re.M)
        for target in targets:
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            path = (REPO / name).parent / file if file else REPO / name
            if not path.exists() or (anchor and anchor not in anchors(path)):
                broken.append(f"{name}: {target}")
    assert not broken, broken


def test_markdown_lines_fit_120_columns_and_cite_no_machine_paths():
    for name in markdown_files():
        for number, line in enumerate((REPO / name).read_text().splitlines(), 1):
            assert len(line) <= 120, f"{name}:{number} is {len(line)} columns"
            assert not line.endswith("]("), f"{name}:{number}: a link split over lines"
            assert not re.search(r"(?<![\w.])/(work|tmp)/", line), f"{name}:{number}: {line}"
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def launch_lines() -> list[tuple[str, str, list[str]]]:
    """(file, script, flags) of every `python SCRIPT.py ...` or `torchrun ... SCRIPT.py ...`
    line in the Markdown's ```bash blocks (continuations joined), SCRIPT one of the five; lines
    with an elided `...` are left out (their flags are not all there)."""
    found = []
    for name in markdown_files():
        parts = (REPO / name).read_text().split("```")
        for block in (parts[i] for i in range(1, len(parts), 2) if parts[i].startswith("bash\n")):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                words = without_env(shlex.split(line, comments=True))
                scripts = [i for i, word in enumerate(words) if word in PAGES]
                if not words or words[0] not in ("python", "torchrun") or not scripts:
                    continue
                flags = words[scripts[0] + 1:]
                if "..." not in flags and not any("..." in word for word in flags):
                    found.append((name, words[scripts[0]], flags))
    return found


def test_every_launch_line_in_the_docs_names_real_flags():
    """Each documented command line parses with its script's Args: no flag the script lacks
    (a renamed or removed one, or one a page promises before it exists), no bad value type."""
    import tyro
    lines = launch_lines()
    assert len(lines) >= 20, len(lines)
    bad = []
    for name, script, flags in lines:
        module = importlib.import_module(script[: -len(".py")])
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                tyro.cli(module.Args, args=flags)
        except SystemExit:
            bad.append(f"{name}: {script} {' '.join(flags)}")
    assert not bad, "\n".join(bad)


def learning_command(script: str, tmp_path) -> list[str]:
    """The flags the script's learning test launches it with: its LEARNING_FLAGS through
    scripts_harness.start_learning_run (toy_flags + the flags today), the launch recorded, not
    run."""
    import scripts_harness
    tests = importlib.import_module("test_" + script[: -len(".py")])
    with (mock.patch.dict(scripts_harness.LEARNING_RUNS),  # a run this session started stays
          mock.patch.object(scripts_harness.subprocess, "Popen") as popen):
        scripts_harness.start_learning_run(script, tests.LEARNING_FLAGS, tmp_path)
    command = popen.call_args.args[0]
    return command[command.index(script) + 1:]


@pytest.mark.parametrize("script", PAGES)
def test_learning_test_replays_the_demo(script, tmp_path):
    """Each script's learning test trains the recipe its page's CPU demo prints: the same Args
    (both parsed as the script's main does, --toy's TOY included), but for where the run writes,
    how often it evaluates and saves, on which eval noise, in what batches (each sample's noise
    is seeded by its line and eval seed alone), and for how long (a test may stop early: the
    first epochs of a run do not depend on --epochs)."""
    ((_, *demo),) = demo_commands(PAGES[script])
    replay = learning_command(script, tmp_path)
    ignored = {"output_dir", "eval_every", "save_every", "eval_seeds", "eval_batch_size"}
    demo_args, replay_args = [
        {key: value for key, value in parsed_as_main(script, flags).items()
         if key not in ignored} for flags in (demo, replay)]
    model_path = replay_args.pop("model")
    assert model_path.endswith(demo_args.pop("model")), (model_path, demo_args)
    assert replay_args.pop("epochs") <= demo_args.pop("epochs")
    assert demo_args == replay_args


@pytest.mark.parametrize("script,page", PAGES.items())
def test_a_page_names_blocks_its_script_has(script, page):
    """The implementation details point at blocks by their tags (`# ALGO LOGIC: sampling`):
    each tag a page quotes begins a tag line of its script, so a renamed block shows here."""
    tags = [line.strip() for line in (REPO / script).read_text().splitlines()
            if line.strip().startswith(("# ALGO LOGIC:", "# TRY NOT TO MODIFY:"))]
    text = (REPO / page).read_text()
    quoted = [" ".join(ref.split())  # a span may wrap
              for ref in re.findall(r"`(# (?:ALGO LOGIC|TRY NOT TO MODIFY):[^`]*)`", text)]
    assert quoted, f"{page} names no block of {script}"
    missing = sorted({ref for ref in quoted if not any(tag.startswith(ref) for tag in tags)})
    assert not missing, f"{page} names blocks {script} lacks: {missing}"
