"""Files across the boundary: read only when regular, written whole through fresh files (O_EXCL|O_NOFOLLOW),
changed only where the run's own, locked for one writer. Standard library only (fineweb.py locks without torch)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import socket
import stat
import struct
import sys

from trainkit.cli import UserError, print_line, reason_of

# --- written whole or not at all ------------------------------------------------------------------

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def create_fresh(path: str, dir_fd: int | None = None) -> int:
    """A descriptor of a new empty file at path: what stood there is unlinked, never opened (a folder: OSError)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path, dir_fd=dir_fd)  # (a folder: EISDIR or EPERM, raised)
    return os.open(path, _CREATE, 0o666, dir_fd=dir_fd)


def write_atomically(
    path: str, write, *, fsync_file: bool, fsync_folder: bool, tmp: str | None = None, dir_fd: int | None = None
):
    """write(f) into tmp (path + ".tmp"), made fresh, then renamed to path; a failure removes tmp, raised as is."""
    tmp = tmp or path + ".tmp"
    fd = create_fresh(tmp, dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync_file:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp, dir_fd=dir_fd)
        raise
    if fsync_folder:
        os.fsync(dir_fd) if dir_fd is not None else fsync_dir(os.path.dirname(path) or ".")


def in_held_folder(folder: str, name: str, dir_fd: int | None) -> str:
    """name as an os call given dir_fd takes it: relative to the held folder dir_fd, else folder's name joined."""
    return name if dir_fd is not None else os.path.join(folder, name)


def write_bytes_atomically(path: str, *blobs, **options):
    """write_atomically of blobs (bytes or buffers), one after the other."""
    write_atomically(path, lambda f: f.writelines(blobs), **options)


def fsync_dir(path: str):
    """Make the entries of folder path (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- read only when regular -----------------------------------------------------------------------

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str | None:
    """What a file of st_mode mode is, in words ("a named pipe (FIFO)"); None for a regular file."""
    return None if stat.S_ISREG(mode) else next((words for is_kind, words in _KINDS if is_kind(mode)), "not a file")


def not_regular(path: str, st: os.stat_result) -> UserError | None:
    """The refusal of path whose (followed) status is st, or None where it is a regular file."""
    if (kind := file_kind(st.st_mode)) is None:
        return None
    target = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    return UserError(f"{path} is {kind}{target}, not a regular file: it cannot be read as one")


def check_regular(path: str) -> os.stat_result:
    """path's status, links followed, or a UserError unless it is a regular file."""
    st = os.stat(path)
    if refusal := not_regular(path, st):
        raise refusal
    return st


