"""--track: every metrics.jsonl line reaches wandb at its epoch's step, the final eval included,
and the wandb files land in the run directory. The offline run is read back from its .wandb
file (a leveldb-style log of protobuf records, the format `wandb sync` uploads)."""

import json
import math
import struct

import pytest

from scripts_harness import read_metrics, run_script, tiny_sd35_flags

SCRIPTS = ["grpo_sd35.py", "dance_grpo_flux.py"]  # the SD3.5 scripts share grpo's code verbatim


def wandb_records(path) -> list[bytes]:
    """The records of a .wandb file: a 7-byte header, then 32 KiB blocks of chunks (crc32,
    length, type: 1 a whole record, 2/3/4 its first/middle/last part)."""
    raw, position, records, partial = path.read_bytes(), 7, [], b""
    while position + 7 <= len(raw):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a chunk header
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        partial += raw[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            records.append(partial)
            partial = b""
    return records


def wandb_history(run_dir) -> dict[int, dict]:
    """step -> the values logged at that step, from the offline run in run_dir/wandb."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = {}
    for data in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
    return history


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_metrics_line_reaches_wandb_at_its_step(script, tiny_sd3, tiny_flux, tmp_path):
    if script == "grpo_sd35.py":
        flags = tiny_sd35_flags(tiny_sd3, tmp_path) + ["--epochs", "2"]
    else:
        from test_dance_grpo_flux import tiny_flux_flags
        flags = tiny_flux_flags(tiny_flux, tmp_path) + ["--epochs", "2"]
    process = run_script(script, flags + ["--track"], check=False,
                         env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert process.returncode == 0, process.stderr[-4000:]
    (run_dir,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    history = wandb_history(run_dir)
    lines = read_metrics(run_dir)
    assert sorted(history) == [line["epoch"] for line in lines] == [0, 1]
    for line in lines:
        logged = history[line["epoch"]]
        for name, value in line.items():
            if name == "epoch":
                continue
            if name.endswith("sheet"):  # a path in metrics.jsonl, an image in wandb
                assert logged[f"{name}/_type"] == "image-file", name
            else:
                assert math.isclose(logged[name], value, rel_tol=1e-9), (name, value)
    assert "eval/final_reward_mean" in history[1] and "eval/final_sheet/path" in history[1]
    # the last epoch's line is printed before the final eval's
    printed = process.stdout.splitlines()
    epoch_line = [i for i, text in enumerate(printed) if text.startswith("epoch 1:")]
    final_eval = [i for i, text in enumerate(printed) if text.startswith("eval after 2")]
    assert epoch_line and final_eval and epoch_line[0] < final_eval[0], printed
