"""Examples/s of HellaSwag scoring, batched vs one example per forward pass (not a test).

The baseline ("reference") is the straightforward approach: one example (4 rows) per forward
pass, logits at every position, loss picked out afterwards. hellaswag.py runs our GPT's
lm_head only at the ending positions and batches examples.

    python benchmarks/bench_hellaswag.py                    # 4 layers x 128 wide, first 200 examples, CPU
    python benchmarks/bench_hellaswag.py --batch-sizes 1,2,4,16,64 --device cuda

A randomly initialized GPT (the scores are meaningless, the work is the same). Each batch size
runs --repeats times, interleaved with the others so that load from other processes falls on
all of them alike; the best run counts (the median is printed beside it).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hellaswag as hs  # noqa: E402
from train_gpt2 import GPT, GPTConfig  # noqa: E402

SHARED_COPY = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "shared",
                           "data", "hellaswag", "hellaswag_val.jsonl")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=200)
    p.add_argument("--batch-sizes", default="1,4,16", help="comma-separated; the first is the baseline")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--data-file", default=SHARED_COPY if os.path.isfile(SHARED_COPY) else None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    torch.manual_seed(0)
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config).to(args.device).eval()
    examples = hs.load_examples(hs.resolve_data_file(args.data_file), args.examples)  # tokenized untimed
    hs.score_examples(model, examples[:8], args.device, batch_size=4)  # warm-up

    class AllLogits(torch.nn.Module):  # hides our GPT's type: scored through the full logits
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt

        def forward(self, idx):
            return self.gpt(idx)[0]

    runs = {"reference": lambda: hs.score_examples(AllLogits(model), examples, args.device, batch_size=1)[1]}
    runs.update({b: (lambda b=b: hs.score_examples(model, examples, args.device, batch_size=b)[1]) for b in sizes})
    times = {b: [] for b in runs}
    losses = {}
    for _ in range(args.repeats):
        for b, run in runs.items():
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses[b] = run()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[b].append(time.perf_counter() - t0)

    n = len(examples)
    print(f"model {config.n_layer}x{config.n_embd}, vocab {config.vocab_size}; {n} examples; device "
          f"{args.device}, {torch.get_num_threads()} threads; best (median) of {args.repeats}")
    base = min(times["reference"])
    for b in runs:
        diff = (losses[b] - losses["reference"]).abs().max().item()
        name = "reference (1 example, all logits)" if b == "reference" else f"hellaswag.py batch {b:4d}"
        print(f"{name:34s}: {n / min(times[b]):8.1f} ex/s ({n / statistics.median(times[b]):8.1f})  "
              f"x{base / min(times[b]):5.2f}  max |d mean loss| {diff:.1e}")


if __name__ == "__main__":
    main()
