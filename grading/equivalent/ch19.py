"""Lab ch19: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

EQUIVALENT = {
    "quantize_int8:2:23:clamp->clamp_": "x.float() / scale is a new tensor: clamping it in "
                                        "place touches no input",
    "choose_kv_config:4:15:min->max": "it changes only the error message's 'closest' "
                                      "configuration, which the task leaves optional ('if "
                                      "you like'); the ValueError is raised either way",
}
