"""The codebase's shape: every module imports, none takes part in an import cycle, each is in the module
table of docs/architecture.md and on one layer of its layer table, no import points up a layer, and none
imports the top package (the API's face)."""

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import lmppo

SOURCE = Path(lmppo.__file__).parent
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
# not imported here: vllm_engine needs vllm (its own environment); __main__ runs the command line
NOT_IMPORTED = {"lmppo.sampling.vllm_engine", "lmppo.__main__"}


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
    graph["lmppo.runs.evaluate"] = graph["lmppo.runs.evaluate"] | {"lmppo.runs.report"}
    cycle = find_cycle(graph)
    assert (
        cycle is not None
        and {"lmppo.runs.evaluate", "lmppo.runs.report"} <= set(cycle)
        and cycle[0] == cycle[-1]
    )


def relative_path(name: str) -> str:
    """Where a module's file is, as docs/architecture.md names it: ``math/core.py``, ``toy/``."""
    parts = name.split(".")[1:]
    return "toy/" if parts[0] == "toy" else "/".join(parts) + ".py"


def test_every_module_has_a_row_in_the_architecture_table():
    table = ARCHITECTURE.read_text()
    modules = {
        relative_path(name)
        for name in lmppo_modules()
        if name not in ("lmppo", "lmppo.__main__") and not module_file(name).name == "__init__.py"
    }
    missing = [path for path in sorted(modules) if f"`{path}`" not in table]
    assert not missing, f"docs/architecture.md has no row for {missing}"


def subpackages() -> list[str]:
    return [
        name for name in lmppo_modules() if name.count(".") == 1 and module_file(name).name == "__init__.py"
    ]


def test_every_package_says_its_job_and_imports_only_what_it_says_it_may():
    """Each package's ``__init__`` docstring ends on "May import: ..." naming the packages
    (``:mod:`lmppo.x```) its modules may import besides the basics, or "anything"; the code keeps to it."""
    layers, graph = architecture_layers(), import_graph()
    basics = {name for name, layer in layers.items() if layer == 1}
    for package in subpackages():
        doc = importlib.import_module(package).__doc__ or ""
        assert "May import:" in doc, f"{package}'s __init__ does not say what it may import"
        allowed = doc.split("May import:", 1)[1]
        if "anything" in allowed or package in basics:
            continue
        may = {package, *basics, *re.findall(r":mod:`(lmppo\.[a-z_]+)`", allowed)}
        used = {
            ".".join(imported.split(".")[:2])
            for name, imports in graph.items()
            if name == package or name.startswith(package + ".")
            for imported in imports
        }
        assert sorted(used - may) == [], f"{package} imports packages its __init__ does not name"


def architecture_layers() -> dict[str, int]:
    """docs/architecture.md's layer table: module (``lmppo.`` name) -> its layer's number (a module listed
    twice is an error)."""
    text = ARCHITECTURE.read_text().split("<!-- layers: read by tests/test_layout.py -->", 1)[1]
    table = text.strip().split("\n\n", 1)[0].splitlines()[2:]  # the rows under the header and its rule
    layers = {}
    for line in table:
        number, modules = line.split("|")[1:3]
        for module in re.findall(r"`([a-z_]+)`", modules):
            assert f"lmppo.{module}" not in layers, f"{module} stands on two layers"
            layers[f"lmppo.{module}"] = int(number.split()[0])
    return layers


def layer_of(name: str, layers: dict[str, int]) -> int:
    """A module's layer; a package's submodules, at any depth (``lmppo.toy.task``,
    ``lmppo.inputs.config.models``), stand on the package's."""
    if name == "lmppo":  # the package's public names come from the top: the API
        return max(layers.values())
    while name not in layers and "." in name:
        name = name.rsplit(".", 1)[0]
    return layers[name]


def test_every_module_stands_on_exactly_one_layer():
    layers = architecture_layers()
    top_level = {".".join(name.split(".")[:2]) for name in lmppo_modules() if name != "lmppo"}
    assert sorted(top_level - set(layers)) == [], "modules with no layer in docs/architecture.md"
    assert sorted(set(layers) - top_level) == [], "layers name modules that do not exist"


def test_no_module_imports_one_on_a_higher_layer():
    upward = upward_imports(import_graph(), architecture_layers())
    assert upward == []


def test_the_layer_check_finds_an_upward_import():
    graph = {"lmppo.math.core": {"lmppo.training.trainer"}, "lmppo.training.trainer": {"lmppo.math.core"}}
    assert upward_imports(graph, {"lmppo.math.core": 1, "lmppo.training.trainer": 6}) == [
        "lmppo.math.core (layer 1) imports lmppo.training.trainer (layer 6)"
    ]


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    return [
        f"{name} (layer {layer_of(name, layers)}) imports {imported} (layer {layer_of(imported, layers)})"
        for name, imports in graph.items()
        for imported in sorted(imports)
        if layer_of(imported, layers) > layer_of(name, layers)
    ]


def top_package_imports(source: str, modules: set[str]) -> list[str]:
    """What ``source`` takes from the top package ``lmppo`` itself: ``import lmppo``, or ``from lmppo import
    X`` where X is none of ``modules`` (``from lmppo import errors`` imports a module, not the package)."""
    taken = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            taken += [alias.name for alias in node.names if alias.name == "lmppo"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "lmppo":
            taken += [f"lmppo.{alias.name}" for alias in node.names if f"lmppo.{alias.name}" not in modules]
    return taken


def test_no_module_imports_the_top_package():
    """``lmppo/__init__`` hands out the API (``lmppo.train`` imports the interface, which imports nearly
    everything): a module that imports it closes a loop; the version is :mod:`lmppo.version`'s."""
    modules = set(lmppo_modules())
    inside = sorted(modules - {"lmppo", "lmppo.__main__"})
    found = {
        name: taken
        for name in inside
        if (taken := top_package_imports(module_file(name).read_text(), modules))
    }
    assert found == {}


def test_the_top_package_check_finds_an_import():
    source = "import lmppo\nfrom lmppo import __version__, errors\n"
    assert top_package_imports(source, set(lmppo_modules())) == ["lmppo", "lmppo.__version__"]


ENGINES = {"lmppo.sampling.hf_engine", "lmppo.sampling.vllm_engine"}  # one module per rollout engine
ENGINE_FREE = ("lmppo.sampling.responses", "lmppo.sampling.episodes", "lmppo.training")


def test_the_engines_are_peers_and_only_the_builder_names_one():
    """An engine class subclasses no other engine's, and the generators (one response, episodes) and the
    trainers reach an engine only through the ``Engine`` protocol: a new engine is one module and a line
    in the builder."""
    graph = import_graph()
    for name in ENGINES:
        tree = ast.parse(module_file(name).read_text())
        for node in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = {ast.unparse(base) for base in node.bases}
            assert not bases & {"DecodeLoop", "VLLMEngine"}, f"{name}: {node.name} subclasses an engine"
        assert not graph.get(name, set()) & ENGINES, f"{name} imports another engine"
    for name, imported in graph.items():
        if name.startswith(ENGINE_FREE):
            assert not imported & ENGINES, f"{name} imports an engine module: {imported & ENGINES}"
