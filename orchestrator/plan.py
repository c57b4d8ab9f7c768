"""The unified-memory plan: what each process needs, checked against the machine before
any model loads, and the share each process is then held to.

Every term is an estimate in bytes from the model's config.json and safetensors headers
(no weights are read). docs/memory.md gives the formulas and their measured error.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import struct
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from policy.model import dequantizes
from runtime.config import QUANT_GROUP, Config, ConfigError, ceil_div, logit_chunk_positions

MB = 1 << 20
GB = 1 << 30
KV_STEP = 256  # mlx-lm grows KV caches in steps of 256 tokens
# Activation values saved for backward per token per layer: hidden-sized tensors (norms,
# q/k/v/o, residuals, LoRA inputs), intermediate-sized ones (gate, up, SiLU, product) and
# attention maps (scores and probabilities, one per head), as counted in a Llama block.
# Against peaks measured with MLX 0.32 the count is within 11% on the tiny model's shapes
# and 3% per layer on SmolLM2-135M (hidden 576, intermediate 1536); tests/test_plan.py
# holds both. (A fit on the tiny model alone gave 14, 5 and 2, 33% high on SmolLM2.)
HIDDEN_TENSORS, INTERMEDIATE_TENSORS, ATTENTION_MAPS = 10, 4, 2
# With gradient checkpointing a block's activations are rebuilt during its backward and
# live there beside their gradients: about 1.7 blocks' worth (as counted above) at the
# peak, measured on the tiny model with MLX 0.32 (180-196 MB against 181 MB planned).
CHECKPOINT_BLOCKS = 1.7
# Float32-sized copies of the logits alive at the learner's peak: the model's logits cast
# to float32 (or scaled by 1/temperature), exp() inside logsumexp, and the gradient.
# tests/test_plan.py measures it on a 16k-vocabulary model where logits are the peak, at
# temperature 1 and 0.7, with the old-policy pass fused and apart.
LOGIT_COPIES = 3
# With train.logit_chunk_mb the logits exist one chunk of positions at a time, in three copies
# at the step's peak (logits, logsumexp's exp, and the backward's softmax and gather
# gradient), four when the step also takes the entropy (old-policy pass fused), beside
# three float32 [tokens, hidden] arrays (last hidden states, their jacobian, the
# cotangent). tests/test_plan.py measures both at a 151,936 vocabulary.
CHUNK_LOGIT_COPIES = 3
CHUNK_HIDDEN_COPIES = 3
# Estimates run up to 10% low on the measured shapes: a plan must fit with this margin.
SAFETY = 1.10


class PlanError(ValueError):
    """The model's shape cannot be read yet (a hub model not downloaded): a run can go on
    without a plan."""


class ModelMissing(PlanError):
    """model.path is no folder, and no model in the local Hugging Face cache either."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(missing_model(path))


def missing_model(path: str, config: str | Path | None = None) -> str:
    """What to say of a model.path that is neither a folder nor a cached hub model: the
    folder it would be (relative to the config, when the config is known), and the comment
    the config gives that path, if any (the examples name the script that makes the folder)."""
    folder = Path(config).resolve().parent / path if config is not None else Path(path)
    text = (
        f"model.path {path!r}: no such folder {folder} (a relative model.path is read beside "
        "the config), and no hub model of that name in the local Hugging Face cache; the plan "
        "needs its config.json and weights on disk"
    )
    try:
        lines = Path(config).read_text().splitlines() if config is not None else []
    except OSError:
        lines = []
    said = re.compile(rf"""^\s*path\s*=\s*["']{re.escape(path)}["']\s*#\s*(.+?)\s*$""")
    notes = [m.group(1) for m in map(said.match, lines) if m]
    return text + (f". The config says: {notes[0]}" if notes else "")


@dataclass(frozen=True)
class ModelShape:
    weight_bytes: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    act_bytes: int  # bytes per activation value (float16/bfloat16: 2, float32: 4)
    lora_in_out: dict[str, tuple[int, int]]  # per linear of a block: (in, out) features
    context: int | None = None  # max_position_embeddings, when config.json says
    bits: int | None = None  # the saved weights' quantization, if any
    dense_bytes: int = 0  # the weights dequantized to float32 (policy.model.dequantize_base)


