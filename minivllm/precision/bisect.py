"""Config bisection: from a bad engine configuration to a good one, one key at a time.

A precision report says *that* a configuration drifts; bisection says *which setting*
does it. Given a good configuration (e.g. float32 everywhere), a bad one (the production
configuration that drifts) and a measure (mean KL against a float32 reference on a few
prompts), :func:`bisect_config` finds the culprit keys: the keys whose bad values break
the good configuration, alone or together. It is ``git bisect`` over configuration keys
instead of commits, in the form of delta debugging's search for a minimal failure-
inducing set (Zeller & Hildebrandt, "Simplifying and Isolating Failure-Inducing Input",
IEEE TSE 2002): the keys that differ are put in a fixed order; a binary search finds the
shortest prefix of them whose bad values, applied to the good configuration, make it bad;
the last key of that prefix is a culprit, found where two measured configurations differ
by exactly that one key. The search repeats with the culprit kept until the culprits
alone break the good configuration (a minimal breaking set: two keys that only break
together are both found), then starts again from the bad configuration with those keys
reverted until it measures good (two keys that each break it alone are both found).

With one culprit among n keys it measures about 2 log2(n) + 3 configurations (good, bad,
the binary search, the check that the culprit alone breaks it and the check that the bad
configuration with it reverted is good); a one-key-at-a-time sweep measures n + 2 and
misses culprits that only break together.

The CLI front end is ``minivllm bisect`` (:mod:`minivllm.entrypoints.cli`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

_MISSING = object()


@dataclass(frozen=True)
class Measurement:
    """One measured configuration: the good one with ``keys`` set to their bad values."""

    keys: tuple[str, ...]
    value: float
    bad: bool


@dataclass
class BisectResult:
    """Result of :func:`bisect_config`.

    Attributes:
        culprits: the culprit keys, in the order they were found.
        groups: the minimal breaking sets found (each a list of keys that, set to their
            bad values together on the good configuration, make it bad).
        good_value, bad_value: the measure of the good and the bad configuration.
        fixed_value: the measure of the bad configuration with the culprits reverted.
        threshold: a configuration is bad when its measure is >= this (or not finite).
        steps: every configuration measured, in order.
        diff: the keys that differ between the two configurations, in search order.
    """

    culprits: list[str]
    groups: list[list[str]]
    good_value: float
    bad_value: float
    fixed_value: float
    threshold: float
    steps: list[Measurement] = field(default_factory=list)
    diff: list[str] = field(default_factory=list)
    good: dict = field(default_factory=dict)
    bad: dict = field(default_factory=dict)

    def alone(self, key: str) -> Optional[float]:
        """The measure of the good configuration with only ``key`` set bad, if measured."""
        for s in self.steps:
            if s.keys == (key,):
                return s.value
        return None

    def to_text(self) -> str:
        def fmt(v):
            return _fmt(v)
        lines = [f"keys that differ ({len(self.diff)}): " + ", ".join(
                     f"{k}: {_show(self.good.get(k, _MISSING))} -> {_show(self.bad.get(k, _MISSING))}"
                     for k in self.diff),
                 f"threshold: a configuration is bad when its measure >= {self.threshold:.3g}",
                 f"good configuration: {fmt(self.good_value)}    bad configuration: "
                 f"{fmt(self.bad_value)}",
                 f"{len(self.steps)} configurations measured:"]
        for s in self.steps:
            keys = "+".join(s.keys) if s.keys else "(good)"
            lines.append(f"  {'BAD ' if s.bad else 'good'}  {fmt(s.value):>10}  good + {keys}")
        for g in self.groups:
            a = self.alone(g[0]) if len(g) == 1 else None
            extra = f" (alone on the good configuration: {fmt(a)})" if a is not None else ""
            lines.append("culprit: " + " + ".join(
                f"{k}={_show(self.bad.get(k, _MISSING))}" for k in g) + extra)
        lines.append(f"bad configuration with the culprits reverted: {fmt(self.fixed_value)}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        def num(v):
            return v if math.isfinite(v) else str(v)
        return {"culprits": self.culprits, "groups": self.groups,
                "good_value": num(self.good_value), "bad_value": num(self.bad_value),
                "fixed_value": num(self.fixed_value), "threshold": self.threshold,
                "diff": self.diff,
                "steps": [{"keys": list(s.keys), "value": num(s.value), "bad": s.bad}
                          for s in self.steps]}


def _fmt(v: float) -> str:
    return f"{v:.3e}" if math.isfinite(v) else str(v)


def _show(v) -> str:
    return "(default)" if v is _MISSING else repr(v)


def _is_bad(value: float, threshold: float) -> bool:
    return not (value < threshold)  # NaN and inf are bad


def bisect_config(good: dict, bad: dict, measure: Callable[[dict], float],
                  threshold: float, progress: Optional[Callable[[Measurement], None]] = None,
                  order: Optional[Sequence[str]] = None) -> BisectResult:
    """Find the keys of ``bad`` that make it bad, starting from ``good``.

    Args:
        good: a configuration (key -> value, e.g. ``EngineArgs`` fields) that measures
            good.
        bad: one that measures bad. Keys present in one configuration only count as
            differences; "setting a key to its bad value" removes it when ``bad`` lacks it.
        measure: configuration -> a number, lower is better (e.g. mean KL against a
            float32 reference, nats). Called once per distinct configuration (memoized).
        threshold: a configuration is bad when its measure is ``>= threshold`` or not
            finite (NaN from an overflow is bad).
        progress: called with each :class:`Measurement` as it is made (a progress bar).
        order: the search order of the differing keys (default: ``bad``'s key order,
            then ``good``'s).
    Returns:
        :class:`BisectResult`; ``result.culprits`` are the keys.
    Raises:
        ValueError: the configurations are equal, the good one measures bad, the bad
            one measures good, ``threshold`` is not a finite number > 0, or ``order``
            is not a permutation of the differing keys.
    """
    if not isinstance(good, dict) or not isinstance(bad, dict):
        raise TypeError(f"good and bad must be dicts, got {type(good).__name__} and "
                        f"{type(bad).__name__}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or not 0 < threshold < math.inf:
        raise ValueError(f"threshold must be a finite number > 0, got {threshold!r}")
    keys = list(bad) + [k for k in good if k not in bad]
    diff = [k for k in keys if good.get(k, _MISSING) != bad.get(k, _MISSING)]
    if not diff:
        raise ValueError("the good and the bad configuration are the same: nothing to bisect")
    if order is not None:
        if sorted(order) != sorted(diff):
            raise ValueError(f"order must list exactly the differing keys {sorted(diff)}, "
                             f"got {list(order)}")
        diff = list(order)

    memo: dict[frozenset, float] = {}
    steps: list[Measurement] = []

    def config(subset) -> dict:
        cfg = dict(good)
        for k in subset:
            v = bad.get(k, _MISSING)
            if v is _MISSING:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        return cfg

    def value(subset) -> float:
        fs = frozenset(subset)
        if fs not in memo:
            v = float(measure(config(subset)))
            memo[fs] = v
            m = Measurement(tuple(k for k in diff if k in fs), v, _is_bad(v, threshold))
            steps.append(m)
            if progress is not None:
                progress(m)
        return memo[fs]

    def broken(subset) -> bool:
        return _is_bad(value(subset), threshold)

    good_value = value([])
    if broken([]):
        raise ValueError(f"the good configuration measures bad ({_fmt(good_value)} >= "
                         f"threshold {threshold:.3g}): pick a good configuration that "
                         "measures good, or raise the threshold")
    bad_value = value(diff)
    if not broken(diff):
        raise ValueError(f"the bad configuration measures good ({_fmt(bad_value)} < "
                         f"threshold {threshold:.3g}): nothing to bisect (lower the "
                         "threshold, or add prompts that show the problem)")

    def minimal_breaking(cands: list[str]) -> list[str]:
        # precondition: good + cands is bad, good alone is good
        found: list[str] = []
        while True:
            if found and broken(found):
                return found
            lo, hi = 0, len(cands)  # good + found + cands[:lo] good, ... + cands[:hi] bad
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if broken(found + cands[:mid]):
                    hi = mid
                else:
                    lo = mid
            found = found + [cands[hi - 1]]
            cands = cands[:hi - 1]

    groups: list[list[str]] = []
    rest = list(diff)
    while True:
        group = minimal_breaking(rest)
        groups.append([k for k in diff if k in group])
        rest = [k for k in rest if k not in group]
        if not broken(rest):
            break
    culprits = [k for g in groups for k in g]
    return BisectResult(culprits=culprits, groups=groups, good_value=good_value,
                        bad_value=bad_value, fixed_value=value(rest), threshold=float(threshold),
                        steps=steps, diff=diff, good=dict(good), bad=dict(bad))


class KLMeasure:
    """Mean KL (nats) of an engine configuration against reference logits on fixed token
    sequences: the measure ``minivllm bisect`` uses.

    Each call builds an ``LLM`` with ``base`` updated by the configuration (through
    ``build``, default ``LLM(**kwargs)``), scores every sequence in one batch
    (``LLM.score``, prefill, logits), frees the engine and returns
    ``mean over sequences of metrics.mean_kl(reference, candidate)``.

    Args:
        prompts: token-id sequences (lists of ints), each >= 1 token.
        reference: one ``[T_i, vocab]`` float tensor per sequence (e.g. a float32
            engine's or ``ReferenceModel``'s logits).
        base: engine arguments every configuration starts from (model,
            max_model_len, num_gpu_blocks_override ...).
        build: configuration -> an ``LLM`` (a mystery engine's ``build``).

    Values are remembered per configuration (``cache``, keyed by :meth:`key`), so a
    configuration measured once, by this object or put there by the caller (the
    reference configuration's own KL), is not built again.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], reference: Sequence,
                 base: Optional[dict] = None, build: Optional[Callable[..., object]] = None):
        if not prompts or len(prompts) != len(reference):
            raise ValueError(f"need one reference per prompt, got {len(prompts)} prompts "
                             f"and {len(reference)} references")
        self.prompts = [list(p) for p in prompts]
        self.reference = list(reference)
        self.base = dict(base or {})
        self._build = build
        self.cache: dict[str, float] = {}

    @staticmethod
    def key(cfg: dict) -> str:
        return repr(sorted(cfg.items(), key=lambda kv: kv[0]))

    def build(self, cfg: dict):
        args = {**self.base, **cfg}
        if self._build is not None:
            return self._build(args)
        from minivllm.llm import LLM

        return LLM(**args)

    def logits(self, cfg: dict) -> list:
        llm = self.build(cfg)
        try:
            return llm.score(self.prompts, output="logits")
        finally:
            del llm

    def __call__(self, cfg: dict) -> float:
        from minivllm.precision.metrics import mean_kl

        k = self.key(cfg)
        if k not in self.cache:
            rows = self.logits(cfg)
            kls = [mean_kl(r.float(), c.float()) for r, c in zip(self.reference, rows)]
            self.cache[k] = float(sum(kls) / len(kls))
        return self.cache[k]
