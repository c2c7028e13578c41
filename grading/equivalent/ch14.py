"""Lab ch14: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_RANGE = ("with a group's scale = amax / 127, |w / scale| <= 127 up to an ulp (amax / "
          "(amax / 127) is within an ulp of 127), so round() never leaves [-127, 127] and "
          "no clamp bound above 127 or below -127 is ever reached")

EQUIVALENT = {
    "quantize_int8_group:4:10:drop .detach()": "the codes and scales take the same values; "
                                               "the engine's weights (and the tests') carry "
                                               "no grad",
    "quantize_int8_group:12:8:clamp->clamp_": "the in-place clamp acts on round()'s fresh "
                                              "result, never on w",
    "quantize_int8_group:12:41:-127->-128": _RANGE,
    "quantize_int8_group:12:47:127->128": _RANGE,
    "quantize_int8_group:12:47:127->254": _RANGE,
}
