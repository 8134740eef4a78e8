"""What a tool writes lands only where it means to: a link or a shared file at a writer's temporary or target name
is replaced, never written through; a --out-dir moved and replaced mid-run stops the writer, naming both folders,
with nothing written into the other; a refused resume or restart leaves its folder byte for byte as it was."""

import contextlib
import json
import os
import shutil
import subprocess
import threading

import pytest

import fineweb
import hf_interop
import plot_log
import train_gpt2 as tg
from conftest import RUN_SHARDS, assert_one_error_line, assert_refused, run_main, tiny_run_args, trained_steps
from conftest import log_records, tree_hashes
from trainkit.runfiles import resume
from trainkit.runfiles.run_folder import OutDirLock, prepare_out_dir
from trainkit.data.shard_scan import ScanCache

SHARDS = RUN_SHARDS  # the shared finished run's data
OUTSIDE = b"a file of someone else's, outside every folder a tool writes\n"


@pytest.fixture
def outside(tmp_path):
    """A file outside every folder a tool writes here, that links get planted to: its bytes must stay."""
    path = tmp_path / "outside" / "theirs.bin"
    path.parent.mkdir()
    path.write_bytes(OUTSIDE)
    return path


@pytest.fixture
def docs(tmp_path):
    """40 documents for fineweb.py --files: two shards of --shard-size 1000."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    return path


def fineweb_args(docs, out):
    return ["--files", str(docs), "--out-dir", str(out), "--shard-size", "1000", "--workers", "1"]


@contextlib.contextmanager
def attribute(path, flag):
    """path given the attribute flag ("a": append-only, "i": immutable; chattr, as root), cleared after."""
    if os.geteuid() != 0 or subprocess.run(["chattr", f"+{flag}", str(path)], capture_output=True).returncode:
        pytest.skip(f"chattr +{flag} needs root and a file system with attributes")
    try:
        yield
    finally:
        subprocess.run(["chattr", f"-{flag}", str(path)], check=True)


def test_copies_of_a_run_resumed_and_branched_leave_the_original_as_it_was(finished_copy, data_dir, tmp_path, outside):
    """runA (and what a kill mid-save leaves) copied by cp -al to runB, runC and by cp -as to runD, links to outside
    at the write probe and lock note of runB, runD: resuming runB, branching runC (--keep-last) and runD at step 2
    move only their own names; runA and outside keep every byte, and runA goes on."""
    run_a, run_b, run_c, run_d = finished_copy, tmp_path / "runB", tmp_path / "runC", tmp_path / "runD"
    (run_a / "ckpt_0000006.pt.tmp").write_bytes(b"PK\x03\x04 half a checkpoint")
    (run_a / "log.jsonl.tmp").write_bytes(b'{"step": 0, "half a log')
    for copy, run in [("cp -al", run_b), ("cp -as", run_d)]:  # (runC after runB's resume: one other name)
        subprocess.run([*copy.split(), str(run_a), str(run)], check=True)
    for run in (run_b, run_d):
        os.symlink(outside, run / f".write_test_{os.getpid()}")
        os.symlink(outside, run / f".lock.{os.getpid()}.tmp")
    for name in ("log.jsonl", "ckpt_0000002.pt", "ckpt_0000004.pt"):
        os.remove(run_d / name)
        os.symlink(os.path.join("..", "run", name), run_d / name)
    before = tree_hashes(run_a)

    def resumed(run, *flags):
        result = run_main("train_gpt2.py", *tiny_run_args(data_dir, run, "--resume", *flags, steps=6, ckpt_every=2))
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout.splitlines()

    note = "note: {}/log.jsonl was a {}: this run writes to a copy of its own, and the file it shared stays as it was"
    assert note.format(run_b, "hard link to a file with 1 other name (as `cp -al` makes)") in resumed(run_b)
    assert tree_hashes(run_a) == before and outside.read_bytes() == OUTSIDE
    assert os.path.isfile(run_b / "ckpt_0000006.pt") and not os.path.islink(run_b / "ckpt_0000006.pt")
    assert trained_steps(run_b) == list(range(6)) and trained_steps(run_a) == list(range(4))
    # runB goes on as a branch of runA's run, at the step it was copied at
    first, branch = (resume.read_run(str(p)) for p in (run_a / "ckpt_0000004.pt", run_b / "ckpt_0000006.pt"))
    assert branch == dict(id=branch["id"], parent=dict(first, step=4)) and branch["id"] != first["id"]
    subprocess.run(["cp", "-al", str(run_a), str(run_c)], check=True)
    resumed(run_c, run_c / "ckpt_0000002.pt", "--keep-last", "1")
    assert sorted(os.listdir(run_c)) == ["branch_0000004", "ckpt_0000006.pt", "log.jsonl"]
    assert tree_hashes(run_a) == before
    # runD: the later checkpoint's link, set aside into the branch folder, still names runA's file
    assert note.format(run_d, "symbolic link to ../run/log.jsonl") in resumed(run_d, run_d / "ckpt_0000002.pt")
    assert tree_hashes(run_a) == before and outside.read_bytes() == OUTSIDE
    assert not os.path.islink(run_d / "log.jsonl") and trained_steps(run_d) == list(range(6))
    assert not any(os.path.islink(run_d / f"ckpt_{step:07d}.pt") for step in (4, 6))
    assert os.path.samefile(run_d / "branch_0000004" / "ckpt_0000004.pt", run_a / "ckpt_0000004.pt")
    # runA can still resume: its log is as its checkpoints recorded it, and its own (the copies copied theirs)
    assert not any("hard link" in line for line in resumed(run_a)) and trained_steps(run_a) == list(range(6))


@pytest.mark.parametrize("writer", ["fineweb.py", "shard scan cache", "plot_log.py", "lm-eval samples"])
def test_a_link_planted_where_a_writer_writes_is_replaced(finished_copy, tmp_path, outside, docs, monkeypatch, writer):
    """A link to a file outside at fineweb.py's shard and manifest temporaries (NAME.tmp), ScanCache.store's
    (ENTRY.PID.tmp), plot_log.py's loss.png or eval --samples-dir's TASK.jsonl: each written as a new file."""
    if writer == "fineweb.py":
        out = tmp_path / "shards"
        out.mkdir()
        for name in ("data_val_000000.npy", "data_train_000001.npy", "manifest.json"):
            os.symlink(outside, out / f"{name}.tmp")
        assert fineweb.main(fineweb_args(docs, out)) == 0
        written = sorted(out.iterdir())
        assert [p.name for p in written] == ["data_train_000001.npy", "data_val_000000.npy", "manifest.json"]
        listed = [(s["file"], s["bytes"]) for s in json.loads((out / "manifest.json").read_text())["shards"]]
        assert listed == [(p.name, p.stat().st_size) for p in (written[1], written[0])]  # val, then train
    elif writer == "shard scan cache":
        shard = tmp_path / "shard.bin"
        shard.write_bytes(b"\0" * 64)
        cache = ScanCache(str(tmp_path / "cache"))
        os.makedirs(cache.folder)
        written = [cache._entry(str(shard))[1] + ".max_id"]
        os.symlink(outside, f"{written[0]}.{os.getpid()}.tmp")
        assert cache.store(str(shard), ".max_id", b"50256")
        assert cache.max_id(str(shard)) == 50256 and os.listdir(cache.folder) == [os.path.basename(written[0])]
    elif writer == "plot_log.py":
        written = [finished_copy / "loss.png"]
        os.symlink(outside, written[0])
        assert plot_log.main([str(finished_copy)]) == 0
        assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert sorted(os.listdir(finished_copy)) == ["ckpt_0000002.pt", "ckpt_0000004.pt", "log.jsonl", "loss.png"]
    else:  # (lm-eval itself stands in: what it returns is what the samples are made of)
        lm_eval_utils = pytest.importorskip("lm_eval.utils")
        sample = dict(doc_id=0, target=1, filtered_resps=[[-1.5, False], [-0.5, True]], metrics=["acc"], acc=1.0)
        evaluated = dict(samples=dict(hellaswag=[sample]), results=dict(hellaswag={"acc,none": 1.0}))
        monkeypatch.setattr(hf_interop, "lm_eval_results", lambda *args, **kwargs: evaluated)
        monkeypatch.setattr(lm_eval_utils, "make_table", lambda out: "the table")
        written = [tmp_path / "samples" / "hellaswag.jsonl"]
        written[0].parent.mkdir()
        os.symlink(outside, written[0])
        args = ["eval", str(tmp_path / "ckpt.pt"), "--tasks", "hellaswag", "--samples-dir", str(written[0].parent)]
        assert hf_interop.main(args) == 0
        assert json.loads(written[0].read_text()) == dict(doc_id=0, target=1, loglikelihoods=[-1.5, -0.5], acc=1.0)
    assert outside.read_bytes() == OUTSIDE and not any(os.path.islink(path) for path in written)


@pytest.mark.parametrize("out", ["r2/", "r2", "r2/.png", "r2/..", "nofolder/.svg"])
def test_a_plot_named_by_a_folder_or_an_extension_alone_is_refused(finished_run, tmp_path, capsys, out):
    """-o naming a folder (with or without its separator) or an extension alone: nothing written (no r2/.png)."""
    (tmp_path / "r2").mkdir()
    before = tree_hashes(tmp_path, folders=True)
    out = f"{tmp_path}/{out}"  # (as typed: pathlib would drop the trailing separator)
    assert plot_log.main([str(finished_run), "-o", out]) == 2
    assert capsys.readouterr().err.startswith(f"error: -o {out} names a folder or an extension alone")
    assert tree_hashes(tmp_path, folders=True) == before


def test_a_run_folder_swapped_mid_run_stops_it_and_nothing_lands_in_the_other(data_dir, tmp_path, monkeypatch):
    """`mv RUN RUN.moved; ln -s OTHER RUN` after the second checkpoint: the next save stops the run."""
    run, moved, other = tmp_path / "RUN", tmp_path / "RUN.moved", tmp_path / "OTHER"
    other.mkdir()
    (other / "notes.txt").write_text("another folder of the user's\n")
    before = tree_hashes(other, folders=True)
    train_step = tg.Trainer.train_step

    def swapping_after_the_second_checkpoint(trainer, step):
        if step == 10:
            os.rename(run, moved)
            os.symlink(other, run)
        return train_step(trainer, step)

    monkeypatch.setattr(tg.Trainer, "train_step", swapping_after_the_second_checkpoint)
    result = run_main("train_gpt2.py", *tiny_run_args(data_dir, run, steps=16, ckpt_every=4, n_layer=1))
    assert tree_hashes(other, folders=True) == before, result.stderr[-3000:]
    assert_one_error_line(
        result,
        f"--out-dir {run} was moved or replaced while this run wrote to it: the folder it took is now {moved}, "
        f"and {run} names {other}; stopping, so that nothing of this run is written there. "
        f"Last good checkpoint: {moved / 'ckpt_0000008.pt'}",
    )
    assert trained_steps(moved) == list(range(12)) and os.path.islink(run)


def test_fineweb_out_dir_swapped_mid_run_stops_it_and_nothing_lands_in_the_other(tmp_path, monkeypatch, docs):
    """fineweb.py's --out-dir replaced by a link to another data set after its first shard: the next stops it."""
    out, moved, other = tmp_path / "fw", tmp_path / "fw.moved", tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text('{"another": "data set"}\n')
    (other / "data_val_000000.npy").write_bytes(b"another data set's shard")
    before = tree_hashes(other, folders=True)
    real_finish = fineweb.ShardWriter.finish_shard

    def finish_then_swap(writer, *args, **kwargs):
        real_finish(writer, *args, **kwargs)
        if not os.path.lexists(moved):
            os.rename(out, moved)
            os.symlink(other, out)

    monkeypatch.setattr(fineweb.ShardWriter, "finish_shard", finish_then_swap)
    result = run_main("fineweb.py", *fineweb_args(docs, out))
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == (  # (after tqdm's progress bar)
        f"error: --out-dir {out} was moved or replaced while fineweb.py wrote to it: the folder it took is now "
        f"{moved}, and {out} names {other}; stopping, so that nothing is written there; run the same command on "
        "the folder it took to resume"
    )
    assert tree_hashes(other, folders=True) == before
    assert sorted(os.listdir(moved)) == ["data_val_000000.npy", "manifest.json"]
    assert [s["file"] for s in json.loads((moved / "manifest.json").read_text())["shards"]] == ["data_val_000000.npy"]


