"""The package's shape, checked: imports point one way (no cycle between modules nor between packages),
gRPC stays at the edges, modes are asked (never compared by name) and declared once, every module
says what it is for."""
from __future__ import annotations

import ast
import dataclasses
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(REPO) / "psgrad"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "proto" not in p.relative_to(PACKAGE).parts)
# What each folder may import from psgrad (besides errors and proto, which anything may, and config,
# which anything above core may).
ALLOWED = {
    "config": {"core"},  # used everywhere, so it sits right above core
    "errors": set(),
    "core": {"core"},  # not even config: JobSpec lives in core (core/job.py), config names it
    "wire": {"core", "wire"},
    "server": {"core", "wire", "server"},
    "client": {"core", "wire", "client"},
    "worker": {"core", "wire", "client", "worker", "metrics", "tasks", "nn"},  # not api: the API builds on worker
    "metrics": {"metrics", "core"},
    "nn": {"nn", "core"},  # modules of users' models (psgrad.Embedding): torch, no wire
    "tasks": {"tasks", "nn", "core"},
}
GRPC_EDGES = {"wire", "server", "client"}


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The file's syntax tree, parsed once per test process (the tests only read it)."""
    return ast.parse(path.read_text())


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    """Every module path imported anywhere in the file (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """psgrad module -> the psgrad modules its file imports, wherever: module level, under
    TYPE_CHECKING, inside functions (a lazy import is still a dependency)."""
    paths = {_module_name(p): p for p in MODULES}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                # `from psgrad import errors` imports the module psgrad.errors, not psgrad's __init__
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in paths and t != name)  # proto/ and outside psgrad: not nodes
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    """No module imports, directly or through others, a module that imports it (function-level
    imports count: hiding an import in a function does not break a cycle)."""
    graph = _import_graph()
    assert {"psgrad.api", "psgrad.cli.main", "psgrad.server.shard"} <= graph.keys()  # the walk found the package
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(
        " + ".join(c) + ": " + "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c) for c in cycles
    )


def _package(module: str) -> str:
    """psgrad.core.modes -> core; psgrad.api -> api; psgrad (its __init__) -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _package_graph(modules: Mapping[str, Iterable[str]]) -> dict[str, dict[str, list[str]]]:
    """module -> the modules it imports, as package -> package -> the imports that make the edge
    ("psgrad.x.a -> psgrad.y.b"); imports within a package are no edge."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, deps in modules.items():
        edges = graph.setdefault(_package(module), {})
        for dep in sorted(deps):
            if _package(dep) != _package(module):
                graph.setdefault(_package(dep), {})
                edges.setdefault(_package(dep), []).append(f"{module} -> {dep}")
    return graph


def _package_cycles(modules: Mapping[str, Iterable[str]]) -> list[str]:
    """Each cycle between psgrad's packages (core <-> config, api <-> worker, ...), named with the
    imports that close it; empty when the packages form a DAG."""
    graph = _package_graph(modules)
    found = []
    for cycle in _cycles({package: set(edges) for package, edges in graph.items()}):
        imports = [i for a in cycle for b in cycle if b in graph[a] for i in graph[a][b]]
        found.append(" <-> ".join(cycle) + ": " + "; ".join(imports))
    return found


def test_no_cycles_between_packages() -> None:
    """The packages (core, wire, server, client, worker, api, config, ...) import each other one way
    only: a package-level cycle (core -> config -> core) is a failure even when no module-level
    cycle closes it."""
    graph = _import_graph()
    packages = _package_graph(graph)
    assert {"core", "config", "api", "worker", "cli", "experiments"} <= packages.keys()  # the walk found them
    cycles = _package_cycles(graph)
    assert not cycles, "cycles between packages:\n" + "\n".join(cycles)
    assert "config" not in packages["core"] and "api" not in packages["worker"]  # core and worker point down


def test_a_cycle_between_packages_is_reported() -> None:
    """The check can fail: a cycle through two packages (no module-level cycle) is found and named,
    with the imports that close it; the real graph with one upward import added fails too."""
    fake = {
        "psgrad.core.job": {"psgrad.core.modes"},
        "psgrad.core.modes": {"psgrad.config"},  # core importing upward
        "psgrad.config": {"psgrad.core.job"},
        "psgrad.api": {"psgrad.worker.flat"},
        "psgrad.worker.flat": set(),
    }
    assert _cycles({m: set(d) for m, d in fake.items()})  # (here the modules close one as well)
    fake["psgrad.config"] = {"psgrad.core.job"}
    fake["psgrad.core.modes"] = set()
    fake["psgrad.core.status"] = {"psgrad.config"}  # module-level: no cycle; package-level: core <-> config
    assert not _cycles({m: set(d) for m, d in fake.items()})
    assert _package_cycles(fake) == [
        "config <-> core: psgrad.config -> psgrad.core.job; psgrad.core.status -> psgrad.config"]
    graph = {m: set(d) for m, d in _import_graph().items()}
    graph["psgrad.worker.loop"].add("psgrad.api")  # what worker/loop.py once did
    assert [c.split(":")[0] for c in _package_cycles(graph)] == ["api <-> worker"]


def test_the_package_is_laid_out_in_folders() -> None:
    assert {_part(p) for p in MODULES} >= {"core", "wire", "server", "client", "worker", "launch", "cli", "experiments"}


def test_only_the_public_modules_are_top_level() -> None:
    """Every other module lives in the folder of its layer."""
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top <= {"__init__", "__main__", "api", "config", "errors"}, sorted(top)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_one_way(path: Path) -> None:
    part = _part(path)
    used = {m.split(".")[1] for m in _imports(path) if m.startswith("psgrad.")}
    used -= {"errors", "proto", part} | ({"config"} if part not in ("core", "errors") else set())
    if part in ALLOWED:
        assert used <= ALLOWED[part], f"{path.name} ({part}/) imports {sorted(used - ALLOWED[part])}"
    if part == "client":
        assert "server" not in used
    if part == "server":
        assert "client" not in used


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_grpc_only_at_the_edges(path: Path) -> None:
    uses_grpc = any(m == "grpc" or m.startswith("grpc.") for m in _imports(path))
    assert not uses_grpc or _part(path) in GRPC_EDGES, f"{path} imports grpc"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_say_what_they_are_for(path: Path) -> None:
    """No cap on length: a module may be long where its concept is."""
    assert ast.get_docstring(_tree(path)), f"{path} has no module docstring"


PROTOBUF_METHODS = {"HasField", "WhichOneof", "ListFields", "CopyFrom", "MergeFrom", "ClearField",
                    "SerializeToString", "ParseFromString", "FromString"}


def test_the_api_speaks_torch_and_psgrad_types_only() -> None:
    """api.py imports no protobuf module and calls no protobuf message's methods: the client hands
    it psgrad's types (PushOutcome, ints, tensors)."""
    path = PACKAGE / "api.py"
    protobuf = sorted(m for m in _imports(path) if m.startswith(("psgrad.proto", "google.protobuf")))
    assert not protobuf, f"api.py imports {protobuf}"
    calls = [f"api.py:{n.lineno}: {ast.unparse(n)}" for n in ast.walk(_tree(path))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in PROTOBUF_METHODS]
    assert not calls, calls


