"""Lab ch22: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "hash_block:5:18:drop tuple()": "the contract gives extra_keys as a tuple (the engine's "
                                    "block_extra_keys returns one): tuple(t) of a tuple has "
                                    "the same repr, so the same bytes are hashed",
}