def test_a_stopped_writer_removes_only_the_folder_it_made_never_one_put_at_its_name(tmp_path, monkeypatch, docs):
    """A run (OutDirLock) and fineweb.py, their --out-dir moved and an empty one made at its name."""
    out, moved = tmp_path / "run", tmp_path / "run.moved"
    lock = OutDirLock(str(out))
    lock.made = prepare_out_dir(str(out))
    lock.acquire()
    os.rename(out, moved)
    out.mkdir()
    lock.release()
    assert out.is_dir() and os.listdir(moved) == []

    fw, fw_moved = tmp_path / "new" / "fw", tmp_path / "fw.moved"

    def swap_then_fail(*args, **kwargs):
        os.rename(tmp_path / "new", fw_moved)
        fw.mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(fineweb, "write_shards", swap_then_fail)
    result = run_main("fineweb.py", *fineweb_args(docs, fw))
    assert result.returncode == 130 and fw.is_dir() and sorted(os.listdir(fw_moved)) == ["fw"]
    assert os.listdir(fw_moved / "fw") == []


def test_an_export_leaves_a_folder_that_only_looks_like_its_partial_folder(finished_copy, tmp_path):
    """An unmarked .gpt2.export-DATE: beside the target, left; inside it, the target is refused as the user's."""
    out = tmp_path / "ex" / "gpt2"
    for backup in (out.parent / ".gpt2.export-20240101", out / ".gpt2.export-20240102"):
        backup.mkdir(parents=True)
        (backup / "important.txt").write_text("my notes\n")
    os.rename(out / ".gpt2.export-20240102", tmp_path / "aside")  # (first: beside only)
    result = run_main("hf_interop.py", "export", finished_copy / "ckpt_0000004.pt", out)
    assert result.returncode == 0 and "removed" not in result.stderr, result.stderr
    assert (out.parent / ".gpt2.export-20240101" / "important.txt").read_text() == "my notes\n"
    shutil.rmtree(out)
    out.mkdir()
    os.rename(tmp_path / "aside", out / ".gpt2.export-20240102")
    result = run_main("hf_interop.py", "export", finished_copy / "ckpt_0000004.pt", out)
    assert_one_error_line(result, f"{out} is not empty and is not an export of hf_interop.py")
    assert (out / ".gpt2.export-20240102" / "important.txt").read_text() == "my notes\n"


