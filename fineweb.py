"""Tokenize a text dataset into GPT-2 token shards for train_gpt2.py.

Each document becomes [<|endoftext|>] + its GPT-2 BPE tokens; the token stream is cut into
shards of --shard-size tokens (a document that does not fit continues in the next shard),
the first shard is the validation split, and each shard is a 1-D uint16 array saved with
np.save, like build-nanogpt's edu_fineweb10B shards (or llm.c's .bin with --format bin).

    python fineweb.py                                   # FineWeb-Edu sample-10BT, 100M-token shards
    python fineweb.py --max-tokens 20M --out-dir data/edu20M
    python fineweb.py --files 'corpus/**/*.parquet' --out-dir data/mine
    python fineweb.py --files "$(python -c 'import os; print(os.path.dirname(os.__file__))')/*.py" \
        --doc-per-file --shard-size 256K --prefix stdlib --out-dir data/stdlib   # offline

OUT/manifest.json records every finished shard; a run that was killed resumes where it
stopped when started again with the same arguments and unchanged input, and the shards come
out byte-identical.

This module is imported by train_gpt2.py and hellaswag.py for get_encoding() and EOT, so at
import it loads only the standard library, numpy and tiktoken, and runs nothing.
"""
import argparse
import base64
import contextlib
import errno
import glob
import gzip
import hashlib
import io
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import zlib
from collections import deque
from decimal import Decimal, InvalidOperation
from itertools import chain, islice

import cli  # the error contract shared by every script; standard library only, so it comes first
from cli import UserError, exit_code_of, flat

# --- command line (standard library only: --help and usage errors answer before numpy and tiktoken)

DEFAULT_DATASET, DEFAULT_NAME = "HuggingFaceFW/fineweb-edu", "sample-10BT"
MANIFEST = "manifest.json"


def parse_args(argv=None) -> argparse.Namespace:
    parser = cli.ArgumentParser(
        description="Tokenize a text dataset into GPT-2 uint16 token shards (resumable).",
        epilog="Sizes: 20M, 1.5K, 10B (= 10G), 1e8 or 100000. Run again with the same arguments "
               "to resume an interrupted run.")
    source = parser.add_argument_group("source (default: FineWeb-Edu sample-10BT, streamed from the Hub)")
    source.add_argument("--dataset", help=f"Hub dataset to stream (default {DEFAULT_DATASET})")
    source.add_argument("--name", help=f"its configuration (default {DEFAULT_NAME} for the default "
                                       "dataset, none otherwise)")
    source.add_argument("--split", help="its split (default train)")
    source.add_argument("--files", nargs="+", action="extend", metavar="GLOB",
                        help="local files instead of the Hub (quote globs; ** recurses): .parquet, "
                             ".jsonl/.json(.gz), any other file is text")
    source.add_argument("--text-field", default="text", metavar="FIELD",
                        help="column or JSON key holding the text (default text)")
    source.add_argument("--doc-per-file", action="store_true",
                        help="text files: a whole file is one document (default: one per non-blank line)")
    source.add_argument("--utf8-errors", choices=["strict", "replace"], default="strict",
                        help="bytes that are not UTF-8, and lone surrogates (JSON's \\ud800 without "
                             "its pair): stop with an error (default) or replace them with U+FFFD")
    output = parser.add_argument_group("output")
    output.add_argument("--out-dir", default="edu_fineweb10B", help="folder for shards and "
                        f"{MANIFEST} (default edu_fineweb10B)")
    output.add_argument("--prefix", default="edufineweb",
                        help="shard file names: PREFIX_{val,train}_NNNNNN (default edufineweb)")
    output.add_argument("--shard-size", type=parse_size, default=10**8, metavar="TOKENS",
                        help="tokens per shard (default 100M)")
    output.add_argument("--val-shards", type=cli.non_negative_int, default=1, metavar="N",
                        help="the first N shards are the val split (default 1)")
    output.add_argument("--max-tokens", type=parse_size, metavar="TOKENS",
                        help="stop after the first TOKENS tokens (default: the whole source)")
    output.add_argument("--format", choices=["npy", "bin"], default="npy",
                        help="npy: np.save of a uint16 array, as build-nanogpt (default); "
                             "bin: llm.c's 1 KiB header + uint16 tokens")
    run_group = parser.add_argument_group("run")
    run_group.add_argument("--workers", type=cli.positive_int, default=os.cpu_count(),
                           help="tokenizer processes (default: all cores; 1 = no pool)")
    run_group.add_argument("--debug", action="store_true",
                           help="show tracebacks and the Hub client's log")
    return parser.parse_args(argv)


_SIZE_SUFFIXES = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}


def parse_size(text: str) -> int:
    """'20M', '1.5K', '1e8', '100_000' -> a count in 1..2**62 (argparse type, the range cli's)."""
    s = text.strip().upper().replace("_", "")
    scale = _SIZE_SUFFIXES.get(s[-1:], 1)
    try:  # Decimal, not float: 0.1K is exactly 100
        value = Decimal(s[:-1] if scale > 1 else s) * scale
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 20M, 1e8, 100000)") from None
    if not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return cli.check_count(int(value), 1)


if __name__ == "__main__":
    cli.exit_on_ctrl_c_while_starting()
    parse_args()  # --help, or a usage error: answered now, before the slow imports

import numpy as np
import tiktoken

# --- errors and sizes ------------------------------------------------------------------------

def one_line(e: BaseException) -> str:
    """Another library's exception as a short single line, to quote inside our message."""
    text = flat(e) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def os_error_reason(e: Exception) -> str:
    """'no space left on device', 'permission denied', ...: an OSError without the file name
    (which a failed write() does not carry anyway), to follow the name in our message; another
    exception (torch.save's RuntimeError, safetensors' error) as its text on one line."""
    reason = e.strerror if isinstance(e, OSError) and e.strerror else one_line(e)
    return reason[:1].lower() + reason[1:]


# --- tokenizer -------------------------------------------------------------------------------

