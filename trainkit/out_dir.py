"""A run's --out-dir taken for it, and who may write there: made and checked (prepare_out_dir), the lock
(OutDirLock: one live run per folder, a flock on the folder itself), whose the folder is (claim_run: its
checkpoints must be of the resumed run's history, by run id), then its log, trackers and branch folders
opened in order (open_run_log). log.jsonl is trainkit/run_log.py's, branch folders trainkit/branch_folders.py's,
the W&B / TensorBoard sinks trainkit/run_trackers.py's.
"""

from __future__ import annotations

import os
import re

from trainkit.atomic_write import create_fresh
from trainkit.branch_folders import check_later_branch, set_aside_later_branch, set_aside_log_without_checkpoint
from trainkit.checkpoints import CKPT_NAME, checkpoint_step, list_checkpoints, same_file
from trainkit.resume import ResumePoint, choose_resume_checkpoint, in_history, new_run, read_run, run_name
from trainkit.cli import UserError, check_a_thread_starts, reason_of
from trainkit.folder_lock import FolderLock, remove_if_same
from trainkit.console import print0
from trainkit.own_files import shared_as
from trainkit.run_log import RunLog
from trainkit.run_trackers import open_sinks


def claim_run(out_dir: str, resumed: ResumePoint | None) -> dict:
    """Rank 0, before anything in out_dir changes: the identity of the run about to write there. A
    fresh run gets a new one; a resume of out_dir's newest checkpoint (a requeued job) keeps its run's;
    any other resume is a branch, with a new id naming the checkpoint's run and step as its parent.
    Every checkpoint in out_dir must belong to that history: up to the resumed step, a state the
    resumed checkpoint went through; past it, a later branch that went through it (set aside next).
    Any other is another run's: a UserError naming both runs, whether or not a log.jsonl is there."""
    if resumed is None:
        return new_run()
    mine, later = resumed.run, False
    for path in list_checkpoints(out_dir):
        if same_file(path, resumed.path):
            continue
        theirs, step = read_run(path), checkpoint_step(path)
        later |= step > resumed.step
        if theirs and not (
            in_history(theirs["id"], step, mine, resumed.step)
            if step <= resumed.step
            else in_history(mine["id"], resumed.step, theirs, step)
        ):
            raise UserError(
                f"cannot resume {resumed.path} ({run_name(mine['id'])}, step {resumed.step}) in --out-dir "
                f"{out_dir}: its {os.path.basename(path)} is another run's ({run_name(theirs['id'])}), and "
                "one folder holds one run; resume into the --out-dir of the checkpoint's own run, or a "
                "new one"
            )
    continues = not later and same_file(os.path.dirname(resumed.path) or ".", out_dir)
    return mine if continues else new_run(mine, resumed.step)


def open_run_log(run, model_cfg, resumed: ResumePoint | None) -> RunLog:
    """Rank 0, for a run that trains: its identity, log.jsonl and trackers. Every check comes before
    the first change to the folder: whose its checkpoints are (claim_run), the trackers (a W&B
    without a login), whether the later branch can move and its log's copy fits (check_later_branch),
    the log (whose it is, whether it can be cut, whether it opens); only then does the later branch move
    aside and the log get cut back to the checkpoint. (A fresh run sets aside the log of a run killed
    before its first checkpoint just before its own opens; a log shared with another folder is copied
    as it opens: own_files.own_file.) A system that lets no more threads start (the prefetcher's comes
    next) is refused first (check_a_thread_starts)."""
    check_a_thread_starts()
    identity = claim_run(run.out_dir, resumed)
    if resumed and identity["id"] == resumed.run["id"] and shared_as(os.path.join(run.out_dir, "log.jsonl")):
        identity = new_run(resumed.run, resumed.step)  # a copied run folder (cp -al) goes on as a branch of its run
    sinks = open_sinks(run, model_cfg, resumed.step if resumed else None)
    if resumed is None:
        set_aside_log_without_checkpoint(run.out_dir)  # (its checks first)
    else:
        check_later_branch(run.out_dir, resumed.step)  # movable, and space for the log's copy
    log = RunLog(run.out_dir, True, resumed, identity)  # (after the sinks: a W&B that cannot start leaves
    log.sinks = sinks  # no empty log.jsonl behind)
    try:
        if resumed:
            set_aside_later_branch(run.out_dir, resumed.step)
        log.cut_back()
    except UserError:
        log.close()
        raise
    if resumed:
        log.resend_step(resumed.step)
        branch = {} if identity["id"] == resumed.run["id"] else {"parent": resumed.run["id"]}
        log.write(event="resume", step=resumed.step, **branch)  # plot_log.py marks it on the curves (a branch's
        # on the curve of the run it names, where the log holds it)
    return log


