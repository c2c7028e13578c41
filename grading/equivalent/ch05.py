"""Lab ch05: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "invariant_decode_attention:17:48:-1->1": "x is [H, split] (2-D): dim 1 is dim -1",
    "invariant_decode_attention:20:38:-1->1": "p is [H, split] (2-D): dim 1 is dim -1",
    "invariant_decode_attention:23:17:drop .to()": "out is torch.empty_like(q): assigning "
                                                   "into it casts to q's dtype the same way",
    "invariant_decode_attention:23:18:Div->MulReciprocal": (
        "acc * (1 / s) and acc / s differ by at most an ulp per element, the same for a "
        "sequence whatever its batch: the contract is bitwise batch invariance (kept) and a "
        "tolerance against float64 (1e-5), and the lab's order of a split's own sums is not "
        "pinned down to the bit, so no bit-exact reference can be demanded"),
}
