"""The README's quickstart runs as written (with fewer steps), and its flags table is the CLI's."""
import os
import re
import subprocess
import sys

import pytest

import train_gpt2 as tg
from conftest import REPO, SHARED

README = (REPO / "README.md").read_text()

# Appended to each quickstart command (argparse keeps the last value): same commands, tiny sizes.
SMALLER = {
    "fineweb.py": "--max-tokens 40K --shard-size 8K",
    "train_gpt2.py": "--max-steps 3 --val-every 2 --val-steps 2 --sample-every 2 --ckpt-every 2 --batch-size 4 "
                     "--total-batch-size 512 --warmup-steps 2",
    "train_gpt2.py --resume": "--max-steps 3 --val-every 2 --val-steps 2 --sample-every 2 --ckpt-every 2 --batch-size 4 "
                              "--total-batch-size 512 --warmup-steps 2 --max-steps 4",
    "hellaswag.py": "--limit 8",
}


def section(start, end):
    return README[README.index(start):README.index(end)]


def quickstart_commands():
    block = section("<!-- quickstart-begin -->", "<!-- quickstart-end -->")
    return [line for line in block.splitlines() if line.startswith("python ")]


def test_readme_flags_table_matches_the_cli():
    table = section("## Flags", "## Output")
    documented = set(re.findall(r"`(--[a-z-]+)", table))
    parser_flags = {opt for action in tg.build_parser()._actions for opt in action.option_strings
                    if opt.startswith("--") and opt != "--help"}
    assert documented == parser_flags


def test_quickstart_runs_as_written(tmp_path):
    if not (SHARED / "data" / "hellaswag").is_dir():
        pytest.skip("../shared/data is not present")
    work = tmp_path / "repo"
    work.mkdir()
    for script in ("train_gpt2.py", "fineweb.py", "hellaswag.py", "hf_interop.py", "plot_log.py"):
        (work / script).symlink_to(REPO / script)
    (tmp_path / "shared").symlink_to(SHARED)  # the README's ../shared paths
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "TIKTOKEN_CACHE_DIR": str(SHARED / "tiktoken_cache")}
    commands = quickstart_commands()
    assert [c.split()[1] for c in commands] == ["fineweb.py", "train_gpt2.py", "plot_log.py", "hellaswag.py",
                                                "hf_interop.py", "train_gpt2.py"]
    for command in commands:
        script = command.split()[1] + (" --resume" if command.endswith("--resume") else "")
        result = subprocess.run(f"{command} {SMALLER.get(script, '')}", shell=True, cwd=work, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        if script == "hellaswag.py":
            assert '"n": 8' in result.stdout
        if script == "train_gpt2.py --resume":
            assert "resumed from out/cpu/ckpt_0000003.pt at step 3" in result.stdout
    assert (work / "out" / "cpu" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (work / "out" / "cpu_hf" / "config.json").is_file()
    assert sorted(p.name for p in (work / "out" / "cpu").glob("ckpt_*.pt")) == [
        "ckpt_0000002.pt", "ckpt_0000003.pt", "ckpt_0000004.pt"]
