"""--tensorboard and --wandb log exactly what log.jsonl logs, across a resume (their offline files read back); a
missing package is one line."""

import json
import struct
import sys
from collections import defaultdict

import numpy as np
import pytest

from conftest import GPT2_VOCAB_RUN, assert_refused, log_records, run_main, tiny_run_args


def tiny(data_dir, out, *extra):
    """A tiny run of GPT-2's vocabulary validated every 2 steps, checkpoints every 4, extra last."""
    sizes = dict(steps=2, val_every=2, ckpt_every=4, **GPT2_VOCAB_RUN)
    return tiny_run_args(data_dir, out, "--val-steps", "2", *extra, **sizes)


SHARDS = dict(n_docs=400, seed=7, max_len=60)


def by_step(records):
    """{step: {key: value}}: one step's records merged, as W&B stores them (less the log's run id)."""
    rows = defaultdict(dict)
    for r in records:
        rows[r["step"]].update({k: v for k, v in r.items() if k not in ("step", "run")})
    return dict(rows)


def wandb_history(run_file):
    """{step: {key: value}} of an offline run's .wandb file: W&B's LevelDB-log framing of
    wandb_internal_pb2.Record protobufs (a 7-byte file header; 32 KiB blocks of chunks, each with
    a 7-byte header: crc32c, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = open(run_file, "rb").read(), 32768
    assert data[:4] == b":W&B"
    pos, pending, rows = 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }  # newer versions fill nested_key only
                rows[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def test_tensorboard_and_wandb_hold_what_log_jsonl_holds(data_dir, tmp_path):
    pytest.importorskip("wandb")
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out, offline = tmp_path / "run", {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    flags = tiny(data_dir, out, "--tensorboard", "--wandb", "tracking-test")
    first = run_main("train_gpt2.py", *flags, "--max-steps", "6", env=offline)  # checkpoints at 4 and 6
    assert first.returncode == 0, first.stderr
    first_log = log_records(out)
    # resume from step 4 (log.jsonl is cut back there) and go on to step 8
    (out / "ckpt_0000006.pt").unlink()
    resumed = run_main("train_gpt2.py", *flags, "--max-steps", "8", "--resume", env=offline)
    assert resumed.returncode == 0, resumed.stderr
    log = log_records(out)
    assert [r["step"] for r in log if "val_loss" in r] == [0, 2, 4, 6, 8]

    # TensorBoard: one scalar series per numeric key, float32 as TensorBoard stores them, the
    # first attempt's steps 4 and later replaced by the resumed run's (strings, such as the
    # {"event": "resume"} record, are text there)
    assert {"event": "resume", "step": 4, "run": first_log[0]["run"]} in log  # the same run, resumed
    expected = defaultdict(list)
    for r in log:
        for key, value in r.items():
            if key != "step" and not isinstance(value, str):  # (the run id is a string too)
                expected[key].append((r["step"], float(np.float32(value))))
    events = event_accumulator.EventAccumulator(str(out), size_guidance={"scalars": 0})  # (restarts purged)
    events.Reload()
    assert {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]} == expected

    # W&B: one run per launch, each holding the log's records from its first step on
    runs = sorted((wandb_history(p) for p in (out / "wandb").glob("offline-run-*/run-*.wandb")), key=min)
    assert runs == [by_step(first_log), by_step(r for r in log if r["step"] >= 4)]


@pytest.mark.parametrize("flags", ["--wandb p", "--tensorboard", "--eval-only --resume --tensorboard"])
def test_tracker_refusals_are_one_line(data_dir, tmp_path, monkeypatch, flags):
    """A tracker whose package is missing (None in sys.modules, the loaded modules set aside); --eval-only's."""
    message = "--eval-only writes nothing, so it does not log to --wandb or --tensorboard either"
    if not flags.startswith("--eval-only"):
        flag = flags.split()[0]
        package = flag.removeprefix("--")
        message = f"{flag} needs the {package} package: pip install {package}"
        for name in [name for name in sys.modules if package in name.split(".")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, package, None)  # its import fails, as when it is not installed
    result = run_main("train_gpt2.py", *tiny(data_dir, tmp_path / "out", *flags.split()))
    assert_refused(result, message)
    assert "| loss " not in result.stdout  # stopped before training
