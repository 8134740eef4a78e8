"""Every script's command line as a program (one run_as_programs interpreter where no process of its own is needed):
whole flag names; a usage error, refusal or deleted current folder one `error:` line, exit 2 (rank 0's alone); --help;
both before torch, numpy, tiktoken, matplotlib are imported; Ctrl-C while importing `error: interrupted`, 130."""

import os
import signal
import sys

import pytest

from conftest import REPO, assert_refused, interrupt_when_blocked, run_as_programs, run_cli, run_main, start
from trainkit.cli import UserError

SCRIPTS = sorted(p.name for p in REPO.glob("*.py"))
HEAVY = ("torch", "numpy", "tiktoken", "matplotlib")
EXTRAS = ("torch._dynamo", "transformers", "datasets", "matplotlib")  # what only some commands use


# (exit code, stderr, stdout) of a usage error
usage_error = lambda script, message: (2, f"error: {message} (see {script} --help)\n", "")
unrecognized = lambda script, args: usage_error(script, f"unrecognized arguments: {args}")
bad_count = lambda script, flag, range_, got: usage_error(script, f"argument {flag}: must be in {range_}, got {got}")


USAGE_ERRORS = {  # command line -> (exit code, stderr, stdout)
    "train_gpt2.py --max-step 5": unrecognized("train_gpt2.py", "--max-step 5"),  # was --max-steps 5
    "train_gpt2.py --warm 3": unrecognized("train_gpt2.py", "--warm 3"),  # was --warmup-steps 3
    "train_gpt2.py --max-steps x": usage_error("train_gpt2.py", "argument --max-steps: invalid int value: 'x'"),
    "train_gpt2.py --batch-size x": usage_error(
        "train_gpt2.py", "argument --batch-size: expected a number of rows or auto, got 'x'"
    ),
    "fineweb.py --max-tok 5": unrecognized("fineweb.py", "--max-tok 5"),
    "hellaswag.py --checkpoint c.pt --lim 3": unrecognized("hellaswag.py", "--lim 3"),
    "hf_interop.py export c.pt hf --vocab 5": unrecognized("hf_interop.py", "--vocab 5"),
    "hf_interop.py": usage_error("hf_interop.py", "the following arguments are required: command"),
    "hf_interop.py export c.pt": usage_error("hf_interop.py export", "the following arguments are required: out_dir"),
    "sample.py --checkpoint c.pt --temp 0.5": unrecognized("sample.py", "--temp 0.5"),
    # every script's integer flags go through cli.int_in: a bad count is refused, never replaced
    "train_gpt2.py --keep-last -1": bad_count("train_gpt2.py", "--keep-last", "0..2**62", -1),
    f"train_gpt2.py --max-steps {2**62 + 1}": bad_count("train_gpt2.py", "--max-steps", "0..2**62", 2**62 + 1),
    "train_gpt2.py --seed -1": bad_count("train_gpt2.py", "--seed", "0..2**64-1", -1),
    "fineweb.py --workers 0": bad_count("fineweb.py", "--workers", "1..2**62", 0),
    "fineweb.py --max-tokens 1e30": bad_count("fineweb.py", "--max-tokens", "1..2**62", 10**30),
    "hellaswag.py --checkpoint c.pt --batch-size 0": bad_count("hellaswag.py", "--batch-size", "1..2**62", 0),
    "hf_interop.py eval c.pt --tasks hellaswag --num-fewshot -1": bad_count(
        "hf_interop.py eval", "--num-fewshot", "0..2**62", -1
    ),
    "hf_interop.py eval c.pt --tasks hellaswag --batch-size 0": bad_count(
        "hf_interop.py eval", "--batch-size", "1..2**62", 0
    ),
    "hf_interop.py export c.pt hf --vocab-size 0": bad_count("hf_interop.py export", "--vocab-size", "1..2**62", 0),
    "sample.py --checkpoint c.pt --top-k 0": bad_count("sample.py", "--top-k", "1..2**62", 0),
    "plot_log.py out --smo 0.5": unrecognized("plot_log.py", "--smo 0.5"),
    "benchmarks/bench_train.py --work x": unrecognized("bench_train.py", "--work x"),  # hidden --worker
    "benchmarks/bench_sample.py --step 3": unrecognized("bench_sample.py", "--step 3"),
    "benchmarks/bench_compile.py --round 3": unrecognized("bench_compile.py", "--round 3"),  # was --rounds 3
    "benchmarks/bench_revision.py no-such-rev": usage_error(
        "bench_revision.py", f"no-such-rev is not a commit of the git repository at {REPO}"
    ),
}
# each script's --help and an unknown flag, first in the interpreter: nothing heavy is imported yet
EARLY = [f"{s} {flags}" for s in SCRIPTS for flags in ("--help", "--no-such-flag")]
EARLY += ["fineweb.py -h", "hf_interop.py eval --help", "hf_interop.py export --help"]
EARLY += ["hf_interop.py export c.pt hf --no-such-flag"]
LATE_HELP = "benchmarks/bench_sample.py --help"  # (imports torch first)
# under torchrun only rank 0 prints: the other ranks run the same command on the same input
ON_RANK = {
    ("1", "train_gpt2.py --max-step 5"): (2, "", ""),
    ("1", "train_gpt2.py --max-lr nan"): (2, "", ""),
    ("0", "train_gpt2.py --max-lr nan"): (2, "error: --max-lr must be a finite number, got nan\n", ""),
}
GONE = "the current folder no longer exists (deleted while the shell was in it): cd to an existing folder and run"
DELETED = (2, f"error: {GONE} the command again\n", "")
# importing any library module (each checked right after its import) loads no train_gpt2, and no script, the
# trainer included, imports EXTRAS (torch._dynamo: 2 s at every start of every rank; compile_model imports it)
LIBRARY = sorted(
    ".".join(p.relative_to(REPO).with_suffix("").parts)
    for p in (REPO / "trainkit").rglob("*.py")
    if p.stem != "__init__"
) + [s.removesuffix(".py") for s in SCRIPTS if s != "train_gpt2.py"]
PROBE = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n    print(m, 'train_gpt2' in sys.modules)\n"
PROBE += f"import train_gpt2\nprint(*[m for m in {EXTRAS!r} if m in sys.modules])"


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """Every command line here that needs no process of its own, run in ONE interpreter in order: {name: result}."""
    tmp = tmp_path_factory.mktemp("cli")
    examples = REPO / "fixtures" / "hellaswag_val_subset.jsonl"
    missing = tmp / "missing.pt"
    cases = {line: dict(argv=line.split()) for line in EARLY}
    cases["probe"] = dict(argv=["-c", PROBE, *LIBRARY])
    # two commands that import the trainer (which imports trainkit, never a script)
    cases["sample run"] = dict(argv=["sample.py", "--checkpoint", str(missing)])
    cases["hellaswag run"] = dict(argv=["hellaswag.py", "--checkpoint", str(missing), "--data-file", str(examples)])
    cases.update({line: dict(argv=line.split()) for line in [*USAGE_ERRORS, LATE_HELP]})
    cases.update({(rank, line): dict(argv=line.split(), env={"RANK": rank}) for rank, line in ON_RANK})
    cases.update({("deleted", s): dict(argv=[s, "--help"], cwd="deleted") for s in SCRIPTS})
    refused = ["train_gpt2.py", "--data-dir", str(tmp / "missing"), "--out-dir", str(tmp / "o")]
    cases["trainer refusal"] = dict(argv=refused)
    return dict(zip(cases, run_as_programs(list(cases.values()), watch=HEAVY))), tmp