def open_regular(path: str):
    """path open for binary reading, or a UserError unless it is a regular file (O_NONBLOCK: a pipe returns at once)."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if refusal := not_regular(path, os.fstat(fd)):
            raise refusal
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# --- JSON read through one bounded reader ---------------------------------------------------------

# JSON nesting refused before json.loads (no RecursionError): deeper than any document read here (a manifest
# 3 levels, a HellaSwag line 2), far below the recursion limit; a `[[[...` 200,000 deep costs two regex passes
MAX_DEPTH = 64

_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)  # a JSON string, escapes included
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JSONFileError(UserError):
    """A document that is not JSON, or nests too deep: `where: reason` (reason alone for a reader's own words)."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def deeper_than_allowed(text: str) -> int | None:
    """How deep arrays and objects nest in text (brackets in strings not counted) where deeper than MAX_DEPTH."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:  # the usual case: too few brackets to nest deeper
        return None
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)
    return depth if depth > MAX_DEPTH else None


def parse_json(text: str | bytes, path: str, line: int | None = None):
    """The JSON value text holds, read from path (at line, in a JSON-lines file); NaN and Infinity accepted."""
    where = f"{path} line {line}" if line is not None else path
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JSONFileError(where, f"not UTF-8 text (byte 0x{text[e.start]:02x}), so not JSON") from None
    if depth := deeper_than_allowed(text):
        raise JSONFileError(
            where, f"JSON nested {depth} levels deep, deeper than the {MAX_DEPTH} of any file read here"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = f"column {e.colno}" if line is not None else f"line {e.lineno} column {e.colno}"
        raise JSONFileError(where, f"not JSON ({e.msg} at {at})") from None
    except (ValueError, RecursionError) as e:  # a number of thousands of digits; (no nesting within MAX_DEPTH)
        raise JSONFileError(where, f"not JSON that can be read ({type(e).__name__})") from None


def read_json(path: str, max_bytes: int | None = None, source: str | None = None):
    """The JSON document in the regular file at path (max_bytes: a larger one refused); source (the flag that
    named it): any failure is a UserError starting with it, and only an object passes."""
    try:
        with open_regular(path) as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise JSONFileError(path, f"larger than the {max_bytes} bytes such a file holds")
        value = parse_json(data, path)
    except JSONFileError as e:
        raise e if source is None else UserError(f"{source}: {e}") from None
    except OSError as e:
        if source is None:
            raise
        raise UserError(f"{source}: cannot read {path}: {reason_of(e)}") from None
    if source is not None and not isinstance(value, dict):
        raise UserError(f"{source}: {path} holds a JSON {type(value).__name__}, not an object")
    return value


# --- changed only where the run's own -------------------------------------------------------------


def shared_as(path: str) -> str | None:
    """How the file at path is shared with other names, in words (None: its own, missing, or no regular file)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link to {os.readlink(path)}" if os.path.isfile(path) else None
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        return f"a hard link to a file with {st.st_nlink - 1} other name{'s' * (st.st_nlink > 2)} (as `cp -al` makes)"
    return None


def own_file(path: str) -> str | None:
    """Before a run changes path in place: a shared file becomes a copy of its own; the note saying so, or None."""
    if (shared := shared_as(path)) is None:
        return None
    with open(path, "rb") as source:
        write_atomically(path, lambda f: shutil.copyfileobj(source, f), fsync_file=True, fsync_folder=True)
    return f"note: {path} was {shared}: this run writes to a copy of its own, and the file it shared stays as it was"


def move_entry(source: str, destination: str):
    """Rename source to destination, a symbolic link with a relative target re-aimed from its new folder."""
    if os.path.islink(source) and not os.path.isabs(os.readlink(source)):
        target = os.path.join(os.path.dirname(source), os.readlink(source))
        os.symlink(os.path.relpath(target, os.path.dirname(destination) or "."), destination)
        os.remove(source)
        return
    os.rename(source, destination)


# <linux/fs.h>: FS_IOC_GETFLAGS, _IOR('f', 1, long), and the two flags that hold a file in place
_FS_IOC_GETFLAGS = 0x80006601 | struct.calcsize("l") << 16
_FS_IMMUTABLE_FL, _FS_APPEND_FL = 0x10, 0x20


def pinned(path: str) -> str | None:
    """How an attribute holds the file at path in place ("immutable (chattr +i)", ...), for root too; else None."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return None
        if hasattr(st, "st_flags"):
            append = st.st_flags & (stat.UF_APPEND | stat.SF_APPEND)
            immutable = st.st_flags & (stat.UF_IMMUTABLE | stat.SF_IMMUTABLE)
        else:
            import fcntl

            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
            try:
                flags = int.from_bytes(fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(8))[:4], sys.byteorder)
            finally:
                os.close(fd)
            append, immutable = flags & _FS_APPEND_FL, flags & _FS_IMMUTABLE_FL
    except (OSError, ImportError):  # gone, unreadable, or a file system without the flags (ENOTTY)
        return None
    return "immutable (chattr +i)" if immutable else "append-only (chattr +a)" if append else None


# --- one live writer per folder -------------------------------------------------------------------


class FolderLock:
    """One live writer per folder: a flock on the folder itself; FOLDER/.lock only names the holder."""

    writer = "fineweb.py"  # who writes the .lock note, for the refusal of a file in its place
    moved_as = ("fineweb.py", "nothing")  # who wrote, and what is not written there, when the folder moved
    in_use_as = ("being written by another process", "")  # who holds the lock, and what waiting for it gives
    note = staticmethod(lambda line: print_line(line, file=sys.stderr))  # how a note is printed

    def __init__(self, folder: str):
        self.folder, self.path, self.fd, self.written = folder, os.path.join(folder, ".lock"), None, None
        self.identity = None  # the folder's status when taken: whether self.folder still names it (moved_to)

    def acquire(self):
        try:
            import fcntl
        except ImportError:  # Windows
            return self._cannot_lock("no flock on this system")
        self.fd = os.open(self.folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        self.identity = os.fstat(self.fd)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            who, then = self.in_use_as
            raise UserError(
                f"--out-dir {self.folder} is {who} ({self._holder()}; it holds a lock on the folder): wait for it "
                f"to end{then}, or choose another --out-dir"
            ) from None
        except OSError as e:  # a file system without locks (Lustre without -o flock): held open, not locked
            return self._cannot_lock(reason_of(e))
        try:
            self._write_holder()
        except UserError:
            self.release()
            raise

    def moved_to(self) -> tuple[str, str] | None:
        """(where the folder taken is now, what self.folder names) where they differ, else None."""
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
        """A UserError naming both folders where self.folder no longer names the folder taken (then: appended)."""
        if (moved := self.moved_to()) is not None:
            who, nothing = self.moved_as
            raise UserError(
                f"--out-dir {self.folder} was moved or replaced while {who} wrote to it: the folder it took is now "
                f"{moved[0]}, and {self.folder} names {moved[1]}; stopping, so that {nothing} is written there{then}"
            )

    def _holder(self) -> str:
        with contextlib.suppress(OSError), open(self.path, errors="replace") as f:
            return f.readline(200).strip() or f"holder not recorded in {self.path}"
        return f"holder not recorded in {self.path}"

    def _write_holder(self):
        if os.path.lexists(self.path) and (os.path.islink(self.path) or not os.path.isfile(self.path)):
            what = "a directory" if os.path.isdir(self.path) else "not a regular file"
            what = f"a symbolic link to {os.readlink(self.path)}" if os.path.islink(self.path) else what
            raise UserError(
                f"{self.path} is {what}, not the lock note {self.writer} writes: remove it, or choose another --out-dir"
            )
        try:  # (a note for people, into the folder held: no fsync, the kernel's lock is what holds)
            write_bytes_atomically(
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
    """Remove the empty folder path where it still is the folder identity (its os.stat when made)."""
    with contextlib.suppress(OSError):  # (rmdir fails unless empty)
        if os.path.samestat(os.lstat(path), identity):
            os.rmdir(path)
