"""Weight quantization algorithms in plain PyTorch: int8, int4 (RTN, GPTQ, AWQ) and fp8.

Conventions used throughout:

* A weight is ``[out_features, in_features]`` like ``nn.Linear.weight``; ``y = x @ w.T``.
* All arithmetic is float32 whatever the input dtype. The one exception is GPTQ's Hessian
  inverse (damping, Cholesky, inverse, Cholesky), done in float64 and cast back to float32
  for the column sweep.
* int4 groups run along the input dimension: columns ``[g * group_size, (g+1) * group_size)``
  of a row share one scale and one zero point, as in GPTQ and AWQ checkpoints.
* int4 codes are ``torch.uint8`` holding 0..15 in both modes and dequantize as
  ``(q - zero) * scale``. Symmetric mode stores ``q_signed + 8`` with a constant zero 8
  (the GPTQ reference's ``zero = (maxq + 1) / 2``).
* Rounding is ``torch.round``, i.e. round half to even.
* A scale that would be 0 (all-zero tensor/row/group, or an amax so small that amax/qmax
  underflows) is replaced by 1.0: all codes then dequantize to exactly 0.

Sources:

* GPTQ: Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
  Pre-trained Transformers", arXiv:2210.17323; reference code github.com/IST-DASLab/gptq
  (``gptq.py`` ``GPTQ.fasterquant``, ``quant.py`` ``Quantizer.find_params``) and AutoGPTQ's
  ``static_groups`` option.
* AWQ: Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
  Acceleration", arXiv:2306.00978; AutoAWQ ``awq/quantize/quantizer.py``
  (``_search_best_scale``, ``_compute_best_clip``, ``pseudo_quantize_tensor``).
* fp8: vLLM ``vllm/model_executor/layers/quantization/fp8.py`` (``Fp8LinearMethod``),
  ``input_quant_fp8.py`` (``QuantFP8``) and ``utils/w8a8_utils.py`` (the torch fallback of
  the scaled GEMM). The vLLM layers for the int4 formats are ``gptq.py``/``gptq_marlin.py``
  and ``awq.py``/``awq_marlin.py`` in the same folder.
"""

from __future__ import annotations

import torch

INT8_QMAX = 127
INT4_MAX_CODE = 15
INT4_SYM_QMAX = 7
INT4_SYM_ZERO = 8
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# vLLM's floor for dynamic activation scales (QuantFP8: _FP8_MIN_SCALING_FACTOR).
FP8_MIN_DYNAMIC_SCALE = 1.0 / (FP8_MAX * 512.0)
AWQ_MIN_SCALE = 1e-4
AWQ_CLIP_ROW_CHUNK = 64
GRANULARITIES = ("tensor", "channel")
WEIGHT_LAYOUT = "[out_features, in_features]"
INPUT_LAYOUT = "[n_tokens, in_features]"


# --- argument checks -----------------------------------------------------------------------

