"""Small helpers shared across the package: integer ceiling division, input checks for
the entry points, whether forward hooks watch a model (the paths that run no Python per module, CUDA
graphs and the deferred residual adds, step aside for them), and safetensors files written with
the modes of any other file the user creates."""

from __future__ import annotations

import os
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


def umask() -> int:
    """The process's umask, read without changing it where Linux reports it (changing it,
    even for an instant, would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, then the file's mode as ``open()`` would have made it
    (0666 less the umask): safetensors 0.8 writes through a private temporary file, so its
    files are 0600, unreadable to the other uids that share a converted model (a hub's
    learners, the grader's sandboxes)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~umask())
