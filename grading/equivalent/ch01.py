"""Lab ch01: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_TWO_D = ("the contract fixes ref and cand as [T, vocab] (2-D), where dim=1 is dim=-1; "
          "kv_drift and the restore check pass torch.cat of [T, vocab] scores")

EQUIVALENT = {
    "mean_kl:2:54:-1->1": _TWO_D,
    "mean_kl:3:55:-1->1": _TWO_D,
    "mean_kl:5:72:-1->1": _TWO_D,
}
