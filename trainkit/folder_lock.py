"""The lock on a folder that one process writes: fineweb.py's --out-dir, and a training run's
(trainkit/out_dir.py's OutDirLock words the refusal for a run). Standard library only, so that
fineweb.py takes it without torch.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

from trainkit.atomic_write import write_bytes_atomically
from trainkit.cli import UserError, reason_of
from trainkit.console import print_line


class FolderLock:
    """One live writer per folder: an exclusive flock on the folder itself (on a descriptor of the
    directory), which no file in it, deleted or rewritten, can undo. FOLDER/.lock names the holder's pid
    and host, only for the refusal of a second writer. The kernel drops the lock when the process ends,
    however it ends, so what a killed writer leaves blocks nothing; a writer that ends removes the .lock
    it wrote (not one that replaced it). fineweb.py holds its --out-dir with it, a training run its own
    (out_dir.OutDirLock, which words the refusal for a run)."""

    writer = "fineweb.py"  # who writes the .lock note, for the refusal of a file in its place

    def __init__(self, folder: str):
        self.folder, self.path, self.fd, self.written = folder, os.path.join(folder, ".lock"), None, None
        self.identity = None  # the folder's status when taken: whether self.folder still names it (moved_to)

    def in_use(self, holder: str) -> str:
        """The refusal of a second writer (holder: as the .lock note names it)."""
        return (
            f"--out-dir {self.folder} is being written by another process ({holder}; it holds a lock on the "
            "folder): wait for it to end, or choose another --out-dir"
        )

    def note(self, line: str):
        print_line(line, file=sys.stderr)

    def acquire(self):
        try:
            import fcntl
        except ImportError:  # Windows
            return self._cannot_lock("no flock on this system")
        fd = os.open(self.folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        self.identity = os.fstat(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(self.in_use(self._holder())) from None
        except OSError as e:  # a file system without locks (Lustre without -o flock): held open, not locked
            self.fd = fd
            return self._cannot_lock(reason_of(e))
        self.fd = fd
        try:
            self._write_holder()
        except UserError:
            self.release()
            raise

    def moved_to(self) -> tuple[str, str] | None:
        """Where the folder taken is now and what self.folder names instead, where the name no longer
        names it (the folder moved, and another, or a link to one, put in its place; "unknown" where the
        folder's new name cannot be read), else None. A writer that goes on writing by name would write
        elsewhere."""
        if self.identity is None:
            return None
        with contextlib.suppress(OSError):
            if os.path.samestat(os.stat(self.folder), self.identity):
                return None
        now = os.path.realpath(self.folder) if os.path.exists(self.folder) else "nothing"
        try:  # (Linux names a descriptor's folder where it is now)
            moved = os.readlink(f"/proc/self/fd/{self.fd}") if self.fd is not None else "unknown"
        except OSError:
            moved = "unknown"
        return moved, now

    def check_held(self, then: str = ""):
        """A UserError naming both folders where self.folder no longer names the folder taken (moved_to):
        a writer that writes by name, or reports by it, stops rather than write elsewhere (then: what to
        do next, appended to the line)."""
        moved = self.moved_to()
        if moved is not None:
            where, now = moved
            raise UserError(
                f"--out-dir {self.folder} was moved or replaced while {self.writer} wrote to it: the folder it "
                f"took is now {where}, and {self.folder} names {now}; stopping, so that nothing is written "
                f"there{then}"
            )

    def _holder(self) -> str:
        """Who holds the lock, as its .lock says."""
        try:
            with open(self.path, errors="replace") as f:
                return f.readline(200).strip() or f"holder not recorded in {self.path}"
        except OSError:
            return f"holder not recorded in {self.path}"

    def _write_holder(self):
        """FOLDER/.lock: a new file, replacing the one a writer that ended or was killed left there."""
        if os.path.lexists(self.path) and (os.path.islink(self.path) or not os.path.isfile(self.path)):
            what = (
                f"a symbolic link to {os.readlink(self.path)}"
                if os.path.islink(self.path)
                else "a directory"
                if os.path.isdir(self.path)
                else "not a regular file"
            )
            raise UserError(
                f"{self.path} is {what}, not the lock note {self.writer} writes: remove it, or choose another --out-dir"
            )
        try:  # (a note for people: no fsync, the kernel's lock is what holds)
            write_bytes_atomically(  # (into the folder held: self.fd)
                ".lock",
                f"pid {os.getpid()} on {socket.gethostname()}\n".encode(),
                fsync_file=False,
                fsync_folder=False,
                tmp=f".lock.{os.getpid()}.tmp",
                dir_fd=self.fd,
            )
            self.written = os.stat(".lock", dir_fd=self.fd)
        except OSError as e:
            raise UserError(f"cannot write {self.path}: {reason_of(e)}") from None

    def _cannot_lock(self, why: str):
        self.note(f"note: cannot lock --out-dir {self.folder} ({why}): a second run on it would not be stopped")

    def release(self):
        """Unlock, removing the .lock this writer wrote from the folder it holds (wherever it is now)."""
        if self.fd is None:
            return
        if self.written:  # still the file this run wrote (same inode): removed while the folder is locked
            with contextlib.suppress(OSError):
                if os.path.samestat(os.stat(".lock", dir_fd=self.fd, follow_symlinks=False), self.written):
                    os.remove(".lock", dir_fd=self.fd)
        os.close(self.fd)
        self.fd = self.written = None


def remove_if_same(path: str, identity: os.stat_result):
    """Remove the empty folder path where it still is the folder identity (its os.stat when made): one
    moved away keeps its contents where it went, and whatever now stands at its name is left alone."""
    with contextlib.suppress(OSError):  # (rmdir fails unless empty)
        if os.path.samestat(os.lstat(path), identity):
            os.rmdir(path)
