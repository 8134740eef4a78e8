"""No run can hurt another: one live trainer per --out-dir, --resume means resume, an abandoned branch is kept, and
every checkpoint written before a refusal or a branch loads with its sha256 unchanged. Two trainers at once are
programs (a held folder under torchrun: a case of test_ranks' launch); the rest run in-process."""

import errno
import fcntl
import os
import re
import shutil
import socket
import sys
import time
from unittest import mock

import pytest

from trainkit.runfiles import checkpoints
from trainkit.runfiles import resume
from trainkit.runfiles import run_folder
import train_gpt2 as tg
from trainkit.cli import UserError
from conftest import RUN_SHARDS, assert_refused, log_records, run_main, tiny_run_args, trained_steps
from conftest import checkpoint_hashes, start, tree_hashes, wait_for

SHARDS = RUN_SHARDS  # the shared finished run's data


def run(data_dir, out, *extra, **sizes):
    """train_gpt2.py on tiny_run_args, in this process (run_main)."""
    return run_main("train_gpt2.py", *tiny_run_args(data_dir, out, *extra, **sizes))


def in_use(out_dir, owner):
    return (
        f"--out-dir {out_dir} is in use by another training run ({owner}; it holds a lock on the folder): "
        "wait for it to end (then --resume continues it), or choose another --out-dir"
    )


@pytest.fixture(scope="module")
def eight_steps(data_dir, tmp_path_factory):
    """An 8-step run with checkpoints at 2, 4, 6, 8: a branch at step 2 moves three of them."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert tg.main(tiny_run_args(data_dir, out, steps=8, ckpt_every=2)) == 0
    return out


@pytest.fixture
def branched(eight_steps, tmp_path):
    """A copy of eight_steps of this test's own."""
    shutil.copytree(eight_steps, tmp_path / "run")
    return tmp_path / "run"


# --- one owner per --out-dir ----------------------------------------------------------------
def test_two_trainers_on_one_folder(data_dir, tmp_path):
    out = tmp_path / "out"
    forever = tiny_run_args(data_dir, out, steps=10**6, ckpt_every=5)
    # two launches at once: one owns the folder, the other is refused naming it
    trainers = [start([sys.executable, "train_gpt2.py", *forever]) for _ in range(2)]
    try:
        while all(p.poll() is None for p in trainers):
            time.sleep(0.05)
        (refused,) = [p for p in trainers if p.poll() is not None]
        (owner,) = [p for p in trainers if p is not refused]
        owned_by = f"pid {owner.pid} on {socket.gethostname()}"
        _, err = refused.communicate()
        assert (refused.returncode, err) == (2, f"error: {in_use(out, owned_by)}\n"), err[-3000:]
        wait_for(lambda: checkpoints.list_checkpoints(out), owner, what="a checkpoint")
        # so is a --resume while the owner runs, even once .lock is rewritten (sed -i on its host field
        # writes a new file): the lock is on the folder, and .lock only names its holder
        edited = out / ".lock.sed"
        edited.write_text(f"pid {owner.pid} on another-host\n")
        os.replace(edited, out / ".lock")
        result = run(data_dir, out, "--resume", steps=10**6, ckpt_every=5)
        assert_refused(result, in_use(out, f"pid {owner.pid} on another-host"))
        wait_for(lambda: len(checkpoints.list_checkpoints(out)) >= 2, owner, what="two checkpoints")
    finally:
        for p in trainers:
            if p.poll() is None:
                p.kill()  # a killed run leaves its lock file: it must block nothing
            p.communicate()
    assert (out / ".lock").read_text() == f"pid {owner.pid} on another-host\n"
    before = checkpoint_hashes(out)
    last = checkpoints.checkpoint_step(checkpoints.latest_checkpoint(out))
    result = run(data_dir, out, "--resume", steps=last + 3, ckpt_every=5)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {out / f'ckpt_{last:07d}.pt'} at step {last}" in result.stdout
    assert trained_steps(out) == list(range(last + 3))  # one run's steps, in order
    assert before.items() <= (after := checkpoint_hashes(out)).items() and f"ckpt_{last + 3:07d}.pt" in after
    assert not (out / ".lock").exists()  # a run that ends removes its lock file


def test_the_lock_is_on_the_folder_not_on_its_lock_file(tmp_path, monkeypatch, capsys):
    holder = run_folder.OutDirLock(str(tmp_path))
    holder.acquire()
    me = f"pid {os.getpid()} on {socket.gethostname()}"
    assert os.listdir(tmp_path) == [".lock"] and (tmp_path / ".lock").read_text() == f"{me}\n"
    os.remove(tmp_path / ".lock")  # a user who thinks it stale: the folder stays locked
    with pytest.raises(UserError) as refused:
        run_folder.OutDirLock(str(tmp_path)).acquire()
    assert str(refused.value) == in_use(tmp_path, f"holder not recorded in {tmp_path / '.lock'}")
    assert os.listdir(tmp_path) == []  # the refused one wrote nothing
    holder.release()
    # release removes only the .lock this run wrote: not one that replaced it
    holder.acquire()
    (tmp_path / "note").write_text("the user's own note\n")
    os.replace(tmp_path / "note", tmp_path / ".lock")
    holder.release()
    assert (tmp_path / ".lock").read_text() == "the user's own note\n"
    # a file system without locks: a note, and nothing written
    os.remove(tmp_path / ".lock")
    monkeypatch.setattr(fcntl, "flock", mock.Mock(side_effect=OSError(errno.ENOLCK, "No locks available")))
    unlocked = run_folder.OutDirLock(str(tmp_path))
    unlocked.acquire()
    unlocked.release()
    assert capsys.readouterr().out == (
        f"note: cannot lock --out-dir {tmp_path} (no locks available): a second run on it would not be stopped\n"
    )
    assert os.listdir(tmp_path) == []


