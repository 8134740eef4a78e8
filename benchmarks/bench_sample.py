"""Tokens/s of sampling with the KV cache against without it (not a test).

Three ways to draw the same tokens from the same model and generator:
- "reference": nanoGPT's loop: a full forward pass over the whole window for every new
  token, logits at every position, the last one kept;
- "no cache": sampling.generate(kv_cache=False): the whole window each step, lm_head on the last
  position only;
- "kv cache": sampling.generate(): each step feeds only the new token (what sample.py runs).

    python benchmarks/bench_sample.py                         # cpu preset, 4 samples x 200 tokens
    python benchmarks/bench_sample.py --model gpt2 --new-tokens 100
    python benchmarks/bench_sample.py --device cuda --model gpt2 --new-tokens 500

A randomly initialized GPT (the text is noise, the work is the same). The variants run
interleaved, --rounds times, so that load from other processes falls on all of them alike; the
best round counts. The prompt plus the new tokens stay within the block size (beyond it the
window slides and the cache is rebuilt every step: no gain there).
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainkit import cli  # noqa: E402
from trainkit.evaluation import sampling  # noqa: E402
from train_gpt2 import GPT, GPTConfig, MODEL_PRESETS  # noqa: E402


@torch.no_grad()
def reference_generate(model, idx, max_new_tokens, top_k, generator):
    """nanoGPT's sampling loop: full logits of the whole window for every token."""
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.block_size :])
        probs = F.softmax(logits[:, -1, :].float(), dim=-1)
        topk_probs, topk_idx = torch.topk(probs, top_k, dim=-1)
        choice = torch.multinomial(topk_probs, 1, generator=generator)
        idx = torch.cat((idx, torch.gather(topk_idx, -1, choice)), dim=1)
    return idx


def main():
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cpu", choices=sorted(MODEL_PRESETS), help="size preset")
    p.add_argument("--samples", type=int, default=4, help="sequences decoded together (batch)")
    p.add_argument("--prompt-tokens", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = GPTConfig(**MODEL_PRESETS[args.model])
    if args.prompt_tokens + args.new_tokens > config.block_size:
        p.error(f"--prompt-tokens + --new-tokens must fit the block size {config.block_size}")
    model = GPT(config).to(args.device).eval()
    prompt = torch.randint(0, 50257, (args.samples, args.prompt_tokens), device=args.device)

    def generator():
        return torch.Generator(device=args.device).manual_seed(1)

    variants = {
        "reference": lambda: reference_generate(model, prompt, args.new_tokens, args.top_k, generator()),
        "no cache": lambda: sampling.generate(
            model, prompt, args.new_tokens, top_k=args.top_k, generator=generator(), kv_cache=False
        ),
        "kv cache": lambda: sampling.generate(model, prompt, args.new_tokens, top_k=args.top_k, generator=generator()),
    }
    sampling.generate(model, prompt, 4, top_k=args.top_k)  # warm-up
    best, tokens = {}, {}
    for _ in range(args.rounds):
        for name, run in variants.items():
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens[name] = run()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)

    n_new = args.samples * args.new_tokens
    print(
        f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params | {args.samples} samples x "
        f"{args.new_tokens} new tokens after {args.prompt_tokens} | top-k {args.top_k} | {args.device} | "
        f"{torch.get_num_threads()} threads | best of {args.rounds}"
    )
    for name in variants:
        same = "same tokens as kv cache" if torch.equal(tokens[name], tokens["kv cache"]) else "DIFFERENT tokens"
        print(
            f"{name:10s} | {n_new / best[name]:8,.0f} tok/s | {best[name]:7.2f} s | "
            f"{best['reference'] / best[name]:5.2f}x reference | {best['no cache'] / best[name]:5.2f}x no cache | "
            f"{same}"
        )


if __name__ == "__main__":
    main()
