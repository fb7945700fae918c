"""The house rules of docs/architecture.md, checked on the source: no import cycle, no import that points up a
layer, and no public name that is also a module name. One process, no ranks; it reads files with `ast`.

Every import inside `hpdl` counts: at module level, under `if TYPE_CHECKING:` and inside functions (a
function-level import that closes a circle only hides it). On failure the message lists the offending
edges as `importer -> imported (file:line)`.
"""

from __future__ import annotations

import ast
import functools
import importlib
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from typing import Optional, Sequence

import pytest

import hpdl

SRC = os.path.dirname(os.path.abspath(hpdl.__file__))

LAYERS: list[tuple[str, ...]] = [
    ("cli", "bench"),
    ("keras",),
    ("tensorflow",),
    ("train", "horovod"),
    ("plan",),
    ("parallel",),
    ("checkpoint", "models"),
    ("ml", "dask"),
    ("interop",),
    ("runtime",),
    ("comm",),
    ("errors", "_version", "settings"),
]
"""Top-level packages of hpdl, highest floor first (/work/shared/ARCHITECTURE.md, docs/architecture.md).

A module may import its own package and any floor below; packages on one floor are siblings and do not
import each other, except on the top floor: `cli` and `bench` are the entry points and may call each other.
`models` (plain torch models) sits beside `checkpoint`: `parallel.tensor` and `plan` build on it."""

PARALLEL_ORDER: dict[str, int] = {"shared": 0, "data": 1, "tensor": 2, "mesh": 9}
"""Floors inside `hpdl.parallel`: `shared` below every strategy, then `data` (its buckets serve ZeRO and Horovod),
`tensor` (its shard annotations serve ZeRO's clipping and the mesh), then the other strategies (`pipe`,
`zero_redundancy`, and any new one such as `spatial` or `branch`: rank STRATEGY, siblings), `mesh` on top."""
STRATEGY = 5

ROOT_EXEMPT = "hpdl"
"""Edges *to* the root package are left out of both checks: Python loads a package before any of its modules,
so `import hpdl` (or `from hpdl import __version__`) inside hpdl loads nothing new; the root itself is checked
(it imports `comm`, `runtime` and `errors` only)."""


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    path: str
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = "function-level" if self.in_function else "module-level"
        path = os.path.relpath(self.path, os.path.dirname(SRC))
        return f"{self.importer} -> {self.imported} ({path}:{self.line}, {where})"


