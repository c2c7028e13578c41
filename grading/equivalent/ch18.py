"""Lab ch18: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "quantize_kv:3:8:clamp->clamp_": "x.float() / scale is a new tensor, so clamping it in "
                                     "place changes nothing the caller holds",
    "calibrate_kv_scales:6:8:drop .float()": "the contract gives amax as a float32 tensor: "
                                             ".float() returns it unchanged",
    "calibrate_kv_scales:6:51:drop .float()": "the contract gives amax as a float32 tensor: "
                                              ".max() of it is float32 already",
}