WRITES_THROUGH = (
    "holds a folder {name}, at the name this trainer writes a new {written} through: that write would fail, after "
    "the steps before it were trained; move it away, or choose another --out-dir"
)
AT_A_NAME = {  # a folder at a name the trainer writes: the line
    "ckpt_0000004.pt.tmp": WRITES_THROUGH,
    "log.jsonl.tmp": WRITES_THROUGH,
    "ckpt_0000003.pt": "holds ckpt_0000003.pt, a folder named as this trainer names its checkpoints: --resume, "
    "--keep-last and the save of its step would take it for one; rename it, or choose another --out-dir",
}


@pytest.mark.parametrize("name", AT_A_NAME)
def test_a_folder_at_a_name_a_run_writes_is_refused_before_it_trains(data_dir, tmp_path, name):
    """At a checkpoint's or the log copy's temporary name, or a checkpoint's (--keep-last would fail on it)."""
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    (out / name / "notes.txt").write_text("mine")
    before = tree_hashes(out, folders=True)
    result = run_main("train_gpt2.py", *tiny_run_args(data_dir, out, "--keep-last", "2", steps=8, ckpt_every=1))
    assert_refused(result, f"--out-dir {out} " + AT_A_NAME[name].format(name=name, written=name.removesuffix(".tmp")))
    assert tree_hashes(out, folders=True) == before


