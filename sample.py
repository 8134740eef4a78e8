"""Sample text from a trained GPT-2: a train_gpt2.py checkpoint or a Hugging Face GPT-2 folder.

    python sample.py --checkpoint out/cpu --prompt "def main(" --num-samples 2 --max-new-tokens 100
    python sample.py --hf-model gpt2_hf --temperature 0.8 --top-k 40 --seed 7

Each sample is the prompt and its continuation as plain text, after a `--- sample i/N ---`
line; notes go to stderr. A sample ends with its first <|endoftext|>, as Hugging Face's generate
stops at the eos token (--continue-past-eot: it runs on). The same seed gives the same text on
the same device and torch version, whatever --batch-size. An empty prompt starts a new document
(<|endoftext|>); a prompt longer than the model's block size keeps its newest tokens in view.
Decoding uses the model's KV cache (train_gpt2.GPT.generate); sample_text here is also what the
trainer prints as in-training samples. Only this command's main imports the trainer (for its GPT).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from trainkit import cli  # the error contract shared by every script; standard library only, so it comes first

SAMPLE_PROMPT = "Hello, I'm a language model,"


# -----------------------------------------------------------------------------
# command line (standard library only: --help and usage errors answer before torch is imported)


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(description="Sample text from a GPT-2 checkpoint or Hugging Face GPT-2 folder.",
                           formatter_class=cli.HelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a train_gpt2.py checkpoint, or a run's --out-dir for its newest one")
    src.add_argument("--hf-model", help="a Hugging Face GPT-2 folder (needs transformers)")
    p.add_argument("--prompt", default=SAMPLE_PROMPT, help="text to continue ('' starts a new document)")
    p.add_argument("--num-samples", type=cli.positive_int, default=4, help="continuations to draw")
    p.add_argument("--max-new-tokens", type=cli.non_negative_int, default=100, help="tokens to add to the prompt")
    p.add_argument("--continue-past-eot", action="store_true",
                   help="go on after <|endoftext|> to --max-new-tokens (by default a sample ends there, as Hugging "
                        "Face's generate stops at eos_token_id; generate(eos_token_id=None) goes on the same way)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="divides the logits: < 1 sharper, > 1 flatter; a tiny one (1e-40) is greedy")
    p.add_argument("--top-k", type=cli.positive_int, default=50, help="draw from the K most likely tokens")
    p.add_argument("--seed", type=cli.int_in(0, 2**63 - 1), default=42,
                   help="seed of the sampling: sample i draws from its own generator (seed, i)")
    p.add_argument("--batch-size", type=cli.positive_int, default=None,
                   help="samples drawn at once, printed as each batch ends; the texts do not depend on it "
                        "(default: as many as fit in 2 GiB, KV cache, activations and logits, at most 64)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (auto: cuda, else mps, else cpu)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return p.parse_args(argv)


if __name__ == "__main__":
    cli.exit_on_ctrl_c_while_starting()
    parse_args()  # --help, or a usage error: answered now, before the slow imports

import numpy as np
import torch
import torch.nn as nn

from trainkit.cli import UserError, exit_code_of
from fineweb import EOT, get_tokenizer_or_fail
from trainkit.launch import resolve_device


# -----------------------------------------------------------------------------
# sampling: what the trainer's in-training samples and this command share


def encode_prompt(enc, prompt: str, vocab_size: int) -> list[int]:
    """Token ids of prompt (a literal <|endoftext|> is that token; an empty prompt is <|endoftext|>
    alone, the start of a document), or a UserError if one lies beyond the model's vocabulary."""
    ids = enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT]
    beyond = [t for t in ids if t >= vocab_size]
    if beyond:
        raise UserError(f"the prompt has token {beyond[0]} ({enc.decode([beyond[0]])!r}), beyond the model's "
                        f"vocabulary of {vocab_size} ids")
    return ids


SAMPLE_BATCH_BYTES = 2 << 30  # default rows drawn at once: as many as fit in this much memory,
SAMPLE_BATCH_ROWS = 64  # and at most this many, so that the first texts come soon