ENCODING_NAME = "r50k_base"  # GPT-2's BPE; tiktoken's "gpt2" is the same table but fetches extra files
EOT = 50256  # <|endoftext|>
GPT2_VOCAB = EOT + 1  # tokens of GPT-2's BPE: <|endoftext|> is the last
EOT_TEXT = "<|endoftext|>"
BPE_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"  # where tiktoken fetches it
BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # what tiktoken requires of it
# the copy this repository ships (bpe/README.md: where it came from); beside the real file when
# a script is reached through a symbolic link
SHIPPED_BPE = os.path.join(os.path.dirname(os.path.realpath(__file__)), "bpe", "r50k_base.tiktoken")
_BPE_HINT = "or set TIKTOKEN_CACHE_DIR to a folder that holds tiktoken's cached r50k_base file"

_encoding = None


def real_vocab_size(vocab_size: int) -> int:
    """The ids of a model with vocab_size rows that are tokens: GPT-2's 50257 when the vocabulary is
    padded beyond them (50304 by default, for faster matmuls), all of a smaller one. Softmaxes in
    training, evaluation, scoring and sampling run over these only, and an export keeps these rows,
    so the padded ids carry no probability and our loss is the exported model's."""
    return min(vocab_size, GPT2_VOCAB)


def token_byte_lengths(vocab_size: int, hint: str | None = None) -> np.ndarray:
    """UTF-8 bytes of the text of each of a model's vocab_size token ids (int64), the denominator of
    bits per byte. <|endoftext|> and the padded ids have 0: a target with no bytes counts in neither
    the loss nor the bytes of bits per byte (nanochat's definition). A model with fewer ids than
    GPT-2's does not read GPT-2's tokens (their ids go up to 50256), so its ids get 0 bytes too, and
    no bits per byte. hint: another way out if the tokenizer cannot be loaded."""
    lengths = np.zeros(vocab_size, dtype=np.int64)
    if vocab_size >= GPT2_VOCAB:
        enc = get_tokenizer_or_fail(hint)
        lengths[:EOT] = [len(enc.decode_single_token_bytes(t)) for t in range(EOT)]
    return lengths


def get_encoding() -> tiktoken.Encoding:
    """The GPT-2 tokenizer (loaded once per process), from the first of: tiktoken's cache, when
    TIKTOKEN_CACHE_DIR (or DATA_GYM_CACHE_DIR) is set and holds the rank file; the copy shipped
    in bpe/, once its sha256 is checked; tiktoken's download, only when that copy is missing. All
    three are the same bytes (tiktoken checks the same sha256), so no run needs the network.
    RuntimeError with a one-line hint when it cannot be loaded."""
    global _encoding
    if _encoding is None:
        _encoding = _load_encoding()
    return _encoding


def _load_encoding() -> tiktoken.Encoding:
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    cached = os.path.join(cache_dir, hashlib.sha1(BPE_URL.encode()).hexdigest()) if cache_dir else None
    if cached and os.path.isfile(cached):
        # checked here: tiktoken deletes a damaged copy (to fetch it again) and says nothing of it
        damaged = True  # (or unreadable)
        with contextlib.suppress(OSError), open(cached, "rb") as f:
            damaged = hashlib.sha256(f.read()).hexdigest() != BPE_SHA256
        if not damaged:
            with contextlib.suppress(Exception):
                return tiktoken.get_encoding(ENCODING_NAME)
        elif os.path.exists(SHIPPED_BPE):
            cli.print_line0(f"note: the GPT-2 tokenizer file {cached} in TIKTOKEN_CACHE_DIR is damaged (another "
                            f"sha256); using {SHIPPED_BPE} instead (delete the damaged file to silence this)")
    if os.path.exists(SHIPPED_BPE):
        return shipped_encoding()
    try:
        return tiktoken.get_encoding(ENCODING_NAME)
    except Exception as e:
        raise RuntimeError(
            f"could not load the GPT-2 tokenizer: {SHIPPED_BPE} is missing and tiktoken could not fetch "
            f"{ENCODING_NAME!r} ({one_line(e)}); restore the file (git checkout -- bpe), {_BPE_HINT}") from e


def shipped_encoding(path: str = SHIPPED_BPE) -> tiktoken.Encoding:
    """tiktoken's r50k_base built from the rank file at path: the same ranks, split pattern and
    special token as tiktoken_ext.openai_public.r50k_base, without its download or cache."""
    from tiktoken_ext.openai_public import r50k_pat_str
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise RuntimeError(f"could not load the GPT-2 tokenizer: cannot read {path}: {os_error_reason(e)}; "
                           f"{_BPE_HINT}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != BPE_SHA256:
        raise RuntimeError(
            f"could not load the GPT-2 tokenizer: {path} is damaged (sha256 {digest[:16]}..., expected "
            f"{BPE_SHA256[:16]}...); restore it (git checkout -- bpe), {_BPE_HINT}")
    ranks = {}
    for line in data.splitlines():  # "base64(token bytes) rank", as tiktoken.load.load_tiktoken_bpe reads it
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(ENCODING_NAME, pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT_TEXT: EOT}, explicit_n_vocab=EOT + 1)


def encode_documents(enc: tiktoken.Encoding, docs: list) -> np.ndarray:
    """Concatenation of [EOT] + enc.encode_ordinary(doc) for each doc, as uint16.

    Documents are joined with <|endoftext|> and encoded in one call, which tiktoken splits
    at each separator exactly as if every document were encoded alone, but with much less
    per-call overhead. A document that itself contains the literal text <|endoftext|> is
    encoded on its own, so that the text stays ordinary text. A lone surrogate in a document
    (no UTF-8 form) raises UnicodeEncodeError: tokenize_chunk decides what becomes of it.
    """
    parts, start = [], 0
    for i, doc in enumerate(docs):
        if EOT_TEXT in doc:
            parts.append(_encode_joined(enc, docs[start:i]))
            parts.append(np.array([EOT], dtype=np.uint32))
            parts.append(enc.encode_to_numpy(doc, disallowed_special=()))  # as encode_ordinary(doc)
            start = i + 1
    parts.append(_encode_joined(enc, docs[start:]))
    tokens = np.concatenate(parts)
    if tokens.size and tokens.max() > np.iinfo(np.uint16).max:
        raise UserError(f"token id {tokens.max()} does not fit in uint16; "
                         f"the tokenizer is not GPT-2's {ENCODING_NAME}")
    return tokens.astype("<u2")


def _encode_joined(enc: tiktoken.Encoding, docs: list) -> np.ndarray:
    if not docs:
        return np.empty(0, dtype=np.uint32)
    return enc.encode_to_numpy(EOT_TEXT + EOT_TEXT.join(docs), allowed_special={EOT_TEXT})


