"""matplotlib figures for drift reports.

Each function returns a ``matplotlib.figure.Figure`` built without pyplot's global state
(so nothing pops up or leaks between calls); in Jupyter a returned Figure renders inline,
and ``fig.savefig("x.png")`` writes it to disk. Pass ``ax`` to draw into your own axes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    from minivllm.precision.layer_diff import LayerDiff


def _axes(ax, figsize=(7.0, 4.0)):
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def mean_by_position(per_sequence: Sequence[np.ndarray]) -> np.ndarray:
    """Mean over sequences at each position (sequences may differ in length)."""
    n = max(len(a) for a in per_sequence)
    total, count = np.zeros(n), np.zeros(n)
    for a in per_sequence:
        total[:len(a)] += a
        count[:len(a)] += 1
    return total / np.maximum(count, 1)


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or len(y) < window:
        return y
    kernel = np.ones(window) / window
    return np.convolve(y, kernel, mode="valid")


def plot_kl_by_position(kl: Mapping[str, Sequence[np.ndarray]], ax=None, window: int = 16,
                        noise_floor: Optional[float] = None, title: Optional[str] = None):
    """Mean KL(reference || candidate) against token position, one line per candidate
    (moving average over ``window`` positions), log scale; optional dashed noise floor.

    Args:
        kl: {label: per-sequence [T_i] KL arrays in nats}.
    """
    fig, ax = _axes(ax)
    for label, seqs in kl.items():
        y = _smooth(mean_by_position(seqs), window)
        x = np.arange(len(y)) + (window - 1) / 2 if window > 1 and len(y) else np.arange(len(y))
        ax.plot(x, np.maximum(y, 1e-12), label=label)
    if noise_floor is not None:
        ax.axhline(max(noise_floor, 1e-12), color="gray", linestyle="--",
                   label="noise floor (mean)")
    ax.set_yscale("log")
    ax.set_xlabel("token position")
    ax.set_ylabel("KL divergence (nats)")
    ax.set_title(title or "KL against the baseline, by position")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_accuracy_by_length(acc: Mapping[str, Mapping[int, float]], ax=None,
                            title: Optional[str] = None, ylabel: str = "accuracy"):
    """Accuracy (e.g. passkey retrieval) against context length, one line per config.

    Args:
        acc: {label: {context length in tokens: accuracy in [0, 1]}}.
    """
    fig, ax = _axes(ax)
    for label, by_len in acc.items():
        xs = sorted(by_len)
        ax.plot(xs, [by_len[x] for x in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "Passkey retrieval against context length")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_agreement_by_position(same: Mapping[str, Sequence[np.ndarray]], ax=None,
                               bins: int = 8, title: Optional[str] = None):
    """Top-1 agreement against position, in equal-width position bins."""
    fig, ax = _axes(ax)
    for label, seqs in same.items():
        m = mean_by_position([np.asarray(s, dtype=np.float64) for s in seqs])
        edges = np.linspace(0, len(m), bins + 1).astype(int)
        centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:]) if b > a]
        vals = [m[a:b].mean() for a, b in zip(edges[:-1], edges[1:]) if b > a]
        ax.plot(centers, vals, marker="o", label=label)
    ax.set_xlabel("token position")
    ax.set_ylabel("top-1 agreement")
    ax.set_title(title or "Top-1 agreement with the baseline, by position")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_layer_errors(diffs: Mapping[str, LayerDiff], ax=None, title: Optional[str] = None):
    """Relative error of the residual stream after each decoder layer (log scale), one
    line per :class:`~minivllm.precision.layer_diff.LayerDiff`; first jumps marked."""
    fig, ax = _axes(ax)
    for label, d in diffs.items():
        errs = np.maximum(np.array(d.residual_errors()), 1e-12)
        line, = ax.plot(np.arange(len(errs)), errs, marker=".", label=label)
        if d.first_jump_layer is not None:
            i = d.first_jump_layer
            ax.plot([i], [errs[i]], marker="o", markersize=10, fillstyle="none",
                    color=line.get_color())
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("relative error ||a - b|| / ||b||")
    ax.set_title(title or "Per-layer error against the baseline (circles: first jump)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig
