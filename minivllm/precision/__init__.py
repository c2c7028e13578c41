"""Precision toolkit: measure how far a configuration drifts from a reference.

Module map:

* ``reference``: HF transformers on the same weights (float32/float64) as ground truth;
* ``metrics``: KL, top-1/top-k agreement, llama.cpp's "same top p", logit differences,
  perplexity, greedy agreement and first divergence, bootstrap confidence intervals;
* ``noise``: the noise floor (the baseline with one reduction reordered);
* ``layer_diff``: hidden states per layer and sub-block, and where the error jumps;
* ``faults``: planted numerical bugs (fp16 RMSNorm, wrong rotary theta in one layer);
* ``evalsets``: QA, passkey, multi-turn conversations, a text corpus;
* ``report``: ``compare(baseline, candidates, eval_sets)``, tables and figures;
* ``regress``: the regression gate for CI (``minivllm regress``) and golden log-prob
  snapshots with per-dtype tolerances;
* ``monitor``: ``DriftMonitor``, a CUSUM over served requests' sampled-token log-probs;
* ``plots``: the matplotlib figures.

``LLM.score`` (in ``minivllm.llm``) gives the engine's teacher-forced rows that all of
this compares.
"""

from minivllm.precision.layer_diff import LayerDiff, capture_hidden_states, layer_diff
from minivllm.precision.metrics import (DriftSummary, abs_diff, bootstrap_ci,
                                        first_divergence, greedy_agreement, kl_divergence,
                                        mean_kl, perplexity, ppl_ratio, same_top_p,
                                        sequence_drift, summarize, top1_agreement,
                                        topk_overlap)
from minivllm.precision.reference import ReferenceModel
from minivllm.precision.report import ComparisonReport, compare

__all__ = [
    "ComparisonReport", "DriftSummary", "LayerDiff", "ReferenceModel", "abs_diff",
    "bootstrap_ci", "capture_hidden_states", "compare", "first_divergence",
    "greedy_agreement", "kl_divergence", "layer_diff", "mean_kl", "perplexity", "ppl_ratio",
    "same_top_p", "sequence_drift", "summarize", "top1_agreement", "topk_overlap",
]
