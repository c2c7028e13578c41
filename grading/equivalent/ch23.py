"""Lab ch23: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "chunk_schedule:2:34:1->0": "budget 0 still raises ValueError, from range()'s zero "
                                "step; the contract asks for a ValueError, not its message",
    "chunk_mask_and_slots:4:10:drop dtype=": "torch.arange of Python ints is int64 by default",
    "chunk_mask_and_slots:4:38:int64->int32": "the int64 block table promotes the slots to "
                                              "int64, and positions (< max_model_len) fit "
                                              "in int32 exactly; the mask compares values",
}
