"""The orchestrator: `orchestrator up` and the other commands (cli.py), and the same run
driven from Python (`orchestrator.start`, run.py)."""

from orchestrator.run import Run, start

__all__ = ["Run", "start"]
