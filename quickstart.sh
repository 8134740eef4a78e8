#!/usr/bin/env bash
# From a fresh clone to a trained GPT-2 with its loss curve, evaluation and samples:
#
#   bash quickstart.sh                    # everything, with the defaults below
#   bash quickstart.sh --max-steps 300    # extra arguments go to train_gpt2.py and override them
#                                         # (python train_gpt2.py --help lists them)
#
# 1. a virtual environment (.venv) with torch (the CPU build where there is no NVIDIA GPU,
#    else the CUDA build) and requirements.txt (+ matplotlib);
# 2. the Python standard library's sources, which every machine has, tokenized by fineweb.py
#    into data/stdlib (~2M tokens: 256K-token shards, the first one is validation);
# 3. training: on a CPU the `cpu` preset (4 layers, 128 wide; 100 steps of 2048 tokens, a few
#    minutes), on a GPU the GPT-2 124M shape on the same data (200 steps of 128K tokens), with
#    the trainer's GPU defaults (bf16, torch.compile), into out/quickstart (out/quickstart-gpu);
# 4. HellaSwag on its first 200 examples (QUICKSTART_HELLASWAG_ARGS may ask for another number):
#    the validation set from HELLASWAG_DIR or downloaded; offline, the subset shipped in fixtures/
#    (its first 200 examples are the same), said so in the output;
# 5. the loss curve (OUT/loss.png, plot_log.py) and a few samples (sample.py).
#
# Rerunning reuses what is done: the environment, the tokenized data, and the checkpoints
# (training resumes with --resume; a finished run just evaluates again). Delete data/stdlib
# or the out folder to start over.
#
# Environment variables:
#   TIKTOKEN_CACHE_DIR       optional: a tiktoken cache holding the GPT-2 BPE (r50k_base), used first;
#                            without it the copy this repository ships in bpe/ is used (no download)
#   HELLASWAG_DIR            where hellaswag_val.jsonl is looked for / downloaded to
#   QUICKSTART_VENV          the virtual environment to use or create (default: .venv)
#   QUICKSTART_FINEWEB_ARGS  extra fineweb.py arguments, e.g. "--max-tokens 40K --shard-size 8K"
#   QUICKSTART_HELLASWAG_ARGS  extra hellaswag.py arguments, e.g. "--limit 20"
set -euo pipefail
for arg in "$@"; do
  case "$arg" in -h|--help) sed -n '2,/^set -euo/{/^set -euo/d; s/^# \{0,1\}//; p}' "$0"; exit 0 ;; esac
done
cd "$(dirname "$0")"
START=$SECONDS

say() { echo "quickstart: $*"; }
die() { echo "error: $*" >&2; exit 2; }

