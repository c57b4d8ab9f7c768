"""README.md and docs/*.md stay usable and true: every relative link and anchor resolves,
every `orchestrator ...` and `actor ...` command in a shell code block parses by that
command's own parser, the cheap ones run for real as a newcomer would run them, README
stays a short front door, and no page carries internal bookkeeping.

The cheap commands are `--help`, `orchestrator plan`, the tiny run (`orchestrator up
--config examples/tiny.toml ...`), `orchestrator show` and `orchestrator timeline`. They run
page by page, in the page's order, each page in a fresh folder: a copy of the checkout's
examples/ (without examples/models/ and runs/, which a fresh checkout does not have), and
the files the page's code blocks name in their info string (```toml file=my-task/run.toml).
`python examples/smollm2_fetch.py` is not run: the model it makes is linked in from this
machine, where it was fetched before (else the commands that need it are not run). Each
command must exit 0, or the code its comment names (`# refused (exit 3)`), and print every
`code span` of its comment. A command that reads a run directory must find it made by a
command before it on the page: by one that ran, or by one too costly to run (a real
model's `up`) whose config names that `run.dir`. Every other command is only parsed.

The parsing is fast and offline; running the cheap commands takes a minute or two (slow).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer
from typer.main import get_command

from runtime.config import SECTIONS

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 300
PROGRAMS = {"orchestrator": "orchestrator.cli", "actor": "actor.__main__"}  # each one's Typer app
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh"}
CONFIG_KEYS = {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
TINY_CONFIG = "examples/tiny.toml"
# The documented steps that fetch a model: not run here (a download), but the folder each
# makes is linked in from where this machine keeps it, when it does.
FETCHES = {"examples/smollm2_fetch.py": "examples/models/SmolLM2-135M-Instruct"}
RUN_TIMEOUT_S = 300  # the tiny run takes 10-40 s
COMMAND_TIMEOUT_S = 120

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)(.*)$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
EXIT_CODE = re.compile(r"\bexit(?: code)? (\d+)\b")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# --------------------------------------------------------------------------- markdown


@dataclasses.dataclass
class Block:
    language: str
    file: str | None  # the file the block is, named in its info string: ```toml file=a/b.toml
    lines: list[str]


def split_fences(text: str) -> tuple[str, list[Block]]:
    """The prose with every fenced block blanked out (line numbers kept), and the blocks."""
    prose: list[str] = []
    blocks: list[Block] = []
    fence = ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if not fence and m:
            fence = m.group(1)
            named = re.search(r"\bfile=(\S+)", m.group(3))
            blocks.append(Block(m.group(2).lower(), named.group(1) if named else None, []))
            prose.append("")
        elif fence and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            fence = ""
            prose.append("")
        elif fence:
            blocks[-1].lines.append(line)
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


def split_comment(line: str) -> tuple[str, str]:
    """(the command, its trailing `# comment`): a '#' that starts a word outside quotes."""
    quote = ""
    for i, c in enumerate(line):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1 :].strip()
    return line, ""


def tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    return list(lexer)


@dataclasses.dataclass
class Command:
    """One simple command of a page's shell block: its words (the program first, with
    `python -m` and VAR=value dropped), the line it is on and that line's comment."""

    line: str
    words: list[str]
    comment: str = ""

    @property
    def program(self) -> str:
        return self.words[0]

    @property
    def name(self) -> str:
        """`orchestrator show reward`: the program and its subcommand words."""
        return " ".join(self.words[: 1 + len(subcommand_path(self))])

    def option(self, *names: str) -> str | None:
        """The value the words give an option (`--x v` or `--x=v`); the last one wins."""
        value = None
        for i, word in enumerate(self.words):
            option, eq, attached = word.partition("=")
            if option in names:
                value = attached if eq else (self.words[i + 1] if i + 1 < len(self.words) else "")
        return value

    def options(self, name: str) -> list[str]:
        """Every value of a repeatable option (`--set a=1 --set b=2`)."""
        out = []
        for i, word in enumerate(self.words):
            option, eq, attached = word.partition("=")
            if option == name:
                out.append(attached if eq else (self.words[i + 1] if i + 1 < len(self.words) else ""))
        return out


def shell_commands(path: Path) -> list[Command]:
    """Every simple command in the page's shell code blocks, in order."""
    _, blocks = split_fences(path.read_text())
    found = []
    for block in blocks:
        if block.language not in SHELL_LANGUAGES or block.file:
            continue
        for line in logical_lines(block.lines):
            code, comment = split_comment(line)
            try:
                words = tokens(code)
            except ValueError as e:  # reported when it would be one of ours
                if re.search(rf"\b({'|'.join(PROGRAMS)})\b", code):
                    found.append(Command(line.strip(), ["<unparsable>", str(e)], comment))
                continue
            segment: list[str] = []
            for word in [*words, ";"]:
                if word in {"&&", "||", ";", "|", "&"}:
                    while segment and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", segment[0]):
                        segment = segment[1:]  # VAR=value before the command
                    if segment[:2] == ["python", "-m"] and segment[2:3] and segment[2] in PROGRAMS:
                        segment = segment[2:]
                    if segment:
                        found.append(Command(line.strip(), segment, comment))
                    segment = []
                else:
                    segment.append(word)
    return found


