"""fineweb.py's ShardWriter: the token stream cut into shards, each recorded in the manifest a resume reads."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os

import numpy as np

from trainkit import fileio
from trainkit.cli import UserError, reason_of
from trainkit.fileio import FolderLock, write_bytes_atomically
from trainkit.data.shards import MANIFEST, manifest_problem, shard_header
from trainkit.data.tokenizer import ENCODING_NAME, EOT


def write_whole(folder: FolderLock, name: str, *blobs) -> None:
    """name written whole into the folder held, without fsync (seconds per shard on slow disks; a resume checks
    sizes); a UserError says that a rerun resumes."""
    folder.check_held("; run the same command on the folder it took to resume")
    path = os.path.join(folder.folder, name)
    target, fd = fileio.in_held_folder(folder.folder, name, folder.fd), folder.fd
    try:
        write_bytes_atomically(target, *blobs, fsync_file=False, fsync_folder=False, dir_fd=fd)
    except OSError as e:  # a full disk, a quota, permissions
        raise UserError(
            f"cannot write {path}: {reason_of(e)}; the shards that {MANIFEST} lists are complete: fix this and run the same command again to resume"
        ) from None


def save_manifest(folder: FolderLock, manifest: dict) -> None:
    write_whole(folder, MANIFEST, json.dumps(manifest, indent=1).encode())


class ShardWriter:
    """Cuts the token stream into shards, recording where each ends in the documents: all a resume needs."""

    def __init__(self, folder: FolderLock, manifest: dict):
        self.folder, self.manifest = folder, manifest
        config = manifest["config"]
        self.prefix, self.fmt, self.val_shards = config["prefix"], config["format"], config["val_shards"]
        try:
            self.buffer = np.empty(config["shard_size"], dtype="<u2")
        except MemoryError:
            size = config["shard_size"]
            raise UserError(
                f"--shard-size {size:,}: not enough memory for one shard's buffer ({2 * size / 1e9:.1f} GB); choose a smaller --shard-size"
            ) from None
        self.filled, self.shard_documents = 0, 0  # shard_documents: those that start in the current shard
        last = manifest["shards"][-1] if manifest["shards"] else {}
        self.documents_done = last.get("documents_done", 0)
        self.open_tokens = last.get("next_document_tokens_done", 0)  # of the last started document
        self.tokens_written = sum(shard["tokens"] for shard in manifest["shards"])

    @property
    def tokens_total(self) -> int:
        return self.tokens_written + self.filled

    def add(self, tokens: np.ndarray) -> None:
        """Append tokens of whole documents (the first may lack a prefix already written)."""
        pos = 0
        while pos < tokens.size:
            segment = tokens[pos : pos + self.buffer.size - self.filled]
            self.buffer[self.filled : self.filled + segment.size] = segment
            self.filled += segment.size
            pos += segment.size
            starts = np.flatnonzero(segment == EOT)
            self.shard_documents += starts.size
            if starts.size:
                # each <|endoftext|> completes the document before it, if there is one
                self.documents_done += starts.size - (0 if self.open_tokens else 1)
                self.open_tokens = segment.size - int(starts[-1])
            else:
                self.open_tokens += segment.size
            if self.filled == self.buffer.size:
                # chunks hold whole documents, so a chunk's end is a document's end too
                self.finish_shard(ends_document=pos == tokens.size or tokens[pos] == EOT)

    def finish_in_two(self, first: int) -> None:
        """finish_shard for a stream that ended inside the first shard, cut in two at `first` tokens instead."""
        tokens = self.buffer[: self.filled].copy()
        self.filled = self.shard_documents = self.documents_done = self.open_tokens = 0
        self.add(tokens[:first])
        self.finish_shard(ends_document=bool(tokens[first] == EOT))
        self.add(tokens[first:])
        self.finish_shard()

    def finish_shard(self, ends_document: bool = True) -> None:
        if not self.filled:
            return
        index = len(self.manifest["shards"])
        split = "val" if index < self.val_shards else "train"
        name = f"{self.prefix}_{split}_{index:06d}.{self.fmt}"
        tokens = self.buffer[: self.filled]
        header = shard_header(tokens, self.fmt)
        write_whole(self.folder, name, header, tokens.data)
        digest = hashlib.sha256(header)
        digest.update(tokens.data)
        if ends_document and self.open_tokens:
            self.documents_done += 1
            self.open_tokens = 0
        self.manifest["shards"].append(
            {
                "file": name,
                "split": split,
                "tokens": int(self.filled),
                "bytes": len(header) + tokens.nbytes,
                "documents": int(self.shard_documents),
                "sha256": digest.hexdigest(),
                "max_id": int(tokens.max()),  # the trainer refuses ids its model has no output for
                "documents_done": self.documents_done,
                "next_document_tokens_done": self.open_tokens,
            }
        )
        try:
            save_manifest(self.folder, self.manifest)
        except UserError:  # the folder holds exactly what the manifest lists, so a rerun resumes
            with contextlib.suppress(OSError):
                os.remove(fileio.in_held_folder(self.folder.folder, name, self.folder.fd), dir_fd=self.folder.fd)
            raise
        self.tokens_written += self.filled
        self.filled = self.shard_documents = 0


def open_manifest(out_dir: str, config: dict, source: str, inputs) -> dict:
    """The manifest of an earlier run with the same config and inputs, or a new one (not yet written)."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        pattern = f"{glob.escape(config['prefix'])}_*.{config['format']}"
        strays = glob.glob(os.path.join(glob.escape(out_dir), pattern))
        if strays:
            raise UserError(
                f"{out_dir} holds shards ({os.path.basename(strays[0])}, ...) but no {MANIFEST}, so they cannot be resumed; use an empty --out-dir"
            )
        tokenizer = f"tiktoken {ENCODING_NAME} (GPT-2 BPE, EOT={EOT})"
        return dict(
            source=source, tokenizer=tokenizer, dtype="uint16", config=config, inputs=inputs, complete=False, shards=[]
        )
    manifest = read_manifest(path)
    old = manifest["config"]
    changed = [f"{key} {old.get(key)!r} -> {value!r}" for key, value in config.items() if old.get(key) != value]
    if changed:
        raise UserError(
            f"{path} was written with other arguments ({'; '.join(changed)}); rerun with the same arguments to resume, or use another --out-dir"
        )
    what = changed_input(manifest.get("inputs"), inputs)
    if what:
        raise UserError(
            f"the --files input changed since {path} was written: {what}, so new shards "
            f"would not continue the old ones; restore it, or delete {out_dir} and start over"
        )
    for shard in manifest["shards"]:
        shard_path = os.path.join(out_dir, shard["file"])
        if not os.path.isfile(shard_path) or os.path.getsize(shard_path) != shard["bytes"]:
            raise UserError(
                f"{shard_path}, listed in {path}, is missing or truncated; delete the folder and start over"
            )
    return manifest


