"""Hostile input to the trainer: one `error:` line, exit code 2, no traceback; never a checkpoint or log lost,
corrupted or filled with non-finite numbers. In-process (run_main) but what only a process shows: Ctrl-C during
start-up, memory and file-size limits (a log that is a named pipe: test_hostile_inputs)."""

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import fineweb
import train_gpt2 as tg
from conftest import HELLASWAG_FILE, REPO, assert_one_error_line, assert_refused, free_port, interrupt_when_blocked
from conftest import log_records, resume_copy, run_command, run_main, start, tiny_run_args, train_records
from conftest import trained_steps, tree_hashes
from shards import make_docs, write_shards
from trainkit.cli import UserError
from trainkit.runfiles import checkpoint_checks, checkpoints, resume
from trainkit.runtime import launch, recovery

SHARDS = dict(n_docs=300, seed=3)
FLOAT_FLAGS = ["--max-lr", "--grad-clip", "--weight-decay", "--dist-timeout", "--muon-lr"]
SHIFT_STEP = 25  # where shift_data's rows change
BAD_FLAGS = {  # the flags: the whole line (where it ends in ..., its start); every float flag must be finite
    "--max-lr inf": "--max-lr must be a finite number, got inf",
    "--val-every 5 --val-steps 0": "--val-steps 0 with --val-every > 0 evaluates nothing: pass --val-steps N or "
    "--val-every 0",
    "--seed -1 --shuffle": "argument --seed: must be in 0..2**64-1, got -1 (see train_gpt2.py --help)",
    f"--batch-size {10**20}": f"argument --batch-size: must be in 1..2**62, got {10**20} (see train_gpt2.py --help)",
    "--optimizer muon --fsdp": "--optimizer muon does not run under --fsdp (Muon needs each whole weight matrix, "
    "which FSDP splits over the ranks): drop --fsdp (DDP) or use --optimizer adamw",
    "--dist-timeout 1": "--dist-timeout must be in [30.0, 1e9] seconds, got 1.0: healthy ranks wait this long for "
    "each other (rank 0 writing a checkpoint or samples, the first step compiling), and a shorter wait reports them "
    "as dead",
    "--n-layer 100000 --n-embd 8192": "the model has 8.05e+04B parameters: its weights, gradients and AdamW state "
    "(16 bytes per parameter) need 1.2e+06 GiB, more than this machine's RAM (...",  # (its size, then the advice)
    "--vocab-size 100 --sample-every 5 --hellaswag-every 5": "--vocab-size 100 is smaller than GPT-2's 50257 "
    "tokens, which sampling and HellaSwag feed the model: pass --sample-every 0 --hellaswag-every 0",
    # finite flags, yet the first update overflows the weights: the checkpoint after it is refused
    "--max-lr 1e38 --warmup-steps 0 --ckpt-every 1": "step 1: not writing {out}/ckpt_0000001.pt: the model weights "
    "(transformer.wte.weight, ...) hold non-finite values. Last good checkpoint: none",
    **{f"{flag} nan": f"{flag} must be a finite number, got nan" for flag in FLOAT_FLAGS},
}


@pytest.mark.parametrize("flags", BAD_FLAGS)
def test_bad_flag_is_one_line(data_dir, tmp_path, flags):
    out, message = tmp_path / "out", BAD_FLAGS[flags].format(out=tmp_path / "out")
    result = run_main("train_gpt2.py", *tiny_run_args(data_dir, out, *flags.split(), steps=3))
    assert_one_error_line(result, "error: " + message.removesuffix("..."))  # (ending in "...": the line's start)
    assert message.endswith("...") or result.stderr == f"error: {message}\n"
    assert not out.exists() or not [f for f in os.listdir(out) if f.endswith(".pt")]


