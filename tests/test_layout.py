"""The codebase's shape: every module imports, none takes part in an import cycle, each is in the module
table of docs/architecture.md."""

import ast
import importlib
import pkgutil
from pathlib import Path

import lmppo

SOURCE = Path(lmppo.__file__).parent
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
# not imported here: vllm_engine needs vllm (its own environment); __main__ runs the command line
NOT_IMPORTED = {"lmppo.vllm_engine", "lmppo.__main__"}


def lmppo_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(SOURCE)], prefix="lmppo.")) + ["lmppo"]


def module_file(name: str) -> Path:
    relative = Path(*name.split(".")[1:])
    package = SOURCE / relative / "__init__.py"
    return package if package.is_file() else (SOURCE / relative).with_suffix(".py")


def lmppo_imports(name: str) -> set[str]:
    """The lmppo modules ``name`` imports anywhere (also inside functions: a lazy import is still a
    dependency, and a cycle through one is still a cycle)."""
    tree = ast.parse(module_file(name).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module)
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from lmppo import core`
    modules = set(lmppo_modules())
    return {m for m in imported if m in modules and m not in ("lmppo", name)}


def import_graph() -> dict[str, set[str]]:
    return {name: lmppo_imports(name) for name in lmppo_modules()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> imported modules) as a path that ends where it starts."""
    state: dict[str, str] = {}  # "active" while on the depth-first path, "done" after

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = "active"
        for dependency in sorted(graph[name]):
            if state.get(dependency) == "active":
                return path[path.index(dependency) :] + [dependency]
            if dependency not in state and (cycle := visit(dependency, [*path, dependency])):
                return cycle
        state[name] = "done"
        return None

    for name in graph:
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


def test_every_module_imports():
    failures = {}
    for name in lmppo_modules():
        if name not in NOT_IMPORTED:
            try:
                importlib.import_module(name)
            except Exception as err:  # reported below, every module at once
                failures[name] = repr(err)
    assert not failures, failures


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle():
    """A lazy import of report from evaluate would close a loop (report reads what evaluate writes)."""
    graph = import_graph()
    graph["lmppo.evaluate"] = graph["lmppo.evaluate"] | {"lmppo.report"}
    cycle = find_cycle(graph)
    assert cycle is not None and {"lmppo.evaluate", "lmppo.report"} <= set(cycle) and cycle[0] == cycle[-1]


def test_every_module_has_a_row_in_the_architecture_table():
    table = ARCHITECTURE.read_text()
    top_level = {name.split(".")[1] for name in lmppo_modules() if name not in ("lmppo", "lmppo.__main__")}
    missing = [m for m in sorted(top_level) if f"`{m}.py`" not in table and f"`{m}/`" not in table]
    assert not missing, f"docs/architecture.md has no row for {missing}"
