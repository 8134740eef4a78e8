"""Tokenize a text dataset into GPT-2 token shards for train_gpt2.py (docs/data.md): each document becomes
[<|endoftext|>] + its GPT-2 BPE tokens, cut into shards of --shard-size tokens (the first the val split), 1-D
uint16 arrays as build-nanogpt's (or llm.c's .bin). OUT/manifest.json records every finished shard: the same
command resumes a killed run, and the shards come out byte-identical."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import signal
import sys
from decimal import Decimal, InvalidOperation
from itertools import chain, islice

from trainkit import cli  # the error contract shared by every script; standard library only, so it comes first
from trainkit.cli import UserError, exit_code_of, print_line, reason_of
from trainkit.fileio import FolderLock, remove_if_same  # one live writer per --out-dir (standard library only)


# --- from documents to shards -------------------------------------------------------------


INTERRUPTED = "fineweb.py: interrupted; run the same command again to resume"


def main(argv=None) -> int:
    args = parse_args(argv)
    previous_handler = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        action = lambda: (validate_args(args), run(args))
        return exit_code_of(action, args.debug, also_catch=(OSError,), interrupted=INTERRUPTED)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)


def run(args: argparse.Namespace) -> None:
    load_worker_encoding()  # fail here, once, rather than in every worker
    source, config, inputs = describe_input(args)
    with output_folder(args.out_dir) as folder:
        write_data_set(args, source, config, inputs, folder)


def write_data_set(args: argparse.Namespace, source: str, config: dict, inputs, folder: FolderLock) -> None:
    """The shards of the source in args.out_dir (held: folder): new, the rest of an interrupted run, or none."""
    manifest = open_manifest(args.out_dir, config, source, inputs)
    writer = ShardWriter(folder, manifest)
    done = f"{len(manifest['shards'])} shards, {writer.tokens_written:,} tokens"
    if manifest["complete"]:
        print_line(f"{args.out_dir} is already complete ({done}); nothing to do")
        return
    if args.files:
        paths = [path for path, *_ in inputs]
        documents = iter_file_documents(paths, args.text_field, args.doc_per_file, args.utf8_errors)
    else:  # a resume reads the commit the interrupted run started with, without asking the Hub again
        revision = manifest["hub_revision"] = manifest.get("hub_revision") or hub_revision(args.dataset)
        documents = iter_hub_documents(args.dataset, args.name, args.split, revision, args.text_field, args.debug)
    if manifest["shards"]:
        print_line(f"resuming after {done} (skipping the first {writer.documents_done:,} documents)", file=sys.stderr)
    write_shards(args, writer, islice(documents, writer.documents_done, None), source)
    manifest["complete"] = True
    save_manifest(folder, manifest)
    shards = manifest["shards"]
    print_line(
        f"wrote {len(shards)} shard{'s' if len(shards) != 1 else ''}, {writer.tokens_written:,} tokens, "
        f"{sum(shard['documents'] for shard in shards):,} documents to {args.out_dir}"
    )
    if len(shards) <= args.val_shards:
        which = "the only shard is a val shard" if len(shards) == 1 else f"all {len(shards)} shards are val shards"
        print_line(
            f"fineweb.py: warning: {which} (--val-shards {args.val_shards}), so train_gpt2.py finds no train "
            f"shards here: run again into an empty --out-dir with --shard-size {max(1, writer.tokens_written // 10)} "
            "(a tenth of the tokens)",
            file=sys.stderr,
        )


def write_shards(args: argparse.Namespace, writer: ShardWriter, documents, source: str) -> None:
    """Tokenize the documents (those the shards so far do not hold) into the writer's shards."""
    from tqdm import tqdm

    drop = writer.open_tokens
    with contextlib.ExitStack() as stack:
        pool = None
        if args.workers > 1:  # forked before the source starts any threads
            pool = stack.enter_context(worker_pool(args.workers))
        # read the first document now, so that source errors come before the progress bar
        first = next(documents, None)
        if first is None and not writer.manifest["shards"]:
            raise UserError(f"no documents in {source}")
        chunks = chunk_located(chain([first], documents) if first is not None else (), CHUNK_CHARS)
        look = dict(unit="tok", unit_scale=True, desc="tokenizing", dynamic_ncols=True)
        progress = stack.enter_context(tqdm(total=args.max_tokens, initial=writer.tokens_total, **look))
        for tokens in tokenize_in_order(chunks, pool, 2 * args.workers, args.utf8_errors):
            if drop:
                tokens, drop = _drop_written_prefix(tokens, drop), 0
            if args.max_tokens:
                tokens = tokens[: args.max_tokens - writer.tokens_total]
            writer.add(tokens)
            progress.update(tokens.size)
            if writer.tokens_total == args.max_tokens:
                break
        if args.split_small_input and not writer.manifest["shards"] and writer.filled > 1:
            writer.finish_in_two(max(1, round(SMALL_INPUT_VAL_FRACTION * writer.filled)))
        else:
            writer.finish_shard()