def test_help_and_usage_errors_answer_before_torch_and_flags_are_never_abbreviated(programs):
    """Also as a rank of a torchrun launch (RANK set: rank 0 alone prints; torchrun's side: test_ranks) and started
    in a folder deleted under the shell (where torch's native libraries would end in a fatal error)."""
    results, _ = programs
    expected = {**USAGE_ERRORS, **ON_RANK, **{("deleted", script): DELETED for script in SCRIPTS}}
    assert {key: (results[key].returncode, results[key].stderr, results[key].stdout) for key in expected} == expected
    for line in [*EARLY, LATE_HELP]:
        result, helps = results[line], line.endswith(("--help", "-h"))
        assert result.returncode == (0 if helps else 2) and result.own is None, line
        assert result.loaded == [] or line == LATE_HELP, line
        if helps:  # the full help; defaults that say nothing left out
            assert result.stderr == "" and result.stdout.startswith(f"usage: {os.path.basename(line.split()[0])}")
            text = " ".join(result.stdout.split())  # as one line: argparse wraps the help
            assert "show this help message and exit" in text and "(default: None)" not in text, line
            assert "(default: False)" not in text, line
        else:
            assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, line


def test_no_library_module_loads_the_trainer_nor_extras_and_no_script_a_second_copy(programs):
    result = programs[0]["probe"]
    assert (result.returncode, result.stdout.splitlines()) == (0, [f"{m} False" for m in LIBRARY] + [""]), result.stderr
    assert {"trainkit.cli", "sample", "hf_interop"} <= set(LIBRARY)
    for name in ("sample run", "hellaswag run"):  # scripts that load the trainer load no second copy of themselves
        result = programs[0][name]
        assert (result.returncode, result.own) == (2, None), result.stderr
        assert "missing.pt" in result.stderr and result.loaded == ["numpy", "tiktoken", "torch"]


