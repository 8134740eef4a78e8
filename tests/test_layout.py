"""The repository's layout: the six scripts a user runs at the root, the modules they
import in trainkit/, dependencies pointing one way (scripts -> the trainer's model -> trainkit),
and the scripts' --help unchanged by the move."""

import ast
import sys

import pytest

from conftest import REPO, run_main

SCRIPTS = ["train_gpt2", "fineweb", "hellaswag", "hf_interop", "sample", "plot_log"]


def repo_files() -> dict:
    """Every Python file of the repository by the name it is imported as: a script or a tests/,
    benchmarks/ or evals/ module by its stem (each folder is on sys.path where its files run),
    trainkit's as trainkit.NAME; hidden folders (a .venv) and caches are not the repository's."""
    files = {}
    for path in sorted(REPO.rglob("*.py")):
        parts = path.relative_to(REPO).parts
        if any(part.startswith(".") or part == "__pycache__" for part in parts):
            continue
        name = (
            "trainkit"
            if parts == ("trainkit", "__init__.py")
            else f"trainkit.{path.stem}"
            if parts[0] == "trainkit"
            else path.stem
        )
        assert name not in files, f"{path} and {files[name]} are both imported as {name}"
        files[name] = path
    return files


def imports_of(path, ours: set, module_level_only: bool = False) -> set:
    """The repository modules a file imports: every import statement, inside functions too
    (module_level_only: those that run when the file is imported, at its top level and in the
    bodies of its top-level if/try)."""
    tree = ast.parse(path.read_text(), str(path))
    if module_level_only:
        nodes, todo = [], list(tree.body)
        while todo:
            node = todo.pop()
            nodes.append(node)
            if isinstance(node, (ast.If, ast.Try)):
                todo += (
                    node.body
                    + node.orelse
                    + getattr(node, "finalbody", [])
                    + [n for h in getattr(node, "handlers", []) for n in h.body]
                )
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found & ours


def import_graph(module_level_only: bool = False) -> dict:
    files = repo_files()
    return {name: imports_of(path, set(files), module_level_only) - {name} for name, path in files.items()}


def cycle_in(graph: dict) -> list | None:
    """One import cycle of graph, as the list of modules around it, or None."""
    state = {}  # module -> "open" while its imports are being followed, "done" after

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [module])):
            return found
    return None


def test_the_root_holds_the_scripts_and_trainkit_the_modules():
    assert sorted(p.stem for p in REPO.glob("*.py")) == sorted(SCRIPTS)
    trainkit = {name for name in repo_files() if name.startswith("trainkit")}
    assert {"trainkit", "trainkit.cli", "trainkit.checkpoints", "trainkit.shards", "trainkit.tokenizer"} <= trainkit
    # nothing runs when trainkit is imported: its __init__ is a docstring alone
    body = ast.parse((REPO / "trainkit" / "__init__.py").read_text()).body
    assert len(body) == 1 and isinstance(body[0].value, ast.Constant)


def test_no_import_cycle_and_trainkit_imports_no_script():
    graph = import_graph()  # inside functions too: a cycle closed at call time is still a circle
    assert cycle_in(graph) is None, f"import cycle: {' -> '.join(cycle_in(graph))}"
    trainkit = {name: deps for name, deps in graph.items() if name.startswith("trainkit")}
    assert {name: deps - set(trainkit) for name, deps in trainkit.items() if deps - set(trainkit)} == {}
    # scripts -> the trainer's model -> trainkit: the scripts that score or sample our checkpoints
    # import the trainer, none of them another script
    assert {name: graph[name] & set(SCRIPTS) for name in SCRIPTS if graph[name] & set(SCRIPTS)} == {
        "hellaswag": {"train_gpt2"},
        "sample": {"train_gpt2"},
    }
    assert graph["train_gpt2"] >= {
        "trainkit.launch",
        "trainkit.checkpoints",
        "trainkit.out_dir",
        "trainkit.run_log",
        "trainkit.memory",
        "trainkit.fsdp",
        "trainkit.chunked_loss",
        "trainkit.shard_scan",
        "trainkit.shard_checks",
        "trainkit.launch_plan",
        "trainkit.tokenizer",
        "trainkit.hellaswag_eval",
        "trainkit.sampling",
        "trainkit.hf_weights",
    }
    assert graph["trainkit.console"] == set()  # the floor: printing, standard library only
    assert graph["trainkit.cli"] == {"trainkit.console"}  # the error contract on it, standard library only


def test_the_scripts_load_the_trainer_only_when_a_command_needs_it():
    # at import (and so for --help) no script loads train_gpt2: hellaswag.py and sample.py import
    # it inside the function that loads a checkpoint
    graph = import_graph(module_level_only=True)
    assert [name for name in graph if "train_gpt2" in graph[name] and name in SCRIPTS] == []


HELPS = [[f"{script}.py"] for script in SCRIPTS] + [["hf_interop.py", command] for command in ("export", "eval")]


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the recorded --help is Python 3.11's argparse layout")
@pytest.mark.parametrize("command", HELPS, ids=["_".join(c).removesuffix(".py") for c in HELPS])
def test_help_is_what_it_was_before_the_move(command):
    recorded = REPO / "tests" / "fixtures" / "help" / f"{'_'.join(command).replace('.py', '')}.txt"
    result = run_main(*command, "--help", env={"COLUMNS": "80"})  # (test_cli runs each --help as a program)
    assert (result.returncode, result.stderr, result.stdout) == (0, "", recorded.read_text())


def test_readme_lists_every_script_and_trainkit_module():
    readme = (REPO / "README.md").read_text()
    files = readme[readme.index("## Files") : readme.index("## Reference")]
    listed = {line.split("`")[1] for line in files.splitlines() if line.startswith("| `")}
    modules = {f"trainkit/{p.name}" for p in (REPO / "trainkit").glob("*.py") if p.name != "__init__.py"}
    assert listed == {f"{script}.py" for script in SCRIPTS} | {"quickstart.sh", "slurm/train_gpt2.sbatch"} | modules
