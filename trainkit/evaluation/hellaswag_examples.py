"""HellaSwag's validation file (a path given, or the cache folder: downloaded once, its sha256 checked) and
its records as token examples, rendered as build-nanogpt does or as lm-eval's task does, once per process.
Standard library only at import (the tokenizer where used): a script's --help names the file before torch."""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import urllib.request
from typing import NamedTuple

from trainkit import fileio
from trainkit.cli import UserError, reason_of
from trainkit.fileio import check_regular, open_regular, write_atomically

# --- the validation file --------------------------------------------------------------------------

DATA_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
DATA_NAME = "hellaswag_val.jsonl"
DATA_SHA256 = "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"
DATA_EXAMPLES = 10042
DOWNLOAD_TIMEOUT_S = 10
# 446 examples of the validation set shipped with the repository, for scoring offline (fixtures/README.md)
SUBSET_FILE = os.path.normpath(os.path.join(os.path.abspath(__file__), "../../../fixtures/hellaswag_val_subset.jsonl"))


def resolve_data_file(data_file: str | None = None, data_dir: str | None = None, flag: str = "--data-file") -> str:
    """The validation jsonl: data_file, else data_dir (default: the cache) / hellaswag_val.jsonl, downloaded
    first where missing. flag: the option that gave data_file, for errors."""
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
    cache = os.environ.get("HELLASWAG_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "gpt2-trainer", "hellaswag"
    )
    path = os.path.join(data_dir or cache, DATA_NAME)
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


# --- its examples ---------------------------------------------------------------------------------


class Example(NamedTuple):
    """Context ids, the four endings' ids, the label, and (lm-eval's rendering) the endings' characters."""

    ctx: list[int]
    endings: list[list[int]]
    label: int
    ending_chars: tuple[int, ...] = ()

    def fit(self, block_size: int | None = None) -> tuple[list[int], list[list[int]]]:
        """Context and endings cut so that context + any ending fits in block_size: every ending gets the
        same newest tokens of the context, as many as the longest leaves (at least 1)."""
        longest = max(len(e) for e in self.endings)
        if block_size is None or len(self.ctx) + longest <= block_size:
            return self.ctx, self.endings
        n_ctx = max(1, block_size - longest)
        return self.ctx[-n_ctx:], [e[: block_size - n_ctx] for e in self.endings]


def render_example(example: dict, enc) -> Example:
    """Tokenize one record (a ValueError saying what is wrong); endings with a leading space."""
    text, endings, label = check_record(example)
    return Example(enc.encode_ordinary(text), [enc.encode_ordinary(" " + e) for e in endings], label)


def lm_eval_clean(text: str) -> str:
    """lm-eval's hellaswag clean-up: ' [title]' becomes '. ', other [tags] go, a double space one."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def lm_eval_text(example: dict) -> tuple[str, list[str], int]:
    """(query, choices, label) as lm-eval's task shows them: '<activity_label>: <ctx_a> <Ctx_b>', cleaned."""
    _, endings, label = check_record(example)
    for key in ("activity_label", "ctx_a", "ctx_b"):
        if not isinstance(example.get(key), str):
            raise ValueError(f"{key!r} must be text for lm-eval's rendering, not {example.get(key)!r:.40}")
    query = lm_eval_clean(f"{example['activity_label']}: {example['ctx_a']} {example['ctx_b'].capitalize()}")
    return query, [lm_eval_clean(e) for e in endings], label


def render_lm_eval(example: dict, enc) -> Example:
    """Tokenize one record as lm-eval does: the ending is what query + ' ' + choice adds to the query's tokens."""
    query, choices, label = lm_eval_text(example)
    ctx = enc.encode_ordinary(query)
    endings = [enc.encode_ordinary(f"{query} {choice}")[len(ctx) :] for choice in choices]
    if not ctx or not all(endings):
        raise ValueError("empty query or choice after lm-eval's clean-up")
    return Example(ctx, endings, label, tuple(len(choice) for choice in choices))


RENDERERS = {"nanogpt": render_example, "lm_eval": render_lm_eval}  # how a record becomes tokens


