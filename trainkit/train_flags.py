"""train_gpt2.py's command line, built from RunConfig's fields (each declares its flag once), and the checks of
its values. Standard library only: `--help` and a usage error answer before torch is imported."""

from __future__ import annotations

import argparse
import dataclasses
import math

from trainkit import cli
from trainkit.cli import UserError

LR_SCHEDULES = ("cosine", "wsd", "linear")  # the decays train_gpt2.get_lr knows
SEED = cli.int_in(0, 2**64 - 1)  # numpy's generators (--shuffle) refuse negative seeds, torch larger ones
OPTIMIZERS = ("adamw", "muon")  # train_gpt2.build_optimizer's
SAMPLE_PROMPT = "Hello, I'm a language model,"  # what --sample-every's samples continue (sample.py's default)
MIN_DIST_TIMEOUT = 30.0  # seconds
CPU_LOSS_CHUNK = 128  # rows per chunk of the chunked loss on CPU: 26 MB of fp32 logits, which malloc
# reuses; from 32 MB glibc maps every allocation afresh (256 rows: 16x the page faults, ~12% slower)


def flag_group(group: str):
    """GROUP(default, help, check=None, **options): a RunConfig field and its flag in this --help group; check:
    (name, value) -> error line or None; argparse's options (a False default without an action: a switch)."""
    return lambda default, help, check=None, **options: dataclasses.field(
        default=default, metadata=dict(help=help, group=group, check=check, options=options)
    )


def flag_name(field_name: str) -> str:
    return f"--{field_name.replace('_', '-')}"


def given_flags(parser: argparse.ArgumentParser, argv, config_class) -> frozenset[str]:
    """The fields of config_class whose flag argv gives (parsed over a namespace argparse leaves unset)."""
    unsaid = object()
    namespace = argparse.Namespace(**{field.name: unsaid for field in dataclasses.fields(config_class)})
    return frozenset(name for name, value in vars(parser.parse_args(argv, namespace)).items() if value is not unsaid)


# what an evaluation of a checkpoint keeps of its own command: where and how it runs and prints
EVALUATION_OWN_FLAGS = frozenset(
    "eval_only resume init_from out_dir device dtype compile debug dist_timeout wandb tensorboard fsdp "
    "activation_checkpointing loss_chunk peak_tflops".split()
)


def as_trained(run, saved: dict, given: frozenset[str]):
    """--eval-only --resume: every flag the command does not give (but EVALUATION_OWN_FLAGS) as the
    checkpoint's run had it (saved: its run_config), so that it evaluates as its training did; checked."""
    taken = {f.name for f in dataclasses.fields(run)} & saved.keys() - given - EVALUATION_OWN_FLAGS
    evaluated = dataclasses.replace(run, **{name: saved[name] for name in taken})
    check_flags(evaluated)
    return evaluated


def build_parser(config_class, description: str) -> argparse.ArgumentParser:
    """The flags of config_class's fields, in their order, in groups in the order each first appears."""
    p = cli.ArgumentParser(description=description, formatter_class=cli.HelpFormatter)
    groups = {}
    for field in dataclasses.fields(config_class):
        meta = field.metadata
        group = groups.get(meta["group"]) or groups.setdefault(meta["group"], p.add_argument_group(meta["group"]))
        options = dict(meta["options"])
        if field.default is False and "action" not in options:
            options["action"] = "store_true"
        group.add_argument(flag_name(field.name), default=field.default, help=meta["help"], **options)
    return p


