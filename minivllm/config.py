"""Engine configuration: ``EngineArgs`` and the frozen config dataclasses built from it.

Argument names follow vLLM (``vllm/engine/arg_utils.py``) so that what a learner sets
here transfers to ``vllm serve`` / ``vllm.LLM``. Where defaults differ from vLLM the
field's comment says why.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Optional

import torch

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
}
ALLOWED_KV_CACHE_DTYPES = tuple(_KV_CACHE_DTYPES)

# Default KV-cache size on CPU when neither num_gpu_blocks_override nor
# kv_cache_memory_bytes is given (vLLM's CPU backend uses VLLM_CPU_KVCACHE_SPACE,
# default 4 GiB; we cap lower so tests on a 24 GB box can run side by side).
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


def parse_dtype(name: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """Resolve a ``dtype`` argument to a torch dtype.

    Args:
        name: one of :data:`ALLOWED_DTYPES` or a torch floating dtype.
        model_dtype: the checkpoint's dtype, used for ``"auto"``.
    Raises:
        ValueError: unknown name; the message lists the allowed values.
    """
    if isinstance(name, torch.dtype):
        if name not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype {name} is not supported; allowed: {ALLOWED_DTYPES}")
        return name
    if name not in _DTYPE_ALIASES:
        raise ValueError(f"Unknown dtype {name!r}; allowed: {', '.join(ALLOWED_DTYPES)}")
    resolved = _DTYPE_ALIASES[name]
    return model_dtype if resolved is None else resolved


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
    """What the engine knows about the model after loading its config.json."""

    model: str  # the name or path the user gave
    path: str  # resolved local HF folder
    dtype: torch.dtype  # compute / weight dtype
    max_model_len: int  # prompt + output tokens per sequence
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV-cache geometry. ``num_blocks * block_size`` token slots per layer."""

    block_size: int
    num_blocks: int
    cache_dtype: torch.dtype  # storage dtype of K and V
    kv_cache_dtype: str  # the name the user gave ("auto", "fp8_e4m3", ...)
    k_scale: float = 1.0  # per-tensor fp8 scales (stored = value / scale)
    v_scale: float = 1.0
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits (vLLM: ``vllm/config/scheduler.py``)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool


@dataclass
class EngineArgs:
    """All engine arguments, with vLLM's names.

    ``LLM(**kwargs)`` and the CLI both build one of these. Validation of values that do
    not need the model happens in :meth:`validate`; the rest when the engine starts.
    """

    model: str = "smollm2-135m-instruct"
    tokenizer: Optional[str] = None
    dtype: str = "auto"  # auto = the checkpoint's dtype (float32 for the embedded model)
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
    calculate_kv_scales: bool = False  # reserved; fp8 scales are 1.0 unless given
    kv_scale: Optional[tuple[float, float]] = None  # (k_scale, v_scale) for fp8 KV
    seed: int = 0
    device: str = "cpu"
    enforce_eager: bool = True  # CUDA graphs come in a later issue
    attention_backend: str = "torch"

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
                self.dtype not in _DTYPE_ALIASES and not isinstance(self.dtype, torch.dtype)):
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
        if self.kv_scale is not None:
            if (not isinstance(self.kv_scale, (tuple, list)) or len(self.kv_scale) != 2
                    or not all(_is_real(s) and math.isfinite(s) and s > 0 for s in self.kv_scale)):
                raise ValueError(f"kv_scale must be two finite positive floats (k_scale, v_scale), "
                                 f"got {self.kv_scale!r}")
            if not str(self.kv_cache_dtype).startswith("fp8"):
                raise ValueError(
                    f"kv_scale is only used by an fp8 KV cache, but kv_cache_dtype="
                    f"{self.kv_cache_dtype!r}; use kv_cache_dtype='fp8_e4m3' (or 'fp8_e5m2') "
                    "or drop kv_scale")
        if self.calculate_kv_scales is True:
            raise ValueError("calculate_kv_scales=True is not supported yet (fp8 scales are 1.0 "
                             "or the values given in kv_scale); leave it False")
        if not isinstance(self.device, str) or not (
                self.device in ("cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ValueError(f"Unknown device {self.device!r}; allowed: cpu, cuda, cuda:N")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "calculate_kv_scales",
                     "enforce_eager"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) \
                or not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        from minivllm.attention.backends import BACKENDS

        if self.attention_backend not in BACKENDS:
            raise ValueError(f"Unknown attention_backend {self.attention_backend!r}; "
                             f"allowed: {', '.join(BACKENDS)}")

    def replace(self, **changes) -> "EngineArgs":
        return dataclasses.replace(self, **changes)


def _is_real(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
