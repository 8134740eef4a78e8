"""No rank can hurt another: ranks started differently are refused with one line, and
a rank that dies leaves the survivors one line naming the last good checkpoint. 2 gloo ranks on the
CPU: a killed rank, the launcher's report and teardown are real torchrun launches; the other start-up
refusals are cases of one launch (run_on_ranks). The checkpoints already in --out-dir must still load,
byte for byte the same."""

import glob
import hashlib
import os
import shutil
import sys
import time

import numpy as np
import pytest

from trainkit.runfiles import checkpoints
from trainkit.data.shards import SAMPLE_BYTES, shard_files
import train_gpt2 as tg
from conftest import HELLASWAG_FILE, REPO, child_pids, kill_group, kill_pids, tiny_run_args, torchrun, tree_hashes
from conftest import run_on_ranks, start, wait_for
from shards import write_manifest

T = 16


SHARDS = dict(n_docs=500, seed=4)


def args_for(data_dir, out_dir, *extra, steps=2, ckpt_every=2):
    """A one-block run, 4 rows a step: one micro-batch of 2 rows on each of 2 ranks."""
    one_block = dict(n_layer=1, block_size=16, seq_len=T, B=2, rows=4, warmup=1)
    return tiny_run_args(data_dir, out_dir, *extra, steps=steps, ckpt_every=ckpt_every, **one_block)


def checkpoint_hashes(out_dir) -> dict:
    hashes = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "ckpt_*.pt"))):
        with open(path, "rb") as f:
            hashes[os.path.basename(path)] = hashlib.sha256(f.read()).hexdigest()
    return hashes


def assert_checkpoints_intact(out_dir, before: dict):
    """Each checkpoint there before is unchanged and loads; any other one loads too."""
    after = checkpoint_hashes(out_dir)
    assert {name: after.get(name) for name in before} == before
    for name in after:
        assert checkpoints.load_checkpoint(os.path.join(out_dir, name))["step"] == int(name[5:12])


def error_lines(stderr) -> list:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def launch_per_rank(shell, args, env=None, script="train_gpt2.py", **popen):
    """torchrun of 2 ranks running `bash -c shell _ python script args`: the shell can give each
    rank ($RANK) its own flags or folder, as a job script on each node might."""
    launch = torchrun("--standalone", "--nproc_per_node=2", "--no-python")
    return start([*launch, "bash", "-c", shell, "_", sys.executable, str(REPO / script), *args], env=env, **popen)


def trained_run(data_dir, out) -> tuple:
    """out holding one checkpoint (step 2), and its hashes."""
    assert tg.main(args_for(data_dir, out)) == 0
    return out, checkpoint_hashes(out)


@pytest.fixture
def trained(data_dir, tmp_path):
    return trained_run(data_dir, tmp_path / "out")


# --- ranks that agree --------------------------------------------------------------------------


def test_ranks_with_different_flags_are_refused_naming_the_first(data_dir, trained):
    # before: a different --max-steps ended in a gloo SIGABRT (83 lines); a different --max-lr trained on.
    # The launcher's side of every start-up refusal: torchrun exits 1, one line, each rank's exit code 2
    out, hashes = trained
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
    assert_checkpoints_intact(out, hashes)
    assert sorted(os.listdir(out)) == ["ckpt_0000002.pt", "log.jsonl"]


# The other start-up refusals: each set up in a folder of its own, then all run as cases of ONE torchrun launch
# (conftest's run_on_ranks). A setup gives its case, the one line expected, and a check of what the case left.


def different_data_of_the_same_sizes(data_dir, folder):
    # the same --data-dir holds another corpus on each rank, cut into shards of the same names and
    # sizes, as two nodes' local copies might: it trained on (the ranks compared names and sizes)
    out, hashes = trained_run(data_dir, folder / "out")
    for rank in (0, 1):
        shutil.copytree(data_dir, folder / f"rank{rank}" / "data")
    shard = sorted(glob.glob(str(folder / "rank1" / "data" / "*_train_*.npy")))[-1]
    np.save(shard, np.load(shard)[::-1])  # the same tokens in another order: same size
    name, size = os.path.basename(shard), os.path.getsize(shard)
    sampled = [shard_files([str(folder / f"rank{rank}" / "data" / name)])[0][2][:12] for rank in (0, 1)]
    line = (
        f"error: the ranks of this launch were started differently: train shards in "
        f"--data-dir: {name} is {size} bytes of sampled content {sampled[0]} on rank 0 but "
        f"{size} bytes of sampled content {sampled[1]} on rank 1; every rank needs the same "
        "command and the same --data-dir files"
    )
    args = args_for("data", out, "--resume")
    case = dict(script="train_gpt2", argv=[args, args], cwd=[folder / "rank0", folder / "rank1"])
    return case, line, lambda ranks: assert_checkpoints_intact(out, hashes) is None  # (it asserts)


