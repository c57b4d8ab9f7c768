"""A real OpenEnv server (openenv-core's `create_app`, served by uvicorn) for the adapter's
test: it echoes the message it gets, and rewards the share of its characters that are
"7". An episode is two steps.

Usage: python openenv_echo.py PORT
"""

import sys

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

STEPS = 2


class EchoAction(Action):
    message: str = Field(..., description="what to echo")


class EchoObservation(Observation):
    echoed_message: str = Field(default="", description="the message, back")


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session is its own instance

    def __init__(self):
        super().__init__()
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> EchoObservation:
        self._state = State(episode_id=episode_id or "", step_count=0)
        return EchoObservation(echoed_message="say 7", done=False, reward=0.0)

    def step(self, action: EchoAction, timeout_s=None, **kwargs) -> EchoObservation:
        self._state.step_count += 1
        text = action.message
        reward = text.count("7") / max(len(text), 1)
        return EchoObservation(echoed_message=text, done=self._state.step_count >= STEPS, reward=reward)

    @property
    def state(self) -> State:
        return self._state


app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=64)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
