"""mlx-lm-lora's GRPO on our model, prompts and reward, for benchmarks/real_model.py.

Run as its own process (`python -m benchmarks.mlx_lm_lora_driver ARGS_JSON`) so its peak
memory is its own. It does what `mlx_lm_lora.train --train-mode grpo` does (mlx-lm-lora
5.10.2, `train.run`): the model with LoRA on every layer (`from_pretrained`), a second copy
as the reference model (`load_reference_model`, as its CLI loads one for GRPO), then
`train_grpo`, one prompt a step. The prompts are tokenized with the chat template as
ours are; top-k is off and no answer tag ends a completion, so the sampling matches ours.
It prints one JSON line per step: the step's time and mlx-lm-lora's peak memory from its
report callback, and the rollout's time from a wrapper around its `generate_grpo`.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path


def main(args: dict) -> None:
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm_lora.train import load_reference_model
    from mlx_lm_lora.trainer import grpo_trainer
    from mlx_lm_lora.utils import from_pretrained

    from rewards.functions import call_reward, load_reward_function, reward_inputs

    reward = load_reward_function(args["reward"], args["search_path"])
    rows = [json.loads(line) for line in open(args["prompts"]) if line.strip()]
    mx.random.seed(args["seed"])
    model, tokenizer, _ = from_pretrained(
        model=args["model"], lora_config={"rank": 8, "scale": 20.0, "num_layers": -1}
    )
    reference = load_reference_model(type("Args", (), {"reference_model_path": None, "model": args["model"]}))

    def encode(row: dict) -> tuple:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        return (ids, tokenizer.encode(row["answer"], add_special_tokens=False), prompt, row["answer"])

    # train_grpo draws batches in its own (shuffled) order; any `steps` rows of the same
    # task cost alike, and the first step is left out as a warm-up.
    dataset = [encode(row) for row in rows[: args["steps"]]]

    def final_number(prompts, completions, answer, types=None) -> list[float]:
        inputs = reward_inputs(prompts[0], completions, [[] for _ in completions], {"answer": answer[0]})
        return [r or 0.0 for r in call_reward(reward, inputs, args["reward"])]

    rollout_s: list[float] = []
    completions_tokens: list[int] = []
    generate = grpo_trainer.generate_grpo

    def timed_generate(**kw):
        t0 = time.perf_counter()
        out = generate(**kw)
        rollout_s.append(time.perf_counter() - t0)
        completions_tokens.append(sum(len(c) for c in out[0]))
        return out

    grpo_trainer.generate_grpo = timed_generate
    started = [time.perf_counter()]

    class Report(TrainingCallback):
        def on_train_loss_report(self, info: dict) -> None:
            now = time.perf_counter()
            print(
                json.dumps(
                    {
                        "step": info["iteration"],
                        "step_s": now - started[0],
                        "rollout_s": rollout_s[-1],
                        "learner_s": now - started[0] - rollout_s[-1],
                        "completion_tokens": completions_tokens[-1],
                        "reward_mean": info["train_total_rewards_mean"],
                        "peak_mb": info["peak_memory"] * 1e9 / (1 << 20),
                    }
                ),
                flush=True,
            )
            started[0] = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        grpo_trainer.train_grpo(
            model=model,
            ref_model=reference,
            tokenizer=tokenizer,
            optimizer=optim.Adam(learning_rate=args["learning_rate"]),
            train_dataset=dataset,
            reward_funcs=[final_number],
            args=grpo_trainer.GRPOTrainingArgs(
                batch_size=1,
                iters=args["steps"],
                group_size=args["group_size"],
                max_completion_length=args["max_tokens"],
                max_seq_length=4096,
                beta=args["beta"],
                temperature=args["temperature"],
                top_p=args["top_p"],
                top_k=0,
                steps_per_report=1,
                steps_per_eval=10**9,
                steps_per_save=10**9,
                adapter_file=str(Path(tmp) / "adapters.safetensors"),
            ),
            training_callback=Report(),
            end_answer_token="",
        )


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
