"""Save and load quantized checkpoints.

Format (version 1), an HF-style folder:

* ``config.json``: the model's config plus ::

      "quantization_config": {"quant_method": "minivllm", "format_version": 1,
                              "method": "gptq", "options": {"group_size": 128, ...}}

  (``options`` holds ``ignore`` when layers were left unquantized; those layers are
  stored as float weights under their fused names, ``...qkv_proj.weight``. A method
  registered with ``register_quantization_method`` must be registered again, under the
  same name, before such a folder loads.)

* ``model.safetensors``:

  - float tensors under their HF names (``model.embed_tokens.weight``,
    ``model.norm.weight``, ``model.layers.N.input_layernorm.weight``, ...), in the
    dtype the engine ran in;
  - each quantized decoder linear under its *fused* name
    ``model.layers.N.{self_attn.qkv_proj, self_attn.o_proj, mlp.gate_up_proj,
    mlp.down_proj}.<tensor>`` where qkv_proj stacks the rows of q, k, v and gate_up_proj
    those of gate, up (as vLLM fuses them), and ``<tensor>`` is:

    ========== ==================================================================
    qweight    int8 [out, in] (int8); uint8 [out, in/2] packed nibbles, even column
               in the low nibble (int4/awq/gptq); float8_e4m3fn [out, in] (fp8)
    weight_scale float32 [] or [out, 1] (int8, fp8): w = qweight * weight_scale
    scales     float32 [out, in/group_size] (int4/awq/gptq)
    zeros      uint8 [out, in/group_size]: w = (q - zeros) * scales per group
    awq_scale  float32 [in] (awq): the layer computes (x / awq_scale) @ w^T
    input_scale float32 [] (fp8 static): x is quantized as x / input_scale
    ========== ==================================================================

* the tokenizer files and chat template copied from the source folder.

Cached checkpoints (:func:`cached_quantized`): a calibrated checkpoint (AWQ, GPTQ, fp8
static) takes a minute or more to build on a CPU, so chapters and labs ask for it by
method and options and get a folder built once under ``$MINIVLLM_CACHE/quantized``,
keyed by a sha256 of the source weights, the options, the calibration token ids and the
quantizer's code, and hash-checked on every use. ``python -m
minivllm.quantization.checkpoint awq '{"group_size": 64}'`` (or ``make quantized``)
builds one ahead.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from minivllm.quantization import QuantConfig, parse_quantization
from minivllm.utils import cdiv, save_safetensors

FORMAT_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt",
                    "tokenizer.model")


def saved_quant_config(cfg: dict) -> Optional[QuantConfig]:
    """The QuantConfig of a folder saved by :func:`save_quantized`, or None.

    Raises:
        ValueError: a quantization_config from another tool (GPTQ/AWQ checkpoints made
            by AutoGPTQ/AutoAWQ use other layouts) or an unknown format version.
    """
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != "minivllm":
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ValueError(f"This checkpoint is quantized with quant_method={method!r}; minivllm "
                         "loads float checkpoints (and quantizes them with quantization=...) "
                         "or its own saved format (quant_method='minivllm').")
    version = qc.get("format_version")
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise ValueError(f"Unsupported minivllm quantized format_version "
                         f"{qc.get('format_version')!r} (this version reads {FORMAT_VERSION})")
    options = qc.get("options", {})
    if not isinstance(qc.get("method"), str) or not isinstance(options, dict):
        raise ValueError(f"quantization_config of a minivllm checkpoint needs 'method' (a "
                         f"string) and 'options' (an object); got {qc!r}")
    return parse_quantization(qc["method"], options)


def save_quantized(engine, path: str | Path) -> Path:
    """Write the engine's quantized model to ``path`` (created; must not hold a config).

    Args:
        engine: an LLMEngine (``llm.llm_engine``) built with ``quantization=...``.
    Raises:
        ValueError: the engine is not quantized; ``path`` is empty, a file, or a folder
            that is not empty.
    """
    from minivllm.layers.linear import QuantLinear

    quant = engine.quant_config
    if quant is None:
        raise ValueError("save_quantized needs an engine built with quantization=...")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"save_quantized needs a folder path, got {path!r}")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; save_quantized writes a folder")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} already holds files (e.g. a model's config.json); pick a new "
                         "or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    src = Path(engine.model_config.path)
    model = engine.model_runner.model
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            for t_name, t in module.stored_tensors().items():
                tensors[f"model.{name}.{t_name}"] = t.detach().cpu().contiguous()
    for name, p in model.named_parameters():  # float weights, norms, biases
        hf = name if name == "lm_head.weight" else f"model.{name}"
        tensors[hf] = p.detach().cpu().contiguous()
    save_safetensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    float_dtype = next(p.dtype for p in model.parameters())  # the engine's dtype
    cfg["torch_dtype"] = str(float_dtype).removeprefix("torch.")
    cfg.pop("dtype", None)
    cfg["quantization_config"] = {"quant_method": "minivllm", "format_version": FORMAT_VERSION,
                                  "method": quant.method, "options": quant.options()}
    (out / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    for f in _TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, out / f)
    return out


def load_quantized_weights(model, path: Path, quant: QuantConfig) -> None:
    """Fill ``model`` (float, on CPU) from a folder written by :func:`save_quantized`.

    Raises:
        ValueError: a missing or unexpected tensor, or a shape mismatch.
    """
    from safetensors import safe_open

    from minivllm.layers.linear import QuantLinear, make_method
    from minivllm.quantization.quantize import _replace, ignored_layers, target_layers

    file = Path(path) / "model.safetensors"
    try:
        with safe_open(str(file), framework="pt") as st:
            stored = {name: st.get_tensor(name) for name in st.keys()}
    except Exception as e:  # missing, truncated or not safetensors
        raise ValueError(f"cannot read {file}: {type(e).__name__}: {e}") from None
    method = make_method(quant)
    skip = ignored_layers(model, quant.ignore)  # saved as float weights, loaded below
    for name, lin in target_layers(model).items():
        if name in skip:
            continue
        prefix = f"model.{name}."
        tensors = {k[len(prefix):]: stored.pop(k) for k in list(stored) if k.startswith(prefix)}
        bias = tensors.pop("bias", None)
        try:
            method.check_tensors(tensors, lin.out_features, lin.in_features)
        except ValueError as e:
            raise ValueError(f"{file}: {name}: {e}") from None
        _replace(model, name, QuantLinear(method, tensors, lin.in_features, lin.out_features,
                                          bias))
    params = dict(model.named_parameters())
    for hf_name, t in stored.items():
        name = hf_name.removeprefix("model.")
        if name not in params:
            raise ValueError(f"{file}: unexpected tensor {hf_name!r}")
        if tuple(params[name].shape) != tuple(t.shape) or not t.is_floating_point():
            raise ValueError(f"{file}: {hf_name!r} is {t.dtype} of shape {tuple(t.shape)}, "
                             f"expected a float tensor of shape {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(t)
        params.pop(name)
    missing = [n for n in params if not n.endswith(".bias")]
    if missing:
        raise ValueError(f"{file} is missing {len(missing)} tensors, e.g. {missing[:3]}")


# --- quantized checkpoints built once and cached ------------------------------------------

CACHE_FORMAT = 1
MANIFEST = "minivllm-cache.json"
# The code that decides which numbers a quantized checkpoint holds: the algorithms, the
# calibration passes, the linear methods' storage and the model the calibration runs
# through. A change to any of these files makes every cached checkpoint stale (a
# conservative stand-in for "the quantizer's version": it also rebuilds on edits that
# change nothing). Option parsing is covered by the key's config part, the folder format
# by FORMAT_VERSION and the load-time checks.
_QUANTIZER_SOURCES = ("quantization/weight_quant.py", "quantization/quantize.py",
                      "quantization/calibration.py", "layers/linear.py", "models/llama.py")


class QuantizedCacheError(ValueError):
    """A cached quantized checkpoint failed its hash check (tampered, truncated, or a
    build that did not finish). The message names the file and the way out."""


def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _sha256_json(obj) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"))
                          .encode("utf-8")).hexdigest()


def _source_digest(src: Path, memo_file: Path) -> str:
    """sha256 over the source folder's config.json and weight files (names and contents).

    Hashing 540 MB takes about a second, so each file's digest is remembered in
    ``memo_file`` under its path, size and mtime; a file whose size or mtime changed is
    hashed again.
    """
    files = sorted([src / "config.json", *src.glob("*.safetensors")])
    try:
        memo = json.loads(memo_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        memo = {}
    digests, changed = {}, False
    for f in files:
        st = f.stat()
        key = f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        if memo.get(key) is None:
            memo[key] = _sha256_file(f)
            changed = True
        digests[f.name] = memo[key]
    if changed:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=1), encoding="utf-8")
        os.replace(tmp, memo_file)
    return _sha256_json(digests)


def _code_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    return _sha256_json({rel: _sha256_file(root / rel) for rel in _QUANTIZER_SOURCES})


def cache_key(model: str, quantization: str, quantization_config: Optional[dict] = None,
              cache_root: str | Path | None = None) -> dict:
    """What a cached checkpoint of ``model`` quantized with ``quantization`` depends on.

    Returns:
        ``{"key": sha256, "parts": {"source": ..., "config": ..., "calibration": ...,
        "code": ...}, "label": ..., "config": {...}, "source_path": ...}``: the source
        weights and config.json, the method with every option (defaults filled in), the
        calibration token ids the build calibrates on (empty for methods without
        calibration), and the quantizer's source files (:data:`_QUANTIZER_SOURCES`).
    Raises:
        ValueError: an unknown model, method or option (as ``LLM`` raises).
    """
    from minivllm.models.embedded import cache_dir
    from minivllm.models.loader import resolve_model_path

    quant = parse_quantization(quantization, quantization_config)
    if quant is None:
        raise ValueError("cached_quantized needs a quantization method, e.g. 'awq'")
    root = Path(cache_root) if cache_root is not None else cache_dir() / "quantized"
    src = resolve_model_path(model)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if saved_quant_config(cfg) is not None:
        raise ValueError(f"{src} is already a quantized checkpoint; cache a float model")
    config = {"method": quant.method, "options": quant.options()}
    build_len = min(_BUILD_MAX_MODEL_LEN, int(cfg.get("max_position_embeddings", 2048)))
    calibration: list = []
    if quant.needs_calibration:
        from minivllm.quantization.calibration import calibration_sequences
        from minivllm.tokenizer import get_tokenizer

        calibration = calibration_sequences(get_tokenizer(str(src)), quant.calibration,
                                            quant.calibration_tokens, build_len)
    parts = {"source": _source_digest(src, root / "source-digests.json"),
             "config": _sha256_json(config), "calibration": _sha256_json(calibration),
             "code": _code_digest()}
    return {"key": _sha256_json(parts), "parts": parts, "label": quant.label(),
            "config": config, "source_path": str(src), "root": str(root),
            "build_max_model_len": build_len}


# calibration windows of up to 1024 tokens (the engine's limit), or the model's length
_BUILD_MAX_MODEL_LEN = 1024


def _check_files(folder: Path, manifest: dict) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise QuantizedCacheError(f"{folder / MANIFEST} lists no files")
    for name, want in files.items():
        f = folder / name
        if not f.is_file():
            raise QuantizedCacheError(
                f"cached quantized checkpoint {folder} is corrupt: {name} is missing. Delete "
                f"the folder or call cached_quantized(..., rebuild=True) to build it again.")
        got = _sha256_file(f)
        if got != want:
            raise QuantizedCacheError(
                f"cached quantized checkpoint {folder} is corrupt: {name} has sha256 "
                f"{got[:16]}..., its manifest says {want[:16]}... (changed after the build: "
                f"tampered or truncated). Delete the folder or call cached_quantized(..., "
                f"rebuild=True) to build it again.")


def cached_quantized(model: str = "smollm2-135m-instruct", quantization: str = "awq",
                     quantization_config: Optional[dict] = None, *,
                     cache_root: str | Path | None = None, rebuild: bool = False,
                     verbose: bool = True) -> Path:
    """A quantized checkpoint of ``model``, built once with :func:`save_quantized` and
    cached; returns the folder, which ``LLM(path)`` loads without quantizing again.

    Where: ``<cache_root>/<model folder name>/<label>-<config hash>/`` (default root
    ``$MINIVLLM_CACHE/quantized``, beside the converted embedded model). Each folder holds
    the checkpoint and ``minivllm-cache.json``: the key (:func:`cache_key`: source weights,
    method and options, calibration token ids, quantizer code), how long the build took,
    and the sha256 of every file.

    On each call: no folder, or a folder whose key is not the current one (stale: the
    source weights, calibration data or quantizer code changed), or ``rebuild=True``:
    (re)build it, printing what it builds and why. Otherwise every file is hashed and
    compared with the manifest (about 0.3 s for a 170 MB checkpoint) before the path is
    returned. The build runs under a file lock, so processes asking at once build once.

    The build is ``LLM(model, dtype="float32", max_model_len=n, quantization=...,
    quantization_config=...)`` with ``n = min(1024, max_position_embeddings)``, so the
    checkpoint is bit for bit what an engine quantizing in place with that max_model_len
    holds. Calibrated methods cut their calibration text into windows of
    ``min(1024, max_model_len)`` tokens, so an in-place engine with a smaller
    max_model_len calibrates on shorter windows and gets a (slightly) different model.

    Args:
        model: an alias or a float HF folder (what ``LLM(model)`` takes).
        quantization, quantization_config: as for ``LLM`` (``ignore`` included).
        cache_root: another cache folder (tests).
        rebuild: build again even when the cache is valid (or corrupt).
        verbose: print a line when building and the engine's progress bar.
    Raises:
        QuantizedCacheError: a file of a cached checkpoint does not match its manifest
            (tampered or truncated), or the manifest is unreadable; the message names the
            file and says how to rebuild.
        ValueError: unknown model, method or option.
    """
    import sys
    import tempfile
    import time

    from filelock import FileLock

    info = cache_key(model, quantization, quantization_config, cache_root)
    src = Path(info["source_path"])
    root = Path(info["root"])
    folder = root / src.name / f"{info['label']}-{info['parts']['config'][:12]}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        reason = "rebuild=True" if rebuild else None
        if reason is None and not folder.exists():
            reason = "not built yet"
        if reason is None:
            try:
                manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
                old = manifest["parts"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise QuantizedCacheError(
                    f"cached quantized checkpoint {folder} is corrupt: its manifest {MANIFEST} "
                    f"cannot be read ({type(e).__name__}). Delete the folder or call "
                    "cached_quantized(..., rebuild=True) to build it again.") from None
            if manifest.get("key") != info["key"]:
                changed = [k for k in info["parts"] if old.get(k) != info["parts"][k]]
                reason = f"stale ({', '.join(changed) or 'key'} changed)"
        if reason is None:
            _check_files(folder, manifest)
            return folder
        if verbose:
            print(f"minivllm: building the {info['label']} checkpoint of {src.name} once "
                  f"({reason}); the full embedded model takes about a minute on 2 cores. "
                  f"Cache: {folder}", file=sys.stderr, flush=True)
        from minivllm import LLM

        t0 = time.perf_counter()
        n = info["build_max_model_len"]
        llm = LLM(str(src), dtype="float32", max_model_len=n,
                  num_gpu_blocks_override=cdiv(n, 16) + 1, quantization=quantization,
                  quantization_config=quantization_config)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".build-") as tmp:
            out = llm.save_quantized(Path(tmp) / "ckpt")
            del llm
            seconds = time.perf_counter() - t0
            files = {f.name: _sha256_file(f) for f in sorted(out.iterdir()) if f.is_file()}
            manifest = {"cache_format": CACHE_FORMAT, "key": info["key"], "parts": info["parts"],
                        "label": info["label"], "config": info["config"],
                        "source": info["source_path"], "build_seconds": round(seconds, 1),
                        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "files": files}
            (out / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(out, folder)
        if verbose:
            print(f"minivllm: built {info['label']} in {seconds:.1f} s", file=sys.stderr,
                  flush=True)
        return folder


def _main(argv=None) -> None:
    """``python -m minivllm.quantization.checkpoint awq '{"group_size": 64}'``: build (or
    check) a cached checkpoint and print its folder."""
    import argparse

    ap = argparse.ArgumentParser(description=_main.__doc__)
    ap.add_argument("quantization")
    ap.add_argument("config", nargs="?", default="{}", help="quantization_config as JSON")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args(argv)
    print(cached_quantized(args.model, args.quantization, json.loads(args.config),
                           rebuild=args.rebuild))


if __name__ == "__main__":
    _main()
