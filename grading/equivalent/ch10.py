"""Lab ch10: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "fused_add_rms_norm:3:8:drop .to()": "residual (any float dtype) + a float32 tensor "
                                         "promotes to float32 (float64 input aside, which "
                                         "the contract's 16-bit/float32 residuals never are)",
    "fused_add_rms_norm:3:37:drop .to()": "a float32 tensor + x promotes x to float32 "
                                          "exactly as .to(float32) does",
}
