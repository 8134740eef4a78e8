"""What a run did not write is checked before use: a kept shard scan is a hint (a faulty one scanned again, one
note), manifest.json has one schema check (one line naming the field); a checkpoint --keep-last may not delete, no
thread to start, a MemoryError under ulimit -v: a warning or one line; plot_log.py draws each run of a log apart."""

import errno
import glob
import json
import os
import resource
import shutil
import signal

import numpy as np
import pytest
from conftest import TEXT_FILE, assert_refused, documents, run_command, run_main, tiny_run_args

import fineweb
import train_gpt2 as tg
from trainkit.cli import UserError
from trainkit.data import shard_scan
from trainkit.data import shards as shard_checks
from trainkit.data.shard_writer import read_manifest

# --- the shard-scan cache ------------------------------------------------------------------------------------------
T = 256  # rows of up to 256 targets over documents of ~40 tokens: a table of ~19k rows, built in 0.1 s


@pytest.fixture(scope="module")
def big_shard(tmp_path_factory) -> str:
    """A shard big enough for its scans to be kept: small ids, an <|endoftext|> opening a document every ~40 tokens."""
    path = str(tmp_path_factory.mktemp("data") / "big_train_000001.npy")
    np.save(path, documents(shard_scan.MIN_CACHED_TOKENS + 1000, seed=0))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    return str(tmp_path / "home-cache" / "gpt2-trainer" / "shards")


@pytest.fixture
def time_limit():
    """A read that blocks (a named pipe) fails the test after 60 s instead of hanging it: pytest.fail, not an
    OSError, which a reader could take for a failed read."""
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: pytest.fail("the scan blocked (on a named pipe?)"))
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def entry_of(cache: str, suffix: str) -> str:
    (entry,) = glob.glob(os.path.join(cache, "*" + suffix))
    return entry


def replace(entry: str, how):
    os.remove(entry)
    if how == "fifo":
        os.mkfifo(entry)
    elif how == "link to /dev/zero":
        os.symlink("/dev/zero", entry)
    else:
        with open(entry, "wb") as f:
            f.write(how.encode() if isinstance(how, str) else how)


def forged(tokens: np.ndarray, case: str) -> np.ndarray:
    """A row table the cache could hold in place of aligned_rows(tokens, T), its first and last rows kept."""
    table = tg.aligned_rows(tokens, T).copy()
    if case == "shifted middle rows":  # rows 100..len-100 start 3 tokens later: still consecutive, lengths in 1..T
        table[99, 1] += 3
        table[100:-100, 0] += 3
        table[-101, 1] -= 3
        assert table[99, 1] <= T and table[-101, 1] >= 1
    else:  # "rows longer than T": rows 100..len-100 merged in pairs
        middle = table[100:-100]
        merged = np.stack([middle[0::2, 0], middle[0::2, 1] + np.append(middle[1::2, 1], 0)[: len(middle[0::2])]], 1)
        table = np.concatenate([table[:100], merged, table[-100:]])
        assert table[:, 1].max() > T
    return table


def assert_notes(capsys, shard: str, reason: str, *entries):
    """What was printed is one note per entry (none: nothing), each saying it is scanned again and why."""
    out = capsys.readouterr()
    assert (out.out + out.err).splitlines() == [
        f"note: the kept scan {entry} of {shard} cannot be used ({reason}); scanning the shard again"
        for entry in entries
    ]


# (the kept scan, its fault): the note's reason, {size} the entry's bytes, {bound} what it may hold, {n} the tokens
EITHER = {"fifo": "not a regular file", "link to /dev/zero": "a symbolic link"}
EITHER["oversize"] = "{size} bytes, more than the {bound} such an entry holds"
SEALED = "its digest or token count is not that of its rows"
LONGER = f"its rows are not consecutive rows of 1..{T} targets over the shard's {{n}} tokens"
FAULTS = {
    **{(kind, fault): reason for kind in ("max_id", "rows") for fault, reason in EITHER.items()},
    ("max_id", "not a number"): "not a token id (b'12e3')",
    ("rows", "a byte changed"): SEALED,
    ("rows", "middle rows shifted in place"): SEALED,
    ("rows", "shifted middle rows"): "a row shorter than --seq-len ends where no document starts in the shard",
    ("rows", "rows longer than T"): LONGER,
    ("rows", "writable by the group"): "it is writable by other users",
    ("rows", "another user's"): "it is owned by another user (uid 65534)",
    ("rows", "in a folder others may write"): "its folder is writable by other users",
}