EARLIER = "use the earlier checkpoint {run}/ckpt_0000002.pt"
FOREIGN_OR_DAMAGED = {  # "command what": the line after the checkpoint's path (nanoGPT's, a tensor: test_hf_interop)
    "resume unknown-key": "not a train_gpt2.py checkpoint (unknown model_config rotary)",
    "export flipped": "damaged checkpoint",
    "hellaswag flipped": "damaged checkpoint",
    "run empty": "cannot load checkpoint (empty file (0 bytes)); truncated or corrupt: " + EARLIER,
    "run flipped": "damaged checkpoint (its contents do not match the sha256 written with it): " + EARLIER,
}


@pytest.mark.parametrize("case", FOREIGN_OR_DAMAGED)
def test_foreign_or_damaged_checkpoint_in_every_command(finished_run, data_dir, tmp_path, case):
    """`run`: the run's newest, resumed by --resume alone (the line names the earlier); `empty`: what a power loss
    leaves unfsynced; `flipped`: 8 bytes inside the tensor data (it still loads); `unknown-key`: re-checksummed."""
    (command, what), path, run = case.split(), tmp_path / "given.pt", tmp_path / "run"
    shutil.copy(finished_run / "ckpt_0000004.pt", path)
    if command == "run":
        path = shutil.copytree(finished_run, run) / "ckpt_0000004.pt"
    data, mid = path.read_bytes(), path.stat().st_size // 2
    flipped = data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 8]) + data[mid + 8 :]
    if what == "unknown-key":
        ckpt = checkpoints.load_checkpoint(str(path))
        ckpt["model_config"]["rotary"] = True
        torch.save(dict(ckpt, checksum=checkpoints.state_digest(ckpt)), path)
    else:
        path.write_bytes(b"" if what == "empty" else flipped)
    commands = {
        "run": ("train_gpt2.py", *tiny_run_args(data_dir, run, "--resume", steps=6, ckpt_every=2)),
        "resume": ("train_gpt2.py", *tiny_run_args(data_dir, tmp_path / "out", "--resume", path, steps=6)),
        "export": ("hf_interop.py", "export", path, tmp_path / "hf"),
        "hellaswag": ("hellaswag.py", "--checkpoint", path, "--data-file", HELLASWAG_FILE, "--limit", 2),
    }
    assert_one_error_line(run_main(*commands[command]), f"{path}: {FOREIGN_OR_DAMAGED[case].format(run=run)}")


