"""Sample text from a trained GPT-2: a train_gpt2.py checkpoint or a Hugging Face GPT-2 folder.

    python sample.py --checkpoint out/cpu --prompt "def main(" --num-samples 2 --max-new-tokens 100
    python sample.py --hf-model gpt2_hf --temperature 0.8 --top-k 40 --seed 7

Each sample ends at its first <|endoftext|>; the same seed gives the same text whatever --batch-size
(docs/sampling.md). Only this command's main imports the trainer (for its GPT).
"""

from __future__ import annotations

import argparse
import math
import sys

from trainkit import cli  # the error contract shared by every script; standard library only, so it comes first
from trainkit.train_flags import SAMPLE_PROMPT  # (standard library only too)


# --- command line (standard library only: --help and usage errors answer before torch is imported)


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(
        description="Sample text from a GPT-2 checkpoint or Hugging Face GPT-2 folder.",
        formatter_class=cli.HelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a train_gpt2.py checkpoint, or a run's --out-dir for its newest one")
    src.add_argument("--hf-model", help="a Hugging Face GPT-2 folder (needs transformers)")
    p.add_argument(
        "--prompt", default=SAMPLE_PROMPT, type=cli.may_be_empty, help="text to continue ('' starts a new document)"
    )
    p.add_argument("--num-samples", type=cli.positive_int, default=4, help="continuations to draw")
    p.add_argument("--max-new-tokens", type=cli.non_negative_int, default=100, help="tokens to add to the prompt")
    p.add_argument(
        "--continue-past-eot",
        action="store_true",
        help="go on after <|endoftext|> to --max-new-tokens (by default a sample ends there, as Hugging "
        "Face's generate stops at eos_token_id; generate(eos_token_id=None) goes on the same way)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="divides the logits: < 1 sharper, > 1 flatter; a tiny one (1e-40) is greedy",
    )
    p.add_argument("--top-k", type=cli.positive_int, default=50, help="draw from the K most likely tokens")
    p.add_argument(
        "--seed",
        type=cli.int_in(0, 2**63 - 1),
        default=42,
        help="seed of the sampling: sample i draws from its own generator (seed, i)",
    )
    p.add_argument(
        "--batch-size",
        type=cli.positive_int,
        help="samples drawn at once, printed as each batch ends; the texts do not depend on it "
        "(default: as many as fit in 2 GiB, KV cache, activations and logits, at most 64)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (auto: cuda, else mps, else cpu)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return p.parse_args(argv)


if __name__ == "__main__":
    cli.parse_before_imports(parse_args)

from trainkit.cli import UserError, exit_code_of, print_line, print_result
from trainkit.runtime.launch import resolve_device
from trainkit.evaluation.sampling import encode_prompt, sample_text  # the trainer's --sample-every too
from trainkit.data.tokenizer import get_tokenizer_or_fail


# --- the command


def load_model(args: argparse.Namespace, device: str):
    from train_gpt2 import GPT  # the model class of our checkpoints (torch and the trainer: not for --help)

    if args.checkpoint:
        return GPT.from_checkpoint(args.checkpoint, device)
    # its own vocabulary, unpadded: a padded id has no token, and the prompt check needs the real size
    return GPT.from_hf(args.hf_model, flag="--hf-model", pad_multiple=1).to(device)


def run(args: argparse.Namespace):
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise UserError(f"--temperature must be a finite number > 0, got {args.temperature}")
    device = resolve_device(args.device)
    enc = get_tokenizer_or_fail()
    model = load_model(args, device)
    n_prompt = len(encode_prompt(enc, args.prompt, model.config.vocab_size))  # refuses ids the model lacks
    if n_prompt >= model.config.block_size:
        print_line(
            f"note: the prompt is {n_prompt} tokens; the model sees only the newest {model.config.block_size}",
            file=sys.stderr,
        )
    drawn = dict(n=args.num_samples, length=args.max_new_tokens, batch_rows=args.batch_size)
    how = dict(temperature=args.temperature, top_k=args.top_k, seed=args.seed, end_at_eot=not args.continue_past_eot)
    texts = sample_text(model, enc, device, args.prompt, **drawn, **how)
    for i, text in enumerate(texts, 1):  # a batch at a time: a huge --num-samples never holds them all
        # where stdout is gone (`| head`, a full disk), no more are drawn
        if not (print_result(f"--- sample {i}/{args.num_samples} ---") and print_result(text, keep_newlines=True)):
            return


def main(argv=None) -> int:
    args = parse_args(argv)
    return exit_code_of(lambda: run(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