class OutDirLock(FolderLock):
    """One live run per --out-dir (trainkit/folder_lock.py's FolderLock, as fineweb.py holds its own --out-dir): rank 0
    takes it once the input checks out, and the refusal of a second run says how to continue the first."""

    writer = "this trainer"

    def __init__(self, out_dir: str):
        super().__init__(out_dir)
        self.made = False  # the folder was made by this run: one it left empty (a refused resume) goes again

    def in_use(self, holder: str) -> str:
        return (
            f"--out-dir {self.folder} is in use by another training run ({holder}; it holds a lock on the "
            "folder): wait for it to end (then --resume continues it), or choose another --out-dir"
        )

    def note(self, line: str):
        print0(line)

    def check_claimed(self, last_checkpoint: str | None):
        """Rank 0, before the log opens and before each checkpoint: a UserError, naming both folders, where
        --out-dir no longer names the folder this run took (`mv OUT OUT.moved; ln -s OTHER OUT`). The run
        writes only into the folder it holds open (its log, its checkpoints: save_checkpoint's folder_fd),
        never into OTHER, and stops rather than go on where its --out-dir no longer shows it."""
        moved = self.moved_to()
        if moved is None:
            return
        where, now = moved
        last = (
            os.path.join(where, os.path.basename(last_checkpoint)) if last_checkpoint and where != "unknown" else None
        )
        raise UserError(
            f"--out-dir {self.folder} was moved or replaced while this run wrote to it: the folder it took is now "
            f"{where}, and {self.folder} names {now}; stopping, so that nothing of this run is written there. "
            f"Last good checkpoint: {last or last_checkpoint or 'none'}"
        )

    def release(self):
        held = self.fd is not None
        super().release()
        if held and self.made:  # (the folder it holds, never one put at its name since)
            remove_if_same(self.folder, self.identity)


# the names a run writes a file through (atomic_write's temporary files: checkpoints, log.jsonl's own copy)
_WRITTEN_THROUGH = re.compile(rf"(?:{CKPT_NAME.pattern}|log\.jsonl)\.tmp")


def prepare_out_dir(out_dir: str) -> bool:
    """Make --out-dir if needed and check it is writable: whether it was made now (OutDirLock.release
    removes it again if the run wrote nothing there)."""
    made = not os.path.lexists(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(
            f"--out-dir {out_dir} is a file, not a folder: a run writes its checkpoints and log.jsonl "
            "into a folder; choose another --out-dir"
        )
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test_{os.getpid()}")
        os.close(create_fresh(probe))  # (a link planted at the name is replaced, never opened)
        os.remove(probe)
    except OSError as e:
        raise UserError(f"cannot write to --out-dir {out_dir}: {reason_of(e)}") from None
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if CKPT_NAME.fullmatch(name) and not os.path.isfile(path):  # --keep-last would fail to delete it
            what = (  # mid-run, a save to write over it
                "a folder"
                if os.path.isdir(path)
                else "a symbolic link to nothing"
                if os.path.islink(path)
                else "not a regular file"
            )
            raise UserError(
                f"--out-dir {out_dir} holds {name}, {what} named as this trainer names its "
                "checkpoints: --resume, --keep-last and the save of its step would take it for one; "
                "rename it, or choose another --out-dir"
            )
        if _WRITTEN_THROUGH.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
            raise UserError(  # (a file or a link there is replaced: atomic_write.create_fresh; a folder is not)
                f"--out-dir {out_dir} holds a folder {name}, at the name this trainer writes a new "
                f"{name.removesuffix('.tmp')} through: that write would fail, after the steps before it were "
                "trained; move it away, or choose another --out-dir"
            )
    return made


def claim_out_dir(run, out_dir_lock: OutDirLock) -> str | None:
    """Rank 0: make --out-dir, lock it for this run, and pick the checkpoint to resume."""
    out_dir_lock.made = prepare_out_dir(run.out_dir)
    out_dir_lock.acquire()
    return choose_resume_checkpoint(run)
