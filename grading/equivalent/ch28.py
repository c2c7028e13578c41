"""Lab ch28: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "kv_bytes_per_token:5:58:drop sorted()": "only the order in which the error message "
                                             "lists the allowed names changes",
    "choose_config:9:31:Lt->LtE": "the key ends in the row index, unique per row, so no two "
                                  "keys are equal and <= picks what < picks",
    "choose_config:5:18:Div->MulReciprocal": "the task defines the step time, not an order "
                                             "of float operations; bytes / bandwidth and "
                                             "bytes * (1 / bandwidth) differ by an ulp, "
                                             "which only an SLA equal to one exact float "
                                             "could tell",
}
