"""The fp8 W8A8 linear as a step of the engine, and the static activation-scale rule.

vLLM: ``vllm/model_executor/layers/quantization/utils/w8a8_utils.py`` (``Fp8LinearOp``:
quantize the input, scaled GEMM) and ``.../quantization/fp8.py`` (``Fp8LinearMethod``,
whose ``input_scale`` holds a calibrated per-tensor scale when the checkpoint's
``activation_scheme`` is ``"static"``). The arithmetic is
:func:`minivllm.quantization.weight_quant.fp8_linear`; this module adds

* :func:`fp8_linear_ref`: the "fp8.linear" step's reference (:mod:`minivllm.steps`),
  what every fp8 linear layer computes with the arguments it hands the step (its static
  ``input_scale`` as delivered, or None);
* :func:`fp8_static_input_scale`: the calibration rule ``amax / 448`` behind that
  ``input_scale`` (the one ``layers/linear.py:Fp8Method.quantize`` applies; a test checks
  they agree), with an optional headroom factor.

Kept apart from ``weight_quant.py`` and ``layers/linear.py`` on purpose: those files are
part of the cached quantized checkpoints' code digest, and nothing here changes which
numbers a checkpoint holds.
"""

from __future__ import annotations

from typing import Optional

import torch

from minivllm.quantization import weight_quant as wq


def fp8_linear_ref(x: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor,
                   x_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The "fp8.linear" step's reference: the W8A8 e4m3 GEMM of
    :func:`~minivllm.quantization.weight_quant.fp8_linear` in x's dtype, with ``q_w``'s
    exact float32 copy kept on the tensor between calls (as the engine's own path keeps
    it on the layer), so the result is bit for bit the engine's.

    Args:
        x: [tokens, in_features] float activations (the layer flattens leading dims).
        q_w: float8_e4m3fn [out, in]; w_scale: float32 [] or [out, 1].
        x_scale: the layer's static input scale as delivered to the GEMM (float32 [],
            from the checkpoint's ``input_scale``), or None: dynamic per-token scales.
        bias: [out] or None.
    Returns:
        [tokens, out_features] in x's dtype.
    Raises:
        ValueError: as ``weight_quant.fp8_linear`` (wrong dtypes, shapes or scales).
    """
    cached = getattr(q_w, "_fp8_f32_cache", None)
    key = (q_w.data_ptr(), q_w.shape)
    if cached is None or cached[0] != key:
        cached = (key, q_w.to(torch.float32))
        setattr(q_w, "_fp8_f32_cache", cached)  # an attribute torch does not declare
    return wq.fp8_linear(x, q_w, w_scale, x_scale, bias, out_dtype=x.dtype,
                         q_w_float32=cached[1])


def fp8_static_input_scale(amax, headroom: float = 1.0) -> torch.Tensor:
    """A static (per-tensor) fp8 activation scale from calibration: what a checkpoint's
    ``input_scale`` holds (llm-compressor's min-max observer and this engine's
    ``Fp8Method.quantize`` compute ``amax / 448``).

    Args:
        amax: the largest |x| observed on the calibration data: a number, or a float
            tensor of observations (one per batch, per layer...; their max is taken);
            finite and >= 0.
        headroom: a finite number >= 1: the scale is made this much larger than the
            calibration data needs, so inputs up to ``headroom * amax`` still fit before
            they saturate, at the price of pushing values ``headroom`` times closer to the
            subnormals (1.0: the engine's rule).
    Returns:
        float32 ``[]``: ``(amax * headroom) / 448`` computed in float32, or 1.0 when amax
        is 0 (only zeros were seen, which any scale stores exactly; a scale is never 0).
    Raises:
        ValueError: amax empty, negative, NaN or inf; headroom not a finite number >= 1.
    """
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
            or not 1.0 <= headroom < float("inf"):
        raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}")
    a = torch.as_tensor(amax, dtype=torch.float32).detach().cpu()
    if a.numel() == 0 or not bool((torch.isfinite(a) & (a >= 0)).all()):
        raise ValueError(f"amax must be finite and >= 0 (at least one value), got "
                         f"{a.flatten().tolist()[:8]}")
    a = a.max()
    return torch.where(a > 0, a * float(headroom) / wq.FP8_MAX, torch.ones_like(a))
