"""The `actor` command. `actor run` is what the orchestrator starts."""

from __future__ import annotations

import logging

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="The MLX rollout actor: samples completions with behavior logprobs.")


@app.command()
def run(run_dir: str = typer.Option(..., help="Run directory written by `orchestrator up`.")) -> None:
    """Connect to the run's learner and stream rollout groups until it says stop."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from actor.service import main

    main(run_dir)


@app.callback()
def _root() -> None:
    """Keep `run` a subcommand even while it is the only one."""


if __name__ == "__main__":
    app()
