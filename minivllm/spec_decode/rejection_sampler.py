"""Verification of draft tokens: the "rejection_sampler" step (:mod:`minivllm.steps`).

vLLM: ``vllm/v1/sample/rejection_sampler.py``. The algorithm is Leviathan et al. 2023
("Fast Inference from Transformers via Speculative Decoding", arXiv:2211.17192,
Algorithm 1) and Chen et al. 2023 (arXiv:2302.01318): with target distribution p and
draft distribution q at a position, the draft token d is accepted with probability
min(1, p(d) / q(d)); at the first rejection a token is drawn from the residual
normalize(max(0, p - q)) and the step ends; when all k drafts are accepted a bonus
token is drawn from p at position k. The emitted tokens are then distributed exactly
as k + 1 tokens sampled from the target one at a time. Greedy requests accept while
the draft equals the target's argmax and emit the argmax at the first mismatch (or as
the bonus), so their output equals plain greedy decoding up to the numerics of
scoring k + 1 positions in one forward.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def verify_greedy(draft_token_ids: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Greedy verification.

    Args:
        draft_token_ids: k draft tokens.
        target_argmax: k + 1 tokens, the target's argmax at each verified position
            (position j scores the sequence extended by drafts 0..j-1).
    Returns:
        the accepted drafts (the longest prefix with ``draft[j] == target_argmax[j]``)
        followed by one target token: ``target_argmax[j]`` at the first mismatch j, or
        the bonus ``target_argmax[k]``. 1 to k + 1 tokens.
    Raises:
        ValueError: len(target_argmax) != k + 1.
    """
    draft, target = [int(t) for t in draft_token_ids], [int(t) for t in target_argmax]
    if len(target) != len(draft) + 1:
        raise ValueError(f"verify_greedy needs k + 1 target tokens for k drafts, got "
                         f"{len(target)} for {len(draft)}")
    out: list[int] = []
    for d, t in zip(draft, target):
        if d != t:
            return out + [t]
        out.append(d)
    return out + [target[-1]]


def rejection_sample_random(draft_token_ids: Sequence[int], draft_probs: Optional[torch.Tensor],
                            target_probs: torch.Tensor,
                            generator: Optional[torch.Generator]) -> list[int]:
    """Random-path verification (Leviathan et al. 2023, Algorithm 1).

    Args:
        draft_token_ids: k draft tokens.
        draft_probs: [k, V] float32, the draft's distribution q at each position (the
            one each draft was sampled from); None for an n-gram draft, which is a point
            mass: q = one-hot(draft).
        target_probs: [k + 1, V] float32, the target's distribution p at each verified
            position (after temperature, top-k, top-p).
        generator: random draws (a request's seeded generator, or the engine's).
    Returns:
        1 to k + 1 tokens. For j = 0..k-1, with d = draft[j]: draw u ~ U[0, 1)
        (``torch.rand(1, generator=generator)``); accept d iff q(d) > 0 and p(d) / q(d)
        >= u. At the first rejection draw one token from normalize(max(0, p_j - q_j))
        (``torch.multinomial(.., 1, generator=generator)``; p_j itself if that residual
        is all zero, which needs p_j == q_j) and stop. If all are accepted, draw the bonus
        token from p_k the same way. The draws come in this order, so two correct
        implementations given equal generators return equal tokens.
    Raises:
        ValueError: shapes that do not match k.
    """
    draft = [int(t) for t in draft_token_ids]
    k = len(draft)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k + 1, V] = [{k + 1}, V], got "
                         f"{tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [k, V] = [{k}, {target_probs.shape[1]}], got "
                         f"{tuple(draft_probs.shape)}")
    p_all = target_probs.float()
    out = []
    for j, d in enumerate(draft):
        p = p_all[j]
        if draft_probs is None:
            q_d = 1.0
            residual = p.clone()
            residual[d] = 0.0
        else:
            q = draft_probs[j].float()
            q_d = float(q[d])
            residual = (p - q).clamp_min(0.0)
        u = float(torch.rand(1, generator=generator, device=p.device))
        if q_d > 0.0 and float(p[d]) / q_d >= u:
            out.append(d)
            continue
        if not bool((residual > 0).any()):
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p_all[k], 1, generator=generator)))
    return out


def rejection_sampler_ref(draft_token_ids: Sequence[int], draft_probs: Optional[torch.Tensor],
                          target_probs: Optional[torch.Tensor],
                          target_argmax: Optional[Sequence[int]],
                          generator: Optional[torch.Generator]) -> list[int]:
    """The "rejection_sampler" step's reference: verify one request's k drafts.

    Greedy requests pass ``target_argmax`` ([k + 1] ints) and None for the probabilities
    and the generator (:func:`verify_greedy`); random requests pass ``target_probs``
    ([k + 1, V]), ``draft_probs`` ([k, V] or None for n-gram drafts) and ``generator``
    with ``target_argmax=None`` (:func:`rejection_sample_random`). Returns the tokens to
    append: the accepted drafts and one target token, 1 to k + 1 of them.
    """
    if target_argmax is not None:
        return verify_greedy(draft_token_ids, target_argmax)
    assert target_probs is not None, "random verification needs target_probs"
    return rejection_sample_random(draft_token_ids, draft_probs, target_probs, generator)
