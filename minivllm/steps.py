"""The step registry: every numerically relevant step of the engine, by name.

No single vLLM file corresponds; the nearest is ``CustomOp``
(``vllm/model_executor/custom_op.py``), compared at the end of this docstring.

Each step is a small function with a reference implementation beside the code that
calls it, and every engine lets a caller swap it for the length of a ``with`` block
(DESIGN principle 2). That is how a chapter plants a fault, how a lab hands one step to
the learner, and how a test compares a fast path with its reference::

    from minivllm import LLM
    from minivllm.steps import reference

    llm = LLM(dtype="float32")
    def rms_norm_fp16(x, weight, eps): ...               # same signature as the reference
    with llm.swap_step("rms_norm", rms_norm_fp16):       # every RMSNorm of the model
        rows = llm.score(ids)
    with llm.swap_step("rms_norm", rms_norm_fp16, where=17):   # decoder layer 17 only
        ...
    with llm.swap_step("rms_norm", rms_norm_fp16, where="layers.17.input_layernorm"):
        ...
    reference("rms_norm")                                # the engine's own reference

The steps (signatures in each reference's docstring):

=====================  =========================================  ==================
name                   reference                                  where it is called
=====================  =========================================  ==================
rms_norm               layers/rms_norm.py:rms_norm_ref            every RMSNorm
fused_add_rms_norm     layers/rms_norm.py:fused_add_rms_norm_ref  every residual add
                                                                  (the norm after it)
rotary.table           layers/rotary_embedding.py:rope_table_ref  each layer's rotary
linear                 layers/linear.py:linear_ref                float linear layers
lm_head                models/llama.py:lm_head_ref                compute_logits
embedding              models/llama.py:embedding_ref              embed_tokens
attention.decode       attention/backends/torch_ref.py            TORCH backend
attention.prefill      attention/backends/torch_ref.py            TORCH backend
kv.quantize            quantization/kv_cache.py:quantize_kv       LayerKVCache.write
kv.dequantize          quantization/kv_cache.py:dequantize_kv     LayerKVCache.read
slot_mapping           attention/metadata.py:slot_mapping_ref     ModelRunner (writes
                                                                  and TORCH reads)
slot_mapping.read      attention/metadata.py:slot_mapping_ref     ModelRunner (TORCH
                                                                  reads only)
block_hash             core/kv_cache_manager.py:hash_block_tokens KVCacheManager
block_hash.extra_keys  core/kv_cache_manager.py:block_extra_keys  KVCacheManager
prefix_cache.lookup    core/kv_cache_manager.py:                  KVCacheManager
                       find_longest_cache_hit
scheduler.preempt      core/scheduler.py:preempt_request_ref      Scheduler._preempt
sampler.penalties      layers/sampler.py:penalties_ref            Sampler
sampler.top_k_top_p    layers/sampler.py:apply_top_k_top_p        Sampler
prompt.chat_template   tokenizer.py:render_chat_ref               LLM.chat
prompt.truncate        tokenizer.py:truncate_prompt_ref           InputProcessor.process_inputs
                                                                  (truncate_prompt_tokens)
prefill_chunk          attention/metadata.py:prefill_chunk_ref    TORCH backend's
                                                                  build_metadata (ch23)
rejection_sampler      spec_decode/rejection_sampler.py:          worker/sampling.py:
                       rejection_sampler_ref                      verify_drafts (ch21)
spec_decode.ngram      spec_decode/ngram_proposer.py:             NgramProposer (method
                       propose_ngram                              "ngram", ch21)
fp8.linear             quantization/w8a8.py:fp8_linear_ref        every fp8 (W8A8)
                                                                  linear layer (ch17)
=====================  =========================================  ==================

While nothing is swapped the engine runs its own path, which is the reference in the
default configuration (TORCH backend, ``float32_matmul_precision="highest"``) and the
configured variant otherwise (Triton kernels for RMSNorm and rotary on CUDA, TF32
emulation for the linears and the LM head). ``swap_step``:

* suspends CUDA graphs for the block (a replay runs no Python, so it would skip the
  swapped function);
* resets the prefix cache on entry and exit when the step changes K/V (``changes_kv``),
  so no block computed with one function is reused under the other; such a step cannot
  be swapped while requests are in flight;
* restores what was there before on exit, also when the block raises; swaps nest.

vLLM has no single registry; its analogs are ``CustomOp`` (``vllm/model_executor/
custom_op.py``: a reference ``forward_native`` beside each device kernel, selected by
``compilation_config.custom_ops``), ``@register_quantization_config``, the attention
backend selection (``VLLM_ATTENTION_BACKEND``) and logits processors.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Union, cast

import torch

from minivllm.attention.backends.torch_ref import decode_attention_ref, prefill_attention_ref
from minivllm.attention.metadata import slot_mapping_ref
from minivllm.attention.metadata import prefill_chunk_ref
from minivllm.core.kv_cache_manager import (block_extra_keys, find_longest_cache_hit,
                                            hash_block_tokens)
from minivllm.core.scheduler import preempt_request_ref
from minivllm.layers.linear import Fp8Method, Linear, QuantLinear, linear_ref
from minivllm.layers.rms_norm import RMSNorm, fused_add_rms_norm_ref, rms_norm_ref
from minivllm.layers.rotary_embedding import RotaryEmbedding, rope_table_ref
from minivllm.layers.sampler import apply_top_k_top_p, penalties_ref
from minivllm.models.llama import embedding_ref, lm_head_ref
from minivllm.quantization.kv_cache import dequantize_kv, quantize_kv
from minivllm.quantization.w8a8 import fp8_linear_ref
from minivllm.tokenizer import render_chat_ref, truncate_prompt_ref
from minivllm.spec_decode.ngram_proposer import propose_ngram
from minivllm.spec_decode.rejection_sampler import rejection_sampler_ref

logger = logging.getLogger("minivllm")

Where = Union[None, int, str, Iterable[int]]


@dataclass(frozen=True)
class Site:
    """One place a step is called: ``name`` (a module path such as
    ``layers.3.input_layernorm``, or an engine part such as ``sampler``) and ``swap(fn,
    memo) -> restore``, which installs ``fn`` there and returns a function that puts
    back what was there. ``memo`` is shared by the sites of one swap."""

    name: str
    swap: Callable[[Callable, dict], Callable[[], None]]


@dataclass(frozen=True)
class Step:
    """A named step.

    Attributes:
        name: the registry name.
        reference: the reference implementation (its docstring gives the signature).
        signature: the call, in one line.
        changes_kv: swapping it changes the K/V the cache stores (the prefix cache is
            reset around a swap).
        per_layer: it has one site per layer, so ``where`` can pick layers.
        torch_backend_only: only the TORCH attention backend calls it (the TRITON
            kernels do this work inside the kernel).
        sites: ``engine -> [Site]``.
    """

    name: str
    reference: Callable
    signature: str
    changes_kv: bool
    per_layer: bool
    torch_backend_only: bool
    sites: Callable[[Any], list[Site]]


def _attr_site(name: str, obj: Any, attr: str) -> Site:
    def swap(fn, memo):
        had = attr in vars(obj)
        old = getattr(obj, attr)
        setattr(obj, attr, fn)

        def restore():
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)  # back to the class default
        return restore
    return Site(name, swap)


def _module_sites(cls: type, attr: str, exclude: tuple[str, ...] = ()):
    def sites(engine) -> list[Site]:
        model = engine.model_runner.model
        return [_attr_site(name, m, attr) for name, m in model.named_modules()
                if isinstance(m, cls) and name not in exclude]
    return sites


def _attention_sites(attr: str):
    def sites(engine) -> list[Site]:
        return [_attr_site(f"layers.{i}.self_attn", layer.self_attn.backend, attr)
                for i, layer in enumerate(engine.model_runner.model.layers)]
    return sites


def _kv_sites(attr: str):
    def sites(engine) -> list[Site]:
        return [_attr_site(f"layers.{i}.self_attn.kv_cache", layer.self_attn.kv_cache, attr)
                for i, layer in enumerate(engine.model_runner.model.layers)]
    return sites


def _rotary_sites(engine) -> list[Site]:
    """The rotary module is shared by all layers (one table); a swap builds a new module
    from the step's tables for the chosen layers (one per module it replaces)."""
    out = []
    for i, layer in enumerate(engine.model_runner.model.layers):
        attn = layer.self_attn

        def swap(fn, memo, attn=attn):
            old = attn.rotary_emb
            new = memo.get(id(old))
            if new is None:
                new = RotaryEmbedding(old.head_dim, old.max_position, old.base, table_fn=fn,
                                      rope_scaling=old.rope_scaling)
                for t, what in ((new.cos_cached, "cos"), (new.sin_cached, "sin")):
                    if tuple(t.shape) != (old.max_position, old.head_dim):
                        raise ValueError(f"the rotary.table step returned a {what} table of "
                                         f"shape {tuple(t.shape)}; expected "
                                         f"[max_position, head_dim] = "
                                         f"{[old.max_position, old.head_dim]}")
                new = new.to(old.cos_cached.device)
                if "kernel" in vars(old):
                    new.kernel = old.kernel
                memo[id(old)] = new
            attn.rotary_emb = new

            def restore():
                attn.rotary_emb = old
            return restore
        out.append(Site(f"layers.{i}.self_attn.rotary_emb", swap))
    return out


