"""fineweb.py: shards equal to a direct tiktoken encoding, exact resume, one-line errors.

The commands run in-process through fineweb.main (run_cli, run_main); as programs, end to end: a run
killed or stopped by SIGTERM and resumed, a second run on a locked folder, the Hub unreachable, a fresh
machine without a tokenizer cache, a damaged or missing shipped BPE.

CPU only, offline: the commands read the GPT-2 BPE from the copy in bpe/ (or a TIKTOKEN_CACHE_DIR a
test sets); the reference encoding is tiktoken's own r50k_base, read from a tiktoken cache that holds the
shipped file (tiktoken's loader and definition, not fineweb's).
"""

import argparse
import gzip
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tiktoken

import fineweb
from conftest import (
    TEXT_FILE,
    fineweb_parked_after,
    group_gone,
    kill_group,
    run_command,
    run_main,
    tiktoken_cache,
    tiny_run_args,
    tree_hashes,
    wait_for,
)
from trainkit import fileio, cli
from trainkit.data import documents, tokenizer
from trainkit.data.shards import SAMPLE_BYTES, SAMPLES, differing_file, sampled_sha256, shard_files

FINEWEB = str(Path(fineweb.__file__).resolve())
EOT = 50256


def reference_encoding() -> tiktoken.Encoding:
    """tiktoken's own r50k_base (tiktoken_ext.openai_public's split pattern, special token and
    sha256 check) from a cache that holds bpe/'s file, not fineweb's loader; loaded without leaving
    TIKTOKEN_CACHE_DIR set for the commands the tests run."""
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    try:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TIKTOKEN_CACHE_DIR"] = tiktoken_cache(cache)
            return tiktoken.get_encoding("r50k_base")
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved


ENC = reference_encoding()

# --- helpers ---------------------------------------------------------------------------------

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "naïve",
    "café",
    "日本語",
    "🙂",
    "x = 1;",
    "don't",
    "it's",
    "123",
    "4.56",
    "def f():",
    "    return",
    "\t",
    "  ",
    "!!",
    "über",
    "—",
]


def make_docs(count=60, seed=0, newlines=True):
    """Varied documents: unicode, code-like text, whitespace runs, a few that span shards."""
    rng = random.Random(seed)
    words = WORDS + (["\n", "\n\n", "\r\n"] if newlines else [])
    docs = []
    for i in range(count):
        length = rng.choice([0, 3, 40, 200]) if i % 15 else 1500  # every 15th is long
        docs.append(" ".join(rng.choice(words) for _ in range(length)))
    return docs


def reference_tokens(docs):
    """What build-nanogpt's fineweb.py writes: [EOT] + encode_ordinary(doc), concatenated."""
    out = []
    for doc in docs:
        out.append(EOT)
        out.extend(ENC.encode_ordinary(doc))
    return np.array(out, dtype=np.uint16)


def load_shards(out_dir):
    manifest = json.loads((Path(out_dir) / "manifest.json").read_text())
    arrays = [np.load(Path(out_dir) / shard["file"]) for shard in manifest["shards"]]
    return manifest, arrays


