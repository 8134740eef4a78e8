"""The documents fineweb.py tokenizes, as deterministic streams of (where, text) from .jsonl, .parquet, text
files or the Hugging Face Hub, and the worker pool that tokenizes them in order."""

from __future__ import annotations

import glob
import gzip
import logging
import os
import re
import signal
import zlib
from collections import deque
from functools import partial

import numpy as np
import tiktoken

from trainkit import fileio
from trainkit.cli import UserError, optional_import, reason_of
from trainkit.fileio import check_regular
from trainkit.data.tokenizer import encode_documents, get_encoding, get_tokenizer_or_fail

# --- document sources: the same arguments give the same documents in the same order (resumes count them)


def resolve_files(patterns: list) -> list:
    """Files matching the globs, in a stable order (sorted per pattern, first match wins)."""
    files = []
    for pattern in patterns:
        found = glob.glob(os.path.expanduser(pattern), recursive=True)
        matched = sorted(p for p in found if os.path.exists(p) and not os.path.isdir(p))
        for path in matched:  # a named pipe would block the read forever, a link to /dev/zero never end
            check_regular(path)
        if not matched and os.path.isdir(os.path.expanduser(pattern)):
            raise UserError(
                f"--files {pattern!r} is a folder: --files takes files or globs, e.g. "
                f"{os.path.join(pattern, '*.jsonl')!r} (or '**/*.jsonl' inside it for its subfolders)"
            )
        if not matched:
            raise UserError(f"--files {pattern!r} matches no files")
        files.extend(matched)
    return list(dict.fromkeys(files))


def iter_file_documents(files: list, text_field: str, doc_per_file: bool, utf8_errors: str):
    for path in files:
        try:
            yield from _iter_one_file(path, text_field, doc_per_file, utf8_errors)
        except UnicodeDecodeError as e:
            raise UserError(
                f"{path} is not valid UTF-8 (byte 0x{e.object[e.start]:02x} cannot be decoded); "
                "convert it to UTF-8, leave it out of --files, or pass --utf8-errors replace"
            ) from e
        except EOFError:  # gzip's only sign of a cut-off file
            raise UserError(
                f"{path} is truncated (the gzip data ends early); re-create it or leave it out of --files"
            ) from None
        except (gzip.BadGzipFile, zlib.error) as e:  # before OSError: BadGzipFile is one
            raise UserError(
                f"{path} is not valid gzip data ({reason_of(e)}); re-create it or leave it out of --files"
            ) from None
        except OSError as e:  # a read() error carries no file name
            raise UserError(f"cannot read {path}: {reason_of(e)}") from None


def _iter_one_file(path: str, text_field: str, doc_per_file: bool, utf8_errors: str):
    kind = os.path.splitext(path[:-3] if path.endswith(".gz") else path)[1].lower()
    if kind == ".parquet":
        yield from _iter_parquet(path, text_field)
        return
    opener = gzip.open if path.endswith(".gz") else open
    # newline="" keeps the text byte-exact: no \r\n -> \n translation
    with opener(path, "rt", encoding="utf-8", errors=utf8_errors, newline="") as f:
        if kind in (".jsonl", ".json"):
            yield from _iter_json_lines(f, path, text_field)
        elif doc_per_file:
            yield path, f.read()
        else:
            for number, line in enumerate(f, start=1):
                if line.strip():  # one document per non-blank line
                    yield f"{path}:{number}", line.rstrip("\r\n")


def _iter_json_lines(f, path: str, text_field: str):
    for number, line in enumerate(f, start=1):
        if not line.strip():
            continue
        try:
            row = fileio.parse_json(line, path, number)
        except fileio.JSONFileError as e:
            raise UserError(
                f"{path}:{number}: not JSON Lines ({e.reason}); .json/.jsonl files must hold one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{number}: expected a JSON object, found {type(row).__name__}")
        where = f"{path}:{number}"
        yield where, _text_of(row, text_field, where)


def _iter_parquet(path: str, text_field: str):
    pa = optional_import("pyarrow", f"reading {path} needs pyarrow (pip install pyarrow)")
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        if text_field not in names:
            raise UserError(_missing_field(path, text_field, names))
        batches = parquet.iter_batches(batch_size=1024, columns=[text_field])
        for row, text in enumerate(text for batch in batches for text in batch.column(0).to_pylist()):
            where = f"{path} row {row}"
            yield where, _checked_text(text, text_field, where)
    except (pa.ArrowException, OSError) as e:  # a damaged footer, page or schema; pyarrow's I/O errors
        raise UserError(
            f"{path} is not a readable Parquet file ({reason_of(e)}); re-create it or leave it out of --files"
        ) from None


