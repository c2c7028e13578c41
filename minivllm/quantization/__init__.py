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
mxfp4    E2M1 weights in blocks of 32 with a power-of-two        none
         (E8M0) scale per block (OCP MX); weight-only
modelo-  NVFP4: E2M1 weights in blocks of 16 with an E4M3 scale  none
pt_fp4   per block and a float32 scale per tensor; weight-only
======== ====================================================== ==========================

The FP4 formats and their scale rules: :mod:`minivllm.quantization.fp4`.

Options every method accepts:

* ``ignore``: decoder linear layers to leave unquantized (float, bit-equal to the
  unquantized engine's), in llm-compressor's / compressed-tensors' convention: each entry
  is a module name (``"layers.0.mlp.down_proj"``, also with HF's ``"model."`` prefix) or
  a regular expression prefixed ``"re:"`` (``"re:.*layers\\.1[0-9]\\..*"``), matched
  from the start of the name (``re.match``). Checkpoint shard names address the fused
  layers: ``q_proj``/``k_proj``/``v_proj`` for ``qkv_proj`` and ``gate_proj``/``up_proj``
  for ``gate_up_proj``; a fused layer is ignored when all its shards are, and it is an
  error when only some are (vLLM's ``should_ignore_layer`` requires the same, since a
  fused layer has one scheme). An entry that names no module of the model is an error
  (a typo would otherwise quantize the layer silently); ``"lm_head"`` and
  ``"model.embed_tokens"``, common in llm-compressor recipes, are accepted and change
  nothing, since those stay float anyway.

Your own method (vLLM's ``@register_quantization_config`` idea, in
``vllm/model_executor/layers/quantization/__init__.py``): subclass
:class:`minivllm.layers.linear.LinearMethod` and register it by name::

    from minivllm.layers.linear import LinearMethod
    from minivllm.quantization import register_quantization_method

    @register_quantization_method("my_int8", options={"granularity": "channel"})
    class MyInt8(LinearMethod):
        def quantize(self, weight, stats=None): ...     # -> {"qweight": ..., "weight_scale": ...}
        def dequantize(self, t): ...                    # -> float32 [out, in]
        def expected(self, out_features, in_features): ...

    LLM(quantization="my_int8", quantization_config={"granularity": "tensor"})

``options`` are the method's option names and defaults; ``quantization_config`` may set
them (and ``ignore``), nothing else. Options named like a :class:`QuantConfig` field
(``granularity``, ``group_size``, ...) are checked as the built-in methods check them and
read as ``cfg.granularity``; other names are read with ``cfg.option(name)``. Registered
methods get no calibration data (``stats`` is None) unless registered with
``calibrated=True``: then, as for awq, the bundled calibration text runs layer by layer
(each layer fitted to the outputs of the already quantized layers below it) and
``quantize(weight, stats)`` gets an
:class:`~minivllm.quantization.calibration.InputObserver` with ``stats.sample`` (up to
512 input rows of that layer, float32 ``[rows, in]``) and ``stats.amax``; such a method
also accepts ``calibration`` and ``calibration_tokens``. Differences from vLLM: vLLM
registers a ``QuantizationConfig`` (which then hands out a ``LinearMethodBase`` per
layer); here the linear method itself is registered, since one config class serves every
method. vLLM refuses any name already registered; here a built-in name is refused and a
registered one can be replaced with ``replace=True`` (a notebook cell run twice).

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
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

QUANTIZATION_METHODS = ("int8", "int4", "awq", "gptq", "fp8", "mxfp4", "modelopt_fp4")
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
    "mxfp4": {},  # block size and scale rule are the format's
    "modelopt_fp4": {},
}
_CALIBRATED = {"awq", "gptq"}
_CALIB_DEFAULTS = {"calibration": "conversations", "calibration_tokens": 4096}
# Methods registered with register_quantization_method: name -> (class, option defaults).
_REGISTERED: dict[str, tuple[type, dict[str, Any]]] = {}
# Registered methods that get calibration statistics (register_quantization_method(...,
# calibrated=True)).
_REGISTERED_CALIBRATED: set[str] = set()


def quantization_methods() -> tuple[str, ...]:
    """Every method ``quantization=`` accepts now: the built-in ones, then the registered."""
    return QUANTIZATION_METHODS + tuple(_REGISTERED)


def register_quantization_method(name: str, method_cls: Optional[type] = None, *,
                                 options: Optional[dict] = None, replace: bool = False,
                                 calibrated: bool = False):
    """Register a linear method under ``name`` so ``LLM(quantization=name)`` uses it.

    Use as a decorator (``@register_quantization_method("my_int8")``) or call it with
    the class. See the module docstring for an example and how this differs from vLLM's
    ``register_quantization_config``.

    Args:
        name: the ``quantization=`` value, a non-empty string; not a built-in method.
        method_cls: a subclass of :class:`minivllm.layers.linear.LinearMethod`
            implementing ``quantize``, ``dequantize`` (weight-only) and ``expected``.
        options: the method's option names and their defaults (``quantization_config``
            may set these and ``ignore``). Names of :class:`QuantConfig` fields are
            validated like the built-in methods' options.
        replace: allow replacing a method registered earlier under ``name``.
        calibrated: the method's ``quantize(weight, stats)`` gets calibration statistics
            (input rows, layer by layer, as awq gets them); see the module docstring.
    Returns:
        ``method_cls`` (a decorator when it is None).
    Raises:
        ValueError: a built-in or already registered name (without ``replace``), a name
            that is not a non-empty string, options that are not a dict of str keys or
            that include ``ignore``.
        TypeError: ``method_cls`` is not a LinearMethod subclass.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a quantization method name must be a non-empty string, got {name!r}")
    if not isinstance(calibrated, bool):
        raise ValueError(f"calibrated must be True or False, got {calibrated!r}")
    if name in QUANTIZATION_METHODS:
        raise ValueError(f"{name!r} is a built-in quantization method "
                         f"({', '.join(QUANTIZATION_METHODS)}); register yours under another name")
    if name in _REGISTERED and not replace:
        raise ValueError(f"quantization method {name!r} is already registered "
                         f"({_REGISTERED[name][0].__name__}); pass replace=True to replace it")
    opts = dict(options or {})
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"options must be a dict of option names and defaults, got {options!r}")
    bad = [k for k in opts if not isinstance(k, str) or k == "ignore"]
    if bad:
        raise ValueError(f"option names must be strings other than 'ignore' (every method "
                         f"accepts ignore), got {bad}")
    _check_options(name, opts)

    def wrap(cls):
        from minivllm.layers.linear import LinearMethod

        if not (isinstance(cls, type) and issubclass(cls, LinearMethod)):
            raise TypeError(f"register_quantization_method({name!r}) needs a subclass of "
                            f"minivllm.layers.linear.LinearMethod, got {cls!r}")
        _REGISTERED[name] = (cls, opts)
        if calibrated:
            _REGISTERED_CALIBRATED.add(name)
        else:
            _REGISTERED_CALIBRATED.discard(name)
        return cls

    return wrap if method_cls is None else wrap(method_cls)


def registered_method_class(name: str) -> Optional[type]:
    """The class registered under ``name``, or None (built-in or unknown)."""
    entry = _REGISTERED.get(name)
    return None if entry is None else entry[0]


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
    # Layers left unquantized (module names or "re:" patterns; see the module docstring).
    ignore: tuple[str, ...] = ()
    # A registered method's options that are not fields above: ((name, value), ...).
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def needs_calibration(self) -> bool:
        return self.method in _CALIBRATED or self.method in _REGISTERED_CALIBRATED or (
            self.method == "fp8" and self.activation_scheme == "static")

    def option(self, name: str) -> Any:
        """One option's value (a field, or a registered method's own option).

        Raises:
            KeyError: the method has no such option.
        """
        extra = dict(self.extra)
        if name in extra:
            return extra[name]
        if name in self.options():
            return getattr(self, name)
        raise KeyError(f"quantization={self.method!r} has no option {name!r}; it has "
                       f"{sorted(self.options())}")

    def options(self) -> dict[str, Any]:
        """The options that apply to this method (for reports and saved checkpoints);
        ``ignore`` only when it is not empty."""
        if self.method in _DEFAULTS:
            keys = list(_DEFAULTS[self.method])
            if self.needs_calibration:
                keys += list(_CALIB_DEFAULTS)
            out = {k: getattr(self, k) for k in keys}
        else:
            extra = dict(self.extra)
            registered = _REGISTERED[self.method][1] if self.method in _REGISTERED else {}
            out = {k: extra[k] if k in extra else getattr(self, k) for k in registered}
            if self.needs_calibration:
                out.update({k: getattr(self, k) for k in _CALIB_DEFAULTS})
        if self.ignore:
            out["ignore"] = list(self.ignore)
        return out

    def label(self) -> str:
        if self.method not in _DEFAULTS:
            return self.method
        o = self.options()
        if self.method == "int8":
            return f"int8-{o['granularity']}"
        if self.method == "fp8":
            return f"fp8-{o['granularity']}-{o['activation_scheme']}"
        if self.method in ("mxfp4", "modelopt_fp4"):
            return self.method
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
    if not isinstance(method, str) or (method not in _DEFAULTS and method not in _REGISTERED):
        registered = (f"registered: {', '.join(_REGISTERED)}" if _REGISTERED else
                      "none registered (minivllm.quantization.register_quantization_method)")
        raise ValueError(f"Unknown quantization {method!r}; allowed: "
                         f"{', '.join(QUANTIZATION_METHODS)} (built-in); {registered}; or None")
    registered_opts = _REGISTERED[method][1] if method in _REGISTERED else None
    allowed = dict(_DEFAULTS[method]) if registered_opts is None else dict(registered_opts)
    if method in _CALIBRATED or method == "fp8" or method in _REGISTERED_CALIBRATED:
        allowed.update(_CALIB_DEFAULTS)
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"quantization_config must be a dict of options, got {options!r}")
    options = dict(options or {})
    ignore = _check_ignore(options.pop("ignore", ()))
    unknown = sorted((str(k) for k in set(options) - set(allowed)))
    if unknown:
        raise ValueError(f"Unknown quantization_config option(s) {unknown} for quantization="
                         f"{method!r}; allowed: {sorted(allowed) + ['ignore']}")
    values = {**allowed, **options}
    _check_options(method, values)
    if registered_opts is not None:
        fields = set(QuantConfig.__dataclass_fields__) - {"method", "ignore", "extra"}
        extra = tuple(sorted((k, v) for k, v in values.items() if k not in fields))
        values = {k: v for k, v in values.items() if k in fields}
        values.update(extra=extra)
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
    return QuantConfig(method=method, ignore=ignore, **values)


def _check_ignore(ignore) -> tuple[str, ...]:
    """``ignore`` as a tuple of non-empty strings, every "re:" entry a valid pattern."""
    if isinstance(ignore, (str, bytes)) or not isinstance(ignore, (list, tuple)):
        raise ValueError("quantization_config['ignore'] must be a list of module names or "
                         f"'re:' patterns, e.g. ['layers.0.mlp.down_proj', 're:.*o_proj'], "
                         f"got {ignore!r}")
    for entry in ignore:
        if not isinstance(entry, str) or not entry or entry == "re:":
            raise ValueError(f"quantization_config['ignore'] entries must be non-empty "
                             f"strings, got {entry!r}")
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as e:
                raise ValueError(f"quantization_config['ignore'] entry {entry!r} is not a valid "
                                 f"regular expression: {e}") from None
    return tuple(ignore)


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
                            or not 0 < float(o["percdamp"]) <= 1):
        bad("percdamp", "a number in (0, 1]")
    if "activation_scheme" in o and o["activation_scheme"] not in ("dynamic", "static"):
        bad("activation_scheme", "'dynamic' or 'static'")
    if "calibration" in o and o["calibration"] not in CALIBRATION_SETS:
        bad("calibration", f"one of {CALIBRATION_SETS}")