@pytest.mark.parametrize("via", ["load_checkpoint", "sample.py"])
def test_a_checkpoint_removed_while_loading(finished_copy, monkeypatch, via):
    """By a live run's --keep-last: gone before it is opened, one line; gone once open, the open file loads whole."""
    run, found = finished_copy, os.path.isfile

    def found_then_removed(path):  # there when looked for, gone when opened
        there = found(path)
        if there and os.path.basename(path) == "ckpt_0000004.pt":
            os.remove(path)
        return there

    monkeypatch.setattr(os.path, "isfile", found_then_removed)
    line = (
        f"checkpoint {run / 'ckpt_0000004.pt'} was removed while loading (by its run's --keep-last?); the newest "
        f"beside it now: {run / 'ckpt_0000002.pt'}"
    )
    if via == "sample.py":
        result = run_main("sample.py", "--checkpoint", run, "--max-new-tokens", 1, "--num-samples", 1)
        return assert_one_error_line(result, line)
    with pytest.raises(UserError) as removed:
        checkpoints.load_checkpoint(str(run))
    assert str(removed.value) == line
    monkeypatch.undo()
    loaded = torch.load

    def removed_once_open(f, *args, **kwargs):
        os.remove(run / "ckpt_0000002.pt")
        return loaded(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", removed_once_open)
    assert (checkpoints.load_checkpoint(str(run / "ckpt_0000002.pt"))["step"], os.listdir(run)) == (2, ["log.jsonl"])


def test_only_numbered_checkpoints_are_ours(data_dir, tmp_path):
    (tmp_path / "ckpt_best.pt").write_bytes(b"the user's own file")
    assert tg.main(tiny_run_args(data_dir, tmp_path, "--keep-last", "1", steps=4, ckpt_every=2)) == 0
    assert tg.main(tiny_run_args(data_dir, tmp_path, "--keep-last", "1", "--resume", steps=6, ckpt_every=2)) == 0
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000006.pt", "ckpt_best.pt", "log.jsonl"]
    assert (tmp_path / "ckpt_best.pt").read_bytes() == b"the user's own file"
    assert trained_steps(tmp_path) == list(range(6))


def test_resume_from_another_runs_checkpoint_never_touches_this_log(finished_run, data_dir, tmp_path):
    other, given = tmp_path / "other", finished_run / "ckpt_0000004.pt"
    assert tg.main(tiny_run_args(data_dir, other, steps=2, ckpt_every=2)) == 0
    theirs, mine = (resume.read_run(str(p))["id"] for p in (other / "ckpt_0000002.pt", given))
    os.rename(other / "ckpt_0000002.pt", tmp_path / "moved_away.pt")  # the log alone still tells whose the folder is
    before = tree_hashes(other)
    assert_one_error_line(
        run_main("train_gpt2.py", *tiny_run_args(data_dir, other, "--resume", given, steps=6)),
        f"{other / 'log.jsonl'} is not the log of the run that wrote {given} (the log is of run {theirs}, the "
        f"checkpoint of run {mine}): resuming would corrupt it; resume into the --out-dir of the checkpoint's own run, "
        "or a new one",
    )
    assert tree_hashes(other) == before
    # into a folder without a log, the resumed run starts a log of its own: a branch, its resume record naming the
    # run it branched from (for plot_log.py to join it to that run's curve and no other)
    assert tg.main(tiny_run_args(data_dir, tmp_path / "new", "--resume", str(given), steps=6)) == 0
    assert trained_steps(tmp_path / "new") == [4, 5]
    (record,) = [r for r in log_records(tmp_path / "new") if r.get("event")]
    assert record["parent"] == mine == log_records(finished_run)[0]["run"] != record["run"] and record["step"] == 4


def test_resume_at_or_past_max_steps_says_so(finished_copy, data_dir):
    """Past it, a mistake: one line; at it, a finished run started again (a requeued job): nothing to do."""
    run, ckpt, before = finished_copy, finished_copy / "ckpt_0000004.pt", tree_hashes(finished_copy)
    past = run_main("train_gpt2.py", *tiny_run_args(data_dir, run, "--resume", steps=3))
    assert_one_error_line(past, f"{ckpt} is at step 4, past --max-steps 3: pass a larger --max-steps to train on")
    at = run_main("train_gpt2.py", *tiny_run_args(data_dir, run, "--resume", steps=4))
    nothing = f"{ckpt} is already at --max-steps 4: nothing to train"
    assert (at.returncode, at.stderr, nothing in at.stdout, tree_hashes(run)) == (0, "", True, before)


@pytest.fixture(scope="module")
def shift_data(tmp_path_factory):
    """Rows of one 16-token pattern for SHIFT_STEP steps, then random tokens: the loss moves from ~3.5 to 10.4."""
    path = tmp_path_factory.mktemp("shift")
    rows = SHIFT_STEP * 8  # args_for: 8 rows of 16 tokens per step
    np.save(path / "s_train_000001.npy", np.tile(np.arange(16, dtype=np.uint16), rows + 1)[: rows * 16 + 1])
    np.save(path / "s_train_000002.npy", np.random.default_rng(0).integers(0, 64, 200 * 128).astype(np.uint16))
    return str(path)


def test_skip_spikes_adapts_to_a_lasting_shift_and_resumes_bit_exact(shift_data, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert tg.main(tiny_run_args(shift_data, straight, "--skip-spikes", "3", steps=60, ckpt_every=20)) == 0
    records = train_records(straight)
    skipped = [r["step"] for r in records if r.get("skipped")]
    # a few updates skipped at the shift, then the window has moved and learning goes on
    assert skipped == list(range(SHIFT_STEP, SHIFT_STEP + len(skipped))) and 0 < len(skipped) < 10
    assert records[-1]["loss"] < records[SHIFT_STEP]["loss"] - 2
    # resumed before the shift, the restored window skips exactly the same steps
    resume_copy(straight, resumed, 20)
    assert tg.main(tiny_run_args(shift_data, resumed, "--skip-spikes", "3", "--resume", steps=60, ckpt_every=20)) == 0
    fields = lambda records: [(r["step"], r["loss"], r.get("skipped")) for r in records]
    assert fields(train_records(resumed)) == fields(records)
    a, b = (checkpoints.load_checkpoint(str(d / "ckpt_0000060.pt")) for d in (straight, resumed))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and a["skip_state"] == b["skip_state"]


def test_skip_spikes_cannot_skip_forever(shift_data, tmp_path):
    # Z = 0.5 is too low to let the window catch up with the shift: the bound stops the run
    assert_one_error_line(
        run_main("train_gpt2.py", *tiny_run_args(shift_data, tmp_path, "--skip-spikes", "0.5", steps=80)),
        f"{recovery.MAX_SPIKES_IN_A_ROW + 1} updates in a row flagged by --skip-spikes 0.5: the loss or grad "
        "norm has moved for good (or Z is too low) and skipping cannot fix that; stopped before the update. Last "
        f"good checkpoint: {tmp_path / 'ckpt_0000040.pt'}",
    )
    skipped = [r["step"] for r in log_records(tmp_path) if r.get("skipped")]
    assert skipped == list(range(skipped[0], skipped[0] + recovery.MAX_SPIKES_IN_A_ROW))  # then the stop


@pytest.fixture(scope="module")
def made_data(tmp_path_factory):
    """A data set fineweb.py made (its manifest.json lists 5 shards: val_000000, train_000001..4), and its input."""
    folder = tmp_path_factory.mktemp("made")
    words = "the quick brown fox jumps over a lazy dog while some more words of text follow it".split()
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, rng.integers(5, 80))) for _ in range(400)]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return make_data(folder / "docs.jsonl", folder / "data")