HUB_TIMEOUT_S = 10
OFFLINE_HINT = "offline, tokenize local files instead with --files 'dir/**/*.parquet'"
DATASETS_HINT = "streaming from the Hub needs the 'datasets' package (pip install datasets); " + OFFLINE_HINT


def hub_revision(dataset: str) -> str:
    """The dataset's newest commit on the Hub, asked once without retries (the datasets client retries ~25 s)."""
    hub = optional_import("huggingface_hub", DATASETS_HINT)
    from huggingface_hub.utils import RepositoryNotFoundError

    try:
        return hub.HfApi().dataset_info(dataset, timeout=HUB_TIMEOUT_S).sha
    except RepositoryNotFoundError:
        raise UserError(
            f"--dataset {dataset}: no such dataset on the Hugging Face Hub (a private one needs `hf auth login`)"
        ) from None
    except Exception as e:  # no network, DNS, proxy, timeout, server errors
        raise UserError(
            f"--dataset {dataset}: cannot reach the Hugging Face Hub ({reason_of(e, typed=True)}); {OFFLINE_HINT}"
        ) from None


def iter_hub_documents(dataset: str, name, split: str, revision, text_field: str, debug: bool):
    rows = _iter_hub_rows(dataset, name, split, revision, debug)
    for number, row in enumerate(rows):
        where = f"{dataset} row {number}"
        yield where, _text_of(row, text_field, where)


def _iter_hub_rows(dataset: str, name, split: str, revision, debug: bool):
    where = f"--dataset {dataset} (--name {name}, --split {split}, revision {revision})"
    datasets = optional_import("datasets", DATASETS_HINT)
    if not debug:  # the Hub client logs every retry; one final line is enough
        for logger in ("huggingface_hub", "datasets", "fsspec"):
            logging.getLogger(logger).setLevel(logging.ERROR)
    try:
        # streaming: rows arrive as they are read, so --max-tokens needs only the first part
        yield from datasets.load_dataset(dataset, name=name, split=split, revision=revision, streaming=True)
    except Exception as e:
        raise UserError(
            f"could not read {where} from the Hugging Face Hub ({reason_of(e, typed=True)}); {OFFLINE_HINT}"
        ) from e


def _text_of(row: dict, text_field: str, where: str) -> str:
    if text_field not in row:
        raise UserError(_missing_field(where, text_field, list(row)))
    return _checked_text(row[text_field], text_field, where)


def _missing_field(where: str, text_field: str, fields: list) -> str:
    return f"{where}: no field {text_field!r} (fields: {', '.join(map(str, fields))}); choose one with --text-field"


def _checked_text(text, text_field: str, where: str) -> str:
    if not isinstance(text, str):
        raise UserError(f"{where}: field {text_field!r} holds {type(text).__name__}, not text")
    return text


# --- parallel tokenization -------------------------------------------------------------------

CHUNK_CHARS = 1 << 20  # text per worker task: big enough that IPC is noise, small enough to stream

_worker_encoding = None


_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # blocked in a worker from its fork until init_worker


def worker_pool(workers: int):
    """A multiprocessing Pool of init_worker's workers. Ctrl-C and SIGTERM are held back from each until its own
    handlers are set: one that came between its fork and then would raise this process's KeyboardInterrupt in
    the worker, which would go on to run the caller's code (a second "interrupted" line; in-process, a worker
    that never ends)."""
    import multiprocessing

    held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        return multiprocessing.Pool(workers, initializer=init_worker)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def init_worker():
    # the main process stops the pool: a worker ignores Ctrl-C and ends quietly on pool.terminate()'s SIGTERM
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_SIGNALS)  # (held by worker_pool while it forked)
    global _worker_encoding
    if _worker_encoding is None:  # forked workers inherit the main process's (loading takes ~0.3 s)
        _worker_encoding = get_encoding()


def load_worker_encoding() -> None:
    """Load the encoding before the pool forks: a failure is one UserError, and the workers inherit it."""
    global _worker_encoding
    _worker_encoding = get_tokenizer_or_fail()


