"""Start-up's passes over every token of a shard, its largest id and its --align-docs row table, done once
and kept in $XDG_CACHE_HOME/gpt2-trainer/shards (else ~/.cache/...), each entry checked before use; under
torchrun the ranks split the scans (docs/data.md)."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import io
import os
import re
import stat
import sys
import time

import numpy as np

from trainkit.fileio import write_bytes_atomically
from trainkit.cli import UserError, print0, print_line, reason_of
from trainkit.data.shards import check_token_ids, find_shards, open_shard, recorded
from trainkit.data.tokenizer import EOT

MIN_CACHED_TOKENS = 1 << 22  # 8 MB of tokens: scanned in milliseconds, not worth a file
PROGRESS_AFTER_S, PROGRESS_EVERY_S = 2.0, 10.0


class ScanCache:
    """The kept scans: <path hash>-<identity hash>.max_id and .rows<T>.npy (the table under a seal row).
    An entry is a hint: read through open_entry, a row table checked (read_rows); one unfit is scanned again."""

    def __init__(self, folder: str | None = None):
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        self.folder = folder or os.path.join(base, "gpt2-trainer", "shards")

    def _entry(self, path: str) -> tuple[str, str] | None:
        """(prefix of every entry of this path, prefix of this path's entries for the file as it is now)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        where = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:20]
        what = hashlib.sha256(f"{st.st_size} {st.st_mtime_ns} {st.st_ino}".encode()).hexdigest()[:20]
        return os.path.join(self.folder, where), os.path.join(self.folder, f"{where}-{what}")

    def _read(self, path: str, suffix: str, read, quiet: bool = False):
        """read(name) of the path's entry of that suffix; None where there is none or unfit (noted unless quiet)."""
        entry = self._entry(path)
        if entry is None:
            return None
        name = entry[1] + suffix
        try:
            return read(name)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnfitEntry) as e:
            if not quiet:
                reason = e if isinstance(e, UnfitEntry) else reason_of(e)
                print0(f"note: the kept scan {name} of {path} cannot be used ({reason}); scanning the shard again")
        return None

    def max_id(self, path: str) -> int | None:
        """The kept largest token id of the shard at path, or None."""
        return self._read(path, ".max_id", read_max_id)

    def rows(self, path: str, T: int, tokens: np.ndarray, quiet: bool = False) -> np.ndarray | None:
        """The kept row table of the shard at path (tokens), memory-mapped, or None."""
        return self._read(path, f".rows{T}.npy", lambda name: read_rows(name, T, tokens), quiet)

    def store(self, path: str, suffix: str, data: bytes) -> bool:
        """data into the path's entry of that suffix, atomically, its earlier identities' deleted; False on failure."""
        entry = self._entry(path)
        if entry is None:
            return False
        target = entry[1] + suffix
        try:
            os.makedirs(self.folder, mode=0o755, exist_ok=True)
            _keep_mine(self.folder)  # (open_entry trusts only what no other user may write)
            write_bytes_atomically(
                target, data, fsync_file=False, fsync_folder=False, tmp=f"{target}.{os.getpid()}.tmp"
            )
            _keep_mine(target)
        except OSError:  # a read-only or full home: the run goes on, and scans again next time
            return False
        for old in glob.glob(glob.escape(entry[0]) + "-*" + suffix):
            if old != target:
                with contextlib.suppress(OSError):
                    os.remove(old)
        return True


MAX_ID_BYTES = 16  # a uint16 id as text, with room to spare
NPY_HEADER_BYTES = 4096  # a .npy header of this table is 128 bytes


class UnfitEntry(Exception):
    """Why a cache entry cannot be used (it is then scanned again)."""


def read_max_id(name: str) -> int:
    with open_entry(name, MAX_ID_BYTES) as f:
        text = f.read(MAX_ID_BYTES)
    if not re.fullmatch(rb"\d{1,5}", text) or int(text) > np.iinfo(np.uint16).max:
        raise UnfitEntry(f"not a token id ({text[:16]!r})")
    return int(text)


