"""Layer-by-layer diff: where along the network does an error start?

Hidden states are captured with forward hooks at the same points in minivllm's Llama and
in transformers' ``LlamaForCausalLM`` (the module names match on purpose):

* ``embed_tokens``: the embeddings;
* ``layers.{i}.self_attn``: attention output (after ``o_proj``), before the residual add;
* ``layers.{i}.mlp``: MLP output, before the residual add;
* ``layers.{i}``: the residual stream after decoder layer i;
* ``norm``: the final RMSNorm output.

Error at each point is the relative Frobenius error ``||a - b|| / ||b||`` over all
tokens (float64). The first *jump* is looked for on the residual stream: the first layer
whose error exceeds both ``min_error`` and ``jump_factor`` times the largest error before
it; inside that layer, the sub-block (attention or MLP) whose own error jumped against the
previous layer's is named. Either side may be an ``LLM`` (any engine configuration) or a
:class:`~minivllm.precision.reference.ReferenceModel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def _points(num_layers: int) -> list[str]:
    names = ["embed_tokens"]
    for i in range(num_layers):
        names += [f"layers.{i}.self_attn", f"layers.{i}.mlp", f"layers.{i}"]
    return names + ["norm"]


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _capture(root: torch.nn.Module, num_layers: int, run) -> dict[str, torch.Tensor]:
    """Hook ``root.<point>`` for every point, call ``run()``, return {point: [T, hidden]}
    (calls that happen several times, e.g. per prefill chunk or decode step, are
    concatenated in order)."""
    chunks: dict[str, list[torch.Tensor]] = {n: [] for n in _points(num_layers)}
    handles = []
    for name in chunks:
        module = root.get_submodule(name)

        def hook(_m, _inp, out, name=name):
            t = _first(out).detach()
            chunks[name].append(t.reshape(-1, t.shape[-1]).to(torch.float64).cpu())
        handles.append(module.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(c) for n, c in chunks.items() if c}


def capture_hidden_states(model, token_ids: Sequence[int], mode: str = "prefill"
                          ) -> dict[str, torch.Tensor]:
    """Hidden states of one sequence at every capture point.

    Args:
        model: an ``LLM`` (scored through the engine, so its dtype, KV-cache dtype,
            chunking and attention backend all apply; ``mode`` as in ``LLM.score``) or a
            ``ReferenceModel``.
    Returns:
        {point: [T, hidden] float64}.
    """
    from minivllm.llm import LLM
    from minivllm.precision.reference import ReferenceModel

    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    ids = list(token_ids)
    if ids and isinstance(ids[0], (list, tuple)):
        raise ValueError("layer diff takes one sequence (a list of token ids), not a batch")
    if isinstance(model, LLM):
        net = model.llm_engine.model_runner.model
        n = len(net.layers)
        return _capture(net, n, lambda: model.score(ids, mode=mode))
    if isinstance(model, ReferenceModel):
        return _capture(model.model.model, model.num_layers, lambda: model.score(ids))
    raise TypeError(f"expected an LLM or a ReferenceModel, got {type(model).__name__}")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b||_F / ||b||_F`` in float64 (``inf`` if b is all zeros and a is not)."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.nan
    num, den = float((a - b).norm()), float(b.norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


@dataclass(frozen=True)
class LayerDiff:
    """Result of :func:`layer_diff`.

    Attributes:
        points: capture points in forward order.
        errors: relative error at each point (same order).
        num_layers: decoder layers.
        first_jump_layer: index of the first decoder layer where the residual-stream error
            jumps, or None when the error grows smoothly (no fault found).
        first_jump_block: "self_attn" or "mlp" inside that layer, or None.
    """

    points: list[str]
    errors: list[float]
    num_layers: int
    first_jump_layer: Optional[int]
    first_jump_block: Optional[str]

    def error(self, point: str) -> float:
        return self.errors[self.points.index(point)]

    def residual_errors(self) -> list[float]:
        """Relative error of the residual stream after each decoder layer."""
        return [self.error(f"layers.{i}") for i in range(self.num_layers)]

    def to_markdown(self) -> str:
        lines = ["| layer | self_attn | mlp | residual stream |", "|---|---|---|---|"]
        for i in range(self.num_layers):
            mark = " **<- first jump**" if i == self.first_jump_layer else ""
            lines.append(f"| {i} | {self.error(f'layers.{i}.self_attn'):.2e} | "
                         f"{self.error(f'layers.{i}.mlp'):.2e} | "
                         f"{self.error(f'layers.{i}'):.2e}{mark} |")
        lines.append(f"| final norm | | | {self.error('norm'):.2e} |")
        return "\n".join(lines)

    def plot(self, ax=None, label: Optional[str] = None):
        """Per-layer relative error (log scale). Returns the matplotlib Figure."""
        from minivllm.precision.plots import plot_layer_errors

        return plot_layer_errors({label or "candidate": self}, ax=ax)


def find_first_jump(errors: dict[str, float], num_layers: int, jump_factor: float = 10.0,
                    min_error: float = 1e-5) -> tuple[Optional[int], Optional[str]]:
    """The first decoder layer whose residual-stream error jumps (see module docstring)."""
    if not (jump_factor > 1 and min_error >= 0):
        raise ValueError(f"need jump_factor > 1 and min_error >= 0, got {jump_factor}, {min_error}")

    def jumped(e: float, before: float) -> bool:
        # a NaN/inf error is always a jump: the first non-finite value is where it broke
        return not math.isfinite(e) or (e > min_error and e > jump_factor * before)

    worst = errors.get("embed_tokens", 0.0)
    if not math.isfinite(worst):
        return 0, None
    for i in range(num_layers):
        e = errors[f"layers.{i}"]
        if jumped(e, worst):
            block = None
            for sub in ("self_attn", "mlp"):
                prev = errors[f"layers.{i - 1}.{sub}"] if i > 0 else 0.0
                if jumped(errors[f"layers.{i}.{sub}"], prev if math.isfinite(prev) else 0.0):
                    block = sub
                    break
            return i, block
        worst = max(worst, e)
    return None, None


def layer_diff(candidate, reference, token_ids: Sequence[int], mode: str = "prefill",
               jump_factor: float = 10.0, min_error: float = 1e-5) -> LayerDiff:
    """Compare hidden states of ``candidate`` against ``reference`` on the same tokens.

    Args:
        candidate, reference: ``LLM`` or ``ReferenceModel`` (e.g. an engine
            configuration against HF float32, or two engine configurations).
        token_ids: one sequence.
        mode: how an ``LLM`` side runs ("prefill" or "decode", see ``LLM.score``).
        jump_factor, min_error: the jump rule (module docstring).
    Raises:
        ValueError: the two models capture different shapes (different architectures).
    """
    a = capture_hidden_states(candidate, token_ids, mode)
    b = capture_hidden_states(reference, token_ids, mode)
    if set(a) != set(b):
        raise ValueError(f"capture points differ: {sorted(set(a) ^ set(b))[:6]}")
    num_layers = sum(1 for k in a if k.count(".") == 1 and k.startswith("layers."))
    points = [p for p in _points(num_layers) if p in a]
    errors = {p: relative_error(a[p], b[p]) for p in points}
    layer, block = find_first_jump(errors, num_layers, jump_factor, min_error)
    return LayerDiff(points=points, errors=[errors[p] for p in points], num_layers=num_layers,
                     first_jump_layer=layer, first_jump_block=block)
