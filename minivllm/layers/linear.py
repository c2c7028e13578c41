"""Linear layers with a linear method: how a layer stores its weight and computes x W^T.

vLLM splits this the same way (``vllm/model_executor/layers/linear.py``: ``LinearBase``
holds a ``quant_method`` whose ``create_weights``/``apply`` own the storage and the
kernel). Here :class:`QuantLinear` holds the method's tensors as buffers and calls
``method.apply``. Methods:

* :class:`Int8Method`: int8 weight-only, per tensor or per output channel.
* :class:`Int4Method`: 4-bit groups (round-to-nearest, AWQ or GPTQ produce the same
  storage: packed nibbles, per-group scale and zero point; AWQ adds a per-input-channel
  scale ``awq_scale`` that divides x, which AutoAWQ would fold into the preceding norm).
* :class:`Fp8Method`: W8A8 e4m3, weight scale per tensor or channel, activation scale
  static (calibrated) or dynamic per token; fp32 accumulation.

Weight-only methods compute ``F.linear(x, dequantized W)``. On CPU there are no int4/int8
GEMM kernels to call, so the dequantized weight is kept after first use (a GPU kernel
dequantizes in registers instead); that changes speed and memory, never the result.

Float32 on CPU: the weight of every float layer (and the LM head) is reordered once into
oneDNN's blocked layout and kept (:func:`packed_cpu_linear`), as vLLM's CPU backend and
``torch.compile``'s CPU freezing do: ``F.linear`` repacks the whole weight inside MKL on
every call, which costs 20-40 % of a decode step's GEMM time on a small CPU. Still
float32 inputs, weights and accumulation; only the summation order inside each dot
product differs (relative differences ~1e-7, as between any two BLAS libraries). Set
``PACK_CPU_WEIGHTS = False`` here to get plain ``F.linear`` back.

TF32 (``float32_matmul_precision="high"``): on CPU every float32 matmul of these layers
(and of the LM head) rounds both inputs to TF32 first (:func:`minivllm.numerics.round_to_tf32`,
as :func:`minivllm.numerics.tf32_linear` does); on CUDA torch's real TF32 is switched on
instead.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.numerics import round_to_tf32
from minivllm.quantization import QuantConfig
from minivllm.quantization import fp4
from minivllm.quantization import weight_quant as wq


def _version(t: torch.Tensor) -> int:
    """In-place (autograd-visible) edits bump a tensor's version; inference-mode tensors
    have none. Edits through ``.data`` are invisible: call :func:`clear_weight_caches`."""
    return 0 if t.is_inference() else t._version


def clear_weight_caches(model: nn.Module) -> None:
    """Forget the TF32-rounded, oneDNN-packed, fp32 LM-head and dequantized weights kept,
    so the next forward recomputes them (needed after editing weights or scales in place
    through ``.data`` or under inference mode, which the caches cannot see)."""
    for module in model.modules():
        for holder in (module, *module.parameters(recurse=False)):
            for attr in ("_tf32_cache", "_packed_cache", "_lm_head_fp32"):
                if hasattr(holder, attr):
                    delattr(holder, attr)
        if isinstance(module, QuantLinear):
            module._dequant = None


def _cached_weight(owner: Optional[object], attr: str, weight: torch.Tensor, make):
    """``make(weight)``, kept on ``owner`` (a module, or the weight tensor itself) under
    ``attr`` until the weight tensor is replaced or edited in place (no owner: computed
    every call)."""
    key = (weight.data_ptr(), _version(weight), weight.shape)
    cached = getattr(owner, attr, None) if owner is not None else None
    if cached is None or cached[0] != key:
        cached = (key, make(weight))
        if owner is not None:
            setattr(owner, attr, cached)
    return cached[1]


# Prepacked oneDNN weights for float32 CPU linears (see the module docstring).
PACK_CPU_WEIGHTS = (torch.backends.mkldnn.is_available()
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
# The batch size oneDNN picks the packed layout for: decode batches are tens of rows;
# the layout serves any number of rows (prefill included).
_PACK_BATCH_HINT = 64


def packed_cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      owner: object) -> torch.Tensor:
    """``F.linear`` for float32 CPU tensors with the weight reordered once into oneDNN's
    blocked layout and kept on ``owner`` (``_packed_cache``; recomputed when the weight
    is replaced or edited in place, see :func:`clear_weight_caches`)."""
    packed = _cached_weight(owner, "_packed_cache", weight, lambda w: torch.ops.mkldnn
                            ._reorder_linear_weight(w.detach(), _PACK_BATCH_HINT))
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, bias,
                                           "none", [], "")
    return y.view(*shape[:-1], y.shape[-1])


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 tf32: bool, owner: Optional[object] = None) -> torch.Tensor:
    """``F.linear``, or with TF32 emulation (``tf32`` on float32 CPU data) the same with
    both inputs rounded to TF32. ``owner`` keeps the rounded weight between calls (it is
    recomputed when the weight tensor is replaced or edited in place; see
    :func:`clear_weight_caches` for edits it cannot see). Float32 on CPU without
    autograd and with an ``owner``: :func:`packed_cpu_linear`."""
    f32_cpu = x.dtype == torch.float32 and x.device.type == "cpu"
    if not (tf32 and f32_cpu):
        if PACK_CPU_WEIGHTS and f32_cpu and owner is not None \
                and weight.dtype == torch.float32 \
                and (bias is None or bias.dtype == torch.float32) \
                and not torch.is_grad_enabled() and x.numel() > 0:
            return packed_cpu_linear(x, weight, bias, owner)
        return F.linear(x, weight, bias)
    return F.linear(round_to_tf32(x), _cached_weight(owner, "_tf32_cache", weight,
                                                     round_to_tf32), bias)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The "linear" step's reference (:mod:`minivllm.steps`): ``x @ weight.T + bias`` in
    the inputs' dtype, as the engine computes it with ``float32_matmul_precision=
    "highest"`` (float32 on CPU: the oneDNN-packed weight, kept on the weight tensor).

    Args:
        x: [..., in_features]; weight: [out_features, in_features]; bias: [out] or None.
    Returns:
        [..., out_features] in x's dtype.
    """
    return float_linear(x, weight, bias, False, owner=weight)