def sample_batch_rows(config, tokens: int, element_size: int = 4) -> int:
    """Rows of tokens positions (at most a block) whose sampling fits in SAMPLE_BATCH_BYTES, in
    1..SAMPLE_BATCH_ROWS: per row, the KV cache of every layer, one layer's activations (x, qkv,
    MLP) and attention scores of a forward over the whole window, and the logits and probabilities."""
    T, C = min(tokens, config.block_size), config.n_embd
    per_row = 2 * config.n_layer * T * C + 8 * T * C + config.n_head * T * T + 4 * config.vocab_size
    return max(1, min(SAMPLE_BATCH_ROWS, SAMPLE_BATCH_BYTES // (per_row * element_size)))


def sample_generator(seed: int, i: int, device: str) -> torch.Generator:
    """The generator of sample i (0, 1, ...) for seed: its own stream, whatever batch it is drawn in."""
    state = np.random.SeedSequence([seed, i]).generate_state(2, np.uint32)
    return torch.Generator(device=device).manual_seed(int(state[0]) << 32 | int(state[1]))


def sample_text(model: nn.Module, enc, device: str, prompt=SAMPLE_PROMPT, n=4, length=32, temperature=1.0,
                top_k=50, seed=42, end_at_eot=True, batch_rows=None, stop_early=True):
    """Yields n continuations of prompt, each the prompt followed by up to length sampled tokens,
    as text; with end_at_eot a continuation ends with its first <|endoftext|> (as Hugging Face's
    generate stops at the eos token), otherwise it runs on past it.

    Sample i draws from its own generator (seed, i), so the texts do not depend on batch_rows, the
    rows drawn at once (default: sample_batch_rows; a huge n never holds more). stop_early: stop a
    batch once all its samples have ended (a sharded model passes False: every rank must run the
    same forwards). Padded vocabulary ids (beyond the tokenizer's) have no text and are left out."""
    was_training = model.training
    model.eval()
    ids = encode_prompt(enc, prompt, model.config.vocab_size)
    batch_rows = batch_rows or sample_batch_rows(model.config, len(ids) + length,
                                                 next(model.parameters()).element_size())
    stop_token = EOT if end_at_eot and stop_early else None
    try:
        for first in range(0, n, batch_rows):
            rows = range(first, min(n, first + batch_rows))
            idx = torch.tensor([ids] * len(rows), dtype=torch.long, device=device)
            generators = [sample_generator(seed, i, device) for i in rows]
            out = model.generate(idx, length, temperature=temperature, top_k=top_k, generator=generators,
                                 stop_token=stop_token)
            for row in out[:, len(ids):].tolist():
                if end_at_eot and EOT in row:
                    row = row[:row.index(EOT) + 1]
                yield prompt + enc.decode([t for t in row if t < enc.n_vocab])
    finally:
        model.train(was_training)


def validate_args(args: argparse.Namespace):
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise UserError(f"--temperature must be a finite number > 0, got {args.temperature}")


def load_model(args: argparse.Namespace, device: str):
    sys.modules.setdefault("sample", sys.modules[__name__])  # run as a program: the trainer's `from sample
    from train_gpt2 import GPT  # import` gets this module, not a second copy; GPT: the model class of our checkpoints
    if args.checkpoint:
        return GPT.from_checkpoint(args.checkpoint, device)
    # its own vocabulary, unpadded: a padded id has no token, and the prompt check needs the real size
    return GPT.from_hf(args.hf_model, flag="--hf-model", pad_multiple=1).to(device)


def run(args: argparse.Namespace):
    validate_args(args)
    device = resolve_device(args.device)
    enc = get_tokenizer_or_fail()
    model = load_model(args, device)
    n_prompt = len(encode_prompt(enc, args.prompt, model.config.vocab_size))  # refuses ids the model lacks
    if n_prompt >= model.config.block_size:
        print(f"note: the prompt is {n_prompt} tokens; the model sees only the newest {model.config.block_size}",
              file=sys.stderr)
    texts = sample_text(model, enc, device, args.prompt, n=args.num_samples, length=args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                        end_at_eot=not args.continue_past_eot, batch_rows=args.batch_size)
    try:
        for i, text in enumerate(texts, 1):  # a batch at a time: a huge --num-samples never holds them all
            print(f"--- sample {i}/{args.num_samples} ---")
            print(text, flush=True)
    except BrokenPipeError:  # `sample.py ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the flush at exit cannot fail
        sys.exit(141)  # 128 + SIGPIPE, what a shell reports for a filter stopped so; no message


def main(argv=None) -> int:
    args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):  # generated text on a terminal that is not UTF-8
        sys.stdout.reconfigure(errors="replace")
    return exit_code_of(lambda: run(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
