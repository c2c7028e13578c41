"""Find and load a model: the embedded alias, a local HF folder, or (where a hub is
reachable) a hub id. Returns our own ``LlamaForCausalLM`` with the weights in the
requested dtype.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Optional, cast

import torch

from minivllm.layers.rotary_embedding import normalize_rope_scaling
from minivllm.models import embedded

ALIASES = {embedded.ALIAS: embedded.ensure_embedded_model}
SUPPORTED_MODEL_TYPES = ("llama",)
_REQUIRED_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


def resolve_model_path(model: str) -> Path:
    """Map a model argument to a local HF folder.

    Accepts: an alias (``smollm2-135m-instruct``), a folder with config.json, or a hub
    id ``org/name`` (downloaded with huggingface_hub where a hub is reachable).
    Raises:
        ValueError: unknown alias or path; the message lists the aliases.
    """
    if model in ALIASES:
        return ALIASES[model]()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"Model folder {model!r} has no config.json")
        return path
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if looks_like_hub_id:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, allow_patterns=[
                "*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]))
        except Exception as e:  # offline, not found, ...
            raise ValueError(
                f"Unknown model {model!r}: not a local folder, and the hub download failed "
                f"({type(e).__name__}). Known aliases: {', '.join(ALIASES)}; or pass a "
                "local HF folder with config.json and *.safetensors.") from None
    raise ValueError(
        f"Unknown model {model!r}: not a known alias and not a local folder. Known aliases: "
        f"{', '.join(ALIASES)}; or pass a local HF folder with config.json and *.safetensors.")


def apply_hf_overrides(cfg: dict, hf_overrides, source: str = "config.json") -> dict:
    """vLLM's ``hf_overrides`` (``ModelConfig.hf_overrides``): a dict whose keys replace
    the config's top-level fields (as ``PretrainedConfig.update`` does: a nested dict such
    as ``rope_scaling`` is replaced whole, not merged), or a callable that takes the config
    and returns it. vLLM's callable gets a ``PretrainedConfig``; here the config is the
    config.json dict, so the callable gets a copy of that dict and must return a dict.

    Raises:
        ValueError: overrides that are neither None, a dict with string keys, nor a
            callable; a callable that does not return a dict.
    """
    if hf_overrides is None:
        return cfg
    if callable(hf_overrides):
        out = hf_overrides(copy.deepcopy(cfg))
        if not isinstance(out, dict):
            raise ValueError(f"hf_overrides: the callable must return the config dict, got "
                             f"{type(out).__name__}")
        return out
    if not isinstance(hf_overrides, dict) or not all(isinstance(k, str) for k in hf_overrides):
        raise ValueError(f"hf_overrides must be a dict of config fields or a callable, got "
                         f"{hf_overrides!r}")
    out = dict(cfg)
    out.update(copy.deepcopy(hf_overrides))
    return out


def derived_max_model_len(cfg: dict) -> int:
    """The longest sequence the config allows, as vLLM derives it
    (``_get_and_verify_max_len`` in ``vllm/config/model.py``): ``max_position_embeddings``
    (2048 if absent), times ``factor`` for rope scaling types linear and dynamic; for yarn
    ``original_max_position_embeddings * factor``; llama3 configs already give the
    extended length in ``max_position_embeddings``, so it is kept."""
    length = int(cfg.get("max_position_embeddings", 2048))
    scaling = cfg.get("rope_scaling")
    if scaling is not None and scaling["rope_type"] in ("linear", "dynamic", "yarn"):
        if scaling["rope_type"] == "yarn":
            length = scaling["original_max_position_embeddings"]
        length = int(length * scaling["factor"])
    return length


def load_hf_config(path: Path, hf_overrides=None) -> dict:
    """Read config.json, apply ``hf_overrides`` (:func:`apply_hf_overrides`) and normalise
    the fields the model needs.

    ``rope_theta`` is taken from the top level or from transformers 5's
    ``rope_parameters``; ``rope_scaling`` likewise (None when the type is default; else
    normalized by :func:`~minivllm.layers.rotary_embedding.normalize_rope_scaling`).
    Raises:
        ValueError: an unreadable or non-object config.json, bad ``hf_overrides``, a
            missing/invalid size field, an unsupported architecture, rope_scaling type or
            field, or hidden_act (found here, before the tokenizer or the weights are
            loaded).
    """
    config_file = Path(path) / "config.json"
    try:
        cfg = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"Could not read {config_file}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(cfg).__name__}")
    cfg = apply_hf_overrides(cfg, hf_overrides)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"Unsupported model_type {model_type!r} in {path}; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    for key in _REQUIRED_INT_KEYS:
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{config_file}: {key!r} must be a positive integer, got {value!r}")
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = cfg.get(key)
        if value is None:
            cfg.pop(key, None)  # absent or null: the default applies
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{config_file}: {key!r} must be a positive integer or absent, "
                             f"got {value!r}")
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{config_file}: 'rope_parameters' must be an object, got {rope!r}")
    if "rope_theta" not in cfg:
        cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    if isinstance(cfg["rope_theta"], bool) or not isinstance(cfg["rope_theta"], (int, float)) \
            or not 0 < cfg["rope_theta"] < float("inf"):
        raise ValueError(f"{config_file}: 'rope_theta' must be a positive number, "
                         f"got {cfg['rope_theta']!r}")
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"{config_file}: 'rope_scaling' must be an object or null, got {scaling!r}")
    try:
        cfg["rope_scaling"] = normalize_rope_scaling(scaling, cfg.get("max_position_embeddings",
                                                                      2048))
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} in {config_file} is not supported (supported: silu)")
    return cfg


def checkpoint_dtype(cfg: dict) -> torch.dtype:
    """The dtype the checkpoint declares (``torch_dtype``/``dtype``), float32 if none."""
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return _DTYPES.get(str(name).replace("torch.", ""), torch.float32)


def iter_checkpoint(path: Path):
    """Yield (name, tensor) from *.safetensors (or pytorch_model*.bin) in a folder.

    Raises:
        ValueError: no weight files found.
    """
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if files:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        return
    bins = sorted(Path(path).glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"No *.safetensors or pytorch_model*.bin weights in {path}")
    for f in bins:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


def load_model(path: Path, cfg: dict, dtype: torch.dtype, max_position: int,
               device: str = "cpu", attention_backend: str = "TORCH", quant=None,
               calibration_ids: Optional[list[list[int]]] = None,
               float32_matmul_precision: str = "highest", load_format: str = "auto",
               seed: int = 0):
    """Build our LlamaForCausalLM, load weights, quantize, cast to ``dtype``, move to
    ``device``.

    Quantization (``quant``, a :class:`~minivllm.quantization.QuantConfig`) works on the
    checkpoint's weights in float32, before the cast, so a bfloat16 engine quantizes the
    same numbers a float32 one does. A folder saved by
    :func:`minivllm.quantization.checkpoint.save_quantized` loads its stored quantized
    tensors instead (``quant`` must then be None or the same method).

    ``load_format="dummy"`` reads no weights: every parameter is drawn from
    U(-1e-3, 1e-3) (vLLM's ``DummyModelLoader``), directly on ``device`` in ``dtype``;
    for benchmarks of a model shape (e.g. Llama-3-8B) without its checkpoint.
    """
    from minivllm.layers.linear import QuantLinear
    from minivllm.layers.rotary_embedding import RotaryEmbedding, get_rope
    from minivllm.models.llama import LlamaAttention, LlamaForCausalLM
    from minivllm.quantization import checkpoint as qckpt
    from minivllm.quantization.quantize import quantize_model, set_float32_matmul_precision

    saved_quant = qckpt.saved_quant_config(cfg)
    if saved_quant is not None and quant is not None and quant != saved_quant:
        raise ValueError(f"{path} holds a checkpoint quantized with {saved_quant.label()}; "
                         f"quantization={quant.method!r} with other options cannot re-quantize "
                         "it. Drop quantization= (or load the float model).")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_position=1, backend=attention_backend)
    if load_format == "dummy":
        return _dummy_model(model, cfg, dtype, max_position, device, seed,
                            float32_matmul_precision)
    model = model.to_empty(device="cpu")
    # One rotary table shared by all layers, float32 (cast to the activation dtype at use,
    # as HF does).
    attns = [cast(LlamaAttention, layer.self_attn) for layer in model.layers]
    rope = get_rope(attns[0].head_dim, max_position, cfg["rope_theta"],
                    cfg.get("rope_scaling"), cfg.get("max_position_embeddings"))
    for attn in attns:
        attn.rotary_emb = rope
    if saved_quant is not None:
        qckpt.load_quantized_weights(model, path, saved_quant)
    else:
        model.load_weights(iter_checkpoint(path))
        if quant is not None:
            quantize_model(model, quant, calibration_ids)
    for module in model.modules():  # cast float weights; quantized storage keeps its dtypes
        if isinstance(module, RotaryEmbedding):
            continue
        stored = module.tensor_names if isinstance(module, QuantLinear) else ()
        for name, t in list(module.named_parameters(recurse=False)) + \
                list(module.named_buffers(recurse=False)):
            if t.is_floating_point() and name not in stored:
                t.data = t.data.to(dtype)
    model = model.to(device).eval()
    set_float32_matmul_precision(model, float32_matmul_precision, device)
    _maybe_use_kernels(model, attention_backend, device)
    return model


def _maybe_use_kernels(model, attention_backend: str, device: str) -> None:
    """With the TRITON backend on CUDA, RMSNorm and rotary run as Triton kernels too (on
    CPU they would run in the interpreter: only attention does, for learning)."""
    if attention_backend == "TRITON" and str(device).startswith("cuda"):
        model.use_triton_kernels()


def _dummy_model(model, cfg: dict, dtype: torch.dtype, max_position: int, device: str,
                 seed: int, float32_matmul_precision: str):
    """Random U(-1e-3, 1e-3) weights, made on the device (see ``load_model``)."""
    from minivllm.layers.rotary_embedding import get_rope
    from minivllm.quantization.quantize import set_float32_matmul_precision

    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1e-3, 1e-3, generator=gen)
    head_dim = model.layers[0].self_attn.head_dim
    rope = get_rope(head_dim, max_position, cfg["rope_theta"], cfg.get("rope_scaling"),
                    cfg.get("max_position_embeddings")).to(device)
    for layer in model.layers:
        layer.self_attn.rotary_emb = rope
    model = model.eval()
    set_float32_matmul_precision(model, float32_matmul_precision, device)
    _maybe_use_kernels(model, model.layers[0].self_attn.backend.name, device)
    return model
