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

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.engine.request import Request, RequestStatus


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
        by ``update_after_step``, after the model ran.
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
        """Advance num_computed_tokens and register newly full blocks in the cache.

        ``num_rejected``: request id -> draft tokens the verifier rejected this step
        (speculative decoding). Their K/V was written, but they are not part of the
        sequence: ``num_computed_tokens`` is rolled back by that many (vLLM:
        ``Scheduler.update_from_output``), so the blocks holding them are never
        registered in the prefix cache, and the next step overwrites their slots."""
        for request, num_new in scheduled:
            rejected = num_rejected.get(request.request_id, 0) if num_rejected else 0
            request.num_computed_tokens += num_new - rejected
            self.kv_cache_manager.cache_blocks(request)
