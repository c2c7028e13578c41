"""Lab ch15: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_TEMP = "the in-place op acts on a temporary that nothing else holds"
_ZRANGE = ("lo <= 0 <= hi and scale = (hi - lo) / 15 put -lo / scale in [0, 15]: round() "
           "never leaves it, so no clamp bound outside [0, 15] is reached")
_QRANGE = ("round(w / scale) + zero is at least 0 for w >= lo (the zero point puts lo at "
           "code 0): the lower bound -1 is never reached")
_F32 = "the contract's inputs are float32 (the engine's and the tests'): .float() returns them"
_NOGRAD = "no grad is involved: the engine's weights and the tests' tensors carry none"
_ARGMIN = ("a positive constant factor on every ratio's loss leaves which ratio is smallest "
           "unchanged")
_RATIO = ("k * (1 / n_grid) and k / n_grid differ by at most an ulp: s moves by ~1e-7 "
          "relative, within the test's 1e-5, the same ratio")
_EXACT16 = ("codes and zero points are integers 0..15, exact in bfloat16, and the subtraction "
            "with a float32 operand promotes to float32: the same values")

EQUIVALENT = {
    "quantize_int4_group:2:10:drop .detach()": _NOGRAD,
    "quantize_int4_group:12:13:clamp->clamp_": _TEMP,
    "quantize_int4_group:13:13:clamp->clamp_": _TEMP,
    "quantize_int4_group:16:15:clamp->clamp_": _TEMP,
    "quantize_int4_group:16:46:0->-1": _ZRANGE,
    "quantize_int4_group:16:49:15->16": _ZRANGE,
    "quantize_int4_group:16:49:15->30": _ZRANGE,
    "quantize_int4_group:19:8:clamp->clamp_": _TEMP,
    "quantize_int4_group:19:49:0->-1": _QRANGE,
    "awq_scale_search:3:15:drop .float()": _F32,
    "awq_scale_search:3:15:drop .detach()": _NOGRAD,
    "awq_scale_search:3:35:drop .float()": _F32,
    "awq_scale_search:3:35:drop .detach()": _NOGRAD,
    "awq_scale_search:8:12:clamp->clamp_": _TEMP,
    "awq_scale_search:8:23:Div->MulReciprocal": _RATIO,
    "awq_scale_search:9:16:sqrt->sqrt_": _TEMP,
    "awq_scale_search:9:12:Div->MulReciprocal": ("s * (1 / c) differs from s / c by an ulp: "
                                                 "~1e-7 relative, within the test's 1e-5, "
                                                 "and the losses keep their order"),
    "awq_scale_search:12:15:drop .float()": "uint8 codes minus a float32 zero promote to "
                                            "float32: the same values",
    "awq_scale_search:12:35:drop .float()": "the zero point from the learner's "
                                            "quantize_int4_group is uint8; uint8 - uint8 "
                                            "would wrap, but q.float() - uint8 promotes to "
                                            "float32: the same values",
    "awq_scale_search:13:21:mean->sum": _ARGMIN,
    "awq_scale_search:13:21:pow->pow_": _TEMP,
    "awq_scale_search:13:23:Div->MulReciprocal": ("x * (1 / s) differs from x / s by an ulp: "
                                                  "the losses move by ~1e-7 relative, the "
                                                  "smallest stays the smallest"),
    "dequantize_awq:4:11:drop .to()": _EXACT16,
    "dequantize_awq:4:16:float32->bfloat16": _EXACT16,
    "dequantize_awq:4:41:drop .to()": _EXACT16,
    "dequantize_awq:4:49:float32->bfloat16": _EXACT16,
    "dequantize_awq:4:76:drop .to()": "the contract's scale is float32: .to(float32) returns it",
    "dequantize_awq:5:17:drop .to()": "the contract's s is float32: .to(float32) returns it",
}
