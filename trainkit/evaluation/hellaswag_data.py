"""Where HellaSwag's validation file comes from: a path given, or the cache folder (downloaded once, its
sha256 checked). Standard library only: a script's --help names the file before torch is imported."""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.request

from trainkit.fileio import write_atomically
from trainkit.cli import UserError
from trainkit.fileio import check_regular

DATA_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
DATA_NAME = "hellaswag_val.jsonl"
DATA_SHA256 = "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"
DATA_EXAMPLES = 10042
DOWNLOAD_TIMEOUT_S = 10
# 446 examples of the validation set shipped with the repository, for scoring offline (fixtures/README.md)
SUBSET_FILE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "fixtures",
    "hellaswag_val_subset.jsonl",
)


def default_data_dir() -> str:
    return os.environ.get("HELLASWAG_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "gpt2-trainer", "hellaswag"
    )


def resolve_data_file(data_file: str | None = None, data_dir: str | None = None, flag: str = "--data-file") -> str:
    """The validation jsonl: data_file, else data_dir (default: the cache) / hellaswag_val.jsonl,
    downloaded first where missing. flag: the option that gave data_file, for errors."""
    if data_file:
        if os.path.isdir(data_file):
            raise UserError(
                f"{flag} {data_file} is a folder: pass the file, e.g. {os.path.join(data_file, 'hellaswag_val.jsonl')}"
            )
        if not os.path.exists(data_file):
            raise UserError(f"{flag} {data_file} does not exist")
        try:
            check_regular(data_file)  # a named pipe would block the read forever
        except UserError as e:
            raise UserError(f"{flag} {e}") from None
        return data_file
    path = os.path.join(data_dir or default_data_dir(), DATA_NAME)
    if not os.path.isfile(path):
        _download(path, flag)
    return path


def _download(path: str, flag: str):
    def write(f):
        digest = hashlib.sha256()
        with urllib.request.urlopen(DATA_URL, timeout=DOWNLOAD_TIMEOUT_S) as r:
            while chunk := r.read(1 << 20):
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != DATA_SHA256:
            raise OSError("the downloaded file is not the expected one (sha256 mismatch)")

    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # one temporary file per process: torchrun ranks may download at once
        write_atomically(path, write, fsync_file=False, fsync_folder=False, tmp=f"{path}.{os.getpid()}.tmp")
    except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, disk errors, cut-off reads
        reason = getattr(e, "reason", None) or e
        raise UserError(
            f"cannot download HellaSwag from {DATA_URL} ({reason}); "
            f"pass a local copy of {DATA_NAME} with {flag} PATH (the repository ships a subset: "
            f"{os.path.relpath(SUBSET_FILE)})"
        ) from None
