"""Shared fixtures: tiny random SD3 / FLUX pipelines, built once per session and loaded from
disk like real ones."""

import os
import sys
import tempfile
from pathlib import Path

# Before anything imports huggingface_hub: tests never touch the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Before anything imports torch: one thread in this process too, as in every script it launches.
# The background learning runs keep both cores busy; a second torch thread here only waits for
# a core (the suite took 25 minutes on 2 cores with torch's default, 18.5 with one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# `from tiny import ...` (tests dir) and `import grpo_sd35` etc. (repo root), without a
# tests/__init__.py.
TESTS = Path(__file__).resolve().parent
for folder in (TESTS.parent, TESTS):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import pytest  # noqa: E402

from scripts_harness import (LEARNING_TEST, contract_run, is_flux,  # noqa: E402
                             start_learning_run, stop_learning_runs)
from tiny import build_tiny_flux, build_tiny_sd3  # noqa: E402


SHIPPED = ["grpo_sd35.py", "nft_sd35.py", "awm_sd35.py", "crd_sd35.py", "dance_grpo_flux.py"]


def pytest_addoption(parser):
    parser.addoption("--script", action="append", default=[],
                     help="tests/test_contract.py: hold this script (a copy of a shipped one, "
                          "say) to the contract; repeatable (default: the five shipped)")


def pytest_generate_tests(metafunc):
    """tests/test_contract.py's tests run once for each --script (default: the shipped five)."""
    if "contract_script" in metafunc.fixturenames:
        scripts = metafunc.config.getoption("script") or SHIPPED
        metafunc.parametrize("contract_script", scripts)


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(config, items):
    """Start the selected toy-world learning runs now, in the background
    (scripts_harness.LEARNING_RUNS): they take minutes and overlap the rest of the suite, whose
    tests go first; theirs, which wait for the runs, last."""
    learning = [item for item in items if item.name == LEARNING_TEST]
    items[:] = [item for item in items if item.name != LEARNING_TEST] + learning
    if config.option.collectonly:
        return
    for item in learning:
        module = item.module
        out = Path(tempfile.mkdtemp(prefix=f"learning-{module.SCRIPT[:-3]}-"))
        start_learning_run(module.SCRIPT, module.LEARNING_FLAGS, out)


def pytest_sessionfinish(session):
    stop_learning_runs()  # finished ones are only cleaned up


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory) -> str:
    """Path of a saved tiny StableDiffusion3Pipeline (pass as --model)."""
    return build_tiny_sd3(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> str:
    """Path of a saved tiny FluxPipeline (pass as --model)."""
    return build_tiny_flux(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_run(tiny_sd3, tiny_flux, tmp_path_factory):
    """tiny_run(script, nproc=1): the contract's run of a script (scripts_harness.contract_run),
    made once a session, shared by tests/test_contract.py and the script's own tests."""
    root = tmp_path_factory.mktemp("contract")

    def get(script: str, nproc: int = 1):
        return contract_run(script, tiny_flux if is_flux(script) else tiny_sd3, root, nproc)
    return get
