"""Run a training script with a fault injected, deterministically (tests/test_faults.py):

    python tests/faults.py SCRIPT [flags...]

with the fault in environment variables:
    FAULT_TIME=T          time.time() returns T (two runs start in the same second)
    FAULT_FULL_DISK=NAME  writing a file whose name ends with NAME raises ENOSPC
    FAULT_LORA_LOADS=FILE every folder a pipeline's load_lora_weights reads is appended to FILE
                          (the load itself goes on as usual)
    FAULT_KILL_ON_LORA_LOAD=1  the process kills itself (SIGKILL) when a pipeline's
                          load_lora_weights is called: a preemption during the final eval, which
                          loads the last checkpoint's saved LoRA after that checkpoint is written
    FAULT_OFF_POLICY=C    every step the training re-scores (sde.sde_step given the rollout's
                          draw as prev_sample) gets C added to its log-prob: the ratio to the
                          rollout's is exp(C) for every sample, as if it ran other weights
    FAULT_OFF_POLICY_AFTER=N   with FAULT_OFF_POLICY: the first N re-scores are left as they
                          are (a half-done change: the epoch's first micro-step is on-policy)
    FAULT_HUB=FILE        the Hub answers whoami as user "tester", and create_repo and
                          upload_folder append their arguments to FILE as JSON lines instead
                          of sending anything
"""

import builtins
import errno
import json
import os
import runpy
import signal
import sys
from unittest import mock

patches = []
if "FAULT_TIME" in os.environ:
    patches.append(mock.patch("time.time", return_value=float(os.environ["FAULT_TIME"])))
if "FAULT_FULL_DISK" in os.environ:
    real_open = builtins.open

    def full_open(path, mode="r", *args, **kwargs):
        if str(path).endswith(os.environ["FAULT_FULL_DISK"]) and mode[0] in "wa":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *args, **kwargs)

    patches.append(mock.patch("builtins.open", full_open))
if "FAULT_LORA_LOADS" in os.environ or "FAULT_KILL_ON_LORA_LOAD" in os.environ:
    from diffusers.loaders import FluxLoraLoaderMixin, SD3LoraLoaderMixin

    def recording(load):
        def load_lora_weights(self, folder, *args, **kwargs):
            if "FAULT_KILL_ON_LORA_LOAD" in os.environ:
                os.kill(os.getpid(), signal.SIGKILL)
            with open(os.environ["FAULT_LORA_LOADS"], "a") as file:
                file.write(f"{folder}\n")
            return load(self, folder, *args, **kwargs)
        return load_lora_weights

    for mixin in (SD3LoraLoaderMixin, FluxLoraLoaderMixin):
        patches.append(mock.patch.object(mixin, "load_lora_weights",
                                         recording(mixin.load_lora_weights)))
if "FAULT_HUB" in os.environ:
    import huggingface_hub

    def recorder(name):
        def record(self, *args, **kwargs):
            with open(os.environ["FAULT_HUB"], "a") as file:
                file.write(json.dumps({"call": name, "args": args, **kwargs}) + "\n")
        return record

    patches.append(mock.patch("huggingface_hub.whoami", return_value={"name": "tester"}))
    for name in ("create_repo", "upload_folder"):
        patches.append(mock.patch.object(huggingface_hub.HfApi, name, recorder(name)))
if "FAULT_OFF_POLICY" in os.environ:  # before the script imports sde_step from sde.py
    import sde

    def off_policy(step):
        rescored = []  # one entry per re-score so far

        def sde_step(*args, prev_sample=None, **kwargs):
            out = step(*args, prev_sample=prev_sample, **kwargs)
            if prev_sample is None:  # a rollout's step: as it is
                return out
            rescored.append(1)
            if len(rescored) <= int(os.environ.get("FAULT_OFF_POLICY_AFTER", 0)):
                return out
            shift = float(os.environ["FAULT_OFF_POLICY"])
            return out[0], out[1] + shift, *out[2:]
        return sde_step

    patches.append(mock.patch.object(sde, "sde_step", off_policy(sde.sde_step)))
for patch in patches:
    patch.start()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
