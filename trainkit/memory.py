"""The host memory a run reports as its own, apart from the token shards' pages it maps.

A process's RSS (and its peak, ru_maxrss / VmHWM) counts the pages of every file it maps: a run that
reads 10B tokens of memory-mapped shards shows ~20 GB of RSS that are the kernel's page cache, shared
with every other process and dropped under pressure, not memory the run needs. The run's own memory is
its anonymous (private) memory, RssAnon in /proc/self/status; the kernel keeps no peak of it alone, so
watch_peak() samples it every SAMPLE_EVERY_S on a daemon thread (a spike shorter than that can be missed)
and peak_report() adds a last sample. The mapped data pages (.bin / .npy files: shards, kept row tables)
are summed from /proc/self/smaps and reported apart. Where /proc is not there (macOS), the peak RSS.
Runs nothing at import."""
from __future__ import annotations

import contextlib
import threading

SAMPLE_EVERY_S = 0.05
DATA_SUFFIXES = (".bin", ".npy")


def _status_kib(key: str) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


class _PeakWatch:
    def __init__(self):
        self.peak_kib = 0
        self.thread = None

    def sample(self) -> bool:
        kib = _status_kib("RssAnon")
        if kib is None:
            return False
        self.peak_kib = max(self.peak_kib, kib)
        return True

    def start(self):
        if self.thread is None and self.sample():
            self.thread = threading.Thread(target=self._run, name="memory watch", daemon=True)
            self.thread.start()

    def _run(self):
        stop = threading.Event()  # never set: the thread ends with the process
        while not stop.wait(SAMPLE_EVERY_S):
            self.sample()


_watch = _PeakWatch()


def watch_peak():
    """Start sampling this process's private memory (once; a no-op where /proc is not there)."""
    _watch.start()


def mapped_data_kib() -> int:
    """Resident pages of the mapped .bin / .npy files (token shards, kept row tables), in KiB."""
    total, counting = 0, False
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header: address range ... path
                counting = line.rstrip().endswith(DATA_SUFFIXES)
            elif counting and first == "Rss:":
                total += int(line.split()[1])
    return total


def peak_report() -> str:
    """"X GiB private (+ Y GiB of mapped shard pages, shared)": the run's own peak, and the data pages
    it maps apart; the peak RSS where /proc is not there."""
    if not _watch.sample():
        import resource
        import sys
        scale = 2**30 if sys.platform == "darwin" else 2**20  # ru_maxrss: bytes on macOS, KiB on Linux
        return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale:.2f} GiB RSS"
    mapped = mapped_data_kib()
    shards = f" (+ {mapped / 2**20:.2f} GiB of mapped shard pages, shared page cache)" if mapped else ""
    return f"{_watch.peak_kib / 2**20:.2f} GiB private{shards}"
