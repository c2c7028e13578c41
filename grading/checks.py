"""Check helpers for the labs' test cells.

Every failure message teaches: what was expected, what was measured, by how much it
missed. Comparisons are done in plain Python floats on values the test cell computed
itself (never on numbers the learner stored), and :func:`guard` fails a test when the
learner's code has patched the functions the checks and the references rely on.

Test cells use them like this (the first, locked cell of a lab imports this module, which
records the original functions; each test cell reloads it)::

    import importlib, grading.checks as checks
    checks = importlib.reload(checks)
    checks.guard()
    checks.close("mean KL", measured=mean_kl(a, b), expected=ref, rtol=1e-6)
"""

from __future__ import annotations

import builtins
import math
import sys

# Functions a learner might patch to make every comparison pass. Their identities are
# recorded once per kernel, the first time this module is imported (reloading the module
# keeps the first record, stored on the sys module where reload does not reach).
_WATCHED = [
    ("torch", "allclose"), ("torch", "isclose"), ("torch", "equal"), ("torch", "log_softmax"),
    ("torch", "softmax"), ("torch", "exp"), ("torch", "sum"), ("torch", "testing"),
    ("numpy", "allclose"), ("numpy", "isclose"), ("numpy", "testing"),
    ("math", "isclose"), ("math", "isnan"), ("math", "isfinite"),
    ("builtins", "abs"), ("builtins", "float"), ("builtins", "max"), ("builtins", "min"),
    ("builtins", "isinstance"), ("builtins", "AssertionError"),
]
_KEY = "_minivllm_grading_originals"


def _lookup(mod_name: str, attr: str):
    mod = sys.modules.get(mod_name)
    return getattr(mod, attr, None) if mod is not None else None


def _record() -> dict:
    if not hasattr(sys, _KEY):
        import numpy  # noqa: F401  (imported so that their functions are recorded)
        import torch  # noqa: F401
        setattr(sys, _KEY, {(m, a): _lookup(m, a) for m, a in _WATCHED})
    return getattr(sys, _KEY)


_ORIGINALS = _record()


class CheckFailed(AssertionError):
    """A test failed; the message says expected, measured and by how much."""


def guard() -> None:
    """Fail if any watched function was replaced since the lab started."""
    changed = [f"{m}.{a}" for (m, a), f in _ORIGINALS.items() if _lookup(m, a) is not f]
    if changed:
        raise CheckFailed("The checking environment was modified: "
                          f"{', '.join(changed)} no longer the original function(s). "
                          "Tests cannot be trusted; remove the code that patches them.")


def _num(name: str, value) -> float:
    try:
        v = builtins.float(value)
    except (TypeError, ValueError):
        raise CheckFailed(f"{name}: expected a number, got {type(value).__name__}: {value!r:.80}")
    if math.isnan(v):
        raise CheckFailed(f"{name}: the result is NaN. A NaN usually comes from log(0), 0/0 or "
                          "inf - inf; check how you normalize the distributions.")
    return v


def close(name: str, measured, expected, rtol: float = 1e-6, atol: float = 0.0) -> None:
    """``|measured - expected| <= atol + rtol * |expected|``, in Python floats."""
    m, e = _num(name, measured), _num(f"{name} (reference)", expected)
    err = builtins.abs(m - e)
    allowed = atol + rtol * builtins.abs(e)
    if not err <= allowed:
        rel = err / builtins.abs(e) if e else math.inf
        raise CheckFailed(f"{name}: expected {e:.6g}, measured {m:.6g}; off by {err:.3g} "
                          f"(relative {rel:.2%}), allowed {allowed:.3g}.")


def at_most(name: str, measured, limit) -> None:
    m, lim = _num(name, measured), _num(f"{name} (limit)", limit)
    if not m <= lim:
        raise CheckFailed(f"{name}: must be at most {lim:.6g}, measured {m:.6g} "
                          f"({m - lim:.3g} over, {m / lim:.2f}x the limit).")


def equal(name: str, measured, expected) -> None:
    if not (type(measured) is type(expected) and measured == expected):
        raise CheckFailed(f"{name}: expected {expected!r}, got {measured!r}.")


def one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise CheckFailed(f"{name}: {value!r} is not one of {list(allowed)}.")
