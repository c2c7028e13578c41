"""Lab ch30: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_MSG = "only the ValueError's message changes; the contract asks for a ValueError"
_INPLACE = "the in-place op acts on a fresh temporary that nothing reads afterwards"
_ZERO_E = ("an all-zero block's amax is clamped up to a tiny normal, whose exponent, minus 2, "
           "is below -127 and clamps to -127: the zero branch's value, whatever it is")
_GUARD = ("the guard's value only divides where denom == 0, and the outer where puts 0.0 "
          "there")
_EDGE2 = "at a == 2 both pieces give index 4 (round(2 * 2) == round(2) + 2)"
_EDGE4 = "at a == 4 both pieces give index 6 (round(4) + 2 == round(4 / 2) + 4)"
_HALF = "a / 2 and a * 0.5 are the same correctly rounded value"
_SMALL = ("any clamp_min at or below 2^-125 maps every block amax below 2^-125 to e = -127 "
          "after the clamp to [-127, 127], as 2^-126 does")
_TILE = ("any fixed K tile meets the contract (invariance, float32, 1e-5 accuracy, batched); "
         "the tile size is the learner's choice, and no test fixes the bits it gives")

EQUIVALENT = {
    "mxfp4:4:28:drop tuple()": _MSG,
    "mxfp4:7:9:drop .detach()": "the outputs are uint8, which carry no autograd history",
    "mxfp4:9:8:clamp->clamp_": _INPLACE,
    "mxfp4:9:20:Gt->GtE": _ZERO_E,
    "mxfp4:9:27:0->-1": _ZERO_E,
    "mxfp4:9:53:clamp_min->clamp_min_": "amax > 0 is evaluated before the in-place clamp, "
                                        "and amax is not read afterwards (full_like takes "
                                        "its shape)",
    "mxfp4:9:68:Pow->Mult": "clamp_min(-252) leaves amax as it is: a zero block takes the "
                            "where's -127 branch (log2(0) = -inf is not selected), a "
                            "subnormal one gets e <= -129, clamped to -127, as before",
    "mxfp4:9:68:2.0x2": "4.0 ** -126 is 0 in float32: clamp_min(0), the same as the Pow->Mult "
                        "mutant (zero blocks take the -127 branch, subnormal ones clamp to -127)",
    "mxfp4:9:75:-126->-127": _SMALL,
    "mxfp4:9:75:-126->-125": _SMALL,
    "mxfp4:10:42:-127.0->-254.0": "the zero branch's value is clamped to -127 anyway",
    "mxfp4:10:42:-127.0->-128.0": "the zero branch's value is clamped to -127 anyway",
    "mxfp4:10:63:127->126": "e = floor(log2(amax)) - 2 is at most 125 for any finite float32 "
                            "amax, so the upper clamp never binds (the contract: finite, "
                            "computed in float32)",
    "mxfp4:10:63:127->128": "e is at most 125 for any finite float32 amax: the upper clamp "
                            "never binds",
    "mxfp4:10:63:127->254": "e is at most 125 for any finite float32 amax: the upper clamp "
                            "never binds",
    "mxfp4:11:8:Div->MulReciprocal": "2^e and 1 / 2^e are exact powers of two for e in "
                                     "[-127, 125], so w / 2^e == w * 2^-e, correctly rounded",
    "mxfp4:15:10:clamp->clamp_": _INPLACE,
    "mxfp4:15:22:Lt->LtE": _EDGE2,
    "mxfp4:16:34:Lt->LtE": _EDGE4,
    "mxfp4:16:73:Div->MulReciprocal": _HALF,
    "nvfp4:4:28:drop tuple()": _MSG,
    "nvfp4:7:9:drop .detach()": "the values are the same; only for a w that requires grad "
                                "would the scales carry autograd history, which the contract "
                                "does not speak of (the engine's quantize_nvfp4 keeps it too)",
    "nvfp4:12:48:Gt->GtE": _GUARD,
    "nvfp4:12:56:0->-1": _GUARD,
    "nvfp4:12:66:1.0x2": _GUARD,
    "nvfp4:12:66:1.0/2": _GUARD,
    "nvfp4:14:10:clamp->clamp_": _INPLACE,
    "nvfp4:14:22:Lt->LtE": _EDGE2,
    "nvfp4:15:34:Lt->LtE": _EDGE4,
    "nvfp4:15:73:Div->MulReciprocal": _HALF,
    "nvfp4:17:64:drop .float()": "the tensor scale is float32 already (a float32 amax / 2688, "
                                 "or torch.tensor(1.0))",
    "matmul:4:78:drop tuple()": _MSG,
    "matmul:5:42:drop tuple()": _MSG,
    "matmul:10:11:64->63": _TILE,
    "matmul:10:11:64->65": _TILE,
    "matmul:10:11:64->128": _TILE,
}