def no_space(monkeypatch):
    """statvfs reporting 100 bytes free, to the resume's branch folder."""
    real = os.statvfs

    def almost_full(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, 1, st.f_blocks, 100, 100, *tuple(st)[5:]))

    monkeypatch.setattr(resume.os, "statvfs", almost_full)


def no_thread(monkeypatch):
    """Threads past the launch's own refused, as under ulimit -v or ulimit -u."""
    start = threading.Thread.start

    def only_the_launch_threads(thread):
        if thread.name not in ("memory watch", "shard sha256"):
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", only_the_launch_threads)


AT_2 = "cannot resume at step 2 in {run}: "
REFUSED = {  # what stands in the way (a file's chattr flag, or a patch), and the line ("...": its start)
    "append-only log": (
        ("log.jsonl", "a"),
        "cannot cut {log} back to {run}/ckpt_0000002.pt: it is append-only (chattr +a); clear that attribute, "
        "or move it aside (the resume then starts a new log.jsonl) (nothing was changed)",
    ),
    "immutable later checkpoint": (
        ("ckpt_0000004.pt", "i"),
        AT_2 + "{run}/ckpt_0000004.pt, of the later branch that the resume moves into a branch folder, is "
        "immutable (chattr +i) and cannot be moved; clear that attribute, or resume into another --out-dir "
        "(nothing was changed)",
    ),
    "no space for the log's copy": (
        no_space,
        AT_2 + "the later branch moves into a branch folder with a copy of {log} ({size:,} bytes), and {run} has "
        "100 bytes free; free space, then run the same command again (nothing was changed)",
    ),
    "append-only log, no checkpoint": (
        ("log.jsonl", "a"),
        "cannot start a new run in {run}: {log}, of run {whose} (stopped before its first checkpoint), is "
        "append-only (chattr +a) and cannot be set aside; clear that attribute, or choose another --out-dir "
        "(nothing was changed)",
    ),
    "no thread": (no_thread, "cannot start a thread (can't start new thread): each takes its stack..."),
    "no W&B login": (  # (conftest's fake_wandb: as without a login)
        lambda monkeypatch: ["--wandb", "no-such-entity"],
        "--wandb: could not start a W&B run (RuntimeError: permission denied for entity); run `wandb login` or "
        "set WANDB_MODE=offline",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_resume_or_restart_changes_nothing(finished_copy, data_dir, monkeypatch, fake_wandb, capsys, case):
    """A resume at step 2 (no checkpoints: a restart), refused before the later branch moves or the log is cut."""
    blocker, message = REFUSED[case]
    run, restart, log = finished_copy, case.endswith("no checkpoint"), finished_copy / "log.jsonl"
    for path in run.glob("ckpt_*.pt") if restart else ():
        path.unlink()
    message = message.format(run=run, log=log, size=log.stat().st_size, whose=log_records(run)[-1]["run"])
    flags = [] if restart else ["--resume", str(run / "ckpt_0000002.pt")]
    before = tree_hashes(run, folders=True)
    with attribute(run / blocker[0], blocker[1]) if isinstance(blocker, tuple) else contextlib.nullcontext():
        extra = blocker(monkeypatch) if callable(blocker) else None
        assert tg.main(tiny_run_args(data_dir, run, *flags, *(extra or []), steps=8, ckpt_every=2)) == 2
    err = capsys.readouterr().err  # (a message ending in "...": the line's start)
    assert (err.startswith(f"error: {message.removesuffix('...')}"), err.count("\n")) == (True, 1), err
    assert message.endswith("...") or err == f"error: {message}\n"
    assert tree_hashes(run, folders=True) == before
