"""Continuous-batching scheduler (vLLM v1: ``vllm/v1/core/sched/scheduler.py``).

There is no separate "prefill phase" and "decode phase". Each step, every request is
given some number of new tokens to compute, ``num_tokens - num_computed_tokens`` or a
chunk of it, under two limits:

* ``max_num_batched_tokens``: the token budget of one forward pass;
* ``max_num_seqs``: how many requests may be running at once.

Order (FCFS): running requests first (decodes and unfinished chunked prefills), then
waiting requests in arrival order. When a running request needs a new block and the
pool is empty, the scheduler *preempts* the most recently admitted running request:
its blocks are freed and it goes back to the front of the waiting queue with
``num_computed_tokens = 0``; when it is admitted again its prompt *and* the tokens it
had generated are recomputed in a prefill (preemption by recompute).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What to run in one step.

    Attributes:
        scheduled: (request, num_new_tokens) in batch order.
        num_batched_tokens: sum of num_new_tokens.
        preempted: requests preempted while building this step.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerUpdate:
    """What :meth:`Scheduler.update_from_output` did with one step's model output.

    Attributes:
        finished: requests finished in this step, in the order they finished (NaN/inf
            first, then sampled rows in batch order, then speculative ones).
        sampled: ``(row, request)`` for each sampled row whose token was appended as a
            generated token (not a forced score token, not a finished request): the rows
            whose log-probs the output processor records.
        num_generation_tokens: tokens appended (sampled and accepted speculative ones).
        num_corrupted_requests: requests newly marked corrupted (NaN/inf).
        spec_decode_num_drafts, spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens:
            this step's verifications (drafts verified, draft tokens, tokens accepted).
    """

    finished: list[Request] = field(default_factory=list)
    sampled: list[tuple[int, Request]] = field(default_factory=list)
    num_generation_tokens: int = 0
    num_corrupted_requests: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


def check_stop(request: Request, token: int,
               detokenize: Callable[[Request], str]) -> Optional[RequestStatus]:
    """The stop conditions after ``token`` was appended (vLLM: ``check_stop`` in
    ``vllm/v1/core/sched/utils.py``), in this order: EOS (unless ``ignore_eos``), a stop
    token id, a stop string (from ``min_tokens`` output tokens on), then the length
    limit (``max_tokens`` or ``max_model_len``).

    Stop strings are checked here, one token at a time, with ``detokenize`` (the output
    processor's): vLLM checks them in its detokenizer instead. With stop strings the
    text is decoded every step (``request.decoded_text``), and only the part the new
    token could have completed is searched; a hit cuts ``request.output_text``.

    Returns:
        FINISHED_STOPPED (``request.stop_reason``: None for EOS, else the token id or
        the string), FINISHED_LENGTH, or None to go on.
    """
    p = request.sampling_params
    if p.stop_strings:  # every step, also before min_tokens, so prev is always current
        prev, request.decoded_text = request.decoded_text, detokenize(request)
    if request.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token in (p.stop_token_ids or ()):
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if p.stop_strings:
            text = request.decoded_text
            # Only look where the new token could have completed a stop string: text
            # that existed before this step (e.g. before min_tokens) is not searched.
            start = len(os.path.commonprefix([prev, text]))
            for s in p.stop_strings:
                idx = text.find(s, max(0, start - len(s) + 1))
                if idx != -1:
                    request.stop_reason = s
                    request.output_text = text[:idx + (len(s) if p.include_stop_str_in_output else 0)]
                    return RequestStatus.FINISHED_STOPPED
    if request.num_tokens >= request.max_total_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def preempt_request_ref(request: Request) -> None:
    """Reset a preempted request for recompute (the "scheduler.preempt" step).

    vLLM v1 preempts by recompute: the request's KV blocks are freed (by the scheduler,
    before this runs) and its whole sequence, prompt and generated tokens alike, is
    prefilled again when it is rescheduled. What must survive is the request's token
    list (``all_token_ids``, ``output_token_ids``), its sampling state (seeded generator)
    and its outputs; what must reset is ``num_computed_tokens``. vLLM:
    ``Scheduler._preempt_request`` (``vllm/v1/core/sched/scheduler.py``).
    """
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.num_preemptions += 1


class Scheduler:
    """FCFS continuous batching with chunked prefill and recompute preemption."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.preempt_request = preempt_request_ref  # the "scheduler.preempt" step
        self.num_preemptions = 0

    # --- queue management ---------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Mark finished, free its blocks, drop it from the queues (idempotent)."""
        if request.request_id not in self.requests:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- the schedule -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide what runs in the next step (vLLM: ``Scheduler.schedule``).

        Reads the queues and the config; takes no arguments. Returns a
        ``SchedulerOutput`` whose ``scheduled`` lists ``(request, num_new_tokens)`` in
        batch order, running requests first, then newly admitted ones:

        1. Running requests, oldest first, each get ``num_tokens - num_computed_tokens``
           new tokens (1 for a decode, the rest of the prompt for an unfinished chunked
           prefill), capped by what is left of ``max_num_batched_tokens``.
           ``KVCacheManager.allocate_slots`` gives them the blocks they need; when the
           pool is empty the newest running request is preempted (``_preempt``), maybe
           the current one, which ends this loop.
        2. Waiting requests, in order, only if nothing was preempted in this step and
           fewer than ``max_num_seqs`` are running: ``get_computed_blocks`` finds the
           prefix-cache hit, the rest of the sequence is the new tokens (cut to the
           budget with chunked prefill). Admission stops, the request staying first in
           the queue, when it does not fit the budget without chunked prefill or when
           its blocks cannot be allocated.

        Side effects: blocks are allocated (the caller reads them with
        ``KVCacheManager.get_block_ids``), requests move between ``waiting`` and
        ``running``, and an admitted request's ``num_computed_tokens`` is set to its
        prefix-cache hit. The scheduled tokens themselves are counted as computed only
        by :meth:`update_from_output` (its first part, :meth:`update_after_step`), after
        the model ran.
        """
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager
        scheduled_ids: set[str] = set()

        # 1) Running requests, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_base = request.num_tokens - request.num_computed_tokens
            num_new = min(num_base + len(request.spec_token_ids), budget)
            if request.spec_token_ids and num_new < num_base + len(request.spec_token_ids):
                # the budget cuts the drafts (vLLM does the same): verify fewer of them
                keep = max(num_new - num_base, 0)
                request.spec_token_ids = request.spec_token_ids[:keep]
                if request.draft_probs is not None:
                    request.draft_probs = request.draft_probs[:keep] if keep else None
            assert num_new > 0, request
            while not kv.allocate_slots(request, num_new):
                # Out of blocks: preempt the newest running request (maybe this one).
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
                i += 1
                continue
            break  # the current request was preempted itself: nothing newer can run

        # 2) Waiting requests, FCFS, unless something was preempted this step.
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break  # a whole prompt must fit in one step; asked again next step
                num_new = budget
            if not kv.allocate_slots(request, num_new, hits):
                break  # asked again next step
            kv.record_prefix_query(request, num_hit_tokens)
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new

        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        return out

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks, reset its state for recompute (the
        "scheduler.preempt" step) and put it first in the waiting queue."""
        self.kv_cache_manager.free(request)
        request.spec_token_ids, request.draft_probs = [], None  # drafts are proposed anew
        self.preempt_request(request)
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_after_step(self, scheduled: list[tuple[Request, int]],
                          num_rejected: Optional[dict[str, int]] = None) -> None:
        """Advance num_computed_tokens and register newly full blocks in the cache: the
        first part of :meth:`update_from_output`, callable alone (the chapters' and
        labs' hand-driven loops append tokens themselves).

        ``num_rejected``: request id -> draft tokens the verifier rejected this step
        (speculative decoding). Their K/V was written, but they are not part of the
        sequence: ``num_computed_tokens`` is rolled back by that many (vLLM:
        ``Scheduler.update_from_output``), so the blocks holding them are never
        registered in the prefix cache, and the next step overwrites their slots."""
        for request, num_new in scheduled:
            rejected = num_rejected.get(request.request_id, 0) if num_rejected else 0
            request.num_computed_tokens += num_new - rejected
            self.kv_cache_manager.cache_blocks(request)

    def update_from_output(self, scheduler_output: SchedulerOutput, output,
                           detokenize: Callable[[Request], str]) -> SchedulerUpdate:
        """Apply one step's model output (vLLM: ``Scheduler.update_from_output``).

        1. Scheduled tokens count as computed (:meth:`update_after_step`), minus rejected
           draft tokens; score requests take their rows (``ScoreState.add``).
        2. A request whose logits (or K/V) held NaN/inf is marked ``corrupted``; a
           generate request among them finishes with FINISHED_ERROR (its tokens so far
           are kept; vLLM counts such requests in vllm:corrupted_requests, we also stop
           them). Score requests keep their (NaN) rows and go on.
        3. Each sampled token is appended and :func:`check_stop` decides; a score
           request instead takes its next forced token, or finishes (FINISHED_LENGTH)
           once it has every row.
        4. Accepted speculative tokens are appended one at a time, so that a stop
           condition ends the request exactly where it is met.

        Args:
            scheduler_output: the step's :meth:`schedule` result.
            output: the step's ``ModelRunnerOutput``.
            detokenize: request -> output text (for stop strings).
        Returns:
            a :class:`SchedulerUpdate`. Finished requests are freed (``finish_request``),
            with ``finish_time`` set; their outputs are the output processor's job.
        """
        by_id = {req.request_id: req for req, _ in scheduler_output.scheduled}
        num_rejected = {rid: len(by_id[rid].spec_token_ids) - (len(toks) - 1)
                        for rid, toks in output.spec_outputs.items()}
        self.update_after_step(scheduler_output.scheduled, num_rejected)
        for rid, (first_pos, rows, count, chosen) in output.score_rows.items():
            score = by_id[rid].score
            assert score is not None  # score rows come only for score requests
            score.add(first_pos, rows, count, chosen)
        update = SchedulerUpdate()
        now = time.monotonic()

        def finish(req: Request, status: RequestStatus) -> None:
            self.finish_request(req, status)
            req.finish_time = now
            update.finished.append(req)

        def append(req: Request, token: int) -> bool:
            """Append a generated token; True when a stop condition finished the request."""
            req.append_output_token(token)
            update.num_generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            status = check_stop(req, token, detokenize)
            if status is not None:
                finish(req, status)
            return status is not None

        for rid in output.nonfinite_request_ids:
            req = by_id[rid]
            if not req.corrupted:
                req.corrupted = True
                update.num_corrupted_requests += 1
            if req.score is None:
                finish(req, RequestStatus.FINISHED_ERROR)
        for i, rid in enumerate(output.sampled_request_ids):
            req = by_id[rid]
            if req.is_finished:  # finished with "error" above
                continue
            if req.score is not None:  # teacher forcing: no sampling, no stop checks
                if req.score.done:
                    finish(req, RequestStatus.FINISHED_LENGTH)
                else:
                    req.append_output_token(req.score.forced_token_ids[req.num_output_tokens])
                continue
            update.sampled.append((i, req))
            append(req, output.sampled_token_ids[i])
        for rid, tokens in output.spec_outputs.items():
            req = by_id[rid]
            update.spec_decode_num_drafts += 1
            update.spec_decode_num_draft_tokens += len(req.spec_token_ids)
            update.spec_decode_num_accepted_tokens += len(tokens) - 1
            req.spec_num_drafts += 1
            req.spec_num_draft_tokens += len(req.spec_token_ids)
            req.spec_num_accepted_tokens += len(tokens) - 1
            req.spec_token_ids, req.draft_probs = [], None
            if req.is_finished:  # finished with "error" above
                continue
            for token in tokens:  # one at a time: a stop condition ends the request exactly
                if append(req, token):
                    break
        return update
