"""Two nodes on one machine: two `torchrun --nnodes 2` launchers, one process each, meeting at a
c10d rendezvous on 127.0.0.1. Only global rank 0 writes, and the run equals the one-node
two-process run (the same ranks do the same work; gloo sums in the same order)."""

import socket
import subprocess
import sys

import torch

from scripts_harness import REPO, lora_tensors, read_metrics, run_script, script_env
from scripts_harness import tiny_sd35_flags


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_write_once_and_match_one_node(tiny_sd3, tmp_path):
    extra = ["--epochs", "2", "--batch-size", "2"]
    one_node = run_script("grpo_sd35.py", tiny_sd35_flags(tiny_sd3, tmp_path / "one") + extra,
                          nproc=2)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "flowrl",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "grpo_sd35.py"]
    command = launcher + tiny_sd35_flags(tiny_sd3, tmp_path / "two") + extra
    nodes = [subprocess.Popen(command, cwd=REPO, env=script_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-4000:]
    runs = [path for path in (tmp_path / "two").iterdir()]
    assert len(runs) == 1, runs  # one run directory: only global rank 0 writes
    printed = [stdout for stdout, _ in outputs if "images/epoch" in stdout]
    assert len(printed) == 1 and "2 process(es) x 2 micro-batches x 2" in printed[0]
    for one, two in zip(read_metrics(one_node), read_metrics(runs[0]), strict=True):
        same = {name: value for name, value in one.items() if not name.startswith("perf/")}
        assert same == {name: two[name] for name in same}
    checkpoint = "checkpoints/epoch_00002"
    for one, two in zip(lora_tensors(one_node / checkpoint), lora_tensors(runs[0] / checkpoint)):
        assert torch.equal(one, two)
