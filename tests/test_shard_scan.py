"""Start-up's passes over every token (the largest token id, --align-docs row tables) run once per shard and
are kept in a cache folder outside the data folder: a second launch reads them instead (the same rows and
losses), a read-only data folder still starts, a shard that changed is scanned again, and a cache folder
that cannot be written only costs the scan. The memory a run reports is its own, the mapped shards' pages
apart."""

import os
import re
import stat

import numpy as np
import pytest
from conftest import run_cli, run_main, tree_hashes
from shards import EOT

import train_gpt2 as tg
from trainkit.runtime import device
from trainkit.data import shard_scan
from trainkit.data.shards import no_output_for

T = 16
BIG = shard_scan.MIN_CACHED_TOKENS + 1000  # tokens of a shard whose scans are kept


def documents(n_tokens: int, seed: int) -> np.ndarray:
    """n_tokens of small ids with an <|endoftext|> opening a document every ~40 tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, n_tokens).astype(np.uint16)
    tokens[rng.integers(0, n_tokens, n_tokens // 40)] = EOT
    tokens[0] = EOT
    return tokens


def train_args(data_dir, out_dir, *extra):
    """Two steps of 8 rows of --align-docs (4 rows x 2 ranks, or x 2 micro-steps on one) of a 1-layer model."""
    flags = "--n-layer 1 --n-head 1 --n-embd 16 --block-size 16 --batch-size 4 --max-steps 2 --val-every 0"
    flags += (
        f" --sample-every 0 --hellaswag-every 0 --ckpt-every 0 --align-docs --seq-len {T} --total-batch-size {8 * T}"
    )
    return ["--data-dir", str(data_dir), "--out-dir", str(out_dir), *flags.split(), *extra]


def step_losses(stdout: str) -> list[str]:
    return re.findall(r"^step\s+\d+/\d+ \| loss (\S+)", stdout, re.MULTILINE)


def kept(cache_home) -> list[str]:
    folder = os.path.join(cache_home, "gpt2-trainer", "shards")
    return sorted(re.sub(r"^\w+-\w+", "", name) for name in os.listdir(folder)) if os.path.isdir(folder) else []


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The one launch: torchrun's two ranks on a read-only folder of a small val shard and two train shards big
    enough for their scans to be kept, the cache empty: (data folder, its files' hashes before, cache home, run)."""
    folder = tmp_path_factory.mktemp("scans")
    data, cache = folder / "data", folder / "cache"
    data.mkdir()
    np.save(data / "big_val_000000.npy", documents(20_000, seed=1))
    for i in (1, 2):
        np.save(data / f"big_train_{i:06d}.npy", documents(BIG, seed=i + 1))
    for path in [*data.iterdir(), data]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    before = tree_hashes(data)
    run = run_cli(train_args(data, folder / "two"), nproc=2, env={"XDG_CACHE_HOME": str(cache)})
    assert run.returncode == 0, run.stderr
    return data, before, cache, run


def test_ranks_split_the_first_scan_of_a_read_only_folder_and_another_process_reads_it(two_ranks, tmp_path):
    """The ranks scan the shards between them and keep each scan once (the val shard is too small to keep); a
    later process reads them, a run whose cache folder cannot be written scans again: one process trains on the
    rows the two ranks did, and nothing in the read-only data folder changed."""
    data, before, cache, two = two_ranks
    assert kept(cache) == [".max_id", ".max_id", ".rows16.npy", ".rows16.npy"]
    stamps = {
        name: os.stat(cache / "gpt2-trainer" / "shards" / name).st_mtime_ns
        for name in os.listdir(cache / "gpt2-trainer" / "shards")
    }
    cached = run_main("train_gpt2.py", *train_args(data, tmp_path / "a"), env={"XDG_CACHE_HOME": str(cache)})
    assert cached.returncode == 0, cached.stderr
    assert {name: os.stat(cache / "gpt2-trainer" / "shards" / name).st_mtime_ns for name in stamps} == stamps
    (tmp_path / "a-file").write_text("")
    uncached = run_main(
        "train_gpt2.py", *train_args(data, tmp_path / "b"), env={"XDG_CACHE_HOME": str(tmp_path / "a-file" / "x")}
    )
    assert uncached.returncode == 0, uncached.stderr
    assert len(step_losses(two.stdout)) == 2
    assert step_losses(two.stdout) == step_losses(cached.stdout) == step_losses(uncached.stdout)
    assert tree_hashes(data) == before
    assert re.search(
        r"\| peak memory \d+\.\d\d GiB private \(\+ \d+\.\d\d GiB of mapped shard pages, shared page cache\)$",
        two.stdout,
        re.MULTILINE,
    ), two.stdout