def _embedding_sites(engine) -> list[Site]:
    """The token embedding: the module's ``forward`` is replaced (its forward hooks,
    such as the precision toolkit's, still run) by ``fn(input_ids, weight)``."""
    emb = engine.model_runner.model.embed_tokens

    def swap(fn, memo):
        had = "forward" in vars(emb)
        old = emb.forward
        emb.forward = lambda input_ids: fn(input_ids, emb.weight)

        def restore():
            if had:
                emb.forward = old
            else:
                del emb.forward
        return restore
    return [Site("embed_tokens", swap)]


def _ngram_sites(engine) -> list[Site]:
    from minivllm.spec_decode.ngram_proposer import NgramProposer

    if not isinstance(getattr(engine, "proposer", None), NgramProposer):
        raise ValueError("step 'spec_decode.ngram' needs an engine built with "
                         "speculative_config={'method': 'ngram', ...}")
    return [_attr_site("proposer", engine.proposer, "propose_fn")]


def _fp8_site(name: str, layer: QuantLinear) -> Site:
    """One fp8 linear layer: its ``forward`` is replaced (its forward hooks still run) by
    ``fn(x [tokens, in], qweight, weight_scale, input_scale, bias)`` on the flattened
    input. (Not a branch in ``Fp8Method.apply``: ``layers/linear.py`` is part of the
    cached checkpoints' code digest.) While swapped, the layer's batch-invariant row
    mode is not applied."""
    def swap(fn, memo):
        had = "forward" in vars(layer)
        old = layer.forward

        def forward(x):
            shape = x.shape
            w = cast(torch.Tensor, layer.qweight)  # fp8_linear_ref keeps q_w's float32
            if getattr(w, "_fp8_f32_cache", None) is None:  # copy on the tensor: share the
                f32 = layer.dequantized_weight(torch.float32)  # layer's own copy
                setattr(w, "_fp8_f32_cache", ((w.data_ptr(), w.shape), f32))
            y = fn(x.reshape(-1, shape[-1]), layer.qweight, layer.weight_scale,
                   layer.input_scale, layer.bias)
            return y.reshape(*shape[:-1], y.shape[-1])
        layer.forward = forward  # type: ignore[method-assign]  # the swap itself

        def restore():
            if had:
                layer.forward = old  # type: ignore[method-assign]
            else:
                del layer.forward
        return restore
    return Site(name, swap)


