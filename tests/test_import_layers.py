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
