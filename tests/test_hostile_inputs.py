"""Files from elsewhere checked before they cost anything (deep JSON, checkpoints and Hugging Face folders not as
written, files not regular files): exit code 2, one `error:` line, every file byte-identical. In-process (run_main),
but the named pipes: as programs (a regression would block the test's own process)."""

import functools
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch

import train_gpt2 as tg
from conftest import HELLASWAG_FILE, assert_one_error_line, assert_refused, run_as_programs, run_main, tiny_hf
from conftest import tiny_run_args, tree_hashes, write_checkpoint
from trainkit.runfiles import checkpoints

DEEP = "[" * 200_000  # a JSON document no reader may hand to the recursive decoder
DEEP_REASON = "JSON nested 200000 levels deep, deeper than the 64 of any file read here"
SHARDS = dict(n_docs=300, seed=3)


# --- JSON: one reader, nesting measured before the decoder -----------------------------------
def test_deep_json_in_every_reader_is_one_line_naming_file_and_line(finished_run, data_dir, tmp_path):
    """In a data folder's manifest.json, fineweb.py's own, a --files line, a HellaSwag line, a Hugging Face config.json,
    a run's log.jsonl and plot_log.py's log; an export folder whose mark is deep is the user's (not replaced)."""
    export = tmp_path / "export"
    assert run_main("hf_interop.py", "export", finished_run, export).returncode == 0
    (export / "gpt2_trainer_export.json").write_text(DEEP)
    data, hf, run = shutil.copytree(data_dir, tmp_path / "data"), tmp_path / "hf", tmp_path / "run"
    for path, text in [
        (data / "manifest.json", DEEP),
        (tmp_path / "fineweb_out" / "manifest.json", DEEP),
        (tmp_path / "docs.jsonl", json.dumps({"text": "fine"}) + "\n" + DEEP + "\n"),
        (tmp_path / "hellaswag.jsonl", HELLASWAG_FILE.read_text().splitlines()[0] + "\n" + DEEP + "\n"),
        (hf / "config.json", DEEP),
        (run / "log.jsonl", DEEP + "\n"),
    ]:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    before = tree_hashes(tmp_path)
    cases = [
        (
            ("train_gpt2.py", *tiny_run_args(data, tmp_path / "out", steps=1)),
            f"{data / 'manifest.json'} is not a manifest fineweb.py wrote ({DEEP_REASON}); restore it, re-create the "
            "data set with fineweb.py, or move it out of the folder",
        ),
        (
            ("fineweb.py", "--files", tmp_path / "docs.jsonl", "--out-dir", tmp_path / "fineweb_out"),
            f"{tmp_path / 'fineweb_out' / 'manifest.json'} is not a manifest written by fineweb.py ({DEEP_REASON}); "
            "use an empty --out-dir",
        ),
        (
            ("fineweb.py", "--files", tmp_path / "docs.jsonl", "--out-dir", tmp_path / "fineweb_new", "--workers", "1"),
            f"{tmp_path / 'docs.jsonl'}:2: not JSON Lines ({DEEP_REASON}); .json/.jsonl files must hold one JSON "
            "object per line",
        ),
        (
            ("hellaswag.py", "--data-file", tmp_path / "hellaswag.jsonl", "--checkpoint", finished_run, "--limit", "2"),
            f"--data-file {tmp_path / 'hellaswag.jsonl'} line 2: not a HellaSwag example ({DEEP_REASON})",
        ),
        (("sample.py", "--hf-model", hf), f"--hf-model {hf}: {hf / 'config.json'}: {DEEP_REASON}"),
        (
            ("train_gpt2.py", *tiny_run_args(data_dir, run, steps=1)),
            f"--out-dir {run} holds a log.jsonl of no run (no line of it is a JSON record: not a log this trainer "
            "wrote) but no checkpoint to resume: move the log aside to start a new run there, or choose another "
            "--out-dir",
        ),
        (
            ("plot_log.py", run / "log.jsonl", "-o", tmp_path / "plot.png"),
            f"{run / 'log.jsonl'} is not a run's log: none of its 1 line(s) is a JSON record; pass a run's --out-dir "
            "or its log.jsonl",
        ),
    ]
    assert_one_error_line(run_main("hf_interop.py", "export", finished_run, export), f"error: {export} ")
    for command, line in cases:
        result = run_main(*command)
        if tmp_path / "fineweb_new" in command:  # its progress bar first; what it keeps of a failed run removed
            assert "Traceback" not in result.stderr
            result.stderr = result.stderr.splitlines(keepends=True)[-1].split("\r")[-1]
            shutil.rmtree(tmp_path / "fineweb_new", ignore_errors=True)
        assert_refused(result, line)
    assert tree_hashes(tmp_path) == before