@pytest.mark.parametrize("kind,fault", FAULTS)
def test_a_faulty_kept_scan_is_noted_once_and_scanned_again(big_shard, cache, capsys, time_limit, kind, fault):
    """Forged rows break the seal, or re-sealed fail the check against the shard; what another user owns or may
    write is not trusted, as ssh trusts files (docs/data.md)."""
    rows = kind == "rows"
    tokens = np.load(big_shard, mmap_mode="r")
    n, built = tokens.size, tg.aligned_rows(tokens, T)

    def rescanned():  # as start-up scans: the kept scan read first
        args = [big_shard], [tokens], [None], T if rows else None, tg.aligned_rows, "train shards"
        largest, tables = shard_scan.scan_shards(*args, progress=False)
        assert largest == [int(tokens.max())] and (not rows or np.array_equal(tables[0], built))
        return tables and tables[0]

    rescanned()
    entry = entry_of(cache, f".rows{T}.npy" if rows else ".max_id")
    capsys.readouterr()
    size = 16 * n + 8192 if rows else 1 << 20  # larger than any table of the shard, or than any id as text
    bound = shard_scan.NPY_HEADER_BYTES + 16 * (n + 1) if rows else shard_scan.MAX_ID_BYTES
    noted = [entry_of(cache, ".max_id")] if fault == "in a folder others may write" else []  # (its largest id too)
    if fault in ("shifted middle rows", "rows longer than T"):
        replace(entry, shard_scan.sealed_rows(forged(tokens, fault), T, n))
    elif fault == "middle rows shifted in place":
        kept = np.load(entry, mmap_mode="r+")
        kept[-len(built) :] = forged(tokens, "shifted middle rows")
        kept.flush()
        del kept
    elif fault == "a byte changed":
        data = bytearray(open(entry, "rb").read())
        data[-16 * 1000] ^= 1  # a row's start, 1000 rows from the end
        replace(entry, bytes(data))
    elif fault == "another user's":
        if os.geteuid() != 0:
            pytest.skip("chown needs root")
        os.chown(entry, 65534, -1)
    elif fault in ("writable by the group", "in a folder others may write"):
        os.chmod(*((entry, 0o664) if fault == "writable by the group" else (cache, 0o777)))
    else:
        replace(entry, {"oversize": b"\0" * size if rows else "1" * size, "not a number": "12e3"}.get(fault, fault))
    rescanned()
    assert_notes(capsys, big_shard, FAULTS[kind, fault].format(size=size, bound=bound, n=n), *noted, entry)
    assert oct(os.stat(entry).st_mode & 0o022) == oct(os.stat(cache).st_mode & 0o022) == "0o0"  # (stored again)
    if fault == "another user's":
        os.chown(entry, os.geteuid(), -1)
    table = rescanned()  # rebuilt (or trusted again): read back without a word
    assert_notes(capsys, big_shard, "")
    assert not rows or isinstance(table, np.memmap)


# --- manifest.json: one schema check, for the trainer and for a resumed fineweb.py -----------------------------------
@pytest.fixture(scope="module")
def made(tmp_path_factory) -> str:
    """A data set fineweb.py made (its manifest lists data_val_000000.npy and train shards 1..): read, not changed."""
    out = str(tmp_path_factory.mktemp("made") / "data")
    argv = ["--files", str(TEXT_FILE), "--doc-per-file", "--out-dir", out, "--shard-size", "4000", "--workers", "1"]
    assert fineweb.main(argv) == 0
    return out


