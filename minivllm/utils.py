"""Small helpers shared across the package: integer ceiling division, input checks for
the entry points, and whether forward hooks watch a model (the paths that run no Python per module, CUDA
graphs and the deferred residual adds, step aside for them)."""

from __future__ import annotations

from typing import Iterable

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers, ``ceil(a / b)`` without floats (vLLM: ``cdiv`` in
    ``vllm/utils``): blocks for ``a`` tokens at ``b`` per block, shards of ``a`` rows over
    ``b`` ranks."""
    return -(-a // b)


def check_valid_unicode(text: str, what: str) -> None:
    """Raise ValueError if ``text`` cannot be encoded as UTF-8 (a lone surrogate), naming
    ``what`` it is, the reason and the character position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {e.reason} at character {e.start} "
                         f"({text[e.start:e.end]!r})") from None


def hook_dicts(modules: Iterable[torch.nn.Module]) -> list[dict]:
    """The forward and forward-pre hook dicts of ``modules``: live objects, so a hook
    registered later shows up in them (keep the list, check it with
    :func:`forward_hooks_registered`)."""
    return [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]


def forward_hooks_registered(dicts: Iterable[dict]) -> bool:
    """True if any of ``dicts`` (from :func:`hook_dicts`) holds a hook, or a global module
    hook is set (``torch.nn.modules.module.register_module_forward_hook`` and its pre
    twin, which fire for every module)."""
    glob = torch.nn.modules.module
    return bool(glob._global_forward_hooks or glob._global_forward_pre_hooks or any(dicts))