def _fp8_sites(engine) -> list[Site]:
    """Every W8A8 fp8 linear layer (``QuantLinear`` with ``Fp8Method``)."""
    model = engine.model_runner.model
    sites = [_fp8_site(name, m) for name, m in model.named_modules()
             if isinstance(m, QuantLinear) and isinstance(m.method, Fp8Method)]
    if not sites:
        raise ValueError("step 'fp8.linear' needs an engine built with quantization='fp8' "
                         "(or an fp8 checkpoint); this one has no fp8 linear layer")
    return sites


def _engine_site(name: str, get_obj: Callable[[Any], Any], attr: str):
    return lambda engine: [_attr_site(name, get_obj(engine), attr)]


STEPS: dict[str, Step] = {s.name: s for s in [
    Step("rms_norm", rms_norm_ref, "rms_norm(x, weight, eps) -> y", True, True, False,
         _module_sites(RMSNorm, "impl")),
    Step("rotary.table", rope_table_ref,
         "rotary_table(head_dim, max_position, base[, rope_scaling]) -> (cos, sin)", True,
         True, False,
         _rotary_sites),
    Step("linear", linear_ref, "linear(x, weight, bias) -> y", True, True, False,
         _module_sites(Linear, "impl", exclude=("lm_head",))),
    Step("lm_head", lm_head_ref, "lm_head(hidden, weight) -> float32 logits", False, False,
         False, _engine_site("lm_head", lambda e: e.model_runner.model, "lm_head_impl")),
    Step("embedding", embedding_ref, "embedding(input_ids, weight) -> x", True, False,
         False, _embedding_sites),
    Step("attention.decode", decode_attention_ref,
         "decode_attention(q, k, v, seq_lens, scale) -> out", True, True, True,
         _attention_sites("decode_attention")),
    Step("attention.prefill", prefill_attention_ref,
         "prefill_attention(q, k, v, scale) -> out", True, True, True,
         _attention_sites("prefill_attention")),
    Step("kv.quantize", quantize_kv, "quantize(x, cache_dtype, scale) -> stored", True, True,
         True, _kv_sites("quantize")),
    Step("kv.dequantize", dequantize_kv, "dequantize(stored, dtype, scale) -> x", True, True,
         True, _kv_sites("dequantize")),
    # "slot_mapping" swaps the writer's and the reader's mapping together;
    # "slot_mapping.read" the TORCH backend's reads alone (the K/V a step attends to; later
    # layers' K/V depend on it, so it changes K/V too). A "slot_mapping.read" swap inside a
    # "slot_mapping" swap wins for the reads; the other way round the outer one is hidden.
    Step("slot_mapping", slot_mapping_ref,
         "slot_mapping(block_table, positions, block_size) -> slots", True, False, False,
         lambda e: [_attr_site("model_runner.slot_mapping", e.model_runner, "slot_mapping"),
                    _attr_site("model_runner.read_slot_mapping", e.model_runner,
                               "read_slot_mapping")]),
    Step("slot_mapping.read", slot_mapping_ref,
         "slot_mapping(block_table, positions, block_size) -> slots", True, False, True,
         _engine_site("model_runner.read_slot_mapping", lambda e: e.model_runner,
                      "read_slot_mapping")),
    Step("block_hash", hash_block_tokens,
         "block_hash(parent_hash, token_ids, extra_keys) -> bytes", True, False, False,
         _engine_site("kv_cache_manager", lambda e: e.kv_cache_manager, "hash_block_tokens")),
    Step("block_hash.extra_keys", block_extra_keys,
         "extra_keys(cache_salt, block_index) -> tuple", False, False, False,
         _engine_site("kv_cache_manager", lambda e: e.kv_cache_manager, "block_extra_keys")),
    Step("prefix_cache.lookup", find_longest_cache_hit,
         "lookup(block_hashes, cached, num_tokens, block_size) -> int", False, False, False,
         _engine_site("kv_cache_manager", lambda e: e.kv_cache_manager,
                      "find_longest_cache_hit")),
    Step("scheduler.preempt", preempt_request_ref, "preempt(request) -> None", False, False,
         False, _engine_site("scheduler", lambda e: e.scheduler, "preempt_request")),
    Step("sampler.penalties", penalties_ref,
         "penalties(logits, prompt_token_ids, output_token_ids, presence_penalty, "
         "frequency_penalty, repetition_penalty) -> logits", False, False, False,
         _engine_site("sampler", lambda e: e.model_runner.sampler, "penalties")),
    Step("sampler.top_k_top_p", apply_top_k_top_p,
         "top_k_top_p(logits, top_k, top_p) -> logits", False, False, False,
         _engine_site("sampler", lambda e: e.model_runner.sampler, "top_k_top_p")),
    # prompt processing (chapter 26): what token ids a request starts from
    Step("prompt.chat_template", render_chat_ref,
         "render_chat(tokenizer, conversation, add_generation_prompt, chat_template) -> ids",
         False, False, False, _engine_site("input_processor", lambda e: e.input_processor, "render_chat")),
    Step("prompt.truncate", truncate_prompt_ref,
         "truncate(token_ids, truncate_prompt_tokens) -> ids", False, False, False,
         _engine_site("input_processor", lambda e: e.input_processor, "truncate_prompt")),
    # chunked prefill (chapter 23): the read slots and the mask of one prefill chunk
    # (TORCH backend; the TRITON kernels take seq_lens and walk the block tables)
    Step("prefill_chunk", prefill_chunk_ref,
         "prefill_chunk(block_table, start, n, block_size, num_tokens) -> (kv_slots, mask)",
         True, False, True,
         _engine_site("model_runner.prefill_chunk", lambda e: e.model_runner,
                      "prefill_chunk")),
    # the residual stream (chapter 10): each residual add with the norm that follows it
    # (site: that norm; the MLP add of layer i belongs to layer i+1's input_layernorm,
    # the last one to the final "norm")
    Step("fused_add_rms_norm", fused_add_rms_norm_ref,
         "fused_add_rms_norm(x, residual, weight, eps) -> (normed, residual)", True, True,
         False, _module_sites(RMSNorm, "add_impl")),
    # speculative decoding (chapter 21): the verifier, and the n-gram drafter
    Step("rejection_sampler", rejection_sampler_ref,
         "rejection_sampler(draft_token_ids, draft_probs, target_probs, target_argmax, "
         "generator) -> tokens", False, False, False,
         _engine_site("model_runner.rejection_sampler", lambda e: e.model_runner,
                      "rejection_sampler")),
    Step("spec_decode.ngram", propose_ngram,
         "propose_ngram(tokens, min_n, max_n, k) -> draft tokens", False, False, False,
         _ngram_sites),
    # fp8 W8A8 linears (chapter 17): x_scale is the layer's static input_scale as
    # delivered (None: dynamic per-token scales)
    Step("fp8.linear", fp8_linear_ref,
         "fp8_linear(x, q_w, w_scale, x_scale, bias) -> y", True, True, False, _fp8_sites),
]}