def commands(path: Path) -> list[Command]:
    """Each `orchestrator ...` / `actor ...` (or `python -m` either) in the page's shell blocks."""
    return [c for c in shell_commands(path) if c.program in PROGRAMS or c.program == "<unparsable>"]


@functools.cache
def cli(program: str):
    """The program's own parser: its Typer app as a Click group."""
    return get_command(importlib.import_module(PROGRAMS[program]).app)


def subcommand_path(command: Command) -> list[str]:
    """The subcommand words of a command as its parser reads them (`show`, `reward`)."""
    group, path = cli(command.program), []
    for word in command.words[1:]:
        subcommands = getattr(group, "commands", None)
        if not subcommands or word.startswith("-") or word not in subcommands:
            break
        path.append(word)
        group = subcommands[word]
    return path


def command_problems(command: Command) -> list[str]:
    """What the command's own parser says of its words: an unknown subcommand or option, a
    missing required one, a value of the wrong type, an extra argument; and `--set` items
    that name no config key."""
    line, program, args = command.line, command.words[0], command.words[1:]
    if program == "<unparsable>":
        return [f"{line}: cannot be split into words ({args[0]})"]
    cmd, path = cli(program), []
    while getattr(cmd, "commands", None):
        if not args or args[0].startswith("-"):
            if "--help" in args:
                return []
            return [f"{line}: `{program} {' '.join(path)}` needs a subcommand ({sorted(cmd.commands)})"]
        if args[0] not in cmd.commands:
            return [
                f"{line}: `{' '.join([program, *path, args[0]])}` is not a command ({sorted(cmd.commands)})"
            ]
        path.append(args.pop(0))
        cmd = cmd.commands[path[-1]]
    problems = []
    if "--help" not in args:
        try:
            cmd.make_context(" ".join([program, *path]), list(args))
        except typer.TyperException as e:
            problems.append(f"{line}: `{program} {' '.join(path)}`: {e.format_message()}")
    for item in command.options("--set"):
        if "=" not in item or item.partition("=")[0] not in CONFIG_KEYS:
            problems.append(f"{line}: --set {item!r} names no config key (section.key=value)")
    return problems


# --------------------------------------------------------------------------- running them


def is_cheap(command: Command) -> bool:
    """A command the docs test runs for real: `--help`, `orchestrator plan`, `show`,
    `timeline`, and `orchestrator up` on the tiny example."""
    if command.program not in PROGRAMS:
        return False
    if "--help" in command.words:
        return True
    first = next((w for w in command.words[1:] if not w.startswith("-")), "")
    if command.program == "orchestrator" and first in {"plan", "show", "timeline"}:
        return True
    return (
        command.program == "orchestrator"
        and first == "up"
        and command.option("--config", "-c") == TINY_CONFIG
    )


def run_dir_made_by(command: Command, folder: Path) -> Path | None:
    """The run directory an `orchestrator up` or `prepare` writes: --run-dir, else the
    config's run.dir (with --set run.dir), relative to where it runs; None when the
    config is not in the folder (a page's placeholder, such as run.toml)."""
    if command.program != "orchestrator" or subcommand_path(command)[:1] not in (["up"], ["prepare"]):
        return None
    run_dir = command.option("--run-dir")
    if run_dir is None:
        config = folder / (command.option("--config", "-c") or "")
        if not config.is_file():
            return None
        run_dir = tomllib.loads(config.read_text()).get("run", {}).get("dir", SECTIONS["run"]().dir)
        for item in command.options("--set"):
            key, _, value = item.partition("=")
            if key == "run.dir":
                run_dir = tomllib.loads(f"v = {value}")["v"]
    return (folder / run_dir).resolve()


def run_dir_read_by(command: Command, folder: Path) -> Path | None:
    """The run directory an `orchestrator show ...` or `timeline` reads."""
    if command.program == "orchestrator" and subcommand_path(command)[:1] in (["show"], ["timeline"]):
        run_dir = command.option("--run-dir")
        return (folder / run_dir).resolve() if run_dir else None
    return None


def fresh_folder(tmp: Path, page: Path) -> Path:
    """A checkout as a newcomer has it: examples/ without models/ and runs/ (not in git),
    and the files the page's code blocks name."""
    folder = tmp / "checkout"
    ignore = shutil.ignore_patterns("models", "runs", "__pycache__", "*.pyc")
    shutil.copytree(REPO / "examples", folder / "examples", ignore=ignore)
    _, blocks = split_fences(page.read_text())
    for block in blocks:
        if block.file:
            target = folder / block.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("\n".join(block.lines) + "\n")
    return folder