# --- checkpoints: structure before contents --------------------------------------------------
STRUCTURES = {  # {case: (edit, a true sha256 (False: made up, where computing it reads a tensor whole), the problem)}
    "expanded embedding": (
        # the token embedding as one float broadcast to 50304 x 16: two bytes' worth of file
        lambda c: c["model"].__setitem__("transformer.wte.weight", torch.zeros(1, 1).expand(50304, 16)),
        True,
        "its tensor ['model']['transformer.wte.weight'] of 50304x16 has strides (0, 0), not "
        "those of a stored tensor (expanded or a view)",
    ),
    "expanded 51 GB": (  # as float32
        lambda c: c["optimizer"]["state"][0].__setitem__("exp_avg_sq", torch.zeros(1).expand(12_800_000_000)),
        False,
        "its tensor ['optimizer']['state'][0]['exp_avg_sq'] of 12800000000 has strides (0,), not "
        "those of a stored tensor (expanded or a view)",
    ),
    "storage larger than its view": (
        lambda c: c["model"].__setitem__("transformer.ln_f.bias", torch.zeros(1000)[:16]),
        True,
        "a tensor's storage holds 4000 bytes, of which its tensors view 64",
    ),
    "nested 3000 deep": (
        lambda c: c.__setitem__("extra", functools.reduce(lambda inner, _: [inner], range(3000), 0)),
        False,
        "its structure nests deeper than 100 levels (at " + ("['extra']" + "[0]" * 30)[:80] + "...)",
    ),
    "model tensor shape": (
        lambda c: c["model"].__setitem__("transformer.h.0.attn.c_attn.weight", torch.zeros(48, 15)),
        True,
        "its transformer.h.0.attn.c_attn.weight is 48x15, where its model_config makes it 48x16",
    ),
}
WRONG_TYPES = {
    "no optimizer": (lambda c: c.pop("optimizer"), "it holds no optimizer to resume from (weights only)"),
    "optimizer tensor shape": (
        lambda c: c["optimizer"]["state"][0].__setitem__("exp_avg", torch.zeros(3)),
        "its optimizer's exp_avg of parameter 0 is 3, where the parameter is 50304x16: written by another program or "
        "edited, it cannot be resumed",  # (the whole line)
    ),
    "no seq_len": (lambda c: c["run_config"].pop("seq_len"), "its run_config has no seq_len"),
    "negative step": (lambda c: c.__setitem__("step", -2), "its step is -2, not a count (an integer >= 0)"),
    "text step": (lambda c: c.__setitem__("step", "2"), "its step is '2', not a count (an integer >= 0)"),
    "float rng state": (
        lambda c: c.__setitem__("rng_cpu", c["rng_cpu"].float()),
        "its rng_cpu is a Tensor, not a random generator's state (a 1-D uint8 tensor)",
    ),
    "empty skip state": (
        lambda c: c.__setitem__("skip_state", {}),
        "its skip_state is not the guards' state (loss_window, norm_window: "
        "lists of numbers; spikes_in_a_row, nonfinite_skipped: counts)",
    ),
    "run not a mapping": (
        lambda c: c.__setitem__("run", ["not", "a", "mapping"]),
        "its run is a list, not a run identity (a mapping of id and parent)",
    ),
    "fractional log offset": (
        lambda c: c.__setitem__("log_offset", 1.5),
        "its log_offset is 1.5, not a count (an integer >= 0)",
    ),
    "text shuffle": (lambda c: c["run_config"].__setitem__("shuffle", "yes"), "its run_config shuffle is 'yes'"),
    "negative shard size": (
        lambda c: c.__setitem__("data_files", {"train": [("x", -1)], "val": None}),
        "its data_files is not a list of shards (name, size, sha256)",
    ),
}
# the structures in every loader, the resume fields (the sha256 right) in the trainer's
CHECKPOINTS = {case: (edit, checksum, problem, 4) for case, (edit, checksum, problem) in STRUCTURES.items()}
CHECKPOINTS.update({case: (edit, True, problem, 1) for case, (edit, problem) in WRONG_TYPES.items()})