def with_field(manifest: dict, case: str) -> dict:
    shards = manifest["shards"]
    second = lambda key, value: {**manifest, "shards": [shards[0], {**shards[1], key: value}, *shards[2:]]}
    return {
        "not an object": [manifest],
        "shards an object": {**manifest, "shards": {s["file"]: s for s in shards}},
        "complete as text": {**manifest, "complete": "false"},
        "no complete": {k: v for k, v in manifest.items() if k != "complete"},
        "an entry a list": {**manifest, "shards": [shards[0], list(shards[1].values())]},
        "file a list": second("file", [shards[1]["file"]]),
        "file a path": second("file", "../" + shards[1]["file"]),
        "bytes as text": second("bytes", str(shards[1]["bytes"])),
        "bytes a fraction": second("bytes", shards[1]["bytes"] + 0.5),
        "bytes true": second("bytes", True),
        "sha256 not 64 hex digits": second("sha256", shards[1]["sha256"][:63] + "g"),
        "max_id beyond uint16": second("max_id", 70000),
        "max_id of 4,001 digits": second("max_id", 10**4000),
        "file listed twice": second("file", shards[0]["file"]),
    }[case]


MANIFEST_CASES = {
    "not an object": "it holds a list, not an object",
    "shards an object": "field shards is an object, not a list of shards",
    "complete as text": "field complete is the text 'false', not true or false",
    "no complete": "no field complete",
    "an entry a list": "field shards[1] is a list, not an object",
    "file a list": "field shards[1].file is a list, not a file name in the folder",
    "file a path": "field shards[1].file is the text '../data_train_000001.npy', not a file name in the folder",
    "bytes as text": "field shards[1].bytes is the text '{bytes}', not a whole number of bytes",
    "bytes a fraction": "field shards[1].bytes is the number {bytes}.5, not a whole number of bytes",
    "bytes true": "field shards[1].bytes is true, not a whole number of bytes",
    "sha256 not 64 hex digits": "field shards[1].sha256 is the text '{sha}', not 64 hexadecimal digits or null",
    "max_id beyond uint16": "field shards[1].max_id is the number 70000, not a token id (0..65535) or null",
    # a huge number cut in the line (cli.clipped, as every message quotes one): before, all 4 KB of it
    "max_id of 4,001 digits": f"field shards[1].max_id is the number 1{'0' * 23}... (4001 characters), not a token id "
    "(0..65535) or null",
    "file listed twice": "field shards[1].file names 'data_val_000000.npy' a second time",
}


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_a_manifest_of_other_types_is_refused_naming_the_field(made, tmp_path, case):
    """The trainer and a resumed fineweb.py (read_manifest) both refuse it in one line naming the field (before,
    taken for another tool's file: its shards unchecked)."""
    data = shutil.copytree(made, tmp_path / "data")  # to change
    manifest = json.loads((data / "manifest.json").read_text())
    path = data / "manifest.json"
    assert read_manifest(str(path)) == manifest  # as fineweb.py wrote it: both readers take it
    train = [s["file"] for s in manifest["shards"][1:]]
    assert [os.path.basename(p) for p in shard_checks.find_shards(str(data), "train")] == train
    path.write_text(json.dumps(with_field(manifest, case)))
    second = manifest["shards"][1]
    problem = MANIFEST_CASES[case].format(bytes=second["bytes"], sha=second["sha256"][:40])
    with pytest.raises(UserError) as refused:
        shard_checks.find_shards(str(data), "train")
    assert str(refused.value) == (
        f"{path} is not a manifest fineweb.py wrote ({problem}); restore it, re-create the data set with "
        "fineweb.py, or move it out of the folder"
    )
    with pytest.raises(UserError) as refused:
        read_manifest(str(path))
    assert str(refused.value) == f"{path} is not a manifest written by fineweb.py ({problem}); use an empty --out-dir"