def test_a_shard_that_changed_since_its_scan_was_kept_is_scanned_again(tmp_path):
    data, cache_home = tmp_path / "data", {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    data.mkdir()
    np.save(data / "big_val_000000.npy", documents(20_000, seed=1))
    np.save(data / "big_train_000001.npy", documents(BIG, seed=2))
    first = run_main("train_gpt2.py", *train_args(data, tmp_path / "a"), env=cache_home)
    assert first.returncode == 0, first.stderr
    assert kept(tmp_path / "cache") == [".max_id", ".rows16.npy"]
    shard = data / "big_train_000001.npy"
    tokens = np.load(shard)
    tokens[12345] = 50300  # an id GPT-2's softmax has no output for; same size
    np.save(shard, tokens)
    second = run_main("train_gpt2.py", *train_args(data, tmp_path / "b"), env=cache_home)
    assert second.returncode == 2
    assert second.stderr.strip().splitlines()[-1] == "error: " + no_output_for(str(shard), 50300, 50304)


def test_scans_are_kept_per_shard_and_redone_only_for_the_shard_that_changed(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    paths = []
    for i in range(2):
        paths.append(str(tmp_path / f"s_train_{i:06d}.npy"))
        np.save(paths[-1], documents(BIG, seed=i))
    built = []

    def build_rows(tokens, T):
        built.append(len(built))
        return tg.aligned_rows(tokens, T)

    def scan():
        shards = [np.load(p, mmap_mode="r") for p in paths]
        return shards, shard_scan.scan_shards(paths, shards, [None, None], T, build_rows, "train", progress=False)

    shards, (largest, tables) = scan()
    assert len(built) == 2 and largest == [int(s.max()) for s in shards]
    shards, (largest_again, tables_again) = scan()
    assert len(built) == 2 and largest_again == largest  # read back, not scanned
    assert all(
        isinstance(t, np.memmap) and np.array_equal(t, tg.aligned_rows(s, T)) for t, s in zip(tables_again, shards)
    )
    tokens = np.load(paths[1])
    tokens[1:2000] = 5  # one long document: other rows
    np.save(paths[1], tokens)
    shards, (largest, tables) = scan()
    assert len(built) == 3  # the changed shard only
    assert np.array_equal(tables[1], tg.aligned_rows(shards[1], T)) and not np.array_equal(tables[1], tables_again[1])
    assert (
        len(os.listdir(tmp_path / "cache" / "gpt2-trainer" / "shards")) == 4
    )  # the changed shard's old entries are gone


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


def test_a_long_scan_prints_its_progress(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(shard_scan, "PROGRESS_AFTER_S", 0.0)
    paths = [str(tmp_path / f"s_train_{i:06d}.npy") for i in range(2)]
    for i, path in enumerate(paths):
        np.save(path, documents(1000, seed=i))
    shards = [np.load(p, mmap_mode="r") for p in paths]
    shard_scan.scan_shards(paths, shards, [None, None], T, tg.aligned_rows, "train shards", progress=True)
    lines = [re.sub(r", \d+ s$", ", N s", line) for line in capsys.readouterr().err.splitlines()]
    assert lines == [
        "train shards: scanning 2 shards (token ids, row tables): 1/2 shards, N s",
        "train shards: scanning 2 shards (token ids, row tables): 2/2 shards, N s",
    ]
