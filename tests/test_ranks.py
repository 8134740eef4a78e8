"""No rank can hurt another: ranks started differently are refused in one line, a dying rank leaves one line naming
the last good checkpoint, and the checkpoints in --out-dir stay byte for byte. 2 gloo ranks: killed ranks and the
launcher's side of a refusal are real launches; the other cases share ONE launch (run_on_ranks)."""

import fcntl
import hashlib
import os
import re
import shutil
import stat
import sys
import time

import numpy as np
import pytest

from trainkit.data import shard_scan
from trainkit.data.shards import SAMPLE_BYTES, shard_files
import train_gpt2 as tg
from conftest import HELLASWAG_FILE, REPO, child_pids, kill_group, kill_pids, tiny_run_args, torchrun, tree_hashes
from conftest import documents, kept_scans, run_main, run_on_ranks, scan_args, start, step_losses, trained_steps
from conftest import checkpoint_hashes, wait_for
from shards import write_manifest

SHARDS = dict(n_docs=500, seed=4)


def args_for(data_dir, out_dir, *extra, steps=2, ckpt_every=2):
    """A one-block run, 4 rows a step: one micro-batch of 2 rows on each of 2 ranks."""
    one_block = dict(n_layer=1, block_size=16, seq_len=16, B=2, rows=4, warmup=1)
    return tiny_run_args(data_dir, out_dir, *extra, steps=steps, ckpt_every=ckpt_every, **one_block)


def error_lines(stderr) -> list:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def launch_per_rank(shell, args, script="train_gpt2.py", **popen):
    """torchrun of 2 ranks running `bash -c shell _ python script args`: the shell gives each rank ($RANK) its flags."""
    launch = torchrun("--standalone", "--nproc_per_node=2", "--no-python")
    return start([*launch, "bash", "-c", shell, "_", sys.executable, str(REPO / script), *args], **popen)


def trained_run(data_dir, out) -> tuple:
    """out holding one checkpoint (step 2), and its hashes."""
    assert tg.main(args_for(data_dir, out)) == 0
    return out, checkpoint_hashes(out)


