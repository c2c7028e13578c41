"""Engine configuration: the frozen config dataclasses the engine is built from
(vLLM: ``vllm/config/``), and the dtype rules they apply.

``EngineArgs`` (the user's arguments, vLLM: ``vllm/engine/arg_utils.py``) lives in
:mod:`minivllm.engine.arg_utils` and builds these with ``create_engine_config()``; this
module imports nothing above the base layer.
"""

from __future__ import annotations

import logging
import numbers
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch


if TYPE_CHECKING:
    from minivllm.quantization import QuantConfig

logger = logging.getLogger("minivllm")

# dtype names accepted for ``dtype`` (vLLM accepts the same spellings).
_DTYPE_ALIASES: dict[str, Optional[torch.dtype]] = {
    "auto": None,
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
ALLOWED_DTYPES = tuple(_DTYPE_ALIASES)

# kv_cache_dtype names. "fp8" is vLLM's alias for fp8_e4m3.
_KV_CACHE_DTYPES: dict[str, Optional[torch.dtype]] = {
    "auto": None,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
ALLOWED_KV_CACHE_DTYPES = tuple(_KV_CACHE_DTYPES)

# lm_head_dtype values besides None (the model dtype): see EngineArgs.lm_head_dtype.
LM_HEAD_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32}

# EngineArgs.logprobs_mode values (vLLM's LogprobsMode, vllm/config/model.py): what the
# ``logprobs`` and ``prompt_logprobs`` of an output hold. "raw": from the model's logits
# before anything the sampler does; "processed": after min_tokens, penalties and (for
# sampled rows) temperature, min_p, top_k and top_p, the distribution the token was drawn
# from (tokens those removed have -inf). Prompt positions are never processed, so the
# processed modes return the raw values there.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def check_logprobs_mode(mode) -> None:
    """Raises ValueError unless ``mode`` is one of :data:`LOGPROBS_MODES`."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                         f"got {mode!r}")


# The sampling fields a model's generation_config.json may set as defaults, as vLLM reads
# them (ModelConfig.get_diff_sampling_param); max_new_tokens becomes max_tokens.
GENERATION_CONFIG_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                            "max_new_tokens")

# Default KV-cache size on CPU when neither num_gpu_blocks_override nor
# kv_cache_memory_bytes is given (vLLM's CPU backend uses VLLM_CPU_KVCACHE_SPACE,
# default 4 GiB; we cap lower so tests on a 24 GB box can run side by side).
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


def supported_dtypes(device: str) -> list[torch.dtype]:
    """Compute dtypes a device supports, preferred first (vLLM's
    ``current_platform.supported_dtypes``: ``vllm/platforms/cpu.py`` and ``cuda.py``).

    x86/aarch64 CPUs: bfloat16, float16, float32. CUDA: the same on compute capability
    >= 8.0 (Ampere and later); float16, float32 before (no bfloat16 tensor cores).
    """
    if str(device).startswith("cuda"):
        index = int(str(device).partition(":")[2] or 0)
        major, _ = torch.cuda.get_device_capability(index)
        if major < 8:
            return [torch.float16, torch.float32]
    return [torch.bfloat16, torch.float16, torch.float32]


# vLLM's ``_FLOAT16_NOT_SUPPORTED_MODELS`` (``vllm/config/model.py``): model types whose
# activations overflow float16 (transformers #36822 for Gemma 3). vLLM leaves float16 out
# of ``dtype="auto"``'s choices for them and rejects an explicit float16.
FLOAT16_NOT_SUPPORTED_MODELS: dict[str, str] = {
    name: "Numerical instability. Please use bfloat16 or float32 instead."
    for name in ("gemma2", "gemma3", "gemma3_text", "plamo2", "glm4")
}


def resolve_auto_dtype(config_dtype: torch.dtype, supported: list[torch.dtype],
                       model_type: Optional[str] = None) -> torch.dtype:
    """vLLM's rule for ``dtype="auto"`` (``vllm/config/model.py``, ``_resolve_auto_dtype``;
    the rule of vLLM PR #18751, 2025-05, read at commit 18ec662 of vLLM's main branch).

    0. float16 is dropped from ``supported`` for the model types of
       :data:`FLOAT16_NOT_SUPPORTED_MODELS`.
    1. A float32 checkpoint is *downcast* to the device's preferred dtype
       (``supported[0]``: bfloat16 on CPUs and Ampere+ GPUs, float16 on older GPUs).
       This is the quiet default that serves fp32 checkpoints in 16 bits. (Before PR
       #18751 vLLM downcast float32 to float16 everywhere, "following common practice":
       the rule of INCIDENTS #14, olmo-cookbook #60.)
    2. A float16/bfloat16 checkpoint keeps its dtype if the device supports it.
    3. Otherwise (a bfloat16 checkpoint on a pre-Ampere GPU) the preferred dtype is used
       and a warning is logged.

    vLLM also prefers float16 for pooling (embedding) models; this engine has none.

    Args:
        config_dtype: the checkpoint's ``torch_dtype`` (float32 when absent).
        supported: :func:`supported_dtypes` of the target device, preferred first.
        model_type: config.json's ``model_type`` (None: no exclusions).
    Raises:
        ValueError: no dtype left to choose from.
    """
    allowed = [d for d in supported
               if not (d == torch.float16 and model_type in FLOAT16_NOT_SUPPORTED_MODELS)]
    if not allowed:
        raise ValueError(f"dtype='auto': none of the supported dtypes {list(supported)} can "
                         f"run model type {model_type!r} (float16 is excluded for it)")
    preferred = allowed[0]
    if config_dtype == torch.float32:
        return preferred
    if config_dtype in allowed:
        return config_dtype
    if config_dtype in supported:  # supported by the device, excluded for the model type
        logger.warning("Model type %r does not support %s; dtype='auto' falls back to %s",
                       model_type, config_dtype, preferred)
    else:
        logger.warning("The device does not support %s; dtype='auto' falls back to %s "
                       "for compatibility", config_dtype, preferred)
    return preferred


def log_dtype_cast(config_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """Log a cast of the checkpoint's weights as vLLM's ``_get_and_verify_dtype`` does:
    upcasting to float32 and downcasting from float32 at INFO, a cast between float16 and
    bfloat16 at WARNING ("Casting torch.bfloat16 to torch.float16."): the two 16-bit
    formats trade range for precision, so such a cast can overflow (bf16 -> fp16, max
    65504) or lose digits (fp16 -> bf16)."""
    if dtype == config_dtype:
        return
    if dtype == torch.float32:
        logger.info("Upcasting %s to %s.", config_dtype, dtype)
    elif config_dtype == torch.float32:
        logger.info("Downcasting %s to %s.", config_dtype, dtype)
    else:
        logger.warning("Casting %s to %s.", config_dtype, dtype)


def parse_dtype(name: str | torch.dtype, model_dtype: torch.dtype,
                device: str = "cpu", model_type: Optional[str] = None,
                supported: Optional[list[torch.dtype]] = None) -> torch.dtype:
    """Resolve a ``dtype`` argument to a torch dtype (vLLM's ``_get_and_verify_dtype``).

    Args:
        name: one of :data:`ALLOWED_DTYPES` (any case, as vLLM lowercases it) or
            ``torch.float32``/``float16``/``bfloat16``.
        model_dtype: the checkpoint's dtype, used for ``"auto"`` (see
            :func:`resolve_auto_dtype`) and for the cast message (:func:`log_dtype_cast`).
        device: where the model runs ("cpu", "cuda", "cuda:N").
        model_type: config.json's ``model_type``; float16 is refused for the types of
            :data:`FLOAT16_NOT_SUPPORTED_MODELS`, as vLLM does.
        supported: the device's dtypes, preferred first (None: :func:`supported_dtypes`
            of ``device``). Pass ``[torch.float16, torch.float32]`` to resolve as on a
            pre-Ampere GPU (a course device; vLLM reads it from the platform).
    Raises:
        ValueError: unknown name (the message lists the allowed values), an unsupported
            torch dtype, or float16 for a model type vLLM runs only in bf16/fp32.
    """
    if isinstance(name, torch.dtype):
        if name not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype {name} is not supported; allowed: {', '.join(ALLOWED_DTYPES)} "
                             "or torch.float32/float16/bfloat16")
        resolved = name
    else:
        key = name.lower() if isinstance(name, str) else name
        if key not in _DTYPE_ALIASES:
            raise ValueError(f"Unknown dtype {name!r}; allowed: {', '.join(ALLOWED_DTYPES)}")
        alias = _DTYPE_ALIASES[key]  # None: "auto"
        resolved = alias if alias is not None else resolve_auto_dtype(
            model_dtype, supported_dtypes(device) if supported is None else supported,
            model_type)
    if resolved == torch.float16 and model_type in FLOAT16_NOT_SUPPORTED_MODELS:
        raise ValueError(f"The model type {model_type!r} does not support float16. Reason: "
                         f"{FLOAT16_NOT_SUPPORTED_MODELS[model_type]}")
    log_dtype_cast(model_dtype, resolved)
    return resolved


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Resolve a ``kv_cache_dtype`` name; ``"auto"`` means the model's compute dtype.

    Raises:
        ValueError: unknown name; the message lists the allowed values.
    """
    if name not in _KV_CACHE_DTYPES:
        raise ValueError(
            f"Unsupported kv_cache_dtype {name!r}; allowed: {', '.join(ALLOWED_KV_CACHE_DTYPES)}"
        )
    resolved = _KV_CACHE_DTYPES[name]
    return model_dtype if resolved is None else resolved


@dataclass(frozen=True)
class ModelConfig:
    """What the engine knows about the model after loading its config.json (vLLM:
    ``vllm/config/model.py``; built by :meth:`from_hf_config`)."""

    model: str  # the name or path the user gave
    path: str  # resolved local HF folder
    dtype: torch.dtype  # compute / weight dtype
    max_model_len: int  # prompt + output tokens per sequence
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, model: str, path: str, hf_config: dict, dtype: torch.dtype,
                       max_model_len: int, tokenizer_eos_token_id: Optional[int] = None
                       ) -> "ModelConfig":
        """Read the geometry from a config.json dict (``hf_config``, overrides applied).

        ``eos_token_ids``: config.json's ``eos_token_id`` (an int or a list), plus the
        tokenizer's ``eos_token_id`` when it is not among them. ``head_dim`` defaults to
        ``hidden_size // num_attention_heads``, ``num_kv_heads`` to the attention heads.
        """
        eos = hf_config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        if tokenizer_eos_token_id is not None and tokenizer_eos_token_id not in eos_ids:
            eos_ids = eos_ids + (tokenizer_eos_token_id,)
        num_heads = hf_config["num_attention_heads"]
        return cls(model=model, path=str(path), dtype=dtype, max_model_len=max_model_len,
                   vocab_size=hf_config["vocab_size"], num_layers=hf_config["num_hidden_layers"],
                   num_kv_heads=hf_config.get("num_key_value_heads", num_heads),
                   head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads,
                   eos_token_ids=eos_ids)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV-cache geometry: ``num_gpu_blocks * block_size`` token slots per layer
    (vLLM: ``vllm/config/cache.py``).

    Two names differ from vLLM's CacheConfig: the storage dtype is the torch dtype
    ``kv_cache_torch_dtype`` (vLLM's ``cache_dtype`` is the *string*, here
    ``kv_cache_dtype``), and the old names ``num_blocks`` and ``cache_dtype`` (a torch
    dtype, not vLLM's string) stay as read-only aliases for the chapters.
    """

    block_size: int
    num_gpu_blocks: int  # blocks in the pool (vLLM's name; on CPU too)
    kv_cache_torch_dtype: torch.dtype  # storage dtype of K and V
    kv_cache_dtype: str  # the name the user gave ("auto", "fp8_e4m3", ...)
    k_scale: float = 1.0  # given static per-tensor scales (stored = value / scale)
    v_scale: float = 1.0
    kv_scale_type: str = "static"  # "static" or "dynamic" (per token and head)
    kv_scale_granularity: str = "tensor"  # static scales per "tensor", "head", or K per "channel"
    enable_prefix_caching: bool = True

    @property
    def num_blocks(self) -> int:
        """Alias of ``num_gpu_blocks`` (the old name)."""
        return self.num_gpu_blocks

    @property
    def cache_dtype(self) -> torch.dtype:
        """Alias of ``kv_cache_torch_dtype`` (the old name). Not vLLM's
        ``CacheConfig.cache_dtype``, which is the string (here ``kv_cache_dtype``)."""
        return self.kv_cache_torch_dtype


def available_memory_bytes(device: str) -> Optional[int]:
    """Memory a KV cache could take now: free GPU memory, or MemAvailable on Linux;
    None when unknown (no check is made then)."""
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        return torch.cuda.mem_get_info(index)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits (vLLM: ``vllm/config/scheduler.py``)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool


SPEC_METHODS = ("ngram", "draft_model")
SPEC_CONFIG_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "model", "quantization", "dtype")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM: ``vllm/config/speculative.py``), built from
    ``EngineArgs.speculative_config`` by :func:`parse_speculative_config`.

    Attributes:
        method: "ngram" (prompt lookup: drafts copied from an earlier occurrence of the
            sequence's last n tokens) or "draft_model" (a second model proposes).
        num_speculative_tokens: k, the most draft tokens proposed per request and step;
            the target then scores k + 1 positions in one forward.
        prompt_lookup_min, prompt_lookup_max: the n-gram sizes tried, longest first
            (ngram only; vLLM's defaults: both 5 when neither is given, one copies the
            other when only one is given).
        model: the draft model (draft_model only): an alias or a local folder; it must
            have the target's vocabulary size.
        quantization: the draft's weight quantization (vLLM's key), or None.
        dtype: the draft's dtype, or None for the target's. NOT a vLLM key (vLLM's draft
            runs in the target's dtype); it lets the embedded model draft for itself in a
            cheaper dtype ("self-speculation", since there is no second model).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None
    quantization: Optional[str] = None
    dtype: Optional[str] = None


def parse_speculative_config(value) -> Optional[SpeculativeConfig]:
    """Validate ``speculative_config`` (a dict, as vLLM's ``LLM(speculative_config=...)``).

    Keys: "method" ("ngram" | "draft_model"; when left out, "draft_model" if "model" is
    given), "num_speculative_tokens" (a positive int, required), "prompt_lookup_max" and
    "prompt_lookup_min" (positive ints, ngram only), "model" (draft_model only, required
    there), "quantization" and "dtype" (draft_model only). The quantization method's
    name is checked against the registry by ``EngineArgs.validate`` (the registry sits
    above this module).

    Raises:
        ValueError: not a dict, an unknown key, a missing or bad value; the message
            says what is allowed.
    """
    if value is None:
        return None
    if isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                         f"'num_speculative_tokens': 3}}, got {type(value).__name__}: {value!r:.80}")
    unknown = sorted(str(k) for k in value if k not in SPEC_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown speculative_config key(s) {unknown}; allowed: "
                         f"{', '.join(SPEC_CONFIG_KEYS)}")
    method = value.get("method")
    if method is None and value.get("model") is not None:
        method = "draft_model"
    if method not in SPEC_METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {', '.join(SPEC_METHODS)}"
                         f", got {method!r}")
    k = value.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"speculative_config['num_speculative_tokens'] must be a positive "
                         f"integer (the draft tokens per step), got {k!r}")
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    model, quant, dtype = value.get("model"), value.get("quantization"), value.get("dtype")
    if method == "ngram":
        given = [name for name in ("model", "quantization", "dtype") if value.get(name) is not None]
        if given:
            raise ValueError(f"speculative_config {given} apply to method='draft_model'; "
                             "method='ngram' has no draft model")
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"speculative_config['{name}'] must be a positive integer "
                                 f"(an n-gram size), got {v!r}")
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        assert lo is not None and hi is not None  # set by the branches above
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min={lo} is larger than "
                             f"prompt_lookup_max={hi}")
        return SpeculativeConfig("ngram", k, lo, hi)
    if lo is not None or hi is not None:
        raise ValueError("speculative_config prompt_lookup_min/prompt_lookup_max apply to "
                         "method='ngram', not 'draft_model'")
    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config method='draft_model' needs 'model': the draft "
                         f"model (an alias or a local folder), got {model!r}")
    if dtype is not None and (not isinstance(dtype, str) or dtype.lower() not in _DTYPE_ALIASES):
        raise ValueError(f"speculative_config['dtype'] {dtype!r} is not a dtype; allowed: "
                         f"{', '.join(ALLOWED_DTYPES)} (or None: the target's dtype)")
    return SpeculativeConfig("draft_model", k, model=model, quantization=quant, dtype=dtype)


@dataclass(frozen=True)
class VllmConfig:
    """Every config the engine is built from, made once by
    :meth:`minivllm.engine.arg_utils.EngineArgs.create_engine_config` (vLLM:
    ``VllmConfig``, ``vllm/config/vllm.py``).

    Attributes:
        model_config, cache_config, scheduler_config: see those classes.
        speculative_config: None without speculative decoding.
        quant_config: the weight quantization to apply (a ``QuantConfig`` of
            :mod:`minivllm.quantization`), or None; ``saved_quant_config`` when the
            checkpoint is already quantized (then nothing is applied at load).
        saved_quant_config: the checkpoint's own quantization, or None.
        hf_config: config.json as a dict, with ``hf_overrides`` applied.
        attention_backend: the resolved backend name ("TORCH" or "TRITON").
        default_sampling_params: the generation config's defaults
            (:func:`default_sampling_params`), checked by building a SamplingParams.
    """

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    speculative_config: Optional[SpeculativeConfig]
    quant_config: Optional[QuantConfig]
    saved_quant_config: Optional[QuantConfig]
    hf_config: dict
    attention_backend: str
    default_sampling_params: dict


def default_sampling_params(generation_config: str, model_path: str,
                            overrides: Optional[dict] = None) -> dict:
    """The model's default sampling fields, as vLLM's ``ModelConfig.get_diff_sampling_param``
    (``vllm/config/model.py``): the generation config's ``GENERATION_CONFIG_FIELDS`` that
    differ from transformers' ``GenerationConfig`` defaults, then ``overrides`` on top;
    ``max_new_tokens`` is renamed ``max_tokens``. Values are checked when a SamplingParams
    is built from them.

    Args:
        generation_config: "auto" (``model_path``), "vllm" (nothing) or a folder.
        model_path: the model's local folder.
        overrides: EngineArgs.override_generation_config.
    Returns:
        {field: value}, empty when nothing is set (then SamplingParams' own defaults apply).
    Raises:
        ValueError: a folder without a readable generation_config.json.
    """
    config: dict = {}
    if generation_config != "vllm":
        folder = model_path if generation_config == "auto" else generation_config
        file = os.path.join(folder, "generation_config.json")
        if os.path.isfile(file):
            from transformers import GenerationConfig

            try:
                config = GenerationConfig.from_pretrained(folder).to_diff_dict()
            except (OSError, ValueError) as e:
                raise ValueError(f"generation_config: could not read {file}: {e}") from None
        elif generation_config != "auto":
            raise ValueError(f"generation_config={generation_config!r}: no "
                             f"generation_config.json in that folder; use 'auto' (the "
                             f"model's), 'vllm' (none) or a folder that has one")
    config.update(overrides or {})
    diff = {k: config[k] for k in GENERATION_CONFIG_FIELDS if config.get(k) is not None}
    if "max_new_tokens" in diff:
        diff["max_tokens"] = diff.pop("max_new_tokens")
    return diff


def _is_real(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
