"""Lab ch07: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "read_slots:2:10:drop dtype=": "torch.arange of an int gives int64 by default",
    "read_slots:2:38:int64->int32": "the contract gives read_slots a 1-D int64 table: "
                                    "int64 * int + int32 promotes to int64, same values "
                                    "(positions < 2^31)",
}