# --- document sources ------------------------------------------------------------------------
# Each source is a deterministic stream of (where, text) documents: where names the document for
# an error message (path:line, path row N, path); the same arguments always give the same
# documents in the same order, which is what makes resuming by document count exact.

def resolve_files(patterns: list) -> list:
    """Files matching the globs, in a stable order (sorted per pattern, first match wins)."""
    files = []
    for pattern in patterns:
        matched = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                         if os.path.isfile(p))
        if not matched and os.path.isdir(os.path.expanduser(pattern)):
            raise UserError(f"--files {pattern!r} is a folder: --files takes files or globs, e.g. "
                            f"{os.path.join(pattern, '*.jsonl')!r} (or '**/*.jsonl' inside it for its subfolders)")
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
                "convert it to UTF-8, leave it out of --files, or pass --utf8-errors replace") from e
        except EOFError:  # gzip's only sign of a cut-off file
            raise UserError(f"{path} is truncated (the gzip data ends early); "
                             "re-create it or leave it out of --files") from None
        except (gzip.BadGzipFile, zlib.error) as e:  # before OSError: BadGzipFile is one
            raise UserError(f"{path} is not valid gzip data ({one_line(e)}); "
                             "re-create it or leave it out of --files") from None
        except OSError as e:  # a read() error carries no file name
            raise UserError(f"cannot read {path}: {os_error_reason(e)}") from None


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
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{number}: not JSON Lines ({e.msg}); "
                             ".json/.jsonl files must hold one JSON object per line") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{number}: expected a JSON object, found {type(row).__name__}")
        where = f"{path}:{number}"
        yield where, _text_of(row, text_field, where)


def _iter_parquet(path: str, text_field: str):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow (pip install pyarrow)") from None
    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        if text_field not in names:
            raise UserError(_missing_field(path, text_field, names))
        row = 0
        for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                where = f"{path} row {row}"
                yield where, _checked_text(text, text_field, where)
                row += 1
    except (pa.ArrowException, OSError) as e:  # a damaged footer, page or schema; pyarrow's I/O errors
        raise UserError(f"{path} is not a readable Parquet file ({one_line(e)}); "
                         "re-create it or leave it out of --files") from None


HUB_TIMEOUT_S = 10
OFFLINE_HINT = "offline, tokenize local files instead with --files 'dir/**/*.parquet'"
DATASETS_HINT = "streaming from the Hub needs the 'datasets' package (pip install datasets); " + OFFLINE_HINT