def test_odd_lock_files_are_one_line(finished_copy, data_dir, tmp_path):
    """A folder at .lock, or a link at it into a missing folder: refused, the folder as it was."""
    out, lock, gone = finished_copy, finished_copy / ".lock", tmp_path / "gone" / "lock"
    link = lambda: lock.rmdir() or lock.symlink_to(gone)  # (the folder's test done)
    for make, what in ((lock.mkdir, "is a directory"), (link, f"is a symbolic link to {gone}")):
        make()
        before = tree_hashes(out, folders=True)
        refusal = f"{lock} {what}, not the lock note this trainer writes: remove it, or choose another --out-dir"
        assert_refused(run(data_dir, out, "--resume", steps=10, ckpt_every=2), refusal)
        assert tree_hashes(out, folders=True) == before and not gone.parent.exists()


# --- whose a folder is: run ids ---------------------------------------------------------------
def test_another_runs_checkpoint_is_refused_whatever_was_moved(finished_copy, eight_steps, data_dir, tmp_path):
    """Run B's checkpoint resumed into run A's folder, A's log.jsonl moved away: A's checkpoints carry A's run
    id, so the run stops with one line naming both runs, and nothing changes."""
    out, given = finished_copy, eight_steps / "ckpt_0000006.pt"
    os.rename(out / "log.jsonl", tmp_path / "a_log.jsonl")
    before = tree_hashes(out)
    a, b = (resume.read_run(str(path))["id"] for path in (out / "ckpt_0000002.pt", given))
    assert_refused(
        run(data_dir, out, "--resume", given, steps=10),
        f"cannot resume {given} (run {b}, step 6) in --out-dir {out}: its ckpt_0000002.pt is another "
        f"run's (run {a}), and one folder holds one run; resume into the --out-dir of the checkpoint's own "
        "run, or a new one",
    )
    assert tree_hashes(out) == before


def test_whose_checkpoints_a_folder_may_hold(tmp_path):
    """claim_run's rule on made-up histories: a requeued run keeps its identity, a resume of an earlier step is
    a branch naming its parent and the step, and a folder holds the checkpoints of one history only."""

    def checkpoint(folder, step, run):
        folder.mkdir(exist_ok=True)
        state = dict(model={}, model_config={}, step=step, log_offset=0, log_sha256="", run=run)
        path = checkpoints.checkpoint_path(str(folder), step)
        checkpoints.save_checkpoint(path, state)
        return resume.ResumePoint.of(path, state)

    def refusal(resumed, folder, name, theirs):
        return re.escape(
            f"cannot resume {resumed.path} ({resume.run_name(resumed.run['id'])}, step "
            f"{resumed.step}) in --out-dir {folder}: its {name} is another run's "
            f"({resume.run_name(theirs)}), and one folder holds one run"
        )

    first, folder = resume.new_run(), tmp_path / "first"
    at_2, at_4 = checkpoint(folder, 2, first), checkpoint(folder, 4, first)
    assert run_folder.claim_run(str(folder), at_4) == first  # a requeued run stays itself
    branch = run_folder.claim_run(str(folder), at_2)  # a branch of it gets an id, naming it and the step
    assert branch["parent"] == dict(first, step=2) and len(branch["id"]) == 32
    at_6 = checkpoint(tmp_path / "branch", 6, branch)
    with pytest.raises(UserError, match=refusal(at_6, folder, "ckpt_0000004.pt", first["id"])):
        run_folder.claim_run(str(folder), at_6)  # step 4 of the first run is not in the branch's past
    os.remove(at_4.path)
    again = run_folder.claim_run(str(folder), at_6)  # step 2 is: the branch may go on there, as a branch again
    assert again["parent"] == dict(branch, step=6) and again["id"] != branch["id"]
    assert resume.in_history(first["id"], 2, again, 8) and not resume.in_history(first["id"], 3, again, 8)
    # two runs never share a folder
    fresh = checkpoint(tmp_path / "fresh", 6, resume.new_run())
    with pytest.raises(UserError, match=refusal(fresh, folder, "ckpt_0000002.pt", first["id"])):
        run_folder.claim_run(str(folder), fresh)
    with pytest.raises(UserError, match=refusal(at_2, tmp_path / "fresh", "ckpt_0000006.pt", fresh.run["id"])):
        run_folder.claim_run(str(tmp_path / "fresh"), at_2)


