"""The passes over every token of a shard that start-up needs: its largest token id (refused where the
model has no output for it) and its --align-docs row table. Each is done once per shard and kept, so that
a resume, a requeued job or another run on the same data reads it back instead of reading 10B tokens again:

- fineweb.py's manifest.json records every shard's max_id as it writes it (read first, shard_checks.recorded);
- everything else goes to a cache folder outside the data folder (which may be read-only):
  $XDG_CACHE_HOME/gpt2-trainer/shards, else ~/.cache/gpt2-trainer/shards. An entry is named by the shard's
  path and identity (size, mtime_ns, inode): a shard rewritten, replaced or touched gets a new name, so it
  is scanned again, and the entries of its earlier identity are deleted. A row table is kept as a .npy
  that the run memory-maps (file pages, shared, not the run's own memory). A shard under MIN_CACHED_TOKENS
  is scanned in milliseconds and not kept.

Under torchrun the ranks first agree on which shards need a scan, split them (rank r takes every W-th),
then exchange the results: the largest ids in one all-gather; each row table through the cache folder
where every rank can read it there (one node, or a cache on a shared filesystem), else in one more
all-gather. A scan that takes more than PROGRESS_AFTER_S seconds prints a progress line every
PROGRESS_EVERY_S. Runs nothing at import."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import sys
import time

import numpy as np

from trainkit.atomic_write import write_atomically
from trainkit.console import print_line

MIN_CACHED_TOKENS = 1 << 22  # 8 MB of tokens: scanned in milliseconds, not worth a file
PROGRESS_AFTER_S, PROGRESS_EVERY_S = 2.0, 10.0


def cache_folder() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gpt2-trainer", "shards")


class ScanCache:
    """The kept scans of shards: <path hash>-<identity hash>.max_id (the id as text) and .rows<T>.npy."""

    def __init__(self, folder: str | None = None):
        self.folder = folder or cache_folder()

    def _entry(self, path: str) -> tuple[str, str] | None:
        """(prefix of every entry of this path, prefix of this path's entries for the file as it is now)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        where = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:20]
        what = hashlib.sha256(f"{st.st_size} {st.st_mtime_ns} {st.st_ino}".encode()).hexdigest()[:20]
        return os.path.join(self.folder, where), os.path.join(self.folder, f"{where}-{what}")

    def max_id(self, path: str) -> int | None:
        entry = self._entry(path)
        with contextlib.suppress(OSError, ValueError):
            if entry:
                with open(entry[1] + ".max_id") as f:
                    return int(f.read())
        return None

    def rows(self, path: str, T: int, n_tokens: int) -> np.ndarray | None:
        """The kept row table, memory-mapped; None where there is none (or not one for these tokens)."""
        entry = self._entry(path)
        with contextlib.suppress(OSError, ValueError):
            if entry:
                table = np.load(f"{entry[1]}.rows{T}.npy", mmap_mode="r", allow_pickle=False)
                if (
                    table.dtype == np.int64
                    and table.ndim == 2
                    and table.shape[1] == 2
                    and len(table)
                    and table[0, 0] == 0
                    and int(table[-1, 0] + table[-1, 1]) == n_tokens - 1
                ):
                    return table
        return None

    def store(self, path: str, suffix: str, data: bytes | np.ndarray) -> bool:
        """data (an array as .npy) into this path's entry of that suffix, atomically; entries of the path's
        earlier identities with the same suffix are deleted. False where the folder cannot take it."""
        entry = self._entry(path)
        if entry is None:
            return False
        target = entry[1] + suffix
        try:
            os.makedirs(self.folder, exist_ok=True)
            write_atomically(
                target,
                lambda f: np.save(f, data, allow_pickle=False) if isinstance(data, np.ndarray) else f.write(data),
                fsync_file=False,
                fsync_folder=False,
                tmp=f"{target}.{os.getpid()}.tmp",  # (ranks of a node store at once)
            )
        except OSError:  # a read-only or full home: the run goes on, and scans again next time
            return False
        for old in glob.glob(glob.escape(entry[0]) + "-*" + suffix):
            if old != target:
                with contextlib.suppress(OSError):
                    os.remove(old)
        return True


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
    paths: list[str],
    shards: list[np.ndarray],
    recorded_max_ids: list,
    T: int | None,
    build_rows,
    what: str,
    progress: bool,
) -> tuple[list[int], list[np.ndarray] | None]:
    """(every shard's largest token id, every shard's row table build_rows(tokens, T), or None without T):
    from fineweb.py's manifest (recorded_max_ids) and the cache where they are, else scanned, once, and kept.
    Under torchrun every rank calls this with the same paths and gets every shard's results."""
    cache, n = ScanCache(), len(paths)
    kept = [shard.size >= MIN_CACHED_TOKENS for shard in shards]
    max_ids = [
        m if isinstance(m, int) else (cache.max_id(p) if k else None) for p, m, k in zip(paths, recorded_max_ids, kept)
    ]
    tables = [cache.rows(p, T, s.size) if T and k else None for p, s, k in zip(paths, shards, kept)] if T else None
    need = [i for i in range(n) if max_ids[i] is None or (T and tables[i] is None)]
    rank, world = _ranks()
    if world > 1:  # the same split on every rank, whatever each one's cache holds
        need = sorted(set().union(*_all_gather(need)))
    if not need:
        return max_ids, tables
    mine = need[rank::world]
    share = f" over {world} ranks, rank 0's share" if world > 1 else ""
    bar = Progress(
        f"{what}: scanning {len(need)} shards{share} (token ids{', row tables' if T else ''})",
        len(mine),
        progress and rank == 0,
    )
    found = {}  # i -> (largest id, whether its row table is in the cache)
    for done, i in enumerate(mine, 1):
        tokens = shards[i]
        largest = max_ids[i] if max_ids[i] is not None else (int(tokens.max()) if tokens.size else 0)
        if kept[i] and max_ids[i] is None:
            cache.store(paths[i], ".max_id", str(largest).encode())
        max_ids[i], cached = largest, bool(T) and tables[i] is not None  # (already in this rank's cache)
        if T and tables[i] is None:
            table = build_rows(tokens, T)
            cached = kept[i] and cache.store(paths[i], f".rows{T}.npy", table)
            tables[i] = cache.rows(paths[i], T, tokens.size) if cached else None
            if tables[i] is None:
                tables[i] = table
            # else: memory-mapped, file pages the kernel shares and drops, not the run's own memory
        found[i] = (largest, cached)
        bar.update(done)
    if world == 1:
        return max_ids, tables
    merged = {i: result for part in _all_gather(found) for i, result in part.items()}
    for i, (largest, _) in merged.items():
        max_ids[i] = largest
    if T:
        for i, (_, cached) in merged.items():
            if tables[i] is None and cached:
                tables[i] = cache.rows(paths[i], T, shards[i].size)
        missing = [i for i in need if tables[i] is None]
        if any(_all_gather(bool(missing))):  # some rank cannot read another's cache: send the tables themselves
            sent = {i: np.asarray(tables[i]) for i in mine}
            for part in _all_gather(sent):
                for i, table in part.items():
                    if tables[i] is None:
                        tables[i] = table
    return max_ids, tables
