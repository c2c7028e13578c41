"""Batch composition as an experiment (chapter 5, tests/test_batch_invariant.py,
benchmarks/batch_invariance.py).

:func:`decode_logits_beside` scores one token sequence through the decode path while other
requests decode in the same steps, so the same rows can be compared alone and in
different batches (Thinking Machines, "Defeating Nondeterminism in LLM Inference";
vLLM's batch-invariant mode)."""

from __future__ import annotations

import torch

from minivllm.sampling_params import SamplingParams


def decode_logits_beside(llm, target: list[int], companions: list[list[int]]) -> torch.Tensor:
    """``target``'s logits while ``companions`` decode beside it.

    Args:
        llm: a :class:`minivllm.LLM` with no requests in flight.
        target: the token ids to score (T of them).
        companions: token-id prompts added first as greedy requests (``ignore_eos``, T + 1
            new tokens each, so they decode in every step of the scoring); they are
            aborted afterwards, and their blocks freed, whatever happens.

    Returns:
        float32 logits ``[T, vocab]``; every row after the first is computed by the
        decode path (``LLM.score(..., mode="decode")``).
    """
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=len(target) + 1, ignore_eos=True)
    ids = [engine.add_request(c, params) for c in companions]
    try:
        return llm.score(target, mode="decode", output="logits")
    finally:
        for rid in ids:
            engine.abort_request(rid)
            engine.finished_outputs.pop(rid, None)
