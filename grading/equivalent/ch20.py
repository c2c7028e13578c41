"""Lab ch20: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_2D = "logits are [B, V] by the contract: dimension 1 is dimension -1"
_NEW = "the tensor filled in place is a new one (from sort or masked_fill): no input changes"
_IDS = ("token ids are lists of small non-negative ints by the contract: torch.tensor makes "
        "them int64 without dtype=, a list of a list is the same list, and an int32 index "
        "selects the same entries")

EQUIVALENT = {
    "top_k_top_p:3:8:drop early return": "with k and p both None, nothing is masked: the rest "
                                         "sorts, then scatters the same values back into a new "
                                         "tensor, equal to logits.clone()",
    "top_k_top_p:5:31:-1->1": _2D,
    "top_k_top_p:11:37:-1->1": _2D,
    "top_k_top_p:12:41:-1->1": _2D,
    "top_k_top_p:9:12:masked_fill->masked_fill_": _NEW,
    "top_k_top_p:15:12:masked_fill->masked_fill_": _NEW,
    "penalties:8:33:0->-1": "counts[r] is one-dimensional: dimension -1 is dimension 0",
    "penalties:8:36:drop dtype=": _IDS,
    "penalties:8:49:drop list()": _IDS,
    "penalties:8:76:int64->int32": _IDS,
    "penalties:11:20:drop dtype=": _IDS,
    "penalties:11:33:drop list()": _IDS,
    "penalties:11:60:int64->int32": _IDS,
    "penalties:15:44:Gt->GtE": "a logit of exactly 0 (or -0.0) is 0 both divided and multiplied "
                               "by the penalty, with the same sign",
    "penalties:15:53:Div->MulReciprocal": "x * (1/r) and x / r differ by at most an ulp of "
                                          "float32, under the stated 1e-5; the restore check "
                                          "samples from float32 probabilities where an ulp "
                                          "moves no draw in practice",
    "penalties:19:31:drop .float()": "a bool tensor times a float32 tensor promotes to float32: "
                                     "the same 0.0 and 1.0",
}
