"""Move GPT-2 weights between Hugging Face transformers and our train_gpt2.GPT.

    python hf_interop.py export out/ckpt_0019073.pt gpt2_ours_hf   # our checkpoint -> HF directory
    python hf_interop.py eval out/gpt2-124M --tasks hellaswag,arc_easy  # lm-evaluation-harness on it

It never imports the trainer. The other direction (GPT.from_hf: --init-from, sample.py) is trainkit/hf/weights.py;
the export's folder and tokenizer files trainkit/hf/export.py (docs/hf.md). transformers: imported where used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

from trainkit import cli  # the error contract shared by every script; standard library only, so it comes first

# --- command line (standard library only: --help and usage errors answer before torch is imported)


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(
        description="Export a train_gpt2.py checkpoint as a Hugging Face GPT-2 folder, or "
        "evaluate one with lm-evaluation-harness."
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write a checkpoint as a Hugging Face GPT-2 directory")
    v = sub.add_parser(
        "eval", help="run lm-evaluation-harness tasks on a checkpoint (exported to a temporary Hugging Face directory)"
    )
    for cmd in (e, v):
        cmd.add_argument(
            "checkpoint",
            help="a checkpoint written by train_gpt2.py: a ckpt_*.pt file, or a run's "
            "--out-dir folder for its newest checkpoint",
        )
    e.add_argument("out_dir", help="directory for config.json and model.safetensors")
    e.add_argument("--vocab-size", type=cli.positive_int, help="rows to keep (default: 50257, dropping the padding)")
    v.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated (hellaswag,arc_easy,...)")
    v.add_argument(
        "--hellaswag-file",
        help="local hellaswag_val.jsonl: hellaswag runs from it through evals/hellaswag_local.yaml, without the Hub",
    )
    v.add_argument("--limit", type=cli.positive_int, help="examples per task (default: all)")
    v.add_argument(
        "--num-fewshot", type=cli.non_negative_int, help="few-shot examples (default: each task's own, 0 for hellaswag)"
    )
    v.add_argument("--batch-size", type=cli.positive_int, default=8, help="lm-eval's batch size (default 8)")
    v.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    v.add_argument("--samples-dir", help="write each task's per-example results to DIR/TASK.jsonl")
    for cmd in (e, v):
        cmd.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")
    return p.parse_args(argv)


if __name__ == "__main__":
    cli.parse_before_imports(parse_args)

import torch

from trainkit.fileio import read_json, write_bytes_atomically
from trainkit.runfiles.checkpoints import latest_checkpoint, load_checkpoint, unwrap_model
from trainkit.cli import UserError, exit_code_of, optional_import, print_line, print_result, reason_of
from trainkit.hf.export import EXPORT_MARK, check_replaceable, check_target, remove_dead_partials, replacing_folder
from trainkit.hf.export import gpt2_tokenizer_files, write_json, write_mark
from trainkit.hf.weights import HF_BUFFERS, INSTALL_HINT, TRANSPOSED, quiet_transformers
from trainkit.data.tokenizer import EOT, GPT2_VOCAB, real_vocab_size
from trainkit.evaluation.hellaswag_examples import load_examples, resolve_data_file


# --- export: our checkpoint as a Hugging Face GPT-2 folder

TIED = ("transformer.wte.weight", "lm_head.weight")
EXPORTED_CONFIG = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")  # what GPT2Config can say of ours
# the rest of our GPT in GPT2Config's words: tanh-approximated GELU, eps 1e-5, tied, no dropout
OUR_GPT2 = dict(activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True)
OUR_GPT2 |= dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, architectures=["GPT2LMHeadModel"])


def export_hf(source, out_dir: str, vocab_size: int | None = None) -> str:
    """Write a Hugging Face GPT-2 directory that GPT2LMHeadModel.from_pretrained(out_dir) loads, marked
    (EXPORT_MARK) as an export's; returns out_dir. source: one of our checkpoints (a ckpt file, or a run's
    folder for its newest) or a GPT (wrapped too). vocab_size: rows to keep (default: the real ones)."""
    check_target(out_dir)
    remove_dead_partials(out_dir)
    check_replaceable(out_dir)  # before any work: a refusal changes nothing
    mark = dict(checkpoint=None, step=None, checksum=None)
    if isinstance(source, (str, os.PathLike)):
        # a run's folder: its newest checkpoint, looked up once, so that the mark names the file loaded
        path = (latest_checkpoint(str(source)) or str(source)) if os.path.isdir(source) else str(source)
        ckpt = load_checkpoint(path, model_fields=EXPORTED_CONFIG)  # a field GPT-2 lacks is refused
        config, sd = argparse.Namespace(**ckpt["model_config"]), ckpt["model"]
        mark.update(checkpoint=os.path.abspath(path), step=ckpt.get("step"), checksum=ckpt["checksum"])
    else:
        model = unwrap_model(source)
        config, sd = model.config, model.state_dict()
    n_keep = real_vocab_size(config.vocab_size) if vocab_size is None else vocab_size
    if not 0 < n_keep <= config.vocab_size:
        raise UserError(f"--vocab-size {n_keep} must be in 1..{config.vocab_size} (the model's vocab size)")
    transformers = optional_import("transformers", INSTALL_HINT)
    special = dict(bos_token_id=EOT, eos_token_id=EOT) if n_keep > EOT else dict(bos_token_id=None, eos_token_id=None)
    sizes = dict(n_positions=config.block_size, n_ctx=config.block_size, n_embd=config.n_embd, n_head=config.n_head)
    hf_config = transformers.GPT2Config(vocab_size=n_keep, n_layer=config.n_layer, **sizes, **OUR_GPT2, **special)
    hf_sd = {}
    for key, value in sd.items():
        value = value.detach().to("cpu", torch.float32)
        if key in TIED:
            value = value[:n_keep]
        elif key.endswith(TRANSPOSED):
            value = value.t()
        hf_sd[key] = value.contiguous()
    hf = transformers.GPT2LMHeadModel(hf_config)
    result = hf.load_state_dict(hf_sd, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(HF_BUFFERS) and k not in TIED]
    if missing or result.unexpected_keys:
        raise UserError(
            f"checkpoint does not match GPT-2's layout (missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})"
        )
    hf.tie_weights()  # one shared matrix, as config.tie_word_embeddings says
    with replacing_folder(out_dir) as new_dir:
        try:
            with quiet_transformers():
                hf.save_pretrained(new_dir)
        except Exception as e:  # OSError, or safetensors' own error for a failed write (a full disk)
            raise UserError(f"cannot write the Hugging Face model to {out_dir}: {reason_of(e)}") from e
        if n_keep >= GPT2_VOCAB:  # the GPT-2 ids: the folder then tokenizes text on its own
            for name, value in gpt2_tokenizer_files(config.block_size).items():
                write_json(os.path.join(new_dir, name), value, out_dir)
        write_mark(new_dir, dict(mark, vocab_size=n_keep), shown=out_dir)
        check_replaceable(out_dir)  # again, for what changed there while this export was written
    return out_dir


# --- lm-evaluation-harness on an exported checkpoint

EVALS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "evals")  # our lm-eval task YAMLs
LM_EVAL_HINT = "lm-evaluation-harness is not installed: pip install lm_eval accelerate"
LOCAL_TASKS = {"hellaswag": "hellaswag_local"}  # lm-eval task -> ours in evals/ that reads a local file


def _load_tasks(TaskManager, names: list[str], hellaswag_file: str | None):
    """(task manager, lm-eval's tasks and groups, their data loaded): hellaswag from hellaswag_file through
    evals/hellaswag_local.yaml when it is given; a task that cannot be had is one line saying what to set."""
    metadata = None
    if hellaswag_file:  # a missing file, or a bad line, named as hellaswag.py names them (not as a failed download)
        flag = "--hellaswag-file"
        load_examples(resolve_data_file(hellaswag_file, flag=flag), flag=flag, style="lm_eval")
        metadata = {"data_file": os.path.abspath(hellaswag_file)}
        names = [LOCAL_TASKS.get(name, name) for name in names]
    # lm-eval's own thousands of task YAMLs take ~15 s to index: only when a task needs them
    manager = TaskManager(
        include_path=EVALS_DIR, metadata=metadata, include_defaults=not set(names) <= set(LOCAL_TASKS.values())
    )
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise UserError(f"--tasks: lm-eval has no task {unknown[0]!r} (`lm_eval ls tasks` lists them)")
    loaded = {}
    for name in names:
        try:
            with _quiet_datasets():
                loaded[name] = manager.load(name)
        except Exception as e:  # the Hub unreachable, a damaged file, a dataset lm-eval cannot build
            fix = (
                "pass --hellaswag-file PATH (a local hellaswag_val.jsonl; evals/hellaswag_local.yaml reads it)"
                if name in LOCAL_TASKS
                else "with no internet, point HF_HOME at a Hugging Face cache that holds its dataset "
                "and set HF_DATASETS_OFFLINE=1"
            )
            raise UserError(f"--tasks {name}: cannot load its data ({reason_of(e, typed=True)}); {fix}") from e
    return manager, [obj for result in loaded.values() for obj in _top_level(result)]


def _top_level(loaded: dict) -> list:
    """The groups and tasks of a TaskManager.load result that are no group's member."""
    members = {child for children in loaded.get("group_map", {}).values() for child in children}
    return [obj for kind in ("groups", "tasks") for name, obj in loaded[kind].items() if name not in members]


@contextlib.contextmanager
def _quiet_datasets():
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if bars:
            datasets.enable_progress_bars()


def lm_eval_results(args: argparse.Namespace, tasks: list[str]) -> dict:
    """lm-evaluation-harness's simple_evaluate of tasks on eval's checkpoint, exported to a temporary Hugging
    Face directory: its results, the per-example records under "samples"."""
    optional_import("accelerate", LM_EVAL_HINT)  # lm-eval's hf model needs it and does not install it
    lm_eval = optional_import("lm_eval", LM_EVAL_HINT)
    HFLM = optional_import("lm_eval.models.huggingface", LM_EVAL_HINT).HFLM
    TaskManager = optional_import("lm_eval.tasks", LM_EVAL_HINT).TaskManager
    manager, loaded = _load_tasks(TaskManager, tasks, args.hellaswag_file)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="hf_export_") as hf_dir:
        export_hf(args.checkpoint, hf_dir)
        if not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):  # transformers would make an empty one
            raise UserError(f"the export of {args.checkpoint} has no tokenizer.json for lm-eval to encode text with")
        try:
            with quiet_transformers():
                lm = HFLM(pretrained=hf_dir, device=device, batch_size=args.batch_size, dtype="float32")
        except (OSError, ValueError, RuntimeError) as e:  # a tokenizer or device it cannot have
            raise UserError(f"lm-eval cannot load the exported model ({reason_of(e, typed=True)})") from e
        options = dict(limit=args.limit, num_fewshot=args.num_fewshot, log_samples=True, bootstrap_iters=0)
        return lm_eval.simple_evaluate(model=lm, tasks=loaded, task_manager=manager, **options)


