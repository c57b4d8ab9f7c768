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


@app.command("reward-worker")
def reward_worker(
    function: str = typer.Argument(..., help="Reward function as module:function (TRL signature)."),
    run_dir: str | None = typer.Option(None, help="Attach to this run's reward socket."),
    connect: str | None = typer.Option(None, help="Or attach to this endpoint."),
) -> None:
    """Serve a Python reward function to a run. Start as many as you like."""
    import logging
    import os

    import protocol
    from orchestrator.reward_worker import serve
    from rewards.functions import RewardError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if (run_dir is None) == (connect is None):
        typer.echo("error: give exactly one of --run-dir and --connect", err=True)
        raise typer.Exit(2)
    try:
        endpoint = connect or protocol.read_endpoints(run_dir)["reward"]
    except (OSError, KeyError, ValueError):
        typer.echo(f"error: {run_dir} has no endpoints.json with a reward socket; "
                   "is the run started?", err=True)
        raise typer.Exit(2) from None
    try:
        serve(function, endpoint, search_path=os.getcwd())
    except RewardError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@app.callback()
def _root() -> None:
    """Keep subcommands explicit."""


def main() -> None:
    sys.exit(app())