def open_entry(name: str, max_bytes: int):
    """The cache entry at name opened where a regular file of at most max_bytes only this user may write, in
    such a folder (as ssh trusts its files); else an UnfitEntry."""
    folder = os.stat(os.path.dirname(name) or ".")
    if not _only_mine(folder):
        raise UnfitEntry(f"its folder {_whose(folder)}")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnfitEntry("a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnfitEntry("not a regular file")
        if st.st_size > max_bytes:
            raise UnfitEntry(f"{st.st_size} bytes, more than the {max_bytes} such an entry holds")
        if not _only_mine(st):
            raise UnfitEntry(f"it {_whose(st)}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _only_mine(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _keep_mine(path: str):
    """Take the write permission of group and others from path where this user owns it (a umask of 002)."""
    st = os.stat(path)
    if st.st_uid == os.geteuid() and st.st_mode & 0o022:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)


def _whose(st: os.stat_result) -> str:
    return f"is owned by another user (uid {st.st_uid})" if st.st_uid != os.geteuid() else "is writable by other users"


def sealed_rows(table: np.ndarray, T: int, n_tokens: int) -> bytes:
    """What a .rows<T>.npy entry holds: table under its seal row (n_tokens, digest), as .npy."""
    buffer = io.BytesIO()
    np.save(buffer, np.concatenate([[[n_tokens, table_digest(table, T, n_tokens)]], table]).astype("<i8"))
    return buffer.getvalue()


def table_digest(table: np.ndarray, T: int, n_tokens: int) -> int:
    digest = hashlib.blake2b(f"{T} {n_tokens} ".encode(), digest_size=8)
    digest.update(np.ascontiguousarray(table, dtype="<i8").data)
    return int(np.frombuffer(digest.digest(), dtype="<i8")[0])


def read_rows(name: str, T: int, tokens: np.ndarray) -> np.ndarray:
    """The row table in the entry at name, memory-mapped, or an UnfitEntry unless it is one of tokens: its
    seal, rows consecutive over the shard of 1..T targets, a shorter one ending where a document starts."""
    n = int(tokens.size)
    with open_entry(name, NPY_HEADER_BYTES + 16 * (n + 1)) as f:
        if np.lib.format.read_magic(f) != (1, 0):
            raise UnfitEntry("not a .npy file of version 1.0, as np.save writes it")
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f, max_header_size=NPY_HEADER_BYTES)
        if dtype != np.dtype("<i8") or fortran or len(shape) != 2 or shape[1] != 2 or not 2 <= shape[0] <= n:
            raise UnfitEntry(f"not a row table of this shard ({dtype}, shape {shape})")
        sealed = np.memmap(f, dtype="<i8", mode="r", offset=f.tell(), shape=shape)
    rows = sealed[1:]
    if int(sealed[0, 0]) != n or int(sealed[0, 1]) != table_digest(rows, T, n):
        raise UnfitEntry("its digest or token count is not that of its rows")
    starts, lengths = rows[:, 0], rows[:, 1]
    ends = starts + lengths
    consecutive = starts[0] == 0 and ends[-1] == n - 1 and np.array_equal(starts[1:], ends[:-1])
    if not consecutive or lengths.min() < 1 or lengths.max() > T:
        raise UnfitEntry(f"its rows are not consecutive rows of 1..{T} targets over the shard's {n} tokens")
    if not np.all((lengths == T) | (tokens[ends] == EOT) | (ends == n - 1)):
        raise UnfitEntry("a row shorter than --seq-len ends where no document starts in the shard")
    return rows


class Progress:
    """ "<what>: i/N shards, s" on stderr, once the work has taken PROGRESS_AFTER_S, then every PROGRESS_EVERY_S."""

    def __init__(self, what: str, total: int, enabled: bool):
        self.what, self.total, self.enabled = what, total, enabled
        self.start = self.last = time.monotonic()
        self.shown = False

    def update(self, done: int):
        now = time.monotonic()
        due = now - self.start >= PROGRESS_AFTER_S and (not self.shown or now - self.last >= PROGRESS_EVERY_S)
        if self.enabled and (due or (self.shown and done == self.total)):
            print_line(f"{self.what}: {done}/{self.total} shards, {now - self.start:.0f} s", file=sys.stderr)
            self.shown, self.last = True, now


