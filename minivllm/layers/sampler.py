"""The sampler: logits -> next tokens (+ log-probs), following vLLM v1's order.

vLLM: ``vllm/v1/sample/sampler.py``, ``ops/penalties.py``, ``ops/topk_topp_sampler.py``.
For a batch of rows (one per request that needs a token this step):

1. raw log-probs = log_softmax(logits), kept for ``logprobs`` (vLLM v1 returns log-probs
   of the raw model distribution, before penalties and temperature, unless the engine's
   ``logprobs_mode`` says otherwise: raw logits, or the processed values of steps 2-5,
   see :class:`Sampler`);
2. ``min_tokens``: EOS and stop token ids get -inf until enough tokens exist;
3. penalties: repetition (CTRL, arXiv:1909.05858: divide positive logits, multiply
   negative ones, for tokens in prompt or output), then frequency (times the count in
   the output) and presence (once if present in the output), subtracted (OpenAI's
   definition);
4. greedy rows: argmax (ties go to the lowest token id, as ``torch.argmax``);
5. random rows: divide by temperature, min_p (drop p < min_p * p_max), top_k, then
   top_p (on the distribution renormalised after top_k), then sample by the
   exponential race ``argmax(p / E)``, ``E ~ Exp(1)``, drawn from the request's own
   ``torch.Generator`` when it has a seed, else from the engine's generator.

All arithmetic is float32. Every row's parameters are per-request tensors, so one
batch can mix greedy and random requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from minivllm.sampling_params import SAMPLING_EPS

NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step; B = number of rows, V = vocab size.

    Attributes:
        temperature: [B] float32; rows below SAMPLING_EPS (1e-5) are greedy (None when
            all_greedy).
        top_k: [B] int64 (<= 0 disables) or None when no row uses it.
        top_p: [B] float32 (1.0 disables) or None.
        min_p: [B] float32 (0.0 disables) or None.
        presence_penalty, frequency_penalty, repetition_penalty: [B] float32 or None.
        prompt_token_ids: per row, the prompt ids (repetition penalty only).
        output_token_ids: per row, the generated ids so far.
        generators: row -> torch.Generator for seeded rows.
        max_num_logprobs: largest ``logprobs`` asked for, or None.
        min_tokens_block: row -> token ids to mask (EOS/stop ids while below min_tokens).
        all_greedy: every row is greedy, known on the host (vLLM's
            ``SamplingMetadata.all_greedy``): the sampler then takes one argmax and skips
            the per-row masks, whose boolean indexing syncs with the device.
    """

    temperature: Optional[torch.Tensor]
    top_k: Optional[torch.Tensor] = None
    top_p: Optional[torch.Tensor] = None
    min_p: Optional[torch.Tensor] = None
    presence_penalty: Optional[torch.Tensor] = None
    frequency_penalty: Optional[torch.Tensor] = None
    repetition_penalty: Optional[torch.Tensor] = None
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: Optional[int] = None
    min_tokens_block: dict[int, list[int]] = field(default_factory=dict)
    all_greedy: bool = False


@dataclass
class SamplerOutput:
    """sampled: [B] int64. When logprobs were asked: topk_ids/topk_logprobs [B, N]
    (N = max_num_logprobs), sampled_logprobs [B] float32, sampled_ranks [B] int64
    (1-based rank among the returned values). Those values are log-probs or logits, raw
    or processed, as the sampler's ``logprobs_mode`` says (default raw log-probs)."""

    sampled: torch.Tensor
    topk_ids: Optional[torch.Tensor] = None
    topk_logprobs: Optional[torch.Tensor] = None
    sampled_logprobs: Optional[torch.Tensor] = None
    sampled_ranks: Optional[torch.Tensor] = None
    # with Sampler.track_stats (the precision monitor): [B] float32, the sampled token's
    # raw log-prob and the raw distribution's entropy (nats)
    raw_sampled_logprobs: Optional[torch.Tensor] = None
    raw_entropy: Optional[torch.Tensor] = None


# --- penalties ----------------------------------------------------------------------

def _token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[B, V] float32 counts of each token id per row."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    for row, ids in enumerate(token_lists):
        if ids:
            idx = torch.tensor(ids, dtype=torch.int64, device=device)
            counts[row].index_add_(0, idx, torch.ones(len(ids), device=device))
    return counts


