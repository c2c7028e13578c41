"""Engine counters, ``llm.stats`` (vLLM: the stats of ``vllm/v1/metrics/stats.py``; the
``vllm:*`` metric names are in the comments)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        spec_decode_num_drafts, spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens:
            speculative decoding (vllm:spec_decode_*_total): verifications run, draft
            tokens verified, draft tokens accepted. The acceptance rate is accepted /
            draft tokens; the mean tokens per verification is 1 + accepted / drafts.
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

    def refresh(self, scheduler, kv_cache_manager, history) -> "EngineStats":
        """Read the live values (queues, block pool, prefix cache) into this object;
        ``history``: the engine's per-step records. Returns self."""
        kv = kv_cache_manager
        self.num_preemptions = scheduler.num_preemptions
        self.prefix_cache_queries = kv.prefix_cache_queries
        self.prefix_cache_hits = kv.prefix_cache_hits
        self.num_free_blocks = kv.block_pool.get_num_free_blocks()
        self.num_total_blocks = kv.block_pool.num_blocks
        self.kv_cache_usage = kv.usage
        self.num_running = scheduler.num_running
        self.num_waiting = scheduler.num_waiting
        self.history = list(history)
        return self

    def record_update(self, update) -> None:
        """Add one step's counts (a ``SchedulerUpdate``)."""
        self.num_generation_tokens += update.num_generation_tokens
        self.num_corrupted_requests += update.num_corrupted_requests
        self.spec_decode_num_drafts += update.spec_decode_num_drafts
        self.spec_decode_num_draft_tokens += update.spec_decode_num_draft_tokens
        self.spec_decode_num_accepted_tokens += update.spec_decode_num_accepted_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