def _float32_matrix(t: torch.Tensor, name: str, layout: str = WEIGHT_LAYOUT) -> torch.Tensor:
    """Check ``t`` is a non-empty, finite, 2-D float tensor and return it as float32
    (the same tensor when it already is float32: callers must not modify it in place)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.ndim != 2:
        raise ValueError(f"{name} must be 2-D {layout}, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    t32 = t.detach().to(torch.float32)
    n_bad = int((~torch.isfinite(t32)).sum())
    if n_bad:
        raise ValueError(f"{name} has {n_bad} non-finite value(s) (NaN or inf); "
                         f"quantization needs finite values")
    return t32


def _check_positive_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _check_bool(value: bool, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_group_size(group_size: int, in_features: int) -> int:
    """Validate group_size and return the number of groups per row,
    ``ceil(in_features / group_size)``: when group_size does not divide in_features the
    last group is shorter (SmolLM2's hidden size 576 = 4 x 128 + 64)."""
    _check_positive_int(group_size, "group_size")
    return -(-in_features // group_size)


def _grouped(w: torch.Tensor, group_size: int, fill: str = "edge") -> torch.Tensor:
    """``w [..., in]`` -> ``[..., n_groups, group_size]``. A short last group is padded by
    repeating its last column (``fill="edge"``: min, max and amax are unchanged) or with
    zeros (``fill="zero"``: no contribution to sums)."""
    in_features = w.shape[-1]
    pad = -in_features % group_size
    if pad:
        extra = w[..., -1:].expand(*w.shape[:-1], pad) if fill == "edge" \
            else w.new_zeros(*w.shape[:-1], pad)
        w = torch.cat([w, extra], dim=-1)
    return w.reshape(*w.shape[:-1], -1, group_size)


def _per_column(t: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """Per-group values ``[out, n_groups]`` -> per-column ``[out, in_features]``."""
    return t.repeat_interleave(group_size, dim=1)[:, :in_features]


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def _check_shape(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must have shape {list(shape)}, got {got}")


def _check_codes(q: torch.Tensor, name: str = "q") -> None:
    """int4 codes: a 2-D uint8 tensor with values 0..15."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.ndim != 2:
        got = (f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor)
               else type(q).__name__)
        raise ValueError(f"{name} must be a 2-D torch.uint8 tensor of int4 codes, got {got}")
    if q.numel() and int(q.max()) > INT4_MAX_CODE:
        raise ValueError(f"{name} holds values up to {int(q.max())}; int4 codes are 0..15")


def _check_scale_tensor(scale: torch.Tensor, name: str, out_features: int) -> torch.Tensor:
    """A per-tensor ([] or one element) or per-channel ([out, 1]) positive finite scale."""
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
    if scale.numel() != 1 and tuple(scale.shape) != (out_features, 1):
        raise ValueError(f"{name} must have shape [] (per tensor) or [{out_features}, 1] "
                         f"(per channel), got {tuple(scale.shape)}")
    s32 = scale.detach().to(torch.float32)
    if not bool(torch.isfinite(s32).all() & (s32 > 0).all()):
        raise ValueError(f"{name} must be positive and finite")
    return s32 if s32.numel() != 1 else s32.reshape(())


# --- shared scale helpers ------------------------------------------------------------------

def _absmax_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``amax / qmax``, with 1.0 wherever that is 0 (see the module docstring)."""
    scale = amax / qmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _amax(w: torch.Tensor, granularity: str) -> torch.Tensor:
    """|w| max over the whole tensor (shape []) or per output row (shape [out, 1])."""
    if granularity == "tensor":
        return w.abs().amax()
    return w.abs().amax(dim=1, keepdim=True)


# --- int8 ----------------------------------------------------------------------------------

def quantize_int8(w: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 round-to-nearest weight quantization (W8 of vLLM's W8A8 layers).

    Args:
        w: ``[out, in]`` float weight (any float dtype; computed in float32).
        granularity: ``"tensor"`` (one scale) or ``"channel"`` (one scale per output row).

    Returns:
        ``q``: torch.int8 ``[out, in]``; ``scale``: float32, shape ``[]`` or ``[out, 1]``.

    Formula: ``scale = amax / 127`` (1.0 where that is 0),
    ``q = clamp(round_half_even(w / scale), -127, 127)``. The code -128 is never used, so
    the grid is symmetric. Round-trip error ``|w - q * scale| <= scale / 2``.

    Raises:
        ValueError: w not a finite non-empty 2-D float tensor; unknown granularity.
    """
    w32 = _float32_matrix(w, "w")
    _check_granularity(granularity)
    scale = _absmax_scale(_amax(w32, granularity), INT8_QMAX)
    q = torch.round(w32 / scale).clamp(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale`` -> float32 ``[out, in]``.

    Args:
        q: torch.int8 ``[out, in]``.
        scale: float, shape ``[]`` or ``[out, 1]`` (as returned by quantize_int8).

    Raises:
        ValueError: q not 2-D int8; scale of another shape, not positive or not finite.
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.ndim != 2:
        raise ValueError("q must be a 2-D torch.int8 tensor [out_features, in_features]")
    return q.to(torch.float32) * _check_scale_tensor(scale, "scale", q.shape[0])



def quantize_int8_group(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output row and group of ``group_size`` input
    columns (the int8 form of GPTQ/AWQ's groups; compressed-tensors' ``strategy="group"``).

    Args:
        w: ``[out, in]`` float weight (any float dtype; computed in float32).
        group_size: input columns per group; when it does not divide ``in`` the last group
            is shorter (576 = 4 x 128 + 64).

    Returns:
        ``q``: torch.int8 ``[out, in]``; ``scale``: float32 ``[out, ceil(in / group_size)]``.

    Formula per group: ``scale = amax / 127`` (1.0 where that is 0),
    ``q = clamp(round_half_even(w / scale), -127, 127)``. Storage: ``out * in`` bytes of
    codes plus ``4 * out * ceil(in / group_size)`` bytes of scales. A group as wide as the
    row gives quantize_int8(w, "channel")'s codes and scales (as ``[out, 1]``).

    Raises:
        ValueError: w not a finite non-empty 2-D float tensor; group_size not a positive int.
    """
    w32 = _float32_matrix(w, "w")
    _check_group_size(group_size, w32.shape[1])
    scale = _absmax_scale(_grouped(w32, group_size).abs().amax(dim=-1), INT8_QMAX)
    q = torch.round(w32 / _per_column(scale, group_size, w32.shape[1]))
    return q.clamp(-INT8_QMAX, INT8_QMAX).to(torch.int8), scale


def dequantize_int8_group(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q * scale`` per group -> float32 ``[out, in]`` (inverse of quantize_int8_group).

    Raises:
        ValueError: q not 2-D int8; group_size not a positive int; scale not float
            ``[out, ceil(in / group_size)]``.
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.ndim != 2:
        raise ValueError("q must be a 2-D torch.int8 tensor [out_features, in_features]")
    n_groups = _check_group_size(group_size, q.shape[1])
    _check_shape(scale, "scale", (q.shape[0], n_groups))
    return q.to(torch.float32) * _per_column(scale.to(torch.float32), group_size, q.shape[1])

# --- int4 round to nearest -----------------------------------------------------------------

def _int4_group_params(wg: torch.Tensor, symmetric: bool,
                       ratio: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (both float32, integer-valued zero) of groups ``wg [..., g]``,
    one pair per group (shape ``[...]``). ``ratio [...]`` shrinks each group's range."""
    if symmetric:
        amax = wg.abs().amax(dim=-1)
        if ratio is not None:
            amax = amax * ratio
        return _absmax_scale(amax, INT4_SYM_QMAX), torch.full_like(amax, INT4_SYM_ZERO)
    lo = wg.amin(dim=-1).clamp(max=0.0)
    hi = wg.amax(dim=-1).clamp(min=0.0)
    if ratio is not None:
        lo, hi = lo * ratio, hi * ratio
    if not bool(torch.isfinite(hi - lo).all()):
        raise ValueError("a group's weight range max - min overflows float32 (|w| near "
                         "3.4e38); such weights cannot be given an int4 scale")
    scale = _absmax_scale(hi - lo, INT4_MAX_CODE)
    zero = torch.round(-lo / scale).clamp(0, INT4_MAX_CODE)
    return scale, zero


def _int4_encode(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Codes ``clamp(round(w / scale) + zero, 0, 15)`` (float32). With zero = 8 this is
    ``clamp(round(w / scale), -8, 7) + 8``, the symmetric formula."""
    return (torch.round(w / scale) + zero).clamp(0, INT4_MAX_CODE)


def _int4_decode(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (q - zero) * scale


def _check_clip_ratio(clip_ratio: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    _check_shape(clip_ratio, "clip_ratio", shape)
    r32 = clip_ratio.detach().to(torch.float32)
    if not bool(((r32 > 0) & (r32 <= 1)).all()):
        raise ValueError("clip_ratio values must lie in (0, 1]")
    return r32


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool,
                  clip_ratio: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise int4 round-to-nearest (RTN) quantization, GPTQ/AWQ checkpoint layout.

    Args:
        w: ``[out, in]`` float weight.
        group_size: input columns per group; when it does not divide ``in`` the last group is shorter.
        symmetric: True for a symmetric grid with constant zero 8, False for a per-group
            integer zero point.
        clip_ratio: optional float ``[out, ceil(in / group_size)]``, values in (0, 1]; each
            group's range is multiplied by it before its scale is computed (AWQ clip).
            Values beyond the shrunk range saturate at the end codes.

    Returns:
        ``q`` uint8 ``[out, in]`` (0..15), ``scale`` float32 ``[out, ceil(in / group_size)]``,
        ``zero`` uint8 ``[out, ceil(in / group_size)]``. Dequantize with dequantize_int4.

    Formulas (per group, r = clip_ratio or 1):
        symmetric: ``scale = r * amax / 7``, ``q = clamp(round(w / scale), -8, 7) + 8``,
        ``zero = 8`` (AutoAWQ's zero_point=False grid; -8 is only reached when clipping).
        asymmetric: ``lo = r * min(min(w), 0)``, ``hi = r * max(max(w), 0)``,
        ``scale = (hi - lo) / 15``, ``zero = clamp(round(-lo / scale), 0, 15)``,
        ``q = clamp(round(w / scale) + zero, 0, 15)``. The range always contains 0, as in
        the GPTQ reference's find_params, so 0 is exactly representable and the zero point
        needs no clamping; a group of one sign would otherwise have its zero point clamped
        and lose most of its grid.
        A zero-range group gets scale 1 (codes 8 resp. 0, dequantizing to 0).

    Error bound without clipping: ``|w - dequant| <= scale / 2`` in both modes. For the
    asymmetric grid, the integer zero point shifts the grid by ``|e| <= 1/2`` step against
    [lo, hi], so one end of the range can stick out of the grid by up to scale / 2; those
    values saturate at the end code, still within scale / 2.

    Raises:
        ValueError: w not a finite non-empty 2-D float tensor; group_size not a positive
            int; symmetric not a bool; clip_ratio of the wrong shape or with
            values outside (0, 1].
    """
    w32 = _float32_matrix(w, "w")
    out_features, in_features = w32.shape
    n_groups = _check_group_size(group_size, in_features)
    _check_bool(symmetric, "symmetric")
    ratio = None if clip_ratio is None else _check_clip_ratio(clip_ratio, (out_features, n_groups))
    scale, zero = _int4_group_params(_grouped(w32, group_size), symmetric, ratio)
    q = _int4_encode(w32, _per_column(scale, group_size, in_features),
                     _per_column(zero, group_size, in_features))
    return q.to(torch.uint8), scale, zero.to(torch.uint8)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """``(q - zero) * scale`` per group -> float32 ``[out, in]``.

    Args:
        q: uint8 codes ``[out, in]`` (0..15, unpacked).
        scale: float ``[out, ceil(in / group_size)]``.
        zero: integer zero points ``[out, ceil(in / group_size)]`` (uint8 from quantize_int4).
        group_size: input columns per group.

    Raises:
        ValueError: q not 2-D uint8 with values <= 15; group_size not a positive int; scale or
            zero of the wrong shape.
    """
    _check_codes(q)
    out_features, in_features = q.shape
    n_groups = _check_group_size(group_size, in_features)
    _check_shape(scale, "scale", (out_features, n_groups))
    _check_shape(zero, "zero", (out_features, n_groups))
    return _int4_decode(q.to(torch.float32),
                        _per_column(scale.to(torch.float32), group_size, in_features),
                        _per_column(zero.to(torch.float32), group_size, in_features))


# --- int4 packing --------------------------------------------------------------------------

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two int4 codes per byte: uint8 ``[out, in]`` (0..15, in even) -> uint8 ``[out, in // 2]``.

    Byte ``j`` of a row holds column ``2j`` in its low nibble and column ``2j + 1`` in its
    high nibble: ``packed = q[:, 0::2] | (q[:, 1::2] << 4)``. (GPTQ checkpoints pack eight
    codes into an int32 along ``in`` and AWQ interleaves the order; this is the plain
    byte layout.)

    Raises:
        ValueError: q not 2-D uint8; a value above 15; odd in_features.
    """
    _check_codes(q)
    if q.shape[1] % 2:
        raise ValueError(f"in_features must be even to pack two codes per byte, got {q.shape[1]}")
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: uint8 ``[out, in // 2]`` -> uint8 ``[out, in]`` (0..15).

    Raises:
        ValueError: packed not a 2-D uint8 tensor.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.ndim != 2:
        raise ValueError("packed must be a 2-D torch.uint8 tensor [out_features, in_features // 2]")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])


# --- GPTQ ----------------------------------------------------------------------------------

def accumulate_hessian(hessian: torch.Tensor | None, x: torch.Tensor,
                       n_seen: int) -> tuple[torch.Tensor, int]:
    """Add a calibration batch to GPTQ's Hessian ``H = 2/n * X^T X`` (running mean).

    Args:
        hessian: float32 ``[in, in]`` over the ``n_seen`` tokens so far, or None to start.
        x: layer inputs ``[n_tokens, in]`` (flatten batch and sequence first).
        n_seen: tokens already in ``hessian`` (0 when it is None).

    Returns:
        A new float32 ``[in, in]`` Hessian over ``n_seen + n_tokens`` tokens, and that count.

    Formula (reference ``GPTQ.add_batch``, float32):
    ``H <- H * n_seen / n + (2 / n) * x^T x`` with ``n = n_seen + n_tokens``.

    Raises:
        ValueError: x not a finite non-empty 2-D float tensor; hessian of the wrong shape;
            n_seen negative or inconsistent with hessian being None.
    """
    x32 = _float32_matrix(x, "x", INPUT_LAYOUT)
    in_features = x32.shape[1]
    if isinstance(n_seen, bool) or not isinstance(n_seen, int) or n_seen < 0:
        raise ValueError(f"n_seen must be a non-negative int, got {n_seen!r}")
    if hessian is None:
        if n_seen:
            raise ValueError(f"n_seen must be 0 when hessian is None, got {n_seen}")
        hessian = torch.zeros(in_features, in_features)
    _check_shape(hessian, "hessian", (in_features, in_features))
    n_total = n_seen + x32.shape[0]
    h = hessian.to(torch.float32) * (n_seen / n_total) + (x32.T @ x32) * (2.0 / n_total)
    return h, n_total


def hessian_from_inputs(x: torch.Tensor) -> torch.Tensor:
    """GPTQ Hessian ``2/n * x^T x`` (float32 ``[in, in]``) of inputs ``x [n_tokens, in]``.

    Raises:
        ValueError: as accumulate_hessian.
    """
    return accumulate_hessian(None, x, 0)[0]


def _float64_hessian(hessian: torch.Tensor, in_features: int) -> torch.Tensor:
    """A float64 copy of a finite, (numerically) symmetric ``[in, in]`` Hessian."""
    _check_shape(hessian, "hessian", (in_features, in_features))
    h = hessian.detach().to(torch.float64, copy=True)
    if not bool(torch.isfinite(h).all()):
        raise ValueError("hessian has non-finite values (NaN or inf)")
    if float((h - h.T).abs().max()) > 1e-3 * float(h.abs().max()):
        raise ValueError("hessian must be symmetric (2/n * X^T X of the layer inputs)")
    return h


def _gptq_inverse_cholesky(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * I)^-1``, damp = percdamp * mean(diag(H)).

    Float64 throughout, float32 out. Raises ValueError when a factorization fails."""
    damp = percdamp * torch.diagonal(h).mean()
    h = h + damp * torch.eye(h.shape[0], dtype=h.dtype)
    advice = (f"the damped Hessian is not positive definite with percdamp={percdamp}; "
              f"use more calibration tokens (at least in_features, from varied text) or a "
              f"larger percdamp (e.g. 0.1)")
    lower, info = torch.linalg.cholesky_ex(h)
    if int(info):
        raise ValueError(f"GPTQ: Cholesky of H failed ({advice})")
    upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
    if int(info):
        raise ValueError(f"GPTQ: Cholesky of H^-1 failed ({advice})")
    return upper.to(torch.float32)


def _updated_columns(w: torch.Tensor, w_block: torch.Tensor, err_block: torch.Tensor,
                     hinv: torch.Tensor, i1: int, start: int, stop: int) -> torch.Tensor:
    """Columns ``start:stop`` (processing order) with every error update so far applied.

    Inside the current block ``[i1, i2)`` those are the eagerly updated ``w_block``
    columns; beyond it, ``w`` still lacks the block's pending lazy update
    ``err_block @ hinv[i1:i2, ...]`` (columns of err_block not yet reached are 0)."""
    i2 = i1 + w_block.shape[1]
    inside = w_block[:, start - i1:min(stop, i2) - i1]
    if stop <= i2:
        return inside
    pending = w[:, i2:stop] - err_block @ hinv[i1:i2, i2:stop]
    return torch.cat([inside, pending], dim=1)


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool,
                  act_order: bool = False, block_size: int = 128, percdamp: float = 0.01
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ int4 quantization (Frantar et al. 2022, arXiv:2210.17323, Algorithm 1).

    Args:
        w: ``[out, in]`` float weight.
        hessian: ``[in, in]`` = ``2/n * X^T X`` over calibration inputs ``X [n, in]``
            (hessian_from_inputs / accumulate_hessian).
        group_size: input columns per group; when it does not divide ``in`` the last group is shorter.
        symmetric: grid as in quantize_int4.
        act_order: process columns in order of decreasing ``diag(H)`` (AutoGPTQ desc_act).
        block_size: columns per lazy-batch block (reference default 128).
        percdamp: diagonal dampening as a fraction of ``mean(diag(H))``.

    Returns:
        ``(q, scale, zero)`` exactly as quantize_int4 returns them (original column
        order, contiguous groups): dequantize with dequantize_int4.

    Algorithm (reference ``GPTQ.fasterquant``):
        1. Dead inputs (``H[i, i] == 0``, never active in calibration) get ``H[i, i] = 1``
           and ``w[:, i] = 0``.
        2. ``H += percdamp * mean(diag(H)) * I``; ``U = cholesky(H^-1, upper)`` (float64,
           then float32 for the sweep, which is float32 like the reference).
        3. For each column i in order: ``q_i = quant(w_i)``,
           ``err = (w_i - dequant(q_i)) / U[i, i]``, ``w_j -= err * U[i, j]`` for j > i.
           Updates inside a block of ``block_size`` columns are applied at once; later
           columns receive the block's updates as one matmul at the block's end (lazy
           batch), which is the same arithmetic regrouped.
        Group parameters: without act_order, a group's scale/zero come from its columns'
        current (error-updated) values when the sweep reaches its first column. Within a
        block the reference reads the outer ``W``, which lacks the current block's updates
        when a group starts mid-block; here every update so far is applied, so the result
        does not depend on block_size except through float rounding. With act_order,
        AutoGPTQ's ``static_groups=True``: all group parameters come from the original
        weights up front and each column uses its own group's, so the checkpoint keeps
        contiguous groups and needs no ``g_idx``.
        The symmetric grid is quantize_int4's (scale = amax/7); the reference's
        symmetric grid is ``scale = 2 * amax / 15`` with zero 8.

    Raises:
        ValueError: bad w/group_size/symmetric (as quantize_int4); hessian not a finite
            symmetric ``[in, in]`` tensor; act_order not a bool; block_size not a positive
            int; percdamp negative or not finite; Cholesky failure after damping (the
            message advises more calibration data or a larger percdamp).
    """
    w32 = _float32_matrix(w, "w").clone()
    out_features, in_features = w32.shape
    n_groups = _check_group_size(group_size, in_features)
    _check_bool(symmetric, "symmetric")
    _check_bool(act_order, "act_order")
    _check_positive_int(block_size, "block_size")
    if not (isinstance(percdamp, (int, float)) and 0 <= percdamp < float("inf")):
        raise ValueError(f"percdamp must be a finite number >= 0, got {percdamp!r}")
    h = _float64_hessian(hessian, in_features)

    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w32[:, dead] = 0.0

    if act_order:
        scale, zero = _int4_group_params(_grouped(w32, group_size), symmetric, None)
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    else:
        scale = torch.ones(out_features, n_groups)
        zero = torch.zeros(out_features, n_groups)
        perm = torch.arange(in_features)
    hinv = _gptq_inverse_cholesky(h[perm][:, perm], percdamp)
    wp = w32[:, perm]
    group_of = (perm // group_size).tolist()
    codes = torch.empty(out_features, in_features)

    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        w_block = wp[:, i1:i2].clone()
        err_block = torch.zeros_like(w_block)
        hinv_block = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            g = group_of[j]
            if not act_order and j % group_size == 0:
                cols = _updated_columns(wp, w_block, err_block, hinv, i1, j, j + group_size)
                scale[:, g], zero[:, g] = _int4_group_params(cols, symmetric, None)
            col = w_block[:, i]
            q = _int4_encode(col, scale[:, g], zero[:, g])
            codes[:, j] = q
            err = (col - _int4_decode(q, scale[:, g], zero[:, g])) / hinv_block[i, i]
            w_block[:, i:] -= torch.outer(err, hinv_block[i, i:])
            err_block[:, i] = err
        wp[:, i2:] -= err_block @ hinv[i1:i2, i2:]

    codes = codes[:, torch.argsort(perm)]
    return codes.to(torch.uint8), scale, zero.to(torch.uint8)


# --- AWQ -----------------------------------------------------------------------------------

def _awq_scale(x_mean: torch.Tensor, ratio: float) -> torch.Tensor:
    """AutoAWQ: ``s = clamp(x_mean^ratio, 1e-4)``, normalised by ``sqrt(max(s) * min(s))``."""
    s = x_mean.pow(ratio).clamp(min=AWQ_MIN_SCALE)
    return s / torch.sqrt(s.max() * s.min())


def _rtn_dequant(w: torch.Tensor, group_size: int, symmetric: bool,
                 clip_ratio: torch.Tensor | None = None) -> torch.Tensor:
    return dequantize_int4(*quantize_int4(w, group_size, symmetric, clip_ratio), group_size)


def _awq_loss(weights: list[torch.Tensor], refs: list[torch.Tensor], x: torch.Tensor,
              s: torch.Tensor, group_size: int, symmetric: bool) -> float:
    """Sum over weights of ``mean((x @ W^T - (x / s) @ Q(W * s)^T)^2)``."""
    xs = x / s
    return sum(float((xs @ _rtn_dequant(w * s, group_size, symmetric).T - ref).pow(2).mean())
               for w, ref in zip(weights, refs))


def _check_awq_inputs(weights: list[torch.Tensor], x: torch.Tensor,
                      group_size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    x32 = _float32_matrix(x, "x", INPUT_LAYOUT)
    in_features = x32.shape[1]
    if not isinstance(weights, (list, tuple)) or not weights:
        raise ValueError("weights must be a non-empty list of [out_features, in_features] tensors")
    ws = [_float32_matrix(w, f"weights[{k}]") for k, w in enumerate(weights)]
    for k, w in enumerate(ws):
        if w.shape[1] != in_features:
            raise ValueError(f"weights[{k}] has in_features={w.shape[1]} but x has "
                             f"{in_features} columns")
    _check_group_size(group_size, in_features)
    return ws, x32


def awq_search_scale(weights: list[torch.Tensor], x: torch.Tensor, group_size: int,
                     symmetric: bool, n_grid: int = 20) -> tuple[torch.Tensor, dict]:
    """AWQ per-input-channel scale search (Lin et al. 2023, arXiv:2306.00978, Sec. 3.2;
    AutoAWQ ``_search_best_scale`` without duo_scaling).

    Args:
        weights: ``[out_k, in]`` weights that all read the same input (e.g. q/k/v).
        x: calibration activations ``[n_tokens, in]`` entering those layers.
        group_size, symmetric: the int4 RTN grid (quantize_int4).
        n_grid: ratios ``k / n_grid`` for k = 0..n_grid-1 (the grid in [0, 1)).

    Returns:
        ``s``: float32 ``[in]``; the engine stores ``quantize(W * s)`` and computes
        ``(x / s) @ dequant^T``. ``info``: ``best_ratio``, ``best_loss``, ``rtn_loss``
        (loss at s = 1) and ``losses`` (one per ratio), all Python floats.

    Formula: ``x_mean = mean(|x|, tokens)``; per ratio,
    ``s = clamp(x_mean^ratio, 1e-4) / sqrt(max(s) * min(s))`` and
    ``loss = sum_k mean((x @ W_k^T - (x / s) @ Q(W_k * s)^T)^2)`` with Q = int4 RTN
    quantize-dequantize. The smallest loss wins (ties keep the earlier ratio). Ratio 0
    gives s = 1 exactly, so ``best_loss <= rtn_loss``.

    Raises:
        ValueError: weights empty or not finite 2-D float tensors with x's in_features;
            x not a finite 2-D float tensor; bad group_size/symmetric; n_grid not positive.
    """
    ws, x32 = _check_awq_inputs(weights, x, group_size)
    _check_bool(symmetric, "symmetric")
    _check_positive_int(n_grid, "n_grid")
    x_mean = x32.abs().mean(dim=0)
    refs = [x32 @ w.T for w in ws]
    losses: list[float] = []
    best_k = 0
    for k in range(n_grid):
        losses.append(_awq_loss(ws, refs, x32, _awq_scale(x_mean, k / n_grid),
                                group_size, symmetric))
        if losses[k] < losses[best_k]:
            best_k = k
    info = {"best_ratio": best_k / n_grid, "best_loss": losses[best_k],
            "rtn_loss": losses[0], "losses": losses}
    return _awq_scale(x_mean, best_k / n_grid), info


def _group_outputs(w: torch.Tensor, xg: torch.Tensor) -> torch.Tensor:
    """Per-group partial outputs ``[rows, tokens, groups]`` of ``w [rows, in]`` on
    ``xg [tokens, groups, group_size]`` (sum over each group's columns only)."""
    wg = _grouped(w, xg.shape[2], fill="zero")
    return torch.einsum("tgk,rgk->rtg", xg, wg)


def _best_clip_rows(w: torch.Tensor, xg: torch.Tensor, group_size: int, symmetric: bool,
                    ratios: list[float]) -> torch.Tensor:
    """Best clip ratio ``[rows, groups]`` for a chunk of output rows ``w [rows, in]``."""
    ref = _group_outputs(w, xg)
    shape = (w.shape[0], xg.shape[1])
    best_err = torch.full(shape, float("inf"))
    best_ratio = torch.ones(shape)
    for r in ratios:
        deq = _rtn_dequant(w, group_size, symmetric, torch.full(shape, r))
        err = (_group_outputs(deq, xg) - ref).pow(2).mean(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, r), best_ratio)
    return best_ratio


def awq_search_clip(w: torch.Tensor, x: torch.Tensor, group_size: int, symmetric: bool,
                    n_grid: int = 20, max_shrink: float = 0.5,
                    n_sample_tokens: int = 512) -> torch.Tensor:
    """AWQ weight clipping search (AutoAWQ ``_compute_best_clip``), one ratio per group.

    Args:
        w: ``[out, in]`` weight, already multiplied by the AWQ scale s.
        x: ``[n_tokens, in]`` inputs of that weight (already divided by s).
        group_size, symmetric: the int4 grid (quantize_int4).
        n_grid, max_shrink: candidate ratios ``1 - k / n_grid`` for
            ``k = 0 .. int(max_shrink * n_grid) - 1`` (defaults: 1.0, 0.95, ..., 0.55;
            AutoAWQ's loop, which stops one step short of ``1 - max_shrink``).
        n_sample_tokens: tokens ``x[::max(1, n_tokens // n_sample_tokens)]`` are used.

    Returns:
        clip_ratio float32 ``[out, ceil(in / group_size)]`` for quantize_int4.

    Criterion per (row, group): ``mean_t (sum_{c in group} x[t, c] * (w[c] - Q_r(w)[c]))^2``,
    the group's contribution to the output error, minimised over r (ties keep the larger
    ratio; r = 1 is plain RTN). Output rows are processed in chunks of 64 so memory stays
    ``64 * tokens * groups`` floats per candidate. The range shrinks as in quantize_int4
    (AutoAWQ instead clamps w to ``±r * amax`` before min/max, which for an asymmetric grid
    shrinks only the side beyond ``r * amax``).

    Raises:
        ValueError: as awq_search_scale; max_shrink outside [0, 1); n_grid or
            n_sample_tokens not a positive int.
    """
    (w32,), x32 = _check_awq_inputs([w], x, group_size)
    _check_bool(symmetric, "symmetric")
    _check_positive_int(n_grid, "n_grid")
    _check_positive_int(n_sample_tokens, "n_sample_tokens")
    if not (isinstance(max_shrink, (int, float)) and 0 <= max_shrink < 1):
        raise ValueError(f"max_shrink must be in [0, 1), got {max_shrink!r}")
    out_features, in_features = w32.shape
    step = max(1, x32.shape[0] // n_sample_tokens)
    xg = _grouped(x32[::step], group_size, fill="zero")
    ratios = [1 - k / n_grid for k in range(max(1, int(max_shrink * n_grid)))]
    chunks = [_best_clip_rows(w32[r0:r0 + AWQ_CLIP_ROW_CHUNK], xg, group_size, symmetric, ratios)
              for r0 in range(0, out_features, AWQ_CLIP_ROW_CHUNK)]
    return torch.cat(chunks, dim=0)


def awq_quantize(w: torch.Tensor, s: torch.Tensor, x: torch.Tensor, group_size: int,
                 symmetric: bool, clip: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ-quantize one weight: ``quantize_int4(W * s, clip_ratio=awq_search_clip(...))``.

    Args:
        w: ``[out, in]`` float weight; s: float ``[in]`` from awq_search_scale;
        x: calibration inputs ``[n_tokens, in]`` of the layer (unscaled).
        group_size, symmetric: the int4 grid; clip: run the clip search (on ``W * s`` and
            ``x / s``, as AutoAWQ does after applying the scale).

    Returns:
        ``(q, scale, zero)`` as quantize_int4, for ``W * s``: the layer must compute
        ``(x / s) @ dequantize_int4(...)^T``.

    Raises:
        ValueError: as quantize_int4/awq_search_clip; s not a positive finite ``[in]`` tensor.
    """
    (w32,), x32 = _check_awq_inputs([w], x, group_size)
    _check_shape(s, "s", (w32.shape[1],))
    s32 = s.detach().to(torch.float32)
    if not bool((torch.isfinite(s32) & (s32 > 0)).all()):
        raise ValueError("s must be positive and finite")
    ws = w32 * s32
    clip_ratio = awq_search_clip(ws, x32 / s32, group_size, symmetric) if clip else None
    return quantize_int4(ws, group_size, symmetric, clip_ratio)


# --- fp8 (e4m3) ----------------------------------------------------------------------------

def _to_fp8(v: torch.Tensor) -> torch.Tensor:
    """Saturating cast to e4m3, round to nearest even (clamped first: a plain ``.to`` gave
    NaN above 448 in older torch releases; 2.13 saturates)."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_weight(w: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 weight quantization (vLLM ``Fp8LinearMethod``; per channel as in its
    compressed-tensors channel strategy).

    Args:
        w: ``[out, in]`` float weight; granularity: ``"tensor"`` or ``"channel"``.

    Returns:
        ``q`` torch.float8_e4m3fn ``[out, in]``; ``scale`` float32 ``[]`` or ``[out, 1]``.
        Dequantize as ``q.float() * scale``.

    Formula: ``scale = amax / 448`` (1.0 where that is 0), ``q = e4m3(clamp(w / scale, ±448))``.
    Error: e4m3 has 3 mantissa bits, so ``|w/scale| >= 2^-6`` (normal) rounds with relative
    error <= 2^-4; below that (subnormal, step 2^-9) the absolute error is <= 2^-10 * scale.

    Raises:
        ValueError: w not a finite non-empty 2-D float tensor; unknown granularity.
    """
    w32 = _float32_matrix(w, "w")
    _check_granularity(granularity)
    scale = _absmax_scale(_amax(w32, granularity), FP8_MAX)
    return _to_fp8(w32 / scale), scale


def quantize_fp8_activation(x: torch.Tensor, scale: torch.Tensor | None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 activation quantization, static or dynamic per token (vLLM ``QuantFP8``).

    Args:
        x: ``[..., in]`` float activations (rows are tokens).
        scale: a positive finite one-element tensor for a static per-tensor scale
            (calibrated offline), or None for dynamic per-token scales.

    Returns:
        ``x_q`` float8_e4m3fn, shape of x; ``scale`` float32: ``[]`` when static,
        ``[..., 1]`` when dynamic.

    Formulas: static ``x_q = e4m3(clamp(x / scale, ±448))``: values beyond
    ``448 * scale`` saturate. Dynamic ``scale = max(amax_row / 448, 1 / (448 * 512))``,
    the floor being vLLM's ``_FP8_MIN_SCALING_FACTOR`` (guards all-zero rows).
    x is not checked on this forward path: NaN propagates to the output, while +-inf
    saturates to +-448 * scale (as the saturating fp8 casts of vLLM's kernels do), so an
    overflow upstream is hidden here; the dynamic per-token scale of an inf row is inf,
    which does make that row NaN.

    Raises:
        ValueError: x not a floating-point tensor with at least one dimension; static
            scale not a positive finite one-element tensor.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim == 0:
        raise ValueError("x must be a floating-point tensor [..., in_features]")
    x32 = x.to(torch.float32)
    if scale is None:
        amax = x32.abs().amax(dim=-1, keepdim=True)
        x_scale = (amax / FP8_MAX).clamp(min=FP8_MIN_DYNAMIC_SCALE)
    else:
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
            raise ValueError("scale must be None (dynamic) or a one-element tensor (static)")
        x_scale = _check_scale_tensor(scale, "scale", 1)
    return _to_fp8(x32 / x_scale), x_scale


def fp8_linear(x: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor,
               x_scale_static: torch.Tensor | None, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None,
               q_w_float32: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 fp8 linear layer: what vLLM's fp8 scaled GEMM computes, in float32 on CPU.

    Args:
        x: ``[..., in]`` activations; q_w: float8_e4m3fn ``[out, in]``;
        w_scale: float32 ``[]`` or ``[out, 1]`` (quantize_fp8_weight);
        x_scale_static: one-element static activation scale, or None for dynamic per token;
        bias: optional ``[out]``; out_dtype: result dtype (default x.dtype).
        q_w_float32: optional ``q_w.float()`` kept by the caller (the conversion is exact;
            a layer keeps it so each call does not convert the whole weight again).

    Returns:
        ``[..., out]`` in out_dtype.

    Formula: ``x_q, x_scale = quantize_fp8_activation(x, x_scale_static)``;
    ``y = (x_q.float() @ q_w.float()^T) * x_scale * w_scale^T`` in float32 (an fp8 GEMM
    with float32 accumulation, up to summation order), cast to out_dtype, then ``+ bias``
    (vLLM's torch fallback in ``w8a8_utils``).

    Raises:
        ValueError: q_w not a 2-D float8_e4m3fn tensor; x's last dim not in_features;
            bad scales (as quantize_fp8_activation / dequantize_int8).
    """
    if not isinstance(q_w, torch.Tensor) or q_w.dtype != FP8_DTYPE or q_w.ndim != 2:
        raise ValueError("q_w must be a 2-D torch.float8_e4m3fn tensor [out_features, in_features]")
    if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[-1] != q_w.shape[1]:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [..., {q_w.shape[1]}] (in_features of q_w), got {got}")
    ws = _check_scale_tensor(w_scale, "w_scale", q_w.shape[0]).reshape(-1)
    x_q, x_scale = quantize_fp8_activation(x, x_scale_static)
    w32 = q_w.to(torch.float32) if q_w_float32 is None else q_w_float32
    y = (x_q.to(torch.float32) @ w32.T) * x_scale * ws
    y = y.to(out_dtype or x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


# --- bookkeeping ---------------------------------------------------------------------------

def weight_bytes(*tensors: torch.Tensor) -> int:
    """Total storage ``sum(numel * element_size)`` of the given tensors, in bytes."""
    return sum(t.numel() * t.element_size() for t in tensors)