def hub_revision(dataset: str) -> str:
    """The dataset's newest commit on the Hub, asked once without retries: offline this fails
    at once, where the datasets client retries for ~25 s. The manifest keeps it, so that a
    resumed run reads the same data even if the dataset has changed since."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.utils import RepositoryNotFoundError
    except ImportError:
        raise UserError(DATASETS_HINT) from None
    try:
        return HfApi().dataset_info(dataset, timeout=HUB_TIMEOUT_S).sha
    except RepositoryNotFoundError:
        raise UserError(f"--dataset {dataset}: no such dataset on the Hugging Face Hub (a private "
                         "one needs `hf auth login`)") from None
    except Exception as e:  # no network, DNS, proxy, timeout, server errors
        raise UserError(f"--dataset {dataset}: cannot reach the Hugging Face Hub "
                         f"({type(e).__name__}: {one_line(e)}); {OFFLINE_HINT}") from None


def iter_hub_documents(dataset: str, name, split: str, revision, text_field: str, debug: bool):
    rows = _iter_hub_rows(dataset, name, split, revision, debug)
    for number, row in enumerate(rows):
        where = f"{dataset} row {number}"
        yield where, _text_of(row, text_field, where)


def _iter_hub_rows(dataset: str, name, split: str, revision, debug: bool):
    where = f"--dataset {dataset} (--name {name}, --split {split}, revision {revision})"
    try:
        import datasets
    except ImportError:
        raise UserError(DATASETS_HINT) from None
    if not debug:  # the Hub client logs every retry; one final line is enough
        for logger in ("huggingface_hub", "datasets", "fsspec"):
            logging.getLogger(logger).setLevel(logging.ERROR)
    try:
        # streaming: rows arrive as they are read, so --max-tokens needs only the first part
        yield from datasets.load_dataset(dataset, name=name, split=split, revision=revision, streaming=True)
    except Exception as e:
        raise UserError(f"could not read {where} from the Hugging Face Hub "
                         f"({type(e).__name__}: {one_line(e)}); {OFFLINE_HINT}") from e


def _text_of(row: dict, text_field: str, where: str) -> str:
    if text_field not in row:
        raise UserError(_missing_field(where, text_field, list(row)))
    return _checked_text(row[text_field], text_field, where)


def _missing_field(where: str, text_field: str, fields: list) -> str:
    return (f"{where}: no field {text_field!r} (fields: {', '.join(map(str, fields))}); "
            "choose one with --text-field")


def _checked_text(text, text_field: str, where: str) -> str:
    if not isinstance(text, str):
        raise UserError(f"{where}: field {text_field!r} holds {type(text).__name__}, not text")
    return text


# --- parallel tokenization -------------------------------------------------------------------

CHUNK_CHARS = 1 << 20  # text per worker task: big enough that IPC is noise, small enough to stream

_worker_encoding = None


def _init_worker():
    # the main process handles Ctrl-C and SIGTERM and stops the pool; a worker ignores Ctrl-C
    # and ends quietly on the SIGTERM of pool.terminate() (not via the inherited handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    global _worker_encoding
    if _worker_encoding is None:  # forked workers inherit the main process's (loading takes ~0.3 s)
        _worker_encoding = get_encoding()


class ChunkError(Exception):
    """Why a chunk of documents could not be tokenized: the index of the document at fault in
    the chunk (None: not known) and the reason, as plain values, so that it crosses the worker
    pool intact; the main process, which knows where each document came from, makes it a
    UserError naming the file and line."""

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
    """encode_documents(enc, docs) at the one place where the data meets the tokenizer, in a
    worker or (--workers 1) in the main process. Whatever the data makes fail here leaves as a
    ChunkError (or a UserError): any other exception would cross the pool as a traceback, and a
    BaseException (tiktoken's PanicException) would end the worker and leave the pool waiting
    for its result forever. The failure costs the search for the document at fault; valid text
    pays nothing."""
    try:
        return _encode_chunk(enc, docs, utf8_errors)
    except (ChunkError, UserError, KeyboardInterrupt, SystemExit):
        raise
    except MemoryError:
        longest = max(map(len, docs))
        raise ChunkError(None, f"not enough memory (the longest is {longest:,} characters)") from None
    except BaseException as e:  # e.g. tiktoken's regex giving up on ~1M characters of whitespace
        index = next((i for i, doc in enumerate(docs) if _fails(enc, doc, utf8_errors)), None)
        error = f"{type(e).__name__}: {one_line(e)}"
        raise ChunkError(index, (f"tiktoken failed ({error})" if index is None else
                                 f"tiktoken cannot tokenize this document ({error}); fix it or leave it out")
                         + " (--debug shows the traceback)") from e


def _encode_chunk(enc: tiktoken.Encoding, docs: list, utf8_errors: str) -> np.ndarray:
    """encode_documents, and --utf8-errors for lone surrogates (JSON's "\\ud800" without its
    other half: not Unicode and no UTF-8 form, the text's counterpart of bytes that are not
    UTF-8): strict refuses one, replace tokenizes U+FFFD in its place."""
    try:
        return encode_documents(enc, docs)
    except UnicodeEncodeError:
        index = next((i for i, doc in enumerate(docs) if _SURROGATE.search(doc)), None)
        if index is None:
            raise
        if utf8_errors == "strict":
            code = ord(_SURROGATE.search(docs[index]).group())
            raise ChunkError(index, f"the text holds a lone surrogate U+{code:04X} (half of a UTF-16 pair, as JSON's "
                                    f"\\u{code:04x} without its other half), which is not Unicode and has no UTF-8 "
                                    "form; fix the input, or pass --utf8-errors replace to tokenize U+FFFD in "
                                    "its place") from None
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
    return tokenize_chunk(_worker_encoding, docs, utf8_errors)


def chunk_located(located, chunk_chars: int):
    """Group a stream of (where, text) documents into (texts, wheres) chunks of about
    chunk_chars characters."""
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


def chunk_documents(docs, chunk_chars: int):
    """Group a stream of document strings into lists of about chunk_chars characters."""
    for texts, _ in chunk_located(((None, doc) for doc in docs), chunk_chars):
        yield texts


def tokenize_in_order(chunks, pool, max_in_flight: int, utf8_errors: str = "strict"):
    """Token arrays of the (texts, wheres) chunks, in order, with at most max_in_flight tasks in
    the pool (with Pool.imap, finished results pile up without limit while the main process is
    busy). A chunk that cannot be tokenized is a UserError naming the document."""
    if pool is None:
        enc = get_encoding()
        for texts, wheres in chunks:
            try:
                yield tokenize_chunk(enc, texts, utf8_errors)
            except ChunkError as e:
                raise e.located(wheres) from e
        return
    pending = deque()

    def result():
        task, wheres = pending.popleft()
        try:
            return task.get()
        except ChunkError as e:
            raise e.located(wheres) from e

    for texts, wheres in chunks:
        pending.append((pool.apply_async(_tokenize_chunk, (texts, utf8_errors)), wheres))
        if len(pending) >= max_in_flight:
            yield result()
    while pending:
        yield result()


# --- shards and manifest ---------------------------------------------------------------------

BIN_MAGIC, BIN_VERSION, BIN_HEADER_INTS = 20240520, 1, 256  # llm.c's header for uint16 token shards


def shard_header(tokens: np.ndarray, fmt: str) -> bytes:
    if fmt == "bin":
        header = np.zeros(BIN_HEADER_INTS, dtype="<i4")
        header[:3] = BIN_MAGIC, BIN_VERSION, tokens.size
        return header.tobytes()
    buffer = io.BytesIO()  # exactly the header np.save writes
    np.lib.format.write_array_header_1_0(buffer, np.lib.format.header_data_from_array_1_0(tokens))
    return buffer.getvalue()


def write_atomically(path: str, *blobs) -> None:
    """Write to path.tmp, then rename: a killed process leaves path absent, old, or complete.
    (No fsync: it guards against power loss, not kills, and cost seconds per shard on slow disks;
    a resumed run checks the size of every shard it keeps.)"""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            for blob in blobs:
                f.write(blob)
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a quota, permissions
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise UserError(f"cannot write {path}: {os_error_reason(e)}; the shards that {MANIFEST} lists are "
                         "complete: fix this and run the same command again to resume") from None


def save_manifest(out_dir: str, manifest: dict) -> None:
    write_atomically(os.path.join(out_dir, MANIFEST), json.dumps(manifest, indent=1).encode())


def _stall_for_tests(shard_index: int) -> None:
    # Test-only: FINEWEB_TEST_STALL_AFTER_SHARD=N parks the process once shard N's file is in
    # place but before the manifest records it, so a test can kill it at that exact point.
    if os.environ.get("FINEWEB_TEST_STALL_AFTER_SHARD") == str(shard_index):
        print(f"stalled after shard {shard_index} (test hook)", file=sys.stderr, flush=True)
        time.sleep(3600)


class ShardWriter:
    """Cuts the token stream into shards and records, per shard, where it ends in the
    document stream: documents fully written so far, and tokens already written of the next
    (split) document. Those two numbers are all a resumed run needs."""

    def __init__(self, out_dir: str, manifest: dict):
        self.out_dir, self.manifest = out_dir, manifest
        config = manifest["config"]
        self.prefix, self.fmt = config["prefix"], config["format"]
        self.val_shards = config["val_shards"]
        try:
            self.buffer = np.empty(config["shard_size"], dtype="<u2")
        except MemoryError:
            raise UserError(f"--shard-size {config['shard_size']:,}: not enough memory for one shard's "
                             f"buffer ({2 * config['shard_size'] / 1e9:.1f} GB); choose a smaller "
                             "--shard-size") from None
        self.filled = 0
        self.shard_documents = 0  # documents that start in the current shard
        last = manifest["shards"][-1] if manifest["shards"] else {}
        self.documents_done = last.get("documents_done", 0)
        self.open_tokens = last.get("next_document_tokens_done", 0)  # of the last started document
        self.tokens_written = sum(shard["tokens"] for shard in manifest["shards"])

    @property
    def tokens_total(self) -> int:
        return self.tokens_written + self.filled

    def add(self, tokens: np.ndarray) -> None:
        """Append tokens of whole documents (the first may lack a prefix already written)."""
        pos = 0
        while pos < tokens.size:
            segment = tokens[pos:pos + self.buffer.size - self.filled]
            self.buffer[self.filled:self.filled + segment.size] = segment
            self.filled += segment.size
            pos += segment.size
            starts = np.flatnonzero(segment == EOT)
            self.shard_documents += starts.size
            if starts.size:
                # each <|endoftext|> completes the document before it, if there is one
                self.documents_done += starts.size - (0 if self.open_tokens else 1)
                self.open_tokens = segment.size - int(starts[-1])
            else:
                self.open_tokens += segment.size
            if self.filled == self.buffer.size:
                # chunks hold whole documents, so a chunk's end is a document's end too
                self.finish_shard(ends_document=pos == tokens.size or tokens[pos] == EOT)

    def finish_shard(self, ends_document: bool = True) -> None:
        if not self.filled:
            return
        index = len(self.manifest["shards"])
        split = "val" if index < self.val_shards else "train"
        name = f"{self.prefix}_{split}_{index:06d}.{self.fmt}"
        tokens = self.buffer[:self.filled]
        header = shard_header(tokens, self.fmt)
        write_atomically(os.path.join(self.out_dir, name), header, tokens.data)
        digest = hashlib.sha256(header)
        digest.update(tokens.data)
        _stall_for_tests(index)
        if ends_document and self.open_tokens:
            self.documents_done += 1
            self.open_tokens = 0
        self.manifest["shards"].append({
            "file": name, "split": split, "tokens": int(self.filled),
            "bytes": len(header) + tokens.nbytes,
            "documents": int(self.shard_documents),
            "sha256": digest.hexdigest(),
            "max_id": int(tokens.max()),  # the trainer refuses ids its model has no output for
            "documents_done": self.documents_done,
            "next_document_tokens_done": self.open_tokens,
        })
        try:
            save_manifest(self.out_dir, self.manifest)
        except UserError:  # the folder holds exactly what the manifest lists, so a rerun resumes
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.out_dir, name))
            raise
        self.tokens_written += self.filled
        self.filled = self.shard_documents = 0


def open_manifest(out_dir: str, config: dict, source: str, inputs) -> dict:
    """The manifest of an earlier run with the same config and inputs, or a new one (not yet
    written: a run that fails before its first shard leaves the folder as it found it)."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        pattern = f"{glob.escape(config['prefix'])}_*.{config['format']}"
        strays = glob.glob(os.path.join(glob.escape(out_dir), pattern))
        if strays:
            raise UserError(f"{out_dir} holds shards ({os.path.basename(strays[0])}, ...) but no "
                             f"{MANIFEST}, so they cannot be resumed; use an empty --out-dir")
        return {"source": source, "tokenizer": f"tiktoken {ENCODING_NAME} (GPT-2 BPE, EOT={EOT})",
                "dtype": "uint16", "config": config, "inputs": inputs, "complete": False, "shards": []}
    manifest = read_manifest(path)
    changed = [f"{key} {manifest['config'].get(key)!r} -> {value!r}"
               for key, value in config.items() if manifest["config"].get(key) != value]
    if changed:
        raise UserError(f"{path} was written with other arguments ({'; '.join(changed)}); "
                         "rerun with the same arguments to resume, or use another --out-dir")
    what = changed_input(manifest.get("inputs"), inputs)
    if what:
        raise UserError(f"the --files input changed since {path} was written: {what}, so new shards "
                         f"would not continue the old ones; restore it, or delete {out_dir} and start over")
    for shard in manifest["shards"]:
        shard_path = os.path.join(out_dir, shard["file"])
        if not os.path.isfile(shard_path) or os.path.getsize(shard_path) != shard["bytes"]:
            raise UserError(f"{shard_path}, listed in {path}, is missing or truncated; "
                             "delete the folder and start over")
    return manifest


def read_manifest(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
        if not (isinstance(manifest["config"], dict) and isinstance(manifest["complete"], bool)
                and all(isinstance(shard["file"], str) and isinstance(shard["bytes"], int)
                        for shard in manifest["shards"])):
            raise TypeError
    except (ValueError, KeyError, TypeError):  # not JSON (or not UTF-8), or not our layout
        raise UserError(f"{path} is not a manifest written by fineweb.py; use an empty --out-dir") from None
    return manifest


def input_listing(files: list) -> list:
    """[path, size, mtime_ns] of every input file: a file edited or replaced in place shows
    in its size or modification time, without reading the data again."""
    listing = []
    for path in files:
        try:
            st = os.stat(path)
        except OSError as e:
            raise UserError(f"cannot read {path}: {os_error_reason(e)}") from None
        listing.append([path, st.st_size, st.st_mtime_ns])
    return listing


def changed_input(before, now) -> str | None:
    """How the input listing now differs from the one an earlier run recorded (None: same)."""
    if now and before is None:
        return "its manifest lists no input files (an older fineweb.py wrote it)"
    then = {path: stamp for path, *stamp in before or []}
    current = {path: stamp for path, *stamp in now or []}
    for path, stamp in current.items():
        if path not in then:
            return f"{path} is new"
        if then[path] != stamp:
            return f"{path} was modified (its size or modification time differs)"
    gone = [path for path in then if path not in current]
    return f"{gone[0]} is gone" if gone else None


def open_shard(path: str) -> np.ndarray:
    """Memory-map a token shard: build-nanogpt's .npy (uint16) or llm.c's .bin."""
    try:
        if path.endswith(".bin"):
            header = np.fromfile(path, dtype=np.int32, count=BIN_HEADER_INTS)
            if header.size < 3 or header[0] != BIN_MAGIC:
                raise UserError(f"{path}: not an llm.c token shard (bad magic). "
                                "HINT: are you passing the right file?")
            if header[1] != BIN_VERSION:
                raise UserError(f"{path}: unsupported llm.c shard version {header[1]} (expected {BIN_VERSION})")
            n_tokens = int(header[2])
            expected = 4 * BIN_HEADER_INTS + 2 * n_tokens
            actual = os.path.getsize(path)
            if actual != expected:
                raise UserError(f"{path}: header says {n_tokens} tokens ({expected} bytes) but the file "
                                f"has {actual} bytes: truncated or corrupt, re-create it")
            return np.memmap(path, dtype=np.uint16, mode="r", offset=4 * BIN_HEADER_INTS, shape=(n_tokens,))
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise UserError(f"{path}: not a .npy token shard (bad magic). HINT: are you passing the right file?")
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except UserError:
        raise
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"{path}: cannot read token shard ({e}); truncated or corrupt? re-create it") from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise UserError(f"{path}: expected a 1-D uint16 token array, got {tokens.dtype} with shape "
                        f"{tokens.shape}. HINT: are you passing the right file?")
    return tokens


def get_tokenizer_or_fail(hint: str | None = None):
    """get_encoding() for a command: a UserError saying how to get the tokenizer (and `hint`,
    another way out) instead of a RuntimeError."""
    try:
        return get_encoding()
    except RuntimeError as e:
        raise UserError(f"{e} (or {hint})" if hint else str(e)) from None


SAMPLES, SAMPLE_BYTES = 16, 64 << 10  # a shard's sampled content: 1 MiB


def sampled_sha256(path: str, size: int) -> str:
    """sha256 of a file's size and SAMPLES slices of SAMPLE_BYTES spread evenly over it, from its
    first byte (the header) to its last; a file of at most SAMPLES x SAMPLE_BYTES is hashed whole.
    Two corpora cut into shards of the same sizes differ in every slice. Every rank fingerprints
    every shard at start-up: a 100M-token shard (200 MB) takes 16 ms read from disk this way, 0.8 s
    for a full sha256 (benchmarks/bench_shard_identity.py), 80 s for FineWeb-Edu 10B's 100 shards."""
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            digest.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def folder_manifest(folder: str) -> dict | None:
    """fineweb.py's manifest.json in a folder of shards, or None where there is no readable one (shards
    may come from other tools): what the trainer's checks of a data folder read."""
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(folder, MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
        return manifest if isinstance(manifest, dict) else None
    return None


def manifest_shards(folder: str) -> dict[str, dict] | None:
    """{file: its entry} of the shards that fineweb.py's manifest.json in folder lists (None without a
    readable one)."""
    with contextlib.suppress(LookupError, TypeError):
        return {shard["file"]: shard for shard in folder_manifest(folder)["shards"]}
    return None


def recorded(paths: list[str], key: str) -> list:
    """What the manifest.json of each path's folder records for it under key (sha256, max_id), or None:
    without a manifest, or where its entry is for a file of another size (not this file)."""
    listed = {folder: manifest_shards(folder) or {} for folder in {os.path.dirname(p) for p in paths}}
    values = []
    for path in paths:
        entry = listed[os.path.dirname(path)].get(os.path.basename(path))
        same_size = isinstance(entry, dict) and entry.get("bytes") == os.path.getsize(path)
        values.append(entry.get(key) if same_size else None)
    return values


def check_against_manifest(folder: str, split: str, paths: list[str]):
    """Where fineweb.py's manifest.json is, it is the list of the folder's shards: refuse the shards of an
    unfinished run (killed, or stopped at a document it could not read: they hold only the data before
    that point), a shard file of the split (paths: those the trainer found by name) that it does not
    list (another data set's file, a copy in another format), and one it lists that is missing or of
    another size."""
    manifest, where = folder_manifest(folder), os.path.join(folder, MANIFEST)
    if manifest is not None and manifest.get("complete") is False:
        written = len(manifest.get("shards") or ())
        raise UserError(f"{folder} holds an unfinished fineweb.py run ({written} shards written, {MANIFEST} says "
                        "complete: false); finish it by running fineweb.py again as it was run")
    listed = manifest_shards(folder)
    if listed is None:  # shards from another tool
        return
    for path in paths:
        if os.path.basename(path) not in listed:
            raise UserError(f"{path} is not one of the shards that {where} lists: move it out of the folder (where "
                            "a manifest is, the trainer reads the shards it lists and no others)")
    for name, entry in sorted(listed.items()):
        path = os.path.join(folder, name)
        if f"_{split}_" not in name or (os.path.isfile(path) and os.path.getsize(path) == entry.get("bytes")):
            continue
        what = (f"is {os.path.getsize(path)} bytes, not the {entry.get('bytes')} that {where} lists"
                if os.path.isfile(path) else f"is missing, yet {where} lists it")
        raise UserError(f"{path} {what}; restore it, or re-create the data set with fineweb.py")


def no_output_for(path: str, token_id: int, vocab_size: int) -> str:
    """Why the model (of vocab_size rows) cannot train on a shard holding token_id: as a target, no
    output of its softmax (real_vocab_size) is that id."""
    if vocab_size >= GPT2_VOCAB:
        return (f"{path} holds token id {token_id}, which the model has no output for: its softmax covers GPT-2's "
                f"{GPT2_VOCAB} tokens (ids 0..{EOT}), whatever --vocab-size pads; the shards come from another "
                "tokenizer (one with added tokens?): re-create them with fineweb.py")
    return (f"{path} holds token id {token_id}, which the model has no output for (--vocab-size {vocab_size}: ids "
            f"0..{vocab_size - 1}); wrong tokenizer or --vocab-size too small")


def check_token_ids(paths: list[str], shards: list[np.ndarray], vocab_size: int):
    """Refuse, before any step, shards holding an id the model has no output for (no_output_for), which
    would fail the loss when its row is first read. A shard's largest id is its manifest's max_id, else
    a pass over the memory-mapped tokens (a 100M-token shard: 0.02 s from the page cache, 2 s for 10B tokens)."""
    for path, tokens, largest in zip(paths, shards, recorded(paths, "max_id")):
        if not isinstance(largest, int):
            largest = int(tokens.max()) if tokens.size else 0
        if largest >= real_vocab_size(vocab_size):
            raise UserError(no_output_for(path, largest, vocab_size))


class ShardDigestCheck:
    """Each shard's full sha256 against the one its folder's manifest.json records, once, on a daemon
    thread started at start-up (hashlib lets go of the GIL: it runs beside the steps, 0.4 to 0.8 s per
    100M-token shard). A shard without a recorded sha256 is not checked. The run asks failed() (free)
    at each step and result() (which waits for it) where it must know."""

    def __init__(self, paths: list[str]):
        self.error = None
        self.thread = threading.Thread(target=self._check, args=(paths, recorded(paths, "sha256")),
                                       name="shard sha256", daemon=True)
        self.thread.start()

    def _check(self, paths: list[str], digests: list[str | None]):
        for path, expected in zip(paths, digests):
            if expected is None:
                continue
            try:
                with open(path, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
            except OSError as e:
                self.error = UserError(f"cannot read {path}: {os_error_reason(e)}")
                return
            if digest != expected:
                self.error = UserError(
                    f"{path} has sha256 {digest[:16]}..., not the {expected[:16]}... that "
                    f"{os.path.join(os.path.dirname(path), MANIFEST)} records: the file changed since fineweb.py "
                    "wrote it (a damaged copy?); restore it, or re-create the data set with fineweb.py")
                return

    def failed(self) -> bool:
        return self.error is not None

    def result(self, wait: bool = True):
        """A UserError naming the first shard that differs: once every shard is checked, or (not wait)
        among those checked so far."""
        if wait:
            self.thread.join()
        if self.error:
            raise self.error


def shard_files(paths: list[str]) -> list[tuple[str, int, str, str | None]]:
    """What tells one set of shards from another, per shard: (file name, size in bytes, its
    sampled_sha256, the sha256 its folder's manifest.json records for a file of that size or None)."""
    files = []
    for path, sha256 in zip(paths, recorded(paths, "sha256")):
        size = os.path.getsize(path)
        files.append((os.path.basename(path), size, sampled_sha256(path, size), sha256))
    return files


def differing_file(a: list[tuple], b: list[tuple]) -> tuple[str, str, str] | None:
    """The first file name (in order) that differs between two shard_files() lists, with what it
    is in each: "N bytes" or "missing" when the sizes differ, else its content (the manifests'
    sha256 where both lists have one, then the sampled one); None if they are the same. The lists
    of checkpoints written before contents were recorded, (name, size) pairs, compare by size."""
    a_files, b_files = ({entry[0]: entry[1:] for entry in files} for files in (a, b))
    for name in sorted({*a_files, *b_files}):
        x, y = a_files.get(name), b_files.get(name)
        if x is None or y is None or x[0] != y[0]:
            size = lambda entry: f"{entry[0]} bytes" if entry else "missing"  # noqa: E731
            return name, size(x), size(y)
        for kind, i in (("sha256", 2), ("sampled content", 1)):
            if len(x) > i and len(y) > i and x[i] and y[i] and x[i] != y[i]:
                return name, f"{x[0]} bytes of {kind} {x[i][:12]}", f"{y[0]} bytes of {kind} {y[i][:12]}"
    return None


@contextlib.contextmanager
def output_folder(out_dir: str):
    """Creates out_dir (and missing parents) and holds it (FolderLock) for the block: a second run on
    it is refused before it reads or writes anything there. If the block fails or is interrupted with
    the new folder still empty, removes what it created: a run that wrote nothing leaves nothing behind."""
    created, folder = [], os.path.abspath(out_dir)
    while not os.path.exists(folder):
        created.append(folder)
        folder = os.path.dirname(folder)
    try:
        os.makedirs(out_dir, exist_ok=True)
        if not os.access(out_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        raise UserError(f"cannot create shards in --out-dir {out_dir}: {os_error_reason(e)}") from None
    lock = FolderLock(out_dir)
    lock.acquire()  # refused: the folder is the other run's, left as it is
    try:
        yield
    except BaseException:
        lock.release()  # (its .lock note goes: the folder is empty again if nothing was written)
        for folder in created:  # the deepest first; stop at the first that is not empty
            try:
                os.rmdir(folder)
            except OSError:
                break
        raise
    finally:
        lock.release()


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

    def in_use(self, holder: str) -> str:
        """The refusal of a second writer (holder: as the .lock note names it)."""
        return (f"--out-dir {self.folder} is being written by another process ({holder}; it holds a lock on the "
                "folder): wait for it to end, or choose another --out-dir")

    def note(self, line: str):
        print(line, file=sys.stderr, flush=True)

    def acquire(self):
        try:
            import fcntl
        except ImportError:  # Windows
            return self._cannot_lock("no flock on this system")
        fd = os.open(self.folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(self.in_use(self._holder())) from None
        except OSError as e:  # a file system without locks (Lustre without -o flock)
            os.close(fd)
            return self._cannot_lock(os_error_reason(e))
        self.fd = fd
        try:
            self._write_holder()
        except UserError:
            self.release()
            raise

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
            what = (f"a symbolic link to {os.readlink(self.path)}" if os.path.islink(self.path) else
                    "a directory" if os.path.isdir(self.path) else "not a regular file")
            raise UserError(f"{self.path} is {what}, not the lock note {self.writer} writes: remove it, or choose "
                            "another --out-dir")
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            os.replace(tmp, self.path)
            self.written = os.stat(self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise UserError(f"cannot write {self.path}: {os_error_reason(e)}") from None

    def _cannot_lock(self, why: str):
        self.note(f"note: cannot lock --out-dir {self.folder} ({why}): a second run on it would not be stopped")

    def release(self):
        if self.fd is None:
            return
        if self.written:  # still the file this run wrote (same inode): removed while the folder is locked
            with contextlib.suppress(OSError):
                if os.path.samestat(os.stat(self.path), self.written):
                    os.remove(self.path)
        os.close(self.fd)
        self.fd = self.written = None


def validate_args(args: argparse.Namespace) -> None:
    """What argparse cannot check; fills in the Hub defaults. UserError names the flag."""
    if args.files:
        if args.dataset or args.name or args.split:
            raise UserError("--files reads local files; leave out --dataset, --name and --split")
    else:
        if args.dataset is None:
            args.dataset = DEFAULT_DATASET
            args.name = args.name or DEFAULT_NAME
        args.split = args.split or "train"
    if args.format == "bin" and args.shard_size >= 2**31:
        raise UserError("--format bin stores the token count as int32: use --shard-size below 2G")
    if not args.out_dir or (os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir)):
        raise UserError(f"--out-dir {args.out_dir!r} is not a folder")
    if "/" in args.prefix or os.sep in args.prefix:
        raise UserError(f"--prefix {args.prefix!r} is the start of a file name, not a path")
    for split, other in (("val", "train"), ("train", "val")):
        # train_gpt2.py finds a split's shards by the name pattern *_{split}_*
        if f"_{other}_" in f"{args.prefix}_{split}_":
            raise UserError(f"--prefix {args.prefix!r} would name {split} shards {args.prefix}_{split}_NNNNNN, "
                             f"which train_gpt2.py would read as {other} shards too (*_{other}_*); "
                             "choose a prefix without '_train' or '_val'")


def _drop_written_prefix(tokens: np.ndarray, count: int) -> np.ndarray:
    """Drop the first count tokens of the first document: the interrupted run wrote them."""
    first_document_longer = tokens.size > count and not (tokens[1:count + 1] == EOT).any()
    if tokens[0] != EOT or not first_document_longer:
        raise UserError("the input differs from the interrupted run's (a document split across "
                         "shards is shorter now); delete the --out-dir folder and start over")
    return tokens[count:]


def run(args: argparse.Namespace) -> None:
    global _worker_encoding
    try:
        _worker_encoding = get_encoding()  # fail here, once, rather than in every worker
    except RuntimeError as e:
        raise UserError(str(e)) from e
    source, config, inputs = describe_input(args)
    with output_folder(args.out_dir):
        write_data_set(args, source, config, inputs)


def write_data_set(args: argparse.Namespace, source: str, config: dict, inputs) -> None:
    """The shards of the source in args.out_dir (held by this run): a new data set, the rest of an
    interrupted one, or nothing when it is complete."""
    manifest = open_manifest(args.out_dir, config, source, inputs)
    writer = ShardWriter(args.out_dir, manifest)
    done = f"{len(manifest['shards'])} shards, {writer.tokens_written:,} tokens"
    if manifest["complete"]:
        print(f"{args.out_dir} is already complete ({done}); nothing to do")
        return
    if args.files:
        documents = iter_file_documents([path for path, *_ in inputs], args.text_field,
                                        args.doc_per_file, args.utf8_errors)
    else:  # a resumed run reads the commit that the interrupted one started with
        # asked of the Hub only by a new run: a resume must not depend on reaching it again
        revision = manifest.get("hub_revision") or hub_revision(args.dataset)
        manifest["hub_revision"] = revision
        documents = iter_hub_documents(args.dataset, args.name, args.split, revision,
                                       args.text_field, args.debug)
    if manifest["shards"]:
        print(f"resuming after {done} (skipping the first {writer.documents_done:,} documents)",
              file=sys.stderr)
    write_shards(args, writer, islice(documents, writer.documents_done, None), source)
    manifest["complete"] = True
    save_manifest(args.out_dir, manifest)
    shards = manifest["shards"]
    print(f"wrote {len(shards)} shards, {writer.tokens_written:,} tokens, "
          f"{sum(shard['documents'] for shard in shards):,} documents to {args.out_dir}")
    if len(shards) <= args.val_shards:
        print(f"fineweb.py: warning: all {len(shards)} shards are val shards (--val-shards "
              f"{args.val_shards}), so train_gpt2.py finds no train shards here", file=sys.stderr)


def describe_input(args: argparse.Namespace) -> tuple[str, dict, list | None]:
    """The source in words, the config (everything that changes the output: a resumed run
    must match it exactly), and the input files' listing (None for the Hub)."""
    inputs, file_info = None, {}
    if args.files:
        files = resolve_files(args.files)
        outside = os.path.realpath(args.out_dir) + os.sep
        inside = [path for path in files if os.path.realpath(path).startswith(outside)]
        if inside:
            raise UserError(f"--files matches {inside[0]}, inside --out-dir {args.out_dir}: "
                             "the output would be read as input")
        source = f"--files {' '.join(args.files)} ({len(files)} matched)"
        inputs = input_listing(files)
        file_info = {"files": args.files, "doc_per_file": args.doc_per_file, "utf8_errors": args.utf8_errors}
    else:
        source = f"Hugging Face Hub {args.dataset} (name {args.name}, split {args.split})"
    config = {"dataset": args.dataset, "name": args.name, "split": args.split, **file_info,
              "text_field": args.text_field, "tokenizer": ENCODING_NAME, "shard_size": args.shard_size,
              "max_tokens": args.max_tokens, "val_shards": args.val_shards, "prefix": args.prefix,
              "format": args.format}
    return source, config, inputs


def write_shards(args: argparse.Namespace, writer: ShardWriter, documents, source: str) -> None:
    """Tokenize the documents (those the shards so far do not hold) into the writer's shards."""
    import multiprocessing
    from tqdm import tqdm

    drop = writer.open_tokens
    with contextlib.ExitStack() as stack:
        pool = None
        if args.workers > 1:  # forked before the source starts any threads
            pool = stack.enter_context(multiprocessing.Pool(args.workers, initializer=_init_worker))
        # read the first document now, so that source errors come before the progress bar
        first = next(documents, None)
        if first is None and not writer.manifest["shards"]:
            raise UserError(f"no documents in {source}")
        chunks = chunk_located(chain([first], documents) if first is not None else (), CHUNK_CHARS)
        progress = stack.enter_context(tqdm(
            total=args.max_tokens, initial=writer.tokens_total, unit="tok", unit_scale=True,
            desc="tokenizing", dynamic_ncols=True))
        for tokens in tokenize_in_order(chunks, pool, 2 * args.workers, args.utf8_errors):
            if drop:
                tokens, drop = _drop_written_prefix(tokens, drop), 0
            if args.max_tokens:
                tokens = tokens[:args.max_tokens - writer.tokens_total]
            writer.add(tokens)
            progress.update(tokens.size)
            if writer.tokens_total == args.max_tokens:
                break
        writer.finish_shard()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM: unwind like Ctrl-C, so the pool is stopped


def main(argv=None) -> int:
    args = parse_args(argv)
    previous_handler = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return exit_code_of(lambda: (validate_args(args), run(args)), args.debug, also_catch=(OSError,),
                            interrupted="fineweb.py: interrupted; run the same command again to resume")
    finally:
        signal.signal(signal.SIGTERM, previous_handler)


if __name__ == "__main__":
    sys.exit(main())
