"""Prometheus metrics with vLLM's names (``vllm/v1/metrics/loggers.py``).

Gauges are set and counters advanced by the engine thread after every step
(:meth:`ServerMetrics.on_step`); ``/metrics`` renders the registry. Names, as a learner
will see them from ``vllm serve``:

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges)
* ``vllm:kv_cache_usage_perc`` (gauge, 0..1, fraction of KV blocks in use)
* ``vllm:num_preemptions_total``, ``vllm:prefix_cache_queries_total``,
  ``vllm:prefix_cache_hits_total`` (tokens), ``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``, ``vllm:request_success_total{finished_reason}``,
  ``vllm:corrupted_requests_total`` (requests whose logits held NaN/inf)
* with ``speculative_config`` only (as vLLM, which registers them only then):
  ``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
  ``vllm:spec_decode_num_accepted_tokens_total``
* histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:e2e_request_latency_seconds``
* with a precision monitor only (``run_server(precision_monitor=...)``; not vLLM
  metrics, hence the ``minivllm:`` prefix; :mod:`minivllm.precision.monitor`):
  ``minivllm:precision_monitor_requests`` (requests counted), ``..._alarm`` (0 or 1),
  ``..._score`` (largest CUSUM, standard deviations), ``..._sampled_logprob`` and
  ``..._entropy`` (the last finished request's means, nats)

prometheus-client appends ``_total`` to counter names itself, so counters are declared
without it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

logger = logging.getLogger("minivllm")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """The server's metrics and the periodic stats log line.

    Args:
        model_name: the ``model_name`` label value.
        log_interval_s: seconds between stats log lines; None for none.
    """

    def __init__(self, model_name: str, log_interval_s: float | None = 5.0):
        self.registry = CollectorRegistry()

        def metric(kind, name, doc, **kw):  # one series per model, labelled by its name
            return kind(name, doc, ["model_name"], registry=self.registry, **kw).labels(model_name)

        def latency(name, doc):
            return metric(Histogram, name, doc, buckets=_LATENCY_BUCKETS)

        self.running = metric(Gauge, "vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = metric(Gauge, "vllm:num_requests_waiting",
                              "Requests waiting to be scheduled.")
        self.kv_usage = metric(Gauge, "vllm:kv_cache_usage_perc",
                               "KV-cache usage: fraction of blocks in use (1 = full).")
        self.preemptions = metric(Counter, "vllm:num_preemptions", "Preemptions (recompute).")
        self.prefix_queries = metric(Counter, "vllm:prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = metric(Counter, "vllm:prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = metric(Counter, "vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = metric(Counter, "vllm:generation_tokens", "Tokens generated.")
        self.success = Counter("vllm:request_success", "Finished requests by reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.corrupted = metric(Counter, "vllm:corrupted_requests",
                                "Requests whose logits (or int8 K/V) held NaN/inf.")
        self.ttft = latency("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = latency("vllm:inter_token_latency_seconds", "Time between tokens.")
        self.e2e = latency("vllm:e2e_request_latency_seconds", "Arrival to finish.")
        self._metric = metric
        # speculative-decoding counters, created on the first step that has them
        self.spec: Optional[dict[str, list]] = None
        # precision-monitor gauges, created on the first step with one
        self.monitor_gauges: Optional[dict[str, Any]] = None
        self.model_name = model_name
        self.log_interval_s = log_interval_s
        self._last = {"preemptions": 0, "queries": 0, "hits": 0, "prompt": 0, "gen": 0,
                      "corrupted": 0}
        self._last_token_time: dict[str, float] = {}
        self._last_log = time.monotonic()
        self._log_gen = 0
        self._log_prompt = 0

    def on_step(self, async_llm, record) -> None:
        """Engine-thread callback (see :class:`minivllm.engine.async_llm.StepRecord`)."""
        eng = async_llm.engine
        sched, kv, st = eng.scheduler, eng.kv_cache_manager, eng._stats
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.kv_usage.set(kv.usage)
        now_vals = {"preemptions": sched.num_preemptions, "queries": kv.prefix_cache_queries,
                    "hits": kv.prefix_cache_hits, "prompt": st.num_prompt_tokens,
                    "gen": st.num_generation_tokens, "corrupted": st.num_corrupted_requests}
        for key, counter in (("preemptions", self.preemptions), ("queries", self.prefix_queries),
                             ("hits", self.prefix_hits), ("prompt", self.prompt_tokens),
                             ("gen", self.generation_tokens), ("corrupted", self.corrupted)):
            delta = now_vals[key] - self._last[key]
            if delta > 0:
                counter.inc(delta)
        if getattr(eng, "speculative_config", None) is not None:
            self._spec_step(st)
        monitor = getattr(eng, "precision_monitor", None)
        if monitor is not None:
            self._monitor_step(monitor)
        self._log_gen += max(0, now_vals["gen"] - self._last["gen"])
        self._log_prompt += max(0, now_vals["prompt"] - self._last["prompt"])
        self._last = now_vals
        for out in record.outputs:
            rid, n_new = out.request_id, record.new_tokens.get(out.request_id, 0)
            if n_new <= 0:
                continue
            m = out.metrics
            prev = self._last_token_time.get(rid)
            if prev is None and m.get("first_token_time") is not None:
                self.ttft.observe(m["first_token_time"] - m["arrival_time"])
            elif prev is not None:
                for _ in range(n_new):
                    self.itl.observe((record.now - prev) / n_new)
            self._last_token_time[rid] = record.now
        for out in record.finished:
            self._last_token_time.pop(out.request_id, None)
            reason = out.outputs[0].finish_reason or "abort"
            self.success.labels(self.model_name, reason).inc()
            m = out.metrics
            if m.get("finish_time") is not None:
                self.e2e.observe(m["finish_time"] - m["arrival_time"])
        self.maybe_log(async_llm)

    def _monitor_step(self, monitor) -> None:
        if self.monitor_gauges is None:
            self.monitor_gauges = {
                key: self._metric(Gauge, f"minivllm:precision_monitor_{key}", doc)
                for key, doc in (
                    ("requests", "Finished requests the precision monitor has counted."),
                    ("alarm", "1 once the drift monitor's CUSUM passed its threshold."),
                    ("score", "Largest CUSUM of the drift monitor, in standard deviations."),
                    ("sampled_logprob", "Last request's mean raw log-prob of its sampled "
                                        "tokens (nats)."),
                    ("entropy", "Last request's mean entropy of the raw distribution (nats)."))}
        state = monitor.state()
        g = self.monitor_gauges
        g["requests"].set(state["requests"])
        g["alarm"].set(1.0 if state["alarm"] else 0.0)
        g["score"].set(state["score"])
        if "logprob" in state["last"]:
            g["sampled_logprob"].set(state["last"]["logprob"])
        if "entropy" in state["last"]:
            g["entropy"].set(state["last"]["entropy"])

    def _spec_step(self, st) -> None:
        """vLLM's ``SpecDecodingProm`` counters, from the engine's totals."""
        names = (("spec_decode_num_drafts", "Verifications run (one per request and step)."),
                 ("spec_decode_num_draft_tokens", "Draft tokens verified."),
                 ("spec_decode_num_accepted_tokens", "Draft tokens accepted."))
        if self.spec is None:
            self.spec = {n: [self._metric(Counter, f"vllm:{n}", doc), 0] for n, doc in names}
        for n, entry in self.spec.items():
            now = getattr(st, n)
            if now > entry[1]:
                entry[0].inc(now - entry[1])
            entry[1] = now

    def maybe_log(self, async_llm, force: bool = False) -> None:
        """The periodic stats line (vLLM's ``LoggingStatLogger``)."""
        if self.log_interval_s is None:
            return
        now = time.monotonic()
        dt = now - self._last_log
        if dt < self.log_interval_s and not force:
            return
        eng = async_llm.engine
        kv = eng.kv_cache_manager
        hit = kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit "
            "rate: %.1f%%, Preemptions: %d", self._log_prompt / dt, self._log_gen / dt,
            eng.scheduler.num_running, eng.scheduler.num_waiting, 100 * kv.usage, 100 * hit,
            eng.scheduler.num_preemptions)
        self._last_log, self._log_gen, self._log_prompt = now, 0, 0
