"""fineweb.py: shards equal to tiktoken's own r50k_base encoding (read from a cache holding bpe/'s file), exact
resume, one-line errors, in-process through fineweb.main (run_main); as programs: a run killed (SIGKILL) with a
second run refused its locked folder, and a run stopped by SIGTERM (its import light and offline), both resumed."""

import argparse
import gzip
import hashlib
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import tiktoken

import fineweb
from conftest import REPO, TEXT_FILE, assert_refused, fineweb_parked_after, group_gone, kill_group
from conftest import run_main, start, tiktoken_cache, tiny_run_args, tree_hashes, wait_for
from trainkit import cli, fileio
from trainkit.data import documents, tokenizer
from trainkit.data.shards import SAMPLE_BYTES, SAMPLES, differing_file, sampled_sha256, shard_files

EOT = 50256
# tiktoken's own r50k_base (its split pattern, special token and sha256 check), not fineweb's loader
with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, TIKTOKEN_CACHE_DIR=tiktoken_cache(cache)):
    ENC = tiktoken.get_encoding("r50k_base")
WORDS = "the|quick|brown|fox|naïve|café|日本語|🙂|x = 1;|don't|it's|123|4.56|def f():|    return|\t|  |!!|über|—".split(
    "|"
)


def make_docs(count=60, seed=0, newlines=True):
    """Varied documents: unicode, code-like text, whitespace runs, every 15th long enough to span shards."""
    rng = random.Random(seed)
    words = WORDS + (["\n", "\n\n", "\r\n"] if newlines else [])
    return [
        " ".join(rng.choice(words) for _ in range(rng.choice([0, 3, 40, 200]) if i % 15 else 1500))
        for i in range(count)
    ]


def reference_tokens(docs):
    """What build-nanogpt's fineweb.py writes: [EOT] + encode_ordinary(doc), concatenated."""
    return np.array([t for doc in docs for t in [EOT, *ENC.encode_ordinary(doc)]], dtype=np.uint16)


def load_shards(out_dir):
    manifest = json.loads((Path(out_dir) / "manifest.json").read_text())
    return manifest, [np.load(Path(out_dir) / shard["file"]) for shard in manifest["shards"]]


def write_jsonl(path, docs, opener=open):
    """docs as rows {"text": doc} (a dict: the row itself)."""
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(doc if isinstance(doc, dict) else {"text": doc}) + "\n" for doc in docs)
    return path


def parquet_bytes(rows, **options) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), buffer := io.BytesIO(), **options)
    return buffer.getvalue()


def fw(*args, env=None):
    """`python fineweb.py args` in this process (run_main); the first argument split at spaces (a command line)."""
    return run_main("fineweb.py", *str(args[0]).split(" "), *args[1:], env=env)


def made(*args, **kwargs):
    result = fw(*args, **kwargs)
    assert result.returncode == 0, result.stderr
    return result


def refused_like(result, message) -> list:
    """result failed with exit code 2, no traceback, its last stderr line `error: message` ("…": any text): the
    lines before it."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    *before, line = result.stderr.splitlines()
    assert re.fullmatch(".*".join(map(re.escape, f"error: {message}".split("…"))), line), line
    return before


def check_output(out_dir, docs, shard_size, val_shards=1, prefix="data"):
    """Shards hold exactly the reference tokens; names, sizes, manifest and hashes are right."""
    manifest, arrays = load_shards(out_dir)
    assert np.array_equal(np.concatenate(arrays), reference_tokens(docs)) and arrays[0].dtype == np.uint16
    assert manifest["complete"] is True
    assert [a.size for a in arrays[:-1]] == [shard_size] * (len(arrays) - 1) and 0 < arrays[-1].size <= shard_size
    doc_ends = np.cumsum([1 + len(ENC.encode_ordinary(doc)) for doc in docs])  # where each document ends
    end = 0
    for index, (shard, tokens) in enumerate(zip(manifest["shards"], arrays)):
        split = "val" if index < val_shards else "train"
        data = (Path(out_dir) / shard["file"]).read_bytes()
        assert (shard["file"], shard["split"]) == (f"{prefix}_{split}_{index:06d}.npy", split)
        assert (shard["tokens"], shard["documents"]) == (tokens.size, int((tokens == EOT).sum()))
        assert (shard["sha256"], shard["bytes"]) == (hashlib.sha256(data).hexdigest(), len(data))
        assert shard["max_id"] == tokens.max()  # what the trainer's start-up check of token ids reads
        np.save(saved := io.BytesIO(), tokens)
        assert data == saved.getvalue()  # byte-identical to np.save's
        end += tokens.size
        done = int(np.searchsorted(doc_ends, end, side="right"))
        assert shard["documents_done"] == done
        assert shard["next_document_tokens_done"] == end - (doc_ends[done - 1] if done else 0)
    return manifest, arrays


def interrupted_copy(full, cut):
    """In cut, what a run of full's killed after its first shard leaves: that shard, a manifest listing it."""
    manifest = json.loads((full / "manifest.json").read_text())
    cut.mkdir()
    (cut / manifest["shards"][0]["file"]).write_bytes((full / manifest["shards"][0]["file"]).read_bytes())
    (cut / "manifest.json").write_text(json.dumps({**manifest, "complete": False, "shards": manifest["shards"][:1]}))
    return manifest


