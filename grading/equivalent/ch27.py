"""Lab ch27: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_2D = "the logits are [T, V] by the contract: dimension 1 is dimension -1"
_ALIAS = ("the list is only read and sliced (slices are new lists; rest is rebound, "
          "never changed in place), so a copy changes nothing")

EQUIVALENT = {
    "minimize_prompt:2:10:drop list()": "ids is a list of ints by the contract, and only "
                                        "sliced and read",
    "minimize_prompt:4:23:-1->1": _2D,
    "minimize_prompt:4:39:-1->1": _2D,
    "bisect_config:19:25:drop list()": _ALIAS,
    "bisect_config:21:27:drop list()": _ALIAS,
    "bisect_config:23:21:0->-1": "lo = -1 only widens the search to the empty prefix, "
                                 "which is found + [], already measured and memoised: the "
                                 "same key is found, with at most one more halving (within "
                                 "the stated budget)",
    "bisect_config:31:27:Sub->Add": "the search after a key is found keeps that key (and one "
                                    "more) among the candidates; it is already in `found`, "
                                    "so a prefix that ends at it breaks only if a shorter "
                                    "one does, and the same keys are found",
    "bisect_config:31:32:1->0": "as Sub->Add: the found key left among the candidates is "
                                "never picked again",
}
