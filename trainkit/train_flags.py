"""The command line of train_gpt2.py: its flags in groups, each with its help string, as llm.c lays
them out, and the checks of a run's values (validate_flag_values, validate_config), in one place.
Standard library only, and it imports nothing of the trainer, which hands it the preset names and
sets the defaults from its config dataclass (RunConfig): so `--help` and a usage error answer
before torch is imported.
"""
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


def batch_size_flag(text: str) -> int | str:
    """--batch-size: a number of rows, or auto."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of rows or auto, got {text!r}") from None
    return cli.check_count(value, 1)


def build_parser(model_presets, cpu_loss_chunk: int) -> argparse.ArgumentParser:
    """The flags, without defaults: the trainer sets them from its RunConfig (set_defaults)."""
    p = cli.ArgumentParser(description="Pretrain GPT-2 on token shards (torchrun for several GPUs).",
                           formatter_class=cli.HelpFormatter)
    g = p.add_argument_group("data and output")
    g.add_argument("--data-dir", help="folder of *_train_*/*_val_* shards (.npy or llm.c .bin)")
    g.add_argument("--out-dir", help="log.jsonl and checkpoints go here")
    g.add_argument("--align-docs", action="store_true", help="start rows at document boundaries; pad row tails (targets -1)")
    g.add_argument("--shuffle", action=argparse.BooleanOptionalAction,
                   help="seeded permutation of shard order and row order each epoch (default: on; a resumed run "
                        "keeps its checkpoint's order); --no-shuffle reads shards and rows front to back")
    g.add_argument("--doc-mask", action="store_true",
                   help="each token attends only to its own document of the row (split at <|endoftext|>), positions "
                        "from the document's start: packed documents train as if alone; validation too (doc_mask.py)")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(model_presets), help="size preset (default gpt2); the flags below override it")
    g.add_argument("--n-layer", type=cli.positive_int, help="transformer blocks")
    g.add_argument("--n-head", type=cli.positive_int, help="attention heads")
    g.add_argument("--n-embd", type=cli.positive_int, help="embedding width")
    g.add_argument("--block-size", type=cli.positive_int, help="longest sequence the model handles")
    g.add_argument("--vocab-size", type=cli.positive_int, help="vocabulary size (default 50304: GPT-2's 50257 padded)")
    g.add_argument("--init-from", help="start from Hugging Face GPT-2 weights: gpt2, gpt2-medium, gpt2-large, "
                   "gpt2-xl (Hub) or a local directory; sets the model shape")
    g = p.add_argument_group("batch")
    g.add_argument("--batch-size", type=batch_size_flag,
                   help="rows per rank per micro-step (B), or auto: the largest that fits the device, found by "
                        "trying before the first step (default: auto on CUDA, 64 elsewhere)")
    g.add_argument("--seq-len", type=cli.positive_int, help="tokens per row (T); default: the model's block size")
    g.add_argument("--total-batch-size", type=cli.positive_int,
                   help="tokens per optimizer step over all ranks; a multiple of B x T x world size")
    g = p.add_argument_group("optimization")
    g.add_argument("--max-steps", type=cli.non_negative_int, help="optimizer steps")
    g.add_argument("--warmup-steps", type=cli.non_negative_int, help="linear LR warmup steps")
    g.add_argument("--max-lr", type=float, help="peak learning rate")
    g.add_argument("--min-lr", type=float, help="final learning rate (default: 10%% of --max-lr)")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES,
                   help="decay after warmup: cosine or linear to --min-lr at --max-steps; wsd holds --max-lr, "
                        "then decays linearly over the last --cooldown-frac of the steps")
    g.add_argument("--cooldown-frac", type=float,
                   help="wsd: fraction of --max-steps spent in the final linear decay")
    g.add_argument("--weight-decay", type=float, help="AdamW decay on matrices and embeddings")
    g.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="adamw: AdamW on every parameter (GPT-2's recipe); muon: Muon on the blocks' weight "
                        "matrices, AdamW at --max-lr on embeddings, LayerNorms and biases (docs/optimizers.md)")
    g.add_argument("--muon-lr", type=float, help="Muon's peak LR; the LR schedule scales it as it scales --max-lr")
    g.add_argument("--muon-momentum", type=float, help="Muon's (Nesterov) momentum")
    g.add_argument("--grad-clip", type=float, help="clip the gradient norm to this (0: off)")
    g = p.add_argument_group("evaluation and checkpoints (0 disables each)")
    g.add_argument("--val-every", type=cli.non_negative_int, help="validation loss every N steps")
    g.add_argument("--val-steps", type=cli.non_negative_int, help="batches per validation")
    g.add_argument("--sample-every", type=cli.non_negative_int, help="print text samples every N steps")
    g.add_argument("--sample-prompt", type=cli.may_be_empty, help="the text those samples continue; fit it to the data, e.g. 'def ' for "
                                           "Python ('' starts a new document; default: \"Hello, I'm a language model,\")")
    g.add_argument("--hellaswag-every", type=cli.non_negative_int, help="HellaSwag accuracy every N steps")
    g.add_argument("--hellaswag-limit", type=cli.non_negative_int, help="examples per HellaSwag eval (0: all)")
    g.add_argument("--hellaswag-file", help="local hellaswag_val.jsonl (default: download/cache)")
    g.add_argument("--ckpt-every", type=cli.non_negative_int, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep-last", type=cli.non_negative_int, help="keep only the newest K checkpoints (0: all)")
    g.add_argument("--resume", nargs="?", const="latest",
                   help="continue from the newest checkpoint in --out-dir (or the given path)")
    g.add_argument("--eval-only", action="store_true",
                   help="with --resume [PATH] or --init-from: run the evaluations above once at that step "
                        "(same numbers as in training), print them, train and write nothing")
    g = p.add_argument_group("run tracking (rank 0; each gets exactly the records of log.jsonl)")
    g.add_argument("--wandb", metavar="PROJECT", help="log to this Weights & Biases project (pip install wandb; "
                   "WANDB_MODE=offline keeps the run in OUT/wandb)")
    g.add_argument("--tensorboard", action="store_true",
                   help="write TensorBoard event files to --out-dir (pip install tensorboard)")
    g = p.add_argument_group("failures")
    g.add_argument("--skip-nonfinite", type=cli.non_negative_int,
                   help="skip up to N steps with a non-finite loss or grad norm instead of stopping")
    g.add_argument("--skip-spikes", type=float,
                   help="skip updates whose loss or grad norm is Z std devs above the recent window (0: off)")
    g.add_argument("--dist-timeout", type=float,
                   help="seconds a collective may wait for a dead or stuck rank")
    g.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    g = p.add_argument_group("distributed")
    g.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and AdamW state over the ranks (FSDP2, under torchrun): "
                        "for models whose 16 bytes per parameter do not fit one GPU")
    g = p.add_argument_group("runtime")
    g.add_argument("--device",
                   help="auto (CUDA, else MPS, else CPU), cpu, cuda, cuda:N or mps (Apple; untested)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="autocast dtype; auto: bfloat16 on CUDA GPUs of compute capability 8.0+, float16 "
                        "(with a GradScaler) on older ones, float32 elsewhere")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="torch.compile the model (default: on for CUDA where Triton can run, off elsewhere); "
                        "a failure to compile falls back to eager with one line")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward: less memory, about 1/3 more compute")
    g.add_argument("--loss-chunk", type=cli.non_negative_int,
                   help="compute lm_head + loss in chunks of N rows without materializing the logits "
                        f"(0: off; default {cpu_loss_chunk} on CPU, off on CUDA)")
    g.add_argument("--seed", type=SEED, help="seed for init and shuffling")
    g.add_argument("--peak-tflops", type=float,
                   help="dense peak TFLOP/s of one device, for MFU (default: looked up by GPU name; none on CPU)")
    return p


MIN_DIST_TIMEOUT = 30.0  # seconds


def validate_flag_values(run, model):
    """Checks of single flags that must pass before anything uses them (--dist-timeout is used
    when joining the process group, before validate_config can run). Integer flags are checked
    as they are parsed (cli.int_in)."""
    for name, value in [*dataclasses.asdict(run).items(), *dataclasses.asdict(model).items()]:
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, float) and not math.isfinite(value):  # argparse's float() takes nan and inf
            raise UserError(f"{flag} must be a finite number, got {value}")
    if not MIN_DIST_TIMEOUT <= run.dist_timeout <= 1e9:  # a timedelta overflows far above that
        raise UserError(f"--dist-timeout must be in [{MIN_DIST_TIMEOUT}, 1e9] seconds, got {run.dist_timeout}: "
                        "healthy ranks wait this long for each other (rank 0 writing a checkpoint or samples, "
                        "the first step compiling), and a shorter wait reports them as dead")


def validate_config(run, model, world_size: int, device_type: str) -> int:
    """Check the run (a RunConfig) and its model (a GPTConfig) as a whole, before any work, and set
    --batch-size's default for the device. Returns the rows each rank reads per optimizer step, which
    --batch-size (a number) divides; auto chooses a divisor later (fit_batch.py)."""
    from trainkit.tokenizer import GPT2_VOCAB  # (numpy and tiktoken: not for --help)
    if run.batch_size is None:
        run.batch_size = "auto" if device_type == "cuda" else 64
    B = 1 if run.batch_size == "auto" else run.batch_size
    if model.n_embd % model.n_head:
        raise UserError(f"--n-embd {model.n_embd} is not divisible by --n-head {model.n_head}")
    if run.seq_len > model.block_size:
        raise UserError(f"--seq-len {run.seq_len} is longer than the model's --block-size {model.block_size}")
    micro_tokens = B * run.seq_len * world_size
    if run.total_batch_size % micro_tokens:
        batch_size = ("", "") if run.batch_size == "auto" else ("batch_size x ", f"{B} x ")
        raise UserError(f"--total-batch-size {run.total_batch_size} is not divisible by {batch_size[0]}seq_len x "
                        f"world_size = {batch_size[1]}{run.seq_len} x {world_size} = {micro_tokens}")
    if run.max_lr <= 0 or (run.min_lr is not None and not 0 <= run.min_lr <= run.max_lr):
        raise UserError(f"need 0 < --max-lr and 0 <= --min-lr <= --max-lr (got {run.max_lr}, {run.min_lr})")
    if run.peak_tflops is not None and run.peak_tflops <= 0:
        raise UserError(f"--peak-tflops must be positive, got {run.peak_tflops}")
    if run.lr_schedule not in LR_SCHEDULES:
        raise UserError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {run.lr_schedule!r}")
    if not 0 <= run.cooldown_frac <= 1:
        raise UserError(f"--cooldown-frac must be in [0, 1], got {run.cooldown_frac}")
    if run.lr_schedule == "wsd" and run.warmup_steps > run.cooldown_start:
        raise UserError(f"--warmup-steps {run.warmup_steps} runs into the cooldown, which starts at step "
                        f"{run.cooldown_start} (--max-steps x (1 - --cooldown-frac)): lower one of them")
    if run.eval_only and run.resume is None and run.init_from is None:
        raise UserError("--eval-only needs weights to evaluate: --resume [PATH] or --init-from NAME_OR_DIR")
    if run.eval_only and (run.wandb or run.tensorboard):
        raise UserError("--eval-only writes nothing, so it does not log to --wandb or --tensorboard either")
    if run.eval_only and not (run.val_every or run.hellaswag_every or run.sample_every):
        raise UserError("--eval-only with --val-every 0, --hellaswag-every 0 and --sample-every 0 has nothing to do")
    if run.grad_clip < 0 or run.weight_decay < 0 or run.skip_spikes < 0:
        raise UserError("--grad-clip, --weight-decay and --skip-spikes must be >= 0")
    if run.val_every and not run.val_steps:
        raise UserError("--val-steps 0 with --val-every > 0 evaluates nothing: pass --val-steps N or --val-every 0")
    text_flags = [flag for flag, on in (("--sample-every 0", run.sample_every),
                                        ("--hellaswag-every 0", run.hellaswag_every)) if on]
    if model.vocab_size < GPT2_VOCAB and text_flags:
        raise UserError(f"--vocab-size {model.vocab_size} is smaller than GPT-2's {GPT2_VOCAB} tokens, which "
                        f"sampling and HellaSwag feed the model: pass {' '.join(text_flags)}")
    if run.optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {run.optimizer!r}")
    if run.muon_lr <= 0 or not 0 <= run.muon_momentum < 1:
        raise UserError(f"need --muon-lr > 0 and 0 <= --muon-momentum < 1 (got {run.muon_lr}, {run.muon_momentum})")
    if run.fsdp and run.optimizer == "muon":  # Newton-Schulz orthogonalizes whole matrices; FSDP holds 1/W of each
        raise UserError("--optimizer muon does not run under --fsdp (Muon needs each whole weight matrix, which "
                        "FSDP splits over the ranks): drop --fsdp (DDP) or use --optimizer adamw")
    if run.fsdp and world_size < 2:
        raise UserError("--fsdp shards the model over the processes of a torchrun launch and needs at "
                        "least 2; with one process drop --fsdp (it would hold the whole model anyway)")
    return run.total_batch_size // (run.seq_len * world_size)
