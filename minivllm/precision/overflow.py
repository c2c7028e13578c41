"""Overflow diagnostics: per-layer counts of NaN and inf in activations.

A float16 model overflows where an activation passes 65504; the inf then turns into NaN
a few operations later (inf - inf, 0 * inf) and every logit downstream is NaN. Which
layer did it first is the question; :func:`track_nonfinite` answers it.

The engine itself always checks the logits: a request whose logits hold NaN/inf ends
with ``finish_reason == "error"`` and is counted in ``llm.stats.num_corrupted_requests``
(vLLM's ``vllm:corrupted_requests``), instead of sampling garbage.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class NonfiniteCounts:
    """Counts per module, in forward order.

    Attributes:
        nan, inf: ``{module name: count}`` summed over every forward while tracking
            (names like ``layers.3.mlp``, ``layers.3`` for the residual stream after the
            layer, ``embed_tokens``, ``norm``).
        elements: ``{module name: elements seen}``.
    """

    nan: dict[str, int] = field(default_factory=dict)
    inf: dict[str, int] = field(default_factory=dict)
    elements: dict[str, int] = field(default_factory=dict)

    def first(self) -> str | None:
        """The first module (in forward order) whose output held NaN or inf, or None."""
        for name in self.elements:
            if self.nan[name] or self.inf[name]:
                return name
        return None

    def total(self) -> int:
        return sum(self.nan.values()) + sum(self.inf.values())

    def rows(self) -> list[dict]:
        """One dict per module: name, nan, inf, elements (for a table or a DataFrame)."""
        return [{"module": n, "nan": self.nan[n], "inf": self.inf[n],
                 "elements": self.elements[n]} for n in self.elements]


def _watched_modules(model) -> dict[str, torch.nn.Module]:
    out = {"embed_tokens": model.embed_tokens}
    for i, layer in enumerate(model.layers):
        out[f"layers.{i}.self_attn"] = layer.self_attn
        out[f"layers.{i}.mlp"] = layer.mlp
        out[f"layers.{i}"] = layer
    out["norm"] = model.norm
    return out


@contextmanager
def track_nonfinite(llm) -> Iterator[NonfiniteCounts]:
    """Count NaN/inf in the outputs of every layer's attention, MLP, residual stream,
    the embeddings and the final norm, while the block runs.

    Args:
        llm: an ``LLM`` (or its ``llm_engine``).
    Yields:
        a :class:`NonfiniteCounts` filled as the model runs.

    Example::

        with track_nonfinite(llm) as counts:
            llm.generate(prompts, params)
        print(counts.first())
    """
    engine = getattr(llm, "llm_engine", llm)
    model = engine.model_runner.model
    counts = NonfiniteCounts()
    handles = []
    for name, module in _watched_modules(model).items():
        counts.nan[name] = counts.inf[name] = counts.elements[name] = 0

        def hook(mod, args, output, name=name):
            out = output.detach()
            counts.nan[name] += int(torch.isnan(out).sum())
            counts.inf[name] += int(torch.isinf(out).sum())
            counts.elements[name] += out.numel()

        handles.append(module.register_forward_hook(hook))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()
