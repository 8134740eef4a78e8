"""train_gpt2.py on a device with less free memory than it has, from the start or from a step on:
the out-of-memory paths of trainkit/runtime/recovery.py (--batch-size auto, a step redone at a smaller micro-batch)
on a real allocation failure, on CPU in the tests and on a GPU in gpu_check.py.

    python benchmarks/squeeze_memory.py --squeeze 600MiB -- --batch-size auto ...   # from the start
    python benchmarks/squeeze_memory.py --squeeze 2:60% -- --batch-size 64 ...       # before step 2

The trainer runs in this process (train_gpt2.main with the flags after --). --squeeze [STEP:]AMOUNT
leaves AMOUNT free before step STEP (or before the trainer starts): an amount in MiB, or a percentage
of what one step needed above the memory held between steps, as measured up to then. On CPU that is
a process memory limit (RLIMIT_AS: the address space may grow by that much, and an allocation beyond
fails as "can't allocate memory"); on CUDA a tensor that takes the rest of the GPU's free memory and
of the allocator's cache. Repeat --squeeze for several; --rank R squeezes one rank of a torchrun.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainkit import cli  # noqa: E402

held = []  # the CUDA tensors that take the memory, alive until the end


def squeeze(amount: str):
    """Leave amount ("600MiB" or "60%" of a step's need so far) free on the trainer's device."""
    import torch
    from trainkit.runtime.recovery import proc_kib

    cuda = torch.cuda.is_available()
    if amount.endswith("%"):  # a step's need: its peak above what the process holds between steps
        need = (
            torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
            if cuda
            else proc_kib("/proc/self/status", "VmPeak") - proc_kib("/proc/self/status", "VmSize")
        )
        leave = int(need * float(amount[:-1]) / 100)
    else:
        leave = int(float(amount.removesuffix("MiB")) * 2**20)
    if cuda:
        free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        held.append(torch.empty(max(0, free - leave), dtype=torch.uint8, device="cuda"))
    else:
        import resource

        limit = proc_kib("/proc/self/status", "VmSize") + leave
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    print(f"squeeze_memory: {leave / 2**20:.0f} MiB left free on {'cuda' if cuda else 'cpu'}", flush=True)


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--squeeze",
        action="append",
        default=[],
        metavar="[STEP:]AMOUNT",
        help="leave AMOUNT (600MiB, or 60%% of a step's need) free before STEP (default: the start)",
    )
    p.add_argument("--rank", type=int, help="under torchrun, squeeze this rank only (default: every rank)")
    p.add_argument("train_args", nargs="*", help="train_gpt2.py's flags, after --")
    args = p.parse_args(argv)
    at_step = {}
    if args.rank is not None and args.rank != int(os.environ.get("RANK", "0")):
        args.squeeze = []
    for spec in args.squeeze:
        step, _, amount = spec.rpartition(":")
        at_step[int(step) if step else None] = amount
    import train_gpt2 as tg

    train_step = tg.Trainer.train_step

    def squeezed_step(self, step):
        if step in at_step:
            squeeze(at_step.pop(step))
        return train_step(self, step)

    tg.Trainer.train_step = squeezed_step
    if None in at_step:
        squeeze(at_step.pop(None))
    return tg.main(args.train_args)


if __name__ == "__main__":
    sys.exit(main())