@pytest.fixture
def small_chunks(monkeypatch):
    # many worker tasks even for tiny inputs, so ordering and in-flight limits are exercised
    monkeypatch.setattr(fineweb, "CHUNK_CHARS", 2000)


# --- tokenization ----------------------------------------------------------------------------
def test_a_token_id_beyond_uint16_is_refused():
    wide = types.SimpleNamespace(encode_to_numpy=lambda text, allowed_special: np.array([EOT, 70000], np.uint32))
    with pytest.raises(cli.UserError, match="70000 does not fit in uint16"):
        tokenizer.encode_documents(wide, ["x"])


def test_tokenize_in_order_keeps_a_bounded_number_of_tasks_in_flight():
    pulled = []
    chunks = (pulled.append(i) or ([f"document {i}"], [f"where {i}"]) for i in range(100))  # (pulled: i asked for)
    with documents.worker_pool(2) as pool:
        results = documents.tokenize_in_order(chunks, pool, max_in_flight=4)
        first = next(results)
        assert len(pulled) == 4
        rest = list(results)
    assert np.array_equal(np.concatenate([first] + rest), reference_tokens([f"document {i}" for i in range(100)]))


SIZES = {  # the accepted, then the refused with their messages
    **{"20M": 20_000_000, "1e8": 10**8, "100000": 100_000, "1.5K": 1500, "0.1k": 100, "2_000": 2000, "10B": 10**10},
    "abc": "not a size: 'abc' (examples: 20M, 1e8, 100000)",
    "M": "not a size: 'M' (examples: 20M, 1e8, 100000)",
    "1.5": "not a whole number: '1.5'",
    "inf": "not a whole number: 'inf'",
    "nan": "not a whole number: 'nan'",
    "0": "must be in 1..2**62, got 0",
    "-3M": "must be in 1..2**62, got -3000000",
    "1e19": f"must be in 1..2**62, got {10**19}",
}


@pytest.mark.parametrize("text", SIZES)
def test_parse_size(text):
    if isinstance(SIZES[text], int):
        assert fineweb.parse_size(text) == SIZES[text]
        return
    with pytest.raises(argparse.ArgumentTypeError) as e:
        fineweb.parse_size(text)
    assert str(e.value) == SIZES[text]


# --- sources and shards ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["jsonl", "json.gz", "parquet"])
def test_rows_to_shards(tmp_path, small_chunks, kind):
    docs = make_docs() + ["text that quotes <|endoftext|> stays text", "last"]
    rows = [{"id": i, "text": doc} for i, doc in enumerate(docs)]
    path = tmp_path / f"docs.{kind}"
    if kind == "parquet":
        path.write_bytes(parquet_bytes(rows, row_group_size=7))
    else:
        write_jsonl(path, rows, gzip.open if kind.endswith(".gz") else open)
    made("--files", path, "--out-dir", tmp_path / "out", "--shard-size", "3000", "--workers", "2")
    check_output(tmp_path / "out", docs, 3000)