def test_ranks_with_different_flags_are_refused_naming_the_first(data_dir, tmp_path):
    # before: a different --max-steps ended in a gloo SIGABRT (83 lines); a different --max-lr trained on
    out, hashes = trained_run(data_dir, tmp_path / "out")
    proc = launch_per_rank(
        'exec "$@" --max-steps $((4 + RANK)) --max-lr 1e-$((2 + RANK))', args_for(data_dir, out, "--resume")
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1  # torchrun's own code whenever a worker fails; the workers' are in its report
    assert error_lines(err) == [
        "error: the ranks of this launch were started differently: --max-steps 4 on rank 0 "
        "but --max-steps 5 on rank 1; every rank needs the same command and the same "
        "--data-dir files"
    ], err[-3000:]
    assert err.count("exitcode  : 2") == 2 and "[rank" not in err and "terminate called" not in err, err[-3000:]
    assert checkpoint_hashes(out) == hashes and sorted(os.listdir(out)) == ["ckpt_0000002.pt", "log.jsonl"]


# --- ONE torchrun launch (run_on_ranks): setup(data_dir, folder) -> (its case, the `error:` line expected or None
# for exit 0 on every rank, check(ranks) of what the case left: it asserts, or returns whether it holds)
def different_data_of_the_same_sizes(data_dir, folder):
    # the same --data-dir holds another corpus on each rank, cut into shards of the same names and
    # sizes, as two nodes' local copies might: it trained on (the ranks compared names and sizes)
    out, hashes = trained_run(data_dir, folder / "out")
    for rank in (0, 1):
        shutil.copytree(data_dir, folder / f"rank{rank}" / "data")
    shard = sorted((folder / "rank1" / "data").glob("*_train_*.npy"))[-1]
    np.save(shard, np.load(shard)[::-1])  # the same tokens in another order: same size
    name, size = shard.name, shard.stat().st_size
    sampled = [shard_files([str(folder / f"rank{rank}" / "data" / name)])[0][2][:12] for rank in (0, 1)]
    line = (
        f"error: the ranks of this launch were started differently: train shards in "
        f"--data-dir: {name} is {size} bytes of sampled content {sampled[0]} on rank 0 but "
        f"{size} bytes of sampled content {sampled[1]} on rank 1; every rank needs the same "
        "command and the same --data-dir files"
    )
    args = args_for("data", out, "--resume")
    case = dict(script="train_gpt2", argv=[args, args], cwd=[folder / "rank0", folder / "rank1"])
    return case, line, lambda ranks: hashes.items() <= checkpoint_hashes(out).items()


def a_copy_that_differs_outside_the_sampled_slices(data_dir, folder):
    """One byte differs between two nodes' copies of a shard, outside the 16 slices the ranks compare (before: trained
    on): rank 1's full sha256 check stops every rank before a checkpoint, in one line naming the shard and rank."""
    rng = np.random.default_rng(5)
    copies = [folder / f"rank{rank}" / "data" for rank in (0, 1)]
    copies[0].mkdir(parents=True)
    np.save(copies[0] / "synth_val_000000.npy", rng.integers(0, 64, 2000).astype(np.uint16))
    np.save(copies[0] / "synth_train_000001.npy", rng.integers(0, 64, 600_000).astype(np.uint16))  # 1.2 MB
    (recorded,) = [s["sha256"] for s in write_manifest(copies[0])["shards"] if s["file"] == "synth_train_000001.npy"]
    shutil.copytree(copies[0], copies[1])
    shard = copies[1] / "synth_train_000001.npy"
    damaged = bytearray(shard.read_bytes())
    damaged[SAMPLE_BYTES + 10] ^= 1  # a token's low byte, between the first two slices
    shard.write_bytes(bytes(damaged))
    assert len({shard_files([str(copy / shard.name)])[0][2] for copy in copies}) == 1  # sampled: the same
    before, out = [tree_hashes(copy) for copy in copies], folder / "out"
    line = (
        f"error: rank 1: data/{shard.name} has sha256 {hashlib.sha256(damaged).hexdigest()[:16]}..., not the "
        f"{recorded[:16]}... that data/manifest.json records: the file changed since fineweb.py wrote it (a damaged "
        "copy?); restore it, or re-create the data set with fineweb.py"
    )
    args = args_for("data", out, steps=4)
    case = dict(script="train_gpt2", argv=[args, args], cwd=[copy.parent for copy in copies])
    return case, line, lambda ranks: [tree_hashes(copy) for copy in copies] == before and not list(out.glob("ckpt_*"))


def a_file_that_only_one_rank_lacks(data_dir, folder):
    # each node reads its own disk: rank 1's missing copy is printed by rank 0, once (before: no line)
    out, _ = trained_run(data_dir, folder / "out")
    args = ["--checkpoint", out, "--data-file", HELLASWAG_FILE, "--limit", "6"]
    case = dict(script="hellaswag", argv=[args, [*args, "--data-file", folder / "missing.jsonl"]])
    line = f"error: rank 1: --data-file {folder / 'missing.jsonl'} does not exist"
    return case, line, lambda ranks: [rank.stdout for rank in ranks] == ["", ""]


def a_folder_another_run_holds(data_dir, folder):
    """A live owner elsewhere (on_ranks locks the case's "held"): rank 0's line, once, every rank stopped within
    --dist-timeout 60 (none left waiting in a collective), the run unchanged."""
    out, hashes = trained_run(data_dir, folder / "out")
    (out / ".lock").write_text("pid 4242 on node-7\n")
    args = args_for(data_dir, out, "--resume", "--dist-timeout", "60", steps=10)
    line = (
        f"error: --out-dir {out} is in use by another training run (pid 4242 on node-7; it holds a lock on the "
        "folder): wait for it to end (then --resume continues it), or choose another --out-dir"
    )
    case = dict(script="train_gpt2", argv=[args, args], held=out)
    return case, line, lambda ranks: checkpoint_hashes(out) == hashes and trained_steps(out) == [0, 1]


def the_ranks_split_the_first_scan_of_a_read_only_folder(data_dir, folder):
    """The ranks split the scan and keep each once (not the too-small val shard); a later run reads them, one with an
    unwritable cache scans again: both train on the ranks' rows, the read-only data unchanged. ("cache": the
    launch's XDG_CACHE_HOME.) The reported memory is the run's own, the mapped shards' pages apart."""
    data, cache = folder / "data", folder / "cache"
    data.mkdir()
    np.save(data / "big_val_000000.npy", documents(20_000, seed=1))
    for i in (1, 2):
        np.save(data / f"big_train_{i:06d}.npy", documents(shard_scan.MIN_CACHED_TOKENS + 1000, seed=i + 1))
    for path in [*data.iterdir(), data]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    before, args = tree_hashes(data), scan_args(data, folder / "two")

    def check(ranks):
        assert kept_scans(cache) == [".max_id", ".max_id", ".rows16.npy", ".rows16.npy"]
        stamps = {path: path.stat().st_mtime_ns for path in (cache / "gpt2-trainer" / "shards").iterdir()}
        cached = run_main("train_gpt2.py", *scan_args(data, folder / "a"), env={"XDG_CACHE_HOME": str(cache)})
        assert cached.returncode == 0, cached.stderr
        assert {path: path.stat().st_mtime_ns for path in stamps} == stamps
        (folder / "a-file").write_text("")
        unwritable = {"XDG_CACHE_HOME": str(folder / "a-file" / "x")}
        uncached = run_main("train_gpt2.py", *scan_args(data, folder / "b"), env=unwritable)
        assert uncached.returncode == 0, uncached.stderr
        two = ranks[0].stdout
        assert len(step_losses(two)) == 2 and step_losses(two) == step_losses(cached.stdout)
        assert step_losses(two) == step_losses(uncached.stdout) and tree_hashes(data) == before
        peak = r"\| peak memory \d+\.\d\d GiB private \(\+ \d+\.\d\d GiB of mapped shard pages, shared page cache\)$"
        assert re.search(peak, two, re.MULTILINE), two

    return dict(script="train_gpt2", argv=[args, args], cache=cache), None, check


def fsdp_eval_only_ends_cleanly_on_every_rank(data_dir, folder):
    # reported: 4 of 13 such runs aborted at exit ("terminate called without an active exception"); the ranks
    # left at different times (no barrier, unlike training's last save), now they meet first. The LAST case:
    # the launch's own clean exit (run_on_ranks asserts exit 0) proves the processes' end
    out, hashes = trained_run(data_dir, folder / "out")
    args = args_for(data_dir, out, "--fsdp", "--eval-only", "--resume", "--val-every", "1", "--val-steps", "1")

    def check(ranks):
        json_lines = [line for rank in ranks for line in rank.stdout.splitlines() if line.startswith("{")]
        assert len(json_lines) == 1 and json_lines[0].startswith('{"step": 2, "val_loss": '), ranks[0].stdout
        assert checkpoint_hashes(out) == hashes and sorted(os.listdir(out)) == ["ckpt_0000002.pt", "log.jsonl"]

    return dict(script="train_gpt2", argv=[args, args]), None, check


ON_RANKS = (different_data_of_the_same_sizes, a_copy_that_differs_outside_the_sampled_slices)
ON_RANKS += (a_file_that_only_one_rank_lacks, a_folder_another_run_holds)
ON_RANKS += (the_ranks_split_the_first_scan_of_a_read_only_folder, fsdp_eval_only_ends_cleanly_on_every_rank)


@pytest.fixture(scope="module")
def on_ranks(data_dir, tmp_path_factory) -> dict:
    """By setup's name in ON_RANKS: its line, its check, and its case's result on each rank."""
    setups = [setup(data_dir, tmp_path_factory.mktemp(setup.__name__)) for setup in ON_RANKS]
    held = [os.open(case.pop("held"), os.O_RDONLY) for case, _, _ in setups if "held" in case]
    (cache,) = [case.pop("cache") for case, _, _ in setups if "cache" in case] or [tmp_path_factory.mktemp("cache")]
    try:
        for fd in held:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("XDG_CACHE_HOME", str(cache))
            results = run_on_ranks([case for case, _, _ in setups])
    finally:
        for fd in held:
            os.close(fd)
    return {setup.__name__: (*rest, ranks) for setup, (_, *rest), ranks in zip(ON_RANKS, setups, results)}


@pytest.mark.parametrize("setup", [setup.__name__ for setup in ON_RANKS])
def test_a_case_on_two_ranks(on_ranks, setup):
    """Every rank exits 2, their stderr together holding the one `error:` line (or every rank exits 0, no error); no
    traceback; what the case left is as its check says."""
    line, check, ranks = on_ranks[setup]
    err = "".join(rank.stderr for rank in ranks)
    if line is None:
        assert [rank.returncode for rank in ranks] == [0, 0] and "error" not in err, err[-3000:]
    else:
        assert [rank.returncode for rank in ranks] == [2, 2] and error_lines(err) == [line], err[-3000:]
    assert "[rank" not in err and "Traceback" not in err and "terminate called" not in err, err[-3000:]
    assert check(ranks) is not False


# --- a rank that dies ----------------------------------------------------------------------------
def rank_of(pid) -> int:
    with open(f"/proc/{pid}/environ") as f:
        return int(dict(v.split("=", 1) for v in f.read().split("\0") if "=" in v)["RANK"])


@pytest.mark.parametrize("victim, mode", [(1, []), (0, ["--fsdp"])], ids=["rank1-ddp", "rank0-fsdp"])
def test_a_killed_rank_leaves_one_line_naming_the_last_good_checkpoint(data_dir, tmp_path, victim, mode):
    out = tmp_path / "out"
    # a checkpoint every step, and the default --dist-timeout (600 s): the survivor must not wait for it
    proc = launch_per_rank(
        'exec "$@"', args_for(data_dir, out, *mode, steps=100000, ckpt_every=1), start_new_session=True
    )
    try:
        wait_for(lambda: len(list(out.glob("ckpt_*.pt"))) >= 3, proc, what="three checkpoints")
        workers = child_pids(proc.pid)
        assert len(workers) == 2
        hashes = checkpoint_hashes(out)
        killed = time.time()
        (victim_pid,) = [pid for pid in workers if rank_of(pid) == victim]
        kill_pids([victim_pid])
        _, err = proc.communicate(timeout=300)
        assert time.time() - killed < 300  # not the --dist-timeout of 600 s (seconds on a quiet machine)
    finally:
        kill_group(proc)
    (line,) = error_lines(err)
    assert proc.returncode == 1 and line.startswith(
        f"error: rank {1 - victim}: another rank of this launch died or stopped answering ("
    )
    named, after = line.split("Last good checkpoint: ")[1].split(" (resume with")[0], checkpoint_hashes(out)
    assert os.path.basename(named) in after and hashes.items() <= after.items()
    assert int(named[-10:-3]) >= max(int(name[5:12]) for name in hashes)
    assert "[rank" not in err and "terminate called" not in err  # no worker traceback, no C++ abort
    assert "exitcode  : 1" in err and "exitcode  : -9" in err  # the survivor's 1, the victim's SIGKILL


def test_a_killed_rank_during_hellaswag_is_one_line(data_dir, tmp_path):
    # rank 1 has all 446 examples to score (rank 0: 6): rank 0 scores its share and waits for rank 1
    # in the final all-reduce, where rank 1's death fails it (before: a gloo traceback)
    out, _ = trained_run(data_dir, tmp_path / "out")
    with open(tmp_path / "stderr", "w") as stderr:
        proc = launch_per_rank(
            'if [ "$RANK" = 1 ]; then exec "$@" --limit 0; else exec "$@"; fi',
            ["--checkpoint", str(out), "--data-file", str(HELLASWAG_FILE), "--limit", "6"],
            script="hellaswag.py",
            stderr=stderr,
            start_new_session=True,
        )
    try:  # rank 0's scoring done (both renderings, under one progress bar):
        wait_for(lambda: "100%" in (tmp_path / "stderr").read_text(), proc, what="rank 0's scoring")
        time.sleep(0.5)  # (a few tensor operations from there to the all-reduce; later is the same failure)
        (rank1,) = [pid for pid in child_pids(proc.pid) if rank_of(pid) == 1]
        kill_pids([rank1])
        stdout, _ = proc.communicate(timeout=300)
    finally:
        kill_group(proc)
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 1 and stdout.startswith("hellaswag: scoring ") and stdout.count("\n") == 1  # no score
    (line,) = error_lines(err)
    assert line.startswith("error: rank 0: another rank of this launch died or stopped answering ("), err[-3000:]
    assert line.endswith("so this rank stopped too; torchrun's report below names the rank that failed first")
    assert "RuntimeError" not in err and "pair.cc" not in err and "terminate called" not in err  # no gloo traceback
