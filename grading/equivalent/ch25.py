"""Lab ch25: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "shard_qkv:6:7:GtE->Gt": "at num_kv_heads == tp both branches give each rank one KV "
                             "head, the rank's own: num_kv_heads // tp * head_dim == head_dim "
                             "and rank // (tp // num_kv_heads) == rank, so the same rows",
}