def test_text_lines_and_files_to_shards(tmp_path, small_chunks):
    lines = make_docs(40, seed=1, newlines=False)
    (tmp_path / "a.txt").write_bytes("\r\n".join(lines[:20]).encode() + b"\r\n\n  \n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("\n".join(lines[20:]), encoding="utf-8")
    out = tmp_path / "lines"
    made(f"--files {tmp_path}/**/*.txt --out-dir {out} --shard-size 2K --val-shards 2 --prefix t")
    check_output(out, [line for line in lines if line.strip()], 2000, val_shards=2, prefix="t")
    files = {"x.py": "def f():\r\n    return 1\n", "y.md": "# Title\n\nbody\n", "z.txt": ""}
    for name, text in files.items():
        (tmp_path / name).write_bytes(text.encode())
    out = tmp_path / "per_file"
    made(f"--files {tmp_path}/*.py {tmp_path}/*.[mt][dx]* --doc-per-file --out-dir {out} --shard-size 300 --workers 1")
    # x.py first (first pattern), then a.txt, y.md, z.txt (second pattern, sorted)
    check_output(out, [files["x.py"], (tmp_path / "a.txt").read_bytes().decode(), files["y.md"], files["z.txt"]], 300)


def test_max_tokens_cuts_exactly_and_bin_format(tmp_path, small_chunks):
    docs = make_docs()
    path, out = write_jsonl(tmp_path / "d.jsonl", docs), tmp_path / "bin"
    made(f"--files {path} --out-dir {out} --shard-size 4000 --max-tokens 10.5K --format bin --workers 2")
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == [f"data_{'train' if i else 'val'}_{i:06d}.bin" for i in range(3)]
    tokens = []
    for shard in manifest["shards"]:
        data = (out / shard["file"]).read_bytes()
        header = np.frombuffer(data[:1024], dtype="<i4")
        assert list(header[:3]) == [20240520, 1, shard["tokens"]] and not header[3:].any()
        assert shard["sha256"] == hashlib.sha256(data).hexdigest()
        tokens.append(np.frombuffer(data[1024:], dtype="<u2"))
    assert [t.size for t in tokens] == [4000, 4000, 2500]
    assert np.array_equal(np.concatenate(tokens), reference_tokens(docs)[:10500])


def test_a_small_file_with_the_defaults_gets_a_val_and_a_train_shard_stopped_and_resumed(tmp_path):
    """Its first tenth the val shard; SIGTERM between the shards: one line, exit 130. That process, offline and never
    having cached the BPE, first shows `import fineweb` light and silent and bpe/'s tokenizer round-tripping."""
    lines = [line for line in make_docs(120, seed=5, newlines=False) if line.strip()]  # one document per line
    (tmp_path / "notes.txt").write_text("\n".join(lines))
    expected, out = reference_tokens(lines), tmp_path / "mine"
    result = made("--files", tmp_path / "notes.txt", "--out-dir", out)
    assert result.stdout == f"wrote 2 shards, {expected.size:,} tokens, {len(lines)} documents to {out}\n"
    assert "warning" not in result.stderr
    manifest, arrays = load_shards(out)
    assert [shard["file"] for shard in manifest["shards"]] == ["data_val_000000.npy", "data_train_000001.npy"]
    assert [a.size for a in arrays] == [round(expected.size / 10), expected.size - round(expected.size / 10)]
    assert np.array_equal(np.concatenate(arrays), expected)
    stopped, round_trip = tmp_path / "stopped", "naïve <|endoftext|> 🙂"  # stopped: parked after the train shard
    args = ["--files", str(tmp_path / "notes.txt"), "--out-dir", str(stopped)]
    python, _, parked = fineweb_parked_after(1)
    imported = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); import fineweb; from trainkit.data import tokenizer\n"
        "heavy = {'torch', 'datasets', 'pyarrow', 'tqdm'} & set(sys.modules); enc = tokenizer.get_encoding()\n"
        f"tokens = enc.encode({round_trip!r}, allowed_special={{'<|endoftext|>'}})\n"
        f"print(sorted(heavy), fineweb.EOT, enc.name, tokens, enc.decode(tokens) == {round_trip!r}, flush=True)\n"
    )
    with open(tmp_path / "stdout.txt", "w") as stdout, open(tmp_path / "stderr.txt", "w") as stderr:
        streams = dict(stdout=stdout, stderr=stderr, start_new_session=True)
        process = start([python, "-c", imported + parked, *args], env=offline_env(tmp_path), **streams)
    try:
        wait_for((stopped / "data_train_000001.npy").exists, process, what="the park after shard 1")
        process.send_signal(signal.SIGTERM)  # the main process only
        assert process.wait(timeout=120) == 130
    finally:
        kill_group(process)  # (its workers too, whatever happened above)
    tokens = ENC.encode(round_trip, allowed_special="all")
    assert (tmp_path / "stdout.txt").read_text() == f"[] 50256 r50k_base {tokens} True\n"
    said = (tmp_path / "stderr.txt").read_text()
    assert "fineweb.py: interrupted; run the same command again to resume" in said and "Traceback" not in said
    assert len(json.loads((stopped / "manifest.json").read_text())["shards"]) == 1 and nothing_cached(tmp_path)
    made(*args)
    assert tree_hashes(stopped) == tree_hashes(out)
    run = tiny_run_args(out, tmp_path / "run", "--val-steps", 1, n_layer=1, block_size=16, B=2, rows=2, steps=1)
    trained = run_main("train_gpt2.py", *run, "--val-every", 1)
    assert trained.returncode == 0, trained.stderr
    assert "step     1 | val loss" in trained.stdout
    result = made("--files", tmp_path / "notes.txt", "--out-dir", (all_val := tmp_path / "all_val"), "--val-shards", 3)
    assert result.stdout == f"wrote 1 shard, {expected.size:,} tokens, {len(lines)} documents to {all_val}\n"
    assert result.stderr.splitlines()[-1] == (
        "fineweb.py: warning: the only shard is a val shard (--val-shards 3), so train_gpt2.py finds no train shards "
        f"here: run again into an empty --out-dir with --shard-size {expected.size // 10} (a tenth of the tokens)"
    )


# --- resume ----------------------------------------------------------------------------------
def test_a_killed_run_blocks_nothing_and_resumes_byte_identical(tmp_path):
    """Parked after writing shard 2, before the manifest lists it: a second run is refused, touching nothing; once
    SIGKILLed, the trainer refuses the folder, the command resumes it, then does nothing; other arguments: refused."""
    docs, reference_out = make_docs(90, seed=2), tmp_path / "uninterrupted"
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    made("--files", path, "--out-dir", reference_out, "--shard-size", "2500", "--workers", "2")
    other, out = write_jsonl(tmp_path / "other.jsonl", make_docs(40, seed=5)), tmp_path / "killed"
    args = ["--files", str(path), "--out-dir", str(out), "--shard-size", "2500", "--workers", "2"]
    first = subprocess.Popen([*fineweb_parked_after(2), *args], stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for((out / "data_train_000002.npy").exists, first, what="the park after shard 2")
        before = tree_hashes(out)
        locked = f"--out-dir {out} is being written by another process (pid {first.pid} on {socket.gethostname()}; it "
        locked += "holds a lock on the folder): wait for it to end, or choose another --out-dir"
        for second in (["--files", str(other), "--out-dir", str(out), "--max-tokens", "1M"], args):
            assert_refused(fw(*second), locked)
            assert tree_hashes(out) == before
        os.kill(first.pid, signal.SIGKILL)  # the main process: its workers end once their task pipe closes
        assert first.wait(timeout=120) == -signal.SIGKILL
        group_gone(first.pid)
    finally:
        kill_group(first)  # (by now its workers may have ended, and the group with them)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and len(manifest["shards"]) == 2
    assert_refused(
        run_main("train_gpt2.py", "--model", "cpu", "--data-dir", out, "--out-dir", tmp_path / "run"),
        f"{out} holds an unfinished fineweb.py run (2 shards written, manifest.json says complete: false); "
        "finish it by running fineweb.py again as it was run",
    )
    assert not (tmp_path / "run").exists()
    assert manifest["shards"][-1]["next_document_tokens_done"] > 0  # a split document: the written prefix is dropped
    result = made(*args)
    skipped = manifest["shards"][-1]["documents_done"]
    assert f"resuming after 2 shards, 5,000 tokens (skipping the first {skipped} documents)" in result.stderr
    assert tree_hashes(out) == tree_hashes(reference_out)
    stamps, total = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}, reference_tokens(docs).size
    complete = f"{out} is already complete ({-(-total // 2500)} shards, {total:,} tokens); nothing to do\n"
    assert made(*args).stdout == complete
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    changed = f"{out / 'manifest.json'} was written with other arguments (shard_size 2500 -> 3000); rerun with the "
    changed += "same arguments to resume, or use another --out-dir"
    assert_refused(fw(*args[:-4], "--shard-size", "3000"), changed)


