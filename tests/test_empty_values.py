"""An empty argument (an unset `$OUT`) is refused by every script in one line naming it, before anything is read or
written; an export never replaces a folder that is or holds the current, home or checkout folder, whatever names it.
In-process (run_main): test_cli runs every script's usage errors as programs."""

import os
import shlex

import pytest

from conftest import REPO, assert_one_error_line, assert_refused_quietly, run_main, tree_hashes


@pytest.fixture
def project(tmp_path):
    """A user's folder with files of their own, the current folder of the command."""
    folder = tmp_path / "myproject"
    (folder / "src").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine\n")
    (folder / "src" / "model.py").write_text("print('mine')\n")
    return folder


EXPORT_INTO = {  # where: what the line says it is
    ".": "is the current folder",
    "..": "holds the current folder",
    "src/..": "is the current folder",
    "~": "is your home folder",
    "REPO": "is this repository's checkout",
    "REPO/..": "holds this repository's checkout",
    "link": "is the current folder",  # a symbolic link to the current folder, beside it
    "empty .": "is the current folder",  # an empty current folder
}


@pytest.mark.parametrize("where", EXPORT_INTO)
def test_an_export_never_replaces_the_current_home_or_checkout_folder(project, finished_run, tmp_path, where):
    """Not even when it is empty or would pass as an earlier export: those folders are the user's."""
    (home := tmp_path / "home").mkdir()
    out = where.replace("REPO", str(REPO)).replace("~", str(home))
    if where == "link":
        os.symlink(project, tmp_path / "link")
        out = str(tmp_path / "link")
    elif where == "empty .":
        project, out = tmp_path / "empty", "."
        project.mkdir()
    state = lambda: (tree_hashes(project), sorted(project.rglob("*")), os.stat(project).st_ino)
    before, checkout = state(), tree_hashes(REPO / "trainkit")
    result = run_main("hf_interop.py", "export", finished_run, out, cwd=project, env={"HOME": str(home)})
    what = EXPORT_INTO[where]
    if where == "REPO/.." and project.resolve().is_relative_to(REPO.resolve().parent):  # (a clone in /tmp)
        what = "holds the current folder"  # the current folder is named first, where one folder holds both
    assert_one_error_line(result, f"error: cannot export into {out}: it {what} (")
    assert result.stderr.endswith("which an export would replace; export into a new folder\n")
    assert state() == before and tree_hashes(REPO / "trainkit") == checkout and os.listdir(home) == []


EMPTY = {  # the command line (shlex): the argument refused
    "train_gpt2.py --resume ''": "--resume",
    "train_gpt2.py --init-from ''": "--init-from",
    "train_gpt2.py --out-dir ''": "--out-dir",
    "train_gpt2.py --data-dir ''": "--data-dir",
    "train_gpt2.py --wandb ''": "--wandb",
    "train_gpt2.py --hellaswag-file ' '": "--hellaswag-file",
    "sample.py --checkpoint ''": "--checkpoint",
    "sample.py --hf-model ''": "--hf-model",
    "hellaswag.py --checkpoint ''": "--checkpoint",
    "hellaswag.py --checkpoint x --data-file ''": "--data-file",
    "fineweb.py --out-dir ''": "--out-dir",
    "fineweb.py --files ''": "--files",
    "plot_log.py ''": "path",
    "hf_interop.py eval '' --tasks hellaswag": "checkpoint",
    "hf_interop.py export {run} ''": "out_dir",  # (an export into the current folder: deletes nothing)
}


@pytest.mark.parametrize("command", EMPTY)
def test_every_script_refuses_an_empty_value(project, finished_run, command):
    script, *args = shlex.split(command.format(run=finished_run))
    argument, before = EMPTY[command], tree_hashes(project)
    value = args[args.index(argument) + 1] if argument in args else ""
    prog = script + (f" {args[0]}" if args[0] in ("eval", "export") else "")
    line = f"argument {argument}: got an empty value ({value!r}: an unset shell variable?) (see {prog} --help)"
    assert_refused_quietly(run_main(script, *args, cwd=project), line)
    assert tree_hashes(project) == before
