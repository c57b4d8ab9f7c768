"""What a decode step costs the actor, in its two parts: sampling a token for every row
(policy/sampler.py, temperature 0.7 and top-p 0.95, as the end-to-end runs sample) and the
model's forward of one token a row on the KV cache, each timed alone over 40 steps, at
several numbers of rows and of cached positions.

    python -m benchmarks.decode_step                  # e2e_lengths' 21 M model (flat, V = 16,384)
    python -m benchmarks.decode_step --model PATH     # any mlx-lm folder, e.g. SmolLM2's
    python -m benchmarks.decode_step --rows 11 --cache 48 300 550   # a long batch's cost
    python -m benchmarks.decode_step --quick          # a small shape: checks the harness

The cache is the engine's (mlx-lm's BatchKVCache, rows left-padded): a row that joins a
batch whose longest live row holds L positions is padded to L, and every decode step's
attention reads all L for every row (masked). `--cache L` times that: an 8-token prompt
left-padded to L, as rows that join a long-tailed batch are.

The default model's next-token distribution is nearly flat on purpose (benchmarks/
real_shape.py), so top-p cannot cut among a few candidates and the sampler draws by mass
(policy/sampler.py); a trained model's peaked distribution takes the candidates' path.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.common import harness, write_results
from benchmarks.learner_lengths import QUICK_SHAPE, SMALL_SHAPE
from benchmarks.real_shape import flat_model

if TYPE_CHECKING:
    import mlx.nn as nn

STEPS = 40
PROMPT = 8  # tokens of the prompt every row continues


def timed_parts(model: nn.Module, rows: int, steps: int = STEPS, cache: int = PROMPT) -> tuple[float, float]:
    """Seconds a decode step spends sampling and in the forward, for `rows` rows whose
    batch cache starts `cache` positions long (an 8-token prompt, left-padded)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from policy.sampler import noise_keys, sample_tokens
    from runtime.config import SamplingConfig

    params = SamplingConfig(temperature=0.7, top_p=0.95)
    pad = max(cache - PROMPT, 0)
    layers = [BatchKVCache([pad] * rows) for _ in make_prompt_cache(model)]
    prompt = [0] * pad + list(range(1, PROMPT + 1))
    logits = model(mx.array([prompt] * rows), cache=layers)[:, -1, :]
    keys, sample_s, forward_s = noise_keys(0, list(range(rows))), 0.0, 0.0
    mx.eval(logits)
    for t in range(steps):
        t0 = time.perf_counter()
        tokens, logprobs = sample_tokens(logits, keys, t, params)
        mx.eval(tokens, logprobs)
        t1 = time.perf_counter()
        logits = model(tokens[:, None], cache=layers)[:, -1, :]
        mx.eval(logits)
        sample_s, forward_s = sample_s + t1 - t0, forward_s + time.perf_counter() - t1
    return sample_s / steps, forward_s / steps


def main(argv: list[str] | None = None) -> int:
    p = harness(__doc__)
    p.add_argument("--model", type=Path, default=None, help="an mlx-lm folder (default: e2e_lengths' model)")
    p.add_argument("--rows", type=int, nargs="+", default=[2, 18, 32])
    p.add_argument(
        "--cache", type=int, nargs="+", default=[PROMPT], help="positions in the batch's cache at the start"
    )
    a = p.parse_args(argv)
    from mlx_lm import load

    model = a.model or flat_model(a.models_dir, QUICK_SHAPE if a.quick else SMALL_SHAPE)
    net = load(str(model))[0]  # once: every measurement decodes on the same weights
    rows = [2] if a.quick else a.rows
    steps = 5 if a.quick else STEPS
    measured = {(n, c): timed_parts(net, n, steps, c) for n in rows for c in a.cache}
    lines = [
        f"A decode step's parts, {model.name}: temperature 0.7, top-p 0.95, {steps} steps each\n",
        "| rows | cache positions | sampling, ms | forward, ms |",
        "|---|---|---|---|",
        *(f"| {n} | {c} | {s * 1e3:.1f} | {f * 1e3:.1f} |" for (n, c), (s, f) in measured.items()),
    ]
    out = {
        "model": str(model),
        "runs": [
            {"rows": n, "cache": c, "sample_s": s, "forward_s": f} for (n, c), (s, f) in measured.items()
        ],
    }
    write_results(
        a.results_dir, "decode_step_quick" if a.quick else "decode_step", out, "\n".join(lines) + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
