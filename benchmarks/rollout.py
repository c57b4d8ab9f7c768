"""Row 1: rollout tokens/s of our actor sampler against mlx-lm's `batch_generate`.

The same model object (the policy: base model with LoRA attached, as the actor runs it),
the same prompts, G, max_tokens and temperature: the comparison is between the two
decoding engines, not between a LoRA model and a plain one (LoRA layers cost ~10% here). Tokens are counted
as the tokens each sequence actually produced, EOS included on both sides: our sampler
keeps a sampled EOS as the last ID, while `batch_generate` drops it from `token_ids`, so
a sequence it returns shorter than max_tokens produced one more token (its EOS).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.common import LORA, MODEL_DIR, PROMPTS, log, median, timed


@dataclass
class RolloutResult:
    group_size: int
    num_prompts: int
    max_tokens: int
    sampler: str  # which of our functions ran: sample_groups or sample_group per prompt
    ours_tok_s: float | None = None
    theirs_tok_s: float | None = None  # batch_generate, the whole batch decoded at once
    theirs_default_tok_s: float | None = None  # batch_generate with its default batch sizes
    theirs_kwargs: dict = field(default_factory=dict)
    runs: dict = field(default_factory=dict)  # raw (tokens, seconds) per repetition

    @property
    def ratio(self) -> float | None:
        if self.ours_tok_s and self.theirs_tok_s:
            return self.ours_tok_s / self.theirs_tok_s
        return None


def sample_ours(
    model, prompt_ids: list[list[int]], group_size: int, params, eos_ids: set[int], seed: int
) -> int:
    """Sample every prompt's group with our sampler, as the actor does; return the tokens produced."""
    from policy.engine import sample_groups

    groups = sample_groups(model, prompt_ids, group_size, params, eos_ids, seed)
    return sum(len(c.token_ids) for group in groups for c in group)


def sample_theirs(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    group_size: int,
    max_tokens: int,
    seed: int,
    batch_kwargs: dict,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> int:
    """batch_generate with each prompt repeated G times; return the tokens produced."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    sequences = [p for p in prompt_ids for _ in range(group_size)]
    response = batch_generate(
        model,
        tokenizer,
        sequences,
        max_tokens=max_tokens,
        sampler=make_sampler(temp=temperature, top_p=top_p),
        return_token_ids=True,
        **batch_kwargs,
    )
    # A sequence shorter than max_tokens stopped on an EOS that token_ids leaves out.
    return sum(len(ids) + (len(ids) < max_tokens) for ids in response.token_ids)


def rates(contenders: dict, reps: int) -> tuple[dict[str, float], dict[str, list]]:
    """Median tokens/s of each contender fn(seed) over `reps` timed calls, after one
    untimed warm-up each. Calls are interleaved (A, B, C, A, B, C, ...) so that load
    from other work on a shared machine hits every contender alike."""
    for fn in contenders.values():
        fn(12345)  # a seed none of the timed calls uses
    runs: dict[str, list] = {name: [] for name in contenders}
    for seed in range(reps):
        for name, fn in contenders.items():
            runs[name].append(timed(lambda f=fn, s=seed: f(s)))
    return {name: median([t / sec for t, sec in r]) for name, r in runs.items()}, runs


def run(num_prompts: int, group_sizes: tuple[int, ...], max_tokens: int, reps: int) -> list[RolloutResult]:
    from mlx_lm import load

    from policy.data import load_prompts
    from policy.model import load_policy
    from runtime.config import SamplingConfig

    ours, tokenizer, _ = load_policy(str(MODEL_DIR), LORA)
    _, their_tokenizer = load(str(MODEL_DIR))
    theirs = ours
    # Tokenized exactly as the actor does it (same tokenizer files on both sides).
    prompt_ids = [p.prompt_ids for p in load_prompts(PROMPTS, tokenizer, 1024)[:num_prompts]]
    eos_ids = set(tokenizer.eos_token_ids)
    params = SamplingConfig(temperature=1.0, max_tokens=max_tokens)
    results = []
    for g in group_sizes:
        n = len(prompt_ids) * g
        # Decode all rows in one batch, as our batched sampler does; mlx-lm's own default
        # (32 decoding rows, 8 prefilled at a time) is reported beside it for reference.
        whole = {"completion_batch_size": n, "prefill_batch_size": n}
        r = RolloutResult(g, len(prompt_ids), max_tokens, "sample_groups", theirs_kwargs=whole)
        log(
            f"rollout G={g}: ours ({r.sampler}) vs batch_generate, {len(prompt_ids)} prompts, "
            f"max_tokens {max_tokens}, {reps} interleaved repetitions"
        )
        medians, r.runs = rates(
            {
                "ours": lambda s, g=g: sample_ours(ours, prompt_ids, g, params, eos_ids, s),
                "theirs": lambda s, g=g, kw=whole: sample_theirs(
                    theirs, their_tokenizer, prompt_ids, g, max_tokens, s, kw
                ),
                "theirs_default": lambda s, g=g: sample_theirs(
                    theirs, their_tokenizer, prompt_ids, g, max_tokens, s, {}
                ),
            },
            reps,
        )
        r.ours_tok_s, r.theirs_tok_s = medians["ours"], medians["theirs"]
        r.theirs_default_tok_s = medians["theirs_default"]
        results.append(r)
    return results
