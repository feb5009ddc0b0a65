"""Run a training script with a fault injected, deterministically (tests/test_faults.py):

    python tests/faults.py SCRIPT [flags...]

with the fault in environment variables:
    FAULT_TIME=T          time.time() returns T (two runs start in the same second)
    FAULT_FULL_DISK=NAME  writing a file whose name ends with NAME raises ENOSPC
    FAULT_HUB=PATH        huggingface_hub.HfApi is a recorder: its calls go to PATH (JSON)
"""

import builtins
import errno
import json
import os
import runpy
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
if "FAULT_HUB" in os.environ:
    calls = []

    class Recorder:
        """The Hub as far as a push goes: who is logged in, the repo, the upload."""

        def whoami(self):
            calls.append(["whoami"])
            return {"name": "someone"}

        def create_repo(self, repo_id, **options):
            calls.append(["create_repo", repo_id, options])
            return mock.Mock(repo_id=f"someone/{repo_id}")

        def upload_folder(self, repo_id, folder_path, **options):
            files = sorted(os.path.relpath(os.path.join(root, name), folder_path)
                           for root, _, names in os.walk(folder_path) for name in names)
            calls.append(["upload_folder", repo_id, folder_path, files])
            with open(os.environ["FAULT_HUB"], "w") as file:
                json.dump(calls, file)

    patches.append(mock.patch("huggingface_hub.HfApi", Recorder))
for patch in patches:
    patch.start()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