def quantized_bytes(m: ModelShape, bits: int) -> float:
    """The base weights once the actor quantizes them: `bits` per weight plus a scale and
    a bias (in the weights' dtype) per group of QUANT_GROUP. Weights saved quantized stay as
    they are."""
    if m.bits:
        return m.weight_bytes
    return m.weight_bytes / m.act_bytes * (bits / 8 + 2 * m.act_bytes / QUANT_GROUP)


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def model_dir(path: str) -> Path:
    """The model's directory: `path` itself, or its snapshot in the local Hugging Face cache.
    Raises PlanError when a valid hub id is not downloaded yet, ConfigError when `path`
    is no valid hub id either; any other failure of the cache is reported as it is."""
    p = Path(path)
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(path, local_files_only=True, allow_patterns=["*.json", "*.safetensors"])
        )
    except LocalEntryNotFoundError:
        raise ModelMissing(path) from None
    except HFValidationError as e:
        raise ConfigError(f"model.path {path!r} is neither a local directory nor a hub id: {e}") from None


def read_shape(path: str) -> ModelShape:
    d = model_dir(path)
    hf = json.loads((d / "config.json").read_text())  # the model's own config (Hugging Face)
    hf = {**hf, **hf.get("text_config", {})}
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise PlanError(f"no .safetensors weights in {d}")
    tensors: dict[str, dict] = {}
    for f in files:
        tensors.update({k: v for k, v in _safetensors_header(f).items() if k != "__metadata__"})
    quantization = hf.get("quantization") or {}
    bits = quantization.get("bits")
    lora: dict[str, tuple[int, int]] = {}
    values = 0  # weights, counted unpacked
    for name, info in tensors.items():
        if bits and name.endswith((".scales", ".biases")):
            continue
        count = math.prod(info["shape"])
        module_bits = (quantization.get(name.rsplit(".", 1)[0]) or {}).get("bits", bits)
        values += count * 32 // module_bits if info["dtype"] == "U32" and module_bits else count
    for name, info in tensors.items():
        parts = name.split(".")
        if "layers" not in parts or parts[-1] != "weight" or len(info["shape"]) != 2:
            continue
        layer = parts.index("layers")
        if parts[layer + 1] != "0" or "norm" in parts[-2]:
            continue
        out_f, in_f = info["shape"]
        if info["dtype"] == "U32" and bits:  # packed quantized weights
            in_f = in_f * 32 // bits
        lora[".".join(parts[layer + 2 : -1])] = (in_f, out_f)
    hidden = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    dtype = str(hf.get("torch_dtype", "float32"))
    return ModelShape(
        weight_bytes=sum(f.stat().st_size for f in files),
        layers=hf["num_hidden_layers"],
        hidden=hidden,
        intermediate=hf["intermediate_size"],
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        vocab=hf["vocab_size"],
        act_bytes=2 if dtype in ("float16", "bfloat16") else 4,
        lora_in_out=lora,
        context=hf.get("max_position_embeddings"),
        bits=bits,
        dense_bytes=4 * values,
    )


