"""Save and load quantized checkpoints.

Format (version 1), an HF-style folder:

* ``config.json``: the model's config plus ::

      "quantization_config": {"quant_method": "minivllm", "format_version": 1,
                              "method": "gptq", "options": {"group_size": 128, ...}}

  (``options`` holds ``ignore`` when layers were left unquantized; those layers are
  stored as float weights under their fused names, ``...qkv_proj.weight``. A method
  registered with ``register_quantization_method`` must be registered again, under the
  same name, before such a folder loads.)

* ``model.safetensors``:

  - float tensors under their HF names (``model.embed_tokens.weight``,
    ``model.norm.weight``, ``model.layers.N.input_layernorm.weight``, ...), in the
    dtype the engine ran in;
  - each quantized decoder linear under its *fused* name
    ``model.layers.N.{self_attn.qkv_proj, self_attn.o_proj, mlp.gate_up_proj,
    mlp.down_proj}.<tensor>`` where qkv_proj stacks the rows of q, k, v and gate_up_proj
    those of gate, up (as vLLM fuses them), and ``<tensor>`` is:

    ========== ==================================================================
    qweight    int8 [out, in] (int8); uint8 [out, in/2] packed nibbles, even column
               in the low nibble (int4/awq/gptq); float8_e4m3fn [out, in] (fp8)
    weight_scale float32 [] or [out, 1] (int8, fp8): w = qweight * weight_scale
    scales     float32 [out, in/group_size] (int4/awq/gptq)
    zeros      uint8 [out, in/group_size]: w = (q - zeros) * scales per group
    awq_scale  float32 [in] (awq): the layer computes (x / awq_scale) @ w^T
    input_scale float32 [] (fp8 static): x is quantized as x / input_scale
    ========== ==================================================================

* the tokenizer files and chat template copied from the source folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from minivllm.quantization import QuantConfig, parse_quantization

FORMAT_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt",
                    "tokenizer.model")


def saved_quant_config(cfg: dict) -> Optional[QuantConfig]:
    """The QuantConfig of a folder saved by :func:`save_quantized`, or None.

    Raises:
        ValueError: a quantization_config from another tool (GPTQ/AWQ checkpoints made
            by AutoGPTQ/AutoAWQ use other layouts) or an unknown format version.
    """
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != "minivllm":
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ValueError(f"This checkpoint is quantized with quant_method={method!r}; minivllm "
                         "loads float checkpoints (and quantizes them with quantization=...) "
                         "or its own saved format (quant_method='minivllm').")
    version = qc.get("format_version")
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise ValueError(f"Unsupported minivllm quantized format_version "
                         f"{qc.get('format_version')!r} (this version reads {FORMAT_VERSION})")
    options = qc.get("options", {})
    if not isinstance(qc.get("method"), str) or not isinstance(options, dict):
        raise ValueError(f"quantization_config of a minivllm checkpoint needs 'method' (a "
                         f"string) and 'options' (an object); got {qc!r}")
    return parse_quantization(qc["method"], options)


def save_quantized(engine, path: str | Path) -> Path:
    """Write the engine's quantized model to ``path`` (created; must not hold a config).

    Args:
        engine: an LLMEngine (``llm.llm_engine``) built with ``quantization=...``.
    Raises:
        ValueError: the engine is not quantized; ``path`` is empty, a file, or a folder
            that is not empty.
    """
    from minivllm.layers.linear import QuantLinear
    from safetensors.torch import save_file

    quant = engine.quant_config
    if quant is None:
        raise ValueError("save_quantized needs an engine built with quantization=...")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"save_quantized needs a folder path, got {path!r}")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; save_quantized writes a folder")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} already holds files (e.g. a model's config.json); pick a new "
                         "or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    src = Path(engine.model_config.path)
    model = engine.model_runner.model
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            for t_name, t in module.stored_tensors().items():
                tensors[f"model.{name}.{t_name}"] = t.detach().cpu().contiguous()
    for name, p in model.named_parameters():  # float weights, norms, biases
        hf = name if name == "lm_head.weight" else f"model.{name}"
        tensors[hf] = p.detach().cpu().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    float_dtype = next(p.dtype for p in model.parameters())  # the engine's dtype
    cfg["torch_dtype"] = str(float_dtype).removeprefix("torch.")
    cfg.pop("dtype", None)
    cfg["quantization_config"] = {"quant_method": "minivllm", "format_version": FORMAT_VERSION,
                                  "method": quant.method, "options": quant.options()}
    (out / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    for f in _TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, out / f)
    return out


def load_quantized_weights(model, path: Path, quant: QuantConfig) -> None:
    """Fill ``model`` (float, on CPU) from a folder written by :func:`save_quantized`.

    Raises:
        ValueError: a missing or unexpected tensor, or a shape mismatch.
    """
    from safetensors import safe_open

    from minivllm.layers.linear import QuantLinear, make_method
    from minivllm.quantization.quantize import _replace, ignored_layers, target_layers

    file = Path(path) / "model.safetensors"
    try:
        with safe_open(str(file), framework="pt") as st:
            stored = {name: st.get_tensor(name) for name in st.keys()}
    except Exception as e:  # missing, truncated or not safetensors
        raise ValueError(f"cannot read {file}: {type(e).__name__}: {e}") from None
    method = make_method(quant)
    skip = ignored_layers(model, quant.ignore)  # saved as float weights, loaded below
    for name, lin in target_layers(model).items():
        if name in skip:
            continue
        prefix = f"model.{name}."
        tensors = {k[len(prefix):]: stored.pop(k) for k in list(stored) if k.startswith(prefix)}
        bias = tensors.pop("bias", None)
        try:
            method.check_tensors(tensors, lin.out_features, lin.in_features)
        except ValueError as e:
            raise ValueError(f"{file}: {name}: {e}") from None
        _replace(model, name, QuantLinear(method, tensors, lin.in_features, lin.out_features,
                                          bias))
    params = dict(model.named_parameters())
    for hf_name, t in stored.items():
        name = hf_name.removeprefix("model.")
        if name not in params:
            raise ValueError(f"{file}: unexpected tensor {hf_name!r}")
        if tuple(params[name].shape) != tuple(t.shape) or not t.is_floating_point():
            raise ValueError(f"{file}: {hf_name!r} is {t.dtype} of shape {tuple(t.shape)}, "
                             f"expected a float tensor of shape {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(t)
        params.pop(name)
    missing = [n for n in params if not n.endswith(".bias")]
    if missing:
        raise ValueError(f"{file} is missing {len(missing)} tensors, e.g. {missing[:3]}")
