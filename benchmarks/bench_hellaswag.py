"""Examples/s of HellaSwag scoring against one example per forward pass (not a test).

Two baselines, each one example (4 rows, padded) per forward pass with logits at every
position: "build-nanogpt" takes the cross-entropy at every position and masks it afterwards,
as build-nanogpt's hellaswag.py does; "all logits" takes it at the ending positions only
(hellaswag.py's path for models other than ours, e.g. --hf-model). hellaswag.py runs our GPT
on packed rows (context once, lm_head only where an ending token is predicted), batched.

    python benchmarks/bench_hellaswag.py                    # 4 layers x 128 wide, first 200 examples, CPU
    python benchmarks/bench_hellaswag.py --batch-sizes 1,4,16,64 --device cuda

A randomly initialized GPT (the scores are meaningless, the work is the same). Each variant
runs --repeats times, interleaved with the others so that load from other processes falls on
all of them alike; the best run counts (the median is printed beside it).
"""

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainkit import cli  # noqa: E402
from trainkit.evaluation import hellaswag_eval, hellaswag_examples  # noqa: E402
from train_gpt2 import GPT, GPTConfig  # noqa: E402


def main():
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=200)
    p.add_argument("--batch-sizes", default="1,2,4,16", help="comma-separated batch sizes for hellaswag.py")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument(
        "--data-file",
        default=hellaswag_examples.SUBSET_FILE,
        help="HellaSwag jsonl (default: the subset in fixtures/, whose first 200 are the full set's)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    torch.manual_seed(0)
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config).to(args.device).eval()
    examples = hellaswag_examples.load_examples(
        hellaswag_examples.resolve_data_file(args.data_file), args.examples
    )  # tokenized untimed
    hellaswag_eval.score_examples(model, examples[:8], args.device, batch_size=4)  # warm-up

    class AllLogits(torch.nn.Module):  # hides our GPT's type: scored through the full logits
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt

        def forward(self, idx):
            return self.gpt(idx)[0]

    @torch.no_grad()
    def build_nanogpt():
        means = []
        for ex in examples:
            tokens, mask, _ = hellaswag_eval.collate([ex], args.block_size)
            tokens, mask = tokens.to(args.device), mask.to(args.device)
            logits = model(tokens)[0]
            losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
            scored = mask[:, 1:]
            means.append((losses.view(4, -1) * scored).sum(1) / scored.sum(1))
        return torch.stack(means).cpu()

    runs = {
        "build-nanogpt": build_nanogpt,
        "all logits": lambda: hellaswag_eval.score_examples(AllLogits(model), examples, args.device, batch_size=1)[1],
    }
    runs.update(
        {b: (lambda b=b: hellaswag_eval.score_examples(model, examples, args.device, batch_size=b)[1]) for b in sizes}
    )
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
    print(
        f"model {config.n_layer}x{config.n_embd}, vocab {config.vocab_size}; {n} examples; device "
        f"{args.device}, {torch.get_num_threads()} threads; best (median) of {args.repeats}"
    )
    base = {name: min(times[name]) for name in ("build-nanogpt", "all logits")}
    print(
        f"{'':34s}  {'ex/s best (median)':>22s}  {'vs build-nanogpt':>16s}  {'vs all logits':>13s}  max |d mean loss|"
    )
    for b in runs:
        diff = (losses[b] - losses["build-nanogpt"]).abs().max().item()
        name = f"{b} (1 example)" if isinstance(b, str) else f"hellaswag.py batch {b:4d}"
        print(
            f"{name:34s}  {n / min(times[b]):10.1f} ({n / statistics.median(times[b]):8.1f})  "
            f"{base['build-nanogpt'] / min(times[b]):15.2f}x  {base['all logits'] / min(times[b]):12.2f}x  "
            f"{diff:.1e}"
        )


if __name__ == "__main__":
    main()
