"""The command-line contract of every script (trainkit/cli.py): whole flag names only, a usage error as one
`error:` line and exit code 2, -h/--help the full help, one line under torchrun (rank 0's), and
Ctrl-C while torch imports as `error: interrupted`, exit code 130."""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO, interrupt_when_blocked, run_cli, run_main
from trainkit.cli import UserError

# Each script runs as a program (`python SCRIPT ARGS` is runpy with run_name "__main__"), all in one
# process so that torch is imported once: its exit code, stderr and stdout per command line.
RUN_AS_PROGRAMS = """
import contextlib, io, json, os, runpy, sys
results = []
for env, argv in json.loads(sys.argv[1]):
    os.environ.update(env)
    sys.argv, err, out, code = argv, io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            code = e.code
    os.environ.pop("RANK", None)
    results.append([code, err.getvalue(), out.getvalue()])
print(json.dumps(results))
"""


def run_as_programs(cases):
    proc = subprocess.run(
        [sys.executable, "-c", RUN_AS_PROGRAMS, json.dumps(cases)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [tuple(result) for result in json.loads(proc.stdout.splitlines()[-1])]


def unrecognized(script, args):
    return 2, f"error: unrecognized arguments: {args} (see {script} --help)\n", ""


def bad_count(script, flag, values, value):
    return 2, f"error: argument {flag}: must be in {values}, got {value} (see {script} --help)\n", ""


def test_usage_errors_are_one_line_and_flags_are_never_abbreviated():
    cases = {  # command line -> (exit code, stderr, stdout)
        "train_gpt2.py --max-step 5": unrecognized("train_gpt2.py", "--max-step 5"),  # was --max-steps 5
        "train_gpt2.py --warm 3": unrecognized("train_gpt2.py", "--warm 3"),  # was --warmup-steps 3
        "train_gpt2.py --max-steps x": (
            2,
            "error: argument --max-steps: invalid int value: 'x' (see train_gpt2.py --help)\n",
            "",
        ),
        "train_gpt2.py --batch-size x": (
            2,
            "error: argument --batch-size: expected a number of rows or auto, got 'x' (see train_gpt2.py --help)\n",
            "",
        ),
        "fineweb.py --max-tok 5": unrecognized("fineweb.py", "--max-tok 5"),
        "hellaswag.py --checkpoint c.pt --lim 3": unrecognized("hellaswag.py", "--lim 3"),
        "hf_interop.py export c.pt hf --vocab 5": unrecognized("hf_interop.py", "--vocab 5"),
        "hf_interop.py": (2, "error: the following arguments are required: command (see hf_interop.py --help)\n", ""),
        "hf_interop.py export c.pt": (
            2,
            "error: the following arguments are required: out_dir (see hf_interop.py export --help)\n",
            "",
        ),
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
        "benchmarks/bench_revision.py no-such-rev": (
            2,
            f"error: no-such-rev is not a commit of the git repository at {REPO} (see bench_revision.py --help)\n",
            "",
        ),
    }
    helps = [
        "train_gpt2.py --help",
        "fineweb.py -h",
        "hellaswag.py --help",
        "hf_interop.py export --help",
        "sample.py --help",
        "plot_log.py --help",
        "benchmarks/bench_sample.py --help",
    ]
    # under torchrun only rank 0 prints: the other ranks run the same command on the same input
    on_rank_1 = {"train_gpt2.py --max-step 5": (2, "", ""), "train_gpt2.py --max-lr nan": (2, "", "")}
    results = run_as_programs(
        [[{}, line.split()] for line in [*cases, *helps]]
        + [[{"RANK": "1"}, line.split()] for line in on_rank_1]
        + [[{"RANK": "0"}, "train_gpt2.py --max-lr nan".split()]]
    )
    assert dict(zip(cases, results[: len(cases)])) == cases
    for line, (code, err, out) in zip(helps, results[len(cases) : len(cases) + len(helps)]):
        script = os.path.basename(line.split()[0])
        assert (code, err) == (0, "") and out.startswith(f"usage: {script}"), (line, err)
        assert "show this help message and exit" in out
        text = " ".join(out.split())  # as one line: argparse wraps the help
        assert "(default: None)" not in text and "(default: False)" not in text, line  # defaults that say nothing
    assert dict(zip(on_rank_1, results[len(cases) + len(helps) : -1])) == on_rank_1
    assert results[-1] == (2, "error: --max-lr must be a finite number, got nan\n", "")


# Each command line as a program in one fresh interpreter, in turn: its exit code, the heavy modules
# loaded so far (each takes seconds to import under load), and which module the script's own name
# gives (None; "__main__", the program itself; or its name: a second copy, run again on import).
HEAVY = ("torch", "numpy", "tiktoken", "matplotlib")
LOADED_AFTER_RUNNING = """
import contextlib, glob, io, json, os, runpy, sys
ours = {os.path.basename(path).removesuffix(".py") for path in glob.glob("*.py")} | {"trainkit"}
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv, code = argv, None
    for name in [m for m in sys.modules if m.split(".")[0] in ours]:  # each command imports this repo's modules afresh
        del sys.modules[name]
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            code = e.code
    own = sys.modules.get(os.path.basename(argv[0]).removesuffix(".py"))
    results.append([code, sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in %r}),
                    own and own.__name__])
print(json.dumps(results))
""" % (HEAVY,)


def test_help_and_usage_errors_answer_before_torch_numpy_tiktoken_and_matplotlib(tmp_path):
    scripts = ["train_gpt2.py", "fineweb.py", "hellaswag.py", "sample.py", "hf_interop.py", "plot_log.py"]
    lines = [[script, *flags] for script in scripts for flags in (["--help"], ["--no-such-flag"])]
    lines += [["hf_interop.py", "eval", "--help"], ["hf_interop.py", "export", "c.pt", "hf", "--no-such-flag"]]
    expected = {" ".join(line): [0 if "--help" in line else 2, [], None] for line in lines}
    # then two commands that import the trainer: nothing imports them back, so no second copy of the
    # script is loaded under its own name (the trainer imports trainkit, never a script)
    examples = tmp_path / "hellaswag_val.jsonl"
    examples.write_text(
        json.dumps(
            {
                "ctx": "A man is on a roof. he",
                "endings": ["a", "b", "c", "d"],
                "label": 3,
                "activity_label": "Roofing",
                "ctx_a": "A man is on a roof.",
                "ctx_b": "he",
            }
        )
    )
    missing = str(tmp_path / "missing.pt")
    runs = [
        ["sample.py", "--checkpoint", missing],
        ["hellaswag.py", "--checkpoint", missing, "--data-file", str(examples), "--device", "cpu"],
    ]
    expected.update({" ".join(line): [2, ["numpy", "tiktoken", "torch"], None] for line in runs})
    proc = subprocess.run(
        [sys.executable, "-c", LOADED_AFTER_RUNNING, json.dumps(lines + runs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    assert {" ".join(line): result for line, result in zip(lines + runs, results)} == expected


def test_a_bad_flag_under_torchrun_is_one_line(tmp_path):
    result = run_cli(["--max-step", "5", "--out-dir", str(tmp_path)], nproc=2)
    output = result.stdout + result.stderr
    assert [line for line in output.splitlines() if "error:" in line] == [
        "error: unrecognized arguments: --max-step 5 (see train_gpt2.py --help)"
    ], output[-3000:]
    assert result.returncode != 0 and "exitcode  : 2" in output  # the rank torchrun names first
    assert not tmp_path.exists() or not os.listdir(tmp_path)


# --- Ctrl-C while the script imports ----------------------------------------------------------

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
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "BLOCKING_FIFO": str(fifo), "OMP_NUM_THREADS": "1"}
    # as from a terminal: a shell running the tests in the background would leave SIGINT ignored
    proc = subprocess.Popen(
        [sys.executable, script, *(a.format(log=log) for a in args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out, err = interrupt_when_blocked(proc, fifo)
    assert (proc.returncode, err, out) == (130, "error: interrupted\n", "")


@pytest.mark.parametrize(
    "script", ["train_gpt2.py", "fineweb.py", "hellaswag.py", "hf_interop.py", "sample.py", "plot_log.py"]
)
def test_a_deleted_current_folder_is_one_line(tmp_path, script):
    """Started in a folder deleted under the shell (torch's native libraries would end in a fatal error)."""
    result = subprocess.run(
        [
            "bash",
            "-c",
            'mkdir gone && cd gone && rmdir ../gone && exec "$@"',
            "bash",
            sys.executable,
            str(REPO / script),
            "--help",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "",
        (
            "error: the current folder no longer exists (deleted while the shell was in it): cd to an existing folder "
            "and run the command again\n"
        ),
    )


@pytest.mark.parametrize(
    "script, args",
    [
        ("sample.py", ["--checkpoint", "{missing}"]),
        ("fineweb.py", ["--files", "{missing}", "--out-dir", "{out}"]),
        ("plot_log.py", ["{missing}"]),
    ],
)
def test_debug_raises_the_refusal_with_its_traceback(tmp_path, script, args):
    """--debug: the refusal's exception leaves main (the traceback), where it was one line and exit code 2
    (tests/test_train_cli.py runs the trainer's as a program; test_hellaswag and test_hf_interop theirs)."""
    args = [a.format(missing=tmp_path / "missing", out=tmp_path / "out") for a in args]
    result = run_main(script, *args)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    with pytest.raises(UserError, match=str(tmp_path / "missing")):
        run_main(script, *args, "--debug")
