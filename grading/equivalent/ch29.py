"""Lab ch29: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_MSG = ("it changes only the ValueError's message; the contract asks for the ValueError "
        "(raised either way), not its wording")
_ULP = ("a * (1/b) and a / b differ by at most an ulp of a double; the monitor's z values "
        "and sums are compared with thresholds that no stream reaches to 1e-15 (the edge "
        "streams' divisions are exact either way)")

EQUIVALENT = {
    "golden_check:12:66:drop tuple()": _MSG,
    "golden_check:13:38:-1->1": "each row tensor is [T, vocab] (checked just above): "
                                "dimension 1 is dimension -1",
    "golden_check:15:14:abs->abs_": "got - gold is a new tensor: abs_ in place touches no "
                                    "input",
    "drift_monitor:17:12:Div->MulReciprocal": _ULP,
    "drift_monitor:24:21:Div->MulReciprocal": _ULP,
    "drift_monitor:25:31:Div->MulReciprocal": _ULP,
    "drift_monitor:29:12:Div->MulReciprocal": _ULP,
}