def read_manifest(path: str) -> dict:
    """The manifest at path where it is of the schema a resume reads (manifest_problem), else a UserError."""
    try:
        manifest = fileio.read_json(path)
        problem = manifest_problem(manifest, resume=True)
    except fileio.JSONFileError as e:
        problem = e.reason
    if problem:
        raise UserError(f"{path} is not a manifest written by fineweb.py ({problem}); use an empty --out-dir")
    return manifest


def input_listing(files: list) -> list:
    """[path, size, mtime_ns] of every input file: an edit shows without reading the data again."""
    listing = []
    for path in files:
        try:
            st = os.stat(path)
        except OSError as e:
            raise UserError(f"cannot read {path}: {reason_of(e)}") from None
        listing.append([path, st.st_size, st.st_mtime_ns])
    return listing


def changed_input(before, now) -> str | None:
    """How the input listing now differs from the one an earlier run recorded (None: same)."""
    if now and before is None:
        return "its manifest lists no input files (an older fineweb.py wrote it)"
    then = {path: stamp for path, *stamp in before or []}
    current = {path: stamp for path, *stamp in now or []}
    for path, stamp in current.items():
        if path not in then:
            return f"{path} is new"
        if then[path] != stamp:
            return f"{path} was modified (its size or modification time differs)"
    gone = [path for path in then if path not in current]
    return f"{gone[0]} is gone" if gone else None
