"""Lab ch11: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_RECIP = ("a * (1 / b) differs from a / b by at most an ulp; the contract is the engine's "
          "inv_freq within 2^-21 relative (the rope formula in float32, not bit-exact)")
_CONT = ("the llama3 blend is continuous: at wavelen == L0 / low_freq_factor the ramp s is 0 "
         "and the blend is inv_freq / factor, at wavelen == L0 / high_freq_factor s is 1 and "
         "the blend is inv_freq, so either branch gives the same value (within an ulp)")
_INT = ("torch.arange of ints is int64; int64 / int is true division to float32 and "
        "torch.outer(int64, float32) promotes to float32, exact for positions < 2^24")

EQUIVALENT = {
    "llama3_inv_freq:5:14:Div->MulReciprocal": _RECIP,
    "llama3_inv_freq:6:8:Div->MulReciprocal": _RECIP,
    "llama3_inv_freq:6:9:Div->MulReciprocal": _RECIP,
    "llama3_inv_freq:7:14:Div->MulReciprocal": _RECIP,
    "llama3_inv_freq:8:22:Gt->GtE": _CONT,
    "llama3_inv_freq:8:32:Div->MulReciprocal": _RECIP,
    "llama3_inv_freq:8:54:Div->MulReciprocal": _RECIP,
    "llama3_inv_freq:9:23:Lt->LtE": _CONT,
    "llama3_inv_freq:9:33:Div->MulReciprocal": _RECIP,
    "rope_table:2:15:Div->MulReciprocal": "1.0 * (1.0 / x) is 1.0 / x, bit for bit",
    "rope_table:2:31:Div->MulReciprocal": _RECIP,
    "rope_table:2:31:drop dtype=": _INT,
    "rope_table:7:16:drop dtype=": _INT,
    "rope_table:9:42:-1->1": "angles is [positions, head_dim / 2] (2-D): dim 1 is dim -1",
}
