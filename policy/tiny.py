"""Build the tiny default model: a character-level Llama that mlx-lm loads like any other.

It exists so that the default run, the tests and CI need no download. The build is
deterministic (fixed seed, fixed vocabulary), and its output is committed under
`examples/tiny-model/` so that nobody has to run this file; it stays here so that anyone
can see how the model was made and rebuild it: `python -m policy.tiny examples/tiny-model`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

SPECIAL_TOKENS = ["<pad>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz .,:;?!+-=*/()'\n")
EOS = "<|end|>"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

MODEL_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}

# With tied embeddings, the logit of the current input token is boosted by |e|^2: at
# std 0.15 the untrained model mildly prefers to repeat its last token (a weak copier),
# yet its samples stay diverse. Far smaller embeddings cannot express a preference at all
# (LoRA cannot move the frozen embeddings), far larger ones collapse into repetition.
EMBED_STD = 0.15


def _write_tokenizer(out: Path, chars: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    # A BPE model without merges is a character tokenizer that still loads as a fast tokenizer.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": "<pad>",
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS, "pad_token": "<pad>"}, indent=2) + "\n"
    )


def save_model(out_dir: str | Path, model, config: dict, chars: list[str] = CHARS) -> Path:
    """An mlx-lm model directory: `model`'s weights, `config` as config.json, and a
    character tokenizer of the special tokens and `chars` (by default the tiny one's). Tests
    and benchmarks save models of other shapes with it too: ids beyond the tokenizer's
    decode to nothing, and every id still costs its logit."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(out, chars)
    return out


def build_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, weights and tokenizer of the tiny model into `out_dir`."""
    from mlx_lm.models import llama

    vocab_size = len(SPECIAL_TOKENS) + len(CHARS)
    config = dict(MODEL_CONFIG, vocab_size=vocab_size, eos_token_id=SPECIAL_TOKENS.index(EOS))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    embed = model.model.embed_tokens
    embed.weight = EMBED_STD * mx.random.normal(embed.weight.shape)
    return save_model(out_dir, model, config)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m policy.tiny OUT_DIR")
    print(build_tiny_model(sys.argv[1]))
