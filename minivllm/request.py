"""Per-request state tracked by the scheduler and the engine (vLLM: ``vllm/v1/request.py``).

Sits above ``core/`` and ``engine/`` (both import it; it imports neither). The old path
``minivllm.engine.request`` re-exports it for the labs."""

from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from minivllm.outputs import Logprob
from minivllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken (recompute)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its logits held NaN/inf (see LLMEngine.step)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass
class ScoreState:
    """Teacher-forced scoring of a fixed token sequence (``LLM.score``).

    Every wanted position's full-vocabulary row is collected as the engine computes it.
    In "decode" mode the request's prompt is the first token and ``forced_token_ids``
    (the rest) are fed one per step instead of sampled tokens, so each row after the
    first comes from a decode step reading the paged KV cache.

    Attributes:
        num_positions: T, the length of the sequence (every position goes through the
            model: later positions need its K/V).
        forced_token_ids: tokens 1..T-1 in decode mode; empty in prefill mode.
        logits: collect raw logits instead of log-probs.
        positions: the rows wanted, in the caller's order (distinct ints in [0, T));
            None: all T. Only these rows go through the LM head and the log-softmax.
        vocab_size: columns of a row (for an empty ``positions``).
        rows: ``[n_i, vocab]`` float32 chunks in position order; ``num_rows`` in total.
        covered: positions [0, covered) are done (their rows held, or not wanted).
        use_prefix_cache: look up prefix-cache hits for the positions before the first
            wanted row (``LLM.score(use_prefix_cache=True)``); the rows of positions
            served from the cache are never computed, so they cannot be wanted.
    """

    num_positions: int
    forced_token_ids: list[int]
    logits: bool = False
    positions: Optional[list[int]] = None
    vocab_size: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)
    num_rows: int = 0
    covered: int = 0
    use_prefix_cache: bool = False

    def __post_init__(self) -> None:
        self._wanted = None if self.positions is None else sorted(self.positions)
        self._held: list[int] = []  # positions of the held rows, in order (positions only)

    @property
    def done(self) -> bool:
        return self.covered >= self.num_positions

    def first_needed(self) -> int:
        """The first position whose row is still wanted (not held yet); T when none is.
        A prefix-cache hit must stop at or before it."""
        if self._wanted is None:
            return self.covered
        i = bisect.bisect_left(self._wanted, self.covered)
        return self._wanted[i] if i < len(self._wanted) else self.num_positions

    def chosen_in(self, start: int, n: int) -> Optional[list[int]]:
        """The wanted positions among [start, start + n) that are not held yet, ascending;
        None when every position is wanted (no ``positions``)."""
        if self._wanted is None:
            return None
        lo = bisect.bisect_left(self._wanted, max(start, self.covered))
        hi = bisect.bisect_left(self._wanted, start + n)
        return self._wanted[lo:hi]

    def add(self, first_pos: int, chunk: torch.Tensor, count: Optional[int] = None,
            chosen: Optional[list[int]] = None) -> None:
        """Record a computed chunk of ``count`` positions starting at ``first_pos``.

        Without ``chosen``, ``chunk`` holds the rows of all of them (``count`` defaults
        to its length); positions already held (recomputed after a preemption) are
        skipped. With ``chosen`` (the positions of :meth:`chosen_in`), ``chunk`` holds
        only their rows."""
        count = chunk.shape[0] if count is None else count
        if chosen is None:
            skip = self.covered - first_pos
            if skip < chunk.shape[0]:
                chunk = chunk[max(skip, 0):]
                self.rows.append(chunk)
                self.num_rows += chunk.shape[0]
        elif chosen:
            self.rows.append(chunk)
            self.num_rows += chunk.shape[0]
            self._held.extend(chosen)
        self.covered = max(self.covered, first_pos + count)

    def result(self) -> torch.Tensor:
        """The ``[T, vocab]`` rows, or ``[len(positions), vocab]`` in the order of
        ``positions``. Raises RuntimeError if scoring stopped early (aborted)."""
        if not self.done:
            raise RuntimeError(f"scoring did not finish: {self.covered} of "
                               f"{self.num_positions} positions (was the request aborted?)")
        if self._wanted is None:
            return torch.cat(self.rows)[: self.num_positions]
        if not self.rows:
            return torch.empty(0, self.vocab_size, dtype=torch.float32)
        rows = torch.cat(self.rows)
        index = {p: i for i, p in enumerate(self._held)}
        assert self.positions is not None  # as _wanted
        order = [index[p] for p in self.positions]
        if order == list(range(len(order))):
            return rows
        return rows[torch.tensor(order, dtype=torch.int64)]