def test_hub_resume_at_a_document_boundary_reads_the_commit_it_started_with(tmp_path, monkeypatch, small_chunks):
    docs, read_at, out, cut = make_docs(40, seed=4), [], tmp_path / "full", tmp_path / "cut"

    def load_dataset(dataset, name, split, revision, streaming):
        assert (dataset, name, split, streaming) == ("me/corpus", None, "train", True)
        read_at.append(revision)
        return iter([{"text": doc} for doc in docs] if revision == "commit-1" else [{"text": "new"}])

    monkeypatch.setitem(sys.modules, "datasets", type(sys)("datasets"))
    monkeypatch.setattr(sys.modules["datasets"], "load_dataset", load_dataset, raising=False)
    monkeypatch.setattr(fineweb, "hub_revision", lambda dataset: "commit-1")
    shard_size = sum(1 + len(ENC.encode_ordinary(doc)) for doc in docs[:7])  # shard 0 ends where document 7 starts
    args = ["--dataset", "me/corpus", "--shard-size", shard_size, "--workers", "2"]
    made(*args, "--out-dir", out)
    assert check_output(out, docs, shard_size, prefix="corpus")[0]["hub_revision"] == "commit-1"  # (its name: prefix)
    manifest = interrupted_copy(out, cut)
    assert (manifest["shards"][0]["documents_done"], manifest["shards"][0]["next_document_tokens_done"]) == (7, 0)
    asked = []  # the dataset changed since; the resume must neither read nor need to ask the Hub
    monkeypatch.setattr(fineweb, "hub_revision", lambda dataset: asked.append(dataset) or "commit-2")
    first = cut / manifest["shards"][0]["file"]
    whole = first.read_bytes()
    first.write_bytes(whole[:-2])  # a shard cut short is refused, not resumed
    truncated = f"{first}, listed in {cut / 'manifest.json'}, is missing or truncated; delete the folder and start over"
    assert_refused(fw(*args, "--out-dir", cut), truncated)
    first.write_bytes(whole)
    made(*args, "--out-dir", cut)
    assert read_at == ["commit-1", "commit-1"] and asked == []
    assert tree_hashes(cut) == tree_hashes(out)


@pytest.mark.parametrize("change", ["edited in place, same size", "touched", "new file", "file gone"])
def test_changed_input_is_not_resumed(tmp_path, change):
    (tmp_path / "in").mkdir()
    a = write_jsonl(tmp_path / "in" / "a.jsonl", make_docs(30, seed=6))
    b = write_jsonl(tmp_path / "in" / "b.jsonl", make_docs(30, seed=7))
    args = ["--files", tmp_path / "in" / "*.jsonl", "--shard-size", "2000", "--workers", "1"]
    made(*args, "--out-dir", tmp_path / "full")
    interrupted_copy(tmp_path / "full", tmp_path / "cut")
    stat = b.stat()
    what = f"{b} was modified (its size or modification time differs)"
    if change == "edited in place, same size":
        b.write_bytes(b.read_bytes().replace(b"fox", b"cat"))
        os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse clock may not show it
    elif change == "touched":
        os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    elif change == "new file":
        what = f"{write_jsonl(tmp_path / 'in' / 'c.jsonl', ['more'])} is new"
    else:
        a.unlink()
        what = f"{a} is gone"
    for out in (tmp_path / "cut", tmp_path / "full"):  # interrupted, and complete: neither is up to date
        why = f"the --files input changed since {out / 'manifest.json'} was written: {what}, so new shards would not "
        why += f"continue the old ones; restore it, or delete {out} and start over"
        before = tree_hashes(out)
        assert_refused(fw(*args, "--out-dir", out), why)
        assert tree_hashes(out) == before


