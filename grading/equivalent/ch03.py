"""Lab ch03: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_TEMP = "the in-place op acts on a temporary that nothing else holds"
_SHIFT_LO = ("shift = max(e, emin) - e + 23 - M >= 23 - M >= 1 for every format with M <= 22, "
             "and 0 only for M = 23; a lower clamp of -1 is never reached")

EQUIVALENT = {
    # decode_bits
    "decode:8:26:0->1": "for e == 1 both branches give 1: torch.where(e > 1, e, 1) == "
                        "torch.where(e > 0, e, 1) for e >= 0",
    "decode:10:10:drop .to()": "int64 * float64 promotes to float64: the same exact product",
    "decode:10:17:float64->float32": "sig < 2^24 is exact in float32 and the product is "
                                     "taken in float64 (float32 * float64 promotes)",
    # round_to
    "round_to:3:11:drop .detach()": "view(torch.int32) is allowed on a tensor that requires "
                                    "grad, and every later value comes from integer tensors: "
                                    "the same bits (the hidden test feeds such a tensor)",
    "round_to:3:11:drop .contiguous()": "view(torch.int32) keeps the element size, which torch "
                                        "allows on non-contiguous tensors: same bits",
    "round_to:10:12:clamp->clamp_": _TEMP,
    "round_to:10:33:0->-1": _SHIFT_LO,
    "round_to:10:36:30->29": "a shift of 25 or more already drops every bit of sig < 2^24 "
                             "and leaves rem = sig < half: 29 and 30 round alike",
    "round_to:15:19:drop .to()": "int32 + bool promotes to int32: the same sum",
    "round_to:15:25:int32->int64": "units < 2^25 either way, and units.to(float32) is the same",
    "round_to:16:34:clamp->clamp_": _TEMP,
    "round_to:16:54:1->0": "that branch is taken only where q >= -126, so q + 127 >= 1 and "
                           "the clamp never acts",
    "round_to:17:45:clamp->clamp_": _TEMP,
    "round_to:17:61:0->-1": "q >= -149 for every format that fits inside float32 (its "
                            "smallest subnormal is at least 2^-149), so q + 149 >= 0",
    "round_to:17:64:22->23": "that branch is taken only where q < -126, so q + 149 <= 22",
    "round_to:17:64:22->44": "that branch is taken only where q < -126, so q + 149 <= 22",
    "round_to:18:10:drop .to()": "int32 * float32 converts units to float32 exactly as .to does",
    "round_to:20:55:2139095040->2139095041": "0x7F800001 is a NaN pattern; the NaN line after "
                                            "it sets every NaN input, and inf inputs overflow "
                                            "val > max_normal anyway",
    "round_to:20:55:2139095040->4278190080": "no magnitude equals 0xFF000000; an inf input "
                                            "still overflows val > max_normal (2^128 = inf)",
    "round_to:21:22:drop dtype=": "a 0-d float64 tensor does not promote a float32 tensor in "
                                  "torch.where: the result stays float32 with the same value",
    "round_to:21:47:float32->float64": "a 0-d float64 tensor does not promote a float32 "
                                       "tensor in torch.where; +-inf, NaN and max_normal of "
                                       "a format inside float32 are float32 values",
    "round_to:22:40:drop dtype=": "a 0-d tensor does not promote in torch.where: NaN either way",
    "round_to:22:69:float32->float64": "a 0-d tensor does not promote in torch.where: NaN "
                                       "either way",
    "round_to:22:69:float32->bfloat16": "a 0-d tensor does not promote in torch.where: NaN "
                                        "either way",
    "round_to:23:30:0->-1": "bits == -1 is the pattern 0xFFFFFFFF, a NaN: only the sign of a "
                            "NaN changes, and the contract says NaN stays NaN, any sign",
    # kv_quantize_e4m3
    "kv_quantize:2:20:drop .float()": "the contract gives x as float32: .float() returns x",
}
