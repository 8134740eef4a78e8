"""HellaSwag's records as token examples (hellaswag.py and --hellaswag-every): each checked and rendered as
build-nanogpt does or as lm-eval's task does, once per process (load_examples), and the line saying which
are scored (describe_data)."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from trainkit import fileio
from trainkit.cli import UserError, reason_of
from trainkit.evaluation.hellaswag_data import DATA_EXAMPLES, DATA_NAME, SUBSET_FILE
from trainkit.fileio import open_regular
from trainkit.data.tokenizer import get_tokenizer_or_fail


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
    fields = [example.get(key) for key in ("activity_label", "ctx_a", "ctx_b")]
    for key, value in zip(("activity_label", "ctx_a", "ctx_b"), fields):
        if not isinstance(value, str):
            raise ValueError(f"{key!r} must be text for lm-eval's rendering, not {value!r:.40}")
    activity, ctx_a, ctx_b = fields
    query = lm_eval_clean(f"{activity}: {ctx_a} {ctx_b.capitalize()}")
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

LABELS = (0, 1, 2, 3)


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
    if type(label) is not int or label not in LABELS:  # not bool, float or another number
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