def penalties_ref(logits: torch.Tensor, prompt_token_ids: list[list[int]],
                  output_token_ids: list[list[int]], presence_penalty: Optional[torch.Tensor],
                  frequency_penalty: Optional[torch.Tensor],
                  repetition_penalty: Optional[torch.Tensor]) -> torch.Tensor:
    """Repetition, frequency and presence penalties (the "sampler.penalties" step).

    Args:
        logits: [B, V] float32 (not modified).
        prompt_token_ids, output_token_ids: per row, the request's prompt and the tokens
            it has generated so far.
        presence_penalty, frequency_penalty, repetition_penalty: [B] float32, or None
            when no row uses that penalty.
    Returns:
        a new [B, V] tensor. Repetition (CTRL, Keskar et al. 2019): a logit of a token
        seen in the prompt or the output is divided by the penalty when positive and
        multiplied when negative. Frequency and presence (OpenAI): subtract
        ``frequency * count_in_output + presence * (count_in_output > 0)``. vLLM:
        ``vllm/model_executor/layers/utils.py:apply_penalties``.
    """
    V = logits.shape[1]
    logits = logits.clone()
    out_counts = _token_counts(output_token_ids, V, logits.device)
    if repetition_penalty is not None:
        prompt_seen = _token_counts(prompt_token_ids, V, logits.device) > 0
        seen = prompt_seen | (out_counts > 0)
        rp = repetition_penalty[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalised, logits)
    if frequency_penalty is not None:
        logits -= frequency_penalty[:, None] * out_counts
    if presence_penalty is not None:
        logits -= presence_penalty[:, None] * (out_counts > 0).float()
    return logits


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata, penalties=penalties_ref) -> torch.Tensor:
    """The penalties of ``meta`` (``penalties``: the step to use); returns ``logits``
    itself when no row has a penalty, else a new [B, V] tensor."""
    if meta.repetition_penalty is None and meta.frequency_penalty is None \
            and meta.presence_penalty is None:
        return logits
    return penalties(logits, meta.prompt_token_ids, meta.output_token_ids,
                     meta.presence_penalty, meta.frequency_penalty, meta.repetition_penalty)


# --- truncation ---------------------------------------------------------------------

def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with p < min_p * max(p) (Nguyen et al. 2024, arXiv:2407.01082)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Top-k (keep the k largest logits, ties at the k-th kept) then top-p (keep the
    smallest head of the sorted distribution whose mass reaches p; the most likely token
    always survives). The sort is stable: equal logits are ordered by token id, so a tie
    at the top-p boundary keeps the lower ids first. The "sampler.top_k_top_p" step's
    reference.

    Args:
        logits: [B, V] float32, already divided by the temperature.
        top_k: [B] int64 (<= 0 or >= V: no limit) or None; top_p: [B] float32 in (0, 1]
            or None.
    Returns:
        [B, V]: dropped tokens set to -inf. vLLM: ``vllm/v1/sample/ops/topk_topp_sampler.py``.
    """
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, V), top_k.clamp(max=V))
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        # top_p = 1 disables: float32 cumsum can reach 1.0 before the tail ends.
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                  default_generator: Optional[torch.Generator]) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E), E ~ Exp(1) i.i.d. (equivalent to drawing
    from p). Seeded rows draw E from their own generator, so their result does not
    depend on the rest of the batch. probs: [B, V] -> [B] int64."""
    q = torch.empty_like(probs)
    unseeded = [r for r in range(probs.shape[0]) if r not in generators]
    if unseeded:
        if len(unseeded) == probs.shape[0]:
            q.exponential_(generator=default_generator)
        else:
            idx = torch.tensor(unseeded, device=probs.device)
            q[idx] = torch.empty(len(unseeded), probs.shape[1], device=probs.device) \
                .exponential_(generator=default_generator)
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return (probs / q).argmax(dim=-1)


