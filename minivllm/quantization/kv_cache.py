"""KV-cache storage formats and scales: how K and V are written to and read from the cache.

Float caches (float32/float16/bfloat16) store ``x.to(cache_dtype)``: round to nearest
even, overflow to inf in float16, no scale.

Quantized caches (fp8_e4m3, fp8_e5m2, int8) store ``q = Q(x / scale)`` and read back
``q * scale``:

* fp8: ``Q`` saturates to the format's largest finite value (448 for e4m3, 57344 for
  e5m2) and rounds to nearest even, as vLLM's CUDA cache kernels do
  (``__nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...)`` in ``csrc/quantization/fp8``);
  a plain cast gives inf for e5m2, and NaN or max for e4m3fn depending on the torch
  version (older releases NaN, 2.13 saturates), so we clamp first and never depend on it.
* int8: ``Q(y) = clamp(round_half_even(y), -127, 127)`` (symmetric, -128 unused).

Scale granularity (``kv_scale_type`` / ``kv_scale_granularity``):

* ``static`` + ``tensor``: one k_scale and one v_scale per layer (vLLM's
  ``layer._k_scale``/``_v_scale``). Default 1.0 for fp8 as in vLLM; given by
  ``kv_scale=(k, v)``; or calibrated (``calculate_kv_scales=True``).
* ``static`` + ``head``: one scale per KV head per layer ([num_kv_heads]); calibrated.
  A head whose keys have large outliers no longer forces a coarse grid on every head.
* ``static`` + ``channel``: K gets one scale per (KV head, channel), ``[num_kv_heads,
  head_dim]``; V one per tensor; calibrated. **Beyond vLLM** (which offers per tensor,
  and per head through llm-compressor's ``attn_head`` strategy): KIVI (Liu et al. 2024,
  arXiv:2402.02750) found that K's outliers sit in a few fixed channels, the same for
  every token, so a scale per channel isolates them while a per-tensor or per-head scale
  spreads their range over every channel; V has no such channels (KIVI quantizes V per
  token). Runs on the TORCH attention backend (the TRITON kernels take [] or [H] scales).
* ``dynamic``: one scale per token and KV head, computed from the values being written
  (``amax over head_dim / qmax``) and stored beside the cache in float32
  ``[num_slots, num_kv_heads]`` tensors (4 bytes per head per token, counted in the
  cache's size). Nothing to calibrate and nothing saturates.

Calibration (:func:`minivllm.quantization.kv_calibration.calibrate_kv_amax`) runs the
float model on calibration text and records per layer (and head) the largest |K| and |V|
(after rotary, i.e. what is stored); the scale is ``amax / qmax``. vLLM's
``calculate_kv_scales`` instead takes the first batch's amax and divides by fixed
headroom constants (``K_SCALE_CONSTANT=200``, ``V_SCALE_CONSTANT=100`` in
``vllm/envs.py``); we calibrate over a set so the range is known and use the whole grid.

fp8 tensors are indexed through a uint8 view because CPU torch lacks fp8 index kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# the storage rules live with the kernels that implement them (torch only; re-exported)
from minivllm_kernels.reference import (FP8_DTYPES, QUANTIZED_KV_DTYPES,  # noqa: F401
                               dequantize_kv, is_fp8, is_quantized, qmax, quantize_kv,
                               read_kv_slots, write_kv_slots)


def kv_scales_from_amax(amax: torch.Tensor, qmax_value: float) -> torch.Tensor:
    """Static KV scales from calibrated maxima: ``amax / qmax``, and 1.0 where amax is 0
    (a channel, head or layer that stored only zeros: any scale reads zeros back, and
    0 would divide by zero on the next write).

    Args:
        amax: largest |K| or |V| seen in calibration, float32, any shape ([] per tensor,
            [num_kv_heads] per head); finite and >= 0.
        qmax_value: the storage format's largest magnitude (:func:`qmax`: 448 for e4m3,
            57344 for e5m2, 127 for int8).
    Returns:
        float32 scales, the shape of ``amax``, so that ``amax / scale == qmax``: the
        calibrated maximum lands on the format's largest value.
    Raises:
        ValueError: qmax_value <= 0 or not finite, or amax negative or not finite.

    vLLM: ``calculate_kv_scales`` (``vllm/attention/layer.py``) divides the first batch's
    amax by headroom constants instead (``K_SCALE_CONSTANT`` = 200, ``V_SCALE_CONSTANT`` =
    100); llm-compressor's calibrated checkpoints store ``amax / qmax`` as here.
    """
    if not (isinstance(qmax_value, (int, float)) and 0 < float(qmax_value) < float("inf")):
        raise ValueError(f"qmax_value must be a finite positive number, got {qmax_value!r}")
    amax = amax.float()
    if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
        raise ValueError(f"amax must be finite and >= 0, got {amax.tolist()}")
    return torch.where(amax > 0, amax / float(qmax_value), torch.ones_like(amax))


@dataclass
class LayerKVCache:
    """One layer's paged K/V storage and its scales (the "KV pool" of one layer).

    Attributes:
        key, value: [num_slots, num_kv_heads, head_dim] in the storage dtype.
        k_scale, v_scale: static scales, float32, shape [] (per tensor),
            [num_kv_heads] (per head) or, K only, [num_kv_heads, head_dim] (per
            channel); 1.0 for float caches.
        k_scale_cache, v_scale_cache: dynamic per-token scales [num_slots, num_kv_heads]
            float32, or None for static scaling.
        quantize, dequantize: this layer's "kv.quantize" and "kv.dequantize" steps
            (:mod:`minivllm.steps`; references :func:`quantize_kv`, :func:`dequantize_kv`).
    """

    key: torch.Tensor
    value: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_scale_cache: Optional[torch.Tensor] = None
    v_scale_cache: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        self.quantize = quantize_kv
        self.dequantize = dequantize_kv
        self.set_scales(self.k_scale, self.v_scale)
        self.nonfinite_rows: Optional[torch.Tensor] = None
        # set (and kept) by the TORCH backend once a NaN/inf K or V has been stored
        self.may_hold_nonfinite = False

    def set_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Replace the static scales (float32, shape [], [num_kv_heads] or
        [num_kv_heads, head_dim])."""
        self.k_scale, self.v_scale = k_scale, v_scale
        # Broadcast forms, computed once (float(t) on CUDA would sync every layer/step).
        self._k_b, self._v_b = self._broadcast(k_scale), self._broadcast(v_scale)

    @property
    def dtype(self) -> torch.dtype:
        return self.key.dtype

    @property
    def dynamic(self) -> bool:
        return self.k_scale_cache is not None

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's K and V ([T, kv_heads, head_dim], compute dtype) at slots [T].

        int8 has no NaN or inf: a token whose K or V is not finite would be stored as a
        clamped number and its attention would look healthy. Such tokens are recorded in
        ``nonfinite_rows`` ([T] bool, read and cleared by the model runner), which marks
        their requests as corrupted."""
        self.note_nonfinite(k, v)
        for x, cache, static, dyn in ((k, self.key, self._k_b, self.k_scale_cache),
                                      (v, self.value, self._v_b, self.v_scale_cache)):
            if dyn is not None:
                # amax * (1/qmax): the same float32 on CPU and CUDA (see minivllm_kernels/reshape_and_cache)
                scale = x.detach().float().abs().amax(dim=-1) * (1.0 / qmax(cache.dtype))  # [T, H]
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
                dyn[slots] = scale
                q = self.quantize(x, cache.dtype, scale[..., None])
            else:
                q = self.quantize(x, cache.dtype, static)
            write_kv_slots(cache, slots, q)

    def note_nonfinite(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """int8 caches: record which of this step's tokens had NaN/inf K or V (a device
        sync; int8 caches therefore run without CUDA graphs). No-op for other dtypes."""
        if self.key.dtype == torch.int8:
            bad = ~(torch.isfinite(k).flatten(1).all(1) & torch.isfinite(v).flatten(1).all(1))
            if bool(bad.any()):
                self.nonfinite_rows = bad if self.nonfinite_rows is None \
                    else self.nonfinite_rows | bad

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather and dequantize slots (any shape [...]) -> K, V [..., kv_heads, head_dim]."""
        out = []
        for cache, static, dyn in ((self.key, self._k_b, self.k_scale_cache),
                                   (self.value, self._v_b, self.v_scale_cache)):
            stored = read_kv_slots(cache, slots)
            scale: torch.Tensor | float
            if dyn is not None:
                scale = read_kv_slots(dyn, slots)[..., None]
            else:
                scale = static
            out.append(self.dequantize(stored, dtype, scale))
        return out[0], out[1]

    @staticmethod
    def _broadcast(scale: torch.Tensor) -> torch.Tensor | float:
        if scale.ndim == 0 and scale.device.type == "cpu":
            value = float(scale)
            return 1.0 if value == 1.0 else scale
        if scale.ndim == 0:
            return scale
        if scale.ndim == 2:
            return scale  # per channel: [H, D] against [..., H, D]
        return scale[:, None]  # per head: [H, 1] against [..., H, D]


def kv_scale_bytes_per_token(num_kv_heads: int, dynamic: bool) -> int:
    """Extra bytes per token per layer for dynamic scales (K and V, float32 per head)."""
    return 2 * num_kv_heads * 4 if dynamic else 0