def get_step(name: str) -> Step:
    """The step called ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if not isinstance(name, str) or name not in STEPS:
        raise ValueError(f"unknown step {name!r}; the steps are: {', '.join(STEPS)}")
    return STEPS[name]


def reference(name: str) -> Callable:
    """The reference implementation of a step (see :func:`get_step`)."""
    return get_step(name).reference


def site_names(engine, name: str) -> list[str]:
    """Where step ``name`` is called in this engine (what ``where`` can select)."""
    return [s.name for s in get_step(name).sites(engine)]


def _select(step: Step, sites: list[Site], where: Where) -> list[Site]:
    if where is None:
        return sites
    if not step.per_layer:
        raise ValueError(f"step {step.name!r} has one site ({sites[0].name}); where= picks "
                         "layers of per-layer steps only: leave it out")
    if isinstance(where, bool):
        raise TypeError("where must be a layer index, a list of them, or a module-name pattern")
    if isinstance(where, str):
        chosen = [s for s in sites if fnmatch.fnmatchcase(s.name, where)
                  or s.name.startswith(where + ".")]
    else:
        layers = [where] if isinstance(where, int) else list(where)
        if not layers or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
            raise TypeError(f"where must be a layer index, a non-empty list of them, or a "
                            f"module-name pattern, got {where!r}")
        chosen = [s for s in sites if any(s.name.startswith(f"layers.{i}.") or
                                          s.name == f"layers.{i}" for i in layers)]
        found = {int(s.name.split(".")[1]) for s in chosen}
        missing = sorted(set(layers) - found)
        if missing:
            n = sum(1 for s in sites if s.name.startswith("layers."))
            raise ValueError(f"where={where!r}: no layer {missing} here (step {step.name!r} "
                             f"has sites in layers 0..{max(n - 1, 0)})")
    if not chosen:
        names = [s.name for s in sites]
        raise ValueError(f"where={where!r} matches no site of step {step.name!r}; its sites "
                         f"are {names[:4]}{' ...' if len(names) > 4 else ''} "
                         f"({len(names)} in all)")
    return chosen


@contextlib.contextmanager
def swap_step(engine, name: str, fn: Callable, where: Where = None):
    """Run ``fn`` in place of step ``name`` inside the ``with`` block (see the module
    docstring). ``LLM.swap_step`` and ``LLMEngine.swap_step`` call this.

    Args:
        engine: an ``LLMEngine``.
        name: a step name (:data:`STEPS`).
        fn: a function with the reference's signature.
        where: per-layer steps only: None (every site), a decoder layer index or a list
            of them, or a module-name pattern (``fnmatch``, e.g. ``"layers.17.*"``,
            ``"*.post_attention_layernorm"``, or a module path prefix).
    Raises:
        ValueError: unknown step, a ``where`` that matches nothing, a TORCH-only step on
            the TRITON backend, or a K/V-changing step while requests are in flight.
        TypeError: ``fn`` not callable, or a malformed ``where``.
    """
    step = get_step(name)
    if not callable(fn):
        raise TypeError(f"swap_step({name!r}, fn): fn must be a function with the signature "
                        f"{step.signature}, got {type(fn).__name__}")
    backend = engine.model_runner.backend.name
    if step.torch_backend_only and backend != "TORCH":
        raise ValueError(f"step {name!r} is computed inside the {backend} kernels; it can be "
                         "swapped on an engine built with attention_backend='TORCH'")
    sites = _select(step, step.sites(engine), where)
    if step.changes_kv and engine.has_unfinished_requests():
        raise ValueError(f"step {name!r} changes the K/V the cache stores; swap it before "
                         "adding requests (requests are in flight)")
    graphs = engine.model_runner.cuda_graphs
    restores: list[Callable[[], None]] = []
    try:
        with graphs.suspended() if graphs is not None else contextlib.nullcontext():
            memo: dict = {}
            for site in sites:
                restores.append(site.swap(fn, memo))
            if step.changes_kv:
                engine.kv_cache_manager.reset_prefix_cache()
            yield
    finally:
        for restore in reversed(restores):
            restore()
        if step.changes_kv and not engine.kv_cache_manager.reset_prefix_cache():
            logger.warning("swap_step(%r): requests were left in flight, so the prefix cache "
                           "could not be reset; blocks computed with the swapped step may be "
                           "reused", name)
