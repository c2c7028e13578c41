"""Lab ch08: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_DEFAULT_INT = "torch.tensor of a list of Python ints is int64 by default"
_INDEX32 = ("index_add_ and boolean-mask assignment accept int32 indices: the same counts "
            "(token ids < 2^31)")

EQUIVALENT = {
    "penalty_counts:2:13:drop dtype=": "torch.zeros is float32 by default (the lab never "
                                       "changes torch's default dtype)",
    "penalty_counts:4:26:0->-1": "counts is 1-D: dimension -1 is dimension 0",
    "penalty_counts:4:29:drop dtype=": _DEFAULT_INT,
    "penalty_counts:4:60:int64->int32": _INDEX32,
    "penalty_counts:8:13:drop dtype=": _DEFAULT_INT,
    "penalty_counts:8:44:int64->int32": _INDEX32,
}