@pytest.mark.parametrize("edit,checksum,problem,loaders", CHECKPOINTS.values(), ids=list(CHECKPOINTS))
def test_a_checkpoint_not_as_the_trainer_writes_it_is_refused_before_its_contents_are_read(
    finished_run, data_dir, tmp_path, edit, checksum, problem, loaders
):
    """A checkpoint whose structure costs more than its file, whose tensors' shapes are not its config's or whose
    resume fields' types are not the trainer's: each loader refuses it in one line before reading a tensor."""
    (tmp_path / "run").mkdir()
    shutil.copy(finished_run / "log.jsonl", tmp_path / "run")
    state, ckpt = torch.load(finished_run / "ckpt_0000002.pt", weights_only=True), tmp_path / "run" / "ckpt_0000002.pt"
    edit(state)
    state.pop("checksum")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # torch.save pickles recursively; the loader must not
    try:  # with its true sha256 (another program wrote it so) or, where that reads an expanded tensor whole, made up
        checkpoints.save_checkpoint(str(ckpt), state) if checksum else torch.save(dict(state, checksum="0" * 64), ckpt)
    finally:
        sys.setrecursionlimit(limit)
    before = tree_hashes(tmp_path)
    line = f"{ckpt}: {problem}: not as train_gpt2.py writes them; there is no earlier checkpoint next to it"
    if problem.endswith("cannot be resumed"):
        line = f"{ckpt}: {problem}"
    for command in [
        ("train_gpt2.py", *tiny_run_args(data_dir, tmp_path / "run", "--resume", steps=4)),
        ("sample.py", "--checkpoint", ckpt, "--max-new-tokens", "1"),
        ("hellaswag.py", "--checkpoint", ckpt, "--data-file", HELLASWAG_FILE, "--limit", "1"),
        ("hf_interop.py", "export", ckpt, tmp_path / "hf"),
    ][:loaders]:
        assert_refused(run_main(*command), line)
    assert tree_hashes(tmp_path) == before


# --- Hugging Face folders: config and weights compared before a model is built ----------------
def index_to(where):
    """The folder's weights moved to where (relative to it, or absolute: {tmp} its parent) and named there by an index."""

    def edit(folder):
        from safetensors.torch import load_file

        names, where_now = list(load_file(folder / "model.safetensors")), where.format(tmp=folder.parent)
        target = folder / where_now
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(folder / "model.safetensors", target)
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {name: where_now for name in names}})
        )

    return edit


def unsafe_bin(folder):
    """pytorch_model.bin instead of safetensors, holding a pickled object that is not a tensor."""
    import argparse
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    os.remove(folder / "model.safetensors")
    torch.save({**state, "extra": argparse.Namespace(code="run me")}, folder / "pytorch_model.bin")