def batch_size_flag(text: str) -> int | str:
    """--batch-size: a number of rows, or auto."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of rows or auto, got {text!r}") from None
    return cli.check_count(value, 1)


# the checks of one field (flag_group's check): its value -> the error line, or None


def one_of(choices):
    def check(name, value):
        return None if value in choices else f"{flag_name(name)} must be one of {', '.join(choices)}, got {value!r}"

    return check


def positive(name, value):
    return None if value is None or value > 0 else f"{flag_name(name)} must be positive, got {value}"


def in_unit_interval(name, value):
    return None if 0 <= value <= 1 else f"{flag_name(name)} must be in [0, 1], got {value}"


def dist_timeout_range(name, value):
    if MIN_DIST_TIMEOUT <= value <= 1e9:  # a timedelta overflows far above that
        return None
    return (
        f"--dist-timeout must be in [{MIN_DIST_TIMEOUT}, 1e9] seconds, got {value}: healthy ranks wait this "
        "long for each other (rank 0 writing a checkpoint or samples, the first step compiling), and a shorter "
        "wait reports them as dead"
    )


def check_flags(run):
    """Each field's own check, before anything uses the values: every float finite (argparse's float() takes
    nan), the fields' checks in flag order, --init-from without shape flags, --eval-only without trackers."""
    fields = dataclasses.fields(run)
    for field in fields:
        value = getattr(run, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{flag_name(field.name)} must be a finite number, got {value}")
    for field in fields:
        check = field.metadata["check"]
        problem = check and check(field.name, getattr(run, field.name))
        if problem:
            raise UserError(problem)
    if run.init_from:  # the weights set the shape: --n-layer and friends would be silently dropped
        shape_flags = [flag_name(name) for name in ("model", "n_layer", "n_head", "n_embd") if getattr(run, name)]
        if shape_flags:
            raise UserError(
                f"--init-from {run.init_from} takes the model's shape from its weights: drop "
                f"{', '.join(shape_flags)} (--block-size and --vocab-size may still shrink or pad it)"
            )
    if run.eval_only and (run.wandb or run.tensorboard):  # (before --eval-only --resume reads its checkpoint)
        raise UserError("--eval-only writes nothing, so it does not log to --wandb or --tensorboard either")


def check_run(run, model, seq_len: int, batch_size: int | str, world_size: int):
    """The checks between fields of a RunConfig and its GPTConfig, with seq_len and batch_size resolved."""
    from trainkit.data.tokenizer import GPT2_VOCAB  # (numpy and tiktoken: not for --help)

    if model.n_embd % model.n_head:
        raise UserError(f"--n-embd {model.n_embd} is not divisible by --n-head {model.n_head}")
    if seq_len > model.block_size:
        raise UserError(f"--seq-len {seq_len} is longer than the model's --block-size {model.block_size}")
    auto = batch_size == "auto"
    B = 1 if auto else batch_size
    micro_tokens = B * seq_len * world_size
    if run.total_batch_size % micro_tokens:
        batch_size = ("", "") if auto else ("batch_size x ", f"{B} x ")
        raise UserError(
            f"--total-batch-size {run.total_batch_size} is not divisible by {batch_size[0]}seq_len x "
            f"world_size = {batch_size[1]}{seq_len} x {world_size} = {micro_tokens}"
        )
    if run.max_lr <= 0 or (run.min_lr is not None and not 0 <= run.min_lr <= run.max_lr):
        raise UserError(f"need 0 < --max-lr and 0 <= --min-lr <= --max-lr (got {run.max_lr}, {run.min_lr})")
    if run.lr_schedule == "wsd" and run.warmup_steps > run.cooldown_start:
        raise UserError(
            f"--warmup-steps {run.warmup_steps} runs into the cooldown, which starts at step "
            f"{run.cooldown_start} (--max-steps x (1 - --cooldown-frac)): lower one of them"
        )
    if run.eval_only and run.resume is None and run.init_from is None:
        raise UserError("--eval-only needs weights to evaluate: --resume [PATH] or --init-from NAME_OR_DIR")
    if run.eval_only and not (run.val_every or run.hellaswag_every or run.sample_every):
        raise UserError("--eval-only with --val-every 0, --hellaswag-every 0 and --sample-every 0 has nothing to do")
    if run.grad_clip < 0 or run.weight_decay < 0 or run.skip_spikes < 0:
        raise UserError("--grad-clip, --weight-decay and --skip-spikes must be >= 0")
    if run.val_every and not run.val_steps:
        raise UserError("--val-steps 0 with --val-every > 0 evaluates nothing: pass --val-steps N or --val-every 0")
    text_flags = [f"{flag_name(name)} 0" for name in ("sample_every", "hellaswag_every") if getattr(run, name)]
    if model.vocab_size < GPT2_VOCAB and text_flags:
        raise UserError(
            f"--vocab-size {model.vocab_size} is smaller than GPT-2's {GPT2_VOCAB} tokens, which "
            f"sampling and HellaSwag feed the model: pass {' '.join(text_flags)}"
        )
    if run.muon_lr <= 0 or not 0 <= run.muon_momentum < 1:
        raise UserError(f"need --muon-lr > 0 and 0 <= --muon-momentum < 1 (got {run.muon_lr}, {run.muon_momentum})")
    if run.fsdp and run.optimizer == "muon":  # Newton-Schulz orthogonalizes whole matrices; FSDP holds 1/W of each
        raise UserError(
            "--optimizer muon does not run under --fsdp (Muon needs each whole weight matrix, which "
            "FSDP splits over the ranks): drop --fsdp (DDP) or use --optimizer adamw"
        )
    if run.fsdp and world_size < 2:
        raise UserError(
            "--fsdp shards the model over the processes of a torchrun launch and needs at "
            "least 2; with one process drop --fsdp (it would hold the whole model anyway)"
        )
