"""A batch's advantages, from its groups' rewards to what the optimizer trains: the
algorithm's advantage of each session, each completion's (a session's turns share it),
and with GiGPO (`algorithm.gigpo_omega > 0`) a step-level term per token (learner/gigpo.py).
Free of sockets and files: the learner's step (learner/service.py) takes it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from learner.algorithms import Algorithm
from learner.batching import TrainRow
from learner.gigpo import batch_advantages
from learner.groups import Group
from runtime.config import Config


@dataclass
class Advantages:
    rewards: np.ndarray  # [groups, group_size]: each session's reward
    rows: np.ndarray  # [B]: each completion's advantage
    trained: np.ndarray  # what the optimizer trains: `rows`, or [B, T] per token with GiGPO
    stats: dict[str, float] = field(default_factory=dict)  # GiGPO's step groups


def advantages(groups: list[Group], samples: list[TrainRow], run: Config, algorithm: Algorithm) -> Advantages:
    """The advantages of a batch's scored `groups`, whose completions are `samples`, by the
    run's `algorithm`."""
    group_size, cfg = run.sampling.group_size, run.algorithm
    rewards = np.stack([g.session_rewards(group_size) for g in groups])
    by_session = algorithm.advantages(rewards).reshape(len(groups), group_size)
    rows = np.concatenate([g.row_advantages(a) for g, a in zip(groups, by_session)])
    if cfg.gigpo_omega <= 0:
        return Advantages(rewards, rows, rows)
    trained, stats = batch_advantages(
        groups,
        samples,
        rows,
        gamma=cfg.gigpo_gamma,
        omega=cfg.gigpo_omega,
        scale_rewards=algorithm.scale_rewards,
    )
    return Advantages(rewards, rows, trained, stats)
