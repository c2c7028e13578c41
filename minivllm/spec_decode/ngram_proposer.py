"""The n-gram (prompt lookup) proposer (vLLM: ``vllm/v1/spec_decode/ngram_proposer.py``;
Saxena 2023, "Prompt Lookup Decoding")."""

from __future__ import annotations

from typing import Sequence


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Draft tokens by prompt lookup.

    Args:
        tokens: the sequence so far (prompt and output token ids).
        min_n, max_n: n-gram sizes to try, 1 <= min_n <= max_n.
        k: the most draft tokens to return (>= 0).
    Returns:
        For the largest n in [min_n, max_n] whose last-n tokens (the suffix) also occur
        earlier, starting at some i with i + n < len(tokens) (the suffix itself does not
        count; an occurrence may overlap it), take the EARLIEST such i and return
        ``tokens[i + n : i + n + k]`` (fewer than k when the sequence ends first). An
        empty list when no n matches. vLLM's rule (``tests/v1/spec_decode/test_ngram.py``:
        longest n wins, then the first occurrence).
    Raises:
        ValueError: min_n < 1, min_n > max_n or k < 0.
    """
    if min_n < 1 or min_n > max_n or k < 0:
        raise ValueError(f"propose_ngram needs 1 <= min_n <= max_n and k >= 0, got "
                         f"min_n={min_n}, max_n={max_n}, k={k}")
    tokens = list(tokens)
    L = len(tokens)
    if k == 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for i in range(0, L - n):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


class NgramProposer:
    """Proposes for a batch of requests from their own token lists (no model)."""

    def __init__(self, min_n: int, max_n: int, k: int):
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self.propose_fn = propose_ngram  # swappable, like a step

    def propose(self, requests, max_drafts: dict) -> dict:
        """request id -> (draft token ids, None): at most ``max_drafts[id]`` each; requests
        with no match get no entry. No draft probabilities: an n-gram draft is a point
        mass (q = one-hot) for the rejection sampler."""
        out = {}
        for req in requests:
            limit = min(self.k, max_drafts[req.request_id])
            if limit <= 0:
                continue
            drafts = list(self.propose_fn(req.all_token_ids, self.min_n, self.max_n, limit))
            if drafts:
                out[req.request_id] = (drafts[:limit], None)
        return out

    def release(self, live_ids) -> None:
        """Nothing is held per request."""