def _modules() -> dict[str, tuple[str, bool]]:
    """Every module of hpdl: dotted name -> (file, is a package)."""
    found: dict[str, tuple[str, bool]] = {}
    base = os.path.dirname(SRC)
    for folder, dirs, files in os.walk(SRC):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, base)[: -len(".py")].split(os.sep)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _resolve(name: str) -> Optional[str]:
    """The hpdl module that `name` (a module or an attribute of one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges() -> list[Edge]:
    edges: list[Edge] = []
    for module, (path, is_package) in MODULES.items():
        with open(path) as handle:
            tree = ast.parse(handle.read(), path)
        inside = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
            if node is not fn
        }
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = module.split(".") if is_package else module.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    source = ".".join(parts + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from pkg import submodule` depends on the submodule; `from pkg import name` on pkg itself.
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
            for target in targets:
                if not target.startswith("hpdl"):
                    continue
                imported = _resolve(target)
                if imported is None or imported == module or imported == ROOT_EXEMPT:
                    continue
                edges.append(Edge(module, imported, path, node.lineno, id(node) in inside))
    return edges


@functools.cache
def edges() -> tuple[Edge, ...]:
    """The import graph, parsed once by the worker that runs these tests (not at every worker's collection)."""
    return tuple(_edges())


def _cycles(edges: Sequence[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _floor(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    for level, names in enumerate(LAYERS):
        if top in names:
            return len(LAYERS) - level
    raise AssertionError(
        f"{module}: the top-level package {top!r} has no floor in LAYERS; add it where it belongs "
        "(tests/test_architecture.py and docs/architecture.md)"
    )


def _parallel_rank(module: str) -> Optional[int]:
    """Floor inside hpdl.parallel (None outside it); the package's own __init__ is above every strategy."""
    parts = module.split(".")
    if parts[:2] != ["hpdl", "parallel"]:
        return None
    if len(parts) == 2:
        return 100
    return PARALLEL_ORDER.get(parts[2], STRATEGY)


def _points_up(e: Edge) -> bool:
    if e.importer.split(".")[:2] == e.imported.split(".")[:2]:  # inside one top-level package
        mine, theirs = _parallel_rank(e.importer), _parallel_rank(e.imported)
        if mine is None or e.importer.split(".")[:3] == e.imported.split(".")[:3]:
            return False
        return theirs is not None and theirs >= mine
    if e.importer == ROOT_EXEMPT:
        return False
    mine, theirs = _floor(e.importer), _floor(e.imported)
    if mine == theirs == len(LAYERS):  # cli <-> bench
        return False
    return theirs >= mine


def test_module_walk_sees_the_packages() -> None:
    """The walk finds the modules and their imports (a broken walk would pass every check below)."""
    assert "hpdl.parallel.mesh.compose" in MODULES and "hpdl.comm.base" in MODULES
    assert any(
        e.importer == "hpdl.parallel.mesh.compose" and e.imported.startswith("hpdl.parallel.pipe") for e in edges()
    )
    assert any(e.in_function for e in edges()), "function-level imports must be part of the graph"
    assert _cycles([Edge("a", "b", SRC, 1, False), Edge("b", "c", SRC, 1, True), Edge("c", "a", SRC, 1, False)])
    up = [("hpdl.checkpoint.sharded", "hpdl.train.checkpoint"), ("hpdl.train.demo", "hpdl.bench.report")]
    up += [
        ("hpdl.parallel.zero_redundancy.wrap", "hpdl.parallel.mesh"),
        ("hpdl.parallel.pipe.p2p", "hpdl.parallel.zero_redundancy"),
    ]
    up += [("hpdl.parallel.data.buckets", "hpdl.parallel.tensor"), ("hpdl.ml.base", "hpdl.dask.cluster")]
    down = [
        ("hpdl.parallel.mesh.compose", "hpdl.parallel.pipe"),
        ("hpdl.parallel.spatial.halo", "hpdl.parallel.tensor"),
    ]
    down += [("hpdl.bench.gpu_check", "hpdl.cli.info"), ("hpdl.train.trainer", "hpdl.parallel.shared")]
    assert all(_points_up(Edge(a, b, SRC, 1, False)) for a, b in up)
    assert not any(_points_up(Edge(a, b, SRC, 1, False)) for a, b in down)


def test_no_import_cycle() -> None:
    cycles = _cycles(edges())
    report = []
    for members in cycles:
        inside = set(members)
        report.append(" <-> ".join(members))
        report += [f"    {e}" for e in edges() if e.importer in inside and e.imported in inside]
    assert not cycles, "import cycles in hpdl (move the shared piece down a floor):\n" + "\n".join(report)


def test_imports_point_down() -> None:
    upward = [str(e) for e in edges() if _points_up(e)]
    assert not upward, (
        "imports that point up or sideways (see LAYERS and PARALLEL_ORDER; move the piece down, or let the "
        "caller pass what is needed):\n  " + "\n  ".join(upward)
    )


def _packages() -> list[str]:
    return sorted(name for name, (_, is_package) in MODULES.items() if is_package)


def test_the_low_floors_never_import_the_root_package() -> None:
    """`runtime` and the floors below it take the version from the leaf `hpdl._version` and their folder from
    `__file__`: `import hpdl` there would pull the root (and what it imports) under the lowest floors."""
    low = {name for names in LAYERS[LAYERS.index(("runtime",)) :] for name in names}
    found = []
    for folder, _, files in os.walk(SRC):
        for file in files:
            path = os.path.join(folder, file)
            top = os.path.relpath(path, SRC).split(os.sep)[0].removesuffix(".py")
            if not file.endswith(".py") or top not in low:
                continue
            for node in ast.walk(ast.parse(open(path).read(), path)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module == "hpdl" and not node.level:
                    names = ["hpdl"]
                found += [f"{path}:{node.lineno}" for n in names if n == "hpdl"]
    assert not found, found


def test_no_public_name_is_a_module() -> None:
    """`import pkg.name` binds the module as the package attribute `name`, over a public function of that name."""
    clashes = []
    for package in _packages():
        module = importlib.import_module(package)
        exported = getattr(module, "__all__", [])
        clashes += [
            f"{package}.{name}"
            for name in exported
            if f"{package}.{name}" in MODULES and not isinstance(getattr(module, name, None), types.ModuleType)
        ]  # a package may offer a submodule as such (hvd.elastic); not a function of the module's name
    assert not clashes, "public names that are also modules (rename the module): " + ", ".join(clashes)


def test_importing_every_parallel_module_rebinds_nothing() -> None:
    import hpdl.parallel as parallel

    before = {name: getattr(parallel, name) for name in parallel.__all__}
    for module in sorted(MODULES):
        if module.startswith("hpdl.parallel."):
            importlib.import_module(module)
    after = {name: getattr(parallel, name) for name in parallel.__all__}
    assert after == before
    assert callable(parallel.zero) and not isinstance(parallel.zero, type(parallel))
    assert all(
        isinstance(importlib.import_module(p).__all__, list) for p in _packages() if p.startswith("hpdl.parallel")
    )


LIGHT_IMPORT = """
import sys
import hpdl, hpdl.cli.main, hpdl.cli.launch, hpdl.dask, hpdl.train.demo
assert "torch" not in sys.modules, "import hpdl (or the launcher, or hpdl demo's) imported torch"
import torch.distributed as dist
assert "hpdl" in dist.Backend.backend_list, "importing torch after hpdl did not register the backend"
assert "torch._dynamo" not in sys.modules
print(hpdl.init.__module__, hpdl.Communicator.__name__, hpdl.runtime.init is hpdl.init)
"""


def test_import_hpdl_needs_no_torch_and_registers_the_backend_once_torch_loads() -> None:
    """The launchers (`hpdl launch`, `hpdl dask`, `hpdl demo`) start in a fraction of torch's import, which
    their ranks pay, not they; torch programs still find "hpdl"."""
    done = subprocess.run([sys.executable, "-c", LIGHT_IMPORT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["hpdl.runtime.world", "Communicator", "True"]
    torch_first = "import torch.distributed as dist, hpdl; assert 'hpdl' in dist.Backend.backend_list"
    done = subprocess.run([sys.executable, "-c", torch_first], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


ASK_FOR_HPDL = """
import importlib, os, sys, warnings
warnings.simplefilter("always")
before = dict(os.environ)
import torch, torch.distributed as dist
handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
print(torch.ones(2).sum().item(), dict(os.environ) == before, "hpdl" in sys.modules,
      getattr(handlers["env"], "_hpdl", False), flush=True)
try:
    dist.Backend("hpdl")  # what init_process_group("hpdl") does first (torch < 2.14); 2.14 calls the entry point
    if not getattr(handlers["env"], "_hpdl", False):
        importlib.metadata.entry_points(group="torch.distributed.backends")["hpdl"].load()()
    print("asked", "hpdl" in sys.modules, getattr(handlers["env"], "_hpdl", False))
except RuntimeError as error:
    print("refused", error)
"""


@pytest.mark.parametrize(
    "shadow",
    ["raise ImportError('not the hpdl you installed')", None],
    ids=["failing hpdl", "empty hpdl folder"],
)
def test_a_broken_hpdl_first_on_the_path_leaves_import_torch_working(tmp_path, shadow):
    """torch calls hpdl's autoload entry point inside `import torch` and fails its own import when that raises: the
    target (hpdl_torch_autoload, outside the package) imports nothing of hpdl, so `import torch` works whatever
    state hpdl is in, and changes nothing (os.environ, torch's env:// handler); the program that asks for "hpdl"
    is told why it cannot have it. (A folder without __init__.py is a namespace portion, which the installed
    package wins over: asking works.)"""
    folder = tmp_path / "hpdl"
    folder.mkdir()
    if shadow is not None:
        (folder / "__init__.py").write_text(shadow)
    done = subprocess.run(
        [sys.executable, "-c", ASK_FOR_HPDL], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    imported, asked = done.stdout.splitlines()
    assert imported.split() == ["2.0", "True", "False", "False"], done.stdout  # torch works and nothing changed
    assert "Warning" not in done.stderr, done.stderr
    if shadow is None:
        assert asked == "asked True True", done.stdout  # the installed hpdl, registered with env:// over MPI
    else:
        assert asked == (
            'refused the "hpdl" torch.distributed backend was asked for, but importing hpdl failed (ImportError: '
            "not the hpdl you installed); is another `hpdl` (a folder of that name) first on sys.path?"
        ), done.stdout
