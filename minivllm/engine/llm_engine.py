"""LLMEngine: add_request / step / abort_request (vLLM: ``vllm/v1/engine/llm_engine.py``).

One ``step()`` = schedule -> run the model on the batch -> sample -> append tokens,
check stop conditions, free finished requests' blocks -> return outputs of requests
that finished (or all updated requests when ``stream=True`` is used by a server).
"""

from __future__ import annotations

import itertools
import numbers
import operator
import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import torch

from minivllm.config import batch_invariant_enabled, default_sampling_params
from minivllm.config import (DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig, EngineArgs, ModelConfig,
                             SchedulerConfig, parse_dtype, parse_kv_cache_dtype)
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler
from minivllm.engine.request import Request, RequestStatus, ScoreState
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.quantization.kv_cache import is_quantized
from minivllm.sampling_params import SamplingParams
from minivllm.utils import check_valid_unicode
from minivllm.worker.model_runner import ModelRunner, kv_cache_bytes_per_block

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Engine counters, readable as ``llm.stats`` (vLLM metric names in comments).

    Attributes:
        num_preemptions: vllm:num_preemptions_total.
        prefix_cache_queries, prefix_cache_hits: in tokens (vllm:prefix_cache_*_total).
        num_free_blocks, num_total_blocks: block pool occupancy now.
        kv_cache_usage: fraction of blocks in use now (vllm:kv_cache_usage_perc).
        num_running, num_waiting: queue lengths now.
        num_steps, num_prompt_tokens, num_generation_tokens: totals.
        spec_decode_num_drafts, spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens: speculative decoding (vllm:spec_decode_*_total):
            verifications run, draft tokens verified, draft tokens accepted. The
            acceptance rate is accepted / draft tokens; the mean tokens per verification
            is 1 + accepted / drafts.
        num_corrupted_requests: requests whose logits, prompt log-probs or (int8 cache)
            K/V held NaN/inf (vllm:corrupted_requests); generation requests among them
            finish with finish_reason "error".
        history: per step (step, num_running, num_waiting, kv_cache_usage, num_batched_tokens).
    """

    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_corrupted_requests: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    history: list = field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def _available_memory_bytes(device: str) -> Optional[int]:
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


class LLMEngine:
    """The engine. Build with ``LLMEngine.from_engine_args(EngineArgs(...))``.

    Raises (at construction):
        ValueError: invalid arguments, unknown model, or a KV cache too small to hold
            one sequence of max_model_len tokens.
    """

    def __init__(self, args: EngineArgs):
        from minivllm.models.loader import (checkpoint_dtype, derived_max_model_len,
                                            load_hf_config, load_model, resolve_model_path)
        from minivllm.attention.backends import resolve_attention_backend
        from minivllm.tokenizer import get_tokenizer

        args.validate()
        self.args = args
        if args.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ValueError(f"device={args.device!r} was requested but "
                                 "torch.cuda.is_available() is False; use device='cpu'")
            index = int(args.device.partition(":")[2] or 0)
            if index >= torch.cuda.device_count():
                raise ValueError(f"device={args.device!r}: there are only "
                                 f"{torch.cuda.device_count()} CUDA device(s)")
        path = resolve_model_path(args.model)
        cfg = load_hf_config(path, args.hf_overrides)
        if args.tensor_parallel_size > 1:
            from minivllm.parallel.emulated_tp import check_tensor_parallel_size

            check_tensor_parallel_size(cfg, args.tensor_parallel_size)
        dtype = parse_dtype(args.dtype, checkpoint_dtype(cfg), args.device,
                            model_type=cfg.get("model_type"))
        cache_dtype = parse_kv_cache_dtype(args.kv_cache_dtype, dtype)
        max_pos = derived_max_model_len(cfg)  # max_position_embeddings, x rope scaling
        max_model_len = args.max_model_len or max_pos
        if max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.get('max_position_embeddings', 2048)}"
                             + (f" (x rope_scaling: {max_pos})" if max_pos !=
                                cfg.get("max_position_embeddings", 2048) else ""))
        self.tokenizer = None if args.skip_tokenizer_init \
            else get_tokenizer(args.tokenizer or str(path))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None \
                and self.tokenizer.eos_token_id not in eos_ids:
            eos_ids = eos_ids + (self.tokenizer.eos_token_id,)
        num_heads = cfg["num_attention_heads"]
        self.model_config = ModelConfig(
            model=args.model, path=str(path), dtype=dtype, max_model_len=max_model_len,
            vocab_size=cfg["vocab_size"], num_layers=cfg["num_hidden_layers"],
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            eos_token_ids=eos_ids)
        self.precision_monitor = None  # set_precision_monitor
        # vLLM's generation_config: the defaults a request's unset fields take (checked
        # here by building a SamplingParams from them, so a bad value fails at start)
        self.default_sampling_params = default_sampling_params(
            args.generation_config, str(path), args.override_generation_config)
        if self.default_sampling_params:
            try:
                SamplingParams(**self.default_sampling_params)
            except (TypeError, ValueError) as e:
                raise ValueError(f"generation_config / override_generation_config give "
                                 f"{self.default_sampling_params}, which SamplingParams "
                                 f"refuses: {e}") from None
            logger.info("Default sampling parameters from the generation config: %s (use "
                        "generation_config='vllm' for SamplingParams' own defaults)",
                        self.default_sampling_params)
        self.cache_config = self._make_cache_config(cache_dtype)
        self.scheduler_config = self._make_scheduler_config()
        device = args.device
        from minivllm.quantization import checkpoint as qckpt
        from minivllm.quantization import parse_quantization

        quant = parse_quantization(args.quantization, args.quantization_config)
        saved_quant = qckpt.saved_quant_config(cfg)
        calibration_ids = None
        if quant is not None and saved_quant is None and quant.needs_calibration:
            calibration_ids = self._calibration_sequences(quant.calibration,
                                                          quant.calibration_tokens)
        self.attention_backend = resolve_attention_backend(args.attention_backend, device)
        model = load_model(path, cfg, dtype, max_model_len, device, self.attention_backend,
                           quant, calibration_ids, args.float32_matmul_precision,
                           load_format=args.load_format, seed=args.seed)
        if args.lm_head_dtype is not None:
            from minivllm.config import LM_HEAD_DTYPES

            model.set_lm_head_dtype(LM_HEAD_DTYPES[args.lm_head_dtype])
        self.quant_config = saved_quant or quant
        # tensor_parallel_size > 1: worker processes hold ranks 1..tp-1; this process's
        # model becomes rank 0's shard (minivllm/parallel/multiproc_executor.py)
        self.model_executor = None
        if args.tensor_parallel_size > 1:
            self._start_tensor_parallel(model, path, cfg, dtype, max_model_len)
        self.kv_cache_manager = KVCacheManager(self.cache_config.num_blocks,
                                               self.cache_config.block_size,
                                               self.cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.model_runner = ModelRunner(
            model, self.model_config, self.cache_config, device, args.seed,
            cuda_graph_max_batch_size=None if args.enforce_eager
            else min(self.scheduler_config.max_num_seqs, 256),
            batch_invariant=batch_invariant_enabled(args),
            emulate_cuda_graphs=args.emulate_cuda_graphs, logprobs_mode=args.logprobs_mode)
        if args.calculate_kv_scales:
            self.calibrate_kv_scales()
        self.speculative_config = None
        self.proposer = None
        if args.speculative_config is not None:
            self._init_speculative(args.speculative_config)
        # The prompt-processing steps ("prompt.chat_template", "prompt.truncate" in
        # minivllm/steps.py): swappable like the numeric ones.
        from minivllm.tokenizer import render_chat_ref, truncate_prompt_ref

        self.render_chat = render_chat_ref
        self.truncate_prompt = truncate_prompt_ref
        self._counter = itertools.count()
        self._stats = EngineStats()
        self._history: deque = deque(maxlen=100_000)
        self.finished_outputs: dict[str, RequestOutput] = {}

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def _start_tensor_parallel(self, model, path, cfg, dtype, max_model_len) -> None:
        """Start the worker processes (``distributed_executor_backend="mp"``)."""
        import weakref

        from minivllm.config import LM_HEAD_DTYPES
        from minivllm.parallel.multiproc_executor import (MultiprocExecutor, WorkerSpec,
                                                          worker_threads)

        args, tp = self.args, self.args.tensor_parallel_size
        spec = WorkerSpec(
            load_args=(path, cfg, dtype, max_model_len, args.device, self.attention_backend),
            load_kwargs={"float32_matmul_precision": args.float32_matmul_precision,
                         "load_format": args.load_format, "seed": args.seed},
            model_config=self.model_config, cache_config=self.cache_config,
            device=args.device, seed=args.seed, batch_invariant=batch_invariant_enabled(args),
            logprobs_mode=args.logprobs_mode,
            lm_head_dtype=None if args.lm_head_dtype is None
            else LM_HEAD_DTYPES[args.lm_head_dtype],
            num_threads=worker_threads(tp))
        self.model_executor = MultiprocExecutor(model, spec, tp)
        weakref.finalize(self, self.model_executor.shutdown)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do with tp = 1). The
        engine cannot run afterwards. Also done when the engine is garbage-collected."""
        if self.model_executor is not None:
            self.model_executor.shutdown()

    def collective_rpc(self, fn, args: tuple = ()):
        """Run ``fn(model, *args)`` on every rank's model (tp = 1: this one); returns
        rank 0's result (vLLM: ``LLM.collective_rpc``). ``fn``: a module-level function."""
        if self.model_executor is None:
            return fn(self.model_runner.model, *args)
        return self.model_executor.collective_rpc(fn, args)

    # --- speculative decoding ----------------------------------------------------------
    def _init_speculative(self, value) -> None:
        """Build the proposer of ``speculative_config`` (chapter 21).

        Raises:
            ValueError: a draft model that cannot serve this target (vocabulary, length),
                or k + 1 larger than max_num_batched_tokens (a verification must fit in
                one step).
        """
        from minivllm.config import parse_speculative_config
        from minivllm.spec_decode.draft_model import DraftModelProposer
        from minivllm.spec_decode.ngram_proposer import NgramProposer

        spec = parse_speculative_config(value)
        k = spec.num_speculative_tokens
        if k + 1 > self.scheduler_config.max_num_batched_tokens:
            raise ValueError(f"speculative_config num_speculative_tokens={k}: a verification "
                             f"schedules k + 1 = {k + 1} tokens, more than "
                             f"max_num_batched_tokens={self.scheduler_config.max_num_batched_tokens}")
        self.speculative_config = spec
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, k)
        else:
            self.proposer = DraftModelProposer(spec, self)

    def _propose_drafts(self) -> None:
        """After a step: draft tokens for every running request that is decoding (its
        next step computes exactly one pending token) and can be speculated
        (:func:`~minivllm.spec_decode.is_spec_decode_unsupported`; not ``LLM.score``).
        At most ``max_total_tokens - num_tokens - 1`` drafts each, so that a step that
        accepts all of them plus the bonus token never passes max_tokens or
        max_model_len."""
        from minivllm.spec_decode import is_spec_decode_unsupported

        self.proposer.release(self.scheduler.requests)
        reqs = [r for r in self.scheduler.running
                if r.num_tokens - r.num_computed_tokens == 1 and r.score is None
                and not is_spec_decode_unsupported(r.params)]
        for r in reqs:
            r.spec_token_ids, r.draft_probs = [], None
        if not reqs:
            return
        limits = {r.request_id: r.max_total_tokens - r.num_tokens - 1 for r in reqs}
        if self.speculative_config.method == "ngram":
            drafts = self.proposer.propose(reqs, limits)
        else:
            gens = {r.request_id: self.model_runner.request_generator(r) for r in reqs
                    if r.params.temperature >= 1e-5}
            drafts = self.proposer.propose(reqs, limits, gens)
        by_id = {r.request_id: r for r in reqs}
        for rid, (tokens, probs) in drafts.items():
            by_id[rid].spec_token_ids = list(tokens)
            by_id[rid].draft_probs = probs

    # --- KV-cache scales ---------------------------------------------------------------
    def calibrate_kv_scales(self, token_id_lists: Optional[list[list[int]]] = None) -> dict:
        """Calibrate static K/V scales (``amax / qmax`` per layer: per tensor, per KV head, or
        K per (head, channel) with V per tensor, ``kv_scale_granularity``).

        Args:
            token_id_lists: calibration sequences; default: the first 2048 tokens of the
                bundled prose corpus (``minivllm/precision/evalsets/corpus.txt``) in
                windows of up to 1024 tokens (not the passkey filler or the QA set used
                for evaluation).
        Returns:
            :meth:`kv_cache_scales` after calibration.
        Raises:
            ValueError: a float KV cache, dynamic scales, or running requests (scales must
                not change under a request whose K/V is already stored).
        """
        if self.model_executor is not None:
            raise ValueError("calibrate_kv_scales with tensor_parallel_size > 1 would set rank "
                             "0's scales only; calibrate with tensor_parallel_size=1")
        cc = self.cache_config
        if cc.kv_scale_type != "static" or not is_quantized(cc.cache_dtype):
            raise ValueError(f"calibrate_kv_scales needs a quantized KV cache with static "
                             f"scales; kv_cache_dtype={cc.kv_cache_dtype!r}, "
                             f"kv_scale_type={cc.kv_scale_type!r}")
        if self.has_unfinished_requests():
            raise ValueError("calibrate_kv_scales cannot run while requests are in flight")
        if token_id_lists is None:
            token_id_lists = self._calibration_sequences("corpus", None)
        if isinstance(token_id_lists, (str, bytes)) or not isinstance(token_id_lists, Iterable):
            raise ValueError("calibrate_kv_scales takes a list of token-id sequences, got "
                             f"{type(token_id_lists).__name__}")
        token_id_lists = list(token_id_lists)
        if any(isinstance(t, (str, bytes)) or not isinstance(t, Iterable) for t in token_id_lists):
            raise ValueError("calibrate_kv_scales takes a list of token-id sequences (a list of "
                             "lists of ints); got a flat sequence or a non-sequence item")
        seqs = [self._check_token_ids(ids, "calibration token ids") for ids in token_id_lists]
        for ids in seqs:
            if not 0 < len(ids) <= self.model_config.max_model_len:
                raise ValueError(f"calibration sequences need 1 to max_model_len="
                                 f"{self.model_config.max_model_len} tokens, got {len(ids)}")
        if not seqs:
            raise ValueError("calibrate_kv_scales needs at least one sequence")
        self.model_runner.calibrate_kv_scales(seqs)
        self.kv_cache_manager.reset_prefix_cache()  # cached blocks used the old scales
        return self.kv_cache_scales()

    def kv_cache_scales(self) -> dict:
        """The KV-cache scales in use (see ``ModelRunner.kv_cache_scales``)."""
        return self.model_runner.kv_cache_scales()

    def _calibration_sequences(self, name: str, max_tokens: Optional[int]) -> list[list[int]]:
        """Calibration token sequences from a bundled set
        (:func:`minivllm.quantization.calibration.calibration_sequences`)."""
        from minivllm.quantization.calibration import calibration_sequences

        if self.tokenizer is None:
            raise ValueError("calibration on the bundled text needs a tokenizer "
                             "(skip_tokenizer_init=True); pass token ids instead")
        return calibration_sequences(self.tokenizer, name, max_tokens,
                                     self.model_config.max_model_len)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the model's weights as stored (quantized layers count their packed
        tensors and scales): ``{"linear", "other", "total"}``."""
        from minivllm.quantization.quantize import model_weight_bytes

        return model_weight_bytes(self.model_runner.model)

    def save_quantized(self, path) -> "Path":
        """Save a quantized model (format: :mod:`minivllm.quantization.checkpoint`)."""
        from minivllm.quantization.checkpoint import save_quantized

        return save_quantized(self, path)

    # --- configuration ----------------------------------------------------------------
    def _make_cache_config(self, cache_dtype: torch.dtype) -> CacheConfig:
        a, mc = self.args, self.model_config
        per_block = kv_cache_bytes_per_block(mc, a.block_size, cache_dtype,
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
            wanted = a.max_num_seqs * -(-mc.max_model_len // a.block_size)
            num_blocks = min(wanted, DEFAULT_CPU_KV_CACHE_BYTES // per_block)
        if num_blocks * a.block_size < mc.max_model_len:
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks x {a.block_size} tokens = "
                f"{num_blocks * a.block_size} tokens, fewer than max_model_len="
                f"{mc.max_model_len}, so one full-length request could never run. Give "
                f"more blocks (num_gpu_blocks_override / kv_cache_memory_bytes) or lower "
                f"max_model_len (needs >= {-(-mc.max_model_len // a.block_size)} blocks, "
                f"{per_block} bytes each).")
        total = num_blocks * per_block
        available = _available_memory_bytes(a.device)
        if available is not None and total > available:
            raise ValueError(
                f"The KV cache would take {num_blocks} blocks x {per_block} bytes = "
                f"{total / 2**30:.2f} GiB, but only {available / 2**30:.2f} GiB of "
                f"{'GPU' if a.device.startswith('cuda') else 'CPU'} memory is available. Lower "
                f"num_gpu_blocks_override / kv_cache_memory_bytes / block_size "
                f"(block_size={a.block_size}).")
        k_scale, v_scale = a.kv_scale or (1.0, 1.0)
        return CacheConfig(block_size=a.block_size, num_blocks=num_blocks,
                           cache_dtype=cache_dtype, kv_cache_dtype=a.kv_cache_dtype,
                           k_scale=k_scale, v_scale=v_scale, kv_scale_type=a.kv_scale_type,
                           kv_scale_granularity=a.kv_scale_granularity,
                           enable_prefix_caching=a.enable_prefix_caching)

    def _make_scheduler_config(self) -> SchedulerConfig:
        a, max_len = self.args, self.model_config.max_model_len
        budget = a.max_num_batched_tokens
        if budget is None:
            budget = 8192 if a.enable_chunked_prefill else max(8192, max_len)
        if not a.enable_chunked_prefill and budget < max_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({max_len}); "
                "without chunked prefill a whole prompt must fit in one step. Raise "
                "max_num_batched_tokens, lower max_model_len, or enable_chunked_prefill=True.")
        return SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=budget,
                               max_model_len=max_len,
                               enable_chunked_prefill=a.enable_chunked_prefill)

    # --- requests ---------------------------------------------------------------------
    def set_precision_monitor(self, monitor) -> None:
        """Feed every finished generate request's sampled tokens to ``monitor`` (a
        :class:`minivllm.precision.monitor.DriftMonitor`, or None to stop): their raw
        log-probs and entropies, whatever the request's own ``logprobs`` and
        ``logprobs_mode``. Costs one log_softmax over the vocabulary per sampled row and
        step. Requests decoded with speculative decoding are not fed (their drafts skip
        the sampler). Not a vLLM feature."""
        self.precision_monitor = monitor
        self.model_runner.sampler.track_stats = monitor is not None

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams with the generation config's defaults (vLLM's
        ``LLM.get_default_sampling_params``); SamplingParams() when it sets none."""
        return SamplingParams(**self.default_sampling_params)

    def add_request(self, prompt: Union[str, list[int], dict], params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Queue a prompt (text or token ids). Returns the request id.

        ``prompt`` may also be a dict as vLLM's ``TextPrompt`` / ``TokensPrompt``:
        ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``, with an optional
        ``"cache_salt"`` (a non-empty string: requests with different salts share no
        prefix-cache block; see :func:`check_cache_salt`).

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, text that is not
                valid Unicode, a prompt longer than max_model_len (both lengths are
                named; only ``params.truncate_prompt_tokens`` truncates, keeping the last
                k tokens), truncate_prompt_tokens > max_model_len, invalid sampling params
                (checked again here, in case they were
                changed after construction), logprobs/prompt_logprobs above the vocabulary
                size, stop_token_ids outside the vocabulary, or a duplicate request id.
            TypeError: prompt, params or request_id of the wrong type.
        """
        cache_salt = None
        if isinstance(prompt, dict):
            prompt, cache_salt = parse_prompt_dict(prompt)
        params = params if params is not None else self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string or None, got {type(request_id).__name__}")
        params.validate()  # fields may have been changed since the object was built
        vocab = self.model_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > vocab:
                raise ValueError(f"{name}={n} is more than the vocabulary size ({vocab}); "
                                 f"allowed: None or 0..{vocab}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True); use "
                             "stop_token_ids instead")
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {t}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: there is no tokenizer, so prompts "
                                 "must be lists of token ids, not text")
            text: Optional[str] = prompt
            check_valid_unicode(prompt, "prompt")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text = None
            token_ids = self._check_token_ids(prompt, "prompt token ids")
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty (0 tokens); give at least one token")
        if params.truncate_prompt_tokens is not None:
            token_ids = self.truncate_prompt_tokens(token_ids, params.truncate_prompt_tokens)
        max_len = self.model_config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, but max_model_len is {max_len} "
                f"(the prompt plus at least one generated token must fit); shorten the prompt "
                f"or raise max_model_len.")
        rid = self._new_request_id(request_id)
        req = Request(rid, token_ids, params, prompt=text,
                      eos_token_ids=self.model_config.eos_token_ids, max_model_len=max_len,
                      cache_salt=cache_salt)
        self.scheduler.add_request(req)
        self._stats.num_prompt_tokens += len(token_ids)
        return rid

    def truncate_prompt_tokens(self, token_ids: list[int],
                               truncate_prompt_tokens: Optional[int]) -> list[int]:
        """Apply ``SamplingParams.truncate_prompt_tokens`` to a tokenized prompt: keep the
        last k ids (the "prompt.truncate" step); -1 keeps max_model_len - 1. None returns
        the ids unchanged. ``add_request`` calls this; the server calls it before its
        context-length check, so usage.prompt_tokens is the truncated length.

        Raises:
            ValueError: k > max_model_len (vLLM's message), an invalid k, or a swapped
                step that returned more than k ids, no ids, or ids outside the vocabulary.
        """
        from minivllm.tokenizer import resolve_truncate_prompt_tokens

        k = resolve_truncate_prompt_tokens(truncate_prompt_tokens,
                                           self.model_config.max_model_len)
        if k is None:
            return token_ids
        out = self.truncate_prompt(list(token_ids), k)
        if isinstance(out, (str, bytes)) or not isinstance(out, (list, tuple)):
            raise ValueError(f"the prompt.truncate step must return a list of token ids, "
                             f"got {type(out).__name__}")
        out = self._check_token_ids(out, "truncated prompt token ids")
        if not 0 < len(out) <= k:
            raise ValueError(f"the prompt.truncate step returned {len(out)} tokens for "
                             f"truncate_prompt_tokens={k}; expected 1..{k}")
        return out

    def add_score_request(self, token_ids: list[int], mode: str = "prefill",
                          logits: bool = False, request_id: Optional[str] = None,
                          positions: Optional[Sequence[int]] = None,
                          use_prefix_cache: bool = False) -> Request:
        """Queue teacher-forced scoring of a fixed token sequence (see ``LLM.score``).

        Returns the Request; after the engine finishes it, ``request.score.result()`` is
        the ``[T, vocab]`` float32 tensor, or ``[len(positions), vocab]`` (rows in the
        order of ``positions``) when positions are given. ``use_prefix_cache``: see
        ``LLM.score``.

        Raises:
            ValueError: mode not "prefill"/"decode", an empty sequence, token ids outside
                the vocabulary, T > max_model_len (both lengths are named), or positions
                that are not distinct ints in [0, T).
        """
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
        if not isinstance(logits, bool):
            raise TypeError(f"logits must be True or False, got {logits!r}")
        if not isinstance(use_prefix_cache, bool):
            raise TypeError(f"use_prefix_cache must be True or False, got {use_prefix_cache!r}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string or None, got {type(request_id).__name__}")
        ids = self._check_token_ids(token_ids, "token ids")
        if not ids:
            raise ValueError("cannot score an empty token sequence")
        max_len = self.model_config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"The sequence to score is {len(ids)} tokens long, but "
                             f"max_model_len is {max_len}; shorten it or raise max_model_len.")
        if mode == "prefill":
            prompt, forced = ids, []
        else:
            prompt, forced = ids[:1], ids[1:]
        wanted = None if positions is None else check_score_positions(positions, len(ids))
        rid = self._new_request_id(request_id, prefix="score-")
        state = ScoreState(num_positions=len(ids), forced_token_ids=forced, logits=logits,
                           positions=wanted, vocab_size=self.model_config.vocab_size,
                           use_prefix_cache=use_prefix_cache)
        # max_tokens only sizes Request bookkeeping: a score request finishes when it has
        # all T rows (the engine skips stop checks for it), never by length.
        params = SamplingParams(temperature=0.0, max_tokens=len(ids))
        req = Request(rid, prompt, params, eos_token_ids=self.model_config.eos_token_ids,
                      max_model_len=max_len + 1, score=state)
        self.scheduler.add_request(req)
        self._stats.num_prompt_tokens += len(prompt)
        return req

    def _check_token_ids(self, tokens, what: str) -> list[int]:
        """Plain ints in [0, vocab) (numpy integer scalars accepted, bools rejected)."""
        vocab = self.model_config.vocab_size
        ids = []
        for t in tokens:
            if isinstance(t, numbers.Integral) and not isinstance(t, (bool, int)):
                t = operator.index(t)  # numpy integer scalars
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"{what} must be integers in [0, {vocab}), got {t!r}")
            ids.append(int(t))
        return ids

    def _new_request_id(self, request_id: Optional[str], prefix: str = "") -> str:
        """The caller's id, or the next counter value not already in use (ids the caller
        chose themselves are skipped)."""
        rid = request_id
        while rid is None or (request_id is None and (rid in self.scheduler.requests
                                                      or rid in self.finished_outputs)):
            rid = f"{prefix}{next(self._counter)}"
        return rid

    def abort_request(self, request_id: Union[str, Iterable[str]]) -> None:
        """Stop a request (or each of a list of them, as vLLM accepts) and free its blocks
        (no-op for unknown/finished ids).

        Raises:
            TypeError: an id that is not a string.
        """
        if not isinstance(request_id, str):
            ids = list(request_id) if isinstance(request_id, (list, tuple, set)) else [request_id]
            for rid in ids:
                if not isinstance(rid, str):
                    raise TypeError(f"request ids are strings; abort_request got "
                                    f"{type(rid).__name__} {rid!r}")
            for rid in ids:
                self.abort_request(rid)
            return
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            req.finish_time = time.monotonic()
            self.finished_outputs[request_id] = self._make_output(req)
            if self.proposer is not None:
                self.proposer.release(self.scheduler.requests)

    def swap_step(self, name: str, fn, where=None):
        """A context manager that runs ``fn`` in place of the named numeric step (see
        :mod:`minivllm.steps`, which also lists the steps)."""
        from minivllm.steps import swap_step

        if self.model_executor is not None:
            raise ValueError(f"swap_step({name!r}) with tensor_parallel_size="
                             f"{self.args.tensor_parallel_size}: a swapped step would run on "
                             "rank 0's shard only; use tensor_parallel_size=1 (or "
                             "minivllm.parallel.emulated_tp to swap TP's own functions)")
        return swap_step(self, name, fn, where)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step. Returns outputs of requests that finished in it.

        If the model raises, every scheduled request is aborted (its blocks freed) and
        the error is re-raised.
        """
        sched = self.scheduler.schedule()
        self._stats.num_steps += 1
        if sched.is_empty:
            self._record(0)
            return []
        kv = self.kv_cache_manager
        tables = {req.request_id: kv.get_block_ids(req.request_id) for req, _ in sched.scheduled}
        try:
            result = self.model_runner.execute_model(sched.scheduled, tables)
        except BaseException:
            for req, _ in sched.scheduled:
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            if self.proposer is not None:
                self.proposer.release(self.scheduler.requests)
            raise
        by_id = {req.request_id: req for req, _ in sched.scheduled}
        num_rejected = {rid: len(by_id[rid].spec_token_ids) - (len(toks) - 1)
                        for rid, toks in result.spec_outputs.items()}
        self.scheduler.update_after_step(sched.scheduled, num_rejected)
        finished: list[RequestOutput] = []
        for rid, chunk in result.prompt_logprobs.items():
            self._append_prompt_logprobs(by_id[rid], chunk)
        for rid, (first_pos, rows, count, chosen) in result.score_rows.items():
            by_id[rid].score.add(first_pos, rows, count, chosen)
        so = result.sampler_output
        now = time.monotonic()
        for rid in result.nonfinite_request_ids:
            req = by_id[rid]
            if not req.corrupted:
                req.corrupted = True
                self._stats.num_corrupted_requests += 1
            if req.score is None:
                # NaN/inf logits (or K/V): sampling would emit garbage. Finish with
                # "error" and keep the tokens produced so far (vLLM counts such requests
                # in vllm:corrupted_requests; we also stop them). Score requests keep
                # their (NaN) rows and finish normally.
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ERROR)
                req.finish_time = now
                finished.append(self._make_output(req))
        sampled = result.sampled_token_ids
        # the precision monitor's per-row statistics, moved to the host once per step
        monitored = None if so is None or so.raw_sampled_logprobs is None else (
            so.raw_sampled_logprobs.tolist(), so.raw_entropy.tolist())
        for i, rid in enumerate(result.sampled_request_ids):
            req = by_id[rid]
            token = sampled[i]
            if req.is_finished:  # finished with "error" above
                continue
            if req.score is not None:  # teacher forcing: no sampling, no stop checks
                if req.score.done:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_LENGTH)
                    req.finish_time = now
                    finished.append(self._make_output(req))
                else:
                    req.append_output_token(req.score.forced_token_ids[req.num_output_tokens])
                continue
            req.append_output_token(token)
            self._stats.num_generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            if req.logprobs is not None:
                self._append_logprobs(req, so, i, token)
            if monitored is not None:
                if req.monitor_stats is None:
                    req.monitor_stats = ([], [])
                req.monitor_stats[0].append(monitored[0][i])
                req.monitor_stats[1].append(monitored[1][i])
            status = self._check_stop(req, token)
            if status is not None:
                self.scheduler.finish_request(req, status)
                req.finish_time = now
                out = self._make_output(req)
                finished.append(out)
        for rid, tokens in result.spec_outputs.items():
            req = by_id[rid]
            st = self._stats
            st.spec_decode_num_drafts += 1
            st.spec_decode_num_draft_tokens += len(req.spec_token_ids)
            st.spec_decode_num_accepted_tokens += len(tokens) - 1
            req.spec_token_ids, req.draft_probs = [], None
            if req.is_finished:  # finished with "error" above
                continue
            for token in tokens:  # one at a time: a stop condition ends the request exactly
                req.append_output_token(token)
                st.num_generation_tokens += 1
                if req.first_token_time is None:
                    req.first_token_time = now
                status = self._check_stop(req, token)
                if status is not None:
                    self.scheduler.finish_request(req, status)
                    req.finish_time = now
                    finished.append(self._make_output(req))
                    break
        if self.proposer is not None:
            try:
                self._propose_drafts()
            except BaseException:  # a failing draft model: no request keeps its blocks
                for req in list(self.scheduler.running):
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
                self.proposer.release(self.scheduler.requests)
                raise
        self._record(sched.num_batched_tokens)
        return finished

    def _record(self, num_batched_tokens: int) -> None:
        self._history.append((self._stats.num_steps, self.scheduler.num_running,
                              self.scheduler.num_waiting, self.kv_cache_manager.usage,
                              num_batched_tokens))

    def _check_stop(self, req: Request, token: int) -> Optional[RequestStatus]:
        p = req.params
        if p.stop_strings:  # every step, also before min_tokens, so prev is always current
            prev, req.decoded_text = req.decoded_text, self._decode(req)
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if p.stop_strings:
                text = req.decoded_text
                # Only look where the new token could have completed a stop string: text
                # that existed before this step (e.g. before min_tokens) is not searched.
                start = len(os.path.commonprefix([prev, text]))
                for s in p.stop_strings:
                    idx = text.find(s, max(0, start - len(s) + 1))
                    if idx != -1:
                        req.stop_reason = s
                        req.output_text = text[:idx + (len(s) if p.include_stop_str_in_output else 0)]
                        return RequestStatus.FINISHED_STOPPED
        if req.num_tokens >= req.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _decode(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(req.output_token_ids,
                                     skip_special_tokens=req.params.skip_special_tokens)

    def _logprob_entry(self, token: int, logprob: float, rank: int, n: int,
                       topk_ids, topk_logprobs) -> dict[int, Logprob]:
        """token id -> Logprob for the actual/sampled token plus the top ``n``
        (``topk_*``: 1-D tensors of length >= n, or None when n == 0)."""
        ids, lps, ranks = [token], [logprob], [rank]
        if n:
            ids += topk_ids[:n].tolist()
            lps += topk_logprobs[:n].tolist()
            ranks += list(range(1, n + 1))
        d: dict[int, Logprob] = {}
        for t, lp, r in zip(ids, lps, ranks):
            if t not in d:
                d[t] = Logprob(lp, r, None if self.tokenizer is None
                               else self.tokenizer.decode([t]))
        return d

    def _append_logprobs(self, req: Request, so, i: int, token: int) -> None:
        n = req.params.logprobs
        lp = float(so.sampled_logprobs[i])
        req.logprobs.append(self._logprob_entry(
            token, lp, int(so.sampled_ranks[i]), n,
            so.topk_ids[i] if n else None, so.topk_logprobs[i] if n else None))
        req.cumulative_logprob += lp

    def _append_prompt_logprobs(self, req: Request, chunk) -> None:
        n = req.params.prompt_logprobs
        for j, tok in enumerate(chunk.token_ids):
            if chunk.first_pos + j < len(req.prompt_logprobs):
                continue  # already recorded before a preemption (the prompt was recomputed)
            req.prompt_logprobs.append(self._logprob_entry(
                tok, float(chunk.token_logprobs[j]), int(chunk.ranks[j]), n,
                chunk.topk_ids[j] if n else None, chunk.topk_logprobs[j] if n else None))

    def _make_output(self, req: Request) -> RequestOutput:
        if (self.precision_monitor is not None and req.status.finished
                and req.monitor_stats is not None):
            self.precision_monitor.update(*req.monitor_stats)
            req.monitor_stats = None  # counted once
        if req.stop_reason is None or not isinstance(req.stop_reason, str):
            ids = req.output_token_ids
            if req.status == RequestStatus.FINISHED_STOPPED \
                    and not req.params.include_stop_str_in_output:
                ids = ids[:-1]  # as vLLM v1: the EOS / stop token id is not in the text
            req.output_text = "" if self.tokenizer is None else self.tokenizer.decode(
                ids, skip_special_tokens=req.params.skip_special_tokens)
        finish = req.status.value if req.status.finished else None
        comp = CompletionOutput(
            index=0, text=req.output_text, token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=req.logprobs, finish_reason=finish, stop_reason=req.stop_reason)
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finish_time": req.finish_time, "num_preemptions": req.num_preemptions}
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids,
                             prompt_logprobs=req.prompt_logprobs, outputs=[comp],
                             finished=req.status.finished, num_cached_tokens=req.num_cached_tokens,
                             metrics=metrics)

    # --- statistics -------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        s = self._stats
        kv = self.kv_cache_manager
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_cache_queries = kv.prefix_cache_queries
        s.prefix_cache_hits = kv.prefix_cache_hits
        s.num_free_blocks = kv.block_pool.get_num_free_blocks()
        s.num_total_blocks = kv.block_pool.num_blocks
        s.kv_cache_usage = kv.usage
        s.num_running = self.scheduler.num_running
        s.num_waiting = self.scheduler.num_waiting
        s.history = list(self._history)
        return s

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def check_cache_salt(cache_salt) -> Optional[str]:
    """A request's ``cache_salt``: None, or a non-empty string (vLLM's rule, "Parameter
    'cache_salt' must be a non-empty string if provided").

    Raises:
        TypeError: not a string.
        ValueError: the empty string.
    """
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a non-empty string if provided, got "
                        f"{type(cache_salt).__name__}: {cache_salt!r:.40}")
    if not cache_salt:
        raise ValueError("cache_salt must be a non-empty string if provided, got ''")
    check_valid_unicode(cache_salt, "cache_salt")
    return cache_salt


