"""A data folder's shards checked for the trainer: against fineweb.py's manifest.json, the list of the folder's
shards (check_against_manifest, before any step; each shard's full sha256 on a thread beside the steps:
ShardDigestCheck), and their token ids against the model's vocabulary (check_token_ids); what that manifest
records of a shard (recorded). Runs nothing at import."""

from __future__ import annotations

import glob
import hashlib
import os
import threading

from trainkit import json_file
from trainkit.cli import UserError, clipped, reason_of
from trainkit.regular_file import open_regular
from trainkit.shards import MANIFEST, manifest_problem
from trainkit.tokenizer import EOT, GPT2_VOCAB, real_vocab_size


def folder_manifest(folder: str) -> dict | None:
    """fineweb.py's manifest.json in a folder of shards, or None where there is none (shards may come from
    other tools): what the trainer's checks of a data folder read. One that cannot be read (permissions, an
    I/O error), is not JSON, or not of the manifest's schema (shards.manifest_problem: a field missing or of
    another type), is a UserError naming why or the field: read as no manifest, the shards it describes (an
    unfinished fineweb.py run's) would go unchecked."""
    path = os.path.join(folder, MANIFEST)
    try:
        manifest = json_file.read(path)
        problem = manifest_problem(manifest)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(
            f"cannot read {path}: {reason_of(e)}; the shards it lists cannot be checked: make it readable, or "
            "move it out of the folder"
        ) from None
    except json_file.JSONFileError as e:
        problem = e.reason
    if problem:
        raise UserError(
            f"{path} is not a manifest fineweb.py wrote ({problem}); restore it, re-create the data "
            "set with fineweb.py, or move it out of the folder"
        )
    return manifest


def manifest_shards(folder: str) -> dict[str, dict] | None:
    """{file: its entry} of the shards that fineweb.py's manifest.json in folder lists (None without one)."""
    manifest = folder_manifest(folder)
    return None if manifest is None else {shard["file"]: shard for shard in manifest["shards"]}


def recorded(paths: list[str], key: str) -> list:
    """What the manifest.json of each path's folder records for it under key (sha256, max_id), or None:
    without a manifest, or where its entry is for a file of another size (not this file)."""
    listed = {folder: manifest_shards(folder) or {} for folder in {os.path.dirname(p) for p in paths}}
    values = []
    for path in paths:
        entry = listed[os.path.dirname(path)].get(os.path.basename(path))
        same_size = entry is not None and entry["bytes"] == os.path.getsize(path)
        values.append(entry.get(key) if same_size else None)
    return values


def check_against_manifest(folder: str, split: str, paths: list[str]):
    """Where fineweb.py's manifest.json is, it is the list of the folder's shards: refuse the shards of an
    unfinished run (killed, or stopped at a document it could not read: they hold only the data before
    that point), a shard file of the split (paths: those the trainer found by name) that it does not
    list (another data set's file, a copy in another format), and one it lists that is missing or of
    another size."""
    manifest, where = folder_manifest(folder), os.path.join(folder, MANIFEST)
    if manifest is not None and not manifest["complete"]:
        written = len(manifest["shards"])
        raise UserError(
            f"{folder} holds an unfinished fineweb.py run ({written} shards written, {MANIFEST} says "
            "complete: false); finish it by running fineweb.py again as it was run"
        )
    listed = manifest_shards(folder)
    if listed is None:  # no manifest: shards from another tool
        return
    for path in paths:
        if os.path.basename(path) not in listed:
            raise UserError(
                f"{path} is not one of the shards that {where} lists: move it out of the folder (where "
                "a manifest is, the trainer reads the shards it lists and no others)"
            )
    for name, entry in sorted(listed.items()):
        path = os.path.join(folder, name)
        if f"_{split}_" not in name or (os.path.isfile(path) and os.path.getsize(path) == entry["bytes"]):
            continue
        what = (
            f"is {os.path.getsize(path)} bytes, not the {clipped(entry['bytes'])} that {where} lists"
            if os.path.isfile(path)
            else f"is missing, yet {where} lists it"
        )
        raise UserError(f"{path} {what}; restore it, or re-create the data set with fineweb.py")


