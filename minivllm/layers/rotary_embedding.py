"""Rotary position embedding (RoPE; Su et al. 2021, arXiv:2104.09864), HF "rotate_half" layout.

The cos/sin tables are computed in float32 from ``inv_freq = 1 / theta^(2i/d)`` and cast
to the activation dtype, exactly as HF ``LlamaRotaryEmbedding`` does, so float32 results
match transformers bit for bit. ``rope_scaling`` types linear, dynamic, llama3 and yarn
change ``inv_freq`` (and, for yarn, scale cos/sin) as transformers' ``ROPE_INIT_FUNCTIONS``
do (:func:`rope_inv_freq`; tests/test_rope_scaling.py compares them). vLLM:
``vllm/model_executor/layers/rotary_embedding``. Course chapter 11.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

logger = logging.getLogger("minivllm")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim] (x's dtype)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


ROPE_SCALING_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# The fields each type reads (transformers' names, modeling_rope_utils.py); required ones
# first, then the optional ones. "type" is the pre-4.45 spelling of "rope_type".
_ROPE_FIELDS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    # dynamic's L0 is the config's max_position_embeddings (transformers and vLLM read it
    # there); the normalized dict carries it so the table can be rebuilt from the dict.
    "dynamic": (("factor",), ("max_position_embeddings",)),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
    "yarn": (("factor",), ("original_max_position_embeddings", "attention_factor",
                           "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
}


def normalize_rope_scaling(rope_scaling, max_position_embeddings: int | None = None
                           ) -> dict | None:
    """Check a ``rope_scaling`` dict and fill in what the table needs.

    Accepts transformers' spelling (``rope_type`` or the older ``type``; the fields of
    ``transformers.modeling_rope_utils``). ``original_max_position_embeddings`` defaults
    to ``max_position_embeddings`` for "yarn" (the pre-training length the correction
    range is measured in), and "dynamic" takes its L0 from ``max_position_embeddings``
    (stored in the result under that name), as transformers does. Keys the type does
    not read are ignored, as transformers does (with a warning, except ``rope_theta``
    and ``partial_rotary_factor`` 1.0, which the config's fields already give).

    Args:
        rope_scaling: None, or a dict with ``rope_type`` in :data:`ROPE_SCALING_TYPES`.
        max_position_embeddings: the config's value (needed by dynamic and yarn when
            ``original_max_position_embeddings`` is absent).
    Returns:
        None for no scaling (None, {} or type "default"), else a new dict with
        ``rope_type`` and every field the type reads.
    Raises:
        ValueError: not a dict, an unknown type (the message lists the supported ones),
            a missing required field, a field that is not a positive number (factor >= 1
            for every type but linear, whose factor may be any positive number;
            high_freq_factor > low_freq_factor for llama3), or partial rotary (not
            implemented).
    """
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"rope_scaling must be a dict or None, got {rope_scaling!r}")
    if not rope_scaling:
        return None
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: "
                         f"{', '.join(ROPE_SCALING_TYPES)}); got rope_scaling={rope_scaling}")
    if rope_type == "default":
        return None
    if rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {rope_scaling['partial_rotary_factor']} is "
                         "not supported (the whole head is rotated)")
    required, optional = _ROPE_FIELDS[rope_type]
    out = {"rope_type": rope_type}
    for key in required + optional:
        if key in rope_scaling and rope_scaling[key] is not None:
            out[key] = rope_scaling[key]
    l0_key = {"dynamic": "max_position_embeddings",
              "yarn": "original_max_position_embeddings"}.get(rope_type)
    if l0_key is not None and l0_key not in out:
        if max_position_embeddings is None:
            raise ValueError(f"rope_scaling type {rope_type!r} needs {l0_key!r} "
                             "(the config's max_position_embeddings by default)")
        out[l0_key] = max_position_embeddings
    ignored = sorted(set(rope_scaling) - set(out) - {"type", "rope_theta", "partial_rotary_factor"})
    if ignored:
        logger.warning("rope_scaling type %r does not read %s (ignored, as transformers "
                       "does)", rope_type, ignored)
    missing = [k for k in required if k not in out]
    if missing:
        raise ValueError(f"rope_scaling type {rope_type!r} needs the field(s) {missing} "
                         f"(it reads {list(required + optional)}); got {rope_scaling}")
    for key, value in out.items():
        if key in ("rope_type", "truncate"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 < value < float("inf"):
            raise ValueError(f"rope_scaling[{key!r}] must be a positive finite number, "
                             f"got {value!r}")
    if "truncate" in out and not isinstance(out["truncate"], bool):
        raise ValueError(f"rope_scaling['truncate'] must be True or False, got {out['truncate']!r}")
    if rope_type != "linear" and out["factor"] < 1:
        raise ValueError(f"rope_scaling type {rope_type!r} needs factor >= 1, got {out['factor']}")
    if rope_type == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError("rope_scaling type 'llama3' needs high_freq_factor > low_freq_factor, "
                         f"got {out['high_freq_factor']} and {out['low_freq_factor']}")
    return out


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None = None
                  ) -> tuple[torch.Tensor, float]:
    """The inverse frequencies of each rotary pair, and the factor cos/sin are scaled by.

    ``inv_freq[i] = 1 / base^(2i / head_dim)`` in float32 (as transformers computes it),
    then the scaling type's change (transformers' ``ROPE_INIT_FUNCTIONS``; vLLM:
    ``vllm/model_executor/layers/rotary_embedding/``):

    * linear (position interpolation, kaiokendev / arXiv:2306.15595): ``inv_freq / factor``
      (vLLM divides the positions instead: the same angles, up to float32 rounding);
    * dynamic (NTK-aware, bloc97 / emozilla): a larger base,
      ``base * (factor * L / L0 - (factor - 1))^(d / (d - 2))`` with ``L0`` =
      original_max_position_embeddings and ``L = factor * L0`` fixed, as vLLM's
      ``DynamicNTKScalingRotaryEmbedding`` does (transformers recomputes it from the
      current sequence length once that exceeds L0; both agree at ``L``);
    * llama3 (Llama 3.1): wavelengths above ``L0 / low_freq_factor`` divided by factor,
      below ``L0 / high_freq_factor`` kept, a linear blend in between;
    * yarn (arXiv:2309.00071): a ramp between interpolated and extrapolated frequencies
      over the pairs whose rotation count at ``L0`` lies between beta_slow and beta_fast,
      and cos/sin multiplied by ``attention_factor`` (default ``0.1 ln(factor) + 1``, or
      the mscale/mscale_all_dim ratio).

    Args:
        head_dim: rotary dimension (even).
        base: rope_theta.
        rope_scaling: None or a dict :func:`normalize_rope_scaling` accepts.
    Returns:
        (inv_freq float32 [head_dim // 2], attention_factor float).
    """
    scaling = normalize_rope_scaling(rope_scaling) or {"rope_type": "default"}
    rope_type = scaling["rope_type"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if rope_type == "dynamic":
        factor, l0 = scaling["factor"], scaling["max_position_embeddings"]
        seq_len = factor * l0
        base = base * ((factor * seq_len / l0) - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** exponents)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    factor = scaling["factor"]
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        l0 = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        long_wave = wavelen > l0 / low       # low frequencies: interpolate
        short_wave = wavelen < l0 / high     # high frequencies: keep
        smooth = (l0 / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(long_wave, inv_freq / factor,
                           torch.where(short_wave, inv_freq, blended)), 1.0
    # yarn
    l0 = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def dim_of(rotations):  # the pair index that turns `rotations` times over l0 positions
        return head_dim * math.log(l0 / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the pair's frequency, 0: interpolate it
    pos_freqs = base ** exponents
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def rope_table_ref(head_dim: int, max_position: int, base: float,
                   rope_scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables (the "rotary.table" step, :mod:`minivllm.steps`).

    ``inv_freq[i] = 1 / base^(2i / head_dim)`` (changed by ``rope_scaling``, see
    :func:`rope_inv_freq`), angle ``pos * inv_freq[i]``, both in float32 as HF
    ``LlamaRotaryEmbedding`` computes them; the rotate-half layout repeats the angles for
    both halves of the head. YaRN multiplies cos and sin by its attention factor.

    Args:
        head_dim: rotary dimension (even).
        max_position: number of positions (rows).
        base: rope_theta.
        rope_scaling: None (the default RoPE) or a dict :func:`normalize_rope_scaling`
            accepts. The engine passes it only to a model with scaling, so a swapped
            table function of three arguments still works on the others.
    Returns:
        (cos, sin): float32 [max_position, head_dim] each.
    """
    # On the CPU even inside a `torch.device("meta")` block (the loader builds the model
    # there): meta arithmetic runs through torch._refs, whose first use imports
    # torch._dynamo (about 2 s per process). The loader moves the tables to the device.
    if rope_scaling is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                device="cpu").float() / head_dim))
        attention_factor = 1.0
    else:
        inv_freq, attention_factor = rope_inv_freq(head_dim, base, rope_scaling)
    t = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    if attention_factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * attention_factor, emb.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    """RoPE from a precomputed float32 table (default or scaled).

    Args:
        head_dim: rotary dimension (the whole head).
        max_position: size of the precomputed table (positions >= it raise IndexError).
        base: rope_theta.
        table_fn: the function that computes the tables (the "rotary.table" step;
            default :func:`rope_table_ref`). Its result is cast to float32.
        rope_scaling: None, or a normalized scaling dict (:func:`normalize_rope_scaling`),
            passed to ``table_fn`` as ``rope_scaling=`` (only when not None).
    """

    cos_cached: torch.Tensor  # [max_position, head_dim] float32 buffers
    sin_cached: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, base: float, table_fn=rope_table_ref,
                 rope_scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.table_fn = table_fn
        self.rope_scaling = rope_scaling
        if rope_scaling is None:
            cos, sin = table_fn(head_dim, max_position, base)
        else:
            cos, sin = table_fn(head_dim, max_position, base, rope_scaling=rope_scaling)
        self.register_buffer("cos_cached", cos.float(), persistent=False)
        self.register_buffer("sin_cached", sin.float(), persistent=False)
        self._last: tuple | None = None  # (positions, dtype, cos, sin) of the last call

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """[T, head_dim] cos and sin for these positions, in ``dtype``. Layers sharing this
        module in one forward pass get the same ``positions`` tensor, so the lookup is
        done once per step and reused (the tensor is held, so identity is reliable)."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos = self.cos_cached[positions].to(dtype)
        sin = self.sin_cached[positions].to(dtype)
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    kernel = None  # e.g. minivllm_kernels.rotary.rotary_embedding (in place, same numbers)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [num_tokens] int64; q: [T, Hq, D]; k: [T, Hkv, D]. Returns (q, k)
        (rotated in place when ``kernel`` is set)."""
        if self.kernel is not None:
            return self.kernel(positions, q, k, self.cos_cached, self.sin_cached)
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)


def get_rope(head_dim: int, max_position: int, base: float, rope_scaling: dict | None,
             max_position_embeddings: int | None = None) -> RotaryEmbedding:
    """Build the rotary embedding (vLLM: ``get_rope`` in
    ``vllm/model_executor/layers/rotary_embedding/__init__.py``).

    Args:
        head_dim: rotary dimension.
        max_position: table size (>= max_model_len).
        base: rope_theta.
        rope_scaling: None or a dict of a type in :data:`ROPE_SCALING_TYPES`.
        max_position_embeddings: the config's value (the default L0 of dynamic and yarn).
    Raises:
        ValueError: an unknown scaling type or a bad field (:func:`normalize_rope_scaling`).
    """
    scaling = normalize_rope_scaling(rope_scaling, max_position_embeddings)
    return RotaryEmbedding(head_dim, max_position, base, rope_scaling=scaling)
