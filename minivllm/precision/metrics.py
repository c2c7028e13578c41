"""Drift metrics between a reference and a candidate, on full-vocabulary distributions.

Inputs are the ``[T, vocab]`` log-probability (or logit) tensors that
:meth:`minivllm.LLM.score` and :meth:`minivllm.precision.ReferenceModel.score` return:
row ``t`` is the distribution of the token after position ``t``. Everything is computed
in float64 so the metric adds no rounding of its own. All KL values are in nats.

Definitions follow common practice:

* KL divergence ``KL(P_ref || P_cand) = sum_v p_ref(v) (log p_ref(v) - log p_cand(v))``,
  per position (llama.cpp ``perplexity --kl-divergence``, and vLLM's quantization docs);
* perplexity ``exp(-mean_t log p(x_{t+1} | x_<=t))`` over the scored continuation tokens;
* llama.cpp's "same top p": the percentage of positions whose most probable token is the
  same in both runs, with its binomial standard error (``tools/perplexity/perplexity.cpp``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, cast

import numpy as np
import torch

ArrayLike = "torch.Tensor | np.ndarray"


def _t(x) -> torch.Tensor:
    """As a float64 torch tensor (numpy arrays and lists accepted)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu()
    return torch.as_tensor(np.asarray(x), dtype=torch.float64)


def _pair(ref, cand) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = _t(ref), _t(cand)
    if r.shape != c.shape or r.dim() != 2:
        raise ValueError(f"expected two [T, vocab] tensors of the same shape, got "
                         f"{tuple(r.shape)} and {tuple(c.shape)}")
    return r, c


def _check_k(k, vocab: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an integer in [1, vocab={vocab}], got {k!r}")


def _token_ids(token_ids, n: Optional[int] = None) -> torch.Tensor:
    ids = list(token_ids)
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
        bad = next(t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)))
        raise ValueError(f"token ids must be integers, got {bad!r}")
    if n is not None and any(not 0 <= int(t) < n for t in ids):
        raise ValueError(f"token ids must be in [0, {n}), got {[t for t in ids if not 0 <= int(t) < n][:3]}")
    return torch.as_tensor([int(t) for t in ids], dtype=torch.int64)


def log_softmax(x) -> torch.Tensor:
    """Normalize logits (or log-probs) row-wise to log-probabilities, float64."""
    return torch.log_softmax(_t(x), dim=-1)


# --- distribution metrics (teacher-forced, position by position) ---------------------

def kl_divergence(ref, cand) -> torch.Tensor:
    """Per-position ``KL(P_ref || P_cand)`` in nats.

    Args:
        ref, cand: ``[T, vocab]`` logits or log-probs (normalized here).
    Returns:
        ``[T]`` float64, each >= 0 up to rounding. Positions where the reference puts
        zero mass on a token contribute nothing for that token (0 log 0 = 0).
    """
    lr, lc = log_softmax(ref), log_softmax(cand)
    _pair(lr, lc)
    return _kl_rows(lr, lr - lc)


