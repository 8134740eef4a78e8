"""The repository's layout: the six scripts at the root, the library in trainkit/ arranged by concern (its top-level
modules and folders: its layers), dependencies one way (scripts -> the trainer's model -> trainkit; no circle between
trainkit's layers), the scripts' --help unchanged; every check derived from the tree, so that modules may move."""

import ast
import graphlib
import sys

import pytest

from conftest import REPO, run_main

SCRIPTS = ["train_gpt2", "fineweb", "hellaswag", "hf_interop", "sample", "plot_log"]
MAX_MODULES, MAX_FLOORS = 25, 6


def repo_files() -> dict:
    """Every Python file of the repository (not of hidden folders or caches) by the name it is imported as: trainkit's
    by its dotted path (a folder's __init__.py as the folder), any other by its stem (its folder is on sys.path)."""
    files = {}
    for path in sorted(REPO.rglob("*.py")):
        parts = path.relative_to(REPO).parts
        if any(part.startswith(".") or part == "__pycache__" for part in parts):
            continue
        dotted = [*parts[:-1], path.stem] if path.stem != "__init__" else list(parts[:-1])
        name = ".".join(dotted) if parts[0] == "trainkit" else path.stem
        assert name not in files, f"{path} and {files[name]} are both imported as {name}"
        files[name] = path
    return files


def trainkit_modules() -> dict:
    """trainkit's modules (its packages' __init__.py left out) by dotted name."""
    return {
        name: path for name, path in repo_files().items() if name.startswith("trainkit.") and path.stem != "__init__"
    }


def import_graph() -> dict:
    """{module: the repository modules it imports, inside functions too} of every repo_files() file."""
    files = repo_files()
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: a relative import"
                found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = found & set(files) - {name}
    return graph


def cycle_in(graph: dict) -> list | None:
    """One import cycle of graph, as the list of modules around it (the first again at its end), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as cycle:
        return cycle.args[1][::-1]
    return None


layer = lambda name: name.split(".")[1]  # a trainkit module's layer


def test_the_root_holds_the_scripts_and_trainkit_its_layers():
    assert sorted(p.stem for p in REPO.glob("*.py")) == sorted(SCRIPTS)
    modules = trainkit_modules()
    # a top-level module is a layer of its own; a folder holds modules only, one level deep
    assert {name for name in modules if len(name.split(".")) > 3} == set()
    assert len(modules) <= MAX_MODULES, sorted(modules)
    # nothing runs when trainkit or one of its folders is imported: each __init__ is a docstring alone
    for init in REPO.glob("trainkit/**/__init__.py"):
        body = ast.parse(init.read_text()).body
        assert len(body) == 1 and isinstance(body[0].value, ast.Constant), init


def test_no_import_cycle_and_trainkit_imports_one_way():
    graph = import_graph()  # inside functions too: a cycle closed at call time is still a circle
    assert cycle_in(graph) is None, f"import cycle: {' -> '.join(cycle_in(graph))}"
    modules = trainkit_modules()
    # trainkit imports no script, and its layers import each other one way: no circle between them
    trainkit = {name for name in graph if name.startswith("trainkit")}
    assert {name: graph[name] - trainkit for name in trainkit if graph[name] - trainkit} == {}
    layers = {layer(name) for name in modules}
    between = {a: {layer(d) for n in modules if layer(n) == a for d in graph[n] & set(modules)} - {a} for a in layers}
    assert cycle_in(between) is None, f"layers in a circle: {' -> '.join(cycle_in(between))}"
    floor = {}  # a module's floor: 1 + the highest floor among its imports (1 with none)
    for module in graphlib.TopologicalSorter({name: graph[name] & set(modules) for name in modules}).static_order():
        floor[module] = 1 + max((floor[dep] for dep in graph[module] & set(modules)), default=0)
    assert max(floor.values()) <= MAX_FLOORS, sorted(floor.items(), key=lambda item: -item[1])
    # scripts -> the trainer's model -> trainkit: a script imports no script but the trainer, which imports none;
    # and every trainkit module is used, by a script or another module
    scripts_imported = {name: graph[name] & set(SCRIPTS) - {"train_gpt2"} for name in SCRIPTS}
    assert {name: found for name, found in scripts_imported.items() if found} == {}
    assert graph["train_gpt2"] & set(SCRIPTS) == set() and graph["train_gpt2"] & set(modules)
    used = set().union(*(graph[name] for name in [*SCRIPTS, *modules]))
    assert set(modules) - used == set()
    assert graph["trainkit.cli"] == set()  # the floor: the error contract and the printer, standard library only


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
    rows = [line.split("|")[1:-1] for line in files.splitlines() if line.startswith("| `")]
    listed = set()
    for row in rows:
        where = row[0].split("`")[1]
        if where.endswith("/"):  # a folder: its modules in the next column
            listed |= {where + name for name in row[1].split("`")[1::2]}
        else:
            listed.add(where)
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "trainkit").rglob("*.py") if p.name != "__init__.py"}
    assert listed == {f"{script}.py" for script in SCRIPTS} | {"quickstart.sh", "slurm/train_gpt2.sbatch"} | modules
