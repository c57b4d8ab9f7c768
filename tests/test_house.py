"""The house rules a newcomer relies on (docs/design.md, "Code map"), read from the source:
which package may import which, no import cycles, no private names taken across modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Lower layers never import higher ones; packages on one layer never import each other.
LAYERS = {
    "runtime": 0,
    "transport": 1,
    "protocol": 2,
    "rewards": 3,
    "policy": 3,
    "actor": 4,
    "learner": 4,
    "orchestrator": 5,
}
# The orchestrator starts the actor and the learner as processes; it never imports them.
NEVER = {("orchestrator", "actor"), ("orchestrator", "learner")}


def modules() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) for each import that runs (type-only imports left out), at any depth."""
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, [alias.name for alias in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def ours(module: str, names: list[str], known: dict[str, Path]) -> list[str]:
    """The modules of ours an import loads: `from protocol import sockets` loads
    protocol.sockets, `from protocol.wire import X` loads protocol.wire."""
    if module.split(".")[0] not in LAYERS:
        return []
    loaded = [module] if module in known else []
    return loaded + [f"{module}.{name}" for name in names if f"{module}.{name}" in known]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: {target for module, names in imports(path) for target in ours(module, names, known)} - {name}
        for name, path in known.items()
    }


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    wrong = []
    for source, targets in graph().items():
        mine = source.split(".")[0]
        for target in targets:
            theirs = target.split(".")[0]
            if theirs == mine:
                continue
            if LAYERS[theirs] >= LAYERS[mine] or (mine, theirs) in NEVER:
                wrong.append(f"{source} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_there_is_no_import_cycle():
    edges = graph()
    cycles = []
    for start in edges:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, "\n".join(sorted(set(cycles)))


def test_no_module_takes_another_s_private_names():
    known = modules()
    wrong = [
        f"{source} takes {module}.{name}"
        for source, path in known.items()
        for module, names in imports(path)
        if module.split(".")[0] in LAYERS and module != source
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not wrong, "\n".join(wrong)


def test_zeromq_is_used_in_the_transport_package_only():
    """The transport seam (transport/__init__.py): a new transport, or a fake, is one module."""
    users = sorted(
        name
        for name, path in modules().items()
        if any(module.split(".")[0] == "zmq" for module, _ in imports(path))
    )
    assert users and all(name.startswith("transport.") for name in users), users


def test_no_function_is_over_60_lines_and_the_learner_s_loop_reads_in_one_sitting():
    long = [
        f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (node.end_lineno or node.lineno) - node.lineno + 1 > 60
    ]
    assert not long, "\n".join(long)
    assert len((ROOT / "learner" / "service.py").read_text().splitlines()) <= 250


def test_the_rules_catch_what_they_are_for(tmp_path):
    """The checks above find an upward import and a private name in made-up source."""
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from learner import x\n"
        "def f():\n    from actor.service import _hidden\n"
    )
    assert imports(path) == [("typing", ["TYPE_CHECKING"]), ("actor.service", ["_hidden"])]
