"""Engine configuration: ``EngineArgs`` and the frozen config dataclasses built from it.

Argument names follow vLLM (``vllm/engine/arg_utils.py``) so that what a learner sets
here transfers to ``vllm serve`` / ``vllm.LLM``. Where defaults differ from vLLM the
field's comment says why.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from minivllm.utils import cdiv

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

    @classmethod
    def from_engine_args(cls, args: "EngineArgs", model_config: ModelConfig,
                         kv_cache_torch_dtype: torch.dtype) -> "CacheConfig":
        """Size the block pool: ``num_gpu_blocks_override``, else
        ``kv_cache_memory_bytes`` / bytes per block, else (CUDA) 80 % of
        ``gpu_memory_utilization`` x free memory, else (CPU) ``max_num_seqs`` full-length
        sequences capped at :data:`DEFAULT_CPU_KV_CACHE_BYTES`. (vLLM sizes it in the
        worker after profiling: ``Worker.determine_available_memory``.)

        Raises:
            ValueError: fewer slots than max_model_len (one full-length request could
                never run), or more bytes than the device has available now.
        """
        from minivllm.worker.model_runner import kv_cache_bytes_per_block

        a, mc = args, model_config
        per_block = kv_cache_bytes_per_block(mc, a.block_size, kv_cache_torch_dtype,
                                             a.kv_scale_type == "dynamic")
        if a.num_gpu_blocks_override is not None:
            num_blocks = a.num_gpu_blocks_override
        elif a.kv_cache_memory_bytes is not None:
            num_blocks = a.kv_cache_memory_bytes // per_block
        elif str(a.device).startswith("cuda"):
            free, _ = torch.cuda.mem_get_info()
            num_blocks = int(free * a.gpu_memory_utilization * 0.8) // per_block
        else:
            # Enough for max_num_seqs full-length sequences, capped at the CPU default.
            wanted = a.max_num_seqs * cdiv(mc.max_model_len, a.block_size)
            num_blocks = min(wanted, DEFAULT_CPU_KV_CACHE_BYTES // per_block)
        if num_blocks * a.block_size < mc.max_model_len:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks x {a.block_size} tokens = "
                f"{num_blocks * a.block_size} tokens, fewer than max_model_len="
                f"{mc.max_model_len}, so one full-length request could never run. Give "
                f"more blocks (num_gpu_blocks_override / kv_cache_memory_bytes) or lower "
                f"max_model_len (needs >= {cdiv(mc.max_model_len, a.block_size)} blocks, "
                f"{per_block} bytes each).")
        total = num_blocks * per_block
        available = available_memory_bytes(a.device)
        if available is not None and total > available:
            raise ValueError(
                f"The KV cache would take {num_blocks} blocks x {per_block} bytes = "
                f"{total / 2**30:.2f} GiB, but only {available / 2**30:.2f} GiB of "
                f"{'GPU' if a.device.startswith('cuda') else 'CPU'} memory is available. Lower "
                f"num_gpu_blocks_override / kv_cache_memory_bytes / block_size "
                f"(block_size={a.block_size}).")
        k_scale, v_scale = a.kv_scale or (1.0, 1.0)
        return cls(block_size=a.block_size, num_gpu_blocks=num_blocks,
                   kv_cache_torch_dtype=kv_cache_torch_dtype, kv_cache_dtype=a.kv_cache_dtype,
                   k_scale=k_scale, v_scale=v_scale, kv_scale_type=a.kv_scale_type,
                   kv_scale_granularity=a.kv_scale_granularity,
                   enable_prefix_caching=a.enable_prefix_caching)


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

    @classmethod
    def from_engine_args(cls, args: "EngineArgs", max_model_len: int) -> "SchedulerConfig":
        """``max_num_batched_tokens`` defaults to 8192 with chunked prefill, else
        ``max(8192, max_model_len)``.

        Raises:
            ValueError: without chunked prefill, a budget below max_model_len.
        """
        budget = args.max_num_batched_tokens
        if budget is None:
            budget = 8192 if args.enable_chunked_prefill else max(8192, max_model_len)
        if not args.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len "
                f"({max_model_len}); without chunked prefill a whole prompt must fit in one "
                "step. Raise max_num_batched_tokens, lower max_model_len, or "
                "enable_chunked_prefill=True.")
        return cls(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                   max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill)


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
    there), "quantization" and "dtype" (draft_model only).

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
    if quant is not None:
        from minivllm.quantization import parse_quantization

        parse_quantization(quant, None)
    return SpeculativeConfig("draft_model", k, model=model, quantization=quant, dtype=dtype)


@dataclass(frozen=True)
class VllmConfig:
    """Every config the engine is built from, made once by
    :meth:`EngineArgs.create_engine_config` (vLLM: ``VllmConfig``, ``vllm/config/vllm.py``).

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