def parse_prompt_dict(prompt: dict) -> tuple[Union[str, list[int]], Optional[str]]:
    """vLLM's ``TextPrompt`` ``{"prompt": str}`` or ``TokensPrompt`` ``{"prompt_token_ids":
    [int, ...]}``, each with an optional ``"cache_salt"``. Returns (prompt, cache_salt).

    Raises:
        ValueError: an unknown key (nothing is silently ignored), neither or both of
            "prompt" and "prompt_token_ids", or an empty cache_salt.
        TypeError: "prompt" not a string, "prompt_token_ids" not a list, or a salt that
            is not a string.
    """
    unknown = sorted(str(k) for k in prompt if k not in PROMPT_DICT_KEYS)
    if unknown:
        raise ValueError(f"unknown prompt key(s) {unknown}; a prompt dict takes 'prompt' (text) "
                         "or 'prompt_token_ids' (a list of ints), and optionally 'cache_salt'")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' (text) and "
                         f"'prompt_token_ids' (a list of ints); got keys {sorted(prompt)}")
    if "prompt" in prompt:
        inner = prompt["prompt"]
        if not isinstance(inner, str):
            raise TypeError(f"'prompt' must be a string, got {type(inner).__name__}; give "
                            "token ids as 'prompt_token_ids'")
    else:
        inner = prompt["prompt_token_ids"]
        if not isinstance(inner, (list, tuple)):
            raise TypeError(f"'prompt_token_ids' must be a list of ints, got "
                            f"{type(inner).__name__}")
        inner = list(inner)
    return inner, check_cache_salt(prompt.get("cache_salt"))