# --- command line (standard library only: --help and usage errors answer before numpy and tiktoken)

DEFAULT_DATASET, DEFAULT_NAME = "HuggingFaceFW/fineweb-edu", "sample-10BT"
DEFAULT_SHARD_SIZE = 10**8
# an input smaller than one default shard is cut in two: this fraction of its tokens val, the rest train
SMALL_INPUT_VAL_FRACTION = 0.1


def parse_args(argv=None) -> argparse.Namespace:
    parser = cli.ArgumentParser(
        description="Tokenize a text dataset into GPT-2 uint16 token shards (resumable).",
        epilog="Sizes: 20M, 1.5K, 10B (= 10G), 1e8 or 100000. Run again with the same arguments "
        "to resume an interrupted run.",
    )
    source = parser.add_argument_group("source (default: FineWeb-Edu sample-10BT, streamed from the Hub)")
    source.add_argument("--dataset", help=f"Hub dataset to stream (default {DEFAULT_DATASET})")
    source.add_argument(
        "--name", help=f"its configuration (default {DEFAULT_NAME} for the default dataset, none otherwise)"
    )
    source.add_argument("--split", help="its split (default train)")
    source.add_argument(
        "--files",
        nargs="+",
        action="extend",
        metavar="GLOB",
        help="local files instead of the Hub (quote globs; ** recurses): .parquet, "
        ".jsonl/.json(.gz), any other file is text",
    )
    source.add_argument(
        "--text-field", default="text", metavar="FIELD", help="column or JSON key holding the text (default text)"
    )
    source.add_argument(
        "--doc-per-file",
        action="store_true",
        help="text files: a whole file is one document (default: one per non-blank line)",
    )
    source.add_argument(
        "--utf8-errors",
        choices=["strict", "replace"],
        default="strict",
        help="bytes that are not UTF-8, and lone surrogates (JSON's \\ud800 without "
        "its pair): stop with an error (default) or replace them with U+FFFD",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--out-dir", default="edu_fineweb10B", help="folder for shards and manifest.json (default edu_fineweb10B)"
    )
    output.add_argument(
        "--prefix",
        help="shard file names: PREFIX_{val,train}_NNNNNN (default: edufineweb for FineWeb-Edu, "
        "another Hub dataset's name, data for --files)",
    )
    output.add_argument(
        "--shard-size",
        type=parse_size,
        metavar="TOKENS",
        help="tokens per shard (default 100M; an input smaller than that is cut in two shards: 10%% val, 90%% train)",
    )
    output.add_argument(
        "--val-shards",
        type=cli.non_negative_int,
        default=1,
        metavar="N",
        help="the first N shards are the val split (default 1)",
    )
    output.add_argument(
        "--max-tokens",
        type=parse_size,
        metavar="TOKENS",
        help="stop after the first TOKENS tokens (default: the whole source)",
    )
    output.add_argument(
        "--format",
        choices=["npy", "bin"],
        default="npy",
        help="npy: np.save of a uint16 array, as build-nanogpt (default); bin: llm.c's 1 KiB header + uint16 tokens",
    )
    run_group = parser.add_argument_group("run")
    run_group.add_argument(
        "--workers",
        type=cli.positive_int,
        default=os.cpu_count(),
        help="tokenizer processes (default: all cores; 1 = no pool)",
    )
    run_group.add_argument("--debug", action="store_true", help="show tracebacks and the Hub client's log")
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
    cli.parse_before_imports(parse_args)  # --help, or a usage error: answered before the slow imports

import numpy as np

from trainkit.data.documents import CHUNK_CHARS, chunk_located, hub_revision, iter_file_documents, worker_pool
from trainkit.data.documents import iter_hub_documents, load_worker_encoding, resolve_files, tokenize_in_order
from trainkit.data.shard_writer import ShardWriter, input_listing, open_manifest, save_manifest
from trainkit.data.tokenizer import ENCODING_NAME, EOT


# --- what run calls ----------------------------------------------------------------------------