def make_data(docs, out):
    assert fineweb.main(["--files", str(docs), "--out-dir", str(out), "--shard-size", "4000", "--workers", "1"]) == 0
    return out


@pytest.mark.parametrize("case", ["another set's shard", "a .bin beside its .npy", "a shard of other bytes"])
def test_a_manifest_is_the_list_of_shards(made_data, tmp_path, case):
    """No shards but those it lists (before: 8,333 rows per epoch became 12,331), of the sha256 it records (checked
    beside the steps: stopped before a checkpoint); missing or resized: test_output, test_cache_and_manifest."""
    data, out = shutil.copytree(made_data, tmp_path / "data"), tmp_path / "out"
    shard, manifest = data / "data_train_000002.npy", data / "manifest.json"
    stray = (
        "{} is not one of the shards that {} lists: move it out of the folder (where a manifest is, the trainer "
        "reads the shards it lists and no others)"
    )
    if case == "another set's shard":
        shutil.copy(shard, data / "other_train_000001.npy")
        message = stray.format(data / "other_train_000001.npy", manifest)
    elif case == "a .bin beside its .npy":
        header = np.zeros(256, dtype=np.int32)  # llm.c's: magic, version, token count
        header[:3] = 20240520, 1, len(np.load(shard))
        (data / "data_train_000002.bin").write_bytes(header.tobytes() + np.load(shard).astype(np.uint16).tobytes())
        message = stray.format(data / "data_train_000002.bin", manifest)
    else:
        shard = data / "data_train_000003.npy"
        tokens = np.load(shard)
        tokens[int(np.flatnonzero(tokens < 50000)[100])] ^= 1  # another real token
        np.save(shard, tokens)
        now, listed = hashlib.sha256(shard.read_bytes()).hexdigest(), json.loads(manifest.read_text())["shards"][3]
        message = (
            f"{shard} has sha256 {now[:16]}..., not the {listed['sha256'][:16]}... that {manifest} records: the file "
            "changed since fineweb.py wrote it (a damaged copy?); restore it, or re-create the data set with fineweb.py"
        )
    before = tree_hashes(data)
    assert_refused(run_main("train_gpt2.py", *tiny_run_args(str(data), out, steps=4, ckpt_every=2)), message)
    assert tree_hashes(data) == before and not list(out.glob("ckpt_*.pt"))
    assert case == "a shard of other bytes" or not out.exists()


