"""kvtier's modules import each other without circles, no file grows past ~400 lines unless its
docstring says why it is one piece, and only vLLM's adapter and the benches import vLLM, directly or through
another kvtier module (everything else runs beside any engine: a second engine's adapter reuses it).

Every ``import`` in ``kvtier/`` counts, at module level or inside a function (a lazy import is
still a dependency). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
else to ``pkg``. Run as a script to print the graph's circles: ``python tests/test_import_graph.py``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvtier"
MAX_LINES = 400
ONE_PIECE = "one piece"  # a longer file's docstring says why it must be one piece, in these words
VLLM_OWNERS = ("kvtier.engines.vllm", "kvtier.bench")  # vLLM's adapter; the benches that start engines


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The kvtier modules `name` (at `path`) imports, anywhere in the file."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import kvtier.ops.x as y`, names inside modules
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("kvtier"):
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def long_files() -> list[str]:
    """Files over MAX_LINES lines whose module docstring does not say why they are one piece."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_LINES and ONE_PIECE not in (ast.get_docstring(ast.parse(text)) or ""):
            out.append(f"{path.relative_to(ROOT)}: {lines} lines")
    return out


def imports_vllm(path: Path) -> bool:
    """Whether the file imports vLLM itself, anywhere in it."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(name.split(".")[0] == "vllm" for name in names):
            return True
    return False


def vllm_paths(edges: dict[str, set[str]], direct: set[str]) -> dict[str, list[str]]:
    """For each module that imports vLLM, itself or through kvtier modules: one chain of imports
    from it to a module in ``direct`` (those that import vLLM themselves)."""
    found: dict[str, list[str]] = {}
    for start in sorted(edges):
        seen, todo = {start}, [[start]]
        while todo:
            chain = todo.pop()
            if chain[-1] in direct:
                found[start] = chain
                break
            for nxt in sorted(edges.get(chain[-1], ())):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(chain + [nxt])
    return found


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_checker_reads_relative_and_from_imports(tmp_path):
    known = {"kvtier.p": tmp_path / "__init__.py", "kvtier.p.a": tmp_path / "a.py", "kvtier.p.b": tmp_path / "b.py",
             "kvtier.q": tmp_path / "q.py"}
    (tmp_path / "a.py").write_text("from . import b\nfrom .b import thing\ndef f():\n    import kvtier.q as q\n")
    assert imports_of("kvtier.p.a", tmp_path / "a.py", known) == {"kvtier.p.b", "kvtier.q"}


def test_no_import_circles_in_kvtier():
    found = circles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_checker_follows_imports_to_vllm():
    edges = {"a": {"b"}, "b": {"c"}, "c": set(), "d": set()}
    assert vllm_paths(edges, {"c"}) == {"a": ["a", "b", "c"], "b": ["b", "c"], "c": ["c"]}


def test_only_the_vllm_adapter_and_the_benches_import_vllm():
    direct = {name for name, path in modules().items() if imports_vllm(path)}
    outside = {name: chain for name, chain in vllm_paths(graph(), direct).items()
               if not name.startswith(VLLM_OWNERS)}
    assert not outside, "import vLLM outside its adapter: " + "; ".join(" -> ".join(c) for c in outside.values())
    assert "kvtier.worker_node" in modules()  # the engine-neutral worker half is among those checked


def test_no_long_file_without_a_reason():
    assert not long_files(), (f"over {MAX_LINES} lines, and the docstring does not say why it is "
                              f"{ONE_PIECE}: {long_files()}")


if __name__ == "__main__":
    for component in circles(graph()):
        print(" <-> ".join(component))
    for line in long_files():
        print(line)
