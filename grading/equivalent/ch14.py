"""Lab ch14: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_RANGE = ("with scale = amax / 127, |w / scale| <= 127 (amax / (amax / 127) rounds to 127 at "
          "most): round() never leaves [-127, 127], so no clamp bound above 127 or below "
          "-127 is ever reached")
_MSG = "only the number quoted in the error message changes; the same k raise ValueError"

EQUIVALENT = {
    "quantize_int8:4:10:drop .detach()": "the codes and scales take the same values; the "
                                         "engine's weights (and the tests') carry no grad",
    "quantize_int8:8:8:clamp->clamp_": "the in-place clamp acts on round()'s fresh result",
    "quantize_int8:8:39:-127->-128": _RANGE,
    "quantize_int8:8:45:127->128": _RANGE,
    "quantize_int8:8:45:127->254": _RANGE,
    "dequantize_int8:2:11:drop .to()": "int8 * a float32 tensor promotes to float32: the "
                                       "same products, bit for bit",
    "dequantize_int8:2:33:drop dtype=": "the contract gives scale as float32 (a tensor): "
                                        "as_tensor keeps it float32",
    "outlier_channels:3:60:0->-1": _MSG,
    "outlier_channels:3:60:0->1": _MSG,
    "outlier_channels:4:11:drop .float()": "|w| of any float dtype ranks rows the same way "
                                           "(the amax values are the same numbers)",
    "outlier_channels:4:11:drop .detach()": "the ranking is the same; no grad is involved",
    "outlier_channels:6:11:drop .to()": "argsort already returns torch.long",
}
