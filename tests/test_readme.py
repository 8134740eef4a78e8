"""The README's quickstart runs as written (with fewer steps), docs/flags.md's table is the CLI's, every link between
README.md and docs/*.md leads somewhere, and fixtures/README.md describes the files beside it."""

import contextlib
import hashlib
import io
import re
import shlex

import pytest

import train_gpt2 as tg
from conftest import REPO, run_as_programs

README = (REPO / "README.md").read_text()
FLAGS_DOC = REPO / "docs" / "flags.md"  # the trainer's flags table moved here from the README

# Appended to each quickstart command (argparse keeps the last value): same commands, tiny sizes.
SMALL_RUN = "--max-steps 3 --val-every 2 --val-steps 2 --sample-every 2 --ckpt-every 2 --batch-size 4 "
SMALL_RUN += "--total-batch-size 512 --warmup-steps 2"
SMALLER = {"train_gpt2.py": SMALL_RUN, "train_gpt2.py --resume": f"{SMALL_RUN} --max-steps 4"}
SMALLER |= {"hellaswag.py": "--limit 8", "sample.py": "--num-samples 2 --max-new-tokens 8"}


section = lambda start, end, text=README: text[text.index(start) : text.index(end)]


def quickstart_commands() -> dict:
    """{its script (" --resume" added to a resume's): command} of each quickstart command, in order."""
    block = section("<!-- quickstart-begin -->", "<!-- quickstart-end -->")
    commands = [line for line in block.splitlines() if line.startswith("python ")]
    return {c.split()[1] + " --resume" * c.endswith("--resume"): c for c in commands}


