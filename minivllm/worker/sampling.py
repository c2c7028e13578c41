"""What the model runner hands the sampler: per-request sampling tensors, generators, and
the verification of speculative drafts (vLLM: ``InputBatch`` /
``vllm/v1/sample/metadata.py`` for the tensors, ``vllm/v1/sample/rejection_sampler.py``
and ``GPUModelRunner._sample`` for the verification)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from minivllm.request import Request
from minivllm.layers.sampler import Sampler, SamplingMetadata
from minivllm.sampling_params import SAMPLING_EPS


def sampling_metadata(reqs: list[Request], device: torch.device) -> SamplingMetadata:
    """The sampler's inputs for one row per request of ``reqs`` (in order): float32 [R]
    temperature, top_p, min_p and penalties, int64 [R] top_k, each None when no request
    uses it; the token histories when a penalty is on; each seeded request's own
    generator (created on first use); the EOS/stop ids a request below ``min_tokens``
    may not draw."""
    ps = [r.sampling_params for r in reqs]

    def vec(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    all_greedy = all(p.temperature < SAMPLING_EPS for p in ps)
    meta = SamplingMetadata(
        temperature=None if all_greedy else vec([p.temperature for p in ps]),
        all_greedy=all_greedy)
    if any(p.top_k > 0 for p in ps):
        meta.top_k = vec([p.top_k for p in ps], torch.int64)
    if any(p.top_p < 1.0 for p in ps):
        meta.top_p = vec([p.top_p for p in ps])
    if any(p.min_p > 0.0 for p in ps):
        meta.min_p = vec([p.min_p for p in ps])
    if any(p.presence_penalty != 0.0 for p in ps):
        meta.presence_penalty = vec([p.presence_penalty for p in ps])
    if any(p.frequency_penalty != 0.0 for p in ps):
        meta.frequency_penalty = vec([p.frequency_penalty for p in ps])
    if any(p.repetition_penalty != 1.0 for p in ps):
        meta.repetition_penalty = vec([p.repetition_penalty for p in ps])
    if meta.presence_penalty is not None or meta.frequency_penalty is not None \
            or meta.repetition_penalty is not None:
        meta.prompt_token_ids = [r.prompt_token_ids for r in reqs]
        meta.output_token_ids = [r.output_token_ids for r in reqs]
    asked = [p.logprobs for p in ps if p.logprobs is not None]
    meta.max_num_logprobs = max(asked) if asked else None
    for i, r in enumerate(reqs):
        if r.sampling_params.seed is not None:
            meta.generators[i] = seeded_generator(r, device)
        if r.num_output_tokens < r.sampling_params.min_tokens:
            block = list(r.sampling_params.stop_token_ids or ())
            if not r.sampling_params.ignore_eos:
                block += list(r.eos_token_ids)
            if block:
                meta.min_tokens_block[i] = block
    return meta


def request_generator(r: Request, sampler: Sampler,
                      device: torch.device) -> Optional[torch.Generator]:
    """The generator of a random request's draws: its own (seeded) one, created on
    first use, or the engine's (``sampler.generator``)."""
    if r.sampling_params.seed is None:
        return sampler.generator
    return seeded_generator(r, device)


def seeded_generator(r: Request, device: torch.device) -> torch.Generator:
    """A seeded request's own generator (``sampling_params.seed`` set): created and
    seeded on first use, then kept on the request so its draws continue across steps."""
    own, seed = r.generator, r.sampling_params.seed
    if own is not None:
        return own
    assert seed is not None, "only seeded requests have their own generator"
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    r.generator = gen
    return gen


def verify_drafts(logits: torch.Tensor, reqs: list[Request], num_drafts: list[int],
                  rejection_sampler: Callable, sampler: Sampler, device: torch.device,
                  bad_ids: set[str]) -> dict[str, list[int]]:
    """Verify draft tokens (speculative decoding; vLLM: ``RejectionSampler``).

    Request ``reqs[i]`` ran its pending token and its k = ``num_drafts[i]`` drafts as one
    chunk; its k + 1 rows of ``logits`` (float32 [sum(k + 1), vocab], the requests' rows
    one after the other) score the sequence extended by drafts 0..j-1. Rows below
    ``min_tokens`` get EOS/stop ids masked as the sampler does. Greedy requests pass the
    rows' argmax to the "rejection_sampler" step; random ones pass p =
    softmax(top_k_top_p(logits / T)) (the "sampler.top_k_top_p" step), the draft's q
    (``request.draft_probs``, None for n-gram drafts) and the request's generator.

    Returns:
        request id -> the tokens its verification emits (accepted drafts, then one
        target token), 1 to k + 1 of them. Requests with NaN/inf logits go to
        ``bad_ids`` instead.
    Raises:
        ValueError: a swapped step returned something other than 1 to k + 1 token ids
            in [0, vocab).
    """
    finite = torch.isfinite(logits.sum(dim=-1)).tolist()
    V = logits.shape[1]
    out: dict[str, list[int]] = {}
    off = 0
    for r, k in zip(reqs, num_drafts):
        rows = logits[off:off + k + 1]
        ok = all(finite[off:off + k + 1])
        off += k + 1
        if not ok:
            bad_ids.add(r.request_id)
            continue
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            block = list(p.stop_token_ids or ()) + ([] if p.ignore_eos else list(r.eos_token_ids))
            if block:
                rows = rows.clone()
                for j in range(k + 1):
                    if r.num_output_tokens + j < p.min_tokens:
                        rows[j, block] = float("-inf")
        if p.temperature < SAMPLING_EPS:
            toks = rejection_sampler(list(r.spec_token_ids), None, None,
                                     rows.argmax(dim=-1).tolist(), None)
        else:
            dev = rows.device
            sub = sampler.top_k_top_p(
                rows / p.temperature,
                torch.full((k + 1,), p.top_k, dtype=torch.int64, device=dev)
                if p.top_k > 0 else None,
                torch.full((k + 1,), p.top_p, device=dev) if p.top_p < 1.0 else None)
            probs = torch.softmax(sub, dim=-1)
            toks = rejection_sampler(list(r.spec_token_ids), r.draft_probs, probs, None,
                                     request_generator(r, sampler, device))
        if isinstance(toks, torch.Tensor):
            toks = toks.tolist()
        toks = list(toks)
        if not 1 <= len(toks) <= k + 1 or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in toks):
            raise ValueError(f"the rejection_sampler step returned {toks!r:.120} for "
                             f"{k} drafts; expected 1 to {k + 1} token ids in [0, {V})")
        out[r.request_id] = toks
    return out
