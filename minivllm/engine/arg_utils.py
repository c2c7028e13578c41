"""``EngineArgs``: every engine argument under vLLM's name, validated, and turned into the
frozen configs of :mod:`minivllm.config` by :meth:`EngineArgs.create_engine_config`
(vLLM: ``vllm/engine/arg_utils.py``).

Argument names follow vLLM so that what a learner sets here transfers to ``vllm serve`` /
``vllm.LLM``. Where a default differs from vLLM, the field's comment says why. This
module sits in the engine layer: it may look up the attention backends, the quantization
registry and the model loader, which the configs below it may not.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from minivllm.config import (_DTYPE_ALIASES, _KV_CACHE_DTYPES, ALLOWED_DTYPES,
                             ALLOWED_KV_CACHE_DTYPES, DEFAULT_CPU_KV_CACHE_BYTES,
                             LM_HEAD_DTYPES, CacheConfig, ModelConfig, SchedulerConfig,
                             VllmConfig, _is_real, _positive_int, available_memory_bytes,
                             check_logprobs_mode, default_sampling_params, parse_dtype,
                             parse_kv_cache_dtype, parse_speculative_config)
from minivllm.utils import cdiv

logger = logging.getLogger("minivllm")


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
    # "TORCH" (reference) or "TRITON" (minivllm_kernels/); None: TORCH on CPU, TRITON on CUDA.
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
    # and RMSNorm through ``minivllm_kernels/batch_invariant.py`` (fixed tiles, no split-K) and
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
        spec = parse_speculative_config(self.speculative_config)
        if spec is not None and spec.quantization is not None:  # the draft model's method
            from minivllm.quantization import parse_quantization

            parse_quantization(spec.quantization, None)
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

        if resolve_attention_backend(self.attention_backend, self.device) == "TRITON":
            from minivllm_kernels import _triton

            on_cuda = str(self.device).startswith("cuda")
            # (CUDA asked for on a machine without it: create_engine_config says so)
            if on_cuda and _triton.INTERPRET and torch.cuda.is_available():
                raise ValueError(
                    f"attention_backend='TRITON' on device={self.device!r} needs compiled "
                    "kernels, but TRITON_INTERPRET=1 is set in this process (the interpreter "
                    "runs kernels on CPU tensors). Unset it before importing minivllm, or use "
                    "device='cpu' or attention_backend='TORCH'.")
            if not on_cuda and not _triton.INTERPRET:
                raise ValueError(
                    f"attention_backend='TRITON' on device={self.device!r} needs Triton's "
                    "interpreter, and this process compiles the kernels for a GPU "
                    "(TRITON_INTERPRET is not 1). Use device='cuda', or "
                    "attention_backend='TORCH', or set TRITON_INTERPRET=1 before importing "
                    "minivllm.")
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
        cache_config = self._create_cache_config(model_config, kv_dtype)
        scheduler_config = self._create_scheduler_config(max_model_len)
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

    def _create_cache_config(self, model_config: ModelConfig,
                             kv_cache_torch_dtype: torch.dtype) -> CacheConfig:
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

        a, mc = self, model_config
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
        return CacheConfig(block_size=a.block_size, num_gpu_blocks=num_blocks,
                           kv_cache_torch_dtype=kv_cache_torch_dtype, kv_cache_dtype=a.kv_cache_dtype,
                   k_scale=k_scale, v_scale=v_scale, kv_scale_type=a.kv_scale_type,
                   kv_scale_granularity=a.kv_scale_granularity,
                   enable_prefix_caching=a.enable_prefix_caching)

    def _create_scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """``max_num_batched_tokens`` defaults to 8192 with chunked prefill, else
        ``max(8192, max_model_len)``.

        Raises:
            ValueError: without chunked prefill, a budget below max_model_len.
        """
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 8192 if self.enable_chunked_prefill else max(8192, max_model_len)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len "
                f"({max_model_len}); without chunked prefill a whole prompt must fit in one "
                "step. Raise max_num_batched_tokens, lower max_model_len, or "
                "enable_chunked_prefill=True.")
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget,
                   max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill)


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def kv_cache_budget_bytes(total_memory_bytes: int, gpu_memory_utilization: float,
                          non_kv_cache_bytes: int) -> int:
    """The bytes vLLM gives the KV cache on one GPU: the share of the device it may use,
    less everything that is not KV cache (vLLM v1 ``Worker.determine_available_memory``,
    ``vllm/v1/worker/gpu_worker.py``: ``requested_memory - non_kv_cache_memory``, with
    ``requested_memory = ceil(total_memory x gpu_memory_utilization)`` from
    ``request_memory`` in ``vllm/v1/worker/utils.py``).

    The KV pool is what is *left*, so every point of ``gpu_memory_utilization`` moves
    ``total_memory_bytes / 100`` bytes in or out of the pool: lowering it never makes
    room for the cache, it takes room from it. (This engine sizes its CUDA pool more
    simply, from free memory: :meth:`EngineArgs._create_cache_config`.)

    Args:
        total_memory_bytes: the device's memory, bytes (> 0).
        gpu_memory_utilization: the fraction of it vLLM may use, in (0, 1].
        non_kv_cache_bytes: weights + the activation peak of the profiling run + memory
            outside PyTorch (vLLM logs each at startup), bytes (>= 0).

    Returns:
        ceil(total x utilization) - non_kv_cache_bytes, bytes (> 0).

    Raises:
        ValueError: an argument out of range, or nothing left for the cache (vLLM: "No
            available memory for the cache blocks").
    """
    _positive_int("total_memory_bytes", total_memory_bytes)
    if not _is_real(gpu_memory_utilization) or not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], "
                         f"got {gpu_memory_utilization!r}")
    if not isinstance(non_kv_cache_bytes, int) or isinstance(non_kv_cache_bytes, bool) \
            or non_kv_cache_bytes < 0:
        raise ValueError(f"non_kv_cache_bytes must be an int >= 0, got {non_kv_cache_bytes!r}")
    budget = math.ceil(total_memory_bytes * gpu_memory_utilization) - non_kv_cache_bytes
    if budget <= 0:
        raise ValueError(
            f"No available memory for the cache blocks: {gpu_memory_utilization} x "
            f"{total_memory_bytes} bytes leaves {budget} bytes after {non_kv_cache_bytes} "
            f"bytes of weights and activations. Increase gpu_memory_utilization (at most 1) "
            f"or give the model more devices.")
    return budget


def batch_invariant_enabled(args: "EngineArgs") -> bool:
    """``args.batch_invariant``, or the environment variable ``VLLM_BATCH_INVARIANT``
    set to ``1`` (vLLM's switch for the same mode; ``0`` or unset: off).

    Raises:
        ValueError: the variable set to anything but ``0`` or ``1``.
    """
    env = os.environ.get(BATCH_INVARIANT_ENV)
    if env is not None and env.strip() not in ("", "0", "1"):
        raise ValueError(f"{BATCH_INVARIANT_ENV}={env!r}: allowed values are 0 and 1")
    return bool(args.batch_invariant) or (env is not None and env.strip() == "1")