def test_a_refusal_is_one_line_as_a_program_and_debug_is_its_traceback(programs):
    """--debug is a process of its own: the traceback is the interpreter's."""
    results, tmp = programs
    line = f"--data-dir {tmp / 'missing'} does not exist; create shards with fineweb.py"
    assert_refused(results["trainer refusal"], line)
    result = run_cli([*results["trainer refusal"].args[1:], "--debug"])
    assert result.returncode == 1 and result.stderr.startswith("Traceback (most recent call last):\n")
    assert result.stderr.splitlines()[-1] == f"trainkit.cli.UserError: {line}"
    assert not (tmp / "o").exists()


BLOCKING_MODULE = """import os
with open(os.environ["BLOCKING_FIFO"], "rb") as fifo:  # blocks until the test lets go
    fifo.read()
raise SystemExit("the import was not interrupted")
"""


@pytest.mark.parametrize(
    "script, args, blocked",
    [
        ("train_gpt2.py", ["--max-steps", "1"], "torch"),
        ("hellaswag.py", ["--checkpoint", "c.pt"], "torch"),
        ("hf_interop.py", ["export", "c.pt", "hf"], "torch"),
        ("sample.py", ["--checkpoint", "c.pt"], "torch"),
        ("fineweb.py", ["--files", "x.txt"], "tiktoken"),
        ("plot_log.py", ["{log}"], "matplotlib"),  # imported while it runs, not at start-up
    ],
)
def test_ctrl_c_while_importing_is_one_line(tmp_path, script, args, blocked):
    # a module of that name earlier on the path blocks in its import, for as long as the test likes
    (tmp_path / blocked).mkdir()
    (tmp_path / blocked / "__init__.py").write_text(BLOCKING_MODULE)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0, "loss": 5.0}\n')
    env = {"PYTHONPATH": str(tmp_path), "BLOCKING_FIFO": str(fifo), "OMP_NUM_THREADS": "1"}
    # as from a terminal: a shell running the tests in the background would leave SIGINT ignored
    command = [sys.executable, script, *(a.format(log=log) for a in args)]
    proc = start(command, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out, err = interrupt_when_blocked(proc, fifo)
    assert (proc.returncode, err, out) == (130, "error: interrupted\n", "")


@pytest.mark.parametrize(
    "command",
    ["sample.py --checkpoint {missing}", "fineweb.py --files {missing} --out-dir {out}", "plot_log.py {missing}"],
)
def test_debug_raises_the_refusal_with_its_traceback(tmp_path, command):
    """(The trainer's as a program above; test_hellaswag's and test_hf_interop's there.)"""
    script, *args = command.format(missing=tmp_path / "missing", out=tmp_path / "out").split()
    result = run_main(script, *args)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    with pytest.raises(UserError, match=str(tmp_path / "missing")):
        run_main(script, *args, "--debug")