def _protobuf_inside(value: Any, where: str = "") -> list[str]:
    """Where value holds a protobuf message (in dataclass fields, sequences, mappings)."""
    from google.protobuf.message import Message

    if isinstance(value, Message):
        return [f"{where or 'value'}: {type(value).__name__}"]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [x for f in dataclasses.fields(value) for x in _protobuf_inside(getattr(value, f.name), f"{where}.{f.name}")]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [x for i, v in enumerate(value) for x in _protobuf_inside(v, f"{where}[{i}]")]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _protobuf_inside(k, where) + _protobuf_inside(v, f"{where}[{k!r}]")]
    return []


def test_what_the_api_gets_and_returns_holds_no_protobuf(make_servers, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Best effort, at run time: in a sync job and an async job with overlap, what ParameterClient
    hands PSOptimizer and what the API returns (StepStats, versions) hold no protobuf message."""
    import torch
    from torch import nn

    import psgrad
    from psgrad.client.parameter_client import ParameterClient
    from psgrad.config import ClientConfig

    from psgrad.proto import ps_pb2

    assert _protobuf_inside({"replies": [ps_pb2.PushReply()]}) == ["['replies'][0]: PushReply"]  # the walk finds one
    handed: list[tuple[str, Any]] = []
    for name in ("join", "pull", "exchange", "rollback", "views", "gradient_buffer", "leave"):
        def recording(self: ParameterClient, *args: Any, _name: str = name, _call: Any = getattr(ParameterClient, name),
                      **kwargs: Any) -> Any:
            result = _call(self, *args, **kwargs)
            handed.append((_name, result))
            return result

        monkeypatch.setattr(ParameterClient, name, recording)
    returned: list[tuple[str, Any]] = []
    client = ClientConfig(connect_timeout_s=10, rpc_timeout_s=30, init_timeout_s=30, reconnect_timeout_s=0)
    for mode, overlap in (("sync", False), ("async", True)):
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        with psgrad.connect([s.address for s in make_servers(2)], mode=mode, client=client) as ps:
            opt = ps.optimizer(model, overlap=overlap)
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(5, 8)).square().mean().backward()
                returned.append((f"{mode} step()", opt.step()))
            returned.append((f"{mode} synchronize()", opt.synchronize()))
            returned.append((f"{mode} refresh()", opt.refresh()))
    assert [name for name, _ in handed].count("exchange") == 6
    found = [x for name, value in handed + returned for x in _protobuf_inside(value, name)]
    assert not found, found


from psgrad.core.modes import DECLARED, MODES  # noqa: E402 (the one declaration the checks below read)

MODE_NAMES = set(MODES)
# The string predicates code once asked about a mode by name; a Mode's properties replaced them.
OLD_PREDICATES = {"is_synchronous", "bounds_staleness", "default_staleness"}


def _names_a_mode(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in MODE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_mode(e) for e in node.elts)
    return isinstance(node, ast.Starred) and _names_a_mode(node.value)


def _mode_string_tests(tree: ast.AST) -> list[str]:
    """Where code tests a mode by its name: compares something with a mode's name (or a tuple holding
    one; ==, !=, in, not in), calls one of the old string predicates (is_synchronous(spec.mode), ...)
    or imports one, or asks whether a string starts or ends with a mode's name ("ssp:")."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            if any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops) and any(
                _names_a_mode(x) for x in (node.left, *node.comparators)
            ):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            prefixes = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if name in OLD_PREDICATES or (name in ("startswith", "endswith") and any(
                    p.split(":")[0] in MODE_NAMES for p in prefixes)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and any(a.name in OLD_PREDICATES for a in node.names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_modes_are_asked_not_compared() -> None:
    """Outside core/, no code tests a mode by its name (see _mode_string_tests): it asks the mode
    (mode_of(spec).synchronous, find_mode(name).bounds_staleness, ...) or its policy
    (policy_for(spec).drops_late, ...), so what a mode means lives in one place."""
    found = []
    for path in MODULES:
        if _part(path) == "core":
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{x}" for x in _mode_string_tests(_tree(path))]
    assert not found, "modes tested by name outside core/:\n" + "\n".join(found)


def test_a_mode_tested_by_name_is_reported() -> None:
    """The check can fail: each way of testing a mode by name is found."""
    code = """
if spec.mode == "sync": pass
if mode in ("async", "ssp"): pass
if is_synchronous(spec.mode) or modes.bounds_staleness(name): pass
if label.startswith("ssp:"): pass
from psgrad.core.modes import default_staleness
if mode_of(spec).synchronous and label.startswith("sparse"): pass
"""
    assert sorted(int(x.split(":")[0]) for x in _mode_string_tests(ast.parse(code))) == [2, 3, 4, 4, 5, 6]


def _mode_name_lists(tree: ast.AST) -> list[str]:
    """Literal lists of modes: a tuple, list or set holding two mode names or more, or a dict with
    two mode names or more among its keys (a second declaration of the modes)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        named = {e.value for e in items if isinstance(e, ast.Constant) and e.value in MODE_NAMES}
        if len(named) >= 2:
            found.append(f"{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def _mode_name_declarations(tree: ast.AST) -> list[str]:
    """Classes that name themselves after a mode (a policy's `name = "sync"`): the mode names' declaration."""
    return [f"{s.lineno}: {s.value.value}" for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            for s in node.body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)
            and s.value.value in MODE_NAMES and any(getattr(x, "id", None) == "name" for x in s.targets)]


def test_the_modes_are_declared_once() -> None:
    """Each mode's name is written once as a declaration (its policy class's name, core/consistency.py),
    the list of modes once (core/modes.py's DECLARED, of Mode objects), and everything else is made
    from that: no literal list of mode names anywhere in psgrad (MODES, the CLI's --mode choices,
    compare's variants and notes, the modes with stale gradients)."""
    assert MODES == tuple(m.name for m in DECLARED) and len(set(MODES)) == len(MODES) >= 3
    lists, declared = [], []
    for path in MODULES:
        tree = _tree(path)
        where = path.relative_to(PACKAGE.parent)
        lists += [f"{where}:{x}" for x in _mode_name_lists(tree)]
        declared += [(str(where), x.split(": ")[1]) for x in _mode_name_declarations(tree)]
    assert not lists, "literal lists of modes (derive them from core/modes.py's DECLARED):\n" + "\n".join(lists)
    assert sorted(declared) == sorted(("psgrad/core/consistency.py", m) for m in MODES), declared


def test_a_second_list_of_modes_is_reported() -> None:
    """The check can fail: lists, sets and dict keys naming two modes or more are found, one mode
    name alone (a default, a label) is not."""
    code = """
MODES = ("async", "ssp")
OPTIONS = {"sync": (), "async": ()}
CHOICES = ["sync", "async", "ssp", "allreduce"]
DEFAULT = "sync"
LABELS = ["ssp:2", "async"]
class P:
    name = "ssp"
    mode = "sync"
"""
    tree = ast.parse(code)
    assert sorted(int(x.split(":")[0]) for x in _mode_name_lists(tree)) == [2, 3, 4]
    assert _mode_name_declarations(tree) == ["8: ssp"]


def test_policies_are_asked_not_inspected() -> None:
    """Only core/consistency.py may look at which policy class it has."""
    for path in MODULES:
        if path.name == "consistency.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                assert "Policy" not in ast.unparse(node.args[1]), f"{path}: {ast.unparse(node)}"


def test_median_module_is_under_200_lines() -> None:
    sizes = sorted(len(p.read_text().splitlines()) for p in MODULES)
    assert sizes[len(sizes) // 2] < 200, sizes


def _psgrad_classes() -> dict[str, tuple[Path, ast.ClassDef]]:
    """Every class defined in psgrad, by name."""
    return {node.name: (path, node) for path in MODULES for node in ast.walk(_tree(path))
            if isinstance(node, ast.ClassDef)}


def test_no_class_inherits_from_two_psgrad_classes() -> None:
    """Composition, not mixins: no class of psgrad has more than one psgrad class among its bases (the
    shard was once `class Shard(ReplicaPath, Recovery, PushPath)`, glued by NotImplementedError stubs)."""
    classes = _psgrad_classes()
    mixed = [f"{path.relative_to(PACKAGE.parent)}: class {name}({', '.join(ast.unparse(b) for b in node.bases)})"
             for name, (path, node) in classes.items()
             if sum(ast.unparse(b).rsplit(".", 1)[-1] in classes for b in node.bases) > 1]
    assert not mixed, "classes with several psgrad bases:\n" + "\n".join(mixed)


def test_the_shard_is_composed_and_holds_tables() -> None:
    """The shard has no psgrad base class and there is no `raise NotImplementedError` glue anywhere
    in psgrad; the shard's collaborators are objects it holds, and its state holds tables."""
    from psgrad.server.shard import Shard
    from psgrad.server.state import ShardState

    assert Shard.__bases__ == (object,)
    for path in MODULES:  # (the client's same-host path is a collaborator too)
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Raise) and node.exc is not None:
                assert "NotImplementedError" not in ast.unparse(node.exc), f"{path.name}:{node.lineno}"
    from psgrad.config import ServerConfig

    shard = Shard(ServerConfig())
    assert {type(c).__name__ for c in (shard.core, shard.pushes, shard.recovery, shard.replica)} == {
        "ShardCore", "Pushes", "Recovery", "Replica"}
    assert "tables" in ShardState.__dataclass_fields__