# Ctrl-C reaches the running step too (the trainer then checkpoints and exits 0): stop here as well;
# the same arguments resume the same run (others may train another one)
SAME_COMMAND=
[ $# -eq 0 ] || printf -v SAME_COMMAND ' %q' "$@"
trap 'echo "quickstart: interrupted; run the same command again to resume: bash quickstart.sh$SAME_COMMAND" >&2
      exit 130' INT
HELLASWAG_ERR=$(mktemp "${TMPDIR:-/tmp}/quickstart-hellaswag.XXXXXX")
trap 'rm -f "$HELLASWAG_ERR"' EXIT

# ---- 1. environment

VENV=${QUICKSTART_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  command -v python3 >/dev/null || die "python3 not found: install Python 3.10 or newer"
  python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "Python 3.10 or newer is needed, python3 is $(python3 -V 2>&1)"
  say "creating the virtual environment $VENV"
  python3 -m venv "$VENV" || die "python3 -m venv failed (on Debian/Ubuntu: apt install python3-venv)"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)

# install_torch: the CPU build where there is no NVIDIA GPU (.ci/install_torch.sh, which .ci/run uses too)
. .ci/install_torch.sh

# one probe, torch imported once: the GPU, the GPT-2 BPE (bpe/, unless TIKTOKEN_CACHE_DIR holds it: if it
# cannot be loaded, why, in one line), whether data/stdlib is complete, and where the standard library is;
# or, before the first installs, which of the modules it imports are missing ("missing torch ...")
probe() {
  "$PY" -c '
import importlib.util, json, os, sys
missing = [m for m in ("torch", "numpy", "tiktoken") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(print("missing", *missing))
import torch
from trainkit.data import tokenizer
try:
    tokenizer.get_encoding()
except RuntimeError as e:
    sys.exit(str(e))
try:
    complete = bool(json.load(open("data/stdlib/manifest.json"))["complete"])
except Exception:
    complete = False
print(int(torch.cuda.is_available()), int(complete), os.path.dirname(os.__file__))' 2>&1 | tail -n 1
}
PROBE=$(probe) || die "${PROBE:-could not load the GPT-2 BPE}"
# torch first, so that requirements.txt does not pull the CUDA build; torch is imported only once
# numpy (requirements.txt) is in, or it warns "Failed to initialize NumPy"
[[ "$PROBE " != "missing"*" torch "* ]] || install_torch
"${PIP[@]}" -r requirements.txt "$(grep '^matplotlib' requirements-dev.txt)"
if [[ "$PROBE" == "missing "* ]]; then
  PROBE=$(probe) || die "${PROBE:-could not load the GPT-2 BPE}"
  [[ "$PROBE" != "missing "* ]] || die "the installs left out: ${PROBE#missing }"
fi
read -r GPU STDLIB_COMPLETE STDLIB <<< "$PROBE"

# ---- 2. data

DATA=data/stdlib
if [ "$GPU" = 1 ]; then
  OUT=out/quickstart-gpu
  TRAIN_ARGS=(--model gpt2 --seq-len 1024 --batch-size 8 --total-batch-size 131072 --max-steps 200
              --warmup-steps 20 --max-lr 6e-4 --val-every 50 --val-steps 4 --sample-every 100
              --ckpt-every 100 --hellaswag-every 0 --sample-prompt "def ")
else
  OUT=out/quickstart
  TRAIN_ARGS=(--model cpu --seq-len 128 --batch-size 16 --total-batch-size 2048 --max-steps 100
              --warmup-steps 10 --max-lr 3e-3 --val-every 25 --val-steps 4 --sample-every 50
              --ckpt-every 50 --hellaswag-every 0 --sample-prompt "def ")
fi
prev=
for arg in "$@"; do  # the later steps follow an --out-dir or --data-dir given to the trainer
  case "$prev" in --out-dir) OUT=$arg ;; --data-dir) DATA=$arg ;; esac
  case "$arg" in --out-dir=*) OUT=${arg#*=} ;; --data-dir=*) DATA=${arg#*=} ;; esac
  prev=$arg
done

if [ "$DATA" = data/stdlib ]; then
  if [ "$STDLIB_COMPLETE" = 1 ]; then
    say "reusing the tokenized standard library in data/stdlib"
  else
    say "tokenizing the Python standard library ($STDLIB/*.py) into data/stdlib"
    # shellcheck disable=SC2086  # QUICKSTART_FINEWEB_ARGS is a list of arguments
    "$PY" fineweb.py --files "$STDLIB/*.py" --doc-per-file --shard-size 256K --prefix stdlib \
      --out-dir data/stdlib ${QUICKSTART_FINEWEB_ARGS:-}
  fi
fi

# ---- 3. training

RESUME=  # before the user's arguments, so that their --resume PATH wins
shopt -s nullglob
CHECKPOINTS=("$OUT"/ckpt_[0-9]*.pt)  # "$OUT" quoted: a folder named like a pattern (out[1]) is itself
shopt -u nullglob
if [ ${#CHECKPOINTS[@]} -gt 0 ]; then
  RESUME=--resume
  say "resuming the run in $OUT"
fi
printf -v SHOWN_ARGS '%q ' "${TRAIN_ARGS[@]}"  # quoted as a shell would need them (--sample-prompt 'def ')
say "training: train_gpt2.py ${SHOWN_ARGS}--data-dir $DATA --out-dir $OUT $RESUME $*"
"$PY" train_gpt2.py "${TRAIN_ARGS[@]}" --data-dir "$DATA" --out-dir "$OUT" $RESUME "$@"

# ---- 4. evaluation

LIMIT=200
prev=
# shellcheck disable=SC2086  # QUICKSTART_HELLASWAG_ARGS is a list of arguments
for arg in ${QUICKSTART_HELLASWAG_ARGS:-}; do  # the number it evaluates: the last --limit, as in argparse
  case "$prev" in --limit) LIMIT=$arg ;; esac
  case "$arg" in --limit=*) LIMIT=${arg#*=} ;; esac
  prev=$arg
done
case "$LIMIT" in
  0) say "HellaSwag, all examples" ;;
  *[!0-9]*|'') say "HellaSwag" ;;  # not a count: hellaswag.py says what is wrong with it
  *) say "HellaSwag, first $((10#$LIMIT)) examples" ;;
esac
# (hellaswag.py prints which examples of which file it scores, then the result)
# shellcheck disable=SC2086  # QUICKSTART_HELLASWAG_ARGS is a list of arguments
hellaswag() { "$PY" hellaswag.py --checkpoint "$OUT" --limit 200 ${QUICKSTART_HELLASWAG_ARGS:-} "$@" 2>"$HELLASWAG_ERR"; }
if ! hellaswag; then
  reason=$(tail -n 1 "$HELLASWAG_ERR")
  case "$reason" in  # not in HELLASWAG_DIR and no download: the subset the repository ships
    "error: cannot download HellaSwag "*)
      reason=${reason#error: }
      say "${reason%%; pass a local copy*}: scoring the subset shipped in fixtures/ instead"
      hellaswag --data-file fixtures/hellaswag_val_subset.jsonl || say "skipping HellaSwag: $(tail -n 1 "$HELLASWAG_ERR")" ;;
    *) say "skipping HellaSwag: $reason" ;;
  esac
fi

# ---- 5. loss curve and samples

"$PY" plot_log.py "$OUT" -o "$OUT/loss.png"
say "samples"
"$PY" sample.py --checkpoint "$OUT" --prompt "def " --num-samples 3 --max-new-tokens 64
say "done in $((SECONDS - START)) s: checkpoints, log.jsonl and loss.png in $OUT"
# the scripts need this environment's python: the README's next commands fail in a plain shell
say "next: the scripts need $VENV's python; activate it in your shell, then run them, e.g.:"
printf '  . %q/bin/activate\n  python sample.py --checkpoint %q --prompt "def "\n' "$VENV" "$OUT"
