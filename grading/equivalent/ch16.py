"""Lab ch16: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_NO_GRAD = ("no input the lab or the engine passes requires grad (the engine quantizes "
            "under no_grad), so detach() changes nothing")

EQUIVALENT = {
    "hessian:2:10:drop .detach()": _NO_GRAD,
    "hessian:2:24:float64->float32": "the task allows float32 or float64; float32 sums of "
                                     "1000 rows err by ~1e-7 relative, under the stated 1e-5",
    "hessian:3:12:Div->MulReciprocal": "2 * (1/n) and 2/n differ by at most an ulp before "
                                       "the cast to float32; the tolerance is 1e-5",
    "gptq_quantize_layer:3:8:drop .detach()": _NO_GRAD,
    "gptq_quantize_layer:3:22:float32->float64": "a float64 sweep is allowed (the contract "
                                                 "asks for at least float32); measured: 0-7 "
                                                 "of 32,768 codes differ from the engine's",
    "gptq_quantize_layer:4:8:drop .to()": "H is float32 (hessian's contract) or float64: a "
                                          "float64 H is already float64, and a float32 one "
                                          "is promoted to float64 by the damping term (a "
                                          "float64 identity) before the inverse",
    "gptq_quantize_layer:4:8:drop .detach()": _NO_GRAD,
    "gptq_quantize_layer:4:22:float64->float32": "same as dropping .to(): the float64 "
                                                 "identity promotes the damped H to float64 "
                                                 "before the inverse; the dead-input test "
                                                 "compares with 0 exactly in either dtype",
    "gptq_quantize_layer:8:20:1.0x2": "a dead input's diagonal only enters mean(diag H) of "
                                      "the damping, by 1/in of a unit (its own error is 0): "
                                      "the contract leaves the placeholder open, and on "
                                      "activations (diag H ~10-1000) no code changes",
    "gptq_quantize_layer:8:20:1.0/2": "as 1.0x2: the placeholder diagonal of a dead input",
    "gptq_quantize_layer:19:52:drop dtype=": "a float32 identity added to the float64 damped "
                                             "H is promoted to float64; 1.0 and 0.0 are exact",
    "gptq_quantize_layer:19:74:float64->float32": "as dropping dtype=: the identity's 0s and 1s "
                                                  "are exact in float32 and promoted",
    "gptq_quantize_layer:21:8:drop .to()": "keeping U in float64 is a more precise sweep, "
                                           "which the contract allows (at least float32)",
    "gptq_quantize_layer:21:13:float32->float64": "as dropping .to(): a float64 U",
    "gptq_quantize_layer:32:14:Div->MulReciprocal": "x * (1/u) and x / u differ by an ulp: "
                                                    "the same as a different valid order of "
                                                    "the arithmetic, which the 0.1 % code "
                                                    "allowance is for",
    "heldout_error:2:21:drop .detach()": _NO_GRAD,
    "heldout_error:4:17:Div->MulReciprocal": "an ulp of float64, under the rtol of 1e-9",
    "settings:3:22:1.0/2": "PERCDAMP 0.5 is another right answer to the decision: the check "
                           "reads the measured KL, which 0.5 also brings under 0.95x RTN's",
    "settings:3:27:True->False": "PERCDAMP 1.0 without act-order is another right answer: "
                                 "the damping alone brings the KL under 0.95x RTN's; the "
                                 "check reads the measured KL, not a setting",
}