@pytest.mark.parametrize("case", ["unreadable", "a shard's bytes of 4,001 digits"])
def test_a_manifest_unreadable_or_listing_a_huge_size_is_one_line_naming_why(made, tmp_path, monkeypatch, case):
    """Unreadable (another user's, mode 600; NFS root squash): before, taken for "no manifest", so an unfinished
    run's shards trained without a word (only a missing one means none). A huge number: before, all in the line."""
    data = shutil.copytree(made, tmp_path / "data")  # to change
    manifest = json.loads((data / "manifest.json").read_text())
    path, shard = data / "manifest.json", data / manifest["shards"][1]["file"]
    if case == "unreadable":
        error = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        monkeypatch.setattr(shard_checks.fileio, "read_json", lambda *args, **kwargs: (_ for _ in ()).throw(error))
        why = f"cannot read {path}: permission denied; the shards it lists cannot be checked: make it readable, or"
        why += " move it out of the folder"
    else:
        manifest["shards"][1]["bytes"] = 10**4000
        path.write_text(json.dumps(manifest))
        why = f"{shard} is {shard.stat().st_size} bytes, not the 1{'0' * 23}... (4001 characters) that {path} lists;"
        why += " restore it, or re-create the data set with fineweb.py"
    with pytest.raises(UserError) as refused:
        shard_checks.find_shards(str(data), "train")
    assert str(refused.value) == why
    monkeypatch.undo()
    assert shard_checks.folder_manifest(str(tmp_path)) is None  # (none there)


# --- cleanups that fail, threads that cannot start ------------------------------------------------------------------
SHARDS = dict(n_docs=300, seed=4)  # the trainer's data (conftest's data_dir)


def test_keep_last_meeting_an_undeletable_checkpoint_warns_once_and_trains_on(data_dir, tmp_path, monkeypatch, capsys):
    """As an immutable file, another user's on NFS or a read-only mount refuse it: before, a PermissionError
    traceback ended the run at its next save."""
    out = tmp_path / "run"
    undeletable = str(out / "ckpt_0000002.pt")
    remove = os.remove

    def refusing(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)) == "ckpt_0000002.pt":  # (named relative to the run's folder, held)
            raise PermissionError(errno.EPERM, "Operation not permitted", undeletable)
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", refusing)
    assert tg.main(tiny_run_args(data_dir, out, "--keep-last", "1", steps=8, ckpt_every=2)) == 0
    assert capsys.readouterr().err == (
        f"warning: --keep-last cannot delete {undeletable} (operation not permitted); it stays, and the run goes on\n"
    )
    kept = sorted(name for name in os.listdir(out) if name.startswith("ckpt_"))
    assert kept == ["ckpt_0000002.pt", "ckpt_0000008.pt"]


def test_a_thread_that_cannot_start_is_one_error_line(data_dir, tmp_path):
    """Under an address-space limit no thread's stack fits in (its stack, ulimit -s, larger than all of ulimit -v):
    before, the prefetcher's first step was a `RuntimeError: can't start new thread` traceback."""
    address_space, stack = 4 << 30, 8 << 30  # bytes: the run needs well under 1 GiB, one thread 8 GiB

    def limited():
        resource.setrlimit(resource.RLIMIT_STACK, (stack, stack))
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    result = run_command("train_gpt2.py", *tiny_run_args(data_dir, tmp_path / "run", steps=2), preexec_fn=limited)
    processes = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    assert_refused(
        result,
        f"cannot start a thread (can't start new thread): each takes its stack (ulimit -s, {stack >> 10} KiB) from "
        f"the address space (ulimit -v, {address_space >> 10} KiB) and counts as a process (ulimit -u, "
        f"{'unlimited' if processes == resource.RLIM_INFINITY else processes}): raise ulimit -v or ulimit -u, or "
        "lower ulimit -s",
    )


