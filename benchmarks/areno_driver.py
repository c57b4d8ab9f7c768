"""AReno's GRPO on its MLX backend, on our model, prompts and reward, for benchmarks/real_model.py.

Run as its own process (`python -m benchmarks.areno_driver ARGS_JSON`) so its peak memory
is its own. It does what `areno train --algo grpo` does (AReno 0.10.0, `cli.train.run`)
through its Python API: a `PolicyTrainerConfig`, an `areno.api.Trainer` on the MLX
backend, and `build_trainer(...).fit()` (its `PolicyOnlyTrainer`): one process, the
rollout through its continuous-batching scheduler on mlx-lm's `BatchGenerator`, then
one optimizer step on the same model object, one prompt a step. The prompts go in as
token ids made with the chat template, as ours are (a row's `tokens`); top-k is off.
It prints one JSON line per step: the step's time since the previous step ended, the
rollout's time as AReno reports it (`step_rollout_time_s`), the completion tokens from
a wrapper around its rollout call, and MLX's peak memory.

On this Linux CPU two settings are needed, and both are set here:
- `backend="mlx"`: AReno picks CUDA on Linux by default (`api/config.py`,
  `default_backend_type`); its MLX backend runs on MLX's CPU backend when chosen.
- `MlxConfig.compile_train_step = False`: `PolicyTrainerConfig.mlx_config()` hard-codes
  `True`, and the compiled `value_and_grad` fails at the first train step on the CPU
  with `IndexError: _Map_base::at`; uncompiled it trains. The driver builds the backend
  config with `mlx_config()` and turns that one field off.

What it cannot match: AReno's GRPO has no KL term and no reference model (its
`PolicyTrainerConfig` has no beta; only PPO has a KL loss), so it runs as beta = 0
where the other systems run 0.04. Its loss takes the sampler's logprobs as the old
policy's and computes none, and its ratio is `exp(logprobs - stop_gradient(logprobs))`,
1 by construction (`api/backend/mlx/losses.py`, `grpo_loss`). The rest is set to the
others': LoRA rank 8 with scale 20 (`alpha` 160: AReno's scale is alpha / rank) on every
linear layer of every block, Adam at a constant learning rate (AdamW with
`weight_decay = 0`, `lr_decay_style = "constant"`), gradient-norm clipping at 1.0 (ours).
AReno's own defaults stay where they are its path: gradient checkpointing on, one
micro-batch (`mini_bs` 16 > G).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(args: dict) -> None:
    import areno.api
    import mlx.core as mx
    from areno.api.rewards import RewardRecord
    from areno.api.tokenizer import load_tokenizer
    from areno.api.trainer_config import PolicyTrainerConfig
    from areno.api.trainer_factory import build_trainer

    from rewards.functions import call_reward, load_reward_function, reward_inputs

    reward = load_reward_function(args["reward"], args["search_path"])
    rows = [json.loads(line) for line in open(args["prompts"]) if line.strip()]
    mx.random.seed(args["seed"])

    tokenizer = load_tokenizer(args["model"])

    def encode(row: dict) -> dict:
        """The row with its prompt as token ids, rendered by the chat template as ours are."""
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        return {**row, "tokens": tokenizer.encode(text, add_special_tokens=False)}

    # AReno walks the dataset in order from its first row, as mlxrl's driver does.
    batch_size = args.get("batch_size", 1)
    dataset = [encode(rows[i % len(rows)]) for i in range(args["steps"] * batch_size)]

    step_rewards: list[float] = []

    def reward_fn(record: RewardRecord) -> float:
        row = record.source_record
        columns = {k: v for k, v in row.items() if k not in ("prompt", "tokens")}
        response = [t for t, m in zip(record.tokens, record.loss_mask, strict=True) if m]
        text = tokenizer.decode(response, skip_special_tokens=True)  # as our actor decodes
        inputs = reward_inputs(row["prompt"], [text], [response], columns)
        value = call_reward(reward, inputs, args["reward"])[0] or 0.0
        step_rewards.append(value)
        return value

    config = PolicyTrainerConfig(
        algo="grpo",
        ckpt=args["model"],
        dataset_path=args["prompts"],
        backend="mlx",
        world_size=1,
        epochs=1,
        max_steps=args["steps"],
        batch_size=batch_size,
        n_samples=args["group_size"],
        temperature=args["temperature"],
        top_p=args["top_p"],
        top_k=-1,
        max_new_tokens=args["max_tokens"],
        optimizer_lr=args["learning_rate"],
        lr_decay_style="constant",
        weight_decay=0.0,
        grad_clip_norm=1.0,
        lora=areno.api.LoraConfig(rank=8, alpha=8 * 20.0),
        metrics_log_dir=None,
    )
    backend_config = config.mlx_config()
    backend_config.compile_train_step = False  # compiled, its first train step fails on the CPU
    trainer = areno.api.Trainer(
        config.world_size,
        config.ckpt,
        backend_type=config.backend_type(),
        custom_config=backend_config,
        score_micro_bs=config.score_micro_bs,
    )

    started = [0.0]
    tokens: list[int] = []
    init, rollout, train = trainer.init, trainer.rollout_token_batch_async, trainer.train

    def timed_init() -> None:
        init()
        started[0] = time.perf_counter()

    async def counted_rollout(*a, **kw):
        out = await rollout(*a, **kw)
        tokens.append(sum(len(seq.resp_tokens) for result in out for seq in result.sequences))
        return out

    def reported_train(*a, **kw):
        result = train(*a, **kw)
        now = time.perf_counter()
        step_s = now - started[0]
        print(
            json.dumps(
                {
                    "step": len(tokens),
                    "step_s": step_s,
                    "rollout_s": result["step_rollout_time_s"],
                    "learner_s": step_s - result["step_rollout_time_s"],
                    "completion_tokens": tokens[-1],
                    "reward_mean": sum(step_rewards) / len(step_rewards),
                    "peak_mb": mx.get_peak_memory() / (1 << 20),
                }
            ),
            flush=True,
        )  # since start, as ours
        step_rewards.clear()
        started[0] = time.perf_counter()
        return result

    trainer.init = timed_init
    trainer.rollout_token_batch_async = counted_rollout
    trainer.train = reported_train
    loss_fn = areno.api.get_algorithm(config.algo).make_loss_fn(config)
    build_trainer(config, instance=trainer, dataset=dataset, reward_fn=reward_fn, loss_fn=loss_fn).fit()
    # Every step is reported and AReno has closed its backend. Leave without the
    # interpreter's teardown: there, about one run in three aborts on this CPU
    # ("terminate called without an active exception", no Python frame left), after
    # its rollout thread has used MLX.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