OUTSIDE = (
    "its model.safetensors.index.json names the weight file '{}', outside the folder: only files inside it are read"
)
NOT_SIZES = "its config.json gives {}: not the sizes of a GPT-2 (positive integers)"
HF_FOLDERS = {  # {case: (config.json's edits, the folder's edit, the problem)}
    "fewer layers than its weights": (
        dict(n_layer=1),
        None,
        "its weights hold tensors that a GPT-2 of its config.json's sizes has no place for "
        "(transformer.h.1.attn.c_attn.bias, transformer.h.1.attn.c_attn.weight, ...; 12 in all); config.json gives "
        "n_layer 1: is it the config of these weights?",
    ),
    "negative n_layer": (dict(n_layer=-1), None, NOT_SIZES.format("n_layer -1")),
    "text n_embd": (dict(n_embd="16"), None, NOT_SIZES.format("n_embd '16'")),
    "absurd n_positions": (
        dict(n_positions=10**9),
        None,
        "tensors of another shape than its config.json gives (transformer.wpe.weight; 1 in all)",
    ),
    "index up out": ({}, index_to("../elsewhere/x.safetensors"), OUTSIDE.format("../elsewhere/x.safetensors")),
    "index into a subfolder": ({}, index_to("sub/x.safetensors"), OUTSIDE.format("sub/x.safetensors")),
    # (for --init-from: the trainer's own flags)
    "absolute index": ({}, index_to("{tmp}/elsewhere/x.safetensors"), OUTSIDE.format("{tmp}/elsewhere/x.safetensors")),
    "unsafe pytorch_model.bin": (
        {},
        unsafe_bin,
        "cannot load {folder}/pytorch_model.bin (it holds pickled objects "
        "other than tensors and plain values, which are never loaded)",
    ),
}


@pytest.mark.parametrize("case", HF_FOLDERS)
def test_a_hugging_face_folder_is_checked_before_a_model_is_built(data_dir, tmp_path, case):
    config, edit, problem = HF_FOLDERS[case]
    folder = tmp_path / "hf"  # conftest's tiny_hf of 100 ids, its config.json then edited
    tiny_hf(vocab_size=100).save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **config}))
    if edit:
        edit(folder)
    before = tree_hashes(tmp_path)
    line = f"--hf-model {folder}: {problem.format(folder=folder, tmp=tmp_path)}"
    command = ("sample.py", "--hf-model", folder, "--max-new-tokens", "1")
    if case == "absolute index":
        flags = "--seq-len 16 --batch-size 4 --total-batch-size 64 --max-steps 1 --val-every 0 --sample-every 0"
        command = ("train_gpt2.py", "--init-from", folder, "--data-dir", data_dir, "--out-dir", tmp_path / "out")
        command, line = (*command, *flags.split(), "--hellaswag-every", "0"), line.replace("--hf-model", "--init-from")
    assert_refused(run_main(*command), line)
    if case == "fewer layers than its weights":  # also where the other commands take a Hugging Face GPT-2
        command = ("hellaswag.py", "--hf-model", folder, "--data-file", HELLASWAG_FILE, "--limit", "1")
        assert_refused(run_main(*command), line)
    assert tree_hashes(tmp_path) == before


# --- files that are not regular files ----------------------------------------------------------
FIFO = "a named pipe (FIFO), not a regular file: it cannot be read as one"
LOG_FIFO = (
    "a named pipe (FIFO), not a regular file: a run would wait on it or write over it; remove it (the run makes "
    "its own), or choose another --out-dir"
)
NOT_FILES = {  # {case: the line}
    "shard fifo": "{path} is " + FIFO,
    "shard /dev/zero": "{path} is a character device (a link to /dev/zero), not a regular file: it cannot be read as one",
    "new log fifo": "{path} is " + LOG_FIFO,
    "resumed log fifo": "{path} is " + LOG_FIFO,
    "fineweb --files": "{path} is " + FIFO,
    "hellaswag --data-file": "--data-file {path} is " + FIFO,
}


