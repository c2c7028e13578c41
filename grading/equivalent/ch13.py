"""Lab ch13: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "steps:8:15:drop .float()": "split_tf32_matmul returns float32 for the float32 engine's "
                                "hidden states and weight: .float() returns it unchanged",
}
