"""README.md and docs/*.md stay usable: every relative link and anchor resolves, every
`orchestrator ...` and `actor ...` command in a code block parses, README stays a short
front door, and no page carries internal bookkeeping.

Fast and offline: the only processes are `--help` calls, one per distinct subcommand.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.config import SECTIONS

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 300
PROGRAMS = ("orchestrator", "actor")
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh"}
CONFIG_KEYS = {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# --------------------------------------------------------------------------- markdown


def split_fences(text: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """The prose with every fenced block blanked out (line numbers kept), and the blocks
    as (language, lines)."""
    prose: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    fence = ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if not fence and m:
            fence = m.group(1)
            blocks.append((m.group(2).lower(), []))
            prose.append("")
        elif fence and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            fence = ""
            prose.append("")
        elif fence:
            blocks[-1][1].append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text of links and code kept, lowercased, every
    character but letters, digits, '_', '-' and spaces dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading's anchor in a markdown file, repeats numbered as GitHub does (-1, -2)."""
    prose, _ = split_fences(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose.splitlines():
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def link_targets(path: Path) -> list[str]:
    """Targets of inline and reference links outside code blocks and code spans."""
    prose, _ = split_fences(path.read_text())
    prose = CODE_SPAN.sub(lambda m: "x" * len(m.group(0)), prose)
    return INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in link_targets(path):
        if not target or SCHEME.match(target):
            continue  # http:, https:, mailto: ... are not checked offline
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{rel(path)}: ({target}): {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{rel(path)}: ({target}): no heading with the anchor #{anchor} in {rel(dest)}")
    return problems


# --------------------------------------------------------------------------- commands


def logical_lines(lines: list[str]) -> list[str]:
    """A code block's lines with backslash continuations joined."""
    out: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            out.append(pending + line)
            pending = ""
    if pending:
        out.append(pending)
    return out


def tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def commands(path: Path) -> list[tuple[str, list[str]]]:
    """Each `orchestrator ...` / `actor ...` (or `python -m` either) in the page's shell
    code blocks, as (the line, its arguments after the program: [program, *args])."""
    _, blocks = split_fences(path.read_text())
    found = []
    for lang, lines in blocks:
        if lang not in SHELL_LANGUAGES:
            continue
        for line in logical_lines(lines):
            if not re.search(rf"\b({'|'.join(PROGRAMS)})\b", line):
                continue
            try:
                words = tokens(line)
            except ValueError as e:
                found.append((line, ["<unparsable>", str(e)]))
                continue
            segment: list[str] = []
            for word in [*words, ";"]:
                if word in {"&&", "||", ";", "|", "&"}:
                    while segment and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", segment[0]):
                        segment = segment[1:]  # VAR=value before the command
                    if segment[:2] == ["python", "-m"]:
                        segment = segment[2:]
                    if segment and segment[0] in PROGRAMS:
                        found.append((line.strip(), segment))
                    segment = []
                else:
                    segment.append(word)
    return found


@functools.cache
def help_text(program: str, path: tuple[str, ...]) -> tuple[int, str]:
    """`python -m PROGRAM *PATH --help`: its exit code and output (wide, no colour)."""
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}
    done = subprocess.run(
        [sys.executable, "-m", program, *path, "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)


def subcommands(help_output: str) -> set[str]:
    """The command names a help screen lists (rich's boxed "Commands" or click's plain one)."""
    names: set[str] = set()
    inside = False
    for line in help_output.splitlines():
        if not inside:
            inside = re.search(r"\bCommands\b", line) is not None
            continue
        if line.startswith("╰") or not line.strip():
            break
        body = line[1:] if line.startswith("│") else line
        m = re.match(r"^ {1,2}([a-z][\w-]*)(?:\s|$)", body)
        if m:
            names.add(m.group(1))
    return names


def command_problems(line: str, words: list[str]) -> list[str]:
    program, args = words[0], words[1:]
    if program == "<unparsable>":
        return [f"{line}: cannot be split into words ({args[0]})"]
    path: list[str] = []
    while args and not args[0].startswith("-"):
        code, out = help_text(program, tuple(path))
        listed = subcommands(out)
        if not listed:
            break  # a leaf: the rest are its arguments
        if args[0] not in listed:
            return [f"{line}: `{program} {' '.join(path + [args[0]])}` is not a command ({sorted(listed)})"]
        path.append(args.pop(0))
    if not path:
        return [f"{line}: no subcommand"]
    code, out = help_text(program, tuple(path))
    name = f"{program} {' '.join(path)}"
    if code != 0:
        return [f"{line}: `{name} --help` exited {code}: {out.strip()[-300:]}"]
    problems = []
    for i, arg in enumerate(args):
        if arg == "--":
            break  # what follows goes to another program
        if not arg.startswith("--"):
            continue
        option, _, value = arg.partition("=")
        if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", out):
            problems.append(f"{line}: `{name}` has no option {option}")
        if option == "--set":
            item = value if value else (args[i + 1] if i + 1 < len(args) else "")
            key = item.partition("=")[0]
            if "=" not in item or key not in CONFIG_KEYS:
                problems.append(f"{line}: --set {item!r} names no config key (section.key=value)")
    return problems


# --------------------------------------------------------------------------- tests


def test_the_docs_exist():
    assert README.is_file()
    assert DOCS, "docs/ holds no pages"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_links_and_anchors_resolve(page):
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_commands_in_code_blocks_parse(page):
    problems = [p for line, words in commands(page) for p in command_problems(line, words)]
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_linked_from_readme():
    targets = [t.partition("#")[0] for t in link_targets(README) if not SCHEME.match(t)]
    linked = {(README.parent / t).resolve() for t in targets}
    missing = [rel(p) for p in DOCS if p.resolve() not in linked]
    assert not missing, f"README's links miss {missing}"


def test_readme_is_a_short_front_door():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines, over {README_MAX_LINES}: move a topic out"


def test_readme_keeps_the_test_commands_ci_runs():
    text = README.read_text()
    assert "pip install -e '.[test]' && python -m pytest" in text
    assert 'python -m pytest -m "not slow"' in text


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_no_internal_bookkeeping(page):
    text = page.read_text()
    issues = [m.group(0) for m in re.finditer(r"issue [0-9]+", text, re.I)]
    assert not issues, f"{rel(page)} refers to issue numbers {issues}: state the result itself"
    verdicts = re.findall(r"\b(?:PASS|MISS)\b", text)
    assert not verdicts, f"{rel(page)} holds PASS/MISS verdicts: state the numbers and the comparison"


# --------------------------------------------------------------------------- the checkers themselves


def test_slug_follows_github():
    assert slug("A real model: SmolLM2 from a GGUF file") == "a-real-model-smollm2-from-a-gguf-file"
    assert slug("Scale-out: `python -m benchmarks.scale`") == "scale-out-python--m-benchmarksscale"
    assert slug("128 tokens, against mlxrl's best path") == "128-tokens-against-mlxrls-best-path"
    assert slug("What `max_staleness` does") == "what-max_staleness-does"


def test_a_broken_link_and_a_broken_command_are_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](#title) [gone](missing.md) [bad anchor](#nowhere)\n\n"
        "```bash\norchestrator up --config x.toml --set train.stepz=5 --no-such-flag\n"
        "actor nosuch --run-dir x\n```\n"
    )
    links = broken_links(page)
    assert len(links) == 2 and "missing.md" in links[0] and "#nowhere" in links[1]
    problems = [p for line, words in commands(page) for p in command_problems(line, words)]
    assert any("train.stepz" in p for p in problems)
    assert any("--no-such-flag" in p for p in problems)
    assert any("nosuch" in p for p in problems)