def a_copy_that_differs_outside_the_sampled_slices(data_dir, folder):
    """One byte differs between two nodes' copies of a shard, outside the 16 slices the ranks compare at
    start-up (before: trained on, the manifest's sha256 never checked): rank 1's full check of its copy,
    beside the steps, stops every rank before a checkpoint, in one line naming the shard and the rank."""
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


REFUSED = (
    different_data_of_the_same_sizes,
    a_copy_that_differs_outside_the_sampled_slices,
    a_file_that_only_one_rank_lacks,
)


@pytest.fixture(scope="module")
def refused(data_dir, tmp_path_factory) -> dict:
    """By setup's name in REFUSED: its line, its check, and its case's result on each rank."""
    setups = [setup(data_dir, tmp_path_factory.mktemp(setup.__name__)) for setup in REFUSED]
    results = run_on_ranks([case for case, _, _ in setups])
    return {setup.__name__: (*rest, ranks) for setup, (_, *rest), ranks in zip(REFUSED, setups, results)}


@pytest.mark.parametrize("setup", [setup.__name__ for setup in REFUSED])
def test_ranks_that_see_different_inputs_stop_alike_with_one_line(refused, setup):
    """Every rank exits 2, their stderr together holds the one `error:` line and no traceback, and what was
    there before is left as it was (setup's check)."""
    line, check, ranks = refused[setup]
    err = "".join(rank.stderr for rank in ranks)
    assert [rank.returncode for rank in ranks] == [2, 2] and error_lines(err) == [line], err[-3000:]
    assert "[rank" not in err and "Traceback" not in err and "terminate called" not in err, err[-3000:]
    assert check(ranks)


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
        wait_for(lambda: len(glob.glob(str(out / "ckpt_*.pt"))) >= 3, proc, what="three checkpoints")
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
    assert proc.returncode == 1
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    survivor = 1 - victim
    assert lines[0].startswith(f"error: rank {survivor}: another rank of this launch died or stopped answering (")
    named = lines[0].split("Last good checkpoint: ")[1].split(" (resume with")[0]
    assert os.path.basename(named) in checkpoint_hashes(out)
    assert int(named[-10:-3]) >= max(int(name[5:12]) for name in hashes)
    assert "[rank" not in err and "terminate called" not in err  # no worker traceback, no C++ abort
    assert "exitcode  : 1" in err and "exitcode  : -9" in err  # the survivor's 1, the victim's SIGKILL
    assert_checkpoints_intact(out, hashes)


def hellaswag_per_rank(out, rank1_args, **popen):
    """hellaswag.py under torchrun on 2 ranks, on out's checkpoint: rank 1 gets rank1_args on top."""
    shell = 'if [ "$RANK" = 1 ]; then exec "$@" $RANK1_ARGS; else exec "$@"; fi'
    return launch_per_rank(
        shell,
        ["--checkpoint", str(out), "--data-file", str(HELLASWAG_FILE), "--limit", "6"],
        env={"RANK1_ARGS": rank1_args},
        script="hellaswag.py",
        **popen,
    )


def test_a_killed_rank_during_hellaswag_is_one_line(trained, tmp_path):
    # rank 1 has all 446 examples to score (rank 0: 6): rank 0 scores its share and waits for rank 1
    # in the final all-reduce, where rank 1's death fails it (before: a gloo traceback)
    with open(tmp_path / "stderr", "w") as stderr:
        proc = hellaswag_per_rank(trained[0], "--limit 0", stderr=stderr, start_new_session=True)
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
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith(
        "error: rank 0: another rank of this launch died or stopped answering ("
    ), err[-3000:]
    assert lines[0].endswith("so this rank stopped too; torchrun's report below names the rank that failed first")
    assert "RuntimeError" not in err and "pair.cc" not in err and "terminate called" not in err  # no gloo traceback


# --- teardown --------------------------------------------------------------------------------


def test_fsdp_eval_only_ends_cleanly_on_every_rank(data_dir, trained):
    # reported: 4 of 13 such runs aborted at exit ("terminate called without an active exception");
    # the ranks left at different times (no barrier, unlike training's last save), now they meet first
    out, hashes = trained
    proc = launch_per_rank(
        'exec "$@"',
        args_for(data_dir, out, "--fsdp", "--eval-only", "--resume", "--val-every", "1", "--val-steps", "1"),
    )
    stdout, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    json_lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(json_lines) == 1 and json_lines[0].startswith('{"step": 2, "val_loss": '), stdout
    assert "terminate called" not in err and "Traceback" not in err and "error" not in err, err[-3000:]
    assert_checkpoints_intact(out, hashes)
    assert sorted(os.listdir(out)) == ["ckpt_0000002.pt", "log.jsonl"]