def test_resume_on_shards_made_again_byte_identical_says_nothing(made_data, tmp_path):
    # before: "warning: ... changed since ... (its manifest.json differs): from step 2 on this run reads other
    # rows than the run it continues would have": the manifests differ only in the input's path and mtime
    data, out = shutil.copytree(made_data, tmp_path / "data"), tmp_path / "out"
    assert tg.main(tiny_run_args(str(data), out, steps=2, ckpt_every=2)) == 0
    shutil.copy(made_data.parent / "docs.jsonl", tmp_path / "copy.jsonl")  # the same text, another path and mtime
    shutil.rmtree(data)
    make_data(tmp_path / "copy.jsonl", data)
    assert (data / "manifest.json").read_bytes() != (made_data / "manifest.json").read_bytes()
    npy = lambda folder: {k: v for k, v in tree_hashes(folder).items() if k.endswith(".npy")}
    assert npy(data) == npy(made_data)
    result = run_main("train_gpt2.py", *tiny_run_args(str(data), out, "--resume", steps=4, ckpt_every=2))
    assert (result.returncode, result.stderr, trained_steps(out)) == (0, "", [0, 1, 2, 3])


@pytest.mark.parametrize("case", ["--vocab-size 60000", "--eval-only", "the manifest's max_id"])
def test_token_ids_the_model_has_no_output_for_are_refused_at_start_up(made_data, finished_run, tmp_path, case):
    # before: the vocabulary check passed ids 50257..50303 (below the padded 50304 or --vocab-size 60000), and the
    # run died when that row was first read: RuntimeError in runtime/kernels.py, IndexError with --loss-chunk 0
    data, out = tmp_path / "data", tmp_path / "out"
    if case == "the manifest's max_id":  # fineweb.py records each shard's largest id: the trainer reads that
        shutil.copytree(made_data, data)
        manifest = json.loads((data / "manifest.json").read_text())
        manifest["shards"][2]["max_id"] = 50290
        (data / "manifest.json").write_text(json.dumps(manifest))
    else:  # shards of another tool, no manifest: the trainer finds the largest id itself
        paths = write_shards(data, make_docs(300, seed=3, vocab=64), shard_size=1500)
        tokens = np.load(paths[2])
        tokens[1234] = 50290  # a pad token that a GPT-2 tokenizer with an added token wrote
        np.save(paths[2], tokens)
    shard = sorted(data.glob("*_train_*.npy"))[1]
    flags = {
        "--vocab-size 60000": case.split(),
        "--eval-only": "--eval-only --resume --val-every 1 --val-steps 1".split(),
    }
    if case == "--eval-only":
        shutil.copytree(finished_run, out)
    before = {folder: tree_hashes(folder) for folder in (data, out) if folder.exists()}
    assert_refused(
        run_main("train_gpt2.py", *tiny_run_args(str(data), out, *flags.get(case, []), steps=4)),
        f"{shard} holds token id 50290, which the model has no output for: its softmax covers GPT-2's 50257 tokens (ids "
        "0..50256), whatever --vocab-size pads; the shards come from another tokenizer (one with added tokens?): "
        "re-create them with fineweb.py",
    )
    assert {folder: tree_hashes(folder) for folder in (data, out) if folder.exists()} == before
    assert out.exists() == (case == "--eval-only")


