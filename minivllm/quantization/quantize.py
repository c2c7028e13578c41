"""Quantize a loaded float model in place: calibrate, then swap each decoder linear layer
for a :class:`~minivllm.layers.linear.QuantLinear`.

Calibration:

* awq and gptq go layer by layer, as the GPTQ reference (``llama_sequential``) and AutoAWQ
  do: the calibration sequences' hidden states enter decoder layer l, its four linear
  layers' inputs are observed, the layer is quantized, and the *quantized* layer's output
  becomes layer l+1's input. Each layer is thus fitted to the inputs it will see when the
  layers below it are quantized too. (A one-pass variant that observes the float model
  only was measured here first; its GPTQ was worse than round-to-nearest end to end:
  the error it pushes into directions the float activations leave empty is exactly
  where the quantized model's activations then go.)
* fp8 with static activation scales needs only amax, from one pass of the float model.
"""

from __future__ import annotations

import logging
import re
from typing import Optional

import torch
from tqdm.auto import tqdm

from minivllm.layers.linear import Linear, QuantLinear, make_method
from minivllm.quantization import QuantConfig, registered_method_class
from minivllm.quantization.calibration import calibration_forward, layer_forward, observe_inputs

logger = logging.getLogger("minivllm")
TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
AWQ_SAMPLE_ROWS = 512  # input rows kept per layer for AWQ's scale and clip searches


def target_layers(model) -> dict[str, Linear]:
    """``{"layers.0.self_attn.qkv_proj": module, ...}`` for every decoder linear."""
    out = {}
    for i, layer in enumerate(model.layers):
        for t in TARGETS:
            parent, _, attr = t.partition(".")
            out[f"layers.{i}.{t}"] = getattr(getattr(layer, parent), attr)
    return out


