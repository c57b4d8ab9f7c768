"""An agent that trains through the served API: it asks SmolLM2 an arithmetic fact and,
when the answer is wrong, says so and lets it try again, up to three times.

    orchestrator up --config examples/smollm2_agent.toml     (README: "Your own agent")

The run calls `run` once per session with the data row, a base URL and a key of the
session's own. The reward is 1 for the right number at the first try, 1/2 at the second,
1/3 at the third, and 0 if no try gets it: the model is paid most for getting it right at
once, and still learns from the feedback. It also says which try earned it
(`turn_rewards`), so that GiGPO's step-level advantage (the config's
`algorithm.gigpo_omega`) credits that try and not the wrong ones before it. The rows are
examples/smollm2_task.py's.
"""

import re

from openai import OpenAI

TRIES = 3
FEEDBACK = "No, that is not right. Try again. Answer with just the number."


def final_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text or "")
    return numbers[-1] if numbers else None


def run(row: dict, base_url: str, api_key: str) -> dict:
    client = OpenAI(base_url=base_url, api_key=api_key)
    messages, turn_rewards = list(row["prompt"]), []
    for attempt in range(1, TRIES + 1):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        text = reply.choices[0].message.content
        if final_number(text) == row["answer"]:
            turn_rewards.append(1.0 / attempt)
            break
        turn_rewards.append(0.0)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FEEDBACK}]
    # The session's reward, and what each try earned: GiGPO credits the try that was right.
    return {"reward": sum(turn_rewards), "turn_rewards": turn_rewards}