def check_record(example) -> tuple[str, list[str], int]:
    """(ctx, endings, label) of a record with a non-empty ctx, 4 non-empty endings and a label 0-3 (or its
    digit as text); anything else (a label 1.9 or true) would silently score the wrong thing."""
    if not isinstance(example, dict):
        raise ValueError(f"a JSON object is expected, not {type(example).__name__}")
    missing = [key for key in ("ctx", "endings", "label") if key not in example]
    if missing:
        raise ValueError(f"no {missing[0]!r} field")
    ctx, endings, label = example["ctx"], example["endings"], example["label"]
    if not isinstance(ctx, str) or not ctx:
        raise ValueError(f"'ctx' must be non-empty text, not {ctx!r:.40}")
    if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) and e for e in endings)):
        raise ValueError(f"'endings' must be a list of 4 non-empty strings, not {endings!r:.60}")
    if isinstance(label, str) and label in ("0", "1", "2", "3"):
        label = int(label)
    if type(label) is not int or label not in (0, 1, 2, 3):  # not bool, float or another number
        raise ValueError(f"'label' must be 0, 1, 2 or 3, not {label!r:.20}")
    return ctx, endings, label


class _Rendered:
    """The lines of one data file, rendered on demand; errors name the flag and the line."""

    def __init__(self, path: str, flag: str):
        try:
            with open_regular(path) as f:
                data = f.read()
        except UserError as e:  # a named pipe, a device
            raise UserError(f"{flag} {e}") from None
        except OSError as e:
            raise UserError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise UserError(
                f"{flag} {path} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x}), so not {DATA_NAME}"
            ) from None
        self.lines = [(number, line) for number, line in enumerate(text.split("\n"), start=1) if line.strip()]
        if not self.lines:
            raise UserError(f"{flag} {path}: no HellaSwag examples in the file")
        self.path, self.flag = path, flag
        self.examples: dict[str, list[Example]] = {style: [] for style in RENDERERS}

    def first(self, n: int, style: str = "nanogpt") -> list[Example]:
        examples, render = self.examples[style], RENDERERS[style]
        if len(examples) < n:
            from trainkit.data.tokenizer import get_tokenizer_or_fail  # (numpy and tiktoken: not for --help)

            enc = get_tokenizer_or_fail()
            for number, line in self.lines[len(examples) : n]:
                try:
                    examples.append(render(fileio.parse_json(line, self.path, number), enc))
                except fileio.JSONFileError as e:
                    raise UserError(f"{self.flag} {e.where}: not a HellaSwag example ({e.reason})") from None
                except ValueError as e:
                    raise UserError(
                        f"{self.flag} {self.path} line {number}: not a HellaSwag example ({reason_of(e)})"
                    ) from None
        return examples[:n]


_CACHE: dict[tuple, _Rendered] = {}  # (real path, mtime, size) -> its rendered examples


def _rendered(path: str, flag: str) -> _Rendered:
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
    if key not in _CACHE:
        _CACHE[key] = _Rendered(path, flag)
    return _CACHE[key]


def load_examples(
    path: str, limit: int | None = None, flag: str = "--data-file", style: str = "nanogpt"
) -> list[Example]:
    """The first limit (None or 0: all) examples of a jsonl file, tokenized once per process, in style
    "nanogpt" or "lm_eval" (RENDERERS). flag: the option that gave path, for errors."""
    data = _rendered(path, flag)
    return data.first(limit or len(data.lines), style)


def describe_data(path: str, limit: int | None = None) -> str:
    """Which examples of which file are scored, and chance; the shipped subset named as such."""
    total = len(_rendered(path, "--data-file").lines)
    n = min(limit or total, total)
    which = f"all {total} examples" if n == total else f"the first {n} of {total} examples"
    subset = os.path.exists(SUBSET_FILE) and os.path.samefile(path, SUBSET_FILE)
    kind = f" (the subset the repository ships, not the full {DATA_EXAMPLES}-example set)" if subset else ""
    return f"hellaswag: {which} in {path}{kind}; chance is 0.25"
