"""Runs that survive the cluster, on one machine.

Two nodes: two `torchrun --nnodes 2` launchers, one process each, meeting at a c10d rendezvous on
127.0.0.1. Only global rank 0 writes, and the run equals the one-node two-process run (the same
ranks do the same work; gloo sums in the same order).

A crashed rank: `torchrun --max-restarts 1 ... --resume latest` restarts the workers after one is
killed mid-run, and they continue from the newest checkpoint to the uninterrupted run's result."""

import os
import signal
import socket
import subprocess
import sys
import time

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


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of a torchrun launcher's worker processes (its children)."""
    workers = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as file:
                parent = int(file.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as file:
                items = file.read().split(b"\0")
            environ = dict(item.split(b"=", 1) for item in items if b"=" in item)
        except (OSError, ValueError):
            continue  # exited meanwhile
        if parent == launcher_pid and b"LOCAL_RANK" in environ:
            workers[int(environ[b"LOCAL_RANK"])] = int(pid)
    return workers


def test_rank_killed_mid_run_restarts_and_continues_exactly(tiny_sd3, tmp_path):
    """torchrun --max-restarts 1 with --resume latest: rank 1 is killed (SIGKILL, no cleanup)
    once the first checkpoint exists; the restarted workers continue from the newest one, in the
    same run directory, to the same LoRA and metrics as an uninterrupted run."""
    extra = ["--epochs", "4", "--batch-size", "2", "--resume", "latest"]
    uninterrupted = run_script("grpo_sd35.py",
                               tiny_sd35_flags(tiny_sd3, tmp_path / "once") + extra, nproc=2)
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", "--max-restarts", "1", "grpo_sd35.py"]
    # As README says: without it the restarted group can read the crashed one's gloo/nccl
    # addresses from the launcher's shared store (pytorch/pytorch#135712; 4 of 6 runs failed).
    env = {**script_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    launcher = subprocess.Popen(command + tiny_sd35_flags(tiny_sd3, out) + extra, cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    deadline, killed = time.monotonic() + 300, None
    while killed is None and launcher.poll() is None and time.monotonic() < deadline:
        saved = list(out.glob("*/checkpoints/epoch_*"))
        workers = worker_pids(launcher.pid)
        if saved and 1 in workers:
            assert not list(out.glob("*/checkpoints/epoch_00004")), "killed too late"
            os.kill(workers[1], signal.SIGKILL)
            killed = workers[1]
        time.sleep(0.02)
    _, stderr = launcher.communicate(timeout=600)
    assert killed is not None, stderr[-4000:]
    assert launcher.returncode == 0, stderr[-4000:]
    assert "exitcode: -9" in stderr  # the launcher saw the kill, then restarted the group
    runs = list(out.iterdir())
    assert len(runs) == 1, runs  # the restart continued the run directory it crashed in
    once, restarted = read_metrics(uninterrupted), read_metrics(runs[0])
    assert [m["epoch"] for m in restarted] == [0, 1, 2, 3]  # redone epochs are not duplicated
    for one, two in zip(once, restarted, strict=True):
        same = {name: value for name, value in one.items() if not name.startswith("perf/")}
        assert same == {name: two[name] for name in same}
    checkpoint = "checkpoints/epoch_00004"
    for one, two in zip(lora_tensors(uninterrupted / checkpoint),
                        lora_tensors(runs[0] / checkpoint), strict=True):
        assert torch.equal(one, two)
