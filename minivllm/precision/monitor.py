"""A drift monitor for served log-probs: is the engine still sampling from the distribution
it sampled from yesterday?

A precision regression in production rarely raises an error. A changed default (vLLM's
switch to ``generation_config="auto"``, lm-evaluation-harness #3154), an fp8 cache turned
on, a kernel that started overflowing: each shifts what the model's sampled tokens look
like before anyone reads the outputs. This monitor watches two numbers per finished
request, over the tokens it generated:

* the mean log-probability of the sampled tokens under the raw model distribution
  (``logprobs_mode`` "raw_logprobs": before temperature and top-k/top-p), which falls
  when sampling gets hotter or the model gets worse at what it is asked;
* the mean entropy of that distribution (nats), which rises when the model is less sure.

Requests differ a lot from each other, so a single request says little; a shift in the
stream's mean does. The test is Page's two-sided CUSUM (E. S. Page, "Continuous
inspection schemes", Biometrika 41, 1954): each request's statistic is standardized by a
baseline mean and standard deviation (estimated from the first ``warmup`` requests, or
given), and the sums ``S+ = max(0, S+ + z - k)``, ``S- = max(0, S- - z - k)`` grow only
while the stream sits more than ``k`` standard deviations off the baseline; an alarm is
raised when one exceeds ``h``. With the defaults (k = 0.5, h = 12, a baseline from 100
requests), measured on simulated normal statistics (``tests/test_precision_monitor.py``):
a shift of one standard deviation of the per-request statistic is flagged after a
median 24 requests (at most 55 of 30 runs), two standard deviations after 9 (at most
14); over 200 in-control requests 3 of 300 runs raised a false alarm. Most of those come
from the baseline: 100 requests estimate the standard deviation to about +-7 %, and an
underestimate inflates every z (with a known baseline Siegmund's approximation puts the
in-control average run length near 10^6 requests per sum). Give a ``reference`` from a
long earlier run to do better.

This is not a vLLM feature. Its Prometheus gauges (``minivllm:`` prefix) are described in
:mod:`minivllm.entrypoints.openai.metrics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

STATISTICS = ("logprob", "entropy")


@dataclass
class DriftMonitor:
    """Two-sided CUSUM over per-request mean sampled-token log-prob and mean entropy.

    Args:
        warmup: requests that set the baseline (mean and standard deviation of each
            statistic) when ``reference`` is not given; no alarm before it is set.
        threshold: h, in baseline standard deviations (> 0).
        allowance: k, in baseline standard deviations (>= 0): shifts smaller than this
            do not accumulate.
        min_tokens: requests with fewer generated tokens are skipped (too noisy).
        reference: a known baseline, ``{"logprob": (mean, std), "entropy": (mean, std)}``
            (one or both), e.g. from :meth:`baseline` of an earlier run.
    Raises:
        ValueError: a parameter out of range, or a reference std that is not positive.
    """

    warmup: int = 100
    threshold: float = 12.0
    allowance: float = 0.5
    min_tokens: int = 4
    reference: Optional[dict] = None
    requests: int = field(default=0, init=False)  # requests counted (after min_tokens)
    alarm: bool = field(default=False, init=False)
    alarm_at: Optional[int] = field(default=None, init=False)  # request count at the alarm
    _warm: dict = field(default_factory=lambda: {s: [] for s in STATISTICS}, init=False,
                        repr=False)
    _base: dict = field(default_factory=dict, init=False, repr=False)
    _cusum: dict = field(default_factory=lambda: {s: [0.0, 0.0] for s in STATISTICS},
                         init=False, repr=False)
    _last: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.warmup, int) or self.warmup < 2:
            raise ValueError(f"warmup must be an integer >= 2, got {self.warmup!r}")
        if not self.threshold > 0:
            raise ValueError(f"threshold must be > 0 (standard deviations), got {self.threshold!r}")
        if not self.allowance >= 0:
            raise ValueError(f"allowance must be >= 0, got {self.allowance!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            raise ValueError(f"min_tokens must be an integer >= 1, got {self.min_tokens!r}")
        for name, pair in (self.reference or {}).items():
            if name not in STATISTICS:
                raise ValueError(f"reference keys must be in {STATISTICS}, got {name!r}")
            mean, std = pair
            if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
                raise ValueError(f"reference[{name!r}] must be (finite mean, std > 0), "
                                 f"got {pair!r}")
            self._base[name] = (float(mean), float(std))

    def update(self, logprobs: Sequence[float],
               entropies: Optional[Sequence[float]] = None) -> bool:
        """Add one finished request: its sampled tokens' raw log-probs (and the entropies
        of the distributions they were drawn from). Returns whether the alarm is on (it
        stays on until :meth:`reset`). Non-finite values (a corrupted request, which
        ``vllm:corrupted_requests`` counts) raise the alarm at once.
        """
        lp = [float(x) for x in logprobs]
        if len(lp) < self.min_tokens:
            return self.alarm
        stats = {"logprob": lp}
        if entropies is not None:
            stats["entropy"] = [float(x) for x in entropies]
        self.requests += 1
        for name, values in stats.items():
            mean = sum(values) / len(values)
            self._last[name] = mean
            if not math.isfinite(mean):
                self._raise()
                continue
            if name not in self._base:
                self._warm[name].append(mean)
                if len(self._warm[name]) >= self.warmup:
                    w = self._warm[name]
                    mu = sum(w) / len(w)
                    sd = math.sqrt(sum((x - mu) ** 2 for x in w) / (len(w) - 1))
                    self._base[name] = (mu, max(sd, 1e-6 * max(1.0, abs(mu))))
                continue
            mu, sd = self._base[name]
            z = (mean - mu) / sd
            hi, lo = self._cusum[name]
            hi = max(0.0, hi + z - self.allowance)
            lo = max(0.0, lo - z - self.allowance)
            self._cusum[name] = [hi, lo]
            if max(hi, lo) > self.threshold:
                self._raise()
        return self.alarm

    def _raise(self) -> None:
        if not self.alarm:
            self.alarm, self.alarm_at = True, self.requests

    @property
    def score(self) -> float:
        """The largest CUSUM, in standard deviations (the alarm is score > threshold)."""
        return max(max(v) for v in self._cusum.values())

    def baseline(self) -> dict:
        """{statistic: (mean, std)} once set (pass it as ``reference`` to a new monitor)."""
        return dict(self._base)

    def state(self) -> dict:
        """Everything a dashboard shows: requests, alarm, alarm_at, score, the last
        request's statistics, the baseline and each CUSUM (``S+``, ``S-``)."""
        return {"requests": self.requests, "alarm": self.alarm, "alarm_at": self.alarm_at,
                "score": self.score, "last": dict(self._last), "baseline": self.baseline(),
                "cusum": {k: tuple(v) for k, v in self._cusum.items()}}

    def reset(self, keep_baseline: bool = True) -> None:
        """Clear the alarm and the sums (after a fix); the baseline stays unless asked."""
        self.alarm, self.alarm_at = False, None
        self._cusum = {s: [0.0, 0.0] for s in STATISTICS}
        if not keep_baseline:
            self._base = {}
            self._warm = {s: [] for s in STATISTICS}
