"""Start-up's passes over every token (the largest token id, --align-docs row tables) run once per shard and are
kept in a cache folder outside the data folder, redone for a shard that changed; the memory a run reports is its own,
the mapped shards' pages apart. (Two ranks splitting the first scan of a read-only folder, a later process reading
it and an unwritable cache folder: a case of test_ranks' launch.)"""

import re

import numpy as np
from conftest import SCAN_T as T, documents, kept_scans

import train_gpt2 as tg
from trainkit.runtime import device
from trainkit.data import shard_scan

BIG = shard_scan.MIN_CACHED_TOKENS + 1000  # tokens of a shard whose scans are kept


def test_scans_are_kept_per_shard_and_redone_only_for_the_shard_that_changed(tmp_path, monkeypatch, capsys):
    """Each shard's scans are kept apart and redone for the one that changed only (its largest id too: an id the
    model has no output for is not hidden by a kept scan); a scan prints its progress (here at once), a read-back
    nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(shard_scan, "PROGRESS_AFTER_S", 0.0)
    paths = [str(tmp_path / f"s_train_{i:06d}.npy") for i in range(2)]
    for i, path in enumerate(paths):
        np.save(path, documents(BIG, seed=i))
    built = []

    def build_rows(tokens, T):
        built.append(len(built))
        return tg.aligned_rows(tokens, T)

    def scan():
        shards = [np.load(p, mmap_mode="r") for p in paths]
        return shards, shard_scan.scan_shards(paths, shards, [None, None], T, build_rows, "train shards", progress=True)

    shards, (largest, tables) = scan()
    assert len(built) == 2 and largest == [int(s.max()) for s in shards]
    shards, (largest_again, tables_again) = scan()
    assert len(built) == 2 and largest_again == largest  # read back, not scanned
    assert all(
        isinstance(t, np.memmap) and np.array_equal(t, tg.aligned_rows(s, T)) for t, s in zip(tables_again, shards)
    )
    tokens = np.load(paths[1])
    tokens[1:2000], tokens[12345] = 5, 50300  # one long document: other rows; an id past GPT-2's 50304 outputs
    np.save(paths[1], tokens)  # (the same size)
    shards, (largest, tables) = scan()
    assert len(built) == 3 and largest == [largest_again[0], 50300]  # the changed shard only
    assert np.array_equal(tables[1], tg.aligned_rows(shards[1], T)) and not np.array_equal(tables[1], tables_again[1])
    assert len(kept_scans(tmp_path / "cache")) == 4  # the changed shard's old entries are gone
    lines = [re.sub(r", \d+ s$", ", N s", line) for line in capsys.readouterr().err.splitlines()]
    assert lines == [
        "train shards: scanning 2 shards (token ids, row tables): 1/2 shards, N s",
        "train shards: scanning 2 shards (token ids, row tables): 2/2 shards, N s",
        "train shards: scanning 1 shards (token ids, row tables): 1/1 shards, N s",
    ]


def test_the_reported_peak_is_private_memory_and_mapped_shard_pages_are_apart(tmp_path):
    path = tmp_path / "s_train_000000.npy"
    written = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(32 << 20,))  # 64 MiB, file pages
    written[:] = 1
    written.flush()
    del written
    report = re.compile(r"(\d+\.\d\d) GiB private(?: \(\+ (\d+\.\d\d) GiB of mapped shard pages, shared page cache\))?")
    device.watch_peak()
    private_before = float(report.fullmatch(device.peak_report())[1])
    mapped_before = device.mapped_data_kib()
    tokens = np.load(path, mmap_mode="r")
    assert int(tokens.sum(dtype=np.int64)) == 32 << 20  # every page read
    assert 63 < (device.mapped_data_kib() - mapped_before) / 1024 < 65
    private, mapped = report.fullmatch(device.peak_report()).groups()
    assert float(private) - private_before < 0.03  # not the 0.06 GiB just mapped
    assert float(mapped) >= 0.06  # 64 MiB, to two digits
    del tokens
