"""Lab ch17: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "quantize_fp8_activation:4:12:clamp->clamp_": "amax / E4M3_MAX is a new tensor: clamping "
                                                  "it in place changes nothing else",
    "quantize_fp8_activation:7:11:clamp->clamp_": "x32 / s is a new tensor: clamping it in "
                                                  "place changes nothing else",
}
