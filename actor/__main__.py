"""The `actor` command. `actor run` is what the orchestrator starts."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import cast

import typer

from runtime import lifecycle
from runtime.lifecycle import config_errors

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="The MLX rollout actor: samples completions with behavior logprobs.",
)


@app.command()
def run(
    run_dir: str = typer.Option(
        ...,
        help="Run directory written by `orchestrator up` (on another "
        "machine: one holding a copy of its config.json).",
    ),
    connect: str | None = typer.Option(
        None, help="The learner's rollout endpoint, e.g. tcp://mac-a.local:5555; default: RUN/endpoints.json."
    ),
    key_dir: str | None = typer.Option(
        None,
        help="CURVE key directory for a TCP run (`orchestrator "
        "keys add-peer`); default: the run directory's keys.",
    ),
    slot: int = typer.Option(
        0,
        help="Which of the run's actor.count actors this is: its share of "
        "the data (a remote actor takes one `up` does not start).",
    ),
) -> None:
    """Connect to the run's learner and stream rollout groups until it says stop.

    Exit codes (runtime.lifecycle): 0 told to stop by the learner, 4 a user error (the
    data file does not parse, a prompt does not fit the model, the learner refused our
    model, LoRA config or key), 128 + N stopped by signal N, 1 anything unexpected."""
    from policy.data import DataError
    from transport.keys import KeysError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from actor.service import main

    lifecycle.exit_with(
        lambda: main(run_dir, key_dir, slot, connect), logging.getLogger("actor"), (DataError, KeysError)
    )


@app.command()
def sample(
    config: str = typer.Option(..., "--config", "-c", help="TOML run config (model, sampling, rewards)."),
    prompts: str | None = typer.Option(
        None, help="Prompt rows (any form data.prompts takes); default: the config's data.prompts."
    ),
    num_samples: int = typer.Option(4, "--num-samples", "-k", min=1, help="Completions per prompt."),
    out: str = typer.Option("samples.jsonl", help="Where to write one JSON row per sample."),
    adapter: str | None = typer.Option(None, help="mlx-lm adapter directory; default: the base model."),
    seed: int = typer.Option(0, help="Sampling seed: the same seed gives the same output."),
    limit: int | None = typer.Option(None, help="Only the first N prompts."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key: section.key=value."),
) -> None:
    """Sample and score without a learner, for evaluation."""
    from runtime.config import load_config

    with config_errors():
        cfg = load_config(config, set_)
    from actor.standalone import run_sample
    from policy.data import DataError

    try:
        summary = run_sample(cfg, prompts or cfg.data.prompts, num_samples, out, adapter, seed, limit)
    except (DataError, FileNotFoundError) as e:
        lifecycle.fail(f"error: {e}")
    show_summary({**summary, "samples": out})


@app.command("eval")
def eval_(
    config: str | None = typer.Option(None, "--config", "-c", help="TOML run config with an eval section."),
    adapter: str | None = typer.Option(None, help="mlx-lm adapter directory; default: the base model."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key: section.key=value."),
    run_dir: str | None = typer.Option(
        None, help="Evaluate for a run (`up` does, with an agent or an environment): its config, its metrics."
    ),
    metrics_step: int | None = typer.Option(
        None, help="With --run-dir: append the figures to RUN/metrics.jsonl as this step's."
    ),
) -> None:
    """Evaluate on the held-out prompts: the eval/* numbers a training run logs. With an
    agent or an environment, each prompt row runs as eval.num_samples sessions or
    episodes."""
    from runtime.config import ConfigError, load_config, load_run_config

    with config_errors():
        if (config is None) == (run_dir is None):
            raise ConfigError("give --config, or --run-dir for a run's own")
        if run_dir is not None:
            lifecycle.watch_lifeline()  # started by `up`: it ends with it
        cfg = load_config(config, set_) if config else load_run_config(cast(str, run_dir), set_)
        if not cfg.eval.prompts:
            raise ConfigError("eval.prompts is not set (the held-out prompt rows)")
    from actor.standalone import run_agent_eval, run_env_eval, run_eval
    from policy.data import DataError

    evaluate = run_agent_eval if cfg.agent.enabled else run_env_eval if cfg.env.environment else run_eval
    try:
        summary = evaluate(cfg, adapter)
    except (DataError, FileNotFoundError) as e:
        lifecycle.fail(f"error: {e}")
    show_summary(summary)
    if run_dir is not None and metrics_step is not None:
        figures = {("eval/tokens_per_s" if k == "tokens_per_s" else k): v for k, v in summary.items()}
        line = {"step": metrics_step, "policy_version": metrics_step, **figures}
        with open(Path(run_dir) / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


@app.command()
def serve(
    config: str | None = typer.Option(None, "--config", "-c", help="TOML run config (model, LoRA)."),
    run_dir: str | None = typer.Option(
        None,
        help="Follow a training run: serve its adapter, each new "
        "version as it is trained (instead of --config).",
    ),
    adapter: str | None = typer.Option(None, help="mlx-lm adapter directory; default: the base model."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (no authentication: loopback)."),
    port: int = typer.Option(8000, help="Port; 0 picks a free one."),
    name: str | None = typer.Option(None, help="Model id in the API; default: the model's directory name."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key: section.key=value."),
) -> None:
    """Serve the policy as an OpenAI-compatible API (/v1/chat/completions, /v1/completions,
    /v1/models); every response also holds token ids, logprobs and the policy version."""
    from pathlib import Path

    from runtime.config import load_config, read_run_config

    if (config is None) == (run_dir is None):
        lifecycle.fail("error: give --config (a fixed adapter) or --run-dir (follow a training run)")
    if run_dir is not None and adapter is not None:
        lifecycle.fail("error: --adapter goes with --config; a followed run's comes from its learner")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with config_errors(FileNotFoundError):
        cfg = read_run_config(run_dir) if run_dir is not None else load_config(str(config), set_)
    if host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"warning: listening on {host}: anyone who can reach it can use the model", err=True)
    from actor.completions import Policy
    from actor.serve import Follower
    from actor.serve import serve as run_server
    from actor.standalone import load_model

    model, tok = load_model(cfg, None if run_dir else adapter)
    policy = Policy(model, tok, name or Path(cfg.model.path).name, cfg.sampling, None)
    follower = Follower(run_dir, cfg, policy) if run_dir else None
    raise typer.Exit(run_server(policy, host, port, follower))


def show_summary(summary: dict) -> None:
    for key, value in summary.items():
        shown = "-" if value is None else (f"{value:.4f}" if isinstance(value, float) else value)
        typer.echo(f"{key:>28}  {shown}")


@app.callback()
def _root() -> None:
    """Keep subcommands explicit."""


if __name__ == "__main__":
    app()