@dataclass(frozen=True)
class Shape:
    """The run's knobs that decide memory."""

    group_size: int
    batch_size: int
    prompt_tokens: int
    max_tokens: int
    micro_batch_size: int
    grad_checkpoint: bool
    lora_rank: int
    lora_layers: int
    lora_keys: tuple[str, ...]
    actor_bits: int = 0  # actor.quantize_bits
    logit_chunk_mb: float = 0.0  # train.logit_chunk_mb
    fused: bool = True  # the old-policy pass fused into the step (num_iterations 1)
    actor_count: int = 1  # actor.count: each actor samples its share of the batches in flight
    local_actors: int = 1  # those on this machine (actor.count - actor.remote)
    learner_ranks: int = 1  # learner.ranks: each trains its share of a batch's rows
    share_prompts: bool = True  # train.share_prompts (and no grad_checkpoint): each prompt once
    decode_rows: int = 0  # rows an actor decodes at once (Config.decode_rows); 0: its share of a batch
    dequantize: bool = False  # quantized weights are held as float32 (policy.model.dequantizes)
    episodes: bool = False  # an environment: every episode of a batch keeps its KV cache while it waits
    staleness: int = 1  # train.max_staleness: above 0, groups join a running batch
    agents: bool = False  # agent sessions: every session of the credit window keeps its KV cache
    reference_ahead_mb: float = 0.0  # train.reference_ahead_mb where the learner takes them (beta > 0)

    @property
    def actor_share(self) -> int:
        """Groups one actor samples at a time."""
        return ceil_div(self.batch_size, self.actor_count)

    @property
    def rows(self) -> int:
        """Completions in one learner forward (a micro-batch of one rank's rows)."""
        total = ceil_div(self.batch_size * self.group_size, self.learner_ranks)
        return self.micro_batch_size if 0 < self.micro_batch_size < total else total

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def prompts(self) -> int:
        """Distinct prompts one learner forward may run (each once, when shared)."""
        return min(self.rows, ceil_div(self.batch_size, self.learner_ranks))

    @property
    def forward_tokens(self) -> int:
        """Positions one learner forward computes: whole rows, or each prompt once and the
        completions after it."""
        if not self.shares:
            return self.rows * self.tokens
        return self.prompts * self.prompt_tokens + self.rows * self.max_tokens

    @property
    def logit_positions(self) -> int:
        """Positions whose logits one learner forward forms: a shared prompt's last only
        (through the model's output head)."""
        if not self.shares:
            return self.rows * self.tokens
        return self.prompts + self.rows * self.max_tokens

    @property
    def shares(self) -> bool:
        return self.share_prompts and not self.grad_checkpoint


def lora_params(m: ModelShape, s: Shape) -> int:
    keys = [k for k in m.lora_in_out if not s.lora_keys or k in s.lora_keys]
    layers = m.layers if s.lora_layers <= 0 else min(s.lora_layers, m.layers)
    return layers * sum(s.lora_rank * sum(m.lora_in_out[k]) for k in keys)


def activation_bytes(m: ModelShape, tokens: int, seq: int) -> float:
    """Bytes saved for backward by one transformer block over `tokens` tokens."""
    per_token = (
        HIDDEN_TENSORS * m.hidden + INTERMEDIATE_TENSORS * m.intermediate + ATTENTION_MAPS * m.heads * seq
    )
    return tokens * per_token * m.act_bytes


def actor_terms(m: ModelShape, s: Shape) -> dict[str, float]:
    # The engine's live rows; with episodes, every episode of a batch holds its KV cache,
    # decoding or waiting for its environment; with agents, every session in flight.
    share = s.actor_share * s.group_size
    if s.agents:  # the sessions of (max_staleness + 1) batches run at once, each with its cache
        share *= s.staleness + 1
    rows = max(s.decode_rows, share) if s.episodes or s.agents else (s.decode_rows or share)
    ctx = math.ceil(s.tokens / KV_STEP) * KV_STEP
    kv = rows * ctx * m.layers * 2 * m.kv_heads * m.head_dim * m.act_bytes
    terms = {
        "weights": quantized_bytes(m, s.actor_bits) if s.actor_bits else m.weight_bytes,
        "lora": 4 * lora_params(m, s),
        "kv_cache": kv,
        # Cutting finished rows out (cache filter), rows joining a running batch (extend)
        # and growing past a 256-token block build the new cache while the old one is
        # alive: measured peaks are 1.5x the cache. A synchronous batch whose rows all fit
        # at once, in one block, does none of them: it starts together and ends empty.
        "kv_copy": kv / 2 if s.staleness or s.episodes or rows < share or s.tokens > KV_STEP else 0.0,
        # The prompts' forward, with logits for their last positions only: every group that
        # joins the batch at once (at the start, the whole credit window), at least a share.
        "prefill": max(s.actor_share, ceil_div(rows, s.group_size))
        * (m.vocab * 4 + 4 * s.prompt_tokens * m.hidden * m.act_bytes),
        "sampling": rows * m.vocab * 4 * 4,  # logits, logprobs, sorted copy, mask
    }
    if s.actor_bits and not m.bits:
        # Quantizing as it loads, the largest weight (the embedding) exists once in full
        # precision, before any sampling: the peak is the larger of that and the sampling.
        running = sum(v for k, v in terms.items() if k not in ("weights", "lora"))
        terms["quantize_load"] = max(0.0, m.vocab * m.hidden * m.act_bytes - running)
    return terms


