"""Lab ch09: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_FRESH = "the in-place fill acts on a tensor the function just made (einsum's result)"
_TOTAL = ("a row with any allowed key has total >= 1 (its max contributes exp(0) = 1) and a "
          "fully masked row has total == 0: thresholds anywhere in [0, 1) and the guard's "
          "choice at total == 1 (dividing by 1 either way) give the same result")
_RECIP = ("e * (1 / total) differs from e / total by at most an ulp: the contract is a "
          "tolerance against float64 attention (1e-6, 1e-5, 4e-3), not the last bit")

EQUIVALENT = {
    "safe_softmax:9:23:Gt->GtE": "total == 0 only on a fully masked row, whose e is all 0: "
                                 "the division branch gives 0 / 1 = 0 there too",
    "safe_softmax:9:31:0->-1": "total >= 0 always: the same as total >= 0 (see Gt->GtE)",
    "safe_softmax:9:34:Div->MulReciprocal": _RECIP,
    "safe_softmax:9:50:Gt->GtE": "at total == 0 the outer where discards the division's NaN",
    "safe_softmax:9:58:0->-1": "at total == 0 the outer where discards the division's NaN",
    "safe_softmax:9:58:0->1": _TOTAL,
    "online_attention:16:16:masked_fill->masked_fill_": _FRESH,
    "online_attention:24:10:Div->MulReciprocal": _RECIP,
    "online_attention:24:32:0->1": _TOTAL.replace("total", "l"),
    "online_attention:25:11:drop .contiguous()": "the contract is the values of an [n, H, D] "
                                                 "float32 tensor, not its memory layout",
    "fp16_attention:8:12:masked_fill->masked_fill_": _FRESH,
    "fp16_attention:13:8:Div->MulReciprocal": _RECIP,
    "fp16_attention:13:32:0->1": _TOTAL,
}
