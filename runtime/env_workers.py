"""The command line of an env worker (`orchestrator env-worker`), for `up` and for `actor
eval`, which start them: here, below both, so that neither imports the other."""

from __future__ import annotations

from runtime.config import Config


def env_worker_args(cfg: Config) -> list[str]:
    """What `python -m` runs for one env worker of `cfg` (`up` starts them, `actor eval` too)."""
    env = cfg.env
    if env.environment == "openenv":
        assert env.openenv_url is not None  # validate() requires it
        field = env.openenv_observation_field
        observation = ["--observation-field", field] if field else []
        return [
            "orchestrator",
            "env-worker",
            "--openenv",
            env.openenv_url,
            "--action-field",
            env.openenv_action_field,
            *observation,
        ]
    assert env.environment is not None and cfg.reward.search_path is not None  # resolved paths
    return ["orchestrator", "env-worker", env.environment, "--search-path", cfg.reward.search_path]