def learner_terms(m: ModelShape, s: Shape) -> dict[str, float]:
    lora = 4 * lora_params(m, s)
    tokens = s.forward_tokens
    per_layer = activation_bytes(m, tokens, s.tokens)
    # Backward runs from the output down to the first block with LoRA only: the blocks
    # below it keep no activations (lora.num_layers counts from the last block).
    trained = m.layers if s.lora_layers <= 0 else min(s.lora_layers, m.layers)
    if s.grad_checkpoint:  # block inputs for every trained layer, one block's insides at a time
        activations = trained * tokens * m.hidden * m.act_bytes + CHECKPOINT_BLOCKS * per_layer
    else:
        activations = trained * per_layer
    # Shared prompts: every row's copy of its prompt's keys and values (KVCache.merge), each layer.
    kv_values = m.layers * 2 * m.kv_heads * m.head_dim  # a position's keys and values, every layer
    prompt_kv = s.rows * s.prompt_tokens * kv_values * m.act_bytes if s.shares else 0
    # Shared prompts carried across micro-batches (learner/trainer.py, accumulate): any of a
    # rank's prompts may be; its keys and values are held through the step, and their
    # gradient summed in float32.
    batch_prompts = ceil_div(s.batch_size, s.learner_ranks)
    carried = batch_prompts * s.prompt_tokens * kv_values * (m.act_bytes + 4) if s.shares else 0
    return {
        "weights": m.weight_bytes,
        "lora": lora,
        "optimizer": 2 * lora,  # Adam's m and v
        "gradients": lora,
        "activations": activations,
        "prompt_kv": prompt_kv,
        "carried_prompts": carried,
        "logits": logits_bytes(m, s, s.logit_positions, activations),
        # The old-policy and reference passes run before the step, one micro-batch at a
        # time and without a graph: their peak (a forward's logits) stays below the
        # step's, so they add nothing to the total. Listed to show they were counted.
        "reference": 0.0,
        # The keys and values of the groups still sampled whose reference logprobs it
        # takes ahead (learner/ahead.py), held through the step: every row of the credit
        # window at max_tokens, up to train.reference_ahead_mb.
        "reference_ahead": min(
            s.reference_ahead_mb * (1 << 20),
            (s.staleness + 1) * s.batch_size * s.group_size * s.tokens * kv_values * m.act_bytes,
        ),
    }


def logits_bytes(m: ModelShape, s: Shape, tokens: int, activations: float) -> float:
    """The learner's logits at its peak beyond the activations: a micro-batch's whole
    logits live beside the activations of the differentiated forward; by chunks they
    exist while the body runs without a graph, and the body's backward runs without them,
    so the peak holds the larger of the two (their excess is this term)."""
    chunk = logit_chunk_positions(s.logit_chunk_mb, m.vocab)
    if chunk <= 0 or tokens <= chunk:
        return LOGIT_COPIES * tokens * m.vocab * 4
    copies = CHUNK_LOGIT_COPIES + s.fused
    chunked = copies * chunk * m.vocab * 4 + CHUNK_HIDDEN_COPIES * tokens * m.hidden * 4
    return max(0.0, chunked - activations)


@dataclass
class Plan:
    actor: dict[str, float]
    learner: dict[str, float]
    budget: float
    budget_source: str
    actors: int = 1  # actor processes on this machine, each with `actor`'s terms
    learners: int = 1  # learner ranks on this machine, each with `learner`'s terms

    @property
    def total(self) -> float:
        return self.actors * sum(self.actor.values()) + self.learners * sum(self.learner.values())

    @property
    def fits(self) -> bool:
        return self.total * SAFETY <= self.budget

    def shares(self) -> dict[str, int]:
        """The budget split in proportion to each process's estimated need (each actor's,
        each learner rank's)."""
        a, b = sum(self.actor.values()), sum(self.learner.values())
        whole = self.actors * a + self.learners * b
        return {"actor": int(self.budget * a / whole), "learner": int(self.budget * b / whole)}


