"""The README and docs/ stay true: links resolve, commands parse, settings match the code.

No engine, no network: every ``kvtier-bench`` / ``kvtier-proxy`` / ``python -m kvtier.…`` command
in a fenced code block or an inline code span is parsed with the real argument parser (nothing
runs), every ``pytest`` path and repository path named in code exists, every relative link
(and its ``#anchor``) resolves, and the configuration page lists exactly the settings of
:class:`kvtier.config.KvtierConfig`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 260

FENCE = re.compile(r"^(```|~~~)([^\n`]*)\n(.*?)^\1[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "text"}
COMMAND_START = re.compile(r"^(?:kvtier-bench|kvtier-proxy|python3? -m (?:kvtier\b|pytest\b)|pytest\b|make\b)")
REPO_PATH = re.compile(r"^(?:tests|kvtier|bench|csrc|docs)/[\w./{},-]+(?:::\w+)?$")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The page without fenced code blocks (their lines kept blank, so line numbers hold)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _fenced_shell(text: str) -> list[str]:
    """Logical command lines of the page's shell code blocks, continuations joined."""
    lines: list[str] = []
    for match in FENCE.finditer(text):
        if match.group(2).strip().lower() not in SHELL_BLOCKS:
            continue
        logical = ""
        for line in match.group(3).splitlines():
            if line.rstrip().endswith("\\"):
                logical += line.rstrip()[:-1] + " "
                continue
            logical += line
            if _open_quote(logical):
                logical += "\n"  # a quoted string goes on over the next line
                continue
            lines.append(logical)
            logical = ""
        if logical:
            lines.append(logical)
    return lines


def _open_quote(line: str) -> bool:
    try:
        shlex.split(line, comments=True)
    except ValueError:
        return True
    return False


def _inline_spans(text: str) -> list[str]:
    return [" ".join(m.group(2).split()) for m in INLINE_CODE.finditer(_prose(text))]


def _commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at ``&&``, ``||``, ``;``, ``|``, ``&``), env prefixes dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, current = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    out = []
    for words in commands:
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


class _Parsed(Exception):
    pass


def _parse_with(parse, argv: list[str]) -> str | None:
    """Run ``parse(argv)``; None when argparse accepted it, else argparse's message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parse(argv)
        except _Parsed:
            return None
        except SystemExit as exc:
            return None if exc.code in (0, None) else (err.getvalue().strip().splitlines() or [f"exit {exc.code}"])[-1]
    return None


def _module_main_parse(module_name: str, argv: list[str]) -> str | None:
    """Parse ``argv`` with the argparse parser the module's ``main(argv)`` builds; stop before it runs."""
    module = importlib.import_module(module_name)
    main = getattr(module, "main", None)
    if main is None or not inspect.signature(main).parameters or "argparse" not in inspect.getsource(module):
        return None  # takes no arguments: nothing to parse
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        return _parse_with(main, argv)
    finally:
        argparse.ArgumentParser.parse_args = original


def _bench_parse(argv: list[str]) -> None:
    from kvtier.bench.cli import build_parser

    build_parser().parse_args(argv)
    raise _Parsed


def _proxy_parse(argv: list[str]) -> None:
    from kvtier.proxy.app import parse_args

    parse_args(argv)
    raise _Parsed


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", _text(ROOT / "Makefile"), re.M))


def _check_command(words: list[str]) -> str | None:
    """A problem with one simple command, or None. Only kvtier's own tools, pytest and make are checked."""
    if any("…" in w for w in words):
        return "a placeholder (…) in a command: write it out so that it runs as written"
    tool, args = words[0], words[1:]
    if tool == "kvtier-bench":
        return _parse_with(_bench_parse, args)
    if tool == "kvtier-proxy":
        return _parse_with(_proxy_parse, args)
    if tool == "make":
        missing = [t for t in args if not t.startswith("-") and "=" not in t and t not in _make_targets()]
        return f"no Makefile target {missing[0]!r}" if missing else None
    if tool in ("python", "python3") and len(args) >= 2 and args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "pytest":
            tool, args = "pytest", rest
        elif module.split(".")[0] == "kvtier":
            if importlib.util.find_spec(module) is None:
                return f"no module {module}"
            if module == "kvtier.bench.cli":
                return _parse_with(_bench_parse, rest)
            return _module_main_parse(module, rest)
        else:
            return None
    elif tool in ("python", "python3") and args and args[0].endswith(".py"):
        return None if (ROOT / args[0]).is_file() else f"no file {args[0]}"
    if tool == "pytest":
        for arg in args:
            if arg.startswith("-") or not re.match(r"^[\w./-]+(::\w+)*$", arg) or "/" not in arg:
                continue
            path = arg.split("::")[0]
            if not (ROOT / path).exists():
                return f"no test path {path}"
        return None
    return None