def _ranks() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj) -> list:
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def scan_shards(
    paths: list[str], shards: list[np.ndarray], known_ids: list, T: int | None, build_rows, what: str, progress: bool
) -> tuple[list[int], list[np.ndarray] | None]:
    """(every shard's largest token id, its row table build_rows(tokens, T) or None without T): known (an int in
    known_ids) or kept where they are, else scanned once and kept. Under torchrun, every rank gets every result."""
    cache, n = ScanCache(), len(paths)
    kept = [shard.size >= MIN_CACHED_TOKENS for shard in shards]
    max_ids = [m if isinstance(m, int) else (cache.max_id(p) if k else None) for p, m, k in zip(paths, known_ids, kept)]
    tables = [cache.rows(p, T, s) if T and k else None for p, s, k in zip(paths, shards, kept)] if T else None
    need = [i for i in range(n) if max_ids[i] is None or (T and tables[i] is None)]
    rank, world = _ranks()
    if world > 1:  # the same split on every rank, whatever each one's cache holds
        need = sorted(set().union(*_all_gather(need)))
    if not need:
        return max_ids, tables
    mine = need[rank::world]
    share = f" over {world} ranks, rank 0's share" if world > 1 else ""
    title = f"{what}: scanning {len(need)} shards{share} (token ids{', row tables' if T else ''})"
    bar = Progress(title, len(mine), progress and rank == 0)
    found = {}  # i -> (largest id, whether its row table is in the cache)
    for done, i in enumerate(mine, 1):
        tokens = shards[i]
        largest = max_ids[i] if max_ids[i] is not None else (int(tokens.max()) if tokens.size else 0)
        if kept[i] and max_ids[i] is None:
            cache.store(paths[i], ".max_id", str(largest).encode())
        max_ids[i], cached = largest, bool(T) and tables[i] is not None  # (already in this rank's cache)
        if T and tables[i] is None:
            table = build_rows(tokens, T)
            cached = kept[i] and cache.store(paths[i], f".rows{T}.npy", sealed_rows(table, T, tokens.size))
            # where kept: memory-mapped, file pages the kernel shares and drops, not the run's own memory
            mapped = cache.rows(paths[i], T, tokens, quiet=True) if cached else None
            tables[i] = table if mapped is None else mapped
        found[i] = (largest, cached)
        bar.update(done)
    if world == 1:
        return max_ids, tables
    for part in _all_gather(found):
        for i, (largest, cached) in part.items():
            max_ids[i] = largest
            if T and tables[i] is None and cached:
                tables[i] = cache.rows(paths[i], T, shards[i], quiet=True)
    # where a rank cannot read another's cache, the tables themselves are sent
    if T and any(_all_gather(any(tables[i] is None for i in need))):
        for part in _all_gather({i: np.asarray(tables[i]) for i in mine}):
            for i, table in part.items():
                if tables[i] is None:
                    tables[i] = table
    return max_ids, tables


def open_split(data_dir: str, split: str, T: int, align_docs: bool, build_rows, vocab_size: int | None, progress):
    """(paths, memory-mapped shards, row tables or None, rows per shard) of data_dir's split, its ids checked
    against vocab_size (None: not); a shard too short for one row is refused."""
    paths = find_shards(data_dir, split)
    shards = [open_shard(p) for p in paths]
    known_ids = recorded(paths, "max_id") if vocab_size is not None else [0] * len(paths)  # 0: no check
    what = f"{split} shards"
    largest_ids, tables = scan_shards(paths, shards, known_ids, T if align_docs else None, build_rows, what, progress)
    if vocab_size is not None:
        check_token_ids(paths, largest_ids, vocab_size)
    counts = [len(t) for t in tables] if align_docs else [max(0, len(s) - 1) // T for s in shards]
    for path, shard, count in zip(paths, shards, counts):
        if count == 0:
            raise UserError(
                f"{path}: {len(shard)} tokens, fewer than one row of --seq-len {T} + 1; remove it or re-create the shards"
            )
    return paths, shards, tables, counts