# Checkpoint (unfused) shard names of the fused layers, as vLLM's fused mapping has them.
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _entry_matches(entry: str, name: str) -> bool:
    """compressed-tensors' rule (vLLM ``compressed_tensors/utils.py``: ``should_ignore_layer``,
    ``_is_equal_or_regex_match``): a "re:" entry matches with ``re.match`` (anchored at the
    start, not the end); any other entry matches the exact name."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == name


def _spellings(name: str) -> tuple[str, str]:
    """A module name as the engine spells it and as the HF checkpoint does ("model.")."""
    return (name, name if name == "lm_head" else f"model.{name}")


def ignored_layers(model, ignore) -> set[str]:
    """The decoder linear layers (names as in :func:`target_layers`) that ``ignore``
    leaves unquantized; see :mod:`minivllm.quantization` for the convention.

    A fused layer (``qkv_proj``, ``gate_up_proj``) is ignored when an entry matches its
    fused name, or when entries match all of its shards (``q_proj``, ``k_proj``,
    ``v_proj``; ``gate_proj``, ``up_proj``).

    Raises:
        ValueError: entries match some shards of a fused layer but not all (it has one
            scheme); an entry that matches no module of the model (a typo would quantize
            the layer silently); the message gives example names.
    """
    if not ignore:
        return set()
    # "lm_head" is a name even when the head is tied to the embeddings (no module)
    names = [n for n, _ in model.named_modules() if n] + ["lm_head"]
    used: set[str] = set()

    def hits(name: str) -> list[str]:
        found = [e for e in ignore if any(_entry_matches(e, s) for s in _spellings(name))]
        used.update(found)
        return found

    for n in names:      # embeddings, norms, lm_head...: accepted, they stay float anyway
        hits(n)
    out = set()
    for name in target_layers(model):
        proj = name.rsplit(".", 1)[-1]
        if hits(name):
            out.add(name)
            continue
        shards = [name[:-len(proj)] + s for s in FUSED_SHARDS.get(proj, ())]
        shard_hits = [bool(hits(s)) for s in shards]
        if any(shard_hits) and not all(shard_hits):
            some = [s for s, h in zip(shards, shard_hits) if h]
            raise ValueError(f"quantization_config['ignore'] ignores {some} but not all shards "
                             f"of the fused layer {name} ({', '.join(shards)}); a fused layer "
                             "has one scheme: ignore all of its shards or none (or name "
                             f"{name!r} itself)")
        if shards and all(shard_hits):
            out.add(name)
    unused = [e for e in ignore if e not in used]
    if unused:
        raise ValueError(f"quantization_config['ignore'] entries {unused} match no module of "
                         f"the model; names look like 'layers.0.mlp.down_proj' (or "
                         f"'model.layers.0.mlp.down_proj', shards 'layers.0.self_attn.q_proj', "
                         f"'layers.0.mlp.up_proj'), patterns like 're:.*\\.o_proj'")
    return out


def _replace(model, name: str, new) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, new)


@torch.inference_mode()
def quantize_model(model, cfg: QuantConfig, calibration_ids: Optional[list[list[int]]] = None,
                   device="cpu", progress: bool = True) -> None:
    """Quantize every decoder linear layer of ``model`` (float32 weights) in place, except
    those ``cfg.ignore`` names (:func:`ignored_layers`), which stay as loaded.

    Args:
        model: our LlamaForCausalLM, weights loaded, rotary tables set.
        cfg: the method and options.
        calibration_ids: token sequences for calibrated methods (ignored otherwise).
    Raises:
        ValueError: a calibrated method without calibration sequences.
    """
    method = make_method(cfg)
    if cfg.needs_calibration and not calibration_ids:
        raise ValueError(f"quantization={cfg.method!r} needs calibration sequences")
    skip = ignored_layers(model, cfg.ignore)  # left float, as loaded
    targets = {n: m for n, m in target_layers(model).items() if n not in skip}
    bar = tqdm(total=len(targets), desc=f"quantizing ({cfg.label()})", unit="layer",
               disable=not progress)
    layerwise = cfg.method in ("awq", "gptq") or (cfg.needs_calibration
                                                  and registered_method_class(cfg.method))
    if layerwise:
        hidden = [model.embed_tokens(torch.tensor(ids, device=device)) for ids in calibration_ids]
        # layers past the last one with a target need no calibration inputs (an ignore
        # list that keeps the upper layers float skips their forward passes)
        last = max((int(n.split(".")[1]) for n in targets), default=-1)
        for i, layer in enumerate(model.layers[:last + 1]):
            names = {n: m for n, m in targets.items() if n.startswith(f"layers.{i}.")}
            if not names:  # nothing to observe here: only carry the hidden states on
                hidden = [layer_forward(layer, h) for h in hidden]
                continue
            with observe_inputs(names, keep_hessian=cfg.method == "gptq",
                                max_rows=0 if cfg.method == "gptq" else AWQ_SAMPLE_ROWS) as stats:
                for h in hidden:
                    layer_forward(layer, h)
            _quantize_layers(model, names, method, stats, bar)
            hidden = [layer_forward(layer, h) for h in hidden]  # the quantized layer's output
    else:
        stats: dict = {}
        if cfg.needs_calibration:  # fp8 static activation scales: amax of the float model
            with observe_inputs(targets) as stats:
                calibration_forward(model, calibration_ids, device)
        _quantize_layers(model, targets, method, stats, bar)
    bar.close()


def _quantize_layers(model, layers: dict, method, stats: dict, bar) -> None:
    from minivllm.quantization import weight_quant as wq

    cfg = method.cfg
    for name, lin in layers.items():
        weight = lin.weight.detach().float().cpu()
        st = stats.get(name)
        if cfg.method == "awq":
            st.awq_scale, _ = wq.awq_search_scale([weight], st.sample, cfg.group_size,
                                                  cfg.symmetric, n_grid=cfg.n_grid)
        tensors = {k: v.to(lin.weight.device) for k, v in method.quantize(weight, st).items()}
        method.check_tensors(tensors, lin.out_features, lin.in_features)
        bias = None if lin.bias is None else lin.bias.detach().clone()
        _replace(model, name, QuantLinear(method, tensors, lin.in_features, lin.out_features,
                                          bias, tf32=lin.tf32))
        if st is not None:  # free the Hessian / samples as we go
            stats[name] = None
        bar.update(1)


def set_float32_matmul_precision(model, precision: str, device: str) -> None:
    """``"highest"``: plain float32. ``"high"``: TF32 for float32 matmuls.

    On CUDA this sets torch's real TF32 switch (``torch.backends.cuda.matmul.allow_tf32``
    via ``torch.set_float32_matmul_precision``), which is process-wide: every float32
    matmul in the process, not only this engine's. On CPU it flags the model's linear
    layers and LM head to round their inputs to TF32 (emulation; attention's own
    matmuls are not rounded).
    """
    high = precision == "high"
    dtype = model.embed_tokens.weight.dtype
    if high and dtype != torch.float32:
        logger.warning("float32_matmul_precision='high' (TF32) changes only float32 matmuls; "
                       "this model runs in %s, so it has no effect (dtype='auto' serves "
                       "float32 checkpoints in bfloat16: pass dtype='float32')", dtype)
    if str(device).startswith("cuda"):
        torch.set_float32_matmul_precision(precision)
        high = False  # the hardware does it
    model.tf32 = high
    for module in model.modules():
        if isinstance(module, (Linear, QuantLinear)):
            module.tf32 = high


def model_weight_bytes(model) -> dict[str, int]:
    """Bytes of the weights as stored: ``{"linear": ..., "other": ..., "total": ...}``.

    "linear" counts the decoder linear layers (quantized tensors and scales when
    quantized); "other" the embeddings, norms and an untied LM head.
    """
    linear = other = 0
    seen = set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            linear += module.weight_bytes()
            seen.update(id(t) for t in module.stored_tensors().values())
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if id(p) in seen:
            continue
        nbytes = p.numel() * p.element_size()
        if any(name.endswith(f"{t}.weight") for t in TARGETS):
            linear += nbytes
        elif "rotary" not in name and "cos_sin" not in name:
            other += nbytes
    return {"linear": linear, "other": other, "total": linear + other}