def fetched(folder_in_repo: str) -> Path | None:
    """Where this machine keeps a model a fetch step makes: the checkout's own examples/
    models/, or the test suite's model cache (conftest.py's `smollm2`)."""
    name = Path(folder_in_repo).name
    cache = Path(os.environ.get("MLX_RL_MODELS", Path.home() / ".cache" / "mlx-rl-ipc"))
    for candidate in (REPO / folder_in_repo, cache / name):
        if (candidate / "config.json").is_file():
            return candidate
    return None


def run_for_real(command: Command, folder: Path, timeout: float) -> tuple[int | None, str]:
    """Run the command in the folder, as typed (the installed console script); its exit
    code (None past the timeout) and output. Past the timeout it gets SIGTERM, the clean
    stop (`up` stops its learner and actor), then SIGKILL; it is always reaped."""
    script = Path(sys.executable).parent / command.program
    argv = [str(script)] if script.exists() else [sys.executable, "-m", command.program]
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    proc = subprocess.Popen(
        [*argv, *command.words[1:]],
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return None, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _code_spans(text: str) -> list[str]:
    return [m.group(0).strip("`").strip() for m in CODE_SPAN.finditer(text)]


@dataclasses.dataclass
class Walk:
    """What following a page's commands in order did: problems, and what ran or not."""

    problems: list[str] = dataclasses.field(default_factory=list)
    ran: list[str] = dataclasses.field(default_factory=list)
    not_run: list[str] = dataclasses.field(default_factory=list)


def follow(page_commands: list[Command], folder: Path, run: bool = True) -> Walk:
    """Follow a page's shell commands in order in `folder`: run the cheap ones (unless
    `run` is false: then only check which run directories they would find), note the run
    directories the others would make, and say what is wrong."""
    walk = Walk()
    would_make: dict[Path, str] = {}  # run directory -> the costly command that makes it
    missing_model = ""  # a documented fetch that could not be stood in for
    for command in page_commands:
        if command.program == "python" and command.words[1:2] and command.words[1] in FETCHES:
            made = FETCHES[command.words[1]]
            source = fetched(made)
            if source is None:
                missing_model = made
            elif run and not (folder / made).exists():
                (folder / made).parent.mkdir(parents=True, exist_ok=True)
                (folder / made).symlink_to(source)
            continue
        if command.program not in PROGRAMS or command_problems(command):
            continue  # not ours, or already reported by the parse test
        reads, makes = run_dir_read_by(command, folder), run_dir_made_by(command, folder)
        if reads is not None and not reads.exists():
            if reads in would_make:
                walk.not_run.append(f"{command.line} (its run comes from `{would_make[reads]}`)")
            else:
                shown = reads.relative_to(folder) if reads.is_relative_to(folder) else reads
                walk.problems.append(
                    f"{command.line}: reads {shown}, which no command before it on this page makes"
                )
            continue
        if not is_cheap(command):
            if makes is not None:
                would_make[makes] = command.line
            continue
        if not run:
            if makes is not None:
                would_make[makes] = command.line
            continue
        timeout = RUN_TIMEOUT_S if subcommand_path(command)[:1] == ["up"] else COMMAND_TIMEOUT_S
        code, out = run_for_real(command, folder, timeout)
        want_code = int(m.group(1)) if (m := EXIT_CODE.search(command.comment)) else 0
        if code is None:
            walk.problems.append(f"{command.line}: did not finish in {timeout} s:\n{out[-1500:]}")
        elif code != want_code and missing_model and Path(missing_model).name in out:
            walk.not_run.append(f"{command.line} (needs {missing_model}, not fetched on this machine)")
            continue
        elif code != want_code:
            walk.problems.append(f"{command.line}: exited {code}, not {want_code}:\n{out[-1500:]}")
        else:
            lacking = [s for s in _code_spans(command.comment) if s not in out]
            if lacking:
                walk.problems.append(f"{command.line}: its output lacks {lacking}:\n{out[-1500:]}")
        if makes is not None and code == 0 and not makes.is_dir():
            walk.problems.append(f"{command.line}: made no {makes}")
        walk.ran.append(command.line)
    return walk


# --------------------------------------------------------------------------- tests


def test_the_docs_exist():
    assert README.is_file()
    assert DOCS, "docs/ holds no pages"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_links_and_anchors_resolve(page):
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


def test_the_pages_hold_commands_of_every_cheap_kind():
    """The extraction finds commands (a broken one would make every check below pass on
    nothing), README shows the tiny run, and each kind of cheap command is there to run."""
    found = {rel(page): commands(page) for page in PAGES}
    assert sum(map(len, found.values())) >= 20, found
    assert any(c.option("--config", "-c") == TINY_CONFIG for c in found["README.md"]), found["README.md"]
    cheap = {c.name for cs in found.values() for c in cs if is_cheap(c)}
    for kind in ("orchestrator plan", "orchestrator up", "orchestrator show reward", "orchestrator timeline"):
        assert kind in cheap, f"no page runs `{kind}`: {sorted(cheap)}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_commands_in_code_blocks_parse(page):
    problems = [p for command in commands(page) for p in command_problems(command)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_run_directories_are_made_before_they_are_read(page, tmp_path):
    """Without running anything: each `show` or `timeline` reads a run directory that a
    command before it on the page makes (as the page's configs say)."""
    walk = follow(shell_commands(page), fresh_folder(tmp_path, page), run=False)
    assert not walk.problems, "\n".join(walk.problems)


RUNNABLE = [page for page in PAGES if any(is_cheap(c) for c in commands(page))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=rel)
def test_cheap_commands_run_from_a_fresh_folder(page, tmp_path):
    walk = follow(shell_commands(page), fresh_folder(tmp_path, page))
    assert not walk.problems, "\n\n".join(walk.problems)
    if not walk.ran:
        pytest.skip("; ".join(walk.not_run))
    assert walk.ran


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
        "actor nosuch --run-dir x\n"
        "orchestrator plan --config x.toml --available-memory-gb lots   # exit 3\n"
        "orchestrator show reward\n"
        "orchestrator timeline --run-dir r --steps 2:8 extra\n"
        "orchestrator up --help\n```\n"
    )
    links = broken_links(page)
    assert len(links) == 2 and "missing.md" in links[0] and "#nowhere" in links[1]
    found = commands(page)
    assert [c.comment for c in found][2] == "exit 3"
    problems = [p for command in found for p in command_problems(command)]
    assert any("train.stepz" in p for p in problems)
    assert any("No such option: --no-such-flag" in p for p in problems)  # the parser's own words
    assert any("`actor nosuch` is not a command" in p for p in problems)
    assert any("Invalid value for '--available-memory-gb'" in p for p in problems)
    assert any("Missing option '--run-dir'" in p for p in problems)
    assert any("unexpected extra argument" in p and "(extra)" in p for p in problems)
    assert len(problems) == 6, problems
    assert [is_cheap(c) for c in found] == [False, False, True, True, True, True]


# README before its timeline command was fixed: the SmolLM2 run lands in runs/smollm2
# (the config's run.dir, relative to where `up` runs), not beside the config.
OLD_README = """\
```bash
pip install -e '.[gguf]'
python examples/smollm2_fetch.py                  # examples/models/SmolLM2-135M-Instruct
orchestrator up --config examples/smollm2.toml
```

```bash
orchestrator timeline --run-dir examples/runs/smollm2 --steps 20:22 --png timeline.png
```
"""


def test_a_command_reading_a_run_no_command_before_it_makes_is_caught(tmp_path):
    """README's old timeline command read examples/runs/smollm2, which no documented
    command makes: caught without running anything. Its fix reads the run `up` makes, too
    costly to run here, so it is only not run."""
    page = tmp_path / "README.md"
    page.write_text(OLD_README)
    walk = follow(shell_commands(page), fresh_folder(tmp_path, page), run=False)
    assert walk.problems == [
        "orchestrator timeline --run-dir examples/runs/smollm2 --steps 20:22 --png timeline.png: "
        "reads examples/runs/smollm2, which no command before it on this page makes"
    ]
    page.write_text(OLD_README.replace("examples/runs/smollm2", "runs/smollm2"))
    walk = follow(shell_commands(page), fresh_folder(tmp_path / "fixed", page), run=False)
    assert not walk.problems and len(walk.not_run) == 1
    assert "orchestrator up --config examples/smollm2.toml" in walk.not_run[0]


@pytest.mark.slow
def test_a_cheap_command_is_held_to_its_comment(tmp_path):
    """Run for real: the exit code a comment names, and the code spans it quotes."""
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "orchestrator plan --config examples/tiny.toml --available-memory-gb 0.002   # refused (exit 3)\n"
        "orchestrator plan --config examples/tiny.toml --available-memory-gb 0.002   # fits\n"
        "orchestrator plan --config examples/tiny.toml   # says `no such words`\n"
        "orchestrator show reward --run-dir runs/tiny\n"
        "```\n"
    )
    walk = follow(shell_commands(page), fresh_folder(tmp_path, page))
    assert len(walk.ran) == 3
    assert len(walk.problems) == 3, walk.problems
    assert "exited 3, not 0" in walk.problems[0]
    assert "its output lacks ['no such words']" in walk.problems[1]
    assert "reads runs/tiny, which no command before it on this page makes" in walk.problems[2]
