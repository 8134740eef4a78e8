"""The token shards and their manifest, one format with two users: fineweb.py writes them (ShardWriter,
the manifest that lets a killed run resume byte-identically), the trainer reads them (open_shard) and
checks a data folder against its manifest (check_against_manifest, check_token_ids, ShardDigestCheck)
and which shards a checkpoint was trained on (shard_files, differing_file). A shard is a 1-D uint16 array: build-nanogpt's .npy or llm.c's .bin with its header.
Runs nothing at import."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import threading

import numpy as np

from trainkit import json_file
from trainkit.atomic_write import write_bytes_atomically
from trainkit.cli import UserError, reason_of
from trainkit.regular_file import check_regular, open_regular
from trainkit.tokenizer import ENCODING_NAME, EOT, GPT2_VOCAB, real_vocab_size

MANIFEST = "manifest.json"  # beside the shards: their sizes, checksums and where each ends in the documents
BIN_MAGIC, BIN_VERSION, BIN_HEADER_INTS = 20240520, 1, 256  # llm.c's header for uint16 token shards


def shard_header(tokens: np.ndarray, fmt: str) -> bytes:
    if fmt == "bin":
        header = np.zeros(BIN_HEADER_INTS, dtype="<i4")
        header[:3] = BIN_MAGIC, BIN_VERSION, tokens.size
        return header.tobytes()
    buffer = io.BytesIO()  # exactly the header np.save writes
    np.lib.format.write_array_header_1_0(buffer, np.lib.format.header_data_from_array_1_0(tokens))
    return buffer.getvalue()


def write_atomically(path: str, *blobs) -> None:
    """path written whole or not at all (atomic_write), without fsync: it guards against a killed
    process, not a power loss, and fsync cost seconds per shard on slow disks; a resumed run checks
    the size of every shard it keeps."""
    try:
        write_bytes_atomically(path, *blobs, fsync_file=False, fsync_folder=False)
    except OSError as e:  # a full disk, a quota, permissions
        raise UserError(
            f"cannot write {path}: {reason_of(e)}; the shards that {MANIFEST} lists are "
            "complete: fix this and run the same command again to resume"
        ) from None


def save_manifest(out_dir: str, manifest: dict) -> None:
    write_atomically(os.path.join(out_dir, MANIFEST), json.dumps(manifest, indent=1).encode())


class ShardWriter:
    """Cuts the token stream into shards and records, per shard, where it ends in the
    document stream: documents fully written so far, and tokens already written of the next
    (split) document. Those two numbers are all a resumed run needs."""

    def __init__(self, out_dir: str, manifest: dict):
        self.out_dir, self.manifest = out_dir, manifest
        config = manifest["config"]
        self.prefix, self.fmt = config["prefix"], config["format"]
        self.val_shards = config["val_shards"]
        try:
            self.buffer = np.empty(config["shard_size"], dtype="<u2")
        except MemoryError:
            raise UserError(
                f"--shard-size {config['shard_size']:,}: not enough memory for one shard's "
                f"buffer ({2 * config['shard_size'] / 1e9:.1f} GB); choose a smaller "
                "--shard-size"
            ) from None
        self.filled = 0
        self.shard_documents = 0  # documents that start in the current shard
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
        """finish_shard for a stream that ended inside the first shard, cut into two shards instead:
        its first `first` tokens and the rest, with the bookkeeping of a stream cut there (so that a
        run interrupted between the two resumes as one that wrote the first)."""
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
        write_atomically(os.path.join(self.out_dir, name), header, tokens.data)
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
            save_manifest(self.out_dir, self.manifest)
        except UserError:  # the folder holds exactly what the manifest lists, so a rerun resumes
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.out_dir, name))
            raise
        self.tokens_written += self.filled
        self.filled = self.shard_documents = 0


def open_manifest(out_dir: str, config: dict, source: str, inputs) -> dict:
    """The manifest of an earlier run with the same config and inputs, or a new one (not yet
    written: a run that fails before its first shard leaves the folder as it found it)."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        pattern = f"{glob.escape(config['prefix'])}_*.{config['format']}"
        strays = glob.glob(os.path.join(glob.escape(out_dir), pattern))
        if strays:
            raise UserError(
                f"{out_dir} holds shards ({os.path.basename(strays[0])}, ...) but no "
                f"{MANIFEST}, so they cannot be resumed; use an empty --out-dir"
            )
        return {
            "source": source,
            "tokenizer": f"tiktoken {ENCODING_NAME} (GPT-2 BPE, EOT={EOT})",
            "dtype": "uint16",
            "config": config,
            "inputs": inputs,
            "complete": False,
            "shards": [],
        }
    manifest = read_manifest(path)
    changed = [
        f"{key} {manifest['config'].get(key)!r} -> {value!r}"
        for key, value in config.items()
        if manifest["config"].get(key) != value
    ]
    if changed:
        raise UserError(
            f"{path} was written with other arguments ({'; '.join(changed)}); "
            "rerun with the same arguments to resume, or use another --out-dir"
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
    try:
        manifest = json_file.read(path)
        if not (
            isinstance(manifest["config"], dict)
            and isinstance(manifest["complete"], bool)
            and all(isinstance(shard["file"], str) and isinstance(shard["bytes"], int) for shard in manifest["shards"])
        ):
            raise TypeError
    except json_file.JSONFileError as e:
        raise UserError(
            f"{path} is not a manifest written by fineweb.py ({e.reason}); use an empty --out-dir"
        ) from None
    except (KeyError, TypeError):  # not our layout
        raise UserError(f"{path} is not a manifest written by fineweb.py; use an empty --out-dir") from None
    return manifest


def input_listing(files: list) -> list:
    """[path, size, mtime_ns] of every input file: a file edited or replaced in place shows
    in its size or modification time, without reading the data again."""
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


def open_shard(path: str) -> np.ndarray:
    """Memory-map a token shard: build-nanogpt's .npy (uint16) or llm.c's .bin; a UserError unless it is a
    regular file (a named pipe would block the read forever, a link to /dev/zero be read until memory runs out)."""
    try:
        check_regular(path)
        if path.endswith(".bin"):
            header = np.fromfile(path, dtype=np.int32, count=BIN_HEADER_INTS)
            if header.size < 3 or header[0] != BIN_MAGIC:
                raise UserError(f"{path}: not an llm.c token shard (bad magic). HINT: are you passing the right file?")
            if header[1] != BIN_VERSION:
                raise UserError(f"{path}: unsupported llm.c shard version {header[1]} (expected {BIN_VERSION})")
            n_tokens = int(header[2])
            expected = 4 * BIN_HEADER_INTS + 2 * n_tokens
            actual = os.path.getsize(path)
            if actual != expected:
                raise UserError(
                    f"{path}: header says {n_tokens} tokens ({expected} bytes) but the file "
                    f"has {actual} bytes: truncated or corrupt, re-create it"
                )
            return np.memmap(path, dtype=np.uint16, mode="r", offset=4 * BIN_HEADER_INTS, shape=(n_tokens,))
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise UserError(f"{path}: not a .npy token shard (bad magic). HINT: are you passing the right file?")
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except UserError:
        raise
    except (ValueError, OSError, EOFError) as e:
        raise UserError(
            f"{path}: cannot read token shard ({reason_of(e)}); truncated or corrupt? re-create it"
        ) from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise UserError(
            f"{path}: expected a 1-D uint16 token array, got {tokens.dtype} with shape "
            f"{tokens.shape}. HINT: are you passing the right file?"
        )
    return tokens


SAMPLES, SAMPLE_BYTES = 16, 64 << 10  # a shard's sampled content: 1 MiB


def sampled_sha256(path: str, size: int) -> str:
    """sha256 of a file's size and SAMPLES slices of SAMPLE_BYTES spread evenly over it, from its
    first byte (the header) to its last; a file of at most SAMPLES x SAMPLE_BYTES is hashed whole.
    Two corpora cut into shards of the same sizes differ in every slice. Every rank fingerprints
    every shard at start-up: a 100M-token shard (200 MB) takes 16 ms read from disk this way, 0.8 s
    for a full sha256 (benchmarks/bench_shard_identity.py), 80 s for FineWeb-Edu 10B's 100 shards."""
    digest = hashlib.sha256(str(size).encode())
    with open_regular(path) as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            digest.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def folder_manifest(folder: str) -> dict | None:
    """fineweb.py's manifest.json in a folder of shards, or None where there is none that can be opened (shards
    may come from other tools): what the trainer's checks of a data folder read. One that is not JSON is a
    UserError: read as no manifest, the shards it describes would go unchecked."""
    path = os.path.join(folder, MANIFEST)
    try:
        manifest = json_file.read(path)
    except OSError:
        return None
    except json_file.JSONFileError as e:
        raise UserError(
            f"{path} is not a manifest fineweb.py wrote ({e.reason}); restore it, re-create the data "
            "set with fineweb.py, or move it out of the folder"
        ) from None
    return manifest if isinstance(manifest, dict) else None


def manifest_shards(folder: str) -> dict[str, dict] | None:
    """{file: its entry} of the shards that fineweb.py's manifest.json in folder lists (None without a
    readable one)."""
    with contextlib.suppress(LookupError, TypeError):
        return {shard["file"]: shard for shard in folder_manifest(folder)["shards"]}
    return None


def recorded(paths: list[str], key: str) -> list:
    """What the manifest.json of each path's folder records for it under key (sha256, max_id), or None:
    without a manifest, or where its entry is for a file of another size (not this file)."""
    listed = {folder: manifest_shards(folder) or {} for folder in {os.path.dirname(p) for p in paths}}
    values = []
    for path in paths:
        entry = listed[os.path.dirname(path)].get(os.path.basename(path))
        same_size = isinstance(entry, dict) and entry.get("bytes") == os.path.getsize(path)
        values.append(entry.get(key) if same_size else None)
    return values


def check_against_manifest(folder: str, split: str, paths: list[str]):
    """Where fineweb.py's manifest.json is, it is the list of the folder's shards: refuse the shards of an
    unfinished run (killed, or stopped at a document it could not read: they hold only the data before
    that point), a shard file of the split (paths: those the trainer found by name) that it does not
    list (another data set's file, a copy in another format), and one it lists that is missing or of
    another size."""
    manifest, where = folder_manifest(folder), os.path.join(folder, MANIFEST)
    if manifest is not None and manifest.get("complete") is False:
        written = len(manifest.get("shards") or ())
        raise UserError(
            f"{folder} holds an unfinished fineweb.py run ({written} shards written, {MANIFEST} says "
            "complete: false); finish it by running fineweb.py again as it was run"
        )
    listed = manifest_shards(folder)
    if listed is None:  # shards from another tool
        return
    for path in paths:
        if os.path.basename(path) not in listed:
            raise UserError(
                f"{path} is not one of the shards that {where} lists: move it out of the folder (where "
                "a manifest is, the trainer reads the shards it lists and no others)"
            )
    for name, entry in sorted(listed.items()):
        path = os.path.join(folder, name)
        if f"_{split}_" not in name or (os.path.isfile(path) and os.path.getsize(path) == entry.get("bytes")):
            continue
        what = (
            f"is {os.path.getsize(path)} bytes, not the {entry.get('bytes')} that {where} lists"
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


def shard_files(paths: list[str]) -> list[tuple[str, int, str, str | None]]:
    """What tells one set of shards from another, per shard: (file name, size in bytes, its
    sampled_sha256, the sha256 its folder's manifest.json records for a file of that size or None)."""
    files = []
    for path, sha256 in zip(paths, recorded(paths, "sha256")):
        size = os.path.getsize(path)
        files.append((os.path.basename(path), size, sampled_sha256(path, size), sha256))
    return files


def differing_file(a: list[tuple], b: list[tuple]) -> tuple[str, str, str] | None:
    """The first file name (in order) that differs between two shard_files() lists, with what it
    is in each: "N bytes" or "missing" when the sizes differ, else its content (the manifests'
    sha256 where both lists have one, then the sampled one); None if they are the same. The lists
    of checkpoints written before contents were recorded, (name, size) pairs, compare by size."""
    a_files, b_files = ({entry[0]: entry[1:] for entry in files} for files in (a, b))
    for name in sorted({*a_files, *b_files}):
        x, y = a_files.get(name), b_files.get(name)
        if x is None or y is None or x[0] != y[0]:
            size = lambda entry: f"{entry[0]} bytes" if entry else "missing"  # noqa: E731
            return name, size(x), size(y)
        for kind, i in (("sha256", 2), ("sampled content", 1)):
            if len(x) > i and len(y) > i and x[i] and y[i] and x[i] != y[i]:
                return name, f"{x[0]} bytes of {kind} {x[i][:12]}", f"{y[0]} bytes of {kind} {y[i][:12]}"
    return None
