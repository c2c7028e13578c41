"""Lab ch21: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_K0 = "with k = 0 the slice tokens[i + n:i + n + k] is empty, so the early return changes nothing"
_NLONG = ("an n of L or L + 1 has no earlier start (range(L - n) is empty), so the loop goes "
          "on to the next n as if the bound were L - 1")
_F32 = "target and draft rows are float32 by the contract: .float() returns them unchanged"
_NORM = ("torch.multinomial normalises its weights itself: scaling the residual by any "
         "positive factor draws the same token but at a float rounding boundary")

EQUIVALENT = {
    "propose_ngram:2:13:drop list()": "tokens is a list by the contract; a slice of it is a list",
    "propose_ngram:4:7:LtE->Lt": _K0,
    "propose_ngram:4:12:0->-1": _K0,
    "propose_ngram:5:8:drop early return": _K0,
    "propose_ngram:6:30:Sub->Add": _NLONG,
    "propose_ngram:6:34:1->0": _NLONG,
    "rejection_sample:4:12:drop .float()": _F32,
    "rejection_sample:9:16:drop .float()": _F32,
    "rejection_sample:19:37:drop .float()": _F32,
    "rejection_sample:11:31:Div->MulReciprocal": "p * (1/q) and p / q differ by at most an ulp "
                                                 "of a double, and u is a multiple of 2**-24: "
                                                 "the comparison changes only when p/q is "
                                                 "within 1e-16 of such a multiple without "
                                                 "being one (the edge test's q = 1 is exact)",
    "rejection_sample:14:12:clamp_min->clamp_min_": "p - q is a new tensor: clamping it in "
                                                    "place touches no input",
    "rejection_sample:15:21:Gt->GtE": "the residual is all zero only when p <= q everywhere, "
                                      "which for probability rows means p == q, and then the "
                                      "ratio is 1 >= u: the draft is accepted before the "
                                      "fallback is reached",
    "rejection_sample:15:25:0->-1": "as Gt->GtE: the fallback to p is unreachable for "
                                    "probability rows",
    "rejection_sample:17:41:Div->Mult": _NORM,
    "rejection_sample:17:41:Div->MulReciprocal": _NORM,
    "rejection_sample:17:45:sum->mean": _NORM,
}
