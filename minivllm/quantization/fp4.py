"""FP4 weights: E2M1 elements with block scales, MXFP4 and NVFP4 (weight-only here).

E2M1 (OCP Microscaling Formats spec v1.0, 2023, section 5.3.3): 1 sign, 2 exponent
(bias 1) and 1 mantissa bit, no infinities or NaN. Its 15 values are
+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; ``minivllm.numerics.FORMATS["fp4_e2m1"]`` rounds to them
(nearest, ties to even). A code is the 4-bit pattern ``sign << 3 | exponent << 1 |
mantissa``, so codes 0-7 are the magnitudes in the order above and 8-15 their negatives.
Two codes share a byte: the element with the even index in the low nibble (the order of
torch's ``float4_e2m1fn_x2`` and of vLLM's packed fp4 weights).

Two ways to scale a block of E2M1 values, both along the input dimension:

- **MXFP4** (OCP MX; vLLM ``quantization="mxfp4"``, the gpt-oss checkpoints): blocks of
  32, one E8M0 scale per block: a power of two ``2^e`` stored as the biased byte
  ``e + 127``. The spec's rule: ``e = floor(log2(amax)) - 2`` (2 is E2M1's largest
  exponent), so the block's largest value lands in [4, 8) and saturates to 6 when it is
  above 6. A block of zeros gets ``e = -127``.
- **NVFP4** (NVIDIA; vLLM ``quantization="modelopt_fp4"``, TensorRT Model Optimizer
  checkpoints): blocks of 16, one FP8 E4M3 scale per block and one float32 scale per
  tensor: ``weight_scale_2 = amax(W) / (6 * 448)``, ``weight_scale = e4m3(amax(block) /
  6 / weight_scale_2)``, elements ``E2M1(w / (weight_scale * weight_scale_2))``. The
  finer blocks and the 3-bit-mantissa scale (rather than a power of two) are why NVFP4
  is the more accurate of the two at about the same size (4.5 and 4.25 bits per weight).

Here both are weight-only and emulated: the layer dequantizes its weight and runs a float
GEMM (``LinearMethod.apply``). vLLM's ``modelopt_fp4`` also quantizes activations (W4A4)
on Blackwell GPUs and falls back to weight-only elsewhere; :func:`fake_quantize_nvfp4_activations`
emulates that activation quantizer (blocks of 16 along the input dimension, E4M3 block
scales computed at run time, a calibrated per-tensor ``input_scale``), for experiments.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
# magnitude of codes 0..7
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# value of codes 0..15 (code 8 is -0.0), and of both codes of every packed byte
_E2M1_VALUES = torch.tensor(_E2M1_MAGNITUDES + tuple(-m for m in _E2M1_MAGNITUDES))
_BYTE_VALUES = torch.stack([_E2M1_VALUES[torch.arange(256) & 15],
                            _E2M1_VALUES[torch.arange(256) >> 4]], dim=-1)  # [256, 2]


def _blocks(w: torch.Tensor, block: int, what: str) -> torch.Tensor:
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"{what}: weight must be a 2-D float tensor [out, in], got "
                         f"{tuple(w.shape)} {w.dtype}")
    if w.shape[1] % block:
        raise ValueError(f"{what}: in_features ({w.shape[1]}) must be a multiple of the "
                         f"block size {block}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{what}: the weight has NaN or infinite values")
    return w.float().reshape(w.shape[0], w.shape[1] // block, block)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 E2M1 codes 0..15 (same shape): round to nearest, ties to even
    (the code with mantissa bit 0), saturating at +-6. The same rounding as
    ``numerics.round_to_format(x, "fp4_e2m1", saturate=True)`` (tested), in a few
    elementwise ops instead of its bit arithmetic.
    NaN is not allowed (the callers refuse non-finite weights first)."""
    a = x.float().abs()
    # codes 0-4 are a * 2 (0, 0.5, ..., 2), codes 4-6 are a + 2 (2, 3, 4), codes 6-7 are
    # 6 + (a - 4) / 2 (4, 6); torch.round rounds half to even, which on each piece is the
    # even code, so the ties go where round-to-nearest-even puts them
    idx = torch.where(a < 2, torch.round(a * 2),
                      torch.where(a < 4, torch.round(a) + 2,
                                  (torch.round((a - 4) / 2) + 6).clamp(max=7)))
    sign = torch.signbit(x).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 E2M1 values (code 8 is -0.0): a 16-entry table."""
    return _E2M1_VALUES.to(codes.device)[(codes & 15).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes (n even) -> [..., n / 2] uint8, the even-index element low."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dimension must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., m] uint8 -> [..., 2m] codes (inverse of :func:`pack_fp4`)."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _dequantize_blocks(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E2M1 values times one float32 scale per block: packed [out, in / 2] and scale
    [out, in / block] -> float32 [out, in]. Each byte is decoded to its two values at
    once through a 256-entry table (the same values as :func:`e2m1_values` of
    :func:`unpack_fp4`, about 3x faster on a CPU)."""
    v = torch.nn.functional.embedding(packed.int(), _BYTE_VALUES.to(packed.device))
    v = v.reshape(packed.shape[0], 2 * packed.shape[1])
    out, n = v.shape
    blocks = scale.shape[1]
    return (v.reshape(out, blocks, n // blocks) * scale[..., None]).reshape(out, n)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4: w [out, in] float (in a multiple of 32) -> (packed uint8 [out, in / 2],
    E8M0 scale bytes uint8 [out, in / 32], biased exponents: scale = 2^(byte - 127)).

    Raises:
        ValueError: not 2-D float, in not a multiple of 32, or non-finite values.
    """
    wb = _blocks(w, MXFP4_BLOCK, "quantize_mxfp4")
    amax = wb.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2,
                    torch.full_like(amax, -127.0)).clamp(-127, 127)
    scaled = wb / torch.exp2(e)[..., None]
    codes = e2m1_codes(scaled).reshape(w.shape)
    return pack_fp4(codes), (e + 127).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(packed [out, in / 2], E8M0 bytes [out, in / 32]) -> float32 [out, in]."""
    return _dequantize_blocks(packed, torch.exp2(scales.float() - 127))


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4: w [out, in] float (in a multiple of 16) -> (packed uint8 [out, in / 2],
    block scales float8_e4m3fn [out, in / 16], tensor scale float32 []) with
    w ~ E2M1 * weight_scale * weight_scale_2 (ModelOpt's names).

    Raises:
        ValueError: not 2-D float, in not a multiple of 16, or non-finite values.
    """
    wb = _blocks(w, NVFP4_BLOCK, "quantize_nvfp4")
    amax = wb.abs().amax()
    global_scale = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else torch.tensor(1.0)
    block_scale, codes = _nvfp4_block_codes(wb, global_scale)
    return pack_fp4(codes.reshape(w.shape)), block_scale, global_scale.float().reshape(())


def _nvfp4_block_codes(xb: torch.Tensor, global_scale: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's two-level scaling of float32 blocks ``xb [..., n, 16]`` under a tensor
    scale: per block an E4M3 scale ``e4m3(amax(block) / 6 / global_scale)``, saturating at
    448 (weights never reach it: their tensor scale comes from their own amax), and E2M1
    codes of ``xb / (block scale * global_scale)`` (0 where that is 0).
    Returns (block scales float8_e4m3fn [..., n], codes uint8 [..., n, 16])."""
    block_scale = (xb.abs().amax(-1) / E2M1_MAX / global_scale).clamp(max=E4M3_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    denom = block_scale.float()[..., None] * global_scale
    scaled = torch.where(denom > 0, xb / torch.where(denom > 0, denom, 1.0), 0.0)
    return block_scale, e2m1_codes(scaled)


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor,
                     global_scale: torch.Tensor) -> torch.Tensor:
    """(packed [out, in / 2], e4m3 [out, in / 16], float32 []) -> float32 [out, in]."""
    return _dequantize_blocks(packed, block_scale.float() * global_scale.float())


def nvfp4_input_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """The per-tensor activation scale of an NVFP4 W4A4 layer from a calibrated amax:
    ``input_scale = amax / (6 * 448)`` (float32 [], ModelOpt's checkpoint name; vLLM's
    ``ModelOptNvFp4LinearMethod`` hands ``1 / input_scale`` to the activation quantizer).

    Raises:
        ValueError: amax not finite and > 0.
    """
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(())
    if not bool(torch.isfinite(a)) or float(a) <= 0:
        raise ValueError(f"nvfp4_input_scale: amax must be finite and > 0, got {float(a)}")
    return a / (E2M1_MAX * E4M3_MAX)


def fake_quantize_nvfp4_activations(x: torch.Tensor, input_scale: torch.Tensor | float
                                    ) -> torch.Tensor:
    """NVFP4 activations (the A4 of W4A4), quantized and dequantized in float32.

    What Blackwell's activation quantizer computes (vLLM's ``scaled_fp4_quant(x,
    1 / input_scale)``), emulated: along the last dimension, blocks of 16 elements; per
    block an FP8 E4M3 scale ``s = e4m3(amax(block) / 6 / input_scale)``, computed at run
    time from the block and saturating at 448; elements ``E2M1(x / (s * input_scale))``,
    saturating at +-6. The result is ``E2M1 * s * input_scale``. Only ``input_scale`` is
    static (calibrated, :func:`nvfp4_input_scale`); an activation above the calibrated
    amax saturates (block scale 448, elements 6) instead of overflowing. Every block is
    a function of its own 16 values and ``input_scale``: a row's result does not depend
    on the other rows of the batch.

    Args:
        x: float tensor [..., K], K a multiple of 16, finite.
        input_scale: the per-tensor scale, a positive float or 0-d tensor.
    Returns:
        float32 tensor of x's shape.
    Raises:
        ValueError: K not a multiple of 16, non-finite x, or input_scale not finite > 0.
    """
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"fake_quantize_nvfp4_activations: the last dimension "
                         f"({x.shape[-1]}) must be a multiple of {NVFP4_BLOCK}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("fake_quantize_nvfp4_activations: x has NaN or infinite values")
    g = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(())
    if not bool(torch.isfinite(g)) or float(g) <= 0:
        raise ValueError(f"fake_quantize_nvfp4_activations: input_scale must be finite "
                         f"and > 0, got {float(g)}")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    block_scale, codes = _nvfp4_block_codes(xb, g)
    return (e2m1_values(codes) * (block_scale.float() * g)[..., None]).reshape(x.shape)
