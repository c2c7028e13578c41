"""Imports point one way: kernels -> layers/attention -> models -> worker/core -> engine ->
llm -> entrypoints/precision (issue 22, item 3).

A module may import modules of its own layer and of any layer below it, never above.
Every import counts, the ones inside functions too (a lazy import is still a dependency;
it only hides the cycle). Read with ``ast``, nothing is imported. Edges that break the
rule today are listed in ``ALLOWED_UPWARD`` with the reason; the test also fails when a
listed edge no longer exists, so the list only shrinks.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The layers, lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, list[str]]] = [
    ("minivllm_kernels", ["minivllm_kernels"]),  # Triton kernels and their torch references: no minivllm
    # leaf modules every layer uses: settings, parameters, outputs, the tokenizer, helpers
    ("base", ["minivllm.config", "minivllm.sampling_params", "minivllm.outputs",
              "minivllm.tokenizer", "minivllm.utils", "minivllm.numerics"]),
    # torch modules and the numerics they run: attention backends and the per-layer KV
    # cache, the quantized formats (KV, w8a8, weight-only, fp4) and their registry
    ("layers/attention", ["minivllm.layers", "minivllm.attention", "minivllm.quantization"]),
    # the model and its loading (with cached quantized checkpoints), tensor-parallel
    # sharding of its layers, and the tools that quantize or calibrate a model by running it
    ("models", ["minivllm.models", "minivllm.parallel.tensor_parallel",
                "minivllm.parallel.emulated_tp", "minivllm.quantization.quantize",
                "minivllm.quantization.calibration", "minivllm.quantization.kv_calibration",
                "minivllm.quantization.checkpoint", "minivllm.quantization.smoothing"]),
    # Request: below the scheduler and the engine (engine/request.py re-exports it under
    # its old path)
    ("request", ["minivllm.request", "minivllm.engine.request"]),
    # the scheduler and KV-cache manager; the runner and what it runs per step (the step
    # registry, speculative decoding's proposers and verification)
    ("worker/core", ["minivllm.core", "minivllm.worker", "minivllm.spec_decode",
                     "minivllm.steps"]),
    ("engine", ["minivllm.engine", "minivllm.parallel.multiproc_executor"]),
    ("llm", ["minivllm.llm", "minivllm"]),  # LLM, and the package's re-exports of it
    # the servers, the CLI and the demo; the precision toolkit
    ("entrypoints/precision", ["minivllm.entrypoints", "minivllm.precision"]),
]

# Upward edges that exist today, (importer, imported) by module, each with its reason.
# An edge here that the code no longer has fails the test: remove it from the list.
_DRAFT = ("the draft model runs in a second LLMEngine built from the target's EngineArgs "
          "(vLLM loads it into the target's model runner)")
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("minivllm.config", "minivllm.quantization"):
        "a type annotation only (VllmConfig.quant_config: QuantConfig, under TYPE_CHECKING)",
    ("minivllm.quantization.calibration", "minivllm.precision.evalsets"):
        "the default calibration text is the bundled eval sets, a data package that sits "
        "under minivllm.precision (whose __init__ loads the toolkit); moving it out changes "
        "the import path 49 chapters and labs use",
    ("minivllm.quantization.checkpoint", "minivllm"):
        "a cached quantized checkpoint that is missing is built through LLM",
    ("minivllm.spec_decode.draft_model", "minivllm.engine.llm_engine"): _DRAFT,
    ("minivllm.spec_decode.draft_model", "minivllm.engine.arg_utils"): _DRAFT,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ("minivllm", "minivllm_kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def _imports(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package modules ``module`` imports (``from a.b import c``: ``a.b.c`` if it is a
    module, else ``a.b``)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")[: len(module.split(".")) - node.level + is_pkg]
                base = ".".join(pkg + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _upward_edges() -> set[tuple[str, str]]:
    mods = _modules()
    return {(m, t) for m, path in mods.items() for t in _imports(m, path, mods)
            if _layer_of(t) > _layer_of(m)}


def test_every_module_has_a_layer():
    for m in _modules():
        _layer_of(m)


def test_imports_point_down():
    new = sorted(_upward_edges() - set(ALLOWED_UPWARD))
    names = [n for n, _ in LAYERS]
    assert not new, "imports against the layer order ({}):\n{}".format(
        " -> ".join(names), "\n".join(f"  {a} ({names[_layer_of(a)]}) imports {b} "
                                      f"({names[_layer_of(b)]})" for a, b in new))


def test_allowlist_is_not_stale():
    stale = sorted(set(ALLOWED_UPWARD) - _upward_edges())
    assert not stale, f"allowed upward imports that no longer exist (remove them): {stale}"


def test_kernels_import_nothing_from_minivllm():
    mods = _modules()
    found = sorted((m, t) for m, p in mods.items() if m.split(".")[0] == "minivllm_kernels"
                   for t in _imports(m, p, mods) if t.split(".")[0] == "minivllm")
    assert not found, f"minivllm_kernels/ must not import minivllm (torch references: minivllm_kernels/): {found}"
