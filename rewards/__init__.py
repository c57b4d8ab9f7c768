"""Rewards: in-process functions with TRL's signature, and the reward socket that external
workers (any language) attach to. No MLX here: the actor and the learner both use it."""
