"""Lab ch06: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_TWO_D = "LLM.score of one sequence is [T, vocab] (2-D): dim 1 is dim -1"

EQUIVALENT = {
    "position_kl:2:81:-1->1": _TWO_D,
    "position_kl:3:80:-1->1": _TWO_D,
    "position_kl:4:42:-1->1": _TWO_D,
    "decode_step:10:13:masked_fill->masked_fill_": "scores is a new tensor (einsum * scale) "
                                                   "that nothing else holds",
}
