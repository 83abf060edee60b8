"""The package layout of /work/shared/LAYOUT.md holds: reading every top-level package's imports with ast
(lazy imports inside functions included; generated *_pb2*.py skipped), no package imports one on its own or
a higher floor, so there is no cycle; rpc/ imports no torch; every package has a floor."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_PRODUCT = {"tests", "benchmarks", "training", "scripts", "docs", "models", "protos", "docker"}
# Each package may import only packages on strictly lower floors.
FLOORS = {
    "rpc": 0,
    "engine": 1,
    "kvtransfer": 2, "bench": 2,
    "gateway": 3, "prefill_worker": 3, "decode_worker": 3,
    "pdserve": 4,
}
# Third-party modules a floor must not import (floor 0 is plumbing only: no torch, no model code).
FORBIDDEN_THIRD_PARTY = {"rpc": {"torch", "triton", "transformers", "numpy"}}


def _packages() -> set[str]:
    return {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name not in NOT_PRODUCT}


def _imports(package: str) -> dict[str, set[str]]:
    """{imported top-level module: files importing it} for every import statement anywhere in `package`."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in (ROOT / package).rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                found[name.split(".")[0]].add(str(path.relative_to(ROOT)))
    return found


def _graph() -> dict[str, dict[str, set[str]]]:
    packages = _packages()
    return {pkg: {dep: files for dep, files in _imports(pkg).items() if dep in packages and dep != pkg}
            for pkg in packages}


def test_every_package_has_a_floor():
    """A new top-level package must be placed on a floor here (and in LAYOUT.md) before it is imported."""
    assert _packages() - set(FLOORS) == set(), "add the new package to FLOORS"


def test_imports_only_go_down():
    """Each package imports only packages on lower floors (lazy imports count)."""
    bad = [f"{pkg} (floor {FLOORS[pkg]}) imports {dep} (floor {FLOORS[dep]}) in {sorted(files)}"
           for pkg, deps in _graph().items() for dep, files in deps.items()
           if pkg in FLOORS and dep in FLOORS and FLOORS[dep] >= FLOORS[pkg]]
    assert not bad, "\n".join(bad)


def test_no_cycle_between_packages():
    """Depth-first search over the package graph finds no cycle (independent of the floor table)."""
    graph = {pkg: set(deps) for pkg, deps in _graph().items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [node, dep])
            elif dep not in state:
                visit(dep, stack + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, cycles


def test_floor_zero_has_no_heavy_dependencies():
    """rpc/ imports neither torch nor other numeric / model libraries."""
    for package, forbidden in FORBIDDEN_THIRD_PARTY.items():
        used = _imports(package)
        assert not {name: sorted(used[name]) for name in forbidden if name in used}, package


def test_the_gateway_process_starts_without_torch():
    """The gateway (tokenizer, routing, gRPC) loads no torch: ~2 s of CPU and ~300 MB less per gateway
    process. Its model facts come from config.json; torch is imported lazily where the engine needs it."""
    import subprocess
    import sys

    check = ("import sys; from gateway.server import serve; from gateway.model_info import ModelFacts; "
             "[ModelFacts.from_dir(d) for d in sys.argv[1:]]; "
             "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))")
    models = [str(ROOT / "models" / name) for name in ("pdserve-tiny", "pdserve-k3-tiny")]
    result = subprocess.run([sys.executable, "-c", check, *models], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch" not in result.stdout, result.stdout


# File-level circles the lead removes when the branches that fix them merge (issue 32): engine.runtime.llm_engine <->
# engine.runtime.prefill_jobs (branch "prefix": one chunked-prefill implementation) and engine.runtime.model_runner <->
# engine.runtime.cuda_graphs (branch "gpu"). Each entry is one circle's exact set of modules; no other circle may exist.
KNOWN_CIRCLES = [
]


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph(root: Path, packages: set[str]) -> dict[str, set[str]]:
    """{module: modules it imports} over every .py file of `packages` under root: every import statement counts
    (function-local and TYPE_CHECKING ones too; relative ones resolved); `from a.b import c` is an edge to the
    module a.b.c when that is a file, else to a.b. A package's implicit import of its parents is not an edge."""
    files = {_module_name(root, path): path for package in packages for path in (root / package).rglob("*.py")
             if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import a.b.c` of a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_import_circle_between_files():
    """No two product files import each other, directly or around a loop, lazy imports included, but the
    circles listed in KNOWN_CIRCLES (each exactly; an entry whose circle is gone must be removed too)."""
    circles = _circles(_module_graph(ROOT, _packages()))
    unexpected = [sorted(circle) for circle in circles if circle not in KNOWN_CIRCLES]
    assert not unexpected, f"import circles between files: {unexpected}"
    gone = [sorted(known) for known in KNOWN_CIRCLES if known not in circles]
    assert not gone, f"KNOWN_CIRCLES lists circles that no longer exist (remove them): {gone}"


def test_a_lazy_import_circle_is_found(tmp_path):
    """Negative control: a.py imports b at its top, b.py imports a inside a function (and c under TYPE_CHECKING
    relatively): both circles are reported; a file importing without a loop is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import helper\n")
    (package / "b.py").write_text("def helper():\n    from pkg import a\n    return a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n")
    (package / "d.py").write_text("import pkg.c\nclass D: ...\n")
    (package / "e.py").write_text("from pkg.a import helper\n")
    circles = _circles(_module_graph(tmp_path, {"pkg"}))
    assert sorted(map(sorted, circles)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
