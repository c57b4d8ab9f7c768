"""Fitting a run to the machine: when the memory plan does not fit, pick the knobs that
make it fit (micro-batches, the actor's rows beyond one batch's, gradient checkpointing,
fewer decode rows, a dequantized or quantized checkpoint on the CPU), in the order they
cost least, and say what changed.

Apart from orchestrator/plan.py, which estimates what a given shape needs: here the
choices made from those estimates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from orchestrator.plan import (
    GB,
    MB,
    ModelShape,
    Plan,
    Shape,
    detect_budget,
    make_plan,
    prompt_tokens,
    read_shape,
    shape_from_config,
)
from runtime.config import Config


@dataclass
class Fit:
    """The run as it will go: its config (with the knobs `fit` picked), plan and shape,
    and what `up` says about them; `plan.fits` is False when nothing made it fit."""

    cfg: Config
    plan: Plan
    shape: Shape
    notes: list[str]


def halvings(n: int, floor: int = 1) -> list[int]:
    """n/2, n/4, ... down to `floor` (included once reached), for shrinking a knob."""
    out, k = [], n // 2
    while k >= floor:
        out.append(k)
        k //= 2
    if out and out[-1] != floor and n > floor:
        out.append(floor)
    return out


def knob_choices(s: Shape) -> list[tuple[Shape, dict[str, dict]]]:
    """The shape as configured, then the knobs in the order they cost least:
    train.micro_batch_size (the same update, exactly, in more passes), then the actor's
    rows beyond a batch's share (the credit window's, which only let groups sampled ahead
    decode beside the current batch's), then grad_checkpoint (a second forward per
    block), then actor.max_rows below the share (fewer rows decoded at once)."""
    micros = halvings(s.rows)
    out: list[tuple[Shape, dict[str, dict]]] = [(s, {})]
    out += [(replace(s, micro_batch_size=k), {"train": {"micro_batch_size": k}}) for k in micros]
    share = s.actor_share * s.group_size
    engine_rows = not (s.episodes or s.agents)  # their caches wait whatever the engine's rows
    actor: dict[str, dict] = {}
    if engine_rows and s.decode_rows > share:
        s, actor = replace(s, decode_rows=share), {"actor": {"max_rows": share}}
        for k in [s.micro_batch_size, *micros]:
            train = {"train": {"micro_batch_size": k}} if k != s.micro_batch_size else {}
            out.append((replace(s, micro_batch_size=k), {**train, **actor}))
    if not s.grad_checkpoint:
        for k in [s.micro_batch_size, *micros]:
            out.append(
                (
                    replace(s, grad_checkpoint=True, micro_batch_size=k),
                    {"train": {"grad_checkpoint": True, "micro_batch_size": k}, **actor},
                )
            )
    smallest, train = out[-1]
    if engine_rows:
        for rows in halvings(s.decode_rows or share, floor=s.group_size):
            out.append((replace(smallest, decode_rows=rows), {**train, "actor": {"max_rows": rows}}))
    return out


def fit(cfg: Config, m: ModelShape, s: Shape, budget: float, source: str) -> Fit:
    """The run as configured if it fits the budget; else the first of `knob_choices` that
    does, with a quantized checkpoint on the CPU loaded dequantized if that fits at all,
    quantized (and slow, said so) if only that fits."""
    notes: list[str] = []
    quantized = s.dequantize and bool(m.bits or s.actor_bits)
    for dense in [True, False] if quantized else [s.dequantize]:
        shape = replace(s, dequantize=dense)
        for candidate, changes in knob_choices(shape):
            plan = make_plan(m, candidate, budget, source)
            if not plan.fits:
                continue
            if s.dequantize and m.bits:
                notes.append(dequantize_note(m, dense))
            if s.dequantize and s.actor_bits and dense:
                notes.append(
                    f"actor.quantize_bits = {s.actor_bits} on the CPU: the actor's base weights are "
                    "rounded to that many bits and held as float32, the same function at dense speed "
                    "(model.dequantize_on_cpu = false keeps them quantized, and smaller)"
                )
            if changes:
                notes.append(knob_note(make_plan(m, shape, budget, source), changes))
            if quantized and not dense:
                changes = {**changes, "model": {"dequantize_on_cpu": False}}
            return Fit(cfg.replace(**changes) if changes else cfg, plan, candidate, notes)
    return Fit(cfg, make_plan(m, s, budget, source), s, notes)


def dequantize_note(m: ModelShape, dense: bool) -> str:
    if dense:
        return (
            f"the checkpoint is {m.bits}-bit and MLX runs on the CPU here, where quantized matmuls are "
            f"many times slower: the learner and actor load it dequantized to float32 "
            f"({m.dense_bytes / MB:.0f} MB instead of {m.weight_bytes / MB:.0f} MB each; "
            "model.dequantize_on_cpu = false keeps it quantized)"
        )
    return (
        f"warning: the checkpoint is {m.bits}-bit and MLX runs on the CPU here, where its quantized "
        f"matmuls run many times slower than float32 (about 18x measured on a 135M model); there "
        f"is no room to dequantize it ({m.dense_bytes / MB:.0f} MB each), so it stays quantized: "
        "expect a slow run"
    )


def knob_note(configured: Plan, changes: dict[str, dict]) -> str:
    picked = ", ".join(
        f"{section}.{k} = {str(v).lower() if isinstance(v, bool) else v}"
        for section, keys in changes.items()
        for k, v in keys.items()
        if section != "model"
    )
    why = {
        "micro_batch_size": "micro-batches: the same update in more passes",
        "grad_checkpoint": "checkpointing: a second forward per block",
        "max_rows": "fewer rows decoded at once",
    }
    costs = "; ".join(why[k] for keys in changes.values() for k in keys if k in why)
    return (
        f"as configured the run needs {configured.total / MB:.0f} MB (+10% margin) of "
        f"{configured.budget / MB:.0f} MB; it fits with {picked} ({costs})"
    )


def suggestion(m: ModelShape, s: Shape, budget: float) -> str:
    """The single change most likely to make a plan fit, in the order users prefer."""
    candidates = []
    if not s.grad_checkpoint:
        candidates.append(("set train.grad_checkpoint = true", replace(s, grad_checkpoint=True)))
    rows = s.rows
    for micro in (rows // 2, rows // 4, rows // 8, 1):
        if 0 < micro < rows:
            candidates.append((f"set train.micro_batch_size = {micro}", replace(s, micro_batch_size=micro)))
    for g in (s.group_size // 2, 2):
        if 2 <= g < s.group_size:
            candidates.append((f"set sampling.group_size = {g}", replace(s, group_size=g)))
    for n in (s.max_tokens // 2, s.max_tokens // 4):
        if 1 <= n < s.max_tokens:
            candidates.append((f"set sampling.max_tokens = {n}", replace(s, max_tokens=n)))
    for text, shape in candidates:
        if make_plan(m, shape, budget, "").fits:
            return text
    best = min(candidates, key=lambda c: make_plan(m, c[1], budget, "").total, default=None)
    if best is None:
        return "use a smaller model"
    return f"{best[0]} (helps most, but is not enough alone; a smaller model may be needed)"


def plan_for(cfg: Config, available_gb: float | None = None) -> tuple[Fit, ModelShape]:
    """The run's plan, with the knobs that make it fit picked (`fit`)."""
    m = read_shape(cfg.model.path)
    s = shape_from_config(cfg, prompt_tokens(cfg, m.context))
    if available_gb is not None:
        budget, source = available_gb * GB, "--available-memory-gb"
    else:
        budget, source = detect_budget()
    return fit(cfg, m, s, budget, source), m
