"""docs/vllm-private-names.md against the installed vLLM and kvtier's code.

Each table row names a vLLM object (``vllm.…Class.attribute``) kvtier relies on beyond the
connector API. A row whose *checked on* cell names the installed vLLM's minor release must
resolve in it (and pass its marker); every row must name files that still use the name; and
every private vLLM name that ``kvtier/engines/vllm/`` touches must have a row. A vLLM release
that renames one of these then fails here rather than silently in an engine.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from kvtier.engines.vllm.compat import VERSION, release  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "vllm-private-names.md"
ADAPTER = ROOT / "kvtier" / "engines" / "vllm"
COLUMNS = ["vllm object", "kvtier use", "why", "on a release without it", "checked on"]
OBJECT_CELL = re.compile(r"^`(vllm(?:\.\w+)+)`\s*(?:\((.*)\))?$")
PRIVATE = re.compile(r"^_[A-Za-z]\w*$")  # one leading underscore; dunders end in "__"
# Private names the adapter touches that are Python's, not vLLM's.
NOT_VLLM = {"_getframe": "sys._getframe, the stack walk of compat.calling_scheduler"}


@dataclasses.dataclass(frozen=True)
class Row:
    path: str  # vllm.module.Class.attribute
    markers: tuple[str, ...]  # "instance attribute", "arguments: a, b", "called by vLLM", "calls: a, b"
    use: str
    checked_on: str
    line: int

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[1]

    def marker(self, kind: str) -> list[str] | None:
        """The comma-separated names of marker ``kind`` (``[]`` for one without names), or None."""
        for marker in self.markers:
            head, _, names = marker.partition(":")
            if head.strip() == kind:
                return [n.strip() for n in names.split(",") if n.strip()]
        return None

    def __str__(self) -> str:
        return f"{DOC.relative_to(ROOT)}:{self.line} `{self.path}`"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse(text: str) -> list[Row]:
    """Every row of every table whose header is :data:`COLUMNS`."""
    rows, in_table = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            in_table = False
            continue
        cells = _cells(line)
        if [c.lower() for c in cells] == COLUMNS:
            in_table = True
            continue
        if not in_table or set(line.replace("|", "").strip()) <= set("-: "):
            continue
        assert len(cells) == len(COLUMNS), f"{DOC.name}:{number}: {len(cells)} cells, not {len(COLUMNS)}"
        match = OBJECT_CELL.match(cells[0])
        assert match, f"{DOC.name}:{number}: the vLLM object cell must read `vllm.module.attribute` (marker): {cells[0]!r}"
        markers = tuple(m.strip() for m in (match.group(2) or "").split(";") if m.strip())
        rows.append(Row(match.group(1), markers, cells[1], cells[4], number))
    return rows


ROWS = parse(DOC.read_text(encoding="utf-8"))
MINOR = "{}.{}".format(*release(VERSION))


def checked_here(row: Row) -> bool:
    """Whether the row's *checked on* cell names the installed vLLM's minor release."""
    return re.search(rf"(?<![\d.]){re.escape(MINOR)}(?:\.\d+)?(?!\d)", row.checked_on) is not None


def resolve(path: str) -> object:
    """Import the longest module prefix of ``path``, then getattr along the rest (AttributeError)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for i, part in enumerate(parts[cut:], cut):
            if not hasattr(obj, part):
                raise AttributeError(f"{'.'.join(parts[:i])} has no {part!r}")
            obj = getattr(obj, part)
        return obj
    raise AttributeError(f"no module of {path} imports")


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def has_instance_attribute(owner: type, name: str) -> bool:
    """``name`` on the class, as a dataclass field or annotation, or set as ``self.name`` in an ``__init__``."""
    if hasattr(owner, name) or (dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}):
        return True
    for klass in inspect.getmro(owner):
        if name in inspect.get_annotations(klass):
            return True
        init = vars(klass).get("__init__")
        if init is not None and re.search(rf"\bself\.{re.escape(name)}\b", _source(init)):
            return True
    return False


def problem(row: Row) -> str | None:
    """What is wrong with ``row`` in the installed vLLM, or None."""
    owner_path, name = row.path.rsplit(".", 1)
    try:
        if row.marker("instance attribute") is not None:
            owner = resolve(owner_path)
            if not isinstance(owner, type) or not has_instance_attribute(owner, name):
                return f"{owner_path} sets no attribute {name!r}"
            obj = None
        else:
            obj = resolve(row.path)
    except AttributeError as exc:
        return str(exc)
    arguments = row.marker("arguments")
    if arguments:
        taken = inspect.signature(obj).parameters
        missing = [a for a in arguments if a not in taken]
        if missing:
            return f"{row.path} takes no argument {', '.join(missing)} (it takes {', '.join(taken)})"
    if row.marker("called by vLLM") is not None and not re.search(rf"\bself\.{name}\(", _source(resolve(owner_path))):
        return f"{owner_path} no longer calls self.{name}(...): kvtier's override of it is never called"
    for hook in row.marker("calls") or ():
        if not re.search(rf"\.{hook}\(", _source(obj)):
            return f"{row.path} no longer calls the connector's {hook}(...): its frame is not on that hook's stack"
    return None