# --- errors: one line, no traceback, exit code 2, nothing written ----------------------------
def damaged_parquet(damage: str) -> bytes:
    data = parquet_bytes([{"text": doc} for doc in make_docs(200)])
    if damage == "truncated":
        return data[: len(data) // 2]
    if damage == "not-parquet":
        return b"id,text\n1,hello\n"
    return data[:100] + bytes(b ^ 0x55 for b in data[100:2000]) + data[2000:]  # the footer intact, the data not


JSONL = "".join(json.dumps({"text": doc}) + "\n" for doc in make_docs(40, seed=5)).encode()
GZ = gzip.compress(JSONL, mtime=0)
# the input files of the cases, by name (each case writes those its command names)
INPUTS = {
    "d.jsonl": lambda: b'{"text": "hello"}\n',
    "a.jsonl.gz": lambda: GZ,
    "blank.txt": lambda: b"\n   \n\n",
    "rows.jsonl": lambda: b'{"id": 1, "content": "hello"}\n',
    "rows.parquet": lambda: parquet_bytes([{"id": 1, "content": "hello"}]),
    "latin1.txt": lambda: "café au lait\n".encode("latin-1"),
    # a lone surrogate as web dumps hold one: JSON's escape without its pair
    "web.jsonl": lambda: b'{"text": "hello"}\n\n{"text": "abc \\ud800 def"}\n{"text": "after"}\n',
    "quotes.jsonl": lambda: b'{"text": "<|endoftext|> \\udfff"}\n',  # encoded alone: encode_ordinary would replace it
    "padded.txt": lambda: b"first line\na" + b" " * 1_000_000 + b"b\nlast line\n",
    "truncated.jsonl.gz": lambda: GZ[: len(GZ) // 2],
    "plain-text.jsonl.gz": lambda: JSONL,
    "flipped.jsonl.gz": lambda: GZ[:-8] + bytes([GZ[-8] ^ 1]) + GZ[-7:],  # (its CRC)
    **{f"{d}.parquet": lambda d=d: damaged_parquet(d) for d in ("truncated", "not-parquet", "damaged-page")},
}
SURROGATE = (
    "{t}/web.jsonl:3: the text holds a lone surrogate U+D800 (half of a UTF-16 pair, as JSON's \\ud800 without its "
    "other half), which is not Unicode and has no UTF-8 form; fix the input, or pass --utf8-errors replace to "
    "tokenize U+FFFD in its place"
)
TIKTOKEN_GIVES_UP = (  # tiktoken's regex gives up on ~1M characters of whitespace before a word (a ValueError; its
    # encode_ordinary panics instead, a BaseException that would have ended a worker)
    "{t}/padded.txt:2: tiktoken cannot tokenize this document (ValueError: Regex error while tokenizing: Error "
    "executing regex: Max stack size exceeded for backtracking); fix it or leave it out (--debug shows the traceback)"
)
MISREAD_AS_VAL = ["x_val train val", "my_val_set train val"]  # a prefix, the split it names, the split read
PREFIX_MISREAD = (
    "--prefix '{0}' would name {1} shards {0}_{1}_NNNNNN, which train_gpt2.py would read as {2} shards too "
    "(*_{2}_*); choose a prefix without '_train' or '_val'"
)
# bad input before any document is read, as "the command => its one stderr line": each command --out-dir
# {t}/new/out and --workers 1 unless it says otherwise
REFUSED = {
    "no matching files": "--files {t}/nothing*.jsonl => --files '{t}/nothing*.jsonl' matches no files",
    "no documents": "--files {t}/blank.txt => no documents in --files {t}/blank.txt (1 matched)",
    "no text field, jsonl": "--files {t}/rows.jsonl => {t}/rows.jsonl:1: no field 'text' (fields: id, content); "
    "choose one with --text-field",
    "no text field, parquet": "--files {t}/rows.parquet => {t}/rows.parquet: no field 'text' (fields: id, content); "
    "choose one with --text-field",
    "not UTF-8": "--files {t}/latin1.txt => {t}/latin1.txt is not valid UTF-8 (byte 0xe9 cannot be decoded); convert "
    "it to UTF-8, leave it out of --files, or pass --utf8-errors replace",
    "unreadable": "--files {t}/d.jsonl => cannot read {t}/d.jsonl: permission denied",
    "files a folder": "--files {t} => --files '{t}' is a folder: --files takes files or globs, e.g. '{t}/*.jsonl' "
    "(or '**/*.jsonl' inside it for its subfolders)",
    "a hidden prefix": "--files {t}/d.jsonl --prefix .hidden => --prefix '.hidden' starts with '.': train_gpt2.py "
    "would not find shards named like hidden files; choose a prefix without the leading dot",
    **{
        f"prefix {p}": f"--files {{t}}/d.jsonl --prefix {p} => " + PREFIX_MISREAD.format(p, named, read)
        for p, named, read in map(str.split, ["a_train_b val train", "x_train val train", *MISREAD_AS_VAL])
    },
    "prefix a path": "--files {t}/d.jsonl --prefix sub/x => --prefix 'sub/x' is the start of a file name, not a path",
    "val shards -1": "--files {t}/d.jsonl --val-shards -1 => argument --val-shards: must be in 0..2**62, got -1 (see "
    "fineweb.py --help)",
    "bin of 3G": "--files {t}/d.jsonl --format bin --shard-size 3G => --format bin stores the token count as int32: "
    "use --shard-size below 2G",
    "dataset and files": "--files {t}/d.jsonl --dataset x/y => --files reads local files; leave out --dataset, "
    "--name and --split",
    "out-dir a file": "--files {t}/d.jsonl --out-dir {t}/d.jsonl => --out-dir '{t}/d.jsonl' is not a folder",
    "out-dir holds the input": "--files {t}/*.jsonl --out-dir {t} => --files matches {t}/d.jsonl, inside --out-dir "
    "{t}: the output would be read as input",
    # out/manifest.json written with the bytes after manifest.json= (its schema: test_cache_and_manifest's table)
    "manifest not UTF-8": "--files {t}/d.jsonl --out-dir {t}/out manifest.json=\xff\xfe => {t}/out/manifest.json is "
    "not a manifest written by fineweb.py (not UTF-8 text (byte 0xff), so not JSON); use an empty --out-dir",
}
# bad input met after the progress bar starts: the folder made for the run is removed
MID_STREAM = {
    "lone surrogate, 1 worker": "--files {t}/web.jsonl => " + SURROGATE,
    "lone surrogate, 2 workers": "--files {t}/web.jsonl --workers 2 => " + SURROGATE,
    "lone surrogate quoting <|endoftext|>": "--files {t}/quotes.jsonl => {t}/quotes.jsonl:1: the text holds a lone "
    "surrogate U+DFFF (…",
    "tiktoken gives up, 1 worker": "--files {t}/padded.txt => " + TIKTOKEN_GIVES_UP,
    "tiktoken gives up, 2 workers": "--files {t}/padded.txt --workers 2 => " + TIKTOKEN_GIVES_UP,
    **{
        f"gzip {damage}": f"--files {{t}}/a.jsonl.gz {{t}}/{damage}.jsonl.gz => {{t}}/{damage}.jsonl.gz {reason}…"
        "re-create it or leave it out of --files"
        for damage, reason in [
            ("truncated", "is truncated (the gzip data ends early)"),
            ("plain-text", "is not valid gzip data (Not a gzipped file (b'{\"'))"),
            ("flipped", "is not valid gzip data (CRC check failed "),
        ]
    },
    **{
        f"parquet {damage}": f"--files {{t}}/{damage}.parquet => {{t}}/{damage}.parquet is not a readable Parquet "
        "file (…); re-create it or leave it out of --files"
        for damage in ("truncated", "not-parquet", "damaged-page")
    },
}

REPLACED = {
    "not UTF-8": ["caf\ufffd au lait"],
    "lone surrogate, 1 worker": ["hello", "abc \ufffd def", "after"],
    "lone surrogate, 2 workers": ["hello", "abc \ufffd def", "after"],  # across the worker pool
    "lone surrogate quoting <|endoftext|>": ["<|endoftext|> \ufffd"],
}


def files_of(folder) -> dict:
    """{path: (size, mtime)} of the files under folder, {path: None} of its folders (no file is read)."""
    return {p: None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).rglob("*")}


def case_args(tmp_path, command: str) -> list:
    """command's arguments in tmp_path ({t}), each input it names written there, and d.jsonl (a last argument
    manifest.json=text: out/manifest.json's bytes)."""
    args = command.split(" ")
    if args[-1].startswith("manifest.json="):
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "manifest.json").write_bytes(args.pop().split("=", 1)[1].encode("latin-1"))
    for name, data in INPUTS.items():
        if name == "d.jsonl" or "{t}/" + name in args:
            (tmp_path / name).write_bytes(data())
    args += [] if "--out-dir" in args else ["--out-dir", "{t}/new/out"]
    return [arg.replace("{t}", str(tmp_path)) for arg in args + ([] if "--workers" in args else ["--workers", "1"])]