@pytest.mark.parametrize("script", ["train_gpt2.py", "fineweb.py"])
def test_a_memory_error_under_ulimit_v_is_one_line_naming_the_limit(data_dir, tmp_path, monkeypatch, script):
    """A lazy import inside torch (as torch.distributed.tensor's): before, `lower --batch-size ...`; fineweb.py's own
    buffers: before, a traceback and exit code 1. (A limit too small for OpenBLAS aborts in C at import: not caught.)"""
    real = resource.getrlimit  # reported as running under `ulimit -v 700000` (KiB), without the limit itself
    monkeypatch.setattr(
        resource, "getrlimit", lambda what: (700000 << 10,) * 2 if what == resource.RLIMIT_AS else real(what)
    )
    if script == "fineweb.py":
        monkeypatch.setattr(fineweb, "chunk_located", lambda *args, **kwargs: (_ for _ in ()).throw(MemoryError()))
        docs = tmp_path / "docs.jsonl"
        docs.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
        args, where = ["--files", docs, "--out-dir", tmp_path / "fw", "--workers", "1"], "on the host"
    else:
        (tmp_path / "needs_memory.py").write_text("raise MemoryError\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setattr(tg, "build_optimizer", lambda *args, **kwargs: __import__("needs_memory"))
        args, where = tiny_run_args(data_dir, tmp_path / "run", steps=2), "while importing a library"
    assert_refused(
        run_main(script, *args),
        f"out of memory {where} (MemoryError): under a memory limit (ulimit -v, 700000 KiB): raise it",
    )


# --- plot_log.py: a log of two runs ---------------------------------------------------------------------------------
def run_records(run: str, steps, loss0: float, resume_at=None, parent=None) -> list:
    records = [dict(step=s, loss=loss0 - 0.1 * s, lr=1e-3, run=run) for s in steps]
    if resume_at is not None:
        records.insert(steps.index(resume_at), dict(event="resume", step=resume_at, run=run, parent=parent))
    return records


def test_plot_log_draws_each_run_of_a_concatenated_log_as_its_own_curve(tmp_path, capsys):
    """`cat a/log.jsonl b/log.jsonl`; a branch (a new run id starting with its resume record) stays its parent's
    curve; a branch of a run not in the log, or a resume naming no parent (an older trainer's), joins nothing."""
    plt = pytest.importorskip("matplotlib.pyplot")
    import plot_log

    a, b, branch, orphan, old = "a" * 32, "b" * 32, "c" * 32, "3" * 32, "4" * 32
    records = run_records(a, list(range(6)), 5.0)  # run a, steps 0..5
    records += run_records(branch, [3, 4, 5], 4.0, resume_at=3, parent=a)  # its branch from step 3 (its log's)
    records += run_records(b, list(range(4)), 9.0)  # run b's log appended: steps 0..3
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = lambda records: [(name, len(rs)) for name, rs in plot_log.runs_of(records)]
    assert runs(records) == [("run aaaaaaaa", 10), ("run bbbbbbbb", 4)]
    unjoined = run_records(orphan, [2, 3, 4, 5], 4.0, resume_at=2, parent="2" * 32)
    unjoined += run_records(old, [4, 5], 3.0, resume_at=4)
    apart = [("run aaaaaaaa", 6), ("run 33333333", 5), ("run 44444444", 3)]
    assert runs(run_records(a, list(range(6)), 5.0) + unjoined) == apart
    fig = plot_log.make_figure(records, smooth=0)
    try:
        lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
        curve = lambda run: [(x, y) for x, y in zip(*lines[f"train loss (run {run * 8})"].get_data())]
        assert curve("a") == [(s, 5.0 - 0.1 * s) for s in (0, 1, 2)] + [(s, 4.0 - 0.1 * s) for s in (3, 4, 5)]
        assert curve("b") == [(s, 9.0 - 0.1 * s) for s in range(4)]
        assert [line.get_xdata()[0] for line in lines.values() if line.get_label() == "resumed"] == [3]
        title = ["run aaaaaaaa: train loss 3.5000 (step 5)", "run bbbbbbbb: train loss 8.7000 (step 3)"]
        assert fig._suptitle.get_text().splitlines() == title
    finally:
        plt.close(fig)
    assert plot_log.main([str(log), "-o", str(tmp_path / "both.png")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'both.png'}\n"