def _kl_rows(lr: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
    """``sum_v p_v * diff_v`` per row with ``p = exp(lr)``, ``diff = lr - lc``.

    p == 0 contributes 0 (0 log 0 = 0); NaN stays NaN so a broken row is never "perfect".
    """
    p = lr.exp()
    terms = p * diff
    terms.masked_fill_(p == 0, 0.0)
    return terms.sum(dim=-1)


def mean_kl(ref, cand) -> float:
    """Mean over positions of :func:`kl_divergence` (nats)."""
    return float(kl_divergence(ref, cand).mean())


def _valid_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows without NaN or +inf (-inf is a legitimate zero probability)."""
    return ~(torch.isnan(x) | torch.isposinf(x)).any(-1)


def _same_top1(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """[T] bool: same argmax, and both rows finite (a NaN row never agrees)."""
    return (r.argmax(-1) == c.argmax(-1)) & _valid_rows(r) & _valid_rows(c)


def top1_agreement(ref, cand) -> float:
    """Fraction of positions whose argmax token is the same, in [0, 1]. Rows holding NaN
    or +inf on either side count as disagreeing."""
    r, c = _pair(ref, cand)
    return float(_same_top1(r, c).double().mean())


def same_top_p(ref, cand) -> tuple[float, float]:
    """llama.cpp's "Same top p": percentage of positions with the same most probable
    token, and its binomial standard error ``sqrt(p (1 - p) / (n - 1))``, both in %."""
    r, c = _pair(ref, cand)
    n = r.shape[0]
    p = float(_same_top1(r, c).double().mean())
    err = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")
    return 100.0 * p, 100.0 * err


def topk_overlap(ref, cand, k: int = 5) -> float:
    """Mean over positions of ``|top-k(ref) ∩ top-k(cand)| / k``, in [0, 1].

    Raises:
        ValueError: k < 1 or k larger than the vocabulary.
    """
    r, c = _pair(ref, cand)
    _check_k(k, r.shape[1])
    tr = r.topk(k, dim=-1).indices
    tc = c.topk(k, dim=-1).indices
    hits = (tr[:, :, None] == tc[:, None, :]).any(-1).double().sum(-1)
    hits = torch.where(_valid_rows(r) & _valid_rows(c), hits, torch.zeros_like(hits))
    return float((hits / k).mean())


def abs_diff(ref, cand) -> tuple[float, float]:
    """``(max, mean)`` absolute element-wise difference (use on logits for the logit
    difference; on log-probs it is the same up to each row's log-normalizer shift)."""
    r, c = _pair(ref, cand)
    d = (r - c).abs()
    return float(d.max()), float(d.mean())


# --- sequence metrics ----------------------------------------------------------------

def token_logprobs(logprobs, token_ids: Sequence[int]) -> torch.Tensor:
    """Log-probability each row assigns to the token that actually follows.

    Args:
        logprobs: ``[T, vocab]`` log-probs for a sequence of T tokens.
        token_ids: the T tokens. Row t scores ``token_ids[t + 1]``.
    Returns:
        ``[T - 1]`` float64.
    """
    lp = log_softmax(logprobs)
    ids = _token_ids(token_ids, lp.shape[-1])
    if ids.shape[0] != lp.shape[0]:
        raise ValueError(f"{lp.shape[0]} rows of log-probs for {ids.shape[0]} tokens")
    return lp[:-1].gather(1, ids[1:, None]).squeeze(1)


def perplexity(logprobs, token_ids: Sequence[int], start: int = 0) -> float:
    """``exp(-mean log p(x_{t+1} | x_<=t))`` over continuation tokens ``t + 1 > start``.

    Args:
        start: positions before it are context only (e.g. a prompt), not scored.
    """
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an integer >= 0, got {start!r}")
    tl = token_logprobs(logprobs, token_ids)[start:]
    if tl.numel() == 0:
        raise ValueError("nothing to score: need at least one token after `start`")
    return float(torch.exp(-tl.mean()))


def ppl_ratio(ref_logprobs, cand_logprobs, token_ids: Sequence[int], start: int = 0) -> float:
    """``perplexity(cand) / perplexity(ref)`` on the same tokens (1.0 = no change)."""
    return perplexity(cand_logprobs, token_ids, start) / perplexity(ref_logprobs, token_ids, start)


def greedy_agreement(ref_tokens: Sequence[int], cand_tokens: Sequence[int]) -> float:
    """Fraction of the reference's generated tokens that the candidate reproduces at the
    same position (a shorter candidate counts its missing positions as misses)."""
    if len(ref_tokens) == 0:
        raise ValueError("reference token list is empty")
    same = sum(1 for a, b in zip(ref_tokens, cand_tokens) if a == b)
    return same / len(ref_tokens)


def first_divergence(ref_tokens: Sequence[int], cand_tokens: Sequence[int]) -> Optional[int]:
    """Index of the first differing token, or None if identical (lengths included: if one
    is a prefix of the other, the index is the shorter length)."""
    for i, (a, b) in enumerate(zip(ref_tokens, cand_tokens)):
        if a != b:
            return i
    if len(ref_tokens) != len(cand_tokens):
        return min(len(ref_tokens), len(cand_tokens))
    return None


# --- uncertainty ---------------------------------------------------------------------

def bootstrap_ci(groups: Sequence[Sequence[float]] | Sequence[np.ndarray] | Sequence[float],
                 statistic: Callable[[np.ndarray], float] = np.mean,
                 confidence: float = 0.95, n_resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval.

    Positions inside one sequence are correlated (an early error persists), so pass a
    list of per-sequence arrays: sequences are resampled whole (cluster bootstrap) and the
    statistic is taken over the pooled positions. A flat list of numbers resamples the
    numbers themselves.

    Returns:
        ``(low, high)``. With one group and no spread, both equal the statistic.
    Raises:
        ValueError: empty input or confidence outside (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if len(groups) == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    if np.ndim(groups[0]) == 0:
        groups = [[float(cast(float, g))] for g in groups]
    arrays = [np.asarray(g, dtype=np.float64).ravel() for g in groups]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(arrays), size=(n_resamples, len(arrays)))
    stats = np.array([statistic(np.concatenate([arrays[i] for i in row])) for row in idx])
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(stats, [alpha, 1 - alpha])
    return float(lo), float(hi)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class SequenceDrift:
    """Per-position metrics of one sequence (small: no vocabulary-sized arrays), so many
    sequences can be scored one at a time and pooled later with :func:`summarize`."""

    kl: np.ndarray              # [T] nats
    top1_same: np.ndarray       # [T] bool
    topk_overlap: np.ndarray    # [T] in [0, 1]
    max_abs_diff: float         # over all [T, vocab] log-prob elements
    sum_abs_diff: float
    num_elements: int
    ref_token_logprobs: np.ndarray   # [T - 1]
    cand_token_logprobs: np.ndarray  # [T - 1]


def sequence_drift(ref, cand, token_ids: Sequence[int], k: int = 5) -> SequenceDrift:
    """All per-position metrics of one sequence; ``ref``/``cand`` are ``[T, vocab]`` logits
    or log-probs of the same T tokens (``token_ids``)."""
    lr, lc = _pair(log_softmax(ref), log_softmax(cand))
    _check_k(k, lr.shape[1])
    ids = _token_ids(token_ids, lr.shape[1])
    if ids.shape[0] != lr.shape[0]:
        raise ValueError(f"{lr.shape[0]} rows of log-probs for {ids.shape[0]} tokens")
    diff = lr - lc                      # one [T, vocab] temporary, reused below
    kl = _kl_rows(lr, diff)
    # rows with NaN/+inf (rare): a cheap finiteness test of the row sums first
    valid = torch.ones(lr.shape[0], dtype=torch.bool)
    if not (bool(torch.isfinite(kl).all()) and bool(torch.isfinite(diff.sum(-1)).all())):
        valid = _valid_rows(lr) & _valid_rows(lc)
    src_r = ref if isinstance(ref, torch.Tensor) and ref.shape == lr.shape else lr
    src_c = cand if isinstance(cand, torch.Tensor) and cand.shape == lc.shape else lc
    # top-k on the inputs (same order as their log-softmax; float32 is faster)
    tr, tc = src_r.topk(k, dim=-1).indices, src_c.topk(k, dim=-1).indices
    overlap = (tr[:, :, None] == tc[:, None, :]).any(-1).double().sum(-1) / k
    overlap = torch.where(valid, overlap, torch.zeros_like(overlap))
    diff.abs_()
    nxt = ids[1:, None]
    return SequenceDrift(
        kl=kl.numpy(), top1_same=((tr[:, 0] == tc[:, 0]) & valid).numpy(),
        topk_overlap=overlap.numpy(),
        max_abs_diff=float(diff.max()), sum_abs_diff=float(diff.sum()), num_elements=diff.numel(),
        ref_token_logprobs=lr[:-1].gather(1, nxt).squeeze(1).numpy(),
        cand_token_logprobs=lc[:-1].gather(1, nxt).squeeze(1).numpy())


@dataclass(frozen=True)
class DriftSummary:
    """Every distribution metric for one candidate against one reference, pooled over
    sequences. ``kl_ci`` is a cluster-bootstrap 95 % interval of ``mean_kl``; abs diffs are
    over log-probs; perplexities are token-weighted (total NLL / total tokens)."""

    num_sequences: int
    num_positions: int
    mean_kl: float
    kl_ci: tuple[float, float]
    max_kl: float
    top1_agreement: float
    same_top_p: tuple[float, float]
    top5_overlap: float
    max_abs_diff: float
    mean_abs_diff: float
    ppl_ref: float
    ppl_cand: float
    ppl_ratio: float

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["kl_ci"] = list(self.kl_ci)
        d["same_top_p"] = list(self.same_top_p)
        return d


def summarize(drifts: Sequence[SequenceDrift], seed: int = 0) -> DriftSummary:
    """Pool per-sequence metrics (see :func:`sequence_drift`)."""
    if not drifts:
        raise ValueError("summarize needs at least one sequence")
    kl = np.concatenate([d.kl for d in drifts])
    same = np.concatenate([d.top1_same for d in drifts]).astype(np.float64)
    n = same.size
    p = float(same.mean())
    err = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")
    nll_r = -sum(float(d.ref_token_logprobs.sum()) for d in drifts)
    nll_c = -sum(float(d.cand_token_logprobs.sum()) for d in drifts)
    n_tok = sum(d.ref_token_logprobs.size for d in drifts)
    ppl_r = _exp(nll_r / n_tok) if n_tok else float("nan")
    ppl_c = _exp(nll_c / n_tok) if n_tok else float("nan")
    return DriftSummary(
        num_sequences=len(drifts), num_positions=int(kl.size), mean_kl=float(kl.mean()),
        kl_ci=bootstrap_ci([d.kl for d in drifts], seed=seed), max_kl=float(kl.max()),
        top1_agreement=p, same_top_p=(100.0 * p, 100.0 * err),
        top5_overlap=float(np.concatenate([d.topk_overlap for d in drifts]).mean()),
        max_abs_diff=max(d.max_abs_diff for d in drifts),
        mean_abs_diff=sum(d.sum_abs_diff for d in drifts) / sum(d.num_elements for d in drifts),
        ppl_ref=ppl_r, ppl_cand=ppl_c, ppl_ratio=ppl_c / ppl_r)
