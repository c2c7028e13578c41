"""Teacher-forced rows of a step: prompt log-probs (``SamplingParams.prompt_logprobs``;
vLLM: ``GPUModelRunner._get_prompt_logprobs_dict``) and the rows of ``LLM.score``
(this engine's teacher-forced log-prob rows, not vLLM's cross-encoder ``LLM.score``)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from minivllm.request import Request
from minivllm.worker.outputs import PromptLogprobsChunk

# A chunk of at least this many rows runs the LM head of ``LLM.score(positions=)`` on at
# least this many rows (see score_logits).
SCORE_HEAD_MIN_ROWS = 16


def prompt_logprobs(logits: torch.Tensor, req: Request, pos0: int,
                    logprobs_mode: str) -> PromptLogprobsChunk:
    """Prompt positions pos0 + 1 .. pos0 + L from the float32 logits [L, vocab] of
    positions pos0 .. pos0 + L - 1, as ``logprobs_mode`` says: log-probs or logits (a
    prompt position is never processed, so "processed_" = "raw_")."""
    logprobs = logits if logprobs_mode.endswith("logits") \
        else torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(req.prompt_token_ids[pos0 + 1:pos0 + 1 + logits.shape[0]],
                           dtype=torch.int64, device=logprobs.device)
    tok_lp = logprobs.gather(1, targets[:, None]).squeeze(1)
    ranks = (logprobs > tok_lp[:, None]).sum(-1) + 1
    n = req.sampling_params.prompt_logprobs or 0  # set: this request asked for them
    topk_lp = topk_ids = None
    if n > 0:
        topk_lp, topk_ids = logprobs.topk(n, dim=-1)
    return PromptLogprobsChunk(pos0 + 1, targets.tolist(), tok_lp, ranks, topk_ids, topk_lp)


def score_logits(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 hidden: torch.Tensor, pos0: int, chosen: Optional[list[int]],
                 row_invariant: bool, vocab_size: int) -> torch.Tensor:
    """LM-head rows (float32 logits) of a score request's chunk (hidden [n, hidden] of
    positions pos0 .. pos0 + n - 1): every row (``chosen`` None), or only the rows at
    positions ``chosen`` (``LLM.score(..., positions=)``), so that the head and the
    log-softmax skip the others.

    The chosen rows must equal the same rows of a full score bit for bit. The GEMM
    of a full chunk has ``len(hidden)`` rows, and a CPU GEMM's per-row result can
    depend on the row count and on where a row sits in the batch (oneDNN's packed
    float32 GEMM on this CPU: rows differ at 1-3, 5-7 and 9-11 rows, agree from 12
    on; bfloat16 agreed at every count). So: a chunk shorter than
    ``SCORE_HEAD_MIN_ROWS`` runs the head on all its rows (as the full score does)
    and keeps the chosen ones; a longer chunk runs it on the chosen rows, padded
    with neighbouring rows of the chunk to at least ``SCORE_HEAD_MIN_ROWS``.
    ``row_invariant`` (the batch-invariant mode: ``compute_logits`` runs one row at a
    time) makes any subset give the same rows, so only the chosen ones run."""
    if row_invariant:
        return compute_logits(hidden if chosen is None else hidden[[p - pos0 for p in chosen]])
    if chosen is None:
        return compute_logits(hidden)
    n = hidden.shape[0]
    offs = [p - pos0 for p in chosen]
    if not offs:
        return hidden.new_empty((0, vocab_size), dtype=torch.float32)
    k = SCORE_HEAD_MIN_ROWS
    if n < k or len(offs) >= n:
        return compute_logits(hidden)[offs]
    if len(offs) >= k:
        return compute_logits(hidden[offs])
    picked = set(offs)
    pad = [i for i in range(n) if i not in picked][: k - len(offs)]
    head_rows = sorted(picked.union(pad))
    where = {r: i for i, r in enumerate(head_rows)}
    logits = compute_logits(hidden[head_rows])
    return logits[[where[o] for o in offs]]


def score_chunk(req: Request, rows: torch.Tensor, pos0: int, count: int,
                chosen: Optional[list[int]]
                ) -> tuple[tuple[int, torch.Tensor, int, Optional[list[int]]], bool]:
    """``ModelRunnerOutput.score_rows`` entry of a score request from its logits rows
    (:func:`score_logits`): ``(pos0, float32 rows on the host (log-softmaxed unless the
    request asked for logits), count, chosen)``, and whether every row is finite."""
    assert req.score is not None  # a score request
    if not req.score.logits:
        rows = torch.log_softmax(rows, dim=-1)
    return (pos0, rows.cpu(), count, chosen), bool(torch.isfinite(rows.sum(dim=-1)).all())