def rowwise(fn, x: torch.Tensor, *args) -> torch.Tensor:
    """``fn(x, *args)`` computed one row of x at a time: batch-invariant by construction.

    Args:
        fn: ``fn(x [1, ..., K], *args) -> [1, ..., N]`` (a linear, an LM head).
        x: [..., K]; its leading dimensions are flattened to rows.
    Returns:
        [..., N]: row i is ``fn`` of a freshly allocated (so equally aligned) copy of
        row i alone, the same call whatever the other rows are.

    Why (course chapter 5): a CPU GEMM's per-row result can depend on the number of
    rows M. Measured here (AMD EPYC, torch's oneDNN-packed float32 GEMM of
    :func:`packed_cpu_linear`): for every model shape, rows of an M >= 2 product differ
    from the same row computed alone; bfloat16 ``F.linear`` agreed at every M tried
    (1..19, 33, 64, 100, 256, 1024), but nothing in its contract says so. One call per
    row removes the question: the row count is always 1. Cost: the weight is read once
    per row (bfloat16 on this CPU already costs about the same per row; float32 decode
    at 8 rows about 2-3x; see ``benchmarks/batch_invariance.py``).
    """
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= 1:
        return fn(x, *args)
    out = [fn(rows[i:i + 1].clone(), *args) for i in range(rows.shape[0])]
    y = torch.cat(out)
    return y.view(*x.shape[:-1], y.shape[-1])


