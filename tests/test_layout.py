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


def test_every_module_imports():
    for name in lmppo_modules():
        if name not in NOT_IMPORTED:
            importlib.import_module(name)


def test_no_import_cycles():
    graph = {name: lmppo_imports(name) for name in lmppo_modules()}
    state: dict[str, str] = {}  # "active" while on the depth-first path, "done" after

    def visit(name: str, path: list[str]) -> None:
        state[name] = "active"
        for dependency in sorted(graph[name]):
            if state.get(dependency) == "active":
                cycle = path[path.index(dependency) :] + [dependency]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dependency not in state:
                visit(dependency, [*path, dependency])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_the_cycle_check_finds_a_cycle(monkeypatch):
    """The check above can fail: a lazy import of report from evaluate would close a loop."""
    real = lmppo_imports
    monkeypatch.setitem(
        globals(),
        "lmppo_imports",
        lambda name: real(name) | ({"lmppo.report"} if name == "lmppo.evaluate" else set()),
    )
    try:
        test_no_import_cycles()
    except AssertionError as err:
        assert "lmppo.evaluate" in str(err) and "lmppo.report" in str(err)
    else:
        raise AssertionError("the cycle evaluate -> report -> evaluate went unnoticed")


def test_every_module_has_a_row_in_the_architecture_table():
    table = ARCHITECTURE.read_text()
    top_level = {name.split(".")[1] for name in lmppo_modules() if name not in ("lmppo", "lmppo.__main__")}
    missing = [m for m in sorted(top_level) if f"`{m}.py`" not in table and f"`{m}/`" not in table]
    assert not missing, f"docs/architecture.md has no row for {missing}"