def only_line(result):
    """The single line a failed run printed (errors come before any progress bar)."""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def error_line(result):
    """The one error line of a run that failed mid-stream, after its progress bar (if any)."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    *progress, last = result.stderr.splitlines()  # the bar redraws itself after each \r
    assert all(line.startswith("tokenizing: ") for line in progress if line), result.stderr
    return last


def write_jsonl(path, rows, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def check_output(out_dir, docs, shard_size, val_shards=1, prefix="data"):
    """Shards hold exactly the reference tokens; names, sizes, manifest and hashes are right."""
    manifest, arrays = load_shards(out_dir)
    expected = reference_tokens(docs)
    assert np.array_equal(np.concatenate(arrays), expected)
    assert manifest["complete"] is True
    assert [a.size for a in arrays[:-1]] == [shard_size] * (len(arrays) - 1)
    assert 0 < arrays[-1].size <= shard_size
    # where each shard ends in the document stream, from the reference document lengths
    doc_ends = np.cumsum([1 + len(ENC.encode_ordinary(doc)) for doc in docs])
    end = 0
    for index, (shard, tokens) in enumerate(zip(manifest["shards"], arrays)):
        split = "val" if index < val_shards else "train"
        assert shard["file"] == f"{prefix}_{split}_{index:06d}.npy"
        assert shard["split"] == split
        assert shard["tokens"] == tokens.size
        assert shard["documents"] == int((tokens == EOT).sum())
        data = (Path(out_dir) / shard["file"]).read_bytes()
        assert shard["sha256"] == hashlib.sha256(data).hexdigest()
        assert shard["bytes"] == len(data)
        assert shard["max_id"] == tokens.max()  # what the trainer's start-up check of token ids reads
        end += tokens.size
        done = int(np.searchsorted(doc_ends, end, side="right"))
        assert shard["documents_done"] == done
        assert shard["next_document_tokens_done"] == end - (doc_ends[done - 1] if done else 0)
    return manifest, arrays


@pytest.fixture
def small_chunks(monkeypatch):
    # many worker tasks even for tiny inputs, so ordering and in-flight limits are exercised
    monkeypatch.setattr(fineweb, "CHUNK_CHARS", 2000)


# --- tokenization ----------------------------------------------------------------------------


def test_encode_documents_matches_encode_ordinary_per_document():
    docs = make_docs(30) + ["", "a<|endoftext|>b", "<|endoftext|>", "tail   "]
    tokens = tokenizer.encode_documents(tokenizer.get_encoding(), docs)
    assert tokens.dtype == np.uint16
    assert np.array_equal(tokens, reference_tokens(docs))


def test_encode_documents_refuses_ids_beyond_uint16():
    class WideEncoding:
        def encode_to_numpy(self, text, allowed_special):
            return np.array([EOT, 70000], dtype=np.uint32)

    with pytest.raises(cli.UserError, match="70000 does not fit in uint16"):
        tokenizer.encode_documents(WideEncoding(), ["x"])


def test_tokenize_in_order_keeps_a_bounded_number_of_tasks_in_flight():
    import multiprocessing

    pulled = []

    def chunks():
        for i in range(100):
            pulled.append(i)
            yield [f"document {i}"], [f"where {i}"]

    with multiprocessing.Pool(2, initializer=documents.init_worker) as pool:
        results = documents.tokenize_in_order(chunks(), pool, max_in_flight=4)
        first = next(results)
        assert len(pulled) == 4
        rest = list(results)
    assert np.array_equal(np.concatenate([first] + rest), reference_tokens([f"document {i}" for i in range(100)]))


@pytest.mark.parametrize(
    "text, value",
    [
        ("20M", 20_000_000),
        ("1e8", 100_000_000),
        ("100000", 100_000),
        ("1.5K", 1500),
        ("0.1k", 100),
        ("2_000", 2000),
        ("10B", 10**10),
    ],
)
def test_parse_size(text, value):
    assert fineweb.parse_size(text) == value


@pytest.mark.parametrize(
    "text, message",
    [
        ("abc", "not a size: 'abc' (examples: 20M, 1e8, 100000)"),
        ("M", "not a size: 'M' (examples: 20M, 1e8, 100000)"),
        ("1.5", "not a whole number: '1.5'"),
        ("inf", "not a whole number: 'inf'"),
        ("nan", "not a whole number: 'nan'"),
        ("0", "must be in 1..2**62, got 0"),
        ("-3M", "must be in 1..2**62, got -3000000"),
        ("1e19", f"must be in 1..2**62, got {10**19}"),
    ],
)
def test_parse_size_rejects(text, message):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        fineweb.parse_size(text)
    assert str(e.value) == message


def test_import_is_light_and_silent():
    code = (
        "import sys, fineweb; from trainkit.data import tokenizer; "
        "heavy = {'torch', 'datasets', 'pyarrow', 'tqdm'} & set(sys.modules); "
        "print(sorted(heavy), fineweb.EOT, tokenizer.get_encoding().name)"
    )
    result = run_command("-c", code, cwd=Path(FINEWEB).parent, timeout=60)
    assert (result.stdout, result.stderr) == ("[] 50256 r50k_base\n", "")


# --- sources and shards ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "json.gz", "parquet"])
def test_rows_to_shards(tmp_path, small_chunks, kind):
    docs = make_docs() + ["text that quotes <|endoftext|> stays text", "last"]
    rows = [{"id": i, "text": doc} for i, doc in enumerate(docs)]
    path = tmp_path / f"docs.{kind}"
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    else:
        write_jsonl(path, rows, gzip.open if kind.endswith(".gz") else open)
    out = tmp_path / "out"
    assert fineweb.main(["--files", str(path), "--out-dir", str(out), "--shard-size", "3000", "--workers", "2"]) == 0
    _, arrays = check_output(out, docs, 3000)
    assert len(arrays) == -(-reference_tokens(docs).size // 3000)


def test_text_lines_and_files_to_shards(tmp_path, small_chunks):
    lines = make_docs(40, seed=1, newlines=False)
    (tmp_path / "a.txt").write_bytes("\r\n".join(lines[:20]).encode() + b"\r\n\n  \n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("\n".join(lines[20:]), encoding="utf-8")
    out = tmp_path / "lines"
    assert (
        fineweb.main(
            [
                "--files",
                str(tmp_path / "**" / "*.txt"),
                "--out-dir",
                str(out),
                "--shard-size",
                "2K",
                "--val-shards",
                "2",
                "--prefix",
                "t",
            ]
        )
        == 0
    )
    check_output(out, [line for line in lines if line.strip()], 2000, val_shards=2, prefix="t")

    files = {"x.py": "def f():\r\n    return 1\n", "y.md": "# Title\n\nbody\n", "z.txt": ""}
    for name, text in files.items():
        (tmp_path / name).write_bytes(text.encode())
    out = tmp_path / "per_file"
    assert (
        fineweb.main(
            [
                "--files",
                str(tmp_path / "*.py"),
                str(tmp_path / "*.[mt][dx]*"),
                "--doc-per-file",
                "--out-dir",
                str(out),
                "--shard-size",
                "300",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    # x.py first (first pattern), then a.txt, y.md, z.txt (second pattern, sorted)
    a_txt = (tmp_path / "a.txt").read_bytes().decode()
    check_output(out, [files["x.py"], a_txt, files["y.md"], files["z.txt"]], 300)


def test_max_tokens_cuts_exactly_and_bin_format(tmp_path, small_chunks):
    docs = make_docs()
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in docs])
    out = tmp_path / "bin"
    assert (
        fineweb.main(
            [
                "--files",
                str(path),
                "--out-dir",
                str(out),
                "--shard-size",
                "4000",
                "--max-tokens",
                "10.5K",
                "--format",
                "bin",
                "--workers",
                "2",
            ]
        )
        == 0
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == [
        "data_val_000000.bin",
        "data_train_000001.bin",
        "data_train_000002.bin",
    ]
    tokens = []
    for shard in manifest["shards"]:
        data = (out / shard["file"]).read_bytes()
        header = np.frombuffer(data[:1024], dtype="<i4")
        assert list(header[:3]) == [20240520, 1, shard["tokens"]] and not header[3:].any()
        assert shard["sha256"] == hashlib.sha256(data).hexdigest()
        tokens.append(np.frombuffer(data[1024:], dtype="<u2"))
    assert [t.size for t in tokens] == [4000, 4000, 2500]
    assert np.array_equal(np.concatenate(tokens), reference_tokens(docs)[:10500])


def test_npy_shards_are_byte_identical_to_np_save(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in make_docs(10)])
    out = tmp_path / "out"
    assert fineweb.main(["--files", str(path), "--out-dir", str(out), "--shard-size", "700", "--workers", "1"]) == 0
    for shard in sorted(out.glob("*.npy")):
        saved = tmp_path / "np_save.npy"
        np.save(saved, np.load(shard))
        assert shard.read_bytes() == saved.read_bytes()


# --- resume ----------------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path):
    docs = make_docs(90, seed=2)
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": doc} for doc in docs])
    # an uninterrupted run to compare against
    reference_out = tmp_path / "uninterrupted"
    assert (
        fineweb.main(["--files", str(path), "--out-dir", str(reference_out), "--shard-size", "2500", "--workers", "2"])
        == 0
    )
    return docs, path, reference_out


def assert_same_output(out, reference_out):
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference_out.iterdir())
    for path in reference_out.iterdir():
        if path.suffix == ".npy":
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == json.loads((reference_out / "manifest.json").read_text())


@pytest.mark.parametrize("how", ["SIGKILL the process group", "SIGTERM the main process"])
def test_killed_run_resumes_byte_identical(tmp_path, corpus, how):
    docs, path, reference_out = corpus
    out = tmp_path / "killed"
    args = ["--files", str(path), "--out-dir", str(out), "--shard-size", "2500", "--workers", "2"]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen([*fineweb_parked_after(2), *args], stderr=stderr, start_new_session=True)
    try:
        # the hook parks the run once shard 2 is in place, before the manifest records it
        wait_for((out / "data_train_000002.npy").exists, process, what="the stall after shard 2")
        if how.startswith("SIGKILL"):
            kill_group(process)
            assert process.returncode == -signal.SIGKILL
        else:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=120) == 130
            said = (tmp_path / "stderr.txt").read_text()
            assert "interrupted; run the same command again to resume" in said
            assert "Traceback" not in said
    finally:
        kill_group(process)  # (its workers too, whatever happened above)

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and len(manifest["shards"]) == 2
    # the trainer refuses the half-made folder rather than train on its first shards
    trained = run_main("train_gpt2.py", "--model", "cpu", "--data-dir", out, "--out-dir", tmp_path / "run")
    assert (trained.returncode, trained.stderr) == (
        2,
        f"error: {out} holds an unfinished fineweb.py run (2 shards "
        "written, manifest.json says complete: false); finish it by "
        "running fineweb.py again as it was run\n",
    )
    assert not (tmp_path / "run").exists()
    # the resume point splits a document, so the already-written prefix must be dropped
    assert manifest["shards"][-1]["next_document_tokens_done"] > 0

    result = run_main("fineweb.py", *args)
    assert result.returncode == 0, result.stderr
    skipped = manifest["shards"][-1]["documents_done"]
    assert f"resuming after 2 shards, 5,000 tokens (skipping the first {skipped} documents)" in result.stderr
    assert_same_output(out, reference_out)
    check_output(out, docs, 2500)


def test_a_folder_being_written_is_refused_to_a_second_run(tmp_path, corpus):
    """Two runs on one --out-dir (unlocked, both wrote, one over the other's shards, and the trainer read
    the mix): the second is refused in one line before it reads or writes anything there; once the first
    is killed, what it left blocks nothing and the same command resumes it."""
    docs, path, reference_out = corpus
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": doc} for doc in make_docs(40, seed=5)])
    out = tmp_path / "out"
    args = ["--files", str(path), "--out-dir", str(out), "--shard-size", "2500", "--workers", "2"]
    first = subprocess.Popen([*fineweb_parked_after(2), *args], stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for((out / "data_train_000002.npy").exists, first, what="the stall after shard 2")
        before = tree_hashes(out)
        for second in (["--files", str(other), "--out-dir", str(out), "--max-tokens", "1M"], args):
            result = run_main("fineweb.py", *second)
            assert (result.returncode, result.stderr) == (
                2,
                (
                    f"error: --out-dir {out} is being written by another process (pid {first.pid} on "
                    f"{socket.gethostname()}; it holds a lock on the folder): wait for it to end, or choose another "
                    "--out-dir\n"
                ),
            )
            assert tree_hashes(out) == before
        os.kill(first.pid, signal.SIGKILL)  # (its workers end once their task pipe closes)
        assert first.wait(timeout=120) == -signal.SIGKILL
        group_gone(first.pid)
        result = run_main("fineweb.py", *args)
        assert result.returncode == 0, result.stderr
    finally:
        kill_group(first)  # (by now its workers may have ended, and the group with them)
    assert_same_output(out, reference_out)


def test_resume_at_a_document_boundary(tmp_path, small_chunks, capsys):
    docs = make_docs(30, seed=3)
    lengths = [1 + len(ENC.encode_ordinary(doc)) for doc in docs]
    shard_size = sum(lengths[:7])  # shard 0 ends exactly where document 7 starts
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in docs])
    args = ["--files", str(path), "--shard-size", str(shard_size), "--workers", "2"]
    assert fineweb.main(args + ["--out-dir", str(tmp_path / "full")]) == 0
    manifest = json.loads((tmp_path / "full" / "manifest.json").read_text())
    assert (manifest["shards"][0]["documents_done"], manifest["shards"][0]["next_document_tokens_done"]) == (7, 0)
    # keep only what an interrupted run would have left: shard 0 and a manifest listing it
    cut = tmp_path / "cut"
    cut.mkdir()
    first = manifest["shards"][0]["file"]
    shard_bytes = (tmp_path / "full" / first).read_bytes()
    (cut / "manifest.json").write_text(json.dumps({**manifest, "complete": False, "shards": manifest["shards"][:1]}))
    (cut / first).write_bytes(shard_bytes[:-2])  # a shard cut short is refused, not resumed
    capsys.readouterr()
    assert fineweb.main(args + ["--out-dir", str(cut)]) == 2
    assert capsys.readouterr().err == (
        f"error: {cut / first}, listed in {cut / 'manifest.json'}, "
        "is missing or truncated; delete the folder and start over\n"
    )
    (cut / first).write_bytes(shard_bytes)
    assert fineweb.main(args + ["--out-dir", str(cut)]) == 0
    assert_same_output(cut, tmp_path / "full")


def test_complete_run_is_not_redone_and_other_arguments_are_refused(tmp_path, corpus):
    docs, path, reference_out = corpus
    stamps = {p.name: p.stat().st_mtime_ns for p in reference_out.iterdir()}
    again = run_main("fineweb.py", "--files", path, "--out-dir", reference_out, "--shard-size", "2500")
    assert again.returncode == 0
    total = reference_tokens(docs).size
    assert again.stdout == (
        f"{reference_out} is already complete ({-(-total // 2500)} shards, {total:,} tokens); nothing to do\n"
    )
    assert {p.name: p.stat().st_mtime_ns for p in reference_out.iterdir()} == stamps

    other = run_main("fineweb.py", "--files", path, "--out-dir", reference_out, "--shard-size", "3000")
    assert other.returncode == 2
    assert only_line(other) == (
        f"error: {reference_out / 'manifest.json'} was written with other arguments "
        "(shard_size 2500 -> 3000); rerun with the same arguments to resume, or use another --out-dir"
    )


# --- errors: one line, no traceback, non-zero exit -------------------------------------------


def test_no_matching_files(tmp_path):
    result = run_main("fineweb.py", "--files", tmp_path / "nothing*.jsonl", "--out-dir", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr == f"error: --files '{tmp_path / 'nothing*.jsonl'}' matches no files\n"


def test_no_documents(tmp_path):
    (tmp_path / "blank.txt").write_text("\n   \n\n")
    result = run_main("fineweb.py", "--files", tmp_path / "blank.txt", "--out-dir", tmp_path / "out", "--workers", "1")
    assert result.returncode == 2
    assert only_line(result) == f"error: no documents in --files {tmp_path / 'blank.txt'} (1 matched)"


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_missing_text_field(tmp_path, kind):
    rows = [{"id": 1, "content": "hello"}]
    path = tmp_path / f"rows.{kind}"
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
        where = str(path)
    else:
        write_jsonl(path, rows)
        where = f"{path}:1"
    result = run_main("fineweb.py", "--files", path, "--out-dir", tmp_path / "out", "--workers", "1")
    assert result.returncode == 2
    assert only_line(result) == (f"error: {where}: no field 'text' (fields: id, content); choose one with --text-field")


def test_undecodable_bytes(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait\n".encode("latin-1"))
    result = run_main("fineweb.py", "--files", path, "--out-dir", tmp_path / "out", "--workers", "1")
    assert result.returncode == 2
    assert only_line(result) == (
        f"error: {path} is not valid UTF-8 (byte 0xe9 cannot be decoded); "
        "convert it to UTF-8, leave it out of --files, or pass --utf8-errors replace"
    )

    replaced = run_main(
        "fineweb.py", "--files", path, "--out-dir", tmp_path / "out", "--workers", "1", "--utf8-errors", "replace"
    )
    assert replaced.returncode == 0, replaced.stderr
    _, arrays = load_shards(tmp_path / "out")
    assert np.array_equal(np.concatenate(arrays), reference_tokens(["caf\ufffd au lait"]))


LONE_SURROGATE_LINE = '{"text": "abc \\ud800 def"}\n'  # as web dumps hold: JSON's escape without its pair


@pytest.mark.parametrize("workers", ["1", "2"])  # in the main process, and across the worker pool
def test_lone_surrogate_is_one_line_or_replaced(tmp_path, workers):
    path = tmp_path / "web.jsonl"
    path.write_text('{"text": "hello"}\n\n' + LONE_SURROGATE_LINE + '{"text": "after"}\n')
    out = tmp_path / "new" / "out"
    result = run_main("fineweb.py", "--files", path, "--out-dir", out, "--workers", workers)
    assert error_line(result) == (
        f"error: {path}:3: the text holds a lone surrogate U+D800 (half of a UTF-16 pair, as JSON's \\ud800 "
        "without its other half), which is not Unicode and has no UTF-8 form; fix the input, or pass "
        "--utf8-errors replace to tokenize U+FFFD in its place"
    )
    assert not (tmp_path / "new").exists()

    replaced = run_main(
        "fineweb.py", "--files", path, "--out-dir", out, "--workers", workers, "--utf8-errors", "replace"
    )
    assert replaced.returncode == 0, replaced.stderr
    _, arrays = load_shards(out)
    assert np.array_equal(np.concatenate(arrays), reference_tokens(["hello", "abc \ufffd def", "after"]))


def test_lone_surrogate_in_a_document_that_quotes_endoftext(tmp_path):
    # such a document is encoded on its own: tiktoken's encode_ordinary would replace the surrogate silently
    path = tmp_path / "web.jsonl"
    path.write_text('{"text": "<|endoftext|> \\udfff"}\n')
    result = run_main("fineweb.py", "--files", path, "--out-dir", tmp_path / "out", "--workers", "1")
    assert error_line(result).startswith(f"error: {path}:1: the text holds a lone surrogate U+DFFF (")
    replaced = run_main(
        "fineweb.py", "--files", path, "--out-dir", tmp_path / "out", "--workers", "1", "--utf8-errors", "replace"
    )
    assert replaced.returncode == 0, replaced.stderr
    _, arrays = load_shards(tmp_path / "out")
    assert np.array_equal(np.concatenate(arrays), reference_tokens(["<|endoftext|> \ufffd"]))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_text_tiktoken_cannot_tokenize_is_one_line_naming_it(tmp_path, workers):
    # tiktoken's regex gives up on ~1M characters of whitespace before a word (a ValueError; its
    # encode_ordinary panics instead, a BaseException that would have ended a worker)
    path = tmp_path / "padded.txt"
    path.write_text("first line\n" + "a" + " " * 1_000_000 + "b\nlast line\n")
    result = run_main("fineweb.py", "--files", path, "--out-dir", tmp_path / "out", "--workers", workers)
    assert error_line(result) == (
        f"error: {path}:2: tiktoken cannot tokenize this document (ValueError: Regex error while tokenizing: Error "
        "executing regex: Max stack size exceeded for backtracking); fix it or leave it out (--debug shows the "
        "traceback)"
    )
    assert not (tmp_path / "out").exists()


def test_other_failures_in_a_worker_are_one_line_naming_the_document(monkeypatch):
    import multiprocessing

    class PanicException(BaseException):  # as tiktoken's Rust panics arrive: not an Exception
        pass

    class Panicking:
        def encode_to_numpy(self, text, **kwargs):
            if "bad" in text:
                raise PanicException("called `Result::unwrap()` on an `Err` value\nnote: run with RUST_BACKTRACE=1")
            return np.array([1, 2], dtype=np.uint32)

    monkeypatch.setattr(documents, "_worker_encoding", Panicking())  # forked workers inherit it
    chunks = [(["ok"], ["x.jsonl:1"]), (["fine", "bad", "bad too"], ["x.jsonl:2", "x.jsonl:3", "x.jsonl:4"])]
    with multiprocessing.Pool(1, initializer=documents.init_worker) as pool:  # the panic used to end the worker
        results = documents.tokenize_in_order(iter(chunks), pool, max_in_flight=2)
        assert next(results).tolist() == [1, 2]
        with pytest.raises(cli.UserError) as raised:
            next(results)
    assert str(raised.value) == (
        "x.jsonl:3: tiktoken cannot tokenize this document (PanicException: called "
        "`Result::unwrap()` on an `Err` value); fix it or leave it out (--debug shows the "
        "traceback)"
    )
    # the worker's own traceback comes along, for --debug
    assert "in encode_to_numpy" in str(raised.value.__cause__.__cause__)

    chunk = ["a" * 10, "b" * 30, "c"]
    monkeypatch.setattr(documents, "encode_documents", lambda enc, docs: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(documents.ChunkError) as raised:
        documents.tokenize_chunk(None, chunk, "strict")
    assert str(raised.value.located(["d:1", "d:2", "d:3"])) == (
        "cannot tokenize the 3 documents from d:1 to d:3: not enough memory (the longest is 30 characters)"
    )


@pytest.mark.parametrize("offline", ["dead proxy", "HF_HUB_OFFLINE"])
def test_hub_unreachable_fails_at_once_and_leaves_no_folder(tmp_path, offline):
    env = {"HF_HOME": str(tmp_path / "hf"), "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    if offline == "HF_HUB_OFFLINE":
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    out = tmp_path / "new" / "out"
    # the datasets client alone retried for ~25 s before its error; one probe without retries
    result = run_command(
        FINEWEB, "--max-tokens", "1000", "--out-dir", out, env=env, timeout=15
    )  # the Hub's clients read
    # their environment at import: a process of its own
    assert result.returncode == 2
    line = only_line(result)
    assert line.startswith("error: --dataset HuggingFaceFW/fineweb-edu: cannot reach the Hugging Face Hub (")
    assert line.endswith("); offline, tokenize local files instead with --files 'dir/**/*.parquet'")
    assert not (tmp_path / "new").exists()


def test_hub_resume_reads_the_commit_it_started_with(tmp_path, monkeypatch):
    docs = make_docs(40, seed=4)
    read_at = []

    def load_dataset(dataset, name, split, revision, streaming):
        assert (dataset, name, split, streaming) == ("me/corpus", None, "train", True)
        read_at.append(revision)
        return iter([{"text": doc} for doc in docs] if revision == "commit-1" else [{"text": "new"}])

    monkeypatch.setitem(sys.modules, "datasets", type(sys)("datasets"))
    monkeypatch.setattr(sys.modules["datasets"], "load_dataset", load_dataset, raising=False)
    monkeypatch.setattr(fineweb, "hub_revision", lambda dataset: "commit-1")
    args = ["--dataset", "me/corpus", "--shard-size", "2000", "--workers", "1"]
    assert fineweb.main(args + ["--out-dir", str(tmp_path / "full")]) == 0
    manifest, _ = check_output(tmp_path / "full", docs, 2000, prefix="corpus")  # named for the dataset
    assert manifest["hub_revision"] == "commit-1"
    cut = tmp_path / "cut"  # what an interrupted run leaves: shard 0 and a manifest listing it
    cut.mkdir()
    (cut / manifest["shards"][0]["file"]).write_bytes((tmp_path / "full" / manifest["shards"][0]["file"]).read_bytes())
    (cut / "manifest.json").write_text(json.dumps({**manifest, "complete": False, "shards": manifest["shards"][:1]}))
    asked = []  # the dataset changed since; the resume must neither read nor need to ask the Hub
    monkeypatch.setattr(fineweb, "hub_revision", lambda dataset: asked.append(dataset) or "commit-2")
    assert fineweb.main(args + ["--out-dir", str(cut)]) == 0
    assert read_at == ["commit-1", "commit-1"] and asked == []
    assert_same_output(cut, tmp_path / "full")


def gzip_corpus(tmp_path):
    """A good .jsonl.gz and the bytes of a second one, to damage."""
    good = write_jsonl(tmp_path / "a.jsonl.gz", [{"text": doc} for doc in make_docs(20)], gzip.open)
    data = "".join(json.dumps({"text": doc}) + "\n" for doc in make_docs(40, seed=5)).encode()
    return good, data


@pytest.mark.parametrize("damage", ["truncated", "plain text", "flipped byte"])
def test_damaged_gzip_is_one_line_naming_it_and_leaves_no_folder(tmp_path, damage):
    good, data = gzip_corpus(tmp_path)
    packed = gzip.compress(data, mtime=0)
    path = tmp_path / "b.jsonl.gz"
    if damage == "truncated":
        path.write_bytes(packed[: len(packed) // 2])
    elif damage == "plain text":
        path.write_bytes(data)
    else:
        path.write_bytes(packed[:-8] + bytes([packed[-8] ^ 1]) + packed[-7:])  # the CRC
    out = tmp_path / "new" / "out"  # the error comes after the folder was made, before any shard
    result = run_main("fineweb.py", "--files", good, path, "--out-dir", out, "--workers", "1")
    reason = {
        "truncated": "is truncated (the gzip data ends early)",
        "plain text": "is not valid gzip data (Not a gzipped file (b'{\"'))",
        "flipped byte": "is not valid gzip data (CRC check failed ",
    }[damage]
    line = error_line(result)
    assert line.startswith(f"error: {path} {reason}")
    assert line.endswith("re-create it or leave it out of --files")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("damage", ["truncated", "not parquet", "damaged page"])
def test_damaged_parquet_is_one_line_naming_it(tmp_path, damage):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": doc} for doc in make_docs(200)]), path)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "not parquet":
        path.write_bytes(b"id,text\n1,hello\n")
    else:  # the footer is intact, the compressed data is not
        path.write_bytes(data[:100] + bytes(b ^ 0x55 for b in data[100:2000]) + data[2000:])
    result = run_main("fineweb.py", "--files", path, "--out-dir", tmp_path / "out", "--workers", "1")
    assert result.returncode == 2
    line = error_line(result)
    assert line.startswith(f"error: {path} is not a readable Parquet file (")
    assert line.endswith("); re-create it or leave it out of --files")
    assert not (tmp_path / "out").exists()


def interrupted_copy(tmp_path, args):
    """Run to completion in full/, then leave in cut/ what a run killed after shard 0 leaves."""
    assert fineweb.main(args + ["--out-dir", str(tmp_path / "full")]) == 0
    manifest = json.loads((tmp_path / "full" / "manifest.json").read_text())
    cut = tmp_path / "cut"
    cut.mkdir()
    first = manifest["shards"][0]["file"]
    (cut / first).write_bytes((tmp_path / "full" / first).read_bytes())
    (cut / "manifest.json").write_text(json.dumps({**manifest, "complete": False, "shards": manifest["shards"][:1]}))
    return cut


@pytest.mark.parametrize("change", ["edited in place, same size", "touched", "new file", "file gone"])
def test_changed_input_is_not_resumed(tmp_path, change):
    (tmp_path / "in").mkdir()
    a = write_jsonl(tmp_path / "in" / "a.jsonl", [{"text": doc} for doc in make_docs(30, seed=6)])
    b = write_jsonl(tmp_path / "in" / "b.jsonl", [{"text": doc} for doc in make_docs(30, seed=7)])
    args = ["--files", str(tmp_path / "in" / "*.jsonl"), "--shard-size", "2000", "--workers", "1"]
    cut = interrupted_copy(tmp_path, args)
    stat = b.stat()
    if change == "edited in place, same size":
        b.write_bytes(b.read_bytes().replace(b"fox", b"cat"))
        os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse clock may not show it
        what = f"{b} was modified (its size or modification time differs)"
    elif change == "touched":
        os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
        what = f"{b} was modified (its size or modification time differs)"
    elif change == "new file":
        new = write_jsonl(tmp_path / "in" / "c.jsonl", [{"text": "more"}])
        what = f"{new} is new"
    else:
        a.unlink()
        what = f"{a} is gone"
    message = (
        f"error: the --files input changed since {cut / 'manifest.json'} was written: {what}, so new "
        f"shards would not continue the old ones; restore it, or delete {cut} and start over"
    )
    for out in (cut, tmp_path / "full"):  # interrupted, and complete: neither is up to date
        before = sorted(p.name for p in out.iterdir())
        result = run_main("fineweb.py", *args, "--out-dir", out)
        assert (result.returncode, only_line(result)) == (2, message.replace(str(cut), str(out)))
        assert sorted(p.name for p in out.iterdir()) == before


@pytest.mark.parametrize(
    "prefix, split, other",
    [
        ("a_train_b", "val", "train"),
        ("x_train", "val", "train"),
        ("x_val", "train", "val"),
        ("my_val_set", "train", "val"),
    ],
)
def test_prefix_the_trainer_would_misread_is_refused(tmp_path, prefix, split, other):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    result = run_main("fineweb.py", "--files", path, "--out-dir", tmp_path / "out", "--prefix", prefix)
    assert (result.returncode, only_line(result)) == (
        2,
        (
            f"error: --prefix {prefix!r} would name {split} shards {prefix}_{split}_NNNNNN, which train_gpt2.py "
            f"would read as {other} shards too (*_{other}_*); choose a prefix without '_train' or '_val'"
        ),
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prefix", "sub/x"], "--prefix 'sub/x' is the start of a file name, not a path"),
        (["--val-shards", "-1"], "argument --val-shards: must be in 0..2**62, got -1 (see fineweb.py --help)"),
        (
            ["--format", "bin", "--shard-size", "3G"],
            "--format bin stores the token count as int32: use --shard-size below 2G",
        ),
        (["--dataset", "x/y"], "--files reads local files; leave out --dataset, --name and --split"),
    ],
)
def test_bad_flags_are_one_line(tmp_path, flags, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    result = run_main("fineweb.py", "--files", path, "--out-dir", tmp_path / "out", *flags)
    assert (result.returncode, result.stderr) == (2, f"error: {message}\n")


def test_out_dir_that_is_a_file_or_holds_the_input(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    result = run_main("fineweb.py", "--files", path, "--out-dir", path)
    assert (result.returncode, result.stderr) == (2, f"error: --out-dir '{path}' is not a folder\n")
    result = run_main("fineweb.py", "--files", tmp_path / "*.jsonl", "--out-dir", tmp_path)
    assert (result.returncode, result.stderr) == (
        2,
        f"error: --files matches {path}, inside --out-dir {tmp_path}: the output would be read as input\n",
    )


def test_manifest_that_is_not_ours(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    (tmp_path / "out").mkdir()
    for text, reason in (
        (b"[]", " (it holds a list, not an object)"),
        (b'{"config": {}}', " (no field complete)"),
        (b"\xff\xfe binary", " (not UTF-8 text (byte 0xff), so not JSON)"),
    ):
        (tmp_path / "out" / "manifest.json").write_bytes(text)
        result = run_main("fineweb.py", "--files", path, "--out-dir", tmp_path / "out")
        assert (result.returncode, result.stderr) == (
            2,
            f"error: {tmp_path / 'out' / 'manifest.json'} is not a manifest written by fineweb.py{reason}; "
            "use an empty --out-dir\n",
        )


@pytest.mark.parametrize("file", ["data_val_000000.npy", "manifest.json"])
def test_disk_full_names_the_file_and_keeps_what_was_written(tmp_path, file, monkeypatch):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in make_docs(10)])
    out = tmp_path / "out"
    out.mkdir()
    create_fresh = fileio.create_fresh

    def full_disk_for_file(tmp, dir_fd=None):  # the temporary file of `file` on a full disk: every write, ENOSPC
        fd = create_fresh(tmp, dir_fd)
        if os.path.basename(tmp) == f"{file}.tmp":  # (named in the folder held: dir_fd)
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, fd)
            os.close(full)
        return fd

    monkeypatch.setattr(fileio, "create_fresh", full_disk_for_file)
    result = run_main("fineweb.py", "--files", path, "--out-dir", out, "--workers", "1")
    assert error_line(result) == (
        f"error: cannot write {out / file}: no space left on device; the shards "
        "that manifest.json lists are complete: fix this and run the same command "
        "again to resume"
    )
    assert not os.path.lexists(out / f"{file}.tmp")
    assert list(out.iterdir()) == []  # no shard that the manifest does not list


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_input_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    os.chmod(path, 0)
    result = run_main("fineweb.py", "--files", path, "--out-dir", tmp_path / "out", "--workers", "1")
    assert (result.returncode, only_line(result)) == (2, f"error: cannot read {path}: permission denied")


def test_all_val_shards_is_said(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in make_docs(10)])
    result = run_main(
        "fineweb.py", "--files", path, "--out-dir", tmp_path / "out", "--val-shards", "3", "--shard-size", "1M"
    )
    assert result.returncode == 0
    tokens = reference_tokens(make_docs(10)).size
    assert result.stdout == f"wrote 1 shard, {tokens:,} tokens, 10 documents to {tmp_path / 'out'}\n"
    assert result.stderr.splitlines()[-1] == (
        "fineweb.py: warning: the only shard is a val shard (--val-shards 3), so train_gpt2.py finds no train shards "
        f"here: run again into an empty --out-dir with --shard-size {tokens // 10} (a tenth of the tokens)"
    )


# --- the GPT-2 BPE shipped in bpe/ ----------------------------------------------------------------

UNICODE_SAMPLES = [
    "naïve café — 日本語のテキスト 🙂👍🏽 ﷽",
    "x = {'a': 1}\r\n\tif x:\n        return None  ",
    "  leading and trailing   ",
    "'s 've 're 'll 'd 'm 't",
    "Ünïcödé İ ß ǅ Ω ℵ 𝔘𝔫𝔦",
    "\u200b\u00a0\u3000",
    "12,345.67e-8 0x1F",
    "",
    "a<|endoftext|>b<|endoftext|>",
]


def test_shipped_bpe_tokenizes_exactly_as_tiktoken():
    shipped = tokenizer.shipped_encoding()
    assert Path(tokenizer.SHIPPED_BPE) == Path(FINEWEB).parent / "bpe" / "r50k_base.tiktoken"
    assert (shipped.name, shipped.n_vocab, shipped.eot_token, shipped.max_token_value) == ("r50k_base", 50257, EOT, EOT)
    assert shipped._mergeable_ranks == ENC._mergeable_ranks and shipped._pat_str == ENC._pat_str
    assert shipped._special_tokens == ENC._special_tokens == {"<|endoftext|>": EOT}

    text = TEXT_FILE.read_text(encoding="utf-8")
    tokens = shipped.encode_ordinary(text)
    assert len(tokens) == 31_195 and tokens == ENC.encode_ordinary(text) and shipped.decode(tokens) == text
    for sample in UNICODE_SAMPLES:
        assert shipped.encode_ordinary(sample) == ENC.encode_ordinary(sample), sample
        assert shipped.encode(sample, allowed_special="all") == ENC.encode(sample, allowed_special="all"), sample
        assert shipped.decode(shipped.encode_ordinary(sample)) == sample
    # <|endoftext|>: the special id when allowed, ordinary text otherwise, refused by default
    assert shipped.encode("a<|endoftext|>b", allowed_special={"<|endoftext|>"}) == [64, EOT, 65]
    assert (
        shipped.encode_ordinary("<|endoftext|>")
        == ENC.encode_ordinary("<|endoftext|>")
        == [27, 91, 437, 1659, 5239, 91, 29]
    )
    with pytest.raises(ValueError, match="disallowed special token"):
        shipped.encode("<|endoftext|>")


def offline_env(tmp_path):
    """A machine without internet that has never cached the BPE: no TIKTOKEN_CACHE_DIR, an empty
    home, XDG cache and temporary folder (tiktoken's default cache is TMPDIR/data-gym-cache), and
    proxies that refuse every connection."""
    env = dict(TIKTOKEN_CACHE_DIR=None, DATA_GYM_CACHE_DIR=None)  # (run_command's with_env unsets them)
    for name in ("home", "cache", "tmp"):
        (tmp_path / name).mkdir(parents=True)
    dead = "http://127.0.0.1:9"
    env.update(
        HOME=str(tmp_path / "home"),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        TMPDIR=str(tmp_path / "tmp"),
        HTTPS_PROXY=dead,
        HTTP_PROXY=dead,
        https_proxy=dead,
        http_proxy=dead,
    )
    return env


def test_offline_without_tiktoken_cache_dir_uses_the_shipped_bpe(tmp_path):
    env = offline_env(tmp_path)
    docs = ["hello world", "naïve café 🙂", "text that quotes <|endoftext|>"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in docs])
    result = run_command(FINEWEB, "--files", path, "--out-dir", tmp_path / "out", "--workers", "2", env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    _, arrays = load_shards(tmp_path / "out")
    assert np.array_equal(np.concatenate(arrays), reference_tokens(docs))

    round_trip = (
        "from trainkit.data import tokenizer; enc = tokenizer.get_encoding(); tokens = enc.encode('naïve <|endoftext|> 🙂', "
        "allowed_special={'<|endoftext|>'}); print(tokens, enc.decode(tokens) == 'naïve <|endoftext|> 🙂')"
    )
    (tmp_path / "empty").mkdir()
    for cache in ({}, {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty")}):  # unset, or set to a folder without it
        result = run_command(
            "-c",
            round_trip,
            env={**env, **cache},
            cwd=Path(FINEWEB).parent,
            timeout=60,
        )
        assert (result.stdout, result.stderr) == (
            f"{ENC.encode('naïve <|endoftext|> 🙂', allowed_special='all')} True\n",
            "",
        )
    assert list((tmp_path / "empty").iterdir()) == []
    assert [p for name in ("home", "cache", "tmp") for p in (tmp_path / name).rglob("*")] == []  # nothing cached


def copy_of_fineweb(tmp_path, bpe: bytes | None):
    """fineweb.py and trainkit/ in a folder of their own, with bpe/r50k_base.tiktoken holding bpe (None: no file)."""
    folder = tmp_path / "repo"
    (folder / "bpe").mkdir(parents=True)
    library = Path(FINEWEB).parent / "trainkit"
    for name in ("fineweb.py", *(f"trainkit/{p.relative_to(library).as_posix()}" for p in library.rglob("*.py"))):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes((Path(FINEWEB).parent / name).read_bytes())
    if bpe is not None:
        (folder / "bpe" / "r50k_base.tiktoken").write_bytes(bpe)
    return folder


@pytest.mark.parametrize("damage", ["one rank changed", "cut short"])
def test_damaged_shipped_bpe_is_one_line(tmp_path, damage):
    data = Path(tokenizer.SHIPPED_BPE).read_bytes()
    bad = data.replace(b" 1000\n", b" 1001\n") if damage == "one rank changed" else data[:-100]
    folder = copy_of_fineweb(tmp_path, bad)
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    result = run_command(
        folder / "fineweb.py",
        "--files",
        path,
        "--out-dir",
        tmp_path / "out",
        env=offline_env(tmp_path),
        timeout=60,
    )
    shipped = (folder / "bpe" / "r50k_base.tiktoken").resolve()
    digest = hashlib.sha256(bad).hexdigest()
    assert (result.returncode, result.stderr) == (
        2,
        (
            f"error: could not load the GPT-2 tokenizer: {shipped} is damaged (sha256 {digest[:16]}..., expected "
            "306cd27f03c1a714...); restore it (git checkout -- bpe), or set TIKTOKEN_CACHE_DIR to a folder that "
            "holds tiktoken's cached r50k_base file\n"
        ),
    )
    assert not (tmp_path / "out").exists()

    # a tiktoken cache still comes first
    cached = run_command(
        folder / "fineweb.py",
        "--files",
        path,
        "--out-dir",
        tmp_path / "out",
        timeout=60,
        env={**offline_env(tmp_path / "2"), "TIKTOKEN_CACHE_DIR": tiktoken_cache(tmp_path / "cache")},
    )
    assert cached.returncode == 0, cached.stderr


def test_missing_shipped_bpe_offline_is_one_line(tmp_path):
    folder = copy_of_fineweb(tmp_path, None)
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    result = run_command(
        folder / "fineweb.py",
        "--files",
        path,
        "--out-dir",
        tmp_path / "out",
        env=offline_env(tmp_path),
        timeout=60,
    )
    assert result.returncode == 2
    line = only_line(result)
    assert line.startswith(
        f"error: could not load the GPT-2 tokenizer: {(folder / 'bpe').resolve()}/r50k_base.tiktoken "
        "is missing and tiktoken could not fetch 'r50k_base' ("
    )
    assert line.endswith(
        "); restore the file (git checkout -- bpe), or set TIKTOKEN_CACHE_DIR to a folder that holds "
        "tiktoken's cached r50k_base file"
    )
    assert not (tmp_path / "out").exists()


def test_shard_files_tell_contents_apart(tmp_path):
    """The ranks' start-up check and a resume compare shards by content: the sha256 fineweb.py's
    manifest records and a sampled sha256 (the whole file when it is small), not only names and sizes."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in make_docs()])
    assert (
        fineweb.main(["--files", str(path), "--out-dir", str(tmp_path / "a"), "--shard-size", "4000", "--workers", "1"])
        == 0
    )
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    paths = [str(tmp_path / "a" / shard["file"]) for shard in manifest["shards"]]
    a = shard_files(paths)
    whole = [
        hashlib.sha256(b"%d" % shard["bytes"] + open(p, "rb").read()).hexdigest()  # small files: all of it
        for shard, p in zip(manifest["shards"], paths)
    ]
    assert a == [
        (shard["file"], shard["bytes"], digest, shard["sha256"]) for shard, digest in zip(manifest["shards"], whole)
    ]
    (tmp_path / "b").mkdir()  # the same shards without the manifest, then one with other tokens of its size
    copies = [str(tmp_path / "b" / os.path.basename(p)) for p in paths]
    for p, copy in zip(paths, copies):
        np.save(copy, np.load(p))
    b = shard_files(copies)
    assert [entry[:3] for entry in b] == [entry[:3] for entry in a] and {entry[3] for entry in b} == {None}
    assert differing_file(a, b) is None
    name, n = a[1][0], a[1][1]
    np.save(copies[1], (np.load(copies[1]) + 1) % 50257)
    b = shard_files(copies)
    assert differing_file(a, b) == (
        name,
        f"{n} bytes of sampled content {a[1][2][:12]}",
        f"{n} bytes of sampled content {b[1][2][:12]}",
    )
    b[1] = (*b[1][:3], "f" * 64)  # both manifests list it: theirs is the sha256 compared first
    assert differing_file(a, b) == (
        name,
        f"{n} bytes of sha256 {a[1][3][:12]}",
        f"{n} bytes of sha256 ffffffffffff",
    )
    assert differing_file(a, b[:1] + b[2:]) == (name, f"{n} bytes", "missing")
    old = [(entry[0], entry[1]) for entry in a]  # a checkpoint written before contents were recorded
    assert differing_file(old, b) is None and differing_file(b, old) is None
    assert differing_file(old, [(name, n - 2)]) == (name, f"{n} bytes", f"{n - 2} bytes")  # sorted: train first


def test_sampled_sha256_of_a_large_shard_reads_its_slices(tmp_path):
    """Above 16 x 64 KiB only the slices count: the header and the last byte do, a byte between two
    slices does not (what a content change of a whole corpus cannot avoid, a single edit may)."""
    path = tmp_path / "big.npy"
    np.save(path, np.zeros(2_000_000, dtype=np.uint16))
    size = path.stat().st_size
    digests = {"as written": sampled_sha256(str(path), size)}
    stride = (size - SAMPLE_BYTES) // (SAMPLES - 1)
    for what, offset in [("first byte", 0), ("last byte", size - 1), ("between slices", SAMPLE_BYTES + 10)]:
        data = bytearray(path.read_bytes())
        data[offset] ^= 1
        (tmp_path / what).write_bytes(bytes(data))
        digests[what] = sampled_sha256(str(tmp_path / what), size)
    assert stride > SAMPLE_BYTES + 10  # that byte is in no slice
    assert len({digests["as written"], digests["first byte"], digests["last byte"]}) == 3
    assert digests["between slices"] == digests["as written"]


def test_a_damaged_file_in_tiktoken_cache_dir_is_kept_and_noted(tmp_path):
    cache = tmp_path / "tiktoken_cache"
    cache.mkdir()
    damaged = cache / hashlib.sha1(tokenizer.BPE_URL.encode()).hexdigest()
    damaged.write_bytes(Path(tokenizer.SHIPPED_BPE).read_bytes()[:-100])
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello world"}])
    result = run_command(
        FINEWEB,
        "--files",
        path,
        "--out-dir",
        tmp_path / "out",
        timeout=60,
        env={**offline_env(tmp_path / "offline"), "TIKTOKEN_CACHE_DIR": str(cache)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(
        f"note: the GPT-2 tokenizer file {damaged} in TIKTOKEN_CACHE_DIR is damaged (another sha256); using "
        f"{tokenizer.SHIPPED_BPE} instead (delete the damaged file to silence this)\n"
    )
    assert result.stderr.count("note:") == 1
    assert damaged.read_bytes() == Path(tokenizer.SHIPPED_BPE).read_bytes()[:-100]  # not deleted by tiktoken
    _, arrays = load_shards(tmp_path / "out")
    assert np.array_equal(np.concatenate(arrays), reference_tokens(["hello world"]))


def test_files_that_is_a_folder_says_so(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"text": "hello world"}])
    result = run_main("fineweb.py", "--files", tmp_path, "--out-dir", tmp_path / "out")
    assert (result.returncode, result.stderr) == (
        2,
        (
            f"error: --files '{tmp_path}' is a folder: --files takes files or globs, e.g. '{tmp_path}/*.jsonl' (or "
            "'**/*.jsonl' inside it for its subfolders)\n"
        ),
    )
    assert os.listdir(tmp_path) == ["d.jsonl"]


def test_a_small_file_with_the_defaults_gets_a_val_and_a_train_shard_the_trainer_reads(tmp_path):
    """An input smaller than one default shard becomes two shards named data_*: its first tenth the val split, the
    rest train; a run killed between the two resumes byte-identical; and train_gpt2.py trains on the folder."""
    lines = [line for line in make_docs(120, seed=5, newlines=False) if line.strip()]  # one document per line
    (tmp_path / "notes.txt").write_text("\n".join(lines))
    expected = reference_tokens(lines)
    out = tmp_path / "mine"
    result = run_main("fineweb.py", "--files", tmp_path / "notes.txt", "--out-dir", out)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote 2 shards, {expected.size:,} tokens, {len(lines)} documents to {out}\n"
    assert "warning" not in result.stderr
    manifest, arrays = load_shards(out)
    assert [shard["file"] for shard in manifest["shards"]] == ["data_val_000000.npy", "data_train_000001.npy"]
    assert [a.size for a in arrays] == [round(expected.size / 10), expected.size - round(expected.size / 10)]
    assert np.array_equal(np.concatenate(arrays), expected)

    killed = tmp_path / "killed"  # parked once the train shard is in place, before the manifest records it
    args = ["--files", str(tmp_path / "notes.txt"), "--out-dir", str(killed)]
    process = subprocess.Popen([*fineweb_parked_after(1), *args], stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for((killed / "data_train_000001.npy").exists, process, what="the park after shard 1")
    finally:
        kill_group(process)
    assert len(json.loads((killed / "manifest.json").read_text())["shards"]) == 1
    resumed = run_main("fineweb.py", *args)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_output(killed, out)

    trained = run_main(
        "train_gpt2.py",
        *tiny_run_args(
            out, tmp_path / "run", "--val-steps", 1, n_layer=1, block_size=16, B=2, rows=2, steps=1, val_every=1
        ),
    )
    assert trained.returncode == 0, trained.stderr
    assert "step     1 | val loss" in trained.stdout


def test_a_prefix_the_trainer_would_not_find_is_refused(tmp_path):
    """A --prefix starting with '.' names hidden files, which the trainer's shard search skips: refused in one
    line before anything is written."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": doc} for doc in make_docs(10)])
    result = run_main("fineweb.py", "--files", path, "--out-dir", tmp_path / "out", "--prefix", ".hidden")
    assert (result.returncode, result.stdout) == (2, "")
    assert only_line(result) == (
        "error: --prefix '.hidden' starts with '.': train_gpt2.py would not find shards "
        "named like hidden files; choose a prefix without the leading dot"
    )
    assert not (tmp_path / "out").exists()
