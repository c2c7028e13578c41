"""Speculative decoding (course chapter 21; vLLM: ``vllm/v1/spec_decode/``,
``vllm/v1/sample/rejection_sampler.py``).

* :mod:`.ngram_proposer`: prompt lookup, drafts copied from the sequence itself;
* :mod:`.draft_model`: a second (smaller, or cheaper) model proposes the drafts;
* :mod:`.rejection_sampler`: the target verifies them (the "rejection_sampler" step).
"""

from minivllm.spec_decode.ngram_proposer import NgramProposer, propose_ngram  # noqa: F401
from minivllm.spec_decode.rejection_sampler import (rejection_sample_random,  # noqa: F401
                                                    rejection_sampler_ref, verify_greedy)


def is_spec_decode_unsupported(params) -> bool:
    """True for requests that decode one token per step even with speculative decoding
    on, as vLLM (``vllm/v1/spec_decode/utils.py:is_spec_decode_unsupported``): penalties,
    min_p and logprobs (their per-position bookkeeping is not done for drafts)."""
    return (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
            or params.repetition_penalty != 1.0 or params.min_p > 1e-5
            or params.logprobs is not None)
