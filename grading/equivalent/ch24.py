"""Lab ch24: mutants of the reference solution that no test can tell from it, each with
why (grading/mutants.py: the harness, and what a claim must name)."""

_MSG = ("it changes only the ValueError's message; the contract asks for the ValueError "
        "(raised either way), not its wording")
_INT32 = ("the value is copied into the int32 buffer, which converts it: block ids and "
          "token ids are small ints, exact in int32 and int64 alike")

EQUIVALENT = {
    "pad_batch:4:62:drop sorted()": _MSG,
    "pad_batch:7:71:-1->-2": _MSG,
    "pad_batch:7:71:-1->0": _MSG,
    "pad_batch:7:71:-1->1": _MSG,
    "pad_batch:10:24:drop list()": "the inputs are lists by the contract: list + list is a "
                                   "new list, and the input is left unchanged either way",
    "write_static:4:42:drop dtype=": "copy_ converts to the buffer's dtype: ints and floats "
                                     "of the step's inputs are exact in it",
    "write_static:7:52:drop dtype=": _INT32,
    "write_static:7:76:int32->int64": _INT32,
}
