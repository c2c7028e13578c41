"""Lab ch04: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_TWO_D = "the contract gives ref and cand as [T, vocab] (2-D), where dim 1 is dim -1"
_EXACT = ("every float dtype converts to float64 exactly, so topk on the original dtype "
          "ranks the same values in the same order (NaN and inf included)")

EQUIVALENT = {
    "topk:2:11:drop .double()": _EXACT,
    "topk:2:25:drop .double()": _EXACT,
    "topk:4:60:1->0": "only the number quoted in the error message changes; the ValueError "
                      "itself is raised on the same k",
    "topk:5:23:-1->1": _TWO_D,
    "topk:6:23:-1->1": _TWO_D,
    "topk:7:50:-1->-2": "[T, k, k] matches are symmetric in the two top-k lists: counting the "
                        "reference's tokens found in the candidate's or the candidate's found in "
                        "the reference's gives the same number (top-k indices are distinct)",
    "topk:7:50:-1->1": "the same as any(-2) on the [T, k, k] matches: the count is symmetric",
    "topk:7:67:-1->1": "hits is [T, k] after any(): sum(1) is sum(-1)",
    "topk:8:45:-1->1": _TWO_D,
    "topk:8:82:-1->1": _TWO_D,
    "topk:10:18:Div->MulReciprocal": "hits / k and hits * (1 / k) differ by at most an ulp of "
                                     "a fraction in [0, 1]: the contract is a metric, compared "
                                     "with a relative tolerance, not its last bit",
}
