"""The one reader of JSON documents a user can hand us (manifests, logs, HellaSwag and --files lines, a
Hugging Face folder's config.json): one that is not JSON, or nests deeper than MAX_DEPTH, is one
JSONFileError naming the file and line, never a RecursionError. The depth is measured by a scan that
skips strings before json.loads sees the text (a `[[[...` 200,000 deep: two regex passes)."""

from __future__ import annotations

import itertools
import json
import re

from trainkit.cli import UserError, reason_of
from trainkit.regular_file import open_regular

# deeper than any document the project writes or reads (a manifest is 3 levels, a HellaSwag line 2), and far
# below the interpreter's recursion limit that whatever walks a decoded value runs into
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


def parse(text: str | bytes, path: str, line: int | None = None):
    """The JSON value text holds, read from path (at line, in a JSON-lines file); NaN and Infinity accepted."""
    where = f"{path} line {line}" if line is not None else path
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JSONFileError(where, f"not UTF-8 text (byte 0x{text[e.start]:02x}), so not JSON") from None
    depth = deeper_than_allowed(text)
    if depth:
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


def read(path: str, max_bytes: int | None = None, source: str | None = None):
    """The JSON document in the file at path (an OSError as open() raises it; a UserError where it is not a
    regular file); max_bytes: a larger file is refused unread. source (the flag that named the file): any
    failure, an OSError too, is a UserError that starts with it, and anything but an object is refused."""
    try:
        with open_regular(path) as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise JSONFileError(path, f"larger than the {max_bytes} bytes such a file holds")
        value = parse(data, path)
    except JSONFileError as e:
        raise e if source is None else UserError(f"{source}: {e}") from None
    except OSError as e:
        if source is None:
            raise
        raise UserError(f"{source}: cannot read {path}: {reason_of(e)}") from None
    if source is not None and not isinstance(value, dict):
        raise UserError(f"{source}: {path} holds a JSON {type(value).__name__}, not an object")
    return value