def _sample_record(sample: dict) -> dict:
    """One example of lm-eval's log: its id, gold answer, log-likelihoods and metric values."""
    resps = sample["filtered_resps"]
    if all(isinstance(r, (list, tuple)) for r in resps):
        resps = [float(resp[0]) for resp in resps]
    record = {"doc_id": sample["doc_id"], "target": sample["target"], "loglikelihoods": resps}
    return record | {metric: sample[metric] for metric in sample.get("metrics", [])}


def run_lm_eval(args):
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not tasks:
        raise UserError("--tasks names no task")
    if args.samples_dir:  # a folder we cannot write fails now, not after the evaluation
        try:
            os.makedirs(args.samples_dir, exist_ok=True)
        except OSError as e:
            raise UserError(f"--samples-dir {args.samples_dir}: {reason_of(e)}") from None
    out = lm_eval_results(args, tasks)
    for task, samples in out["samples"].items() if args.samples_dir else ():
        path = os.path.join(args.samples_dir, f"{task}.jsonl")
        try:
            lines = "".join(json.dumps(_sample_record(s)) + "\n" for s in samples).encode()
            write_bytes_atomically(path, lines, fsync_file=False, fsync_folder=False)
        except OSError as e:
            raise UserError(f"cannot write {path}: {reason_of(e)}") from None
    from lm_eval.utils import make_table

    print_line(make_table(out), file=sys.stderr, keep_newlines=True)
    print_result(json.dumps({task: _metrics(results) for task, results in out["results"].items()}))


def _metrics(results: dict) -> dict:
    """A task's numbers: acc, acc_norm, ... ('acc,none' for lm-eval's default filter) and n."""
    numbers = {key.removesuffix(",none"): v for key, v in results.items() if "," in key and "_stderr," not in key}
    return numbers | ({"n": results["sample_len"]} if "sample_len" in results else {})


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "eval":
        return exit_code_of(lambda: run_lm_eval(args), args.debug)

    def export():
        out = export_hf(args.checkpoint, args.out_dir, vocab_size=args.vocab_size)
        mark = read_json(os.path.join(out, EXPORT_MARK))  # which checkpoint (a folder's newest) and step
        source = os.path.relpath(mark["checkpoint"])
        source = mark["checkpoint"] if source.startswith("..") else source
        step = f"step {mark['step']}" if mark["step"] is not None else "it records no step"
        print_line(
            f"wrote Hugging Face GPT-2 of {source} ({step}) to {out} (load with "
            f"GPT2LMHeadModel.from_pretrained({out!r}) and AutoTokenizer.from_pretrained({out!r}))"
        )

    return exit_code_of(export, args.debug)


if __name__ == "__main__":
    sys.exit(main())