@pytest.fixture(scope="module")
def not_files(finished_run, data_dir, tmp_path_factory):
    """NOT_FILES' special files given to the scripts as programs (run_as_programs: a timeout ends a blocked one).
    {case: (CompletedProcess, its special file, whether it was still one)}, whether all else is unchanged."""
    tmp = tmp_path_factory.mktemp("not_files")
    fifo_data, zero_data = (Path(shutil.copytree(data_dir, tmp / name)) for name in ("fifo_data", "zero_data"))
    new, resumed, docs = tmp / "new", tmp / "resumed", tmp / "docs.jsonl"
    new.mkdir()
    shutil.copytree(finished_run, resumed)
    os.remove(resumed / "log.jsonl")
    train = lambda data, out, *extra: ["train_gpt2.py", *tiny_run_args(data, out, *extra, steps=6)]
    cases = {
        "shard fifo": (fifo_data / "x_train_000009.npy", train(fifo_data, tmp / "o1")),
        "shard /dev/zero": (zero_data / "x_train_000009.npy", train(zero_data, tmp / "o2")),
        "new log fifo": (new / "log.jsonl", train(data_dir, new)),
        "resumed log fifo": (resumed / "log.jsonl", train(data_dir, resumed, "--resume")),
        "fineweb --files": (docs, ["fineweb.py", "--files", docs, "--out-dir", tmp / "o3"]),
        "hellaswag --data-file": (docs, ["hellaswag.py", "--data-file", docs, "--checkpoint", finished_run]),
    }
    before = tree_hashes(tmp)
    for path in {path for path, _ in cases.values()}:
        os.symlink("/dev/zero", path) if path.parent == zero_data else os.mkfifo(path)
    results = run_as_programs([dict(argv=[str(a) for a in argv]) for _, argv in cases.values()], timeout=300)
    special = [path.is_symlink() or stat.S_ISFIFO(os.lstat(path).st_mode) for path, _ in cases.values()]
    for path in {path for path, _ in cases.values()}:
        os.remove(path)
    paths = [path for path, _ in cases.values()]
    return dict(zip(cases, zip(results, paths, special))), tree_hashes(tmp) == before


@pytest.mark.parametrize("case", NOT_FILES)
def test_a_file_that_is_not_a_regular_file_is_refused_not_read(not_files, case):
    (result, path, still_special), unchanged = not_files[0][case], not_files[1]
    assert_refused(result, NOT_FILES[case].format(path=path))
    assert still_special and unchanged  # the pipe or link left as it was, and every other file


# --- models HellaSwag cannot score --------------------------------------------------------------
BLOCK_1 = (
    "HellaSwag predicts each ending from its context, which a model of --block-size 1 cannot see (it needs "
    "at least 2 positions)"
)
CANNOT_SCORE = {  # {case: (the model's block_size and vocab_size, hellaswag.py's problem, the trainer's line)}
    "block-size-1": ((1, 50304), BLOCK_1, f"--hellaswag-every 1: {BLOCK_1}; pass --hellaswag-every 0"),
    "vocab-size-1000": (
        (32, 1000),
        "HellaSwag's examples are GPT-2's tokens (ids up to 50256), beyond this model's vocabulary of 1000 ids",
        "--vocab-size 1000 is smaller than GPT-2's 50257 tokens, which sampling and HellaSwag feed the model: pass "
        "--hellaswag-every 0",
    ),
}


@pytest.mark.parametrize("case", CANNOT_SCORE)
def test_a_model_hellaswag_cannot_score_is_one_line(data_dir, tmp_path, case):
    """hellaswag.py on its checkpoint, and the trainer asked to score it every N steps (refused before the
    first step, not after N steps of training): one line each, nothing written."""
    (block_size, vocab_size), problem, trainer_line = CANNOT_SCORE[case]
    model = tg.GPT(tg.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=block_size, vocab_size=vocab_size))
    checkpoint = write_checkpoint(model, tmp_path / "ckpt_0000001.pt")
    result = run_main("hellaswag.py", "--checkpoint", checkpoint, "--limit", "4", "--data-file", HELLASWAG_FILE)
    assert_refused(result, f"cannot score this model on HellaSwag: {problem}")
    out = tmp_path / "out"
    flags = ["--vocab-size", vocab_size, "--hellaswag-every", 1, "--hellaswag-file", HELLASWAG_FILE]
    args = tiny_run_args(data_dir, out, *flags, steps=2, n_layer=1, block_size=block_size, seq_len=1, rows=4)
    assert_refused(run_main("train_gpt2.py", *args), trainer_line)
    assert not out.exists()
