"""One launch on one or many processes: the device, the torchrun process group, what rank 0 decides for all,
the ranks' agreement on flags and data, and one line per rank failure (a dead peer: a RankLost, no traceback)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainkit.cli import RankLocalError, UserError, exit_code_of, flat, print_line, reason_of
from trainkit.data.shards import data_fingerprint, differing_file
from trainkit.train_flags import flag_name


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def enabled(self):
        return self.world_size > 1 or dist.is_initialized()

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def device_type(self):
        return torch.device(self.device).type  # cuda, mps or cpu


def resolve_device(device: str) -> str:
    """--device checked against what torch sees: auto picks CUDA, else Apple's MPS, else the CPU."""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", device):
        raise UserError(f"--device {device}: expected auto, cpu, cuda, cuda:N or mps")
    mps = torch.backends.mps.is_available()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} asked for, but torch sees no CUDA device")
    if device == "mps" and not mps:
        raise UserError("--device mps asked for, but torch sees no MPS device (Apple silicon, macOS 12.3+)")
    return device


# what torchrun sets in each process it starts; a launch by hand (a cluster's own script) sets them too
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def setup_distributed(device: str = "auto", timeout_s: float = 600.0) -> Dist:
    """Join torchrun's process group where its variables are set (NCCL on CUDA, else gloo), else one process; one
    line for a variable missing or wrong (each rank's own: RankLocalError) or ranks not all there by timeout_s."""
    device = resolve_device(device)
    env = {k: os.environ.get(k, "") for k in LAUNCH_VARIABLES}
    if not any(env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return Dist(device=device)
    how = "launch with torchrun, which sets them all, or unset RANK, LOCAL_RANK and WORLD_SIZE to run one process"
    given = [f"{k}={v}" for k, v in env.items() if v]
    for name, value in env.items():
        if not value:
            raise RankLocalError(
                f"{name} is not set, but {', '.join(given)} {'is' if len(given) == 1 else 'are'}: {how}"
            )
        if name != "MASTER_ADDR" and not value.isdigit():
            raise RankLocalError(f"{name}={value!r} is not a whole number: {how}")
    rank, local_rank, world = (int(env[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if rank >= world:
        raise RankLocalError(f"RANK={rank} with WORLD_SIZE={world}: the ranks are 0..WORLD_SIZE-1; {how}")
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    try:  # device_id binds NCCL's communicator to this rank's GPU (else barrier() warns and guesses it)
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch.device(device) if cuda else None,
        )
    except dist.DistError as e:  # the store at MASTER_ADDR:MASTER_PORT: not every rank came, or none answers
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        raise RankLocalError(
            f"could not gather the WORLD_SIZE={world} ranks of this launch at {where} "
            f"within {timeout_s:g} s ({reason_of(e, typed=True).split('. ')[0]}): start all "
            f"{world} ranks (torchrun does), or unset RANK, LOCAL_RANK and WORLD_SIZE to run one "
            "process"
        ) from None
    return Dist(rank=rank, local_rank=local_rank, world_size=world, device=device)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place (gloo has no AVG; callers divide themselves)."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def decided_on_rank0(dist_state: Dist, decide):
    """decide() on rank 0 only (which writes --out-dir), its result sent to every rank; a UserError there is
    raised on every rank, so that none waits in a collective for one that stopped."""
    answer = [None, None]  # (result, refusal)
    if dist_state.is_main:
        try:
            answer[0] = decide()
        except UserError as e:
            answer[1] = str(e)
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise UserError(answer[1])
    return answer[0]


class AgreedUserError(UserError):
    """A UserError every rank raised alike (checked_on_every_rank): they leave the group together."""


def checked_on_every_rank(dist_state: Dist, action):
    """This rank's action(), where each rank may fail on what only it sees: after one all-gather, if any raised
    a UserError every rank raises the lowest rank's (named by rank but rank 0's), which rank 0 prints once."""
    result, refusal = None, None
    try:
        result = action()
    except UserError as e:
        refusal = str(e)
    if dist.is_initialized():
        refusals = [None] * dist.get_world_size()
        dist.all_gather_object(refusals, refusal)
        rank, refusal = next(((r, m) for r, m in enumerate(refusals) if m is not None), (0, None))
        refusal = f"rank {rank}: {refusal}" if refusal is not None and rank else refusal
    if refusal is not None:
        raise (AgreedUserError if dist.is_initialized() else UserError)(refusal)
    return result


class RankLost(Exception):
    """Another rank died (or stopped answering) and a collective failed: each survivor prints its one `error:`
    line and exits 1 (not a UserError: the input was fine, and rank 0 may be the rank that died)."""


def is_lost_rank(e: BaseException) -> bool:
    """A collective failed because a peer is gone (gloo: a RuntimeError naming its socket; NCCL: a DistError)."""
    return isinstance(e, dist.DistError) or (
        isinstance(e, RuntimeError) and re.search(r"gloo|nccl|connection (closed|reset)|timed out", str(e), re.I)
    )


def lost_rank_error(e: BaseException, rank: int, last_ckpt: str | None, saves: bool = True) -> RankLost:
    """The line for a failed collective; saves: the command writes checkpoints (so name the last)."""
    # gloo: "[.../pair.cc:553] Connection closed by peer [127.0.0.1]:14728. This is typically ..."
    reason = reason_of(e).split(". ")[0]
    checkpoint = f". Last good checkpoint: {last_ckpt or 'none'}" if saves else ""
    checkpoint += " (resume with the same command plus --resume)" if saves and last_ckpt else ""
    return RankLost(
        f"rank {rank}: another rank of this launch died or stopped answering ({reason}), so this rank "
        f"stopped too; torchrun's report below names the rank that failed first{checkpoint}"
    )


@contextlib.contextmanager
def process_group(device: str = "auto", timeout_s: float = 600.0, last_checkpoint=None):
    """One command's work in the process group, each fault one line: the ranks meet before teardown, a dead peer
    is a RankLost (naming last_checkpoint()), and after a UserError torchrun's SIGTERM cannot cut rank 0 short."""
    dist_state = setup_distributed(device, timeout_s)
    try:
        yield dist_state
        if dist_state.enabled:
            dist.barrier()
    except UserError as e:
        if dist_state.enabled:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if isinstance(e, AgreedUserError):  # every rank is here: wait for each other, as at a good end
                with contextlib.suppress(Exception):  # (a peer gone meanwhile: the line still comes)
                    dist.barrier()
        raise
    except Exception as e:
        if dist_state.enabled and is_lost_rank(e):  # another rank died during set-up, evaluation or the last barrier
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun SIGTERMs the survivors: print the line first
            raise lost_rank_error(
                e, dist_state.rank, last_checkpoint and last_checkpoint(), saves=bool(last_checkpoint)
            ) from None
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_code_on_every_rank(action, debug: bool = False) -> int:
    """exit_code_of(action), where a RankLost is printed by every surviving rank and exits 1."""
    try:
        return exit_code_of(action, debug)
    except RankLost as e:
        if debug:
            raise
        print_line(f"error: {flat(e)}", file=sys.stderr)
        return 1


def first_difference(rank: int, mine: list, theirs: list) -> str | None:
    """The first item where rank's launch fingerprint (mine) differs from rank 0's (theirs), in words."""
    for (what, a), (_, b) in zip(theirs, mine):
        if a == b:
            continue
        if what.startswith("--"):
            return f"{what} {a} on rank 0 but {what} {b} on rank {rank}"
        name, on_0, on_rank = differing_file(a, b)
        return f"{what}: {name} is {on_0} on rank 0 but {on_rank} on rank {rank}"
    return None


def check_ranks_agree(run):
    """Under torchrun, refuse ranks started with other flags or data (a rank that leaves early hangs a
    collective; another --max-lr drifts silently): one all-gather; every rank raises the same error."""
    fingerprint = [(flag_name(name), value) for name, value in dataclasses.asdict(run).items()]
    fingerprint += data_fingerprint(run.data_dir)
    if not dist.is_initialized():
        return
    fingerprints = [None] * dist.get_world_size()
    dist.all_gather_object(fingerprints, fingerprint)
    for rank, fingerprint in enumerate(fingerprints[1:], start=1):
        difference = first_difference(rank, fingerprint, fingerprints[0])
        if difference:
            # torchrun SIGTERMs the others once one has exited: every rank ignores it first, so rank 0 prints the line
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            dist.barrier()
            raise UserError(
                f"the ranks of this launch were started differently: {difference}; "
                "every rank needs the same command and the same --data-dir files"
            )
