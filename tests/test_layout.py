"""The layout: tests/ holds tests (test_*.py, conftest.py and the fixtures a test imports or runs;
measurement scripts and the GPU host's run scripts live in tools/, the native benchmarks in
native/bench/); the runtime imports no benchmark code and needs no package of the ``bench`` extra;
the Python packages' imports have no circle and keep to docs/ARCHITECTURE.md's table of what may
import what."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PACKAGES = (ROOT / "tutti_cluster", ROOT / "control" / "tutti_control")


def test_every_other_file_in_tests_is_used_by_a_test():
    sources = {p: p.read_text() for p in TESTS.glob("*.py") if p.name.startswith("test_") or p.name == "conftest.py"}
    unused = []
    for p in sorted(TESTS.iterdir()):
        if p.is_dir() or p in sources:
            continue
        name = p.stem if p.suffix == ".py" else p.name
        if not any(name in text for q, text in sources.items() if q != p):
            unused.append(p.name)
    assert not unused, f"not a test nor used by one, belongs in tools/: {unused}"


def test_native_benchmarks_are_apart_from_the_native_tests():
    assert not [p.name for p in (ROOT / "native" / "tests").iterdir() if not p.name.startswith("test_")]


# The store, the node daemon and the cluster plane; the vLLM connector's three sides.
RUNTIME = ("tutti_cluster.store", "tutti_cluster.node.daemon", "tutti_cluster.node.link",
           "tutti_cluster.cluster.client", "tutti_cluster.cluster.directory", "tutti_cluster.cluster.stage",
           "tutti_cluster.cluster.stage_stream")
VLLM = ("tutti_cluster.vllm.connector", "tutti_cluster.vllm.scheduler", "tutti_cluster.vllm.worker")
BENCH_EXTRA = ("matplotlib", "tqdm")  # pyproject's `bench` extra


def loaded_by(modules: tuple[str, ...]) -> list[str]:
    """The modules a fresh interpreter holds once it has imported ``modules``."""
    code = ("import importlib, json, sys; [importlib.import_module(m) for m in sys.argv[1:]]; "
            "print(json.dumps(sorted(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def benchmark_modules(loaded: list[str], extra: tuple[str, ...]) -> list[str]:
    return [m for m in loaded if m.split(".")[0] in extra or m.split(".")[:2] == ["tutti_cluster", "bench"]]


def test_the_runtime_imports_no_benchmark_code_nor_the_bench_extra():
    assert not benchmark_modules(loaded_by(RUNTIME), BENCH_EXTRA)
    if importlib.util.find_spec("vllm") is not None:
        # vLLM imports tqdm itself (a dependency of its own): there only plots and benchmarks count.
        assert not benchmark_modules(loaded_by(VLLM), ("matplotlib",))


def test_the_demo_runs_without_the_bench_extra(tmp_path: Path):
    # A None entry in sys.modules makes the import fail, as a package that is not installed would.
    code = (f"import sys; [sys.modules.__setitem__(m, None) for m in {list(BENCH_EXTRA)!r}]; "
            "from tutti_cluster.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "up", "--demo", "--tokens", "256", "--capacity-gb", "0.1",
                        "--data-dir", str(tmp_path / "node")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "byte-exact    yes" in r.stdout, (r.stdout, r.stderr)


def module_name(path: Path) -> str:
    top = next(p for p in PACKAGES if p in path.parents)
    rel = path.with_suffix("").relative_to(top.parent)
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import a module can run: at module level and deferred ones in functions, all but those
    under ``if TYPE_CHECKING:`` (type checkers read them, Python does not)."""
    found: list[ast.Import | ast.ImportFrom] = []

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if "TYPE_CHECKING" in ast.unparse(node.test):
                for n in node.orelse:
                    self.visit(n)
            else:
                self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.append(node)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            found.append(node)

    Visitor().visit(tree)
    return found


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: ``imports`` less those inside functions."""
    deferred = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(f)}
    return [n for n in imports(tree) if id(n) not in deferred]


def import_graph(find: Callable[[ast.Module], list[ast.Import | ast.ImportFrom]] = imports) -> dict[str, set[str]]:
    """Module -> the modules of these packages it imports (a package's ``__init__`` where a name
    comes from the package itself; a parent package that Python runs first is no edge), the imports
    being those ``find`` picks."""
    files = {module_name(p): p for pkg in PACKAGES for p in pkg.rglob("*.py")}
    known = set(files) | {module_name(p.with_name(p.name.split(".")[0] + ".py"))
                          for pkg in PACKAGES for p in [*pkg.rglob("*.pyi"), *pkg.rglob("*.so")]}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for m, path in files.items():
        for node in find(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per further dot
                    pkg = m.split(".") if path.name == "__init__.py" else m.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join([*pkg, base] if base else pkg)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for t in targets:
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    graph[m].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_packages_imports_have_no_circle():
    assert not circles(import_graph())


def test_the_circle_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("import x\nif TYPE_CHECKING:\n    import y\ndef f():\n    from z import w\n")
    assert [ast.unparse(n) for n in imports(tree)] == ["import x", "from z import w"]


# docs/ARCHITECTURE.md, "What may import what": a module, or with ".*" a package and everything in
# it, -> what it may import (the same notation). A module keeps to its own entry, else to the
# longest package entry over it; a module that no entry covers is a new place the table must name.
BASE = tuple(f"tutti_cluster.{m}" for m in ("errors", "files", "keys", "kv_layout", "config"))
RUNTIME_ALL = ("tutti_cluster", *BASE, "tutti_cluster._native", "tutti_cluster.store", "tutti_cluster.demo",
               "tutti_cluster.node.*", "tutti_cluster.cluster.*", "tutti_cluster.pipeline.*", "tutti_cluster.vllm.*")
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "tutti_cluster": (*BASE, "tutti_cluster.store"),
    "tutti_cluster.errors": (),
    "tutti_cluster.files": ("tutti_cluster.errors",),
    "tutti_cluster.keys": ("tutti_cluster.errors",),
    "tutti_cluster.kv_layout": ("tutti_cluster.errors",),
    "tutti_cluster.config": ("tutti_cluster.errors", "tutti_cluster.files", "tutti_cluster._native"),
    "tutti_cluster.store": (*BASE, "tutti_cluster._native"),
    "tutti_cluster.demo": (*BASE, "tutti_cluster.store"),
    "tutti_cluster.cli": ("tutti_cluster.*", "tutti_control.*"),  # bench/, tutti_control: in functions only
    "tutti_cluster.node.protocol": ("tutti_cluster.config", "tutti_cluster.errors"),
    "tutti_cluster.node.link": ("tutti_cluster.node.protocol", "tutti_cluster.config", "tutti_cluster.errors"),
    "tutti_cluster.node.*": (*BASE, "tutti_cluster.store", "tutti_cluster.node.*", "tutti_cluster.cluster.*"),
    "tutti_cluster.cluster.*": (*BASE, "tutti_cluster.store", "tutti_cluster.cluster.*", "tutti_cluster.node.protocol"),
    "tutti_cluster.pipeline.*": ("tutti_cluster.errors", "tutti_cluster.pipeline.*"),
    "tutti_cluster.vllm.*": ("tutti_cluster", *BASE, "tutti_cluster.store", "tutti_cluster.cli",
                             "tutti_cluster.node.link", "tutti_cluster.cluster.*", "tutti_cluster.pipeline.*",
                             "tutti_cluster.vllm.*"),
    "tutti_cluster.bench.*": (*RUNTIME_ALL, "tutti_cluster.bench.*"),
    "tutti_control.*": ("tutti_control.*", "tutti_cluster.config", "tutti_cluster.errors", "tutti_cluster.files",
                        "tutti_cluster.node.link", "tutti_cluster.node.protocol", "tutti_cluster.cluster.auth",
                        "tutti_cluster.cluster.directory", "tutti_cluster.cluster.etcd"),
}


def covers(entry: str, module: str) -> bool:
    return module == entry or (entry.endswith(".*") and (module == entry[:-2] or module.startswith(entry[:-1])))


def broken_rules(graph: dict[str, set[str]], rules: dict[str, tuple[str, ...]] = MAY_IMPORT) -> list[str]:
    found = []
    for m in sorted(graph):
        entry = m if m in rules else max((e for e in rules if e.endswith(".*") and covers(e, m)), key=len, default=None)
        if entry is None:
            found.append(f"{m}: no entry in the table")
            continue
        found += [f"{m} imports {t}" for t in sorted(graph[m]) if not any(covers(a, t) for a in rules[entry])]
    return found


def test_every_module_imports_only_what_the_architecture_allows():
    assert not broken_rules(import_graph())


def test_the_cli_imports_the_benchmarks_and_the_admin_plane_only_inside_functions():
    graph = import_graph(module_level_imports)
    assert not [f"{m} imports {t}" for m, ts in graph.items()
                if m.startswith("tutti_cluster") and not m.startswith("tutti_cluster.bench")
                for t in ts if t.split(".")[0] == "tutti_control" or t.startswith("tutti_cluster.bench")]


def test_the_bindings_and_the_engine_api_include_only_the_engine_api():
    api = ROOT / "native" / "include"
    for path in [*(ROOT / "native" / "bindings").glob("*.cc"), *(api / "tutti").glob("*.h")]:
        for header in re.findall(r'#include\s*"([^"]+)"', path.read_text()):
            assert header.startswith("tutti/") and (api / header).is_file(), f"{path.name} includes {header}"


def test_the_rule_check_sees_a_broken_rule():
    graph = {"tutti_cluster.node.link": {"tutti_cluster.node.protocol", "tutti_cluster.node.daemon"},
             "tutti_cluster.store": {"tutti_cluster.bench.runner"}, "tutti_cluster.nova": set(),
             "tutti_control.app": {"tutti_cluster.store"}, "tutti_cluster.pipeline.table": {"tutti_cluster.errors"}}
    assert broken_rules(graph) == ["tutti_cluster.node.link imports tutti_cluster.node.daemon",
                                   "tutti_cluster.nova: no entry in the table",
                                   "tutti_cluster.store imports tutti_cluster.bench.runner",
                                   "tutti_control.app imports tutti_cluster.store"]
    tree = ast.parse("import x\ntry:\n    import y\nexcept ImportError:\n    pass\ndef f():\n    import z\n")
    assert [ast.unparse(n) for n in module_level_imports(tree)] == ["import x", "import y"]