class ChunkError(Exception):
    """Why a chunk could not be tokenized (the document's index or None, the reason), as values that cross the pool."""

    def __init__(self, index, reason: str):
        super().__init__(index, reason)
        self.index, self.reason = index, reason

    def located(self, wheres: list) -> UserError:
        if self.index is not None:
            return UserError(f"{wheres[self.index]}: {self.reason}")
        span = wheres[0] if len(wheres) == 1 else f"the {len(wheres)} documents from {wheres[0]} to {wheres[-1]}"
        return UserError(f"cannot tokenize {span}: {self.reason}")


_SURROGATE = re.compile("[\ud800-\udfff]")


def tokenize_chunk(enc: tiktoken.Encoding, docs: list, utf8_errors: str) -> np.ndarray:
    """encode_documents; any failure (a PanicException too: it would hang the pool) a ChunkError naming the document."""
    try:
        return _encode_chunk(enc, docs, utf8_errors)
    except (ChunkError, UserError, KeyboardInterrupt, SystemExit):
        raise
    except MemoryError:
        longest = max(map(len, docs))
        raise ChunkError(None, f"not enough memory (the longest is {longest:,} characters)") from None
    except BaseException as e:  # e.g. tiktoken's regex giving up on ~1M characters of whitespace
        index = next((i for i, doc in enumerate(docs) if _fails(enc, doc, utf8_errors)), None)
        what = "failed" if index is None else "cannot tokenize this document"
        advice = "" if index is None else "; fix it or leave it out"
        raise ChunkError(
            index, f"tiktoken {what} ({reason_of(e, typed=True)}){advice} (--debug shows the traceback)"
        ) from e


def _encode_chunk(enc: tiktoken.Encoding, docs: list, utf8_errors: str) -> np.ndarray:
    """encode_documents, a lone surrogate refused (--utf8-errors strict) or tokenized as U+FFFD (replace)."""
    try:
        return encode_documents(enc, docs)
    except UnicodeEncodeError:
        index = next((i for i, doc in enumerate(docs) if _SURROGATE.search(doc)), None)
        if index is None:
            raise
        if utf8_errors == "strict":
            code = ord(_SURROGATE.search(docs[index]).group())
            raise ChunkError(
                index,
                f"the text holds a lone surrogate U+{code:04X} (half of a UTF-16 pair, as JSON's \\u{code:04x} without "
                "its other half), which is not Unicode and has no UTF-8 form; fix the input, or pass --utf8-errors "
                "replace to tokenize U+FFFD in its place",
            ) from None
        return encode_documents(enc, [_SURROGATE.sub("\ufffd", doc) for doc in docs])


def _fails(enc: tiktoken.Encoding, doc: str, utf8_errors: str) -> bool:
    try:
        _encode_chunk(enc, [doc], utf8_errors)
        return False
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        return True


def _tokenize_chunk(docs: list, utf8_errors: str) -> np.ndarray:
    return tokenize_chunk(_worker_encoding or get_encoding(), docs, utf8_errors)


def chunk_located(located, chunk_chars: int):
    """(texts, wheres) chunks of about chunk_chars characters of a stream of (where, text) documents."""
    texts, wheres, size = [], [], 0
    for where, text in located:
        texts.append(text)
        wheres.append(where)
        size += len(text) + 1
        if size >= chunk_chars:
            yield texts, wheres
            texts, wheres, size = [], [], 0
    if texts:
        yield texts, wheres


def tokenize_in_order(chunks, pool, max_in_flight: int, utf8_errors: str = "strict"):
    """Token arrays of the (texts, wheres) chunks in order, at most max_in_flight in the pool (Pool.imap's pile
    up); a chunk that cannot be tokenized is a UserError naming the document."""
    pending = deque()
    for texts, wheres in chunks:
        task = (texts, utf8_errors)
        pending.append(
            (pool.apply_async(_tokenize_chunk, task).get if pool else partial(_tokenize_chunk, *task), wheres)
        )
        if len(pending) >= (max_in_flight if pool else 1):
            yield _located_result(*pending.popleft())
    while pending:
        yield _located_result(*pending.popleft())


def _located_result(result, wheres: list) -> np.ndarray:
    try:
        return result()
    except ChunkError as e:
        raise e.located(wheres) from e
