"""Lab ch12: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "residual_peaks:3:12:drop dtype=": "torch.zeros is float32 by default (the lab never "
                                       "changes torch's default dtype)",
    "residual_peaks:7:47:drop .float()": "torch.maximum of the float32 entry and a 16-bit "
                                         "0-d max promotes to float32, and a 16-bit value "
                                         "converts to float32 exactly: the same peak",
    "residual_peaks:7:47:drop .detach()": "the engine scores under torch.inference_mode: "
                                          "outputs carry no graph to detach from",
}