def test_a_branch_without_a_log_moves_its_checkpoints_and_says_no_more(branched, data_dir, capsys):
    """A resume at step 6 of a folder whose log.jsonl is gone: ckpt_0000008.pt moves into a branch folder."""
    out = branched
    os.remove(out / "log.jsonl")
    assert tg.main(tiny_run_args(data_dir, out, "--resume", str(out / "ckpt_0000006.pt"), steps=8, ckpt_every=2)) == 0
    assert (
        f"resuming at step 6: moved the later branch of this run (1 checkpoint, ckpt_0000008.pt) to "
        f"{out / 'branch_0000008'}; nothing was deleted\n"
    ) in capsys.readouterr().out
    assert os.listdir(out / "branch_0000008") == ["ckpt_0000008.pt"]


# --- resume means resume --------------------------------------------------------------------
def test_a_log_of_no_run_and_no_checkpoint_is_refused_with_or_without_resume(data_dir, tmp_path):
    """Neither a fresh run nor --resume appends a run to the user's own log.jsonl."""
    only_log = tmp_path / "only_log"
    only_log.mkdir()
    (only_log / "log.jsonl").write_text("my notes\n")
    refusal = (
        f"--out-dir {only_log} holds a log.jsonl of no run (no line of it is a JSON record: not a log this "
        "trainer wrote) but no checkpoint to resume: move the log aside to start a new run there, or choose "
        "another --out-dir"
    )
    for resume_flag in ([], ["--resume"]):
        assert_refused(run(data_dir, only_log, *resume_flag, steps=10), refusal)
    assert sorted(os.listdir(only_log)) == ["log.jsonl"] and (only_log / "log.jsonl").read_text() == "my notes\n"


# --- abandoned branches are kept --------------------------------------------------------------
def test_resume_from_an_earlier_checkpoint_keeps_the_later_branch(branched, data_dir):
    out, hashes = branched, checkpoint_hashes(branched)
    log = (out / "log.jsonl").read_bytes()
    # a new branch from step 2, with another learning rate
    result = run(data_dir, out, "--resume", out / "ckpt_0000002.pt", "--max-lr", "5e-3", steps=8, ckpt_every=2)
    assert result.returncode == 0, result.stderr[-3000:]
    branch = out / "branch_0000008"
    assert (
        f"resuming at step 2: moved the later branch of this run (3 checkpoints, ckpt_0000004.pt ... "
        f"ckpt_0000008.pt) with a copy of its log.jsonl to {branch}; nothing was deleted"
    ) in result.stdout
    assert (branch / "log.jsonl").read_bytes() == log  # the old branch's whole log, beside its checkpoints
    assert sorted(os.listdir(branch)) == ["ckpt_0000004.pt", "ckpt_0000006.pt", "ckpt_0000008.pt", "log.jsonl"]
    # the new branch is a run of its own, which names its parent run and the step it branched at; each
    # log record names the run that wrote it
    first, new = (resume.read_run(str(path)) for path in (out / "ckpt_0000002.pt", out / "ckpt_0000004.pt"))
    assert new == dict(id=new["id"], parent=dict(first, step=2)) and first["parent"] is None
    assert resume.read_run(str(branch / "ckpt_0000008.pt")) == first
    runs = [record["run"] for record in log_records(out)]
    cut = runs.index(new["id"])
    assert runs == [first["id"]] * cut + [new["id"]] * (len(runs) - cut) and cut == 2  # steps 0, 1: the first run's
    # the trainer's own advice, a plain --resume, continues the new branch
    result = run(data_dir, out, "--resume", "--max-lr", "5e-3", steps=10, ckpt_every=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {out / 'ckpt_0000008.pt'} at step 8" in result.stdout and "branch" not in result.stdout
    assert trained_steps(out) == list(range(10)) and trained_steps(branch) == list(range(8))
    assert resume.read_run(str(out / "ckpt_0000010.pt")) == new  # a plain --resume goes on as the same run
    # every checkpoint ever written is still under the folder, unchanged: the first run's step 2 in
    # place, its later ones in the branch folder, the new branch's beside step 2
    now = checkpoint_hashes(out)
    kept = {
        name if name == "ckpt_0000002.pt" else os.path.join("branch_0000008", name): sha for name, sha in hashes.items()
    }
    assert {path: now.get(path) for path in kept} == kept
    new = {f"ckpt_{step:07d}.pt" for step in (4, 6, 8, 10)}
    assert set(now) == set(kept) | new and all(now[name] != hashes.get(name) for name in new)
    # the branch folder is a run folder of its own: the old branch goes on there
    assert tg.main(tiny_run_args(data_dir, branch, "--resume", steps=10, ckpt_every=2)) == 0
    assert trained_steps(branch) == list(range(10)) and (branch / "log.jsonl").read_bytes().startswith(log)
    assert resume.read_run(str(branch / "ckpt_0000010.pt")) == first