class Request:
    """One sequence moving through the engine.

    The central counter is ``num_computed_tokens``: how many of ``all_token_ids`` already
    have K/V in the paged cache. The scheduler schedules ``num_tokens -
    num_computed_tokens`` more (all of them, or a chunk); a decode step is simply the
    case where that difference is 1. Preemption by recompute resets it to 0.

    ``sampling_params`` is vLLM's name; ``params`` (the constructor argument and the old
    attribute name, used by chapters and labs) is an alias of it.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: Optional[str] = None, eos_token_ids: tuple[int, ...] = (),
                 max_model_len: int = 0, arrival_time: Optional[float] = None,
                 score: Optional[ScoreState] = None, cache_salt: Optional[str] = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = params
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens that hit the prefix cache (first schedule)
        self.status = RequestStatus.WAITING
        self.corrupted = False  # its logits held NaN/inf at some step
        self.stop_reason: Optional[object] = None
        self.num_preemptions = 0
        # Prefix-cache hashes of this request's full blocks (filled by the KV manager).
        self.block_hashes: list[bytes] = []
        # Limit on total length: max_model_len, or prompt + max_tokens.
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
        self.max_total_tokens = min(max_model_len, len(prompt_token_ids) + max_tokens)
        # Sampling state. The seeded generator is created by the model runner on its
        # device at first use and then kept across steps (and across preemption).
        self.generator: Optional[torch.Generator] = None
        self.logprobs: Optional[list[dict[int, Logprob]]] = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # The precision monitor's per-token statistics (LLMEngine.set_precision_monitor):
        # raw log-prob of each sampled token and the entropy it was drawn from, or None.
        self.monitor_stats: Optional[tuple[list[float], list[float]]] = None
        self.prompt_logprobs: Optional[list] = [None] if params.prompt_logprobs is not None else None
        self.output_text = ""
        # Output text as of the last step, kept (only) for requests with stop strings so
        # that each step decodes once and searches only where the new token could end one.
        self.decoded_text = ""
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_token_time: Optional[float] = None
        self.finish_time: Optional[float] = None
        self.score = score  # set for LLM.score requests only
        # vLLM's per-request prefix-cache salt: an extra key of the first block's hash
        # (KVCacheManager), so requests with different salts share no cached block.
        self.cache_salt = cache_salt
        # Speculative decoding (chapter 21; vLLM's ``Request.spec_token_ids``): draft
        # tokens proposed after the last step, verified in the next one. They are never
        # in all_token_ids; the scheduler schedules 1 + len(spec_token_ids) tokens for a
        # decoding request. draft_probs: [len(spec_token_ids), vocab] float32, the draft
        # model's distribution for random requests, else None (n-gram or greedy).
        self.spec_token_ids: list[int] = []
        self.draft_probs: Optional[torch.Tensor] = None
        # This request's own verification counts (the engine-wide totals are
        # ``EngineStats.spec_decode_*``): verifications run, draft tokens verified, draft
        # tokens accepted. RequestOutput.metrics["spec_decode"] reports them (vLLM, in its
        # own fields: ``--per-request-spec-decode-metrics``, the response's
        # ``metrics.speculative_decoding``).
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0

    @property
    def params(self) -> SamplingParams:
        """Alias of ``sampling_params`` (vLLM's name), kept for chapters and labs."""
        return self.sampling_params

    @params.setter
    def params(self, value: SamplingParams) -> None:
        self.sampling_params = value

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