@dataclass
class EngineArgs:
    """All engine arguments, with vLLM's names.

    ``LLM(**kwargs)`` and the CLI both build one of these. Validation of values that do
    not need the model happens in :meth:`validate`; the rest when the engine starts.
    """

    model: str = "smollm2-135m-instruct"
    tokenizer: Optional[str] = None
    # auto = vLLM's rule (config.resolve_auto_dtype): the checkpoint's dtype, except that
    # float32 checkpoints (the embedded model is one) run in bfloat16 (float16 on GPUs
    # without bf16). Pass dtype="float32" to keep float32.
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto = same as dtype
    block_size: int = 16
    num_gpu_blocks_override: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9  # CUDA only: fraction of free memory for KV
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None  # None: 8192, or max_model_len w/o chunking
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True  # vLLM v1 default
    enable_chunked_prefill: bool = True  # vLLM v1 default
    # KV-cache scales (fp8/int8 caches; see minivllm/quantization/kv_cache.py).
    calculate_kv_scales: bool = False  # calibrate static scales on the bundled corpus
    kv_scale: Optional[tuple[float, float]] = None  # given static (k_scale, v_scale)
    kv_scale_type: str = "static"  # or "dynamic": per token and KV head, at write time
    # static calibrated scales per "tensor", per "head", or "channel": K per (head, channel)
    # [num_kv_heads, head_dim] and V per tensor (KIVI-style; beyond vLLM, TORCH backend)
    kv_scale_granularity: str = "tensor"
    # Weight quantization (minivllm/quantization/): a method name and its options.
    quantization: Optional[str] = None
    quantization_config: Optional[dict] = None
    # "highest": plain float32 matmuls; "high": TF32 (real on CUDA, emulated on CPU).
    float32_matmul_precision: str = "highest"
    seed: int = 0
    device: str = "cpu"
    # CUDA only: capture decode steps in CUDA graphs (sizes 1, 2, 4, 8, 16, ... up to
    # min(max_num_seqs, 256)), needs the TRITON backend; True runs every step eagerly.
    enforce_eager: bool = False
    # "TORCH" (reference) or "TRITON" (kernels/); None: TORCH on CPU, TRITON on CUDA.
    attention_backend: Optional[str] = None
    # "auto": read the checkpoint; "dummy": random weights, only config.json is read
    # (vLLM's name; for benchmarks of model shapes one does not have).
    load_format: str = "auto"
    # True: no tokenizer is loaded; prompts must be token ids and outputs carry no text.
    skip_tokenizer_init: bool = False
    # The LM head's compute dtype. None: the model dtype, as vLLM does (its
    # LogitsProcessor multiplies in the model dtype and casts the logits to float32).
    # "float32": the final hidden states and an fp32 copy of the LM-head weight (the
    # tied embedding for SmolLM2; the embedding lookup stays in the model dtype) are cast
    # to float32 before the matmul. NOT a vLLM flag: it mirrors the mitigation of vllm
    # #18352 (vLLM vs HF logprobs differ by up to ~0.32 in bf16) adopted by
    # allenai/open-instruct PR #1387 and PrimeIntellect-ai/prime-rl PR #2438 (an fp32
    # lm_head with its own fp32 weight copy). Costs one fp32 copy of the weight
    # (vocab x hidden x 4 bytes: 113 MB for SmolLM2), kept only when set.
    lm_head_dtype: Optional[str] = None
    # Batch-invariant mode (course chapter 5): a request's logits do not depend on what
    # else is in the batch (bitwise), at some speed cost. vLLM has it as the environment
    # variable ``VLLM_BATCH_INVARIANT=1`` (docs: features/batch_invariance; tracker
    # vllm #27433, first PR #24583), after Thinking Machines' "Defeating Nondeterminism
    # in LLM Inference" (2025-09-10): at temperature 0 the same prompt gave 80 distinct
    # completions out of 1000 because matmul, RMSNorm and attention kernels pick their
    # reduction order from the batch shape. Here it is an EngineArgs field; the same
    # environment variable set to 1 also turns it on (see :func:`batch_invariant_enabled`).
    # What it changes (``ModelRunner(batch_invariant=True)``): CPU: decode attention
    # runs per sequence over its own keys (no padding to the group's longest sequence),
    # every linear layer and the LM head run one row at a time; CUDA: linears, LM head
    # and RMSNorm through ``kernels/batch_invariant.py`` (fixed tiles, no split-K) and
    # the TRITON paged attention (fixed split size). Unlike vLLM's mode it does not also
    # make prefill and decode of the same token agree, or change the sampler.
    batch_invariant: bool = False
    # vLLM's hf_overrides: fields that replace the checkpoint's config.json before the
    # model is built (a dict, e.g. {"rope_theta": 10000.0, "rope_scaling": {"rope_type":
    # "linear", "factor": 2.0}, "max_position_embeddings": 4096}), or a callable that
    # takes the config dict and returns it (vLLM's gets a PretrainedConfig).
    # Applied by minivllm.models.loader.apply_hf_overrides (course chapter 11).
    hf_overrides: Optional[Union[dict, Callable[[dict], dict]]] = None
    # Speculative decoding (course chapter 21), vLLM's dict: {"method": "ngram" |
    # "draft_model", "num_speculative_tokens": k, "prompt_lookup_max": ...,
    # "prompt_lookup_min": ..., "model": ...}; see :class:`SpeculativeConfig`.
    speculative_config: Optional[dict] = None
    # NOT a vLLM option (course chapter 24): on CPU, decode steps replay emulated CUDA
    # graphs (minivllm/worker/cuda_graph.py: EmulatedCUDAGraphRunner): the same capture
    # sizes, static buffers and padded rows as the CUDA runner, and a replay that re-runs
    # the ops recorded at capture, so a hook or patch added later is not seen unless the
    # runner steps aside (can_run, suspended()). No speed-up; each capture size costs one
    # forward at capture, with keys padded to max_model_len (keep both small). Needs
    # device="cpu", the TORCH backend and enforce_eager=False.
    emulate_cuda_graphs: bool = False
    # vLLM's generation_config: where default sampling parameters come from. "auto" (vLLM's
    # default since v0.8): the model folder's generation_config.json, as transformers
    # reads it (only fields that differ from transformers' defaults); "vllm": none, the
    # SamplingParams defaults; or a folder holding a generation_config.json. Only
    # GENERATION_CONFIG_FIELDS are used. They fill what a request leaves unset: LLM.generate
    # without sampling_params (LLM.get_default_sampling_params) and OpenAI requests without
    # temperature/top_p/... (course chapters 20, 29: lm-evaluation-harness #3154).
    generation_config: str = "auto"
    # vLLM's override_generation_config: fields applied over the generation config, e.g.
    # {"temperature": 0.5}; with generation_config="vllm" they are the only defaults.
    override_generation_config: Optional[dict] = None
    # vLLM's logprobs_mode: see LOGPROBS_MODES.
    logprobs_mode: str = "raw_logprobs"
    # vLLM's tensor_parallel_size: the model's heads, MLP units and vocabulary split over
    # this many ranks, one process each (minivllm/parallel/multiproc_executor.py; course
    # chapter 25). Attention heads (and intermediate size) must be divisible by it, and KV
    # heads divide or be divided by it (SmolLM2-135M: 1 or 3). CPU, gloo, float weights.
    tensor_parallel_size: int = 1
    # vLLM's distributed_executor_backend: None (default: "mp" when tensor_parallel_size
    # > 1, else "uni"), "mp" (worker processes) or "uni" (this process; tp = 1 only).
    distributed_executor_backend: Optional[str] = None

    def validate(self) -> None:
        """Check arguments that can be checked without the model.

        Raises:
            ValueError: naming the argument, the value and what is allowed.
        """
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string (an alias or a local folder), "
                             f"got {self.model!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"tokenizer must be None or a non-empty string (a local folder), "
                             f"got {self.tokenizer!r}")
        if not isinstance(self.dtype, (str, torch.dtype)) or (
                isinstance(self.dtype, str) and self.dtype.lower() not in _DTYPE_ALIASES):
            raise ValueError(f"Unknown dtype {self.dtype!r}; allowed: {', '.join(ALLOWED_DTYPES)}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(
                f"Unsupported kv_cache_dtype {self.kv_cache_dtype!r}; "
                f"allowed: {', '.join(ALLOWED_KV_CACHE_DTYPES)}"
            )
        _positive_int("block_size", self.block_size)
        _positive_int("max_num_seqs", self.max_num_seqs)
        for name in ("num_gpu_blocks_override", "kv_cache_memory_bytes",
                     "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(name, value)
        if not _is_real(self.gpu_memory_utilization) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be a number in (0, 1], "
                f"got {self.gpu_memory_utilization!r}"
            )
        if not isinstance(self.device, str) or not (
                self.device in ("cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ValueError(f"Unknown device {self.device!r}; allowed: cpu, cuda, cuda:N")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "calculate_kv_scales",
                     "enforce_eager", "skip_tokenizer_init", "batch_invariant"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if self.hf_overrides is not None and not callable(self.hf_overrides) and not (
                isinstance(self.hf_overrides, dict)
                and all(isinstance(k, str) for k in self.hf_overrides)):
            raise ValueError(f"hf_overrides must be None, a dict of config fields or a "
                             f"callable, got {self.hf_overrides!r}")
        if not isinstance(self.emulate_cuda_graphs, bool):
            raise ValueError(f"emulate_cuda_graphs must be True or False, "
                             f"got {self.emulate_cuda_graphs!r}")
        if self.emulate_cuda_graphs and (self.device != "cpu" or self.enforce_eager):
            raise ValueError("emulate_cuda_graphs=True emulates CUDA graphs on the CPU: it needs "
                             f"device='cpu' and enforce_eager=False (got device={self.device!r}, "
                             f"enforce_eager={self.enforce_eager!r}); on CUDA the engine "
                             "captures real graphs")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                             f"generation_config.json, got {self.generation_config!r}")
        if self.override_generation_config is not None and not (
                isinstance(self.override_generation_config, dict)
                and all(isinstance(k, str) for k in self.override_generation_config)):
            raise ValueError(f"override_generation_config must be None or a dict of "
                             f"generation-config fields, got {self.override_generation_config!r}")
        check_logprobs_mode(self.logprobs_mode)
        self._validate_kv_scales()
        self._validate_quantization()
        self._validate_parallel()
        parse_speculative_config(self.speculative_config)
        if self.lm_head_dtype is not None and (not isinstance(self.lm_head_dtype, str)
                                               or self.lm_head_dtype not in LM_HEAD_DTYPES):
            raise ValueError(f"lm_head_dtype must be None (the model dtype, as vLLM) or "
                             f"'float32' (an fp32 LM head), got {self.lm_head_dtype!r}")
        if self.float32_matmul_precision not in ("highest", "high"):
            raise ValueError(f"float32_matmul_precision must be 'highest' or 'high' (TF32), "
                             f"got {self.float32_matmul_precision!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) \
                or not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        from minivllm.attention.backends import resolve_attention_backend

        resolve_attention_backend(self.attention_backend, self.device)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.load_format == "dummy" and self.quantization is not None:
            raise ValueError("load_format='dummy' (random weights) cannot be combined with "
                             "quantization: there are no real weights to quantize")

    def _validate_kv_scales(self) -> None:
        quantized = self.kv_cache_dtype.startswith("fp8") or self.kv_cache_dtype == "int8"
        if self.kv_scale_type not in ("static", "dynamic"):
            raise ValueError(f"kv_scale_type must be 'static' or 'dynamic', "
                             f"got {self.kv_scale_type!r}")
        if self.kv_scale_granularity not in ("tensor", "head", "channel"):
            raise ValueError(f"kv_scale_granularity must be 'tensor', 'head' or 'channel', "
                             f"got {self.kv_scale_granularity!r}")
        if self.kv_scale is not None:
            tiny, big = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
            if (not isinstance(self.kv_scale, (tuple, list)) or len(self.kv_scale) != 2
                    or not all(_is_real(s) and math.isfinite(s) and tiny <= s <= big
                               for s in self.kv_scale)):
                raise ValueError(f"kv_scale must be two finite positive floats (k_scale, v_scale) "
                                 f"within float32's normal range [{tiny:.3g}, {big:.3g}] (the "
                                 f"scales are stored in float32), got {self.kv_scale!r}")
            k_scale, v_scale = (float(s) for s in self.kv_scale)  # two: checked above
            self.kv_scale = (k_scale, v_scale)
            if self.calculate_kv_scales is True or self.kv_scale_type == "dynamic":
                raise ValueError("kv_scale gives fixed scales; it cannot be combined with "
                                 "calculate_kv_scales=True or kv_scale_type='dynamic'")
            if self.kv_scale_granularity != "tensor":
                raise ValueError("kv_scale gives one (k_scale, v_scale) pair per tensor; "
                                 "per-head and per-channel scales come from "
                                 "calculate_kv_scales=True")
        changed = (self.kv_scale is not None or self.calculate_kv_scales is True
                   or self.kv_scale_type != "static" or self.kv_scale_granularity != "tensor")
        if changed and not quantized:
            raise ValueError(
                f"KV scales (kv_scale, calculate_kv_scales, kv_scale_type, "
                f"kv_scale_granularity) apply to a quantized KV cache, but kv_cache_dtype="
                f"{self.kv_cache_dtype!r}; use kv_cache_dtype 'fp8_e4m3', 'fp8_e5m2' or "
                "'int8', or drop them")
        if self.calculate_kv_scales is True and self.kv_scale_type == "dynamic":
            raise ValueError("calculate_kv_scales=True calibrates static scales; "
                             "kv_scale_type='dynamic' computes them per token; pick one")
        if (self.kv_scale_granularity == "channel" and self.attention_backend is not None
                and self.attention_backend != "TORCH"):
            raise ValueError("kv_scale_granularity='channel' runs on the TORCH attention "
                             "backend only (the TRITON kernels take [] or [num_kv_heads] "
                             f"scales); got attention_backend={self.attention_backend!r}")
        if (self.kv_scale_granularity in ("head", "channel")
                and self.calculate_kv_scales is not True):
            raise ValueError(f"kv_scale_granularity={self.kv_scale_granularity!r} needs "
                             "calculate_kv_scales=True "
                             "(per-head scales come from calibration)")
        if (self.kv_cache_dtype == "int8" and self.kv_scale_type == "static"
                and self.kv_scale is None and self.calculate_kv_scales is not True):
            raise ValueError(
                "kv_cache_dtype='int8' needs scales (a scale of 1.0 would round K and V to "
                "integers): set calculate_kv_scales=True, kv_scale=(k_scale, v_scale), or "
                "kv_scale_type='dynamic'")

    def _validate_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        backend = self.distributed_executor_backend
        if backend not in (None, "mp", "uni"):
            raise ValueError(f"distributed_executor_backend must be None, 'mp' or 'uni', got "
                             f"{backend!r} (vLLM's 'ray' and 'external_launcher' are not "
                             "implemented here)")
        if tp == 1:
            return
        if backend == "uni":
            raise ValueError(f"distributed_executor_backend='uni' runs one process; "
                             f"tensor_parallel_size={tp} needs 'mp' (or None)")
        refused = {
            "device": (not self.device.startswith("cpu"),
                       f"{self.device!r}: tensor parallelism runs on CPU (gloo) only here"),
            "quantization": (self.quantization is not None,
                             "quantized weights are not sharded; drop quantization="),
            "speculative_config": (self.speculative_config is not None,
                                   "speculative decoding with tensor parallelism is not "
                                   "implemented"),
            "emulate_cuda_graphs": (self.emulate_cuda_graphs is True,
                                    "the emulated graph replays rank 0's ops only"),
            "calculate_kv_scales": (self.calculate_kv_scales is True,
                                    "calibration would set rank 0's scales only"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"tensor_parallel_size={tp} cannot be combined with "
                                 f"{name}: {why}")

    def _validate_quantization(self) -> None:
        from minivllm.quantization import parse_quantization

        if self.quantization_config is not None and not isinstance(self.quantization_config, dict):
            raise ValueError(f"quantization_config must be a dict of options, "
                             f"got {self.quantization_config!r}")
        parse_quantization(self.quantization, self.quantization_config)

    def replace(self, **changes) -> "EngineArgs":
        return dataclasses.replace(self, **changes)

    def create_engine_config(self) -> VllmConfig:
        """Validate, read the model's config.json and build every config (vLLM:
        ``EngineArgs.create_engine_config``). Loads the tokenizer (cached; its
        ``eos_token_id`` joins the model's) unless ``skip_tokenizer_init``; loads no weights.

        Raises:
            ValueError: an invalid argument (:meth:`validate`), a CUDA device that is not
                there, an unknown model, max_model_len above the model's positions, a
                tensor_parallel_size the model's heads do not divide, a generation config
                SamplingParams refuses, a KV cache too small for one max_model_len
                sequence, or speculative decoding whose k + 1 exceeds
                max_num_batched_tokens.
        """
        from minivllm.attention.backends import resolve_attention_backend
        from minivllm.models.loader import (checkpoint_dtype, derived_max_model_len,
                                            load_hf_config, resolve_model_path)
        from minivllm.quantization import checkpoint as qckpt
        from minivllm.quantization import parse_quantization
        from minivllm.sampling_params import SamplingParams
        from minivllm.tokenizer import get_tokenizer

        self.validate()
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ValueError(f"device={self.device!r} was requested but "
                                 "torch.cuda.is_available() is False; use device='cpu'")
            index = int(self.device.partition(":")[2] or 0)
            if index >= torch.cuda.device_count():
                raise ValueError(f"device={self.device!r}: there are only "
                                 f"{torch.cuda.device_count()} CUDA device(s)")
        path = resolve_model_path(self.model)
        cfg = load_hf_config(path, self.hf_overrides)
        if self.tensor_parallel_size > 1:
            from minivllm.parallel.emulated_tp import check_tensor_parallel_size

            check_tensor_parallel_size(cfg, self.tensor_parallel_size)
        dtype = parse_dtype(self.dtype, checkpoint_dtype(cfg), self.device,
                            model_type=cfg.get("model_type"))
        kv_dtype = parse_kv_cache_dtype(self.kv_cache_dtype, dtype)
        max_pos = derived_max_model_len(cfg)  # max_position_embeddings, x rope scaling
        max_model_len = self.max_model_len or max_pos
        if max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.get('max_position_embeddings', 2048)}"
                             + (f" (x rope_scaling: {max_pos})" if max_pos !=
                                cfg.get("max_position_embeddings", 2048) else ""))
        tokenizer = None if self.skip_tokenizer_init \
            else get_tokenizer(self.tokenizer or str(path))
        model_config = ModelConfig.from_hf_config(
            self.model, str(path), cfg, dtype, max_model_len,
            None if tokenizer is None else tokenizer.eos_token_id)
        # vLLM's generation_config: the defaults a request's unset fields take (checked
        # here by building a SamplingParams from them, so a bad value fails at start)
        defaults = default_sampling_params(self.generation_config, str(path),
                                           self.override_generation_config)
        if defaults:
            try:
                SamplingParams(**defaults)
            except (TypeError, ValueError) as e:
                raise ValueError(f"generation_config / override_generation_config give "
                                 f"{defaults}, which SamplingParams refuses: {e}") from None
            logger.info("Default sampling parameters from the generation config: %s (use "
                        "generation_config='vllm' for SamplingParams' own defaults)", defaults)
        cache_config = CacheConfig.from_engine_args(self, model_config, kv_dtype)
        scheduler_config = SchedulerConfig.from_engine_args(self, max_model_len)
        spec = parse_speculative_config(self.speculative_config)
        if spec is not None and spec.num_speculative_tokens + 1 > \
                scheduler_config.max_num_batched_tokens:
            k = spec.num_speculative_tokens
            raise ValueError(f"speculative_config num_speculative_tokens={k}: a verification "
                             f"schedules k + 1 = {k + 1} tokens, more than "
                             f"max_num_batched_tokens={scheduler_config.max_num_batched_tokens}")
        return VllmConfig(
            model_config=model_config, cache_config=cache_config,
            scheduler_config=scheduler_config, speculative_config=spec,
            quant_config=parse_quantization(self.quantization, self.quantization_config),
            saved_quant_config=qckpt.saved_quant_config(cfg), hf_config=cfg,
            attention_backend=resolve_attention_backend(self.attention_backend, self.device),
            default_sampling_params=defaults)


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


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def batch_invariant_enabled(args: "EngineArgs") -> bool:
    """``args.batch_invariant``, or the environment variable ``VLLM_BATCH_INVARIANT``
    set to ``1`` (vLLM's switch for the same mode; ``0`` or unset: off).

    Raises:
        ValueError: the variable set to anything but ``0`` or ``1``.
    """
    import os

    env = os.environ.get(BATCH_INVARIANT_ENV)
    if env is not None and env.strip() not in ("", "0", "1"):
        raise ValueError(f"{BATCH_INVARIANT_ENV}={env!r}: allowed values are 0 and 1")
    return bool(args.batch_invariant) or (env is not None and env.strip() == "1")


def _is_real(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
