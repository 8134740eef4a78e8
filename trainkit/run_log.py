"""log.jsonl, a run's log (RunLog): one JSON record per line, each naming its run; a failed write cut back to
the last whole record; cut back exactly on resume, where read_log_up_to refuses a log that is not the
checkpoint run's; a copy of its own where it was shared. The W&B / TensorBoard trackers that get every
record too are trainkit/run_trackers.py's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat

from trainkit import cli, json_file
from trainkit.resume import ResumePoint, log_summary, run_name
from trainkit.cli import UserError, reason_of
from trainkit.console import print0
from trainkit.own_files import own_file, pinned, shared_as


class RunLog:
    """log.jsonl on rank 0: one JSON object per line, each with the "run" id of the run that wrote
    it. Other ranks write nothing.

    Each record is one write, and a failed write (disk full) is cut back: the file always ends
    with a whole record. A checkpoint stores the log's length and the sha256 of its contents up
    to there (position()); resuming cuts the log back to that point (cut_back(), once a later
    branch has its copy) only when the log here is that run's log (an empty or missing log starts
    afresh), and refuses otherwise."""

    sinks = ()  # run trackers that get every record too (open_sinks)

    def __init__(self, out_dir: str, enabled: bool, resumed: ResumePoint | None = None, run: dict | None = None):
        self.path, self.file, self.run, self.resumed = os.path.join(out_dir, "log.jsonl"), None, run, resumed
        self.last_checkpoint = resumed.path if resumed else None  # named when a write fails
        self.size, self.sha = 0, hashlib.sha256()
        if not enabled:
            return
        if os.path.islink(self.path) and not os.path.exists(self.path):  # open() would create its target
            raise UserError(
                f"cannot open {self.path}: it is a symbolic link to {os.readlink(self.path)}, which "
                "does not exist; remove the link or point it at a file"
            )
        try:
            kept = read_log_up_to(self.path, resumed)
            held = resumed and not shared_as(self.path) and pinned(self.path)  # (a shared log is cut as a copy)
            if held and os.path.getsize(self.path) > len(kept):  # (before anything in the folder changes)
                raise UserError(
                    f"cannot cut {self.path} back to {resumed.path}: it is {held}; clear that attribute, or move "
                    "it aside (the resume then starts a new log.jsonl) (nothing was changed)"
                )
            note = own_file(self.path)  # a log shared with another run folder: this run appends to its own copy
            self.file = open_run_file(self.path, "ab", buffering=0)  # unbuffered: one write per record
        except OSError as e:
            raise UserError(
                f"cannot open {self.path}: {reason_of(e)}; make it a writable file, or choose another --out-dir"
            ) from None
        if note:
            print0(note)
        self.size = len(kept)
        self.sha.update(kept)

    def cut_back(self):
        """Resuming: drop what the run logged after its checkpoint (where it logged any: an append-only log
        that ends there resumes)."""
        if self.file and self.resumed:
            try:
                if os.fstat(self.file.fileno()).st_size > self.size:
                    self.file.truncate(self.size)
            except OSError as e:
                raise UserError(f"cannot cut {self.path} back to {self.resumed.path}: {reason_of(e)}") from None

    def write(self, **record):
        if self.file:
            mine = dict(record, run=self.run["id"]) if self.run else record
            self._append((json.dumps(strict_json_record(mine), allow_nan=False) + "\n").encode())
        for sink in list(self.sinks):
            self._to_sink(sink, f"at step {record['step']}", sink.write, record)

    def resend_step(self, step: int):
        """The sinks get the records of step that the log holds: a resumed run's step was evaluated
        before its checkpoint, so each tracker then holds what log.jsonl holds from that step on."""
        if not self.file:
            return
        with open(self.path, "rb") as f:
            for number, line in enumerate(f.read(self.size).splitlines(), start=1):
                record = json_file.parse(line, self.path, number)
                record.update(
                    {k: float(v) for k, v in record.pop("nonfinite", {}).items()}
                )  # strict_json_record undone
                record.pop("run", None)  # as write() sends them: a tracker has its own run
                if record["step"] == step:
                    for sink in list(self.sinks):
                        self._to_sink(sink, f"at step {step}", sink.write, record)

    def _to_sink(self, sink, when: str, call, *args):
        """A run tracker that fails (W&B's service gone, a full disk) gets no more records, with a
        warning: the training and log.jsonl go on, and log.jsonl holds every record."""
        try:
            call(*args)
        except Exception as e:
            self.sinks = [s for s in self.sinks if s is not sink]
            cli.print_warning(
                f"{sink.flag} failed {when} ({reason_of(e, typed=True)}) and gets no more "
                f"records; {self.path} has them all"
            )

    def _append(self, data: bytes):
        try:
            view = memoryview(data)
            while view:  # a short write means the disk filled mid-record: the next write says why
                view = view[self.file.write(view) :]
        except OSError as e:
            with contextlib.suppress(OSError):
                self.file.truncate(self.size)  # back to the last whole record
            self._fail(e)
        self.size += len(data)
        self.sha.update(data)

    def sync(self):
        """Make the log durable (before a checkpoint that points into it)."""
        if self.file:
            try:
                os.fsync(self.file.fileno())
            except OSError as e:
                self._fail(e)

    def _fail(self, e: OSError):
        raise UserError(
            f"cannot write {self.path}: {reason_of(e)} (the log ends at its last whole record). "
            f"Last good checkpoint: {self.last_checkpoint or 'none'}"
        ) from None

    def position(self) -> dict:
        """What a checkpoint taken now records of its run: the bytes of the log written so far and
        their sha256 (where a resume cuts the log back), and the run's identity."""
        return dict(log_offset=self.size, log_sha256=self.sha.hexdigest(), run=self.run)

    def close(self):
        if self.file:
            self.file.close()
        for sink in list(self.sinks):
            self._to_sink(sink, "at the end", sink.close)


def strict_json_record(record: dict) -> dict:
    """record with its NaN and infinite numbers as null, listed by name and value under "nonfinite":
    JSON has no NaN or Infinity, and strict readers (jq, JavaScript, pandas' default) reject them."""
    bad = {k: str(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
    return {**record, **dict.fromkeys(bad), "nonfinite": bad} if bad else record


def open_run_file(path: str, mode: str, **options):
    """open(path, mode) for a file a run folder holds (log.jsonl), where another program may have put
    a named pipe, a socket or a disk's block device: a UserError naming what it is, never a wait
    forever for a pipe's other end (the open does not block: O_NONBLOCK) nor writes onto a disk.
    A character device answers at once and stays allowed (/dev/null, /dev/full)."""
    # (a new file gets open()'s usual 0o666 less the umask: os.open's default mode is 0o777)
    f = open(path, mode, opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK, 0o666), **options)
    kind = os.fstat(f.fileno()).st_mode
    what = (
        "a named pipe (FIFO)"
        if stat.S_ISFIFO(kind)
        else "a socket"
        if stat.S_ISSOCK(kind)
        else "a block device"
        if stat.S_ISBLK(kind)
        else None
    )
    if what:
        f.close()
        raise UserError(
            f"{path} is {what}, not a regular file: a run would wait on it or write over it; remove it "
            "(the run makes its own), or choose another --out-dir"
        )
    return f


def read_log_up_to(path: str, resumed: ResumePoint | None) -> bytes:
    """What a run keeps of the log.jsonl at path: all of it, or resuming, its bytes up to the
    checkpoint's recorded (offset, sha256), when it is the log of the checkpoint's run (a missing or
    empty log is fine: a new one starts). Otherwise a UserError: cutting it would corrupt it."""
    try:
        with open_run_file(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size  # (0 for a device: /dev/full reads zeros forever)
            kept = f.read(min(resumed.log_offset, size) if resumed else size)
    except FileNotFoundError:
        return b""
    if resumed and kept and (len(kept) != resumed.log_offset or hashlib.sha256(kept).hexdigest() != resumed.log_sha256):
        last, whose, _, _ = log_summary(path)
        if last != resumed.run["id"]:
            raise UserError(
                f"{path} is not the log of the run that wrote {resumed.path} (the log is of {whose}, the "
                f"checkpoint of {run_name(resumed.run['id'])}): resuming would corrupt it; resume into "
                "the --out-dir of the checkpoint's own run, or a new one"
            )
        change = (
            f"it holds {len(kept)} bytes, and was {resumed.log_offset} long then"
            if len(kept) < resumed.log_offset
            else f"its first {resumed.log_offset} bytes differ from then"
        )
        raise UserError(
            f"{path} is the log of {whose}, but not as it was when {resumed.path} was written ({change}): "
            "it was cut short or edited since, and resuming would cut it in the wrong place; restore it, "
            "or move it aside (the resume then starts a new log.jsonl)"
        )
    return kept
