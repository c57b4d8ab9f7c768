"""The `orchestrator` command."""

from __future__ import annotations

import sys

import typer

from protocol.config import ConfigError, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run RL post-training as an MLX actor and learner over ZeroMQ.")


@app.command()
def up(
    config: str = typer.Option(..., "--config", "-c", help="TOML run config."),
    steps: int | None = typer.Option(None, help="Override train.steps."),
    run_dir: str | None = typer.Option(None, help="Override run.dir."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: section.key=value (repeatable)."),
) -> None:
    """Validate the config, start learner and actor, train, and stop both at the end."""
    try:
        cfg = load_config(config, set_, run_dir=run_dir, steps=steps)
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from None
    from orchestrator.supervisor import up as run_up

    raise typer.Exit(run_up(cfg))


@app.callback()
def _root() -> None:
    """Keep subcommands explicit."""


def main() -> None:
    sys.exit(app())
