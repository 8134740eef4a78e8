"""No run can hurt another (issue 17): one live trainer per --out-dir, --resume means resume, and
an abandoned branch is kept. The real script, run as users run it; every checkpoint written
before a refusal or a branch still loads with its sha256 unchanged."""
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

import checkpoints
import train_gpt2 as tg
from conftest import REPO, run_cli
from shards import shard_dir
from test_resilience import args_for

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return shard_dir(tmp_path_factory, 300, seed=7)


def start(args):
    return subprocess.Popen([sys.executable, "train_gpt2.py", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **ONE_THREAD})


def run(args, nproc=1):
    return run_cli(args, nproc, env=ONE_THREAD)


def assert_refused(returncode, stderr, message):
    lines = stderr.splitlines()
    assert (returncode, lines) == (2, [f"error: {message}"]), stderr[-3000:]


def checkpoint_hashes(out_dir):
    """{file name: sha256 of its bytes} of every checkpoint anywhere under out_dir, after checking
    that each loads (load_checkpoint verifies the sha256 stored inside)."""
    found = {}
    for folder, _, names in os.walk(out_dir):
        for name in names:
            if checkpoints.CKPT_NAME.fullmatch(name):
                path = os.path.join(folder, name)
                checkpoints.load_checkpoint(path)
                found[os.path.relpath(path, out_dir)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return found


def train_steps(log_path):
    with open(log_path) as f:
        return [r["step"] for r in map(json.loads, f) if "loss" in r]


def in_use(out_dir, owner):
    return (f"--out-dir {out_dir} is in use by another training run ({owner}; it holds {out_dir / '.lock'}): "
            "wait for it to end (then --resume continues it), or choose another --out-dir")


@pytest.fixture(scope="module")
def finished_once(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert tg.main(args_for(data_dir, out, steps=8, ckpt_every=2)) == 0
    return out


@pytest.fixture
def finished_run(finished_once, tmp_path):
    """A copy of an 8-step run with checkpoints at 2, 4, 6, 8, and their sha256s."""
    out = tmp_path / "run"
    shutil.copytree(finished_once, out)
    return out, checkpoint_hashes(out)


# --- one owner per --out-dir ----------------------------------------------------------------

def test_two_trainers_on_one_folder(data_dir, tmp_path):
    out = tmp_path / "out"
    forever = args_for(data_dir, out, steps=10**6, ckpt_every=5)
    # two launches at once: one owns the folder, the other is refused naming it
    trainers = [start(forever), start(forever)]
    try:
        while all(p.poll() is None for p in trainers):
            time.sleep(0.05)
        refused, = [p for p in trainers if p.poll() is not None]
        owner, = [p for p in trainers if p is not refused]
        owned_by = f"pid {owner.pid} on {socket.gethostname()}"
        assert_refused(refused.returncode, refused.communicate()[1], in_use(out, owned_by))
        # so is a --resume while the owner runs
        result = run(args_for(data_dir, out, "--resume", steps=10**6, ckpt_every=5))
        assert_refused(result.returncode, result.stderr, in_use(out, owned_by))
        while len(checkpoints.list_checkpoints(out)) < 2:
            assert owner.poll() is None, owner.communicate()
            time.sleep(0.05)
    finally:
        for p in trainers:
            if p.poll() is None:
                p.kill()  # a killed run leaves its lock file: it must block nothing
            p.communicate()
    assert (out / ".lock").read_text() == f"{owned_by}\n"
    before = checkpoint_hashes(out)
    last = checkpoints.checkpoint_step(checkpoints.latest_checkpoint(out))
    result = run(args_for(data_dir, out, "--resume", steps=last + 3, ckpt_every=5))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {out / f'ckpt_{last:07d}.pt'} at step {last}" in result.stdout
    assert train_steps(out / "log.jsonl") == list(range(last + 3))  # one run's steps, in order
    after = checkpoint_hashes(out)
    assert {k: after[k] for k in before} == before and f"ckpt_{last + 3:07d}.pt" in after
    assert not (out / ".lock").exists()  # a run that ends removes its lock file


def test_refused_torchrun_launch_stops_every_rank(finished_run, data_dir):
    out, hashes = finished_run
    with open(out / ".lock", "a+") as held:  # a live owner elsewhere
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242 on node-7\n")
        held.flush()
        start_time = time.time()
        result = run(args_for(data_dir, out, "--resume", steps=10, B=2), nproc=2)
        elapsed = time.time() - start_time
    assert result.returncode != 0 and elapsed < 60  # not a rank left waiting in a collective
    message = f"error: {in_use(out, 'pid 4242 on node-7')}"
    assert [line for line in result.stderr.splitlines() if "error:" in line] == [message]  # rank 0's, once
    assert 'train_gpt2.py", line' not in result.stderr  # no traceback of ours
    assert checkpoint_hashes(out) == hashes and train_steps(out / "log.jsonl") == list(range(8))


# --- resume means resume --------------------------------------------------------------------

def test_resume_means_resume(finished_run, data_dir, tmp_path, capsys):
    out, hashes = finished_run
    log = (out / "log.jsonl").read_bytes()
    # an unset $CKPT in a job script
    result = run(args_for(data_dir, out, "--resume", "", steps=10, ckpt_every=2))
    assert_refused(result.returncode, result.stderr, "--resume got an empty path (''; an unset variable in the job "
                   "script?): pass --resume alone to continue from the newest checkpoint in --out-dir, or --resume PATH")
    assert checkpoint_hashes(out) == hashes and (out / "log.jsonl").read_bytes() == log
    # a folder holding only the log of a run that wrote no checkpoint: neither a fresh run nor
    # --resume appends a second run to it
    only_log = tmp_path / "only_log"
    only_log.mkdir()
    shutil.copy(out / "log.jsonl", only_log)
    refusal = (f"--out-dir {only_log} holds the log.jsonl of an earlier run but no checkpoint to resume: move the "
               "log aside to start a new run there, or choose another --out-dir")
    result = run(args_for(data_dir, only_log, steps=10, ckpt_every=2))
    assert_refused(result.returncode, result.stderr, refusal)
    assert tg.main(args_for(data_dir, only_log, "--resume", steps=10, ckpt_every=2)) == 2
    assert capsys.readouterr().err == f"error: {refusal}\n"
    assert sorted(os.listdir(only_log)) == ["log.jsonl"] and (only_log / "log.jsonl").read_bytes() == log


# --- abandoned branches are kept --------------------------------------------------------------

def test_resume_from_an_earlier_checkpoint_keeps_the_later_branch(finished_run, data_dir):
    out, hashes = finished_run
    log = (out / "log.jsonl").read_bytes()
    # a new branch from step 2, with another learning rate
    result = run(args_for(data_dir, out, "--resume", str(out / "ckpt_0000002.pt"), "--max-lr", "5e-3", steps=8,
                          ckpt_every=2))
    assert result.returncode == 0, result.stderr[-3000:]
    branch = out / "branch_0000008"
    assert (f"resuming at step 2: moved the later branch of this run (3 checkpoints, ckpt_0000004.pt ... "
            f"ckpt_0000008.pt) with a copy of its log.jsonl to {branch}; nothing was deleted") in result.stdout
    assert (branch / "log.jsonl").read_bytes() == log  # the old branch's whole log, beside its checkpoints
    assert sorted(os.listdir(branch)) == ["ckpt_0000004.pt", "ckpt_0000006.pt", "ckpt_0000008.pt", "log.jsonl"]
    # the trainer's own advice, a plain --resume, continues the new branch
    result = run(args_for(data_dir, out, "--resume", "--max-lr", "5e-3", steps=10, ckpt_every=2))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {out / 'ckpt_0000008.pt'} at step 8" in result.stdout and "branch" not in result.stdout
    assert train_steps(out / "log.jsonl") == list(range(10)) and train_steps(branch / "log.jsonl") == list(range(8))
    # every checkpoint ever written is still under the folder, unchanged: the first run's step 2 in
    # place, its later ones in the branch folder, the new branch's beside step 2
    now = checkpoint_hashes(out)
    kept = {name if name == "ckpt_0000002.pt" else os.path.join("branch_0000008", name): sha
            for name, sha in hashes.items()}
    assert {path: now.get(path) for path in kept} == kept
    new = {f"ckpt_{step:07d}.pt" for step in (4, 6, 8, 10)}
    assert set(now) == set(kept) | new and all(now[name] != hashes.get(name) for name in new)
    # the branch folder is a run folder of its own: the old branch goes on there
    assert tg.main(args_for(data_dir, branch, "--resume", steps=10, ckpt_every=2)) == 0
    assert train_steps(branch / "log.jsonl") == list(range(10)) and (branch / "log.jsonl").read_bytes().startswith(log)
