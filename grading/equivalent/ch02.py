"""Lab ch02: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    # size_engine
    "size_engine:3:11:Lt[0]->LtE": "at gpu_memory_utilization 0 the share is 0 bytes, so "
                                   "the pool (0 - non_kv_bytes) // per_block <= 0 holds no "
                                   "request and the same ValueError is raised",
}
