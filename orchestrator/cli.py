"""The `orchestrator` command."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from protocol.connection import LEARNER_TIMEOUT_S
from runtime import lifecycle
from runtime.config import Config, ConfigError, load_config, load_run_config
from runtime.config_sections import missing_backends
from runtime.lifecycle import config_errors

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Run RL post-training as an MLX actor and learner over ZeroMQ.",
)


@app.command()
def up(
    config: str | None = typer.Option(None, "--config", "-c", help="TOML run config."),
    resume: str | None = typer.Option(
        None,
        help="Continue the run in this directory from its newest checkpoint (its config.json is the config).",
    ),
    steps: int | None = typer.Option(None, help="Override train.steps."),
    run_dir: str | None = typer.Option(None, help="Override run.dir."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: section.key=value (repeatable)."),
    available_memory_gb: float | None = typer.Option(
        None, help="Memory budget to plan against; default: detected."
    ),
    overwrite: bool = typer.Option(
        False,
        help="Start over in a run directory that holds another run: "
        "delete its metrics, checkpoints, adapters and logs.",
    ),
) -> None:
    """Validate the config, check the memory plan, start learner and actor, train, stop."""
    if (config is None) == (resume is None):
        lifecycle.fail("error: give --config to start a run, or --resume RUN_DIR to continue one")
    if overwrite and resume is not None:
        lifecycle.fail("error: --overwrite starts a run over; --resume continues one: give one of them")
    with config_errors():
        if resume is not None:
            cfg = load_run_config(resume, set_, steps)
        else:
            assert config is not None  # one of the two, checked above
            cfg = load_config(config, set_, run_dir=run_dir, steps=steps)
    for problem in missing_backends(cfg.log.report_to):
        lifecycle.fail(f"config error: {problem}")
    cfg, shares = check_plan(cfg, available_memory_gb, config=config)
    from orchestrator.supervisor import up as run_up

    raise typer.Exit(run_up(cfg, resume=resume is not None, shares_mb=shares, overwrite=overwrite))


def check_plan(
    cfg: Config, available_gb: float | None, show: bool = False, config: str | None = None
) -> tuple[Config, dict[str, float]]:
    """Refuse (exit 3) a run that nothing makes fit, naming the knob, and (exit 4) data
    that does not parse or fit the model's context; else return the config as it will
    run (with the knobs the plan picked, said on stdout) and the shares. `config`, the
    TOML file, lets a missing model folder be named in full."""
    from orchestrator.fit import plan_for, suggestion
    from orchestrator.plan import MB, ModelMissing, PlanError, missing_model, render
    from policy.data import DataError

    try:
        fitted, model = plan_for(cfg, available_gb)
    except DataError as e:
        lifecycle.fail(f"data error: {e}", lifecycle.EXIT_USER_ERROR)
    except ConfigError as e:
        lifecycle.fail(f"config error: {e}")
    except PlanError as e:
        problem = missing_model(e.path, config) if isinstance(e, ModelMissing) and config else str(e)
        if show:
            lifecycle.fail(f"error: {problem}")
        # A hub model not downloaded yet: mlx-lm fetches it when the processes start, so
        # the run can go on; it just cannot be planned (or held to shares) beforehand.
        typer.echo(
            f"warning: no memory check: {problem}. Run `orchestrator plan` once it is there.", err=True
        )
        return cfg, {}
    plan, shape = fitted.plan, fitted.shape
    for note in fitted.notes:
        typer.echo(note)
    if show or not plan.fits:
        typer.echo(render(plan))
    if not plan.fits:
        needs = f"needs {plan.total / MB:.0f} MB (+10% margin) of {plan.budget / MB:.0f} MB"
        lifecycle.fail(
            f"does not fit: {needs}. Try: {suggestion(model, shape, plan.budget)}", lifecycle.EXIT_NO_FIT
        )
    shares = {k: v / MB for k, v in plan.shares().items()}
    if show:
        typer.echo(f"fits: actor share {shares['actor']:.0f} MB, learner share {shares['learner']:.0f} MB")
    return fitted.cfg, shares


@app.command()
def plan(
    config: str = typer.Option(..., "--config", "-c", help="TOML run config."),
    available_memory_gb: float | None = typer.Option(None, help="Budget; default: detected."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: section.key=value (repeatable)."),
) -> None:
    """Estimate each process's memory, check it against the budget, and name the knob to
    turn when it does not fit (exit 3). Loads no model weights."""
    with config_errors():
        cfg = load_config(config, set_)
    check_plan(cfg, available_memory_gb, show=True, config=config)


@app.command()
def prepare(
    config: str = typer.Option(..., "--config", "-c", help="TOML run config."),
    run_dir: str | None = typer.Option(None, help="Override run.dir."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: section.key=value (repeatable)."),
    overwrite: bool = typer.Option(False, help="Delete another run's results in the directory first."),
) -> None:
    """Check a config and write its run directory (config.json, endpoints.json, keys for
    TCP) without starting anything: for processes you start yourself, such as learner
    ranks on several Macs under `mlx.launch --hostfile` (docs/scale-out.md)."""
    with config_errors():
        cfg = load_config(config, set_, run_dir=run_dir)
    cfg, _ = check_plan(cfg, None, config=config)
    from orchestrator.launch import prepare_run_dir
    from runtime.rundir import RunExists

    try:
        run = prepare_run_dir(cfg, overwrite=overwrite)
    except RunExists as e:
        lifecycle.fail(f"error: {e}")
    typer.echo(
        f"wrote {run}: start the learner (or its ranks) with `python -P -m learner --run-dir {run}` "
        f"and each actor with `actor run --run-dir {run} --slot I`"
    )


@app.command("convert-gguf")
def convert_gguf(
    gguf_file: str = typer.Argument(..., help="A .gguf model file (llama.cpp, Ollama, LM Studio)."),
    out: str = typer.Argument(..., help="The mlx-lm model folder to write (model.path in a config)."),
) -> None:
    """Turn a GGUF file into an mlx-lm model folder: Llama-family and Qwen2/Qwen3 models;
    Q4_0, Q4_1 and Q8_0 stay quantized, other types are dequantized (the `gguf` extra)."""
    from policy.from_gguf import GGUFError, convert

    try:
        convert(gguf_file, out, say=typer.echo)
    except GGUFError as e:
        lifecycle.fail(f"error: {e}")


@app.command("reward-worker")
def reward_worker(
    function: str = typer.Argument(..., help="Reward function as module:function (TRL signature)."),
    run_dir: str | None = typer.Option(None, help="Attach to this run's reward socket."),
    connect: str | None = typer.Option(None, help="Or attach to this endpoint."),
    key_dir: str | None = typer.Option(
        None,
        help="CURVE keys for a TCP endpoint (`orchestrator keys "
        "add-peer`); default with --run-dir: the run's.",
    ),
    insecure: bool = typer.Option(False, help="Connect to a TCP endpoint without keys (plain TCP)."),
    search_path: str | None = typer.Option(
        None, help="Directory searched first for the module; default: the current one."
    ),
    learner_timeout: float = typer.Option(
        LEARNER_TIMEOUT_S, help="Exit when the learner has been unreachable this many seconds."
    ),
) -> None:
    """Serve a Python reward function to a run. Start as many as you like; each survives
    learner restarts and exits when the run ends. MODULE is imported from --search-path
    (default: the current folder), as `reward.functions` are from beside the config."""
    import os

    from orchestrator.workers import RewardWorker
    from rewards.functions import RewardError

    endpoint, keys = _worker_endpoint(run_dir, connect, "reward", key_dir, insecure)
    _serve(
        lambda signals: RewardWorker(
            function, endpoint, search_path or os.getcwd(), learner_timeout, signals, keys
        ),
        RewardError,
        run_dir,
    )


@app.command("env-worker")
def env_worker(
    environment: str | None = typer.Argument(None, help="Environment class, module:Class (reset, step)."),
    run_dir: str | None = typer.Option(None, help="Attach to this run's env socket."),
    connect: str | None = typer.Option(None, help="Or attach to this endpoint."),
    key_dir: str | None = typer.Option(
        None,
        help="CURVE keys for a TCP endpoint (`orchestrator keys "
        "add-peer`); default with --run-dir: the run's.",
    ),
    insecure: bool = typer.Option(False, help="Connect to a TCP endpoint without keys (plain TCP)."),
    search_path: str | None = typer.Option(
        None, help="Directory searched first for the module; default: the current one."
    ),
    openenv: str | None = typer.Option(
        None,
        help="Instead of a class: the URL of an OpenEnv server, one "
        "session per episode (the `openenv` extra).",
    ),
    action_field: str = typer.Option("message", help="OpenEnv: the action's field for the model's turn."),
    observation_field: str | None = typer.Option(
        None, help="OpenEnv: the observation's field the model sees; default: all of them, as JSON."
    ),
    actor_timeout: float = typer.Option(
        LEARNER_TIMEOUT_S, help="Exit when the actor has been unreachable this many seconds."
    ),
) -> None:
    """Serve an environment to a run's actor: a Python class, or an OpenEnv server (one
    instance or session per episode). Start as many as you like; each survives actor
    restarts and exits when the run ends."""
    import os
    from collections.abc import Callable
    from functools import partial

    from orchestrator.workers import EnvError, EnvWorker, load_env_class

    lifecycle.watch_lifeline()  # started by `orchestrator up`: end with it
    if (environment is None) == (openenv is None):
        lifecycle.fail("error: give exactly one of module:Class and --openenv URL")
    endpoint, keys = _worker_endpoint(run_dir, connect, "env", key_dir, insecure)

    def make(signals: lifecycle.StopSignals) -> EnvWorker:
        if openenv is not None:
            from orchestrator.openenv_bridge import OpenEnvEpisode, check_installed

            check_installed()
            make_env: Callable[[], object] = partial(OpenEnvEpisode, openenv, action_field, observation_field)
            name = f"the OpenEnv server at {openenv}"
        else:
            assert environment is not None  # one of the two, checked above
            make_env, name = load_env_class(environment, search_path or os.getcwd()), environment
        return EnvWorker(make_env, name, endpoint, actor_timeout, signals, keys)

    _serve(make, EnvError, run_dir)


def _worker_endpoint(
    run_dir: str | None, connect: str | None, socket: str, key_dir: str | None, insecure: bool
) -> tuple[str, Path | None]:
    """The endpoint a worker attaches to, and its CURVE key directory (None: no CURVE)."""
    import logging

    import protocol
    from transport.keys import KeysError, key_dir_for, run_key_dir

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if (run_dir is None) == (connect is None):
        lifecycle.fail("error: give exactly one of --run-dir and --connect")
    try:
        endpoint = connect or protocol.read_endpoints(Path(str(run_dir)))[socket]
    except (OSError, KeyError, ValueError):
        lifecycle.fail(f"error: {run_dir} has no endpoints.json with a {socket} socket; is the run started?")
    try:
        if key_dir is None and run_dir is not None:
            # The run's config says whether it is insecure; without one, it is not.
            insecure = insecure or _run_is_insecure(run_dir)
            return endpoint, run_key_dir(run_dir, endpoint, insecure)
        return endpoint, key_dir_for(endpoint, key_dir, insecure)
    except KeysError as e:
        lifecycle.fail(f"error: {e}")


def _run_is_insecure(run_dir: str) -> bool:
    from runtime.config import read_run_config

    try:
        return read_run_config(run_dir).run.insecure
    except (OSError, ValueError):  # no config.json, or a broken one: fail closed
        return False


def _serve(make_worker, user_error: type[Exception], run_dir: str | None) -> None:
    """Run a worker to its end and exit with its code; a user error (the function or class
    cannot be loaded) exits 2. `run_dir`: where it looks whether its run has ended."""
    import os

    from orchestrator.workers import serve
    from runtime import spans
    from runtime.config import read_run_config

    signals = lifecycle.StopSignals().install()
    try:
        worker = make_worker(signals)
        worker.run_dir = None if run_dir is None else Path(run_dir)
        if run_dir is not None:
            enabled = read_run_config(run_dir).log.timeline
            spans.start(run_dir, f"{worker.role.replace('_', '-')}-{os.getpid()}", enabled)
        code = serve(worker)
    except user_error as e:
        lifecycle.fail(f"error: {e}")
    except lifecycle.ForcedStop as e:
        code = lifecycle.signal_exit_code(e.signum)
    raise typer.Exit(code)


def run_file(run_dir: Path, name: str, why_missing: str) -> Path:
    """`run_dir/name`, or exit 2 saying which is missing: the directory, or the file."""
    if not (run_dir / "config.json").exists():
        what = "does not exist" if not run_dir.exists() else "holds no run (no config.json)"
        lifecycle.fail(f"error: run directory {run_dir} {what}; give the run.dir of a run (--run-dir)")
    if not (run_dir / name).exists():
        lifecycle.fail(f"error: {run_dir / name} does not exist: {why_missing}")
    return run_dir / name


show_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Show a run's files.")
app.add_typer(show_app, name="show")


@show_app.command("completions")
def show_completions(
    run_dir: str = typer.Option(..., "--run-dir", help="The run's directory."),
    step: int | None = typer.Option(None, help="The logged step to show; default: the last."),
    width: int | None = typer.Option(None, help="Line width; default: the terminal's."),
) -> None:
    """Print the completions the learner logged (log.completions_every) as a table."""
    from pathlib import Path

    from orchestrator.show import NotLogged, completions_table, read_lines

    path = run_file(
        Path(run_dir), "completions.jsonl", "the learner logs none (log.completions_every sets how often)"
    )
    try:
        typer.echo(completions_table(read_lines(path), step, width))
    except NotLogged as e:
        lifecycle.fail(f"error: {e}")


@show_app.command("reward")
def show_reward(
    run_dir: str = typer.Option(..., "--run-dir", help="The run's directory."),
    window: int = typer.Option(10, help="Steps at each end to average."),
) -> None:
    """Print the mean reward of the first and the last N steps: did the run learn?"""
    from pathlib import Path

    from orchestrator.show import read_lines, reward_change

    path = run_file(Path(run_dir), "metrics.jsonl", "the run has not finished a step yet")
    typer.echo(reward_change(read_lines(path), window))


@app.command()
def plot(
    run_dir: str = typer.Option(..., "--run-dir", help="The run's directory."),
    out: str | None = typer.Option(None, help="PNG to write; default: RUN_DIR/curves.png."),
) -> None:
    """Write a PNG of the run's main curves (reward ± std, KL, length, clipping, entropy,
    rollout speed) from metrics.jsonl. Needs the `plot` extra."""
    from orchestrator.show import plot_metrics, read_lines

    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        lifecycle.fail(f"error: {path} does not exist")
    try:
        written = plot_metrics(read_lines(path), Path(out or Path(run_dir) / "curves.png"), str(run_dir))
    except RuntimeError as e:
        lifecycle.fail(f"error: {e}")
    typer.echo(f"wrote {written}")


@app.command()
def timeline(
    run_dir: str = typer.Option(..., "--run-dir", help="The run's directory."),
    steps: str | None = typer.Option(
        None, help="A:B, only steps A to B (from step A-1's end); default: all."
    ),
    out: str | None = typer.Option(None, help="Trace to write; default: RUN_DIR/timeline.json."),
    png: str | None = typer.Option(None, help="Also draw it to this PNG (the `plot` extra)."),
) -> None:
    """Write one trace of every process (open it in ui.perfetto.dev or chrome://tracing)
    and print where each one's time went: busy, and what it waited on."""
    from orchestrator.timeline import write_timeline

    run_file(Path(run_dir), "timeline", "no process recorded one (log.timeline = false?)")
    try:
        typer.echo(write_timeline(run_dir, out, steps, png))
    except (ValueError, RuntimeError) as e:
        lifecycle.fail(f"error: {e}")


keys_app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="CURVE keys of a TCP run (RUN/keys; `up` creates them)."
)
app.add_typer(keys_app, name="keys")


@keys_app.command("add-peer")
def keys_add_peer(
    name: str = typer.Argument(..., help="A name for the peer, e.g. the other Mac's host name."),
    run_dir: str = typer.Option(..., "--run-dir", help="The run's directory."),
) -> None:
    """Make a key directory for a peer on another machine and let its key in. Copy the
    directory there and pass it as --key-dir to its actor or workers. A running run lets
    the new key in at once."""
    from transport.keys import KeysError, add_peer

    try:
        out = add_peer(run_dir, name)
    except KeysError as e:
        lifecycle.fail(f"error: {e}")
    typer.echo(
        f"wrote {out} (owner-only; it holds a secret key: copy it over ssh, e.g. scp -r {out} OTHER-MAC:)"
    )


@app.callback()
def _root() -> None:
    """Keep subcommands explicit."""


def main() -> None:
    sys.exit(app())