def _files(use: str) -> list[Path]:
    """The files a *kvtier use* cell names (``scheduler.py``: the adapter's; ``bench/x.py``: kvtier's)."""
    found = []
    for name in re.findall(r"[\w/]+\.py", use):
        path = ADAPTER / name if "/" not in name else ROOT / "kvtier" / name
        found.append(path)
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def identifiers(path: Path) -> set[str]:
    """Every name the code of ``path`` uses: names, attributes, definitions, keywords, and the words
    of its string constants other than docstrings (``getattr`` names, class names matched as text)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs, out = _docstrings(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.keyword) and node.arg:
            out.add(node.arg)
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[0])
            out.update(node.name.split("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out.update(re.findall(r"\w+", node.value))
    return out


def kvtier_defines() -> set[str]:
    """Private names kvtier defines itself anywhere: functions, classes, module and class names,
    and attributes it assigns on ``self`` or ``cls``."""
    own = set()
    for path in (ROOT / "kvtier").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        own.add(leaf.id)
                    elif isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) \
                            and leaf.value.id in ("self", "cls"):
                        own.add(leaf.attr)
    return {name for name in own if PRIVATE.match(name)}


def private_names_touched() -> dict[str, list[str]]:
    """Private names ``kvtier/engines/vllm/*.py`` touches that are not kvtier's own -> where.

    An attribute kvtier reads but never defines, an override it reaches through ``super()``, and a
    private name in a string constant (as ``getattr``, ``hasattr`` and ``calling_scheduler`` take
    names; f-string pieces and docstrings aside) are vLLM's, or Python's (:data:`NOT_VLLM`).
    """
    own, touched, overridden = kvtier_defines(), {}, set()
    for path in sorted(ADAPTER.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        in_fstring = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and PRIVATE.match(node.attr) and not node.attr.endswith("__"):
                name = node.attr
                value = node.value
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                    overridden.add(name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE.match(node.value) \
                    and not node.value.endswith("__") and id(node) not in docs | in_fstring:
                name = node.value
            if name is not None:
                touched.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return {name: where for name, where in touched.items()
            if (name not in own or name in overridden) and name not in NOT_VLLM}


# ---- the tests ------------------------------------------------------------------------------------


def test_the_doc_has_its_tables():
    assert len(ROWS) >= 40, f"{DOC.name}: {len(ROWS)} rows parsed; is the header still {COLUMNS}?"
    assert len({row.path for row in ROWS}) == len(ROWS), "a vLLM object has two rows"
    if any(MINOR in row.checked_on for row in ROWS):  # a release the doc names: its rows must be found
        assert any(checked_here(row) for row in ROWS), f"no row reads as checked on vLLM {MINOR}"


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.path.removeprefix("vllm."))
def test_each_name_checked_on_this_release_is_in_the_installed_vllm(row):
    if not checked_here(row):
        pytest.skip(f"not checked on vLLM {MINOR} ({row.checked_on})")
    found = problem(row)
    assert found is None, (f"{row}: {found}, in the installed vLLM {VERSION}. kvtier relies on it "
                           f"({row.use}): adapt kvtier (kvtier/engines/vllm/compat.py) and the row in {DOC.name}")


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.path.removeprefix("vllm."))
def test_each_row_names_code_that_uses_the_name(row):
    files = _files(row.use)
    assert files, f"{row}: the kvtier use cell names no file"
    missing = [str(p.relative_to(ROOT)) for p in files if not p.is_file()]
    assert not missing, f"{row}: no file {', '.join(missing)}"
    names = row.marker("calls") or [row.name]
    used = set().union(*(identifiers(p) for p in files))
    unused = [n for n in names if n not in used]
    assert not unused, (f"{row}: {', '.join(unused)} appears in none of {', '.join(p.name for p in files)}; "
                        "drop the row or point it at the code that uses the name")


def test_every_private_vllm_name_the_adapter_touches_has_a_row():
    documented = {row.name for row in ROWS}
    touched = private_names_touched()
    missing = {name: where for name, where in touched.items() if name not in documented}
    assert not missing, (f"private names kvtier/engines/vllm/ touches with no row in {DOC.name}: "
                         + "; ".join(f"{n} ({', '.join(w)})" for n, w in sorted(missing.items())))
    # the scan sees what the doc lists, so an empty scan cannot pass unnoticed
    assert {"_inflight_prefills", "_reserve_prefill_lookahead", "_registry", "_get_connector_metadata"} <= set(touched)


@pytest.mark.parametrize("path, marker", [
    ("vllm.v1.core.sched.scheduler.Scheduler._no_such_method", ""),
    ("vllm.v1.core.sched.scheduler.Scheduler._no_such_set", "instance attribute"),
    ("vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots", "arguments: no_such_argument"),
    ("vllm.v1.core.sched.scheduler.Scheduler.add_request", "called by vLLM"),
    ("vllm.v1.core.sched.scheduler.Scheduler", "calls: no_such_hook"),
    ("vllm.no_such_module.Thing", ""),
])
def test_a_name_this_vllm_lacks_is_caught(path, marker):
    row = Row(path, (marker,) if marker else (), "scheduler.py", MINOR, 0)
    assert problem(row) is not None
