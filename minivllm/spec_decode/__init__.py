"""Speculative decoding (course chapter 21; vLLM: ``vllm/v1/spec_decode/``,
``vllm/v1/sample/rejection_sampler.py``).

* :mod:`.ngram_proposer`: prompt lookup, drafts copied from the sequence itself;
* :mod:`.draft_model`: a second (smaller, or cheaper) model proposes the drafts;
* :mod:`.rejection_sampler`: the target verifies them (the "rejection_sampler" step).
"""

from minivllm.sampling_params import SAMPLING_EPS
from minivllm.spec_decode.ngram_proposer import NgramProposer, propose_ngram  # noqa: F401
from minivllm.spec_decode.rejection_sampler import (rejection_sample_random,  # noqa: F401
                                                    rejection_sampler_ref, verify_greedy)


def is_spec_decode_unsupported(params) -> bool:
    """True for requests that decode one token per step even with speculative decoding
    on, as vLLM (``vllm/v1/spec_decode/utils.py:is_spec_decode_unsupported``): penalties,
    min_p and logprobs (their per-position bookkeeping is not done for drafts)."""
    return (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
            or params.repetition_penalty != 1.0 or params.min_p > SAMPLING_EPS
            or params.logprobs is not None)


def make_proposer(spec, engine):
    """The proposer of a ``SpeculativeConfig``: an :class:`NgramProposer`, or a
    :class:`~minivllm.spec_decode.draft_model.DraftModelProposer` serving ``engine``."""
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max,
                             spec.num_speculative_tokens)
    from minivllm.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(spec, engine)


def propose_drafts(proposer, scheduler, model_runner) -> None:
    """After a step: draft tokens for every running request that is decoding (its next
    step computes exactly one pending token) and can be speculated
    (:func:`is_spec_decode_unsupported`; not ``LLM.score``), set as the requests'
    ``spec_token_ids`` (and ``draft_probs``). At most ``max_total_tokens - num_tokens -
    1`` drafts each, so that a step that accepts all of them plus the bonus token never
    passes max_tokens or max_model_len. Draft state of finished requests is released."""
    proposer.release(scheduler.requests)
    reqs = [r for r in scheduler.running
            if r.num_tokens - r.num_computed_tokens == 1 and r.score is None
            and not is_spec_decode_unsupported(r.sampling_params)]
    for r in reqs:
        r.spec_token_ids, r.draft_probs = [], None
    if not reqs:
        return
    limits = {r.request_id: r.max_total_tokens - r.num_tokens - 1 for r in reqs}
    if isinstance(proposer, NgramProposer):
        drafts = proposer.propose(reqs, limits)
    else:
        gens = {r.request_id: model_runner.request_generator(r) for r in reqs
                if r.sampling_params.temperature >= SAMPLING_EPS}
        drafts = proposer.propose(reqs, limits, gens)
    by_id = {r.request_id: r for r in reqs}
    for rid, (tokens, probs) in drafts.items():
        by_id[rid].spec_token_ids = list(tokens)
        by_id[rid].draft_probs = probs