def test_log_cut_mid_record_is_left_whole_and_the_run_resumes(finished_copy, data_dir):
    run, limit = finished_copy, 10_000_000  # bytes per file: a checkpoint (~9.8 MB) fits, the log reaches it soon
    log = (json.dumps(dict(step=-1, note="x" * (limit - 2000))) + "\n").encode() + (run / "log.jsonl").read_bytes()
    (run / "log.jsonl").write_bytes(log)  # that long at the step-4 checkpoint
    ckpt = checkpoints.load_checkpoint(str(run / "ckpt_0000004.pt"))
    ckpt.update(log_offset=len(log), log_sha256=hashlib.sha256(log).hexdigest())
    torch.save(dict(ckpt, checksum=checkpoints.state_digest(ckpt)), run / "ckpt_0000004.pt")

    def file_size_limit():  # what a full disk does to one file: a short write, then EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = tiny_run_args(data_dir, run, "--resume", steps=20, ckpt_every=2)
    result = run_command("train_gpt2.py", *args, preexec_fn=file_size_limit)
    last = checkpoints.latest_checkpoint(str(run))
    assert_one_error_line(
        result,
        f"cannot write {run / 'log.jsonl'}: file too large (the log ends at its last whole record). Last good "
        f"checkpoint: {last}",
    )
    text = (run / "log.jsonl").read_text()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())
    assert checkpoints.load_checkpoint(last)["step"] >= 4
    assert tg.main(args) == 0  # space freed
    assert trained_steps(run) == list(range(20))


