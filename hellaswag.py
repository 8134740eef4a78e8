"""HellaSwag accuracy of a GPT-2 style model (validation split, 10042 examples).

    python hellaswag.py --checkpoint out/ckpt_0019073.pt
    python hellaswag.py --hf-model path/to/gpt2            # a local Hugging Face GPT-2 directory
    torchrun --nproc_per_node=8 hellaswag.py --checkpoint out/ckpt_0019073.pt
    python hellaswag.py --checkpoint out --data-file fixtures/hellaswag_val_subset.jsonl  # offline: the shipped subset

Prints acc and acc_norm (build-nanogpt's and llm.c's, GPT-2 124M ~0.2955) and lm-eval's lm_eval_acc,
lm_eval_acc_norm (docs/hellaswag.md), scored by trainkit/evaluation/hellaswag_eval.py as --hellaswag-every is.
"""

from __future__ import annotations

import json
import os
import sys

from trainkit import cli  # the error contract shared by every script; standard library only, so it comes first
from trainkit.evaluation.hellaswag_examples import DATA_NAME, resolve_data_file  # (standard library only too)


# --- command line (standard library only: --help and usage errors answer before torch is imported)


def parse_args(argv=None):
    p = cli.ArgumentParser(description="HellaSwag (validation) accuracy of a GPT-2 model.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoint written by train_gpt2.py")
    src.add_argument("--hf-model", help="a local Hugging Face GPT-2 directory (needs transformers)")
    p.add_argument("--data-file", help=f"local copy of {DATA_NAME} (default: download it)")
    p.add_argument(
        "--data-dir",
        help=f"where {DATA_NAME} is cached or downloaded to "
        "(default: $HELLASWAG_DIR or ~/.cache/gpt2-trainer/hellaswag)",
    )
    p.add_argument(
        "--limit", type=cli.non_negative_int, default=0, help="score only the first N examples (0: all 10042)"
    )
    p.add_argument(
        "--no-lm-eval",
        dest="lm_eval",
        action="store_false",
        help="skip lm-eval's rendering of the examples and its lm_eval_acc, lm_eval_acc_norm (half the "
        "time: each example is scored once, not twice)",
    )
    p.add_argument(
        "--batch-size", type=cli.positive_int, help="examples per forward pass (default: 16 on CUDA, 4 on CPU)"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto: cuda if available)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="autocast dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p.parse_args(argv)


if __name__ == "__main__":
    cli.parse_before_imports(parse_args)

import torch.nn as nn

from trainkit.runfiles.checkpoints import latest_checkpoint, load_checkpoint
from trainkit.evaluation.hellaswag_eval import evaluate
from trainkit.evaluation.hellaswag_examples import RENDERERS, describe_data, load_examples
from trainkit.hf.weights import load_hf_model
from trainkit.cli import print0, print_result
from trainkit.runtime.launch import checked_on_every_rank, exit_code_on_every_rank, process_group
from trainkit.runtime.device import resolve_dtype

# --- the command: our checkpoint or a Hugging Face GPT-2, scored on every rank


class HFLogits(nn.Module):
    """A Hugging Face GPT2LMHeadModel whose forward returns bare logits."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config  # n_positions gives the block size

    def forward(self, idx):
        return self.hf(input_ids=idx).logits


def load_checkpoint_model(path: str, device: str) -> tuple[nn.Module, str]:
    """Our GPT from a checkpoint (a file, or a run's folder for its newest), and which file and step it is."""
    from train_gpt2 import GPT, MODEL_FIELDS, GPTConfig  # our checkpoints' model (only this command imports it)

    chosen = (latest_checkpoint(path) if os.path.isdir(path) else None) or path  # (a folder without one: refused)
    ckpt = load_checkpoint(chosen, model_fields=MODEL_FIELDS)
    model = GPT(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    step = f", step {ckpt['step']}" if isinstance(ckpt.get("step"), int) else " (it records no step)"
    return model.to(device).eval(), f"{chosen}{step}"


def run(args) -> dict:
    def load_data_and_model(device: str):
        data_file = resolve_data_file(args.data_file, args.data_dir)
        for style in RENDERERS if args.lm_eval else ["nanogpt"]:  # a bad file fails before loading a model
            load_examples(data_file, args.limit, style=style)  # (evaluate reuses these)
        if args.checkpoint:
            return data_file, *load_checkpoint_model(args.checkpoint, device)
        model = HFLogits(load_hf_model(args.hf_model, "--hf-model")).to(device).eval()
        return data_file, model, f"the Hugging Face GPT-2 in {args.hf_model}"

    with process_group(args.device) as dist_state:
        dtype = resolve_dtype(args.dtype, dist_state.device_type)
        # each rank reads its node's files: one with a file missing or bad is named, by rank 0
        data_file, model, scored = checked_on_every_rank(dist_state, lambda: load_data_and_model(dist_state.device))
        print0(f"hellaswag: scoring {scored}")
        options = dict(limit=args.limit, batch_size=args.batch_size, dtype=dtype, progress=True, lm_eval=args.lm_eval)
        ranks = dict(rank=dist_state.rank, world_size=dist_state.world_size)
        result = evaluate(model, dist_state.device, data_file=data_file, **options, **ranks)
        print0(describe_data(data_file, args.limit))  # stdout only once there is a result
        print_result(json.dumps(result))
        return result


def main(argv=None) -> int:
    args = parse_args(argv)
    return exit_code_on_every_rank(lambda: run(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