def _names_a_command(span: str) -> bool:
    """An inline code span that is a command with arguments (a bare ``kvtier-proxy`` only names the tool)."""
    words = re.sub(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+", "", span)
    return bool(COMMAND_START.match(words)) and " " in words


def _all_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for page in PAGES:
        text = _text(page)
        lines = _fenced_shell(text) + [s for s in _inline_spans(text) if _names_a_command(s)]
        for line in lines:
            for words in _commands(line):
                if COMMAND_START.match(" ".join(words)) or (words[0] in ("python", "python3") and len(words) > 1
                                                           and words[1].endswith(".py")):
                    found.append((_rel(page), line.strip(), words))
    return found


def test_the_readme_is_short():
    lines = _text(ROOT / "README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it within {README_MAX_LINES} (move reference to docs/)"


def test_every_page_starts_with_a_title_and_a_line_on_what_it_covers():
    for page in PAGES:
        lines = [line for line in _text(page).splitlines() if line.strip()]
        assert lines[0].startswith("# "), f"{_rel(page)} does not start with a '# Title'"
        assert not lines[1].startswith("#"), f"{_rel(page)}: say in one line under the title what the page covers"


def _cells(row: str) -> int:
    """Cells of a table row as GitHub counts them: every unescaped pipe splits, code spans too."""
    return len(re.split(r"(?<!\\)\|", row.strip().strip("|")))


def test_every_table_row_has_its_header_s_cells():
    problems = []
    for page in PAGES:
        lines = _prose(_text(page)).splitlines()
        for i, line in enumerate(lines):
            is_header = (line.startswith("|") and i + 1 < len(lines)
                         and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1]))
            if not is_header or (i > 0 and lines[i - 1].startswith("|")):
                continue
            width = _cells(line)
            for j in range(i + 1, len(lines)):
                if not lines[j].startswith("|"):
                    break
                if _cells(lines[j]) != width:
                    problems.append(f"{_rel(page)}:{j + 1}: {_cells(lines[j])} cells, the header has {width}")
    assert not problems, "tables that render broken:\n" + "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup gone, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(_text(path)).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def test_slugs_follow_github():
    assert slug("P/D on one H100: kvtier against vLLM's NixlConnector (vLLM 0.26.0)") == \
        "pd-on-one-h100-kvtier-against-vllms-nixlconnector-vllm-0260"
    assert slug("Why no hits?") == "why-no-hits"
    assert slug("`kv_connector_extra_config` keys") == "kv_connector_extra_config-keys"


def _links(page: Path) -> list[str]:
    text = INLINE_CODE.sub(lambda m: "code", _prose(_text(page)))
    return [m.group(1) for m in LINK.finditer(text)]


def test_every_relative_link_resolves():
    problems = []
    for page in PAGES:
        for target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                problems.append(f"{_rel(page)}: link {target!r}: no file {path_part}")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{_rel(page)}: link {target!r}: no heading #{anchor} in {_rel(dest)}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_repository_paths_named_in_code_exist():
    problems = []
    for page in PAGES:
        for span in _inline_spans(_text(page)):
            if not REPO_PATH.match(span):
                continue
            path = span.split("::")[0]
            brace = re.match(r"^(.*)\{([^}]*)\}(.*)$", path)
            paths = [brace.group(1) + alt + brace.group(3) for alt in brace.group(2).split(",")] if brace else [path]
            # docs/architecture.md names modules from kvtier/ down
            problems += [f"{_rel(page)}: `{span}`: no {p}" for p in paths
                         if not (ROOT / p).exists() and not (ROOT / "kvtier" / p).exists()]
    assert not problems, "paths named in the docs that do not exist:\n" + "\n".join(problems)


def test_the_pages_name_kvtier_commands():
    tools = {words[0] if words[0] != "python" else words[2] for _, _, words in _all_commands() if words}
    assert {"kvtier-bench", "kvtier-proxy", "make"} <= tools, tools


def test_every_command_parses_with_the_current_cli():
    problems = []
    for page, line, words in _all_commands():
        problem = _check_command(words)
        if problem:
            problems.append(f"{page}: {shlex.join(words)}\n    {problem}")
    assert not problems, "commands in the docs that do not run as written:\n" + "\n".join(problems)


def test_the_configuration_page_lists_every_setting_and_no_other():
    from kvtier.config import KvtierConfig

    keys = set()
    for line in _text(ROOT / "docs" / "configuration.md").splitlines():
        match = re.match(r"^\|\s*`([a-z_]+)`\s*\|", line)
        if match:
            keys.add(match.group(1))
    fields = {f.name for f in dataclasses.fields(KvtierConfig)}
    assert keys == fields, (f"docs/configuration.md misses {sorted(fields - keys)} and lists unknown "
                            f"{sorted(keys - fields)}")


@pytest.mark.parametrize("words, broken", [
    (["kvtier-bench", "reload", "--prompt-len", "32k", "--no-such-flag"], True),
    (["kvtier-bench", "reload", "--prompt-len", "32k"], False),
    (["kvtier-proxy", "--prefill", "http://a:1", "--decode", "http://b:2", "--mode", "push"], False),
    (["kvtier-proxy", "--mode", "push"], True),
    (["python", "-m", "kvtier.bench.ttft", "--modes", "recompute", "bogus"], True),
    (["python", "-m", "kvtier.no_such_module"], True),
    (["python", "-m", "pytest", "tests/no_such_test.py"], True),
    (["make", "no-such-target"], True),
])
def test_the_command_check_catches_a_bad_command(words, broken):
    assert (_check_command(words) is not None) == broken