def test_readme_flags_table_matches_the_cli():
    table = re.search(r"(?ms)^## Flags.*?(?=^## |\Z)", FLAGS_DOC.read_text())[0]  # to the next such heading
    documented = set(re.findall(r"`(--[a-z-]+)", table))
    options = [option for action in tg.build_parser()._actions for option in action.option_strings]
    assert documented == {option for option in options if option.startswith("--") and option != "--help"}


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quickstart's commands (smaller), the transcript's training second, in ONE interpreter (run_as_programs) in a
    folder of links to the scripts, without TIKTOKEN_CACHE_DIR (bpe/ ships the BPE): the folder, {command: stdout}."""
    work = tmp_path_factory.mktemp("quickstart") / "repo"
    work.mkdir()
    for name in [*(p.name for p in REPO.glob("*.py")), "fixtures", "trainkit", "bpe"]:  # the scripts, what they read
        (work / name).symlink_to(REPO / name)
    commands = {key: f"{command} {SMALLER.get(key, '')}" for key, command in quickstart_commands().items()}
    # steps 0 and 1 are in the warmup, whose learning rates do not depend on --max-steps
    transcript = f"{quickstart_commands()['train_gpt2.py']} --max-steps 2 --sample-every 0 --out-dir out/transcript"
    commands = {"fineweb.py": commands.pop("fineweb.py"), "transcript": transcript, **commands}
    argvs = []  # each as a shell splits it, `$(python -c 'CODE')` replaced by what CODE prints
    for command in commands.values():
        for code in re.findall(r"\$\(python -c '([^']*)'\)", command):
            with contextlib.redirect_stdout(io.StringIO()) as out:
                exec(code, {})
            command = command.replace(f"$(python -c '{code}')", out.getvalue().strip())
        argvs.append(shlex.split(command)[1:])
    env = {"TIKTOKEN_CACHE_DIR": None}
    results = run_as_programs([dict(argv=argv, cwd=str(work), env=env) for argv in argvs])
    for command, result in zip(commands.values(), results):
        assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    return work, {key: result.stdout for key, result in zip(commands, results)}


def test_quickstart_runs_as_written(quickstart):
    work, stdout = quickstart
    order = "fineweb.py train_gpt2.py plot_log.py hellaswag.py sample.py hf_interop.py train_gpt2.py"
    assert [c.split()[1] for c in quickstart_commands().values()] == order.split()
    assert stdout["hellaswag.py"].splitlines()[:2] == [  # offline: the subset the repository ships, said so
        "hellaswag: scoring out/cpu/ckpt_0000003.pt, step 3",
        "hellaswag: the first 8 of 446 examples in fixtures/hellaswag_val_subset.jsonl (the subset the "
        "repository ships, not the full 10042-example set); chance is 0.25",
    ]
    assert stdout["hellaswag.py"].splitlines()[2].endswith('"n": 8}')
    assert "--- sample 1/2 ---\ndef " in stdout["sample.py"] and "--- sample 2/2 ---\ndef " in stdout["sample.py"]
    assert "resumed from out/cpu/ckpt_0000003.pt at step 3" in stdout["train_gpt2.py --resume"]
    assert (work / "out" / "cpu" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (work / "out" / "cpu_hf" / "config.json").is_file()
    assert sorted(p.name for p in (work / "out" / "cpu").glob("ckpt_*.pt")) == [f"ckpt_000000{i}.pt" for i in (2, 3, 4)]


def test_links_between_readme_and_docs_resolve():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) > 10  # the reference lives in docs/
    texts = {page: re.sub(r"(?ms)^```.*?^```", "", page.read_text()) for page in pages}  # outside code blocks
    # GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens
    anchor_of = lambda heading: re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    anchors = {page.resolve(): {anchor_of(h) for h in re.findall(r"(?m)^#+ (.+)$", texts[page])} for page in pages}
    broken, linked = [], set()
    for page, text in texts.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page.resolve()
            linked.add(dest)
            if not dest.exists() or (anchor and anchor not in anchors.get(dest, set())):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []
    assert {p.resolve() for p in pages[1:]} <= linked  # every doc is reachable from a link


def test_fixtures_are_the_files_their_readme_describes():
    text = (REPO / "fixtures" / "README.md").read_text()
    sections = dict(re.findall(r"(?ms)^## (\S+)\n(.*?)(?=^## |\Z)", text))
    assert sorted(sections) == sorted(p.name for p in (REPO / "fixtures").iterdir() if p.name != "README.md")
    for name, body in sections.items():
        data = (REPO / "fixtures" / name).read_bytes()
        assert re.search(r"\*\*sha256:\*\* `([0-9a-f]{64})`", body)[1] == hashlib.sha256(data).hexdigest(), name
        assert f"{len(data):,} bytes" in body, name


def shape(line):
    """A printed line with its durations and numbers masked: what stays the same from run to run."""
    line = re.sub(r"\b\d+h\d\dm\b|\b(\d+m)?\d+s\b", "T", line)
    return re.sub(r" +", " ", re.sub(r"\d[\d,.]*(e[-+]\d+)?", "#", line))


def test_the_transcript_holds_what_the_first_two_commands_print_today(quickstart):
    """Its reproducible numbers (fineweb's count; the model, batch and step-0 validation lines; steps 0-1's loss, lr
    and norm) are what the quickstart prints today under OMP_NUM_THREADS=1; other step and summary lines keep shape."""
    import platform

    recorded, this = re.search(r"recorded with Python (3\.\d+\.\d+)", README)[1], platform.python_version()
    if this != recorded:
        pytest.skip(f"the transcript tokenizes Python {recorded}'s standard library, this is {this}")
    block = section("<!-- transcript-begin -->", "<!-- transcript-end -->")
    lines = [line for line in block.splitlines() if line and not line.startswith(("<!--", "```"))]
    stdout = quickstart[1]
    assert stdout["fineweb.py"].splitlines() == [lines[0]]
    printed = stdout["transcript"].splitlines()
    assert printed[:3] == lines[1:4]  # model, batch, step 0's validation
    for step in (0, 1):
        shown = next(line for line in lines if line.startswith(f"step {step:5d}/"))
        got = next(line for line in printed if line.startswith(f"step {step:5d}/"))
        assert got.replace("/2 |", "/100 |").split(" | dt ")[0] == shown.split(" | dt ")[0]
    step_shapes = lambda text: [shape(line) for line in text if re.match(r"step +\d+/", line)]
    printed_steps, recorded_steps = step_shapes(printed), step_shapes(lines)
    assert (printed_steps[0], printed_steps[-1]) == (recorded_steps[0], recorded_steps[-1])  # (the last: no eta)
    assert shape(printed[-1]) == shape(lines[-1]) and lines[-1].startswith("done: ")