def describe_input(args: argparse.Namespace) -> tuple[str, dict, list | None]:
    """The source in words, the config (all that changes the output: a resume must match it), the inputs."""
    source, inputs = f"Hugging Face Hub {args.dataset} (name {args.name}, split {args.split})", None
    if args.files:
        files = resolve_files(args.files)
        outside = os.path.realpath(args.out_dir) + os.sep
        inside = [path for path in files if os.path.realpath(path).startswith(outside)]
        if inside:
            raise UserError(
                f"--files matches {inside[0]}, inside --out-dir {args.out_dir}: the output would be read as input"
            )
        source = f"--files {' '.join(args.files)} ({len(files)} matched)"
        inputs = input_listing(files)
    file_keys = ("files", "doc_per_file", "utf8_errors") if args.files else ()
    config = {key: getattr(args, key) for key in ("dataset", "name", "split", *file_keys, "text_field")}
    config["tokenizer"] = ENCODING_NAME
    config |= {key: getattr(args, key) for key in ("shard_size", "max_tokens", "val_shards", "prefix", "format")}
    return source, config, inputs


def validate_args(args: argparse.Namespace) -> None:
    """What argparse cannot check; fills in the Hub defaults. UserError names the flag."""
    if args.files and (args.dataset or args.name or args.split):
        raise UserError("--files reads local files; leave out --dataset, --name and --split")
    if not args.files:
        if args.dataset is None:
            args.dataset = DEFAULT_DATASET
            args.name = args.name or DEFAULT_NAME
        args.split = args.split or "train"
    if args.format == "bin" and args.shard_size >= 2**31:
        raise UserError("--format bin stores the token count as int32: use --shard-size below 2G")
    if not args.out_dir or (os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir)):
        raise UserError(f"--out-dir {args.out_dir!r} is not a folder")
    args.split_small_input = args.shard_size is None and args.val_shards == 1
    args.shard_size = args.shard_size or DEFAULT_SHARD_SIZE
    args.prefix = default_prefix(args) if args.prefix is None else args.prefix
    if "/" in args.prefix or os.sep in args.prefix:
        raise UserError(f"--prefix {args.prefix!r} is the start of a file name, not a path")
    if args.prefix.startswith("."):  # glob's * (train_gpt2.py's *_val_*) skips hidden files
        raise UserError(
            f"--prefix {args.prefix!r} starts with '.': train_gpt2.py would not find shards named "
            "like hidden files; choose a prefix without the leading dot"
        )
    for split, other in (("val", "train"), ("train", "val")):  # train_gpt2.py finds a split by *_{split}_*
        if f"_{other}_" in f"{args.prefix}_{split}_":
            raise UserError(
                f"--prefix {args.prefix!r} would name {split} shards {args.prefix}_{split}_NNNNNN, "
                f"which train_gpt2.py would read as {other} shards too (*_{other}_*); choose a prefix without '_train' or '_val'"
            )


def default_prefix(args: argparse.Namespace) -> str:
    """edufineweb for FineWeb-Edu (build-nanogpt's); another Hub dataset's name, sanitized; files: data."""
    if args.files:
        return "data"
    if args.dataset == DEFAULT_DATASET:
        return "edufineweb"
    return re.sub(r"[^A-Za-z0-9.-]", "-", args.dataset.rsplit("/", 1)[-1]).lstrip(".-") or "data"


@contextlib.contextmanager
def output_folder(out_dir: str):
    """out_dir created and held (the FolderLock yielded); where the block fails, the folders it made go if empty."""
    created, folder = [], os.path.abspath(out_dir)
    while not os.path.exists(folder):
        created.append(folder)
        folder = os.path.dirname(folder)
    try:
        os.makedirs(out_dir, exist_ok=True)
        made = [(path, os.lstat(path)) for path in created]  # the deepest first
        if not os.access(out_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        raise UserError(f"cannot create shards in --out-dir {out_dir}: {reason_of(e)}") from None
    lock = FolderLock(out_dir)
    lock.acquire()  # refused: the folder is the other run's, left as it is
    try:
        yield lock
    except BaseException:
        lock.release()  # (its .lock note goes: the folder is empty again if nothing was written)
        for path, identity in made:  # stops being removed at the first that is not empty
            remove_if_same(path, identity)
        raise
    finally:
        lock.release()


def _drop_written_prefix(tokens: np.ndarray, count: int) -> np.ndarray:
    """Drop the first count tokens of the first document: the interrupted run wrote them."""
    first_document_longer = tokens.size > count and not (tokens[1 : count + 1] == EOT).any()
    if tokens[0] != EOT or not first_document_longer:
        raise UserError(
            "the input differs from the interrupted run's (a document split across shards is shorter now); delete the --out-dir folder and start over"
        )
    return tokens[count:]


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM: unwind like Ctrl-C, so the pool is stopped


if __name__ == "__main__":
    sys.exit(main())
