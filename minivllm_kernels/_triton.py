"""Import Triton the way this project runs it: compiled on a CUDA machine, interpreted
elsewhere.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated with ``@triton.jit``. On a
machine without a CUDA GPU this module sets ``TRITON_INTERPRET=1`` before any kernel of
:mod:`minivllm_kernels` is defined, so every one of them runs in Triton's interpreter (NumPy, one program instance at a time: slow,
but the same source, and you can put ``print`` or a debugger in a kernel). Set
``TRITON_INTERPRET=1`` yourself to interpret on a GPU machine too.

Raises (at import):
    ImportError: Triton is not installed, or ``TRITON_INTERPRET=0`` was set on a machine
        without CUDA (nothing to compile for).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

import minivllm_kernels  # noqa: F401,E402  (sets TRITON_INTERPRET=1 on machines without CUDA)

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("minivllm's kernels need Triton: pip install 'triton>=3.0' "
                      "(Linux); on CPU it runs in its interpreter") from e

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if not INTERPRET and not torch.cuda.is_available():
    raise ImportError("TRITON_INTERPRET=0 but there is no CUDA GPU to compile Triton kernels "
                      "for; unset it (kernels then run in Triton's interpreter)")


if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(tl.zeros, JITFunction) and not isinstance(tl.zeros, InterpretedFunction):
        raise ImportError(
            "Triton was imported before TRITON_INTERPRET=1 was set, so its language "
            "functions were compiled-mode and cannot run in the interpreter. Import "
            "minivllm (or kernels) before torch/transformers, or set TRITON_INTERPRET=1 in "
            "the environment.")


def device_ok(*tensors: Optional[torch.Tensor]) -> None:
    """Raise ValueError unless the tensors can run here: CUDA tensors when compiling, CPU
    tensors in the interpreter."""
    want = "cpu" if INTERPRET else "cuda"
    for t in tensors:
        if t is not None and t.device.type != want:
            raise ValueError(f"Triton kernels here run on {want} tensors "
                             f"(TRITON_INTERPRET={'1' if INTERPRET else '0'}), got a "
                             f"{t.device.type} tensor")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


__all__ = ["triton", "tl", "INTERPRET", "device_ok", "next_pow2"]
