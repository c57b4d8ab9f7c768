"""mlxrl's GRPO loop on our model, prompts and reward, for benchmarks/real_shape.py.

Run as its own process (`python -m benchmarks.mlxrl_driver ARGS_JSON`) so its peak memory
is its own. It follows `mlxrl train`'s loop (mlxrl 0.2.4, `cli._phase1_gsm8k`): sample G
completions of one prompt, score them, compute old-policy and reference logprobs
(`batch_from_rollouts`), one optimizer step. It prints one JSON line per step. The
rollout is its best path (`best`: `generate_prefix_cached_group_rollouts` with
`compile_decode_step=True`, behind mlxrl's published figures) or `naive`, what `mlxrl
train` runs.
"""

from __future__ import annotations

import json
import sys
import time


def main(args: dict) -> None:
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlxrl.algo.grpo import GRPOAlgorithm
    from mlxrl.policy.logprobs import pad_token_id_from_tokenizer
    from mlxrl.policy.model import LoRAConfig, load_policy_with_lora
    from mlxrl.rollout.naive import SamplingConfig, generate_group_rollouts
    from mlxrl.rollout.optimized import generate_prefix_cached_group_rollouts
    from mlxrl.train.grpo import batch_from_rollouts, optimizer_step

    from rewards.functions import call_reward, load_reward_function, reward_inputs

    reward = load_reward_function(args["reward"], args["search_path"])
    rows = [json.loads(line) for line in open(args["prompts"]) if line.strip()]

    mx.random.seed(args["seed"])
    model, tokenizer, _ = load_policy_with_lora(model_id=args["model"], config=LoRAConfig(rank=8, scale=20.0))
    optimizer = optim.Adam(learning_rate=args["learning_rate"])
    pad = pad_token_id_from_tokenizer(tokenizer)
    sampling = SamplingConfig(
        max_tokens=args["max_tokens"], temperature=args["temperature"], top_p=args["top_p"]
    )
    algorithm = GRPOAlgorithm()

    def text_of_prompt(prompt) -> str:
        """A chat prompt rendered by the model's template, as this project renders it."""
        if isinstance(prompt, str):
            return prompt
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)

    if args["rollout"] == "best":  # its prefix-cached rollout with the compiled decode step

        def generate(**kw):
            return generate_prefix_cached_group_rollouts(**kw, compile_decode_step=True)
    else:
        generate = generate_group_rollouts  # what `mlxrl train` runs
    batch_size = args.get("batch_size", 1)
    for step in range(args["steps"]):
        batch_rows = [rows[(step * batch_size + i) % len(rows)] for i in range(batch_size)]
        t0 = time.perf_counter()
        prompts = [text_of_prompt(row["prompt"]) for row in batch_rows]
        completions = generate(
            model=model,
            tokenizer=tokenizer,
            prompts=prompts,
            group_size=args["group_size"],
            config=sampling,
            seed=args["seed"] + step,
            use_chat_template=False,
        )
        t1 = time.perf_counter()
        ids = [list(c.completion_tokens) for c in completions]
        rewards = []
        for i, row in enumerate(batch_rows):  # completions come prompt by prompt, G each
            group = slice(i * args["group_size"], (i + 1) * args["group_size"])
            columns = {k: v for k, v in row.items() if k != "prompt"}
            inputs = reward_inputs(row["prompt"], [c.text for c in completions[group]], ids[group], columns)
            rewards += [r or 0.0 for r in call_reward(reward, inputs, args["reward"])]
        batch = batch_from_rollouts(
            model=model,
            completions=completions,
            rewards=rewards,
            group_size=args["group_size"],
            pad_token_id=pad,
            compute_reference=args["beta"] != 0.0,
            algorithm=algorithm,
        )
        optimizer_step(
            model=model,
            optimizer=optimizer,
            batch=batch,
            beta=args["beta"],
            pad_token_id=pad,
            algorithm=algorithm,
        )
        t2 = time.perf_counter()
        print(
            json.dumps(
                {
                    "step": step + 1,
                    "step_s": t2 - t0,
                    "rollout_s": t1 - t0,
                    "learner_s": t2 - t1,
                    "completion_tokens": sum(map(len, ids)),
                    "reward_mean": sum(rewards) / len(rewards),
                    "peak_mb": mx.get_peak_memory() / (1 << 20),
                }
            ),
            flush=True,
        )  # since start, as ours


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
