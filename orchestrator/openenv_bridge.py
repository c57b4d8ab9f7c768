"""OpenEnv environments as this project's environments.

An OpenEnv server (openenv-core; any environment built with its `create_app`) keeps each
episode in a WebSocket session of its own. `OpenEnvEpisode` is one such session, with
the `reset` / `step` of an environment class, so `orchestrator env-worker --openenv URL`
serves it on the actor's env socket like any Python environment. It speaks through
OpenEnv's own `GenericEnvClient` (the `openenv` extra), with plain dicts: no package of
the environment is needed here.

An action is `{action_field: the model's turn}` (`message` for OpenEnv's echo template).
What the model sees of an observation is its `observation_field`, or, unset, every field
of the observation as JSON. Rewards and `done` are the server's.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.workers import EnvError

INSTALL = "pip install -e '.[openenv]'"


def check_installed() -> None:
    """Fail at start, not at the first episode, when openenv-core is missing."""
    try:
        import openenv.core.generic_client  # noqa: F401
    except ImportError:
        raise EnvError(f"the OpenEnv adapter needs openenv-core: {INSTALL}") from None


class OpenEnvEpisode:
    """One episode on the OpenEnv server at `url`: a session opened here, closed at the end."""

    def __init__(self, url: str, action_field: str = "message", observation_field: str | None = None) -> None:
        from openenv.core.generic_client import GenericEnvClient

        self.action_field, self.observation_field = action_field, observation_field
        self.client = GenericEnvClient(base_url=url).sync()
        self.client.connect()

    def reset(self, prompt: Any, **columns: Any) -> dict:
        """The server's reset; the data row is the model's prompt, not the server's input."""
        return self.reply(self.client.reset())

    def step(self, action: str) -> dict:
        return self.reply(self.client.step({self.action_field: action}))

    def reply(self, result: Any) -> dict:
        observation = result.observation if isinstance(result.observation, dict) else {}
        if self.observation_field is not None:
            if self.observation_field not in observation:
                fields = ", ".join(observation) or "none"
                raise EnvError(
                    f"the observation has no field {self.observation_field!r} (fields: {fields}); "
                    "set env.openenv_observation_field"
                )
            text = observation[self.observation_field]
            text = text if isinstance(text, str) else json.dumps(text)
        else:
            shown = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
            text = json.dumps(shown)
        return {"observation": text, "reward": result.reward, "done": bool(result.done)}

    def close(self) -> None:
        self.client.close()