def no_output_for(path: str, token_id: int, vocab_size: int) -> str:
    """Why the model (of vocab_size rows) cannot train on a shard holding token_id: as a target, no
    output of its softmax (real_vocab_size) is that id."""
    if vocab_size >= GPT2_VOCAB:
        return (
            f"{path} holds token id {token_id}, which the model has no output for: its softmax covers GPT-2's "
            f"{GPT2_VOCAB} tokens (ids 0..{EOT}), whatever --vocab-size pads; the shards come from another "
            "tokenizer (one with added tokens?): re-create them with fineweb.py"
        )
    return (
        f"{path} holds token id {token_id}, which the model has no output for (--vocab-size {vocab_size}: ids "
        f"0..{vocab_size - 1}); wrong tokenizer or --vocab-size too small"
    )


def check_token_ids(paths: list[str], largest_ids: list[int], vocab_size: int):
    """Refuse, before any step, shards holding an id the model has no output for (no_output_for), which
    would fail the loss when its row is first read. A shard's largest id is its manifest's max_id, else
    a scan of its tokens that trainkit/shard_scan.py keeps for the next launch."""
    for path, largest in zip(paths, largest_ids):
        if largest >= real_vocab_size(vocab_size):
            raise UserError(no_output_for(path, largest, vocab_size))


class ShardDigestCheck:
    """Each shard's full sha256 against the one its folder's manifest.json records, once, on a thread
    of its own beside the steps (hashlib lets go of the GIL: 0.4 to 0.8 s per 100M-token shard). A
    shard without a recorded sha256 is not checked. start() starts it, where the steps start; the run
    asks failed() (free) at each step and result() (which waits for it) where it must know; close()
    ends it at the next MiB, on every way out, before the process group is torn down: a thread still
    hashing while the interpreter shuts down is killed there, not ended."""

    CHUNK = 1 << 20

    def __init__(self, paths: list[str]):
        self.error, self.thread, self.stopping = None, None, threading.Event()
        self.paths, self.digests = paths, recorded(paths, "sha256")

    def start(self):
        if any(self.digests) and self.thread is None:  # no thread (its stack and malloc arena) with nothing to check
            self.thread = threading.Thread(target=self._check, name="shard sha256")
            self.thread.start()

    def _check(self):
        buffer = bytearray(self.CHUNK)
        for path, expected in zip(self.paths, self.digests):
            if expected is None:
                continue
            digest = hashlib.sha256()
            try:
                with open_regular(path) as f:  # reads of CHUNK bytes, unbuffered: a stop waits for one at most
                    while n := f.raw.readinto(buffer):
                        if self.stopping.is_set():
                            return
                        digest.update(memoryview(buffer)[:n])
            except UserError as e:  # (swapped for a named pipe since start-up)
                self.error = e
                return
            except OSError as e:
                self.error = UserError(f"cannot read {path}: {reason_of(e)}")
                return
            if digest.hexdigest() != expected:
                self.error = UserError(
                    f"{path} has sha256 {digest.hexdigest()[:16]}..., not the {expected[:16]}... that "
                    f"{os.path.join(os.path.dirname(path), MANIFEST)} records: the file changed since fineweb.py "
                    "wrote it (a damaged copy?); restore it, or re-create the data set with fineweb.py"
                )
                return

    def failed(self) -> bool:
        return self.error is not None

    def result(self, wait: bool = True):
        """A UserError naming the first shard that differs: once every shard is checked, or (not wait)
        among those checked so far."""
        if wait and self.thread:
            self.thread.join()
        if self.error:
            raise self.error

    def close(self):
        """Stop checking (within one MiB) and wait for the thread to end."""
        self.stopping.set()
        if self.thread:
            self.thread.join()


def find_shards(data_dir: str, split: str) -> list[str]:
    """The split's shards in data_dir (*_{split}_*.npy or .bin, in name order), checked against its manifest."""
    if not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir} does not exist; create shards with fineweb.py")
    folder = glob.escape(data_dir)  # a folder named like a pattern (data[1]) is still that folder
    paths = sorted(p for ext in ("npy", "bin") for p in glob.glob(os.path.join(folder, f"*_{split}_*.{ext}")))
    check_against_manifest(data_dir, split, paths)
    if not paths:
        raise UserError(
            f"no '{split}' shards (*_{split}_*.npy or .bin) in --data-dir {data_dir}; create them with fineweb.py"
        )
    return paths