def check_score_positions(positions, num_tokens: int) -> list[int]:
    """``LLM.score(..., positions=)`` for one sequence of ``num_tokens`` tokens: distinct
    ints in [0, num_tokens), as a list in the given order (numpy/torch 1-D integer arrays
    and ``range`` accepted).

    Raises:
        TypeError: not a sequence of ints (a bool, a float, a string...).
        ValueError: a position outside [0, num_tokens), or one that appears twice.
    """
    if isinstance(positions, (torch.Tensor, np.ndarray)):
        if positions.ndim != 1:
            raise ValueError(f"positions must be 1-D (the rows of one sequence), got shape "
                             f"{tuple(positions.shape)}")
        positions = positions.tolist()
    if isinstance(positions, (str, bytes, dict, set, frozenset)) \
            or not isinstance(positions, (list, tuple, range)):
        raise TypeError(f"positions must be a list of ints (rows of the sequence), got "
                        f"{type(positions).__name__}: {positions!r:.80}")
    out = []
    for p in positions:
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Integral):
            raise TypeError(f"positions must be ints, got {type(p).__name__}: {p!r:.40}")
        p = int(p)
        if not 0 <= p < num_tokens:
            raise ValueError(f"position {p} is outside the sequence: a sequence of "
                             f"{num_tokens} tokens has rows 0..{num_tokens - 1} (negative "
                             "positions are not accepted)")
        out.append(p)
    if len(set(out)) != len(out):
        seen, dup = set(), None
        for p in out:
            if p in seen:
                dup = p
                break
            seen.add(p)
        raise ValueError(f"position {dup} appears more than once in positions; give each "
                         "row once (index the result to repeat a row)")
    return out