def detect_budget() -> tuple[float, str]:
    """Usable memory: on macOS the GPU wired limit (or 3/4 of RAM when unset), elsewhere
    the kernel's MemAvailable."""
    if platform.system() == "Darwin":
        total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True).stdout)
        wired = subprocess.run(["sysctl", "-n", "iogpu.wired_limit_mb"], capture_output=True, text=True)
        limit_mb = int(wired.stdout.strip() or 0) if wired.returncode == 0 else 0
        if limit_mb > 0:
            return limit_mb * MB, "iogpu.wired_limit_mb"
        return total * 3 / 4, "3/4 of hw.memsize (iogpu.wired_limit_mb is unset)"
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"], "MemAvailable"


def shape_from_config(cfg: Config, prompt_tokens: int) -> Shape:
    s, t, lora = cfg.sampling, cfg.train, cfg.lora
    return Shape(
        s.group_size,
        t.batch_size,
        prompt_tokens,
        cfg.max_completion_tokens,
        t.micro_batch_size,
        t.grad_checkpoint,
        lora.rank,
        lora.num_layers,
        lora.keys,
        cfg.actor.quantize_bits,
        t.logit_chunk_mb,
        t.fuse_old_logprobs and cfg.algorithm.num_iterations == 1,
        cfg.actor.count,
        cfg.actor.count - cfg.actor.remote,
        cfg.learner.ranks,
        t.share_prompts,
        cfg.decode_rows,
        dequantizes(cfg.model.dequantize_on_cpu),
        bool(cfg.env.environment),
        t.max_staleness,
        cfg.agent.enabled,
        cfg.partials_mb,
    )


def make_plan(m: ModelShape, s: Shape, budget: float, source: str) -> Plan:
    # Dequantized, weights and activations are float32, and an actor told to quantize
    # rounds its weights but holds them dense. Without that, the actor keeps the
    # checkpoint's own quantization or quantizes as it loads.
    dense = replace(m, weight_bytes=m.dense_bytes, act_bytes=4, bits=None) if s.dequantize and m.bits else m
    actor = actor_terms(dense, replace(s, actor_bits=0)) if s.dequantize else actor_terms(m, s)
    return Plan(
        actor,
        learner_terms(dense, s),
        budget,
        source,
        s.local_actors,
        s.learner_ranks,
    )


def render(plan: Plan) -> str:
    lines = [f"{'process':<9} {'term':<12} {'MB':>10}"]
    for name, terms in (("actor", plan.actor), ("learner", plan.learner)):
        for term, value in terms.items():
            lines.append(f"{name:<9} {term:<12} {value / MB:>10.1f}")
        lines.append(f"{name:<9} {'total':<12} {sum(terms.values()) / MB:>10.1f}")
    for name, n, terms in (("actors", plan.actors, plan.actor), ("ranks", plan.learners, plan.learner)):
        if n > 1:
            lines.append(f"{name:<9} {f'x{n}':<12} {n * sum(terms.values()) / MB:>10.1f}")
    lines.append(f"{'all':<9} {'total':<12} {plan.total / MB:>10.1f}")
    lines.append(f"{'budget':<9} {'':<12} {plan.budget / MB:>10.1f}   ({plan.budget_source})")
    return "\n".join(lines)


def prompt_tokens(cfg: Config, context: int | None = None) -> int:
    """The longest prompt of the data, in tokens (capped at max_prompt_tokens). Loads
    only the tokenizer. Raises DataError for a row (of the data or the eval prompts) that
    does not parse or does not fit the model's context, so a run stops on it before any
    process starts."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch not found" notice
    from transformers import AutoTokenizer

    from policy.data import check_context, load_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir(cfg.model.path)))
    d = cfg.data
    prompts = load_prompts(d.prompts, tokenizer, cfg.sampling.max_prompt_tokens, d.split, d.prompt_column)
    check_context(prompts, context, cfg.max_completion_tokens)
    if cfg.eval.prompts:
        held_out = load_prompts(
            cfg.eval.prompts, tokenizer, cfg.sampling.max_prompt_tokens, d.split, d.prompt_column
        )
        check_context(held_out, context, cfg.eval.max_tokens or cfg.sampling.max_tokens)
    return max(len(p.prompt_ids) for p in prompts)


def thread_count(overlapped: bool) -> int:
    """CPU BLAS threads per process. Overlapped (max_staleness > 0), the actor and the
    learner compute at the same time and share the cores; synchronous, they take turns,
    so each gets all of them while it works."""
    cores = os.cpu_count() or 2
    return max(1, cores // 2) if overlapped else cores