@pytest.mark.parametrize("case", [*REFUSED, *MID_STREAM])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, case):
    command, message = (REFUSED.get(case) or MID_STREAM[case]).split(" => ")
    args = case_args(tmp_path, command)
    if case == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads any file")
        os.chmod(tmp_path / "d.jsonl", 0)
    before = files_of(tmp_path)
    result = fw(*args)
    progress = refused_like(result, message.replace("{t}", str(tmp_path)))  # the bar redraws itself after each \r
    assert case in MID_STREAM or progress == [], result.stderr
    assert all(bar.startswith("tokenizing: ") for bar in progress if bar), result.stderr
    assert files_of(tmp_path) == before
    if case in REPLACED:  # what --utf8-errors replace tokenizes instead
        made(*args, "--utf8-errors", "replace")
        tokens = np.concatenate(load_shards(tmp_path / "new" / "out")[1])
        assert np.array_equal(tokens, reference_tokens(REPLACED[case]))


def test_other_failures_in_a_worker_are_one_line_naming_the_document(monkeypatch):
    class PanicException(BaseException):  # as tiktoken's Rust panics arrive: not an Exception
        pass

    class Panicking:
        def encode_to_numpy(self, text, **kwargs):
            if "bad" in text:
                raise PanicException("called `Result::unwrap()` on an `Err` value\nnote: run with RUST_BACKTRACE=1")
            return np.array([1, 2], dtype=np.uint32)

    monkeypatch.setattr(documents, "_worker_encoding", Panicking())  # forked workers inherit it
    chunks = [(["ok"], ["x.jsonl:1"]), (["fine", "bad", "bad too"], ["x.jsonl:2", "x.jsonl:3", "x.jsonl:4"])]
    with documents.worker_pool(1) as pool:  # the panic used to end the worker
        results = documents.tokenize_in_order(iter(chunks), pool, max_in_flight=2)
        assert next(results).tolist() == [1, 2]
        with pytest.raises(cli.UserError) as raised:
            next(results)
    assert str(raised.value) == (
        "x.jsonl:3: tiktoken cannot tokenize this document (PanicException: called `Result::unwrap()` on an `Err` "
        "value); fix it or leave it out (--debug shows the traceback)"
    )
    assert "in encode_to_numpy" in str(raised.value.__cause__.__cause__)  # the worker's own traceback, for --debug
    monkeypatch.setattr(documents, "encode_documents", lambda enc, docs: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(documents.ChunkError) as raised:
        documents.tokenize_chunk(None, ["a" * 10, "b" * 30, "c"], "strict")
    assert str(raised.value.located(["d:1", "d:2", "d:3"])) == (
        "cannot tokenize the 3 documents from d:1 to d:3: not enough memory (the longest is 30 characters)"
    )


@pytest.mark.parametrize("file", ["data_val_000000.npy", "manifest.json"])
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_names_the_file_and_keeps_what_was_written(tmp_path, file, monkeypatch):
    path, out = write_jsonl(tmp_path / "d.jsonl", make_docs(10)), tmp_path / "out"
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
    full = f"cannot write {out / file}: no space left on device; the shards that manifest.json lists are complete: "
    full += "fix this and run the same command again to resume"
    refused_like(fw("--files", path, "--out-dir", out, "--workers", "1"), full)
    assert list(out.iterdir()) == []  # no temporary file, no shard that the manifest does not list


# --- the Hub, the GPT-2 BPE shipped in bpe/, the tokenizer cache -------------------------------
def offline_env(tmp_path, **more) -> dict:
    """A machine without internet that has never cached the BPE: no TIKTOKEN_CACHE_DIR, an empty home, XDG cache
    and temporary folder (tiktoken's default cache is TMPDIR/data-gym-cache), proxies that refuse every connection."""
    env = dict(TIKTOKEN_CACHE_DIR=None, DATA_GYM_CACHE_DIR=None)  # (with_env unsets them)
    for name, variable in (("home", "HOME"), ("cache", "XDG_CACHE_HOME"), ("tmp", "TMPDIR")):
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        env[variable] = str(tmp_path / name)
    return env | dict.fromkeys(["HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"], "http://127.0.0.1:9") | more


def nothing_cached(tmp_path):
    return [p for name in ("home", "cache", "tmp") for p in (tmp_path / name).rglob("*")] == []


@pytest.mark.parametrize("offline", ["dead proxy", "HF_HUB_OFFLINE"])
def test_hub_unreachable_fails_at_once_and_leaves_no_folder(tmp_path, monkeypatch, offline):
    """One probe without retries (the datasets client alone retried for ~25 s before its error). The Hub's client
    reads HF_HUB_OFFLINE at import and its proxies when made: both as a new process would have them."""
    import huggingface_hub

    env = {"HF_HOME": str(tmp_path / "hf"), "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    if offline == "HF_HUB_OFFLINE":
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    huggingface_hub.close_session()
    started = time.monotonic()
    try:
        result = fw("--max-tokens", "1000", "--out-dir", tmp_path / "new" / "out", env=env)
    finally:
        huggingface_hub.close_session()  # (made with the dead proxies)
    assert time.monotonic() - started < 15
    why = "--dataset HuggingFaceFW/fineweb-edu: cannot reach the Hugging Face Hub (…); offline, tokenize local files "
    assert not refused_like(result, why + "instead with --files 'dir/**/*.parquet'")
    assert not (tmp_path / "new").exists()


def test_shipped_bpe_tokenizes_exactly_as_tiktoken():
    shipped = tokenizer.shipped_encoding()
    assert Path(tokenizer.SHIPPED_BPE) == REPO / "bpe" / "r50k_base.tiktoken"
    assert (shipped.name, shipped.n_vocab, shipped.eot_token, shipped.max_token_value) == ("r50k_base", 50257, EOT, EOT)
    # the three things tiktoken builds an encoder from: equal, so it encodes and decodes every text as ENC does
    assert shipped._mergeable_ranks == ENC._mergeable_ranks and shipped._pat_str == ENC._pat_str
    assert shipped._special_tokens == ENC._special_tokens == {"<|endoftext|>": EOT}
    text = TEXT_FILE.read_text(encoding="utf-8")
    tokens = shipped.encode_ordinary(text)
    assert len(tokens) == 31_195 and tokens == ENC.encode_ordinary(text) and shipped.decode(tokens) == text
    # <|endoftext|>: the special id when allowed, ordinary text otherwise, refused by default
    assert shipped.encode("a<|endoftext|>b", allowed_special={"<|endoftext|>"}) == [64, EOT, 65]
    ordinary = shipped.encode_ordinary("<|endoftext|>")
    assert ordinary == ENC.encode_ordinary("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]
    with pytest.raises(ValueError, match="disallowed special token"):
        shipped.encode("<|endoftext|>")


@pytest.mark.parametrize(
    "shipped_bpe,cache",
    [("intact", c) for c in ("unset", "a folder without it", "a damaged file")]  # cache: TIKTOKEN_CACHE_DIR
    + [(f, c) for f in ("one rank changed", "cut short", "missing") for c in ("unset", "good")],
)
def test_offline_the_tokenizer_is_tiktoken_cache_dir_s_else_the_shipped_bpe_else_one_line(
    tmp_path, monkeypatch, request, shipped_bpe, cache
):
    """A damaged cached file is kept, with one note; nothing is cached. Loaded anew as in a new process: tiktoken's
    registry emptied, the temporary folder offline_env's (tiktoken's default cache), bpe/'s file at `shipped`."""
    data = Path(tokenizer.SHIPPED_BPE).read_bytes()
    bad = {"one rank changed": data.replace(b" 1000\n", b" 1001\n"), "cut short": data[:-100], "missing": None}
    shipped = tmp_path / "repo" / "bpe" / "r50k_base.tiktoken"
    shipped.parent.mkdir(parents=True)
    if shipped_bpe != "missing":
        shipped.write_bytes(bad.get(shipped_bpe, data))
    tokenizer.get_encoding.cache_clear()  # loaded anew here, and again by the tests after this one
    request.addfinalizer(tokenizer.get_encoding.cache_clear)
    monkeypatch.setattr(documents, "_worker_encoding", None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setattr(tokenizer, "SHIPPED_BPE", str(shipped))
    monkeypatch.setattr(tokenizer.shipped_encoding, "__defaults__", (str(shipped),))
    folder = tmp_path / "tiktoken_cache"
    damaged = folder / hashlib.sha1(tokenizer.BPE_URL.encode()).hexdigest()
    if cache != "unset":
        folder.mkdir()
    if cache in ("good", "a damaged file"):  # (named as tiktoken names its download: conftest's tiktoken_cache)
        damaged.write_bytes(data if cache == "good" else data[:-100])
    docs, out = ["hello world", "naïve café 🙂", "text that quotes <|endoftext|>"], tmp_path / "out"
    env = offline_env(tmp_path, **({} if cache == "unset" else {"TIKTOKEN_CACHE_DIR": str(folder)}))
    result = fw("--files", write_jsonl(tmp_path / "d.jsonl", docs), "--out-dir", out, "--workers", "2", env=env)
    if shipped_bpe != "intact" and cache == "unset":
        tail = ", or set TIKTOKEN_CACHE_DIR to a folder that holds tiktoken's cached r50k_base file"
        why = f"is missing and tiktoken could not fetch 'r50k_base' (…); restore the file (git checkout -- bpe){tail}"
        if shipped_bpe != "missing":
            sha = hashlib.sha256(bad[shipped_bpe]).hexdigest()[:16]
            why = f"is damaged (sha256 {sha}..., expected 306cd27f03c1a714...); restore it (git checkout -- bpe){tail}"
        assert not refused_like(result, f"could not load the GPT-2 tokenizer: {shipped} {why}")
        assert not out.exists() and nothing_cached(tmp_path)
        return
    assert result.returncode == 0, result.stderr
    assert np.array_equal(np.concatenate(load_shards(out)[1]), reference_tokens(docs)) and nothing_cached(tmp_path)
    if cache == "a damaged file":
        assert result.stderr.startswith(
            f"note: the GPT-2 tokenizer file {damaged} in TIKTOKEN_CACHE_DIR is damaged (another sha256); using "
            f"{tokenizer.SHIPPED_BPE} instead (delete the damaged file to silence this)\n"
        )
        assert result.stderr.count("note:") == 1 and damaged.read_bytes() == data[:-100]  # not deleted by tiktoken
    else:
        assert "note:" not in result.stderr and sorted(folder.glob("*")) == [damaged] * (cache == "good")


# --- telling shards apart ----------------------------------------------------------------------
def test_shard_files_tell_contents_apart(tmp_path):
    """The ranks' start-up check and a resume compare shards by content: the sha256 fineweb.py's
    manifest records and a sampled sha256 (the whole file when it is small), not only names and sizes."""
    made(f"--files {write_jsonl(tmp_path / 'd.jsonl', make_docs())} --out-dir {tmp_path}/a --shard-size 4K --workers 1")
    shards = json.loads((tmp_path / "a" / "manifest.json").read_text())["shards"]
    paths = [str(tmp_path / "a" / shard["file"]) for shard in shards]
    a = shard_files(paths)
    whole = [hashlib.sha256(b"%d" % s["bytes"] + Path(p).read_bytes()).hexdigest() for s, p in zip(shards, paths)]
    assert a == [(s["file"], s["bytes"], digest, s["sha256"]) for s, digest in zip(shards, whole)]
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
    sampled = lambda entry: f"{n} bytes of sampled content {entry[2][:12]}"
    assert differing_file(a, b) == (name, sampled(a[1]), sampled(b[1]))
    b[1] = (*b[1][:3], "f" * 64)  # both manifests list it: theirs is the sha256 compared first
    assert differing_file(a, b) == (name, f"{n} bytes of sha256 {a[1][3][:12]}", f"{n} bytes of sha256 ffffffffffff")
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
    for what, offset in [("first byte", 0), ("last byte", size - 1), ("between slices", SAMPLE_BYTES + 10)]:
        data = bytearray(path.read_bytes())
        data[offset] ^= 1
        (tmp_path / what).write_bytes(bytes(data))
        digests[what] = sampled_sha256(str(tmp_path / what), size)
    assert (size - SAMPLE_BYTES) // (SAMPLES - 1) > SAMPLE_BYTES + 10  # the stride: that byte is in no slice
    assert len({digests["as written"], digests["first byte"], digests["last byte"]}) == 3
    assert digests["between slices"] == digests["as written"]
