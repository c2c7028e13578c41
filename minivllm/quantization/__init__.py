"""Quantization: weight quantization methods and KV-cache storage formats.

Weights (``LLM(quantization=..., quantization_config={...})``): every linear layer of the
decoder (qkv_proj, o_proj, gate_up_proj, down_proj) is quantized on load from the float
checkpoint; embeddings, norms and the (tied) LM head stay in the model dtype, as in
vLLM's default ``ignore`` of ``lm_head``.

======== ====================================================== ==========================
method   what is stored                                          options (defaults)
======== ====================================================== ==========================
int8     int8 weights, symmetric, one scale per tensor or per   granularity ("channel")
         output channel; weight-only (activations stay float)
int4     4-bit round-to-nearest, groups along the input dim,     group_size (128),
         symmetric or asymmetric (zero point per group)          symmetric (True)
awq      int4 after AWQ's activation-aware per-input-channel     group_size (128),
         scale search and clip search (Lin et al. 2023)          symmetric (False), n_grid
                                                                 (20), clip (True)
gptq     int4 from GPTQ's Hessian-based error feedback           group_size (128),
         (Frantar et al. 2022), optional act-order               symmetric (True),
                                                                 act_order (True),
                                                                 percdamp (1.0)
fp8      W8A8: e4m3 weights per tensor or per channel; e4m3      granularity ("tensor"),
         activations per tensor (static, calibrated) or per      activation_scheme
         token (dynamic), fp32 accumulation                      ("dynamic")
======== ====================================================== ==========================

awq, gptq and fp8 with static activation scales need calibration data: by default the
bundled chat conversations (``calibration="conversations"``, ``calibration_tokens``
4096), which are not the corpus or QA sets the benchmarks evaluate on.

GPTQ's defaults are not AutoGPTQ's (desc_act=False, damp_percent=0.01). Measured on the
embedded model with 4096 calibration tokens (``benchmarks/quantization.py``), those
settings lower each layer's error on the calibration data 2-6x yet lose to plain
round-to-nearest end to end: GPTQ moves error into input directions the small
calibration set leaves nearly empty, and other text uses them. Damping the Hessian with
its mean diagonal (``percdamp=1.0``) limits that, and act-order helps further.

Saved checkpoints: see :mod:`minivllm.quantization.checkpoint`.
KV cache: see :mod:`minivllm.quantization.kv_cache`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

QUANTIZATION_METHODS = ("int8", "int4", "awq", "gptq", "fp8")
CALIBRATION_SETS = ("conversations", "corpus")

# Options each method accepts, with its defaults.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "int8": {"granularity": "channel"},
    "int4": {"group_size": 128, "symmetric": True},
    "awq": {"group_size": 128, "symmetric": False, "n_grid": 20, "clip": True},
    # act_order and percdamp differ from AutoGPTQ's defaults (desc_act=False,
    # damp_percent=0.01): with 4k calibration tokens those lose to round-to-nearest on
    # this course's model (benchmarks/RESULTS.md), strong damping does not.
    "gptq": {"group_size": 128, "symmetric": True, "act_order": True, "percdamp": 1.0,
             "block_size": 128},
    "fp8": {"granularity": "tensor", "activation_scheme": "dynamic"},
}
_CALIBRATED = {"awq", "gptq"}
_CALIB_DEFAULTS = {"calibration": "conversations", "calibration_tokens": 4096}


@dataclass(frozen=True)
class QuantConfig:
    """A weight-quantization method and its options (see the module table)."""

    method: str
    granularity: str = "channel"
    group_size: int = 128
    symmetric: bool = True
    act_order: bool = False
    percdamp: float = 0.01
    block_size: int = 128
    n_grid: int = 20
    clip: bool = True
    activation_scheme: str = "dynamic"
    calibration: str = "conversations"
    calibration_tokens: int = 4096

    @property
    def needs_calibration(self) -> bool:
        return self.method in _CALIBRATED or (
            self.method == "fp8" and self.activation_scheme == "static")

    def options(self) -> dict[str, Any]:
        """The options that apply to this method (for reports and saved checkpoints)."""
        keys = list(_DEFAULTS[self.method])
        if self.needs_calibration:
            keys += list(_CALIB_DEFAULTS)
        return {k: getattr(self, k) for k in keys}

    def label(self) -> str:
        o = self.options()
        if self.method == "int8":
            return f"int8-{o['granularity']}"
        if self.method == "fp8":
            return f"fp8-{o['granularity']}-{o['activation_scheme']}"
        sym = "sym" if o["symmetric"] else "asym"
        extra = "-actorder" if o.get("act_order") else ""
        return f"{self.method}-{sym}-g{o['group_size']}{extra}"


def parse_quantization(method: Optional[str], options: Optional[dict]) -> Optional[QuantConfig]:
    """Validate ``quantization`` / ``quantization_config`` into a :class:`QuantConfig`.

    Raises:
        ValueError: unknown method or option, or an option value out of range; the
            message lists what is allowed.
    """
    if method is None:
        if options:
            raise ValueError("quantization_config was given without quantization")
        return None
    if not isinstance(method, str) or method not in _DEFAULTS:
        raise ValueError(f"Unknown quantization {method!r}; allowed: "
                         f"{', '.join(QUANTIZATION_METHODS)} (or None)")
    allowed = dict(_DEFAULTS[method])
    if method in _CALIBRATED or method == "fp8":
        allowed.update(_CALIB_DEFAULTS)
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"quantization_config must be a dict of options, got {options!r}")
    options = dict(options or {})
    unknown = sorted((str(k) for k in set(options) - set(allowed)))
    if unknown:
        raise ValueError(f"Unknown quantization_config option(s) {unknown} for quantization="
                         f"{method!r}; allowed: {sorted(allowed)}")
    values = {**allowed, **options}
    _check_options(method, values)
    if method == "fp8" and values["activation_scheme"] == "dynamic":
        given = sorted(set(options) & set(_CALIB_DEFAULTS))
        if given:
            raise ValueError(f"quantization_config {given} only apply to fp8 with "
                             "activation_scheme='static' (dynamic scales need no calibration)")
    for name in ("group_size", "n_grid", "block_size", "calibration_tokens"):
        if name in values:
            values[name] = int(values[name])  # numpy integers -> int
    if "percdamp" in values:
        values["percdamp"] = float(values["percdamp"])
    return QuantConfig(method=method, **values)


def _check_options(method: str, o: dict) -> None:
    def bad(name, allowed):
        raise ValueError(f"quantization_config[{name!r}] for {method!r} must be {allowed}, "
                         f"got {o[name]!r}")

    if "granularity" in o and o["granularity"] not in ("tensor", "channel"):
        bad("granularity", "'tensor' or 'channel'")
    def is_int(v) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))

    if "group_size" in o and (not is_int(o["group_size"]) or o["group_size"] not in (32, 64, 128)):
        bad("group_size", "the integer 32, 64 or 128")
    for flag in ("symmetric", "act_order", "clip"):
        if flag in o and not isinstance(o[flag], bool):
            bad(flag, "True or False")
    for name, lo, hi in (("n_grid", 2, 1000), ("block_size", 1, 1 << 16),
                         ("calibration_tokens", 16, 1 << 20)):
        if name in o and (not is_int(o[name]) or not lo <= o[name] <= hi):
            bad(name, f"an integer in [{lo}, {hi}]")
    if "percdamp" in o and (isinstance(o["percdamp"], (bool, np.bool_))
                            or not isinstance(o["percdamp"], numbers.Real)
                            or not 0 < o["percdamp"] <= 1):
        bad("percdamp", "a number in (0, 1]")
    if "activation_scheme" in o and o["activation_scheme"] not in ("dynamic", "static"):
        bad("activation_scheme", "'dynamic' or 'static'")
    if "calibration" in o and o["calibration"] not in CALIBRATION_SETS:
        bad("calibration", f"one of {CALIBRATION_SETS}")
