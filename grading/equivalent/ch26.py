"""Lab ch26: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "render_and_tokenize:4:11:drop list()": "tokenizer.encode already returns a new list of "
                                            "ints (checks.equal compares the type too)",
    "truncate_by_turns:2:39:1->2": "the contract allows a system message only first: the "
                                   "second message is a user message, which the role filter "
                                   "drops, so the system part is the same",
}
