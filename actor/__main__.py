"""The `actor` command. `actor run` is what the orchestrator starts."""

from __future__ import annotations

import logging

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="The MLX rollout actor: samples completions with behavior logprobs.")


@app.command()
def run(run_dir: str = typer.Option(..., help="Run directory written by `orchestrator up`.")) -> None:
    """Connect to the run's learner and stream rollout groups until it says stop.

    Exit codes (protocol.lifecycle): 0 told to stop by the learner, 4 a user error (the
    data file does not parse, a prompt does not fit the model, the learner refused our
    model or LoRA config), 128 + N stopped by signal N, 1 anything unexpected."""
    from policy.data import DataError
    from protocol import lifecycle

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from actor.service import main

    lifecycle.exit_with(lambda: main(run_dir), logging.getLogger("actor"), (DataError,))


@app.command()
def sample(
    config: str = typer.Option(..., "--config", "-c", help="TOML run config (model, sampling, rewards)."),
    prompts: str | None = typer.Option(None, help="Prompt rows (any form data.prompts takes); "
                                       "default: the config's data.prompts."),
    num_samples: int = typer.Option(4, "--num-samples", "-k", min=1, help="Completions per prompt."),
    out: str = typer.Option("samples.jsonl", help="Where to write one JSON row per sample."),
    adapter: str | None = typer.Option(None, help="mlx-lm adapter directory; default: the base model."),
    seed: int = typer.Option(0, help="Sampling seed: the same seed gives the same output."),
    limit: int | None = typer.Option(None, help="Only the first N prompts."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key: section.key=value."),
) -> None:
    """Sample and score without a learner, for evaluation."""
    from protocol.config import ConfigError, load_config

    try:
        cfg = load_config(config, set_)
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from None
    from actor.sample import run_sample
    from policy.data import DataError

    try:
        summary = run_sample(cfg, prompts or cfg.data.prompts, num_samples, out, adapter, seed, limit)
    except (DataError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    show_summary({**summary, "samples": out})


@app.command("eval")
def eval_(
    config: str = typer.Option(..., "--config", "-c", help="TOML run config with an [eval] section."),
    adapter: str | None = typer.Option(None, help="mlx-lm adapter directory; default: the base model."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key: section.key=value."),
) -> None:
    """Evaluate on the held-out prompts: the eval/* numbers a training run logs."""
    from protocol.config import ConfigError, load_config

    try:
        cfg = load_config(config, set_)
        if not cfg.eval.prompts:
            raise ConfigError("eval.prompts is not set (the held-out prompt rows)")
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from None
    from actor.sample import run_eval
    from policy.data import DataError

    try:
        summary = run_eval(cfg, adapter)
    except (DataError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    show_summary(summary)


def show_summary(summary: dict) -> None:
    for key, value in summary.items():
        shown = "-" if value is None else (f"{value:.4f}" if isinstance(value, float) else value)
        typer.echo(f"{key:>28}  {shown}")


@app.callback()
def _root() -> None:
    """Keep subcommands explicit."""


if __name__ == "__main__":
    app()