class Linear(nn.Linear):
    """``nn.Linear`` with the engine's matmul precision (``tf32``: emulate TF32 on CPU).

    Same parameters and state-dict names as ``nn.Linear``, so checkpoints load as usual.
    ``impl``: the "linear" step when swapped (``LLM.swap_step``), a function with
    :func:`linear_ref`'s signature; None runs the engine's own path (the reference, or
    its TF32 emulation).
    """

    tf32 = False
    impl = None
    # Batch-invariant mode (``EngineArgs.batch_invariant``; set per layer by the model
    # runner): None off; "rows": :func:`rowwise` around the engine's own path (CPU);
    # a function with linear_ref's signature: that function (CUDA:
    # ``minivllm_kernels.batch_invariant.linear_batch_invariant``). A swapped "linear" step wins.
    batch_invariant = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl is not None:
            return self.impl(x, self.weight, self.bias)
        if self.batch_invariant is not None:
            if self.batch_invariant == "rows":
                return rowwise(self._own_path, x)
            return self.batch_invariant(x, self.weight, self.bias)
        return float_linear(x, self.weight, self.bias, self.tf32, owner=self.weight)

    def _own_path(self, x: torch.Tensor) -> torch.Tensor:
        return float_linear(x, self.weight, self.bias, self.tf32, owner=self.weight)


