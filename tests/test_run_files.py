"""What a run writes is its own: a log left by a run killed before its first checkpoint is set aside; an evaluation
that fails after trained steps saves them first; a resume applies its own optimizer hyperparameters; an export names
the checkpoint it loaded. (Copied run folders, folders at a checkpoint's name: test_write_safety.)"""

import functools
import json
import os
import shutil

import pytest
import torch

import train_gpt2 as tg
from trainkit.runfiles import checkpoints
from conftest import HELLASWAG_FILE, RUN_SHARDS, assert_refused, run_main, tiny_run_args, trained_steps

SHARDS = RUN_SHARDS  # the shared finished run's data
run = functools.partial(run_main, "train_gpt2.py")


def test_the_same_command_after_a_kill_before_the_first_checkpoint_starts_again(finished_run, data_dir, tmp_path):
    """A log of 3 trained steps and no checkpoint (an OOM kill): the old log kept byte-identical in branch_0000003/,
    one note line; the new log.jsonl is created 0o666 less the umask."""
    out = tmp_path / "killed"
    out.mkdir()
    killed = b"".join((finished_run / "log.jsonl").read_bytes().splitlines(keepends=True)[:3])
    (out / "log.jsonl").write_bytes(killed)
    whose = json.loads(killed.splitlines()[0])["run"]
    os.umask(0o022)  # (this test's: the process's own is restored after it)
    result = run(*tiny_run_args(data_dir, out, steps=2, ckpt_every=2))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"note: {out}/log.jsonl holds 3 trained steps of run {whose} but no checkpoint (it stopped before its "
        f"first): moved to {out}/branch_0000003/log.jsonl, nothing was deleted; this run starts afresh"
    ) in result.stdout.splitlines()
    assert (out / "branch_0000003" / "log.jsonl").read_bytes() == killed
    assert trained_steps(out) == [0, 1]
    assert os.stat(out / "log.jsonl").st_mode & 0o777 == 0o644


def test_an_evaluation_that_fails_after_trained_steps_saves_them_first(data_dir, tmp_path, monkeypatch):
    """The HellaSwag file removed after step 1: step 20's evaluation fails after its steps are saved (one note line),
    the run stops with the evaluation's line; once the file is back, --resume goes on from step 20."""
    out, hellaswag = tmp_path / "out", tmp_path / "hellaswag.jsonl"
    shutil.copyfile(HELLASWAG_FILE, hellaswag)
    evaluation = ["--hellaswag-file", hellaswag, "--hellaswag-limit", "4"]
    args = tiny_run_args(data_dir, out, *evaluation, steps=24, ckpt_every=100, hellaswag_every=20)
    train_step = tg.Trainer.train_step

    def removing_the_file_after_step_1(trainer, step):
        if step == 2:
            os.remove(hellaswag)
        return train_step(trainer, step)

    monkeypatch.setattr(tg.Trainer, "train_step", removing_the_file_after_step_1)
    result = run(*args)
    monkeypatch.undo()
    assert_refused(result, f"--hellaswag-file {hellaswag} does not exist")
    assert result.stdout.splitlines()[-1] == (
        f"note: step 20's evaluation failed (the error below); the steps trained before it are saved first in "
        f"{out}/ckpt_0000020.pt: once fixed, resume with the same command plus --resume"
    )
    assert sorted(os.listdir(out)) == ["ckpt_0000020.pt", "log.jsonl"]
    shutil.copyfile(HELLASWAG_FILE, hellaswag)
    result = run(*args, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {out}/ckpt_0000020.pt at step 20" in result.stdout
    assert trained_steps(out) == list(range(24))


NEW_HYPERPARAMETERS = [  # optimizer, the resume's flags, the note
    ("adamw", "--weight-decay 0.0", "--weight-decay 0.1 -> 0.0"),
    ("muon", "--muon-momentum 0.5 --weight-decay 0.05", "--weight-decay 0.1 -> 0.05, --muon-momentum 0.95 -> 0.5"),
]


@pytest.mark.parametrize("optimizer, flags, note", NEW_HYPERPARAMETERS)
def test_a_resume_applies_its_own_optimizer_hyperparameters(data_dir, tmp_path, optimizer, flags, note):
    """The optimizer takes the resume's values, not the checkpoint's, in one note line; the same flags again: none."""
    out, flags = tmp_path / "out", flags.split()
    assert tg.main(tiny_run_args(data_dir, out, "--optimizer", optimizer, steps=2, ckpt_every=2)) == 0
    result = run(*tiny_run_args(data_dir, out, "--optimizer", optimizer, "--resume", *flags, steps=4, ckpt_every=2))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("note: the optimizer")] == [
        f"note: the optimizer takes this run's values, not its checkpoint's: {note}"
    ]
    state = torch.load(out / "ckpt_0000004.pt", weights_only=True)["optimizer"]
    adamw, muon = (state["adamw"], state["muon"]) if optimizer == "muon" else (state, None)
    decay = float(flags[flags.index("--weight-decay") + 1])
    assert [g["weight_decay"] for g in adamw["param_groups"]] == [decay, 0.0]
    if muon:
        assert [(g["momentum"], g["weight_decay"]) for g in muon["param_groups"]] == [(0.5, 0.0)]
    again = run(*tiny_run_args(data_dir, out, "--optimizer", optimizer, "--resume", *flags, steps=6, ckpt_every=2))
    assert again.returncode == 0 and "note: the optimizer" not in again.stdout, again.stderr[-3000:]


def test_an_export_of_a_run_folder_names_the_checkpoint_it_loaded(finished_copy, tmp_path, monkeypatch):
    """Exporting a run's folder while its run saves a newer checkpoint (simulated: one appears right after
    the export looks the newest up): the mark names the checkpoint whose step and checksum it holds."""
    import hf_interop

    newer = tmp_path / "newer"
    newer.mkdir()
    os.rename(finished_copy / "ckpt_0000004.pt", newer / "ckpt_0000004.pt")
    real_list = checkpoints.list_checkpoints

    def list_then_save(folder):
        found = real_list(folder)
        if os.path.exists(newer / "ckpt_0000004.pt"):  # the run's next save lands now
            os.rename(newer / "ckpt_0000004.pt", finished_copy / "ckpt_0000004.pt")
        return found

    monkeypatch.setattr(checkpoints, "list_checkpoints", list_then_save)
    out = hf_interop.export_hf(str(finished_copy), str(tmp_path / "hf"))
    mark = json.loads((tmp_path / "hf" / hf_interop.EXPORT_MARK).read_text())
    exported = checkpoints.load_checkpoint(mark["checkpoint"])
    assert out == str(tmp_path / "hf") and mark["checkpoint"] == str(finished_copy / "ckpt_0000002.pt")
    assert (mark["step"], mark["checksum"]) == (exported["step"], exported["checksum"]) == (2, exported["checksum"])