def test_ctrl_c_during_start_up_is_one_line(data_dir, tmp_path):
    """Held in its start-up (a patch of open_shard in its process reads a named pipe first) when Ctrl-C comes."""
    fifo = tmp_path / "hold"
    os.mkfifo(fifo)
    code = f"""import runpy, sys
sys.path.insert(0, {str(REPO)!r})
import trainkit.data.shards as shards
def held(path, open_shard=shards.open_shard):
    with open({str(fifo)!r}, "rb") as f:
        f.read()
    return open_shard(path)
shards.open_shard = held
sys.argv[0] = {str(REPO / "train_gpt2.py")!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    # as from a terminal: a shell running the tests in the background would leave SIGINT ignored
    command = [sys.executable, "-c", code, *tiny_run_args(data_dir, tmp_path / "out")]
    proc = start(command, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out, err = interrupt_when_blocked(proc, fifo)
    assert (proc.returncode, err) == (130, "error: interrupted\n")


def test_second_ctrl_c_during_a_checkpoint_write_keeps_the_previous_one(data_dir, tmp_path, monkeypatch, capsys):
    real_save, saves = torch.save, []

    def interrupted_save(obj, file):
        saves.append(file)
        if len(saves) == 2:
            file.write(b"PK\x03\x04 partial")
            raise KeyboardInterrupt
        real_save(obj, file)

    monkeypatch.setattr(tg.torch, "save", interrupted_save)
    assert tg.main(tiny_run_args(data_dir, tmp_path, steps=6, ckpt_every=2)) == 130
    assert capsys.readouterr().err == "error: interrupted\n"
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000002.pt", "log.jsonl"]
    assert checkpoints.load_checkpoint(str(tmp_path / "ckpt_0000002.pt"))["step"] == 2


TORCHRUNS = "LOCAL_RANK=0 MASTER_ADDR=localhost MASTER_PORT=1"  # what torchrun sets beside RANK and WORLD_SIZE
RANK_VARIABLES = {  # {case: (the variables set, the line)}
    "no MASTER_ADDR": (
        "RANK=0 WORLD_SIZE=1 LOCAL_RANK=0",
        "MASTER_ADDR is not set, but RANK=0, LOCAL_RANK=0, WORLD_SIZE=1 are: launch with torchrun, which sets them "
        "all, or unset RANK, LOCAL_RANK and WORLD_SIZE to run one process",
    ),
    "RANK alone": ("RANK=0", "LOCAL_RANK is not set, but RANK=0 is: launch with torchrun"),
    "WORLD_SIZE=two": (
        f"RANK=0 WORLD_SIZE=two {TORCHRUNS}",
        "WORLD_SIZE='two' is not a whole number: launch with torchrun",
    ),
    "RANK past WORLD_SIZE": (
        f"RANK=2 WORLD_SIZE=2 {TORCHRUNS}",
        "RANK=2 with WORLD_SIZE=2: the ranks are 0..WORLD_SIZE-1; launch with torchrun",
    ),
}


@pytest.mark.parametrize("variables,message", RANK_VARIABLES.values(), ids=list(RANK_VARIABLES))
def test_rank_variables_without_torchrun_are_one_line(finished_run, data_dir, variables, message):
    env, before = dict(v.split("=") for v in variables.split()), tree_hashes(finished_run)
    for script, args in [
        ("train_gpt2.py", tiny_run_args(data_dir, finished_run, "--resume", steps=6)),
        ("hellaswag.py", ["--checkpoint", finished_run, "--limit", "1"]),
    ]:
        assert_one_error_line(run_main(script, *args, env=env), message)
    assert tree_hashes(finished_run) == before


def test_ranks_that_never_gather_are_one_line(monkeypatch, capsys):
    # launch.process_group, which every script's ranks join through, with a second rank that never comes: the
    # store's timeout (2 s here; --dist-timeout in the trainer)
    port = str(free_port())
    for variable in f"RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT={port}".split():
        monkeypatch.setenv(*variable.split("="))

    def join():
        with launch.process_group("cpu", 2):
            pass

    result = subprocess.CompletedProcess([], launch.exit_code_on_every_rank(join), "", capsys.readouterr().err)
    assert_one_error_line(
        result,
        f"error: rank 0: could not gather the WORLD_SIZE=2 ranks of this launch at 127.0.0.1:{port} within 2 s "
        "(DistStoreError: ",
        "start all 2 ranks (torchrun does), or unset RANK, LOCAL_RANK and WORLD_SIZE",
    )


def test_libraries_that_cannot_load_under_a_memory_limit_are_one_line(data_dir, tmp_path):
    def limit_memory():  # ulimit -v 300000: too little to map torch's shared libraries
        resource.setrlimit(resource.RLIMIT_AS, (300_000 * 1024,) * 2)

    for script, args in [
        ("train_gpt2.py", tiny_run_args(data_dir, tmp_path / "out", steps=2)),
        ("sample.py", ["--checkpoint", tmp_path / "c.pt"]),
    ]:
        assert_one_error_line(
            run_command(script, *args, preexec_fn=limit_memory),
            "error: cannot import the libraries this script needs (ImportError: ",
            "under a memory limit (ulimit -v) raise it, otherwise reinstall them",
        )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sizes", [(1, 2, 16, 32, 100), (3, 4, 8, 7, 64)])
def test_gpt_state_shapes_are_the_models(sizes):
    shape = dict(zip(("n_layer", "n_head", "n_embd", "block_size", "vocab_size"), sizes))
    state = tg.GPT(tg.GPTConfig(**shape)).state_dict()
    assert checkpoint_checks.gpt_state_shapes(shape) == {k: tuple(v.shape) for k, v in state.items()}


CANNOT_USE = ["log cut short", "log not JSON", "log on a full disk", "out-dir a file", "NaN in the optimizer"]
CANNOT_USE += ["init-from a file", "export into a missing folder", "resume of a log", "export of a shard"]


@pytest.mark.parametrize("case", CANNOT_USE)
def test_a_folder_or_file_a_command_cannot_use_is_one_line_and_left_as_it_was(finished_run, data_dir, tmp_path, case):
    """The line's fragments, the first its start; "... of a log/shard": --resume PATH into a new --out-dir, or an
    export, of a file that is no checkpoint (one loader: each command and each kind once)."""
    out, ckpt, new, hf = tmp_path / "run", finished_run / "ckpt_0000004.pt", tmp_path / "new", tmp_path / "hf"
    log, shard = out / "log.jsonl", os.path.join(data_dir, min(p for p in os.listdir(data_dir) if "_train_" in p))
    newest = shutil.copytree(finished_run, out) / "ckpt_0000004.pt"
    train = lambda out, *extra, steps=6: ("train_gpt2.py", *tiny_run_args(data_dir, out, *extra, steps=steps))
    no_ckpt = "{} is not a checkpoint but {}: pass a ckpt_NNNNNNN.pt or a run's --out-dir ({})".format
    of_log = no_ckpt(log, "a JSON text file (a log.jsonl?)", f"the newest checkpoint beside it is {newest}")
    of_shard = no_ckpt(shard, "a NumPy array (a token shard?)", "there is no checkpoint beside it")
    commands_and_lines = {
        "resume of a log": (train(new, "--resume", log), of_log),
        "export of a shard": (("hf_interop.py", "export", shard, hf), of_shard),
        "log cut short": (
            train(out, "--resume"),
            f"{log} is the log of run {log_records(finished_run)[0]['run']}, but not as it was when {newest} "
            "was written (it holds ",
            "it was cut short or edited since, and resuming would cut it in the wrong place; restore it, or move it "
            "aside (the resume then starts a new log.jsonl)",
        ),
        "log not JSON": (
            train(out, steps=2),
            f"--out-dir {out} holds a log.jsonl of no run (no line of it is a JSON record: not a log this trainer "
            "wrote) but no checkpoint to resume: move the log aside",
        ),
        "log on a full disk": (  # every write: ENOSPC
            train(out, steps=4),
            f"cannot write {log}: no space left on device (the log ends at its last whole record). Last good "
            "checkpoint: none",
        ),
        "out-dir a file": (
            train(log, steps=2),
            f"--out-dir {log} is a file, not a folder: a run writes its checkpoints and log.jsonl into a folder; "
            "choose another --out-dir",
        ),
        "NaN in the optimizer": (
            train(out, "--resume"),
            f"{newest}: the optimizer state holds NaN or inf (exp_avg of parameter 3): use the earlier "
            f"checkpoint {out}/ckpt_0000002.pt",
        ),
        "init-from a file": (
            ("train_gpt2.py", "--data-dir", data_dir, "--out-dir", new, "--init-from", ckpt),  # (no shape flags)
            f"--init-from {ckpt} is a file, and --init-from takes a Hugging Face GPT-2: a Hub name (gpt2, ...) or a "
            "folder written by save_pretrained; --resume PATH continues a train_gpt2.py checkpoint's run; to start "
            "a new run from its weights, export it (hf_interop.py export PATH DIR) and pass --init-from DIR",
        ),
        "export into a missing folder": (
            ("hf_interop.py", "export", out, tmp_path / "missing" / "hf"),
            f"cannot write the Hugging Face model to {tmp_path}/missing/hf: the folder it goes into, "
            f"{tmp_path}/missing, does not exist; create it, or choose another output folder",
        ),
    }
    if case == "log cut short":
        lines = log.read_bytes().splitlines(keepends=True)
        log.write_bytes(b"".join(lines[:1] + lines[2:]))  # one line deleted
    elif case in ("log not JSON", "log on a full disk"):
        shutil.rmtree(out)
        out.mkdir()
        log.write_bytes(bytes(range(256))) if case == "log not JSON" else log.symlink_to("/dev/full")
    elif case == "NaN in the optimizer":  # saved with a valid checksum, as by another program
        state = torch.load(ckpt, weights_only=True)
        state["optimizer"]["state"][3]["exp_avg"][0] = float("nan")
        checkpoints.save_checkpoint(str(newest), {k: v for k, v in state.items() if k != "checksum"})
    command, line, *fragments = commands_and_lines[case]
    before = tree_hashes(tmp_path), sorted(tmp_path.rglob("*"))  # (no folder made either)
    result = run_main(*command)
    assert_one_error_line(result, f"error: {line}", *fragments)
    assert (tree_hashes(tmp_path), sorted(tmp_path.rglob("*")), "weights_only" in result.stderr) == (*before, False)
