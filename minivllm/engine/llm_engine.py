"""LLMEngine: add_request / step / abort_request (vLLM: ``vllm/v1/engine/llm_engine.py``).

One ``step()`` = ``Scheduler.schedule`` -> ``ModelRunner.execute_model`` (forward and
sample) -> ``Scheduler.update_from_output`` (append tokens, check stop conditions, free
finished requests' blocks) -> ``OutputProcessor.process_outputs`` (log-probs, text) ->
the outputs of requests that finished in the step.

Around the loop: configs come from ``EngineArgs.create_engine_config`` (arg_utils.py),
prompts are checked by the ``InputProcessor`` (input_processor.py), counters live in
``EngineStats`` (stats.py), KV-scale calibration in ``minivllm/quantization/`` (weight
bytes and quantized checkpoints too: ``LLM.weight_bytes`` and ``LLM.save_quantized`` call
them directly).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from pathlib import Path
from collections.abc import Iterable
from typing import Callable, Optional, Sequence, Union

from minivllm.config import LM_HEAD_DTYPES
from minivllm.engine.arg_utils import EngineArgs, batch_invariant_enabled
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler
from minivllm.engine.input_processor import InputProcessor
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.stats import EngineStats
from minivllm.outputs import RequestOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.worker.model_runner import ModelRunner

# (tokenizer, set name, max tokens or None, max_model_len) -> token-id sequences
CalibrationData = Callable[..., list[list[int]]]


class LLMEngine:
    """The engine. Build with ``LLMEngine.from_engine_args(EngineArgs(...))``.

    Args:
        args: the engine arguments.
        calibration_data: where calibration token ids come from, for weight quantization
            methods that calibrate (``quantization_config["calibration"]``) and for
            :meth:`calibrate_kv_scales` without sequences: a function ``(tokenizer,
            name, max_tokens, max_model_len) -> list of token-id lists``. ``LLM`` passes
            :func:`minivllm.quantization.calibration.calibration_sequences` (the bundled
            sets); None: such calibration needs explicit token ids.
    Raises (at construction):
        ValueError: invalid arguments, unknown model, or a KV cache too small to hold
            one sequence of max_model_len tokens.
    """

    def __init__(self, args: EngineArgs, calibration_data: Optional[CalibrationData] = None):
        from minivllm.models.loader import load_model
        from minivllm.tokenizer import get_tokenizer

        config = args.create_engine_config()
        self.args, self.vllm_config = args, config
        self.model_config, self.cache_config = config.model_config, config.cache_config
        self.scheduler_config = config.scheduler_config
        self.speculative_config = config.speculative_config
        self.default_sampling_params = config.default_sampling_params
        self.attention_backend = config.attention_backend
        self.tokenizer = None if args.skip_tokenizer_init \
            else get_tokenizer(args.tokenizer or self.model_config.path)
        self.calibration_data = calibration_data
        mc, quant = self.model_config, config.quant_config
        self.input_processor = InputProcessor(mc, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        calibration_ids = None
        if quant is not None and config.saved_quant_config is None and quant.needs_calibration:
            calibration_ids = self.calibration_sequences(quant.calibration,
                                                         quant.calibration_tokens)
        model = load_model(Path(mc.path), config.hf_config, mc.dtype, mc.max_model_len,
                           args.device, self.attention_backend, quant, calibration_ids,
                           args.float32_matmul_precision, load_format=args.load_format,
                           seed=args.seed)
        if args.lm_head_dtype is not None:
            model.set_lm_head_dtype(LM_HEAD_DTYPES[args.lm_head_dtype])
        self.quant_config = config.saved_quant_config or quant
        # tensor_parallel_size > 1: worker processes hold ranks 1..tp-1; this process's
        # model becomes rank 0's shard (minivllm/parallel/multiproc_executor.py)
        self.model_executor = None
        if args.tensor_parallel_size > 1:
            import weakref

            from minivllm.parallel.multiproc_executor import start_tensor_parallel

            self.model_executor = start_tensor_parallel(model, args, config)
            weakref.finalize(self, self.model_executor.shutdown)
        cc = self.cache_config
        self.kv_cache_manager = KVCacheManager(cc.num_gpu_blocks, cc.block_size,
                                               cc.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.model_runner = ModelRunner(
            model, mc, cc, args.device, args.seed,
            cuda_graph_max_batch_size=None if args.enforce_eager
            else min(self.scheduler_config.max_num_seqs, 256),
            batch_invariant=batch_invariant_enabled(args),
            emulate_cuda_graphs=args.emulate_cuda_graphs, logprobs_mode=args.logprobs_mode)
        if args.calculate_kv_scales:
            self.calibrate_kv_scales()
        self.proposer = None
        if self.speculative_config is not None:
            from minivllm.spec_decode import make_proposer

            self.proposer = make_proposer(self.speculative_config, self)
        self._counter = itertools.count()
        self._stats = EngineStats()
        self._history: deque = deque(maxlen=100_000)
        self.finished_outputs: dict[str, RequestOutput] = {}

    @classmethod
    def from_engine_args(cls, args: EngineArgs,
                         calibration_data: Optional[CalibrationData] = None) -> "LLMEngine":
        return cls(args, calibration_data)

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

    # --- requests ---------------------------------------------------------------------
    def add_request(self, prompt: Union[str, list[int], dict], params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Queue a prompt (text or token ids). Returns the request id.

        ``prompt`` may also be a dict as vLLM's ``TextPrompt`` / ``TokensPrompt``:
        ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``, with an optional
        ``"cache_salt"`` (a non-empty string: requests with different salts share no
        prefix-cache block; see :func:`~minivllm.engine.input_processor.check_cache_salt`).

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
        params = params if params is not None else self.get_default_sampling_params()
        token_ids, text, cache_salt = self.input_processor.process_inputs(prompt, params,
                                                                          request_id)
        rid = self._new_request_id(request_id)
        req = Request(rid, token_ids, params, prompt=text,
                      eos_token_ids=self.model_config.eos_token_ids,
                      max_model_len=self.model_config.max_model_len, cache_salt=cache_salt)
        self.scheduler.add_request(req)
        self._stats.num_prompt_tokens += len(token_ids)
        return rid

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
        prompt, params, state = self.input_processor.process_score_inputs(
            token_ids, mode, logits, request_id, positions, use_prefix_cache)
        rid = self._new_request_id(request_id, prefix="score-")
        req = Request(rid, prompt, params, eos_token_ids=self.model_config.eos_token_ids,
                      max_model_len=self.model_config.max_model_len + 1, score=state)
        self.scheduler.add_request(req)
        self._stats.num_prompt_tokens += len(prompt)
        return req

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
            self.finished_outputs[request_id] = self.output_processor.make_output(req)
            if self.proposer is not None:
                self.proposer.release(self.scheduler.requests)

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
        update = self.scheduler.update_from_output(sched, result,
                                                   self.output_processor.detokenize)
        self._stats.record_update(update)
        by_id = {req.request_id: req for req, _ in sched.scheduled}
        finished = self.output_processor.process_outputs(by_id, result, update)
        if self.proposer is not None:
            from minivllm.spec_decode import propose_drafts

            try:
                propose_drafts(self.proposer, self.scheduler, self.model_runner)
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

    # --- statistics, defaults, steps --------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return self._stats.refresh(self.scheduler, self.kv_cache_manager, self._history)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    @property
    def precision_monitor(self):
        """The monitor of :meth:`set_precision_monitor`, or None."""
        return self.output_processor.precision_monitor

    def set_precision_monitor(self, monitor) -> None:
        """Feed every finished generate request's sampled tokens to ``monitor`` (a
        :class:`minivllm.precision.monitor.DriftMonitor`, or None to stop): their raw
        log-probs and entropies, whatever the request's own ``logprobs`` and
        ``logprobs_mode``. Costs one log_softmax over the vocabulary per sampled row and
        step. Requests decoded with speculative decoding are not fed (their drafts skip
        the sampler). Not a vLLM feature."""
        self.output_processor.precision_monitor = monitor
        self.model_runner.sampler.track_stats = monitor is not None

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams with the generation config's defaults (vLLM's
        ``LLM.get_default_sampling_params``); SamplingParams() when it sets none."""
        return SamplingParams(**self.default_sampling_params)

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

    # --- quantization (minivllm/quantization/) ---------------------------------------
    def calibration_sequences(self, name: str, max_tokens: Optional[int]) -> list[list[int]]:
        """Calibration token sequences from ``calibration_data`` (a bundled set, by name).

        Raises:
            ValueError: no tokenizer (skip_tokenizer_init=True) or no calibration_data.
        """
        if self.tokenizer is None:
            raise ValueError("calibration on the bundled text needs a tokenizer "
                             "(skip_tokenizer_init=True); pass token ids instead")
        if self.calibration_data is None:
            raise ValueError("this engine was built without calibration_data; pass token ids "
                             "(or build it through LLM, which supplies the bundled sets)")
        return self.calibration_data(self.tokenizer, name, max_tokens,
                                     self.model_config.max_model_len)

    def calibrate_kv_scales(self, token_id_lists: Optional[list[list[int]]] = None) -> dict:
        """Calibrate static K/V scales; see
        :func:`minivllm.quantization.kv_calibration.calibrate_kv_scales`. Returns
        :meth:`kv_cache_scales` after calibration."""
        from minivllm.quantization.kv_calibration import calibrate_kv_scales

        return calibrate_kv_scales(self, token_id_lists)

    def kv_cache_scales(self) -> dict:
        """The KV-cache scales in use (see ``ModelRunner.kv_cache_scales``)."""
        return self.model_runner.kv_cache_scales()