class LinearMethod:
    """Interface: ``quantize`` a float weight into named tensors, ``apply`` the layer."""

    def __init__(self, cfg: QuantConfig):
        self.cfg = cfg

    def quantize(self, weight: torch.Tensor, stats=None) -> dict[str, torch.Tensor]:
        """weight [out, in] float32 -> tensors to store (names are the checkpoint's)."""
        raise NotImplementedError

    def dequantize(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """Stored tensors -> float32 weight [out, in] (weight-only methods)."""
        raise NotImplementedError

    def expected(self, out_features: int, in_features: int) -> dict[str, tuple]:
        """Stored tensor name -> (dtype, shape) for a layer of this shape."""
        raise NotImplementedError

    def check_tensors(self, t: dict[str, torch.Tensor], out_features: int,
                      in_features: int) -> None:
        """Exactly the expected tensors, with their dtypes, shapes and value ranges.

        Raises:
            ValueError: naming the tensor and what was expected.
        """
        want = self.expected(out_features, in_features)
        if set(t) != set(want):
            raise ValueError(f"expected tensors {sorted(want)} for {self.cfg.label()}, "
                             f"got {sorted(t)}")
        for name, (dtype, shape) in want.items():
            x = t[name]
            if x.dtype != dtype or tuple(x.shape) != tuple(shape):
                raise ValueError(f"{name} must be {dtype} of shape {list(shape)}, got "
                                 f"{x.dtype} of shape {list(x.shape)}")
            if name in ("weight_scale", "weight_scale_2", "scales", "awq_scale", "input_scale"):
                if x.dtype == torch.float32 and not bool((torch.isfinite(x) & (x > 0)).all()):
                    raise ValueError(f"{name} must be finite and positive")
                if x.dtype == torch.float8_e4m3fn and not bool(
                        (torch.isfinite(x.float()) & (x.float() >= 0)).all()):
                    raise ValueError(f"{name} (E4M3 block scales) must be finite and >= 0")
                if x.dtype == torch.uint8 and bool((x == 255).any()):
                    raise ValueError(f"{name} (E8M0 scale bytes) must not be 255 (NaN)")
        if "zeros" in t and int(t["zeros"].max()) > 15:
            raise ValueError("zeros must be int4 codes (0..15)")
        if "zeros" in t and self.cfg.symmetric and not bool((t["zeros"] == 8).all()):
            raise ValueError("a symmetric int4 checkpoint has zeros == 8 everywhere")

    def apply(self, layer: "QuantLinear", x: torch.Tensor) -> torch.Tensor:
        w = layer.dequantized_weight(x.dtype)
        return float_linear(x, w, layer.bias, layer.tf32, owner=layer)


class Int8Method(LinearMethod):

    def quantize(self, weight, stats=None):
        q, scale = wq.quantize_int8(weight, self.cfg.granularity)
        return {"qweight": q, "weight_scale": scale.float()}

    def dequantize(self, t):
        return wq.dequantize_int8(t["qweight"], t["weight_scale"])

    def expected(self, out_features, in_features):
        scale = () if self.cfg.granularity == "tensor" else (out_features, 1)
        return {"qweight": (torch.int8, (out_features, in_features)),
                "weight_scale": (torch.float32, scale)}


class Int4Method(LinearMethod):
    """int4 RTN, AWQ or GPTQ; all three store the same packed layout."""

    def quantize(self, weight, stats=None):
        c = self.cfg
        out: dict[str, torch.Tensor] = {}
        if c.method == "int4":
            q, scale, zero = wq.quantize_int4(weight, c.group_size, c.symmetric)
        elif c.method == "gptq":
            q, scale, zero = wq.gptq_quantize(weight, stats.hessian_matrix(), c.group_size,
                                              c.symmetric, act_order=c.act_order,
                                              block_size=c.block_size, percdamp=c.percdamp)
        elif c.method == "awq":
            s = stats.awq_scale  # searched once per group of layers sharing the input
            q, scale, zero = wq.awq_quantize(weight, s, stats.sample, c.group_size,
                                             c.symmetric, clip=c.clip)
            out["awq_scale"] = s.float()
        else:
            raise ValueError(f"Int4Method cannot run method {c.method!r}")
        out.update(qweight=wq.pack_int4(q), scales=scale.float(), zeros=zero)
        return out

    def dequantize(self, t):
        w = wq.dequantize_int4(wq.unpack_int4(t["qweight"]), t["scales"], t["zeros"],
                               self.cfg.group_size)
        return w

    def expected(self, out_features, in_features):
        groups = -(-in_features // self.cfg.group_size)
        want = {"qweight": (torch.uint8, (out_features, -(-in_features // 2))),
                "scales": (torch.float32, (out_features, groups)),
                "zeros": (torch.uint8, (out_features, groups))}
        if self.cfg.method == "awq":
            want["awq_scale"] = (torch.float32, (in_features,))
        return want

    def apply(self, layer, x):
        if layer.awq_scale is not None:
            x = (x.float() / layer.awq_scale).to(x.dtype)
        return super().apply(layer, x)


class Fp8Method(LinearMethod):

    def quantize(self, weight, stats=None):
        q, scale = wq.quantize_fp8_weight(weight, self.cfg.granularity)
        out = {"qweight": q, "weight_scale": scale.float()}
        if self.cfg.activation_scheme == "static":
            amax = stats.amax.float()
            out["input_scale"] = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        return out

    def dequantize(self, t):
        return t["qweight"].to(torch.float32)  # exact; the scales apply after the GEMM

    def expected(self, out_features, in_features):
        scale = () if self.cfg.granularity == "tensor" else (out_features, 1)
        want = {"qweight": (torch.float8_e4m3fn, (out_features, in_features)),
                "weight_scale": (torch.float32, scale)}
        if self.cfg.activation_scheme == "static":
            want["input_scale"] = (torch.float32, ())
        return want

    def apply(self, layer, x):
        shape = x.shape
        y = wq.fp8_linear(x.reshape(-1, shape[-1]), layer.qweight, layer.weight_scale,
                          layer.input_scale, layer.bias, out_dtype=x.dtype,
                          q_w_float32=layer.dequantized_weight(torch.float32))
        return y.reshape(*shape[:-1], y.shape[-1])


class Mxfp4Method(LinearMethod):
    """MXFP4 weight-only (:mod:`minivllm.quantization.fp4`): packed E2M1 + E8M0 bytes."""

    def quantize(self, weight, stats=None):
        q, scale = fp4.quantize_mxfp4(weight)
        return {"qweight": q, "weight_scale": scale}

    def dequantize(self, t):
        return fp4.dequantize_mxfp4(t["qweight"], t["weight_scale"])

    def expected(self, out_features, in_features):
        return {"qweight": (torch.uint8, (out_features, in_features // 2)),
                "weight_scale": (torch.uint8, (out_features, in_features // fp4.MXFP4_BLOCK))}


class Nvfp4Method(LinearMethod):
    """NVFP4 weight-only (vLLM's ``modelopt_fp4`` names): packed E2M1, E4M3 block scales
    ``weight_scale`` and the float32 tensor scale ``weight_scale_2``."""

    def quantize(self, weight, stats=None):
        q, block_scale, global_scale = fp4.quantize_nvfp4(weight)
        return {"qweight": q, "weight_scale": block_scale, "weight_scale_2": global_scale}

    def dequantize(self, t):
        return fp4.dequantize_nvfp4(t["qweight"], t["weight_scale"], t["weight_scale_2"])

    def expected(self, out_features, in_features):
        return {"qweight": (torch.uint8, (out_features, in_features // 2)),
                "weight_scale": (torch.float8_e4m3fn, (out_features, in_features // fp4.NVFP4_BLOCK)),
                "weight_scale_2": (torch.float32, ())}


def make_method(cfg: QuantConfig) -> LinearMethod:
    """The linear method for ``cfg``: a built-in one, or the class registered under
    ``cfg.method`` (:func:`minivllm.quantization.register_quantization_method`).

    Raises:
        ValueError: no method of that name (the message lists the known ones).
    """
    from minivllm.quantization import quantization_methods, registered_method_class

    if cfg.method == "int8":
        return Int8Method(cfg)
    if cfg.method in ("int4", "awq", "gptq"):
        return Int4Method(cfg)
    if cfg.method == "fp8":
        return Fp8Method(cfg)
    if cfg.method == "mxfp4":
        return Mxfp4Method(cfg)
    if cfg.method == "modelopt_fp4":
        return Nvfp4Method(cfg)
    cls = registered_method_class(cfg.method)
    if cls is not None:
        return cls(cfg)
    raise ValueError(f"Unknown quantization method {cfg.method!r}; known: "
                     f"{', '.join(quantization_methods())}")


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored by a :class:`LinearMethod`.

    Args:
        method: the linear method.
        tensors: the method's stored tensors (``qweight``, scales...), registered as
            buffers under the same names (what a saved checkpoint holds).
        in_features, out_features: the float layer's shape.
        bias: float bias [out] or None.
        tf32: emulate TF32 matmuls on float32 CPU inputs.
    """

    _OPTIONAL = ("awq_scale", "input_scale")

    def __init__(self, method: LinearMethod, tensors: dict[str, torch.Tensor],
                 in_features: int, out_features: int, bias: Optional[torch.Tensor] = None,
                 tf32: bool = False):
        super().__init__()
        self.method = method
        self.in_features, self.out_features = in_features, out_features
        self.tf32 = tf32
        self.tensor_names = tuple(tensors)
        for name, t in tensors.items():
            self.register_buffer(name, t)
        for name in self._OPTIONAL:
            if name not in tensors:
                setattr(self, name, None)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dequant: Optional[torch.Tensor] = None

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.tensor_names}

    def weight_bytes(self) -> int:
        """Bytes of the stored quantized weight and its scales (not the bias)."""
        return sum(t.numel() * t.element_size() for t in self.stored_tensors().values())

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as the matmul sees it, cast to ``dtype`` (kept after first use; after
        editing the stored tensors call :func:`clear_weight_caches`). For fp8 that is the
        e4m3 values in float32; the scales apply to the GEMM's output."""
        if self._dequant is None or self._dequant.dtype != dtype \
                or self._dequant.device != self.qweight.device:
            self._dequant = self.method.dequantize(self.stored_tensors()).to(
                device=self.qweight.device, dtype=dtype)
        return self._dequant

    batch_invariant = None  # None or "rows" (see Linear.batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant == "rows":
            return rowwise(lambda r: self.method.apply(self, r), x)
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"method={self.method.cfg.label()}")