class Sampler:
    """Callable sampler. ``penalties`` and ``top_k_top_p`` are the "sampler.penalties" and
    "sampler.top_k_top_p" steps (:mod:`minivllm.steps`; swap them with ``LLM.swap_step``).

    ``logprobs_mode`` (vLLM's, ``vllm/v1/sample/sampler.py``; values in
    :data:`minivllm.config.LOGPROBS_MODES`) picks what ``logprobs`` return: "raw_logprobs"
    (default) log_softmax of the model's logits; "raw_logits" those logits; the
    "processed_" modes the values the token was chosen from: for greedy rows the logits
    after min_tokens and penalties, for sampled rows after temperature, min_p, top_k and
    top_p too (removed tokens are -inf), as logits or log_softmax of them.
    """

    def __init__(self, generator: Optional[torch.Generator] = None,
                 logprobs_mode: str = "raw_logprobs"):
        from minivllm.config import check_logprobs_mode

        check_logprobs_mode(logprobs_mode)
        self.generator = generator
        self.logprobs_mode = logprobs_mode
        # set by LLMEngine.set_precision_monitor: every row's raw sampled log-prob and
        # entropy are returned (one log_softmax of [B, V] per step more)
        self.track_stats = False
        self.penalties = penalties_ref
        self.top_k_top_p = apply_top_k_top_p

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] float32. Returns SamplerOutput."""
        logits = logits.float()
        want = meta.max_num_logprobs is not None
        raw = self.logprobs_mode.startswith("raw")
        values = None  # what the logprobs report: [B, V]
        raw_lp = torch.log_softmax(logits, dim=-1) if self.track_stats or (
            want and self.logprobs_mode == "raw_logprobs") else None
        if want and raw:
            values = raw_lp if self.logprobs_mode == "raw_logprobs" else logits.clone()
        if meta.min_tokens_block:
            logits = logits.clone()
            for row, ids in meta.min_tokens_block.items():
                logits[row, ids] = NEG_INF
        logits = apply_penalties(logits, meta, self.penalties)

        processed = None
        if want and not raw:  # greedy rows keep these; sampled rows are replaced below
            processed = logits.clone()
        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample_mixed(logits, meta, processed)
        out = SamplerOutput(sampled=sampled)
        if self.track_stats:
            assert raw_lp is not None
            out.raw_sampled_logprobs = raw_lp.gather(1, sampled[:, None]).squeeze(1)
            p = raw_lp.exp()
            out.raw_entropy = -(p * raw_lp.masked_fill(p == 0, 0.0)).sum(-1)
        if want:
            if not raw:
                assert processed is not None
                values = torch.log_softmax(processed, dim=-1) \
                    if self.logprobs_mode == "processed_logprobs" else processed
            n = meta.max_num_logprobs
            assert n is not None and values is not None
            if n > 0:
                out.topk_logprobs, out.topk_ids = values.topk(n, dim=-1)
            out.sampled_logprobs = values.gather(1, sampled[:, None]).squeeze(1)
            out.sampled_ranks = (values > out.sampled_logprobs[:, None]).sum(-1) + 1
        return out

    def _sample_mixed(self, logits: torch.Tensor, meta: SamplingMetadata,
                      processed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Greedy rows (temperature < SAMPLING_EPS) by argmax, the others sampled. [B] int64.
        ``processed`` [B, V] (processed logprobs modes): the sampled rows' final logits
        are written into it."""
        temperature = meta.temperature
        assert temperature is not None  # None only when all_greedy
        greedy_mask = temperature < SAMPLING_EPS
        sampled = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        if greedy_mask.any():
            sampled[greedy_mask] = logits[greedy_mask].argmax(dim=-1)
        if not greedy_mask.all():
            rows = (~greedy_mask).nonzero().squeeze(1)
            sub = logits[rows] / temperature[rows, None]
            if meta.min_p is not None:
                sub = apply_min_p(sub, meta.min_p[rows])
            sub = self.top_k_top_p(
                sub, None if meta.top_k is None else meta.top_k[rows],
                None if meta.top_p is None else meta.top_p[rows])
            if processed is not None:
                processed[rows] = sub
            probs = torch.softmax(sub, dim=-1)
            row_list = rows.tolist()
            gens = {i: meta.generators[r] for i, r in enumerate(row_list) if r in meta.generators}
            sampled[rows] = random_sample(probs, gens, self.generator)
        return sampled
