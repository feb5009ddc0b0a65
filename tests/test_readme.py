"""README.md's demo block (each script's docstring points to it): every command is accepted
up to the model load (the learning tests run the same recipes to completion)."""

import re
import shlex

import pytest

from scripts_harness import REPO, ModelLoaded, assert_bad_input

SCRIPTS = ["grpo_sd35.py", "nft_sd35.py", "awm_sd35.py", "crd_sd35.py", "dance_grpo_flux.py"]


def commands(text: str) -> list[list[str]]:
    """`python X.py ...` commands in a text, backslash continuations joined, as argv lists."""
    joined = re.sub(r"\\\n\s*", " ", text)
    argvs = []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("python ") and ".py" in line and not line.startswith("python tests/"):
            argvs.append(shlex.split(line)[1:])
    return argvs


def readme_demos() -> dict[str, list[str]]:
    """{script: its flags} of the bash block after "CPU demo" in README.md."""
    text = (REPO / "README.md").read_text()
    block = text.split("CPU demo", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return {argv[0]: argv[1:] for argv in commands(block)}


def test_readme_has_one_demo_per_script():
    assert sorted(readme_demos()) == sorted(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_readme_demo_is_accepted_and_the_docstring_points_to_it(script, tmp_path):
    doc = (REPO / script).read_text().split('"""')[1]
    assert 'CPU demo on the toy world (a few minutes): README.md, "Running a script".' in doc
    flags = readme_demos()[script]
    assert "tests/assets/toy-" in " ".join(flags)  # the toy world, not random weights
    flags = flags + ["--output-dir", str(tmp_path / "out")]  # the last --output-dir wins
    with pytest.raises(ModelLoaded):  # every flag is valid: the script gets as far as loading
        assert_bad_input(script, flags, "never reached")
