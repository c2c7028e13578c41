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


# ------------------------------------------------------------ contract helpers
# What every lab's hidden tests need beyond "the number is right": inputs left as they
# were, a new object where one is promised, global state untouched (also when the
# learner's function raises), values compared with their types, bits compared exactly.

def snapshot(obj):
    """A deep copy to compute expectations from *before* the learner's call (a tensor is
    cloned, a container copied recursively), so an in-place change cannot hide itself."""
    import copy

    return copy.deepcopy(obj)


def _bits(t):
    """A float tensor's bit pattern (so -0.0 != 0.0 and NaN == NaN of the same payload)."""
    import torch

    if t.is_floating_point():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.detach().contiguous().view(width)
    return t.detach()


def _diff(a, b, path: str = "") -> str | None:
    """Where ``a`` and ``b`` differ (type, dtype, shape, a bit, a key), or None when they
    are the same value: tensors bit for bit, floats by their bits, containers recursively,
    element types included (an ``int`` is not a 0-d tensor, a ``float`` not an ``int``)."""
    import numpy
    import torch

    here = path or "the value"
    if type(a) is not type(b):
        return f"{here}: type {type(a).__name__}, expected {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return (f"{here}: {a.dtype} {tuple(a.shape)}, expected {b.dtype} {tuple(b.shape)}")
        if a.device != b.device:
            return f"{here}: on {a.device}, expected {b.device}"
        ba, bb = _bits(a.cpu()), _bits(b.cpu())
        if not torch.equal(ba, bb):
            idx = (ba != bb).nonzero()[0].tolist()
            return (f"{here}: differs at index {idx}: {a[tuple(idx)].item()!r}, expected "
                    f"{b[tuple(idx)].item()!r} ({int((ba != bb).sum())} elements differ)")
        return None
    if isinstance(a, numpy.ndarray):
        return _diff(torch.from_numpy(numpy.ascontiguousarray(a)),
                     torch.from_numpy(numpy.ascontiguousarray(b)), path)
    if isinstance(a, float):
        same = (a == b and math.copysign(1, a) == math.copysign(1, b)) or (a != a and b != b)
        return None if same else f"{here}: {a!r}, expected {b!r}"
    if isinstance(a, dict):
        if list(a) != list(b) and set(a) != set(b):
            return f"{here}: keys {sorted(map(repr, a))}, expected {sorted(map(repr, b))}"
        for k in b:
            d = _diff(a[k], b[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{here}: length {len(a)}, expected {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if hasattr(a, "__dict__") and not isinstance(a, type) and type(a).__eq__ is object.__eq__:
        return _diff(vars(a), vars(b), f"{path}.__dict__" if path else "the object")
    try:
        same = bool(a == b)
    except Exception:  # noqa: BLE001
        same = a is b
    return None if same else f"{here}: {a!r:.80}, expected {b!r:.80}"


def same(name: str, measured, expected) -> None:
    """``measured`` is ``expected`` exactly: same types all the way down, tensors with the
    same dtype, shape and bits (-0.0 is not 0.0), floats bit-equal."""
    d = _diff(measured, expected)
    if d:
        raise CheckFailed(f"{name}: {d}.")


def unchanged(name: str, after, before) -> None:
    """An input (``after``, the object the learner's code was given) still equals the
    :func:`snapshot` taken before the call."""
    d = _diff(after, before)
    if d:
        raise CheckFailed(f"{name} was changed by the call (the contract says inputs are "
                          f"left as they are; work on a copy): {d}.")


def _code_names(code) -> set[str]:
    """Every global/attribute name a code object (and the functions, lambdas and
    comprehensions nested in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def not_calling(name: str, fn, forbidden, why: str) -> None:
    """The learner's function ``fn`` refers to none of ``forbidden`` (functions or
    modules: the grader's reference, which the lab asks them to write themselves): not by
    a global bound to it or to its module (``from ... import f as g``; ``import m``),
    nor by an import inside the function (``from m import f``).

    A static check of the names ``fn``'s code uses, resolved in its globals; it does not
    follow calls into other functions of the learner's (a helper of theirs that calls the
    reference is checked by passing that helper too)."""
    import types

    mods = {getattr(f, "__module__", None) for f in forbidden if not isinstance(f, types.ModuleType)}
    mods |= {f.__name__ for f in forbidden if isinstance(f, types.ModuleType)}
    mods.discard(None)
    code = getattr(fn, "__code__", None)
    if code is None:
        raise CheckFailed(f"{name}: expected a Python function, got {type(fn).__name__}.")
    glb = getattr(fn, "__globals__", {})
    hits = []
    for n in sorted(_code_names(code)):
        obj = glb.get(n, getattr(builtins, n, None))
        if any(obj is f for f in forbidden) or (isinstance(obj, types.ModuleType)
                                                 and obj.__name__ in mods):
            hits.append(n)
        elif any(n == m or n == m.rsplit(".", 1)[-1] for m in mods):  # an import inside fn
            hits.append(n)
    if hits:
        raise CheckFailed(f"{name} uses {', '.join(hits)}: {why}")


def new_object(name: str, result, *inputs) -> None:
    """``result`` is none of ``inputs`` and, for tensors, shares no memory with them."""
    import torch

    for x in inputs:
        if result is x:
            raise CheckFailed(f"{name}: returned the object it was given; the contract "
                              "promises a new one (a caller may change either).")
        if (isinstance(result, torch.Tensor) and isinstance(x, torch.Tensor)
                and result.numel() and x.numel()
                and result.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()):
            raise CheckFailed(f"{name}: the result shares memory with an input (a view or "
                              "an in-place result); the contract promises a new tensor.")


def rng_state() -> tuple:
    """The global generators' states: torch's CPU generator, ``random``'s, numpy's."""
    import random

    import numpy
    import torch

    return (torch.get_rng_state().clone(), random.getstate(), numpy.random.get_state())


def rng_unchanged(name: str, before: tuple) -> None:
    import numpy
    import torch

    after = rng_state()
    parts = []
    if not torch.equal(after[0], before[0]):
        parts.append("torch's global generator (torch.manual_seed or an unseeded torch.rand*)")
    if after[1] != before[1]:
        parts.append("random's global generator (random.seed or random.random)")
    if not all(numpy.array_equal(x, y) if isinstance(x, numpy.ndarray) else x == y
               for x, y in zip(after[2], before[2])):
        parts.append("numpy's global generator")
    if parts:
        raise CheckFailed(f"{name} changed global random state: {', '.join(parts)}. Draw "
                          "from a torch.Generator of your own (or the one you are given) "
                          "so a caller's random stream is not disturbed.")


def hook_count(module) -> int:
    """Forward/backward hooks registered on ``module`` and its submodules, plus torch's
    global module hooks."""
    from torch.nn.modules import module as _mod

    n = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
            for m in module.modules())
    return n + sum(len(getattr(_mod, a, {})) for a in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks"))


def call(name: str, fn, *args, module=None, raises=None, **kwargs):
    """Call the learner's ``fn(*args, **kwargs)`` and check its side effects: every
    argument equals its :func:`snapshot` afterwards, the global generators are untouched,
    and (with ``module``) no hook was left registered. ``raises`` (an exception type or a
    tuple of them): the call must raise it, and the same checks hold after it raised.
    Returns the result (None when it raised as required)."""
    before_args, before_kw = snapshot(args), snapshot(kwargs)
    rng = rng_state()
    hooks = hook_count(module) if module is not None else None
    result, raised = None, None
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (checked below)
        if raises is None or not isinstance(e, raises):
            raise
        raised = e
    if raises is not None and raised is None:
        names = raises.__name__ if isinstance(raises, type) else \
            " or ".join(t.__name__ for t in raises)
        raise CheckFailed(f"{name}: expected {names}, but the call returned {result!r:.80}.")
    for i, (a, b) in enumerate(zip(args, before_args)):
        unchanged(f"{name}: argument {i + 1}", a, b)
    for k in kwargs:
        unchanged(f"{name}: argument {k}=", kwargs[k], before_kw[k])
    rng_unchanged(name, rng)
    if module is not None and hook_count(module) != hooks:
        raise CheckFailed(f"{name} left {hook_count(module) - hooks} hook(s) registered "
                          f"{'after raising' if raised else 'after returning'}; remove them "
                          "in a finally block.")
    return result


def bits_equal(name: str, measured, expected) -> None:
    """Two tensors of the same dtype and shape, bit for bit (the specified computation
    done exactly as specified)."""
    import torch

    if not isinstance(measured, torch.Tensor):
        raise CheckFailed(f"{name}: expected a tensor, got {type(measured).__name__}")
    d = _diff(measured, expected)
    if d:
        raise CheckFailed(f"{name}: not bit-identical to the specified computation: {d}.")


def op_dtypes(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and count the floating-point tensors that torch
    operations produced inside it, by dtype: ``(result, {dtype: count})``. A step the lab
    asks to compute in float32 shows float32 here, and no float64 (nor only 16-bit)."""
    import torch
    from torch.overrides import TorchFunctionMode

    seen: dict = {}

    class _Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    seen[t.dtype] = seen.get(t.dtype, 0) + 1
            return out

    with _Watch():
        result = fn(*args, **kwargs)
    return result, seen
