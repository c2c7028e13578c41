"""``LLM``: the offline entry point, with vLLM's signature (``vllm/entrypoints/llm.py``).

    from minivllm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", kv_cache_dtype="fp8_e4m3")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable
from typing import Optional, Sequence, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.stats import EngineStats
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.utils import check_valid_unicode

Prompt = Union[str, list[int], dict]  # dict: vLLM's TextPrompt / TokensPrompt
Conversation = list[dict[str, str]]


class LLM:
    """An engine plus a tokenizer, driven to completion by ``generate``/``chat``.

    Keyword arguments are :class:`minivllm.engine.arg_utils.EngineArgs` fields (vLLM names):
    ``model, dtype, kv_cache_dtype, block_size, num_gpu_blocks_override,
    kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens, max_model_len,
    enable_prefix_caching, enable_chunked_prefill, seed, device``, KV scales
    (``calculate_kv_scales, kv_scale, kv_scale_type, kv_scale_granularity``), weights
    (``quantization, quantization_config``), ``float32_matmul_precision`` ...

    ``dtype="auto"`` follows vLLM: a float32 checkpoint such as the embedded model runs
    in **bfloat16**; pass ``dtype="float32"`` for float32.

    Raises:
        TypeError: an unknown keyword argument.
        ValueError: an invalid value (the message lists what is allowed).
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs):
        fields = EngineArgs.__dataclass_fields__
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise TypeError(f"Unknown LLM argument(s) {unknown}; allowed: {sorted(fields)}")
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        if isinstance(kwargs.get("tokenizer"), os.PathLike):
            kwargs["tokenizer"] = os.fspath(kwargs["tokenizer"])
        self.engine_args = EngineArgs(model=model, **kwargs)
        # the bundled calibration sets (minivllm/precision/evalsets) for quantization
        # methods that calibrate and for calculate_kv_scales
        from minivllm.quantization.calibration import calibration_sequences

        self.llm_engine = LLMEngine.from_engine_args(self.engine_args, calibration_sequences)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def kv_cache_scales(self) -> dict:
        """The KV-cache scales stored with the cache (see ``LLMEngine.kv_cache_scales``)."""
        return self.llm_engine.kv_cache_scales()

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the model's weights as stored (quantized layers count their packed
        tensors and scales): ``{"linear", "other", "total"}``."""
        from minivllm.quantization.quantize import model_weight_bytes

        return model_weight_bytes(self.llm_engine.model_runner.model)

    def save_quantized(self, path):
        """Write this quantized model to a folder ``LLM(path)`` loads again (format:
        :mod:`minivllm.quantization.checkpoint`). Raises ValueError if not quantized."""
        from minivllm.quantization.checkpoint import save_quantized

        return save_quantized(self.llm_engine, path)

    def collective_rpc(self, method, args: tuple = ()):
        """Run ``method(model, *args)`` on every tensor-parallel rank's model (tp = 1: the
        one model) and return rank 0's result (vLLM: ``LLM.collective_rpc``, whose
        callables get the worker). ``method`` must be a module-level function: the
        worker processes import it by name."""
        if not callable(method):
            raise TypeError(f"collective_rpc takes a module-level function, got {method!r}")
        return self.llm_engine.collective_rpc(method, tuple(args))

    def swap_step(self, name: str, fn, where=None):
        """Run ``fn`` in place of one of the engine's numeric steps inside a ``with`` block.

            with llm.swap_step("rms_norm", my_rms_norm, where=17):   # layer 17 only
                rows = llm.score(ids)

        Args:
            name: a step of :mod:`minivllm.steps` ("rms_norm", "rotary.table", "linear",
                "lm_head", "attention.decode", "attention.prefill", "kv.quantize",
                "kv.dequantize", "slot_mapping", "slot_mapping.read", "block_hash",
                "block_hash.extra_keys", "prefix_cache.lookup",
                "scheduler.preempt", "sampler.penalties", "sampler.top_k_top_p",
                "prompt.chat_template", "prompt.truncate", "prefill_chunk",
                "rejection_sampler", "spec_decode.ngram").
            fn: a function with the signature of the step's reference
                (``minivllm.steps.reference(name)``).
            where: for per-layer steps, a layer index, a list of them, or a module-name
                pattern such as ``"layers.3.input_layernorm"``; None: everywhere.
        Returns:
            a context manager; on exit (also on an exception) the previous function is
            back. CUDA graphs are suspended inside, and the prefix cache is reset around
            steps that change K/V.
        Raises:
            ValueError, TypeError: see :func:`minivllm.steps.swap_step`.
        """
        return self.llm_engine.swap_step(name, fn, where)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's ``LLM.reset_prefix_cache``). Returns
        False, changing nothing, while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    @property
    def stats(self) -> EngineStats:
        """Preemptions, KV usage, prefix-cache queries/hits, free blocks, per-step history."""
        return self.llm_engine.stats

    def set_precision_monitor(self, monitor) -> None:
        """Feed every finished request's sampled tokens (raw log-probs, entropies) to a
        :class:`minivllm.precision.monitor.DriftMonitor`; None stops. Not a vLLM API."""
        self.llm_engine.set_precision_monitor(monitor)

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a call without ``sampling_params`` uses (vLLM's name): the
        fields the model's generation config sets (``EngineArgs.generation_config``,
        ``override_generation_config``), SamplingParams' defaults for the rest."""
        return self.llm_engine.get_default_sampling_params()

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Args:
            prompts: a string, a list of token ids, a prompt dict, or a list of those.
                A prompt dict is vLLM's ``{"prompt": text}`` or ``{"prompt_token_ids":
                [...]}``, optionally with ``"cache_salt": str`` (non-empty): requests
                with different salts never share prefix-cache blocks.
            sampling_params: one for all prompts, or one per prompt (default:
                :meth:`get_default_sampling_params`, the generation config's defaults).
            use_tqdm: show a progress bar over finished requests.
        Raises:
            ValueError: bad prompts or a sampling_params list of the wrong length. When one
                prompt is invalid, no request is run and no blocks are held.
        """
        batch: object = prompts
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], numbers.Integral)):
            batch = [prompts]
        if isinstance(batch, (bytes, bytearray, set, frozenset)) \
                or not isinstance(batch, Iterable):
            raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict, or "
                            f"a list of those, got {type(batch).__name__}")
        prompts = list(batch)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            if isinstance(sampling_params, (str, bytes, dict)) \
                    or not isinstance(sampling_params, Iterable):
                raise TypeError(f"sampling_params must be a SamplingParams, a list of them "
                                f"(one per prompt) or None, got {type(sampling_params).__name__}")
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts; "
                                 "give one, or one per prompt")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(engine.add_request(prompt, params))
        except BaseException:
            for rid in ids:  # do not leave half a batch queued
                engine.abort_request(rid)
                engine.finished_outputs.pop(rid, None)
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(self, messages: Union[Conversation, Sequence[Conversation]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             chat_template: Optional[str] = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then
        generate. Messages are dicts with "role" and "content".

        The template is rendered to text and tokenized with ``add_special_tokens=False``
        (the "prompt.chat_template" step, ``tokenizer.py:render_chat_ref``), so a
        tokenizer that adds a BOS cannot put a second one in front of the template's
        (vLLM PR #16976). ``SamplingParams.truncate_prompt_tokens`` keeps the last k
        tokens of the rendered conversation; without it a conversation longer than
        max_model_len raises ValueError.
        """
        if not isinstance(messages, (list, tuple)):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts, "
                            f"or a list of such lists, got {type(messages).__name__}")
        conversations: list = [messages] if messages and isinstance(messages[0], dict) \
            else list(messages)
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat() applies the tokenizer's chat template; this LLM was built "
                             "with skip_tokenizer_init=True")
        prompts = []
        for conv in conversations:
            if not isinstance(conv, (list, tuple)):
                raise TypeError("each conversation must be a list of {'role': ..., 'content': "
                                f"...}} dicts, got {type(conv).__name__}: {conv!r:.80}")
            if not conv:
                raise ValueError("a conversation must have at least one message")
            for i, msg in enumerate(conv):
                if not isinstance(msg, dict):
                    raise TypeError(f"message {i} must be a dict with 'role' and 'content', "
                                    f"got {type(msg).__name__}: {msg!r:.80}")
                for key in ("role", "content"):
                    value = msg.get(key)
                    if not isinstance(value, str):
                        raise ValueError(f"message {i} needs a string {key!r}, got "
                                         f"{value!r:.80} (message: {msg!r:.120})")
                    check_valid_unicode(value, f"message {i} {key!r}")
            try:  # the "prompt.chat_template" step: render, then add_special_tokens=False
                ids = self.llm_engine.input_processor.render_chat(tok, list(conv), add_generation_prompt,
                                                  chat_template)
            except (ValueError, TypeError):
                raise
            except Exception as e:  # jinja2 TemplateError: syntax, undefined, raise_exception
                raise ValueError(f"the chat template failed on this conversation: "
                                 f"{type(e).__name__}: {e}") from e
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
                raise ValueError(f"the prompt.chat_template step must return a list of token "
                                 f"ids, got {type(ids).__name__}")
            prompts.append(list(ids))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def score(self, token_ids: Union[Sequence[int], Sequence[Sequence[int]]],
              mode: str = "prefill", output: str = "logprobs",
              use_tqdm: bool = False,
              positions: Union[Sequence[int], Sequence[Optional[Sequence[int]]], None] = None,
              use_prefix_cache: bool = False,
              ) -> Union["torch.Tensor", list["torch.Tensor"]]:
        """Teacher-forced full-vocabulary scores of fixed token sequences (not vLLM's
        ``LLM.score``, which is cross-encoder similarity scoring; see the end).

        Row ``t`` of the result is the model's distribution of the token *after* position
        ``t`` given tokens ``0..t``, so a sequence of T tokens gives T rows (the last row
        predicts a token beyond the sequence). No token is sampled: the sequence is fixed,
        so precision effects are measured without generation cascades.

        Args:
            token_ids: one sequence (list of ints) or a list of sequences, each
                1..max_model_len tokens. Sequences of a list run together as one batch.
            mode: "prefill" computes all positions in prefill passes (chunked by
                ``max_num_batched_tokens`` when chunked prefill is on); "decode" feeds
                the first token as a prompt and then one token per engine step, so every
                later row comes from the decode path reading K/V from the paged cache.
            output: "logprobs" (log-softmax) or "logits" (raw, as the LM head gives them).
            use_tqdm: progress bar over finished sequences.
            positions: score only these rows. For one sequence, a list of distinct ints
                in [0, T); for a batch, one such list (or None: all rows) per sequence.
                None: every row. Every position still goes through the model (later
                positions need its K/V), but only the chosen rows go through the LM head
                and the log-softmax, which is the cost of a long score (a [T, vocab]
                float32 tensor: 393 MB at T = 2,000). The rows come back in the order
                given and equal the same rows of a full score bit for bit (see
                ``minivllm.worker.score.score_logits`` for how the CPU GEMM is kept to the same
                rounding).
            use_prefix_cache: read prefix-cache hits (default False: every position is
                computed). A position served from the cache never runs through the
                model, so its row cannot be computed: the hit stops at the first wanted
                row (with ``positions=None`` that is row 0, so nothing hits; ask for the
                rows after a cached prefix with ``positions``), at a block boundary, and
                leaves at least the last token to compute. The tokens after a hit run as
                a prefill that attends to the cached K/V (an explicit mask, not
                ``is_causal``), which is what makes hit-versus-miss numerics measurable.
                Every score request writes its full blocks into the cache either way.
        Returns:
            float32 CPU tensor ``[T, vocab]`` (``[len(positions), vocab]`` with
            positions) for one sequence, or a list of them.
        Raises:
            ValueError: unknown mode or output, an empty sequence, token ids outside the
                vocabulary, a sequence longer than max_model_len, a position outside
                [0, T) or given twice, or a positions list whose length does not match
                the batch.
            TypeError: positions that are not lists of ints.

        Not vLLM's ``LLM.score`` (that one is a cross-encoder similarity API); this is the
        precision toolkit's teacher-forced scorer (llama.cpp ``perplexity`` computes the
        same rows). Without ``use_prefix_cache`` scoring requests skip the prefix-cache
        lookup, as requests with prompt_logprobs always do (vLLM v1 skips reading the
        cache for them: ``skip_reading_prefix_cache``).
        """
        if output not in ("logprobs", "logits"):
            raise ValueError(f"output must be 'logprobs' or 'logits', got {output!r}")
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
        if not isinstance(use_prefix_cache, bool):
            raise TypeError(f"use_prefix_cache must be True or False, got {use_prefix_cache!r}")
        if isinstance(token_ids, (torch.Tensor, np.ndarray)):
            if token_ids.ndim not in (1, 2):
                raise ValueError(f"token_ids as an array must be 1-D (one sequence) or 2-D (a "
                                 f"batch), got shape {tuple(token_ids.shape)}")
            token_ids = token_ids.tolist()
        if not isinstance(token_ids, (list, tuple)):
            raise TypeError(f"token_ids must be a list of ints or a list of such lists, "
                            f"got {type(token_ids).__name__}")
        seqs = list(token_ids)
        single = not seqs or not isinstance(seqs[0], (list, tuple))
        if single:
            seqs = [seqs]
        for s in seqs:
            if not isinstance(s, (list, tuple)):
                raise TypeError(f"a batch must hold lists of token ids, got {type(s).__name__}")
        per_seq = self._score_positions(positions, single, len(seqs))
        engine = self.llm_engine
        reqs = []
        try:
            for s, pos in zip(seqs, per_seq):
                reqs.append(engine.add_score_request(list(s), mode, logits=output == "logits",
                                                     positions=pos,
                                                     use_prefix_cache=use_prefix_cache))
        except BaseException:
            for r in reqs:
                engine.abort_request(r.request_id)
                engine.finished_outputs.pop(r.request_id, None)
            raise
        self._run_engine([r.request_id for r in reqs], use_tqdm)
        results = []
        for r in reqs:
            assert r.score is not None  # every request here was made by add_score_request
            results.append(r.score.result())
        return results[0] if single else results

    @staticmethod
    def _score_positions(positions, single: bool, n: int) -> list:
        """``score(positions=)`` as one entry (a list of ints, or None) per sequence."""
        if positions is None:
            return [None] * n
        if isinstance(positions, (torch.Tensor, np.ndarray)):
            if single:
                return [positions]  # checked (1-D, ints) with the sequence
            if positions.ndim != 2:
                raise ValueError(f"positions for a batch of {n} sequences must be one list "
                                 f"(or None) per sequence, got an array of shape "
                                 f"{tuple(positions.shape)}")
            positions = positions.tolist()
        if single:
            return [positions]
        if isinstance(positions, (str, bytes, dict)) or not isinstance(positions, (list, tuple)):
            raise TypeError(f"positions for a batch must be a list with one list of ints (or "
                            f"None) per sequence, got {type(positions).__name__}")
        per_seq = list(positions)
        if any(isinstance(p, numbers.Integral) for p in per_seq):
            raise TypeError("positions for a batch must hold one list of ints (or None) per "
                            "sequence, not ints: e.g. positions=[[0, 5], None] for two "
                            "sequences")
        if len(per_seq) != n:
            raise ValueError(f"got positions for {len(per_seq)} sequences but {n} sequences "
                             "to score; give one list (or None) per sequence")
        return per_seq

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        wanted = set(ids)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id not in wanted:
                        # a request added through llm_engine.add_request: keep its output
                        # for its owner (as abort_request does) instead of dropping it
                        engine.finished_outputs[out.request_id] = out
                        continue
                    results[out.request_id] = out
                    bar.update(1)
        except BaseException:
            for rid in ids:  # KeyboardInterrupt or a model error: free everything
                engine.abort_request(rid)
                engine.finished_outputs.pop(rid, None)  # nobody will collect it
            raise
        finally:
            bar.close()
        for rid in wanted - set(results):
            if rid in engine.finished_outputs:
                results[rid] = engine.finished_outputs.pop(rid)
        return [results[rid] for rid in ids]

