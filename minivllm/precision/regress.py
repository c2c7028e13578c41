"""A precision regression gate a team runs in its own CI (``minivllm regress``).

Two checks, each with a verdict and a number behind it:

1. **Candidate against baseline** (a configuration change: fp8 KV cache, another dtype, a
   new default): both engines score the same fixed corpus windows teacher-forced
   (``LLM.score``) and generate from the same fixed chat prompts with *their own default*
   ``SamplingParams`` (``LLM.get_default_sampling_params``: the model's generation config
   and ``override_generation_config``; a per-prompt seed). A candidate **regresses** when

   * its mean KL interval (cluster bootstrap, 95 %) lies above both ``max_kl`` and the
     noise floor's interval (the baseline against itself with its MLP reduction
     reordered, :mod:`minivllm.precision.noise`), or any KL is not finite; or
   * its top-1 agreement is below ``min_top1`` and below the noise floor's; or
   * the fraction of generated tokens that match the baseline's at the same position is
     below ``min_default_agreement`` and below the noise floor's. Teacher-forced scoring
     never sees sampling settings, so this is the check that catches a changed default
     (lm-evaluation-harness #3154, NeMo-RL #3497: ``generation_config="auto"``).

   What changed in the default ``SamplingParams`` is listed in the report either way.

2. **Golden log-prob snapshot** (a code change: a new engine version, kernel or library,
   where there is no old engine to run beside the new one): :func:`golden_snapshot` stores
   the log-prob of every next token of fixed sequences, with the engine's dtype;
   :func:`golden_check` fails when a log-prob moved by more than the tolerance for that
   dtype (the snapshot tests of Stanford CS336's assignments, with tolerances per dtype
   instead of one ``atol``).

The defaults (:data:`DEFAULT_TOLERANCES`, :class:`Thresholds`) are set from measurements on
the embedded SmolLM2-135M-Instruct (chapter 29; windows of 64 tokens, CPU): the largest
token log-prob change under a reordered MLP reduction is 2.4e-5 in float32, 0.03 in
float16 and 0.28 in bfloat16; an fp8 e4m3 KV cache moves it by 0.58-0.82 and gives a
mean KL of 7e-3 nats, bfloat16 weights 1.3e-3, a float16 KV cache 4e-7.

This is not a vLLM feature; vLLM's own CI compares log-probs against HF with
``check_logprobs_close`` (tests/models/utils.py), which is the same idea for one model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from minivllm.precision import evalsets as E
from minivllm.precision import metrics as M
from minivllm.precision.report import _json_safe, config_label

GOLDEN_FORMAT = "minivllm-golden/1"
# Largest allowed |token log-prob - golden| (nats), by the engine's compute dtype: about
# 40x (float32), 3x (float16) and 1.8x (bfloat16) the reordered-reduction noise measured
# on the embedded model; an fp8 e4m3 KV cache exceeds each of them.
DEFAULT_TOLERANCES = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.5}
# The sampling fields a default can change (what the report lists).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class Thresholds:
    """What counts as a regression (see the module docstring).

    Args:
        max_kl: mean KL (nats) a candidate may reach whatever the noise floor (>= 0).
        min_top1: top-1 agreement (fraction) below which a candidate fails, unless the
            noise floor agrees less.
        min_default_agreement: fraction of default-sampled tokens equal to the
            baseline's, below which a candidate fails, unless the noise floor agrees less.
    Raises:
        ValueError: a value out of range.
    """

    max_kl: float = 1e-3
    min_top1: float = 0.98
    min_default_agreement: float = 0.9

    def __post_init__(self) -> None:
        if not (isinstance(self.max_kl, (int, float)) and math.isfinite(self.max_kl)
                and self.max_kl >= 0):
            raise ValueError(f"max_kl must be a finite number >= 0 (nats), got {self.max_kl!r}")
        for name in ("min_top1", "min_default_agreement"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v <= 1):
                raise ValueError(f"{name} must be a fraction in [0, 1], got {v!r}")


def _finite_list(name: str, values) -> list[float]:
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of numbers (one per sequence), got "
                         f"{values!r}") from None
    if not out:
        raise ValueError(f"{name} is empty: give one mean KL per sequence")
    return out


def is_regression(cand_kl: Sequence[float], noise_kl: Optional[Sequence[float]],
                  max_kl: float) -> bool:
    """The KL rule: True when the cluster-bootstrap 95 % interval of the candidate's mean
    KL lies entirely above ``max_kl`` and above the noise floor's interval, or when any
    candidate value is NaN or infinite (a broken engine is never within tolerance).

    Args:
        cand_kl: mean KL (nats) per evaluation sequence, candidate against baseline.
        noise_kl: the same for the baseline against its reordered self (None: no floor).
        max_kl: the tolerated mean KL (nats, >= 0).
    Raises:
        ValueError: empty lists, non-numbers, a negative or non-finite ``max_kl``.
    """
    Thresholds(max_kl=max_kl)  # validates max_kl
    cand = _finite_list("cand_kl", cand_kl)
    if not all(math.isfinite(v) for v in cand):
        return True
    floor = 0.0
    if noise_kl is not None:
        noise = _finite_list("noise_kl", noise_kl)
        floor = M.bootstrap_ci(noise)[1] if all(math.isfinite(v) for v in noise) else math.inf
    return M.bootstrap_ci(cand)[0] > max(floor, max_kl)


# --- fixed evaluation inputs ----------------------------------------------------------

def eval_sequences(tokenizer, seq_len: int = 64, num_sequences: int = 8) -> list[list[int]]:
    """The first ``num_sequences`` corpus windows of ``seq_len`` tokens (fixed text).

    Raises:
        ValueError: the corpus holds fewer windows, or a count below its minimum.
    """
    if not (isinstance(seq_len, int) and seq_len >= 2 and isinstance(num_sequences, int)
            and num_sequences >= 2):
        raise ValueError(f"seq_len and num_sequences must be integers >= 2 (an interval "
                         f"needs two sequences), got {seq_len!r} and {num_sequences!r}")
    seqs = E.corpus_sequences(tokenizer, seq_len, num_sequences)
    if len(seqs) < num_sequences:
        raise ValueError(f"the corpus holds only {len(seqs)} windows of {seq_len} tokens")
    return seqs


def default_prompts(tokenizer, num_prompts: int = 8) -> list[list[int]]:
    """The first ``num_prompts`` QA questions as chat prompts (token ids)."""
    qa = E.load_qa()
    if not (isinstance(num_prompts, int) and 1 <= num_prompts <= len(qa)):
        raise ValueError(f"num_prompts must be an integer in [1, {len(qa)}], got {num_prompts!r}")
    return [E.chat_prompt_ids(tokenizer, E.qa_prompt(it.question)) for it in qa[:num_prompts]]


def sampling_defaults(llm) -> dict:
    """The sampling fields of ``llm.get_default_sampling_params()``."""
    sp = llm.get_default_sampling_params()
    return {k: getattr(sp, k) for k in _SAMPLING_FIELDS}


def generate_with_defaults(llm, prompts: Sequence[Sequence[int]], max_tokens: int = 16,
                           seed: int = 0) -> list[list[int]]:
    """Token ids each prompt generates under the engine's own default SamplingParams, with
    ``max_tokens`` and a per-prompt seed (``seed + i``) set, ``ignore_eos`` on."""
    import dataclasses

    base = llm.get_default_sampling_params()
    params = [dataclasses.replace(base, max_tokens=max_tokens, seed=seed + i, ignore_eos=True)
              for i in range(len(prompts))]
    return [list(o.outputs[0].token_ids) for o in llm.generate([list(p) for p in prompts],
                                                                 params)]


def token_agreement(ref: Sequence[Sequence[int]], cand: Sequence[Sequence[int]]) -> float:
    """Mean over prompts of the fraction of positions with the same token."""
    return float(np.mean([M.greedy_agreement(a, b) for a, b in zip(ref, cand)]))


# --- the gate -------------------------------------------------------------------------

@dataclass
class Verdict:
    """One candidate's numbers and the reasons it failed (empty: it passed)."""

    label: str
    drift: M.DriftSummary
    kl_per_sequence: list
    default_agreement: float
    default_changes: dict  # field -> (baseline value, candidate value)
    failures: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_json(self) -> dict:
        return {"label": self.label, "passed": self.passed, "failures": self.failures,
                "mean_kl": self.drift.mean_kl, "kl_ci": list(self.drift.kl_ci),
                "top1_agreement": self.drift.top1_agreement,
                "max_abs_logprob_diff": self.drift.max_abs_diff,
                "default_agreement": self.default_agreement,
                "default_changes": {k: list(v) for k, v in self.default_changes.items()},
                "kl_per_sequence": list(self.kl_per_sequence)}


@dataclass
class GoldenResult:
    """:func:`golden_check`'s answer. ``worst`` is (sequence, position) of the largest
    error; ``num_failed`` counts log-probs beyond the tolerance (NaN counts)."""

    passed: bool
    dtype: str
    tolerance: float
    max_abs_error: float
    worst: Optional[tuple]
    num_failed: int
    num_checked: int

    def as_json(self) -> dict:
        return dict(self.__dict__, worst=list(self.worst) if self.worst else None)

    def to_markdown(self) -> str:
        status = "**pass**" if self.passed else "**FAIL**"
        where = "" if self.worst is None else f" at sequence {self.worst[0]}, position {self.worst[1]}"
        return (f"Golden snapshot ({self.dtype}, tolerance {self.tolerance:g} nats): {status}; "
                f"largest |log-prob - golden| {self.max_abs_error:.3g}{where}; "
                f"{self.num_failed} of {self.num_checked} log-probs beyond the tolerance.")


@dataclass
class RegressionReport:
    """What :func:`check` returns (and ``minivllm regress`` prints and saves)."""

    baseline: str
    thresholds: Thresholds
    noise: Optional[M.DriftSummary] = None
    noise_kl_per_sequence: Optional[list] = None
    noise_default_agreement: Optional[float] = None
    verdicts: list = field(default_factory=list)
    golden: Optional[GoldenResult] = None
    num_sequences: int = 0
    seq_len: int = 0
    num_prompts: int = 0
    max_tokens: int = 0

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts) and (self.golden is None or self.golden.passed)

    def to_json(self) -> dict:
        n = self.noise
        return _json_safe({
            "passed": self.passed, "baseline": self.baseline,
            "thresholds": dict(self.thresholds.__dict__),
            "eval": {"corpus_windows": self.num_sequences, "seq_len": self.seq_len,
                     "default_prompts": self.num_prompts, "max_tokens": self.max_tokens},
            "noise_floor": None if n is None else {
                "mean_kl": n.mean_kl, "kl_ci": list(n.kl_ci), "top1_agreement": n.top1_agreement,
                "default_agreement": self.noise_default_agreement},
            "candidates": [v.as_json() for v in self.verdicts],
            "golden": self.golden.as_json() if self.golden else None})

    def to_markdown(self) -> str:
        t = self.thresholds
        lines = [f"# Precision regression check: **{'PASS' if self.passed else 'FAIL'}**", ""]
        if self.verdicts:
            lines += [f"Baseline: **{self.baseline}**; {self.num_sequences} corpus windows of "
                      f"{self.seq_len} tokens; {self.num_prompts} prompts x "
                      f"{self.max_tokens} tokens under each engine's default sampling "
                      f"parameters. Thresholds: mean KL <= {t.max_kl:g} nats, top-1 >= "
                      f"{t.min_top1:g}, default-sampling agreement >= {t.min_default_agreement:g} "
                      "(each beyond the noise floor).", "",
                      "| config | mean KL (nats) [95% CI] | top-1 agree | default-sampling "
                      "agree | verdict |", "|---|---|---|---|---|"]
            if self.noise is not None:
                n, na = self.noise, self.noise_default_agreement
                agree = "-" if na is None else f"{100 * na:.1f}%"
                lines.append(f"| noise floor (baseline, reordered MLP sum) | {n.mean_kl:.3g} "
                             f"[{n.kl_ci[0]:.3g}, {n.kl_ci[1]:.3g}] | {100 * n.top1_agreement:.2f}% "
                             f"| {agree} | - |")
            for v in self.verdicts:
                d = v.drift
                verdict = "pass" if v.passed else "**REGRESSION**: " + "; ".join(v.failures)
                lines.append(f"| {v.label} | {d.mean_kl:.3g} [{d.kl_ci[0]:.3g}, {d.kl_ci[1]:.3g}] "
                             f"| {100 * d.top1_agreement:.2f}% | {100 * v.default_agreement:.1f}% "
                             f"| {verdict} |")
            lines.append("")
            for v in self.verdicts:
                if v.default_changes:
                    ch = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in v.default_changes.items())
                    lines.append(f"- {v.label}: default sampling parameters changed: {ch}")
            lines.append("")
        if self.golden is not None:
            lines += [self.golden.to_markdown(), ""]
        return "\n".join(lines)

    def save(self, out_dir: Union[str, Path]) -> dict:
        """Write report.md and report.json into ``out_dir``; returns their paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        md, js = out / "report.md", out / "report.json"
        md.write_text(self.to_markdown() + "\n", encoding="utf-8")
        js.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        return {"report.md": md, "report.json": js}


def _drifts(ref_rows, rows, seqs) -> list:
    return [M.sequence_drift(r, c, s) for r, c, s in zip(ref_rows, rows, seqs)]


def check(baseline, candidates: Mapping[str, Any], *,
          thresholds: Thresholds = Thresholds(), seqs: Optional[Sequence[Sequence[int]]] = None,
          prompts: Optional[Sequence[Sequence[int]]] = None, seq_len: int = 64,
          num_sequences: int = 8, num_prompts: int = 8, max_tokens: int = 16,
          noise_floor: bool = True, mode: str = "prefill", baseline_label: str = "baseline",
          ) -> RegressionReport:
    """Judge candidate engines against a baseline engine (see the module docstring).

    Args:
        baseline: an ``LLM``.
        candidates: {label: LLM}; each must share the baseline's tokenizer and vocabulary.
        seqs: token sequences to score (default: :func:`eval_sequences`).
        prompts: chat prompts (token ids) for the default-sampling check (default:
            :func:`default_prompts`); an empty list skips that check.
        max_tokens: tokens generated per prompt.
        noise_floor: measure the baseline against its reordered-reduction self (without
            it a candidate is judged against ``max_kl`` alone).
        mode: "prefill" or "decode" scoring (``LLM.score``).
    Returns:
        A :class:`RegressionReport`; ``report.passed`` is the CI verdict.
    Raises:
        ValueError: no candidates, a bad count, or a bad mode.
    """
    from minivllm.precision.noise import permuted_mlp_reduction

    if not isinstance(candidates, Mapping) or not candidates:
        raise ValueError("give at least one candidate as {label: LLM}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    tok = baseline.get_tokenizer()
    seqs = [list(s) for s in (seqs if seqs is not None else
                              eval_sequences(tok, seq_len, num_sequences))]
    if len(seqs) < 2:
        raise ValueError(f"give at least 2 sequences to score (an interval needs two), got "
                         f"{len(seqs)}")
    prompts = [list(p) for p in (prompts if prompts is not None else
                                 default_prompts(tok, num_prompts))]
    ref_rows = baseline.score(seqs, mode=mode)
    ref_gen = generate_with_defaults(baseline, prompts, max_tokens) if prompts else []
    base_defaults = sampling_defaults(baseline)
    rep = RegressionReport(baseline_label, thresholds, num_sequences=len(seqs),
                           seq_len=max(len(s) for s in seqs), num_prompts=len(prompts),
                           max_tokens=max_tokens)
    noise_top1 = 0.0
    noise_agree = 0.0
    if noise_floor:
        with permuted_mlp_reduction(baseline, seed=1):
            nd = _drifts(ref_rows, baseline.score(seqs, mode=mode), seqs)
            noise_gen = generate_with_defaults(baseline, prompts, max_tokens) if prompts else []
        rep.noise = M.summarize(nd)
        rep.noise_kl_per_sequence = [float(d.kl.mean()) for d in nd]
        rep.noise_default_agreement = token_agreement(ref_gen, noise_gen) if prompts else 1.0
        noise_top1, noise_agree = rep.noise.top1_agreement, rep.noise_default_agreement
    for label, llm in candidates.items():
        ds = _drifts(ref_rows, llm.score(seqs, mode=mode), seqs)
        summary = M.summarize(ds)
        kl_seq = [float(d.kl.mean()) for d in ds]
        agree = token_agreement(ref_gen, generate_with_defaults(llm, prompts, max_tokens)) \
            if prompts else 1.0
        cand_defaults = sampling_defaults(llm)
        changes = {k: (base_defaults[k], cand_defaults[k]) for k in _SAMPLING_FIELDS
                   if base_defaults[k] != cand_defaults[k]}
        v = Verdict(label, summary, kl_seq, agree, changes)
        if is_regression(kl_seq, rep.noise_kl_per_sequence, thresholds.max_kl):
            v.failures.append(f"mean KL {summary.mean_kl:.3g} [{summary.kl_ci[0]:.3g}, "
                              f"{summary.kl_ci[1]:.3g}] above {thresholds.max_kl:g}"
                              + (" and the noise floor" if noise_floor else ""))
        if summary.top1_agreement < min(thresholds.min_top1, noise_top1 if noise_floor else 1.0):
            v.failures.append(f"top-1 agreement {100 * summary.top1_agreement:.2f}% below "
                              f"{100 * thresholds.min_top1:g}%")
        if prompts and agree < min(thresholds.min_default_agreement,
                                   noise_agree if noise_floor else 1.0):
            v.failures.append(f"default-sampling agreement {100 * agree:.1f}% below "
                              f"{100 * thresholds.min_default_agreement:g}%")
        rep.verdicts.append(v)
    return rep


# --- golden snapshots -------------------------------------------------------------------

def _dtype_name(llm) -> str:
    return str(llm.llm_engine.model_config.dtype).replace("torch.", "")


def golden_snapshot(llm, seqs: Sequence[Sequence[int]], config: Optional[dict] = None,
                    mode: str = "prefill") -> dict:
    """A JSON-ready snapshot: for each sequence, the log-prob the engine gives each next
    token (``T - 1`` floats, nats), with the engine's dtype (which picks the tolerance).

    Args:
        llm: an ``LLM``.
        seqs: token sequences (at least 2 tokens each).
        config: the engine settings, stored for the reader (e.g. the CLI flags).
    """
    seqs = [list(s) for s in seqs]
    if not seqs or any(len(s) < 2 for s in seqs):
        raise ValueError("a golden snapshot needs at least one sequence of >= 2 tokens")
    rows = llm.score(seqs, mode=mode)
    return {"format": GOLDEN_FORMAT, "dtype": _dtype_name(llm), "mode": mode,
            "model": llm.llm_engine.model_config.model, "config": dict(config or {}),
            "torch": torch.__version__, "token_ids": seqs,
            "logprobs": [M.token_logprobs(r, s).tolist() for r, s in zip(rows, seqs)]}


def validate_golden(snapshot) -> dict:
    """Raise ValueError with what is wrong unless ``snapshot`` is a golden snapshot."""
    if not isinstance(snapshot, dict):
        raise ValueError(f"a golden snapshot is a JSON object, got {type(snapshot).__name__}")
    missing = [k for k in ("dtype", "token_ids", "logprobs") if k not in snapshot]
    if missing:
        raise ValueError(f"not a golden snapshot: missing {missing} (write one with "
                         "`minivllm regress --golden FILE --update-golden`)")
    if snapshot.get("format", GOLDEN_FORMAT) != GOLDEN_FORMAT:
        raise ValueError(f"golden snapshot format {snapshot['format']!r}; this version reads "
                         f"{GOLDEN_FORMAT!r}")
    ids, lps = snapshot["token_ids"], snapshot["logprobs"]
    if not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps) or not ids:
        raise ValueError("golden snapshot: token_ids and logprobs must be non-empty lists of "
                         "the same length (one entry per sequence)")
    for i, (s, lp) in enumerate(zip(ids, lps)):
        if not isinstance(s, list) or not isinstance(lp, list) or len(lp) != len(s) - 1:
            raise ValueError(f"golden snapshot: sequence {i} has {len(s) if isinstance(s, list) else '?'} "
                             f"tokens, so it needs {len(s) - 1 if isinstance(s, list) else '?'} "
                             f"log-probs, got {len(lp) if isinstance(lp, list) else lp!r}")
    return snapshot


def golden_check(snapshot: dict, rows: Sequence, tol_by_dtype: Optional[Mapping[str, float]] = None
                 ) -> GoldenResult:
    """Compare scored rows with a golden snapshot, at the snapshot dtype's tolerance.

    Args:
        snapshot: from :func:`golden_snapshot` (or :func:`load_golden`).
        rows: one ``[T, vocab]`` tensor per snapshot sequence (logits or log-probs; they
            are normalized here), as ``LLM.score(snapshot["token_ids"])`` returns them.
        tol_by_dtype: {dtype name: largest allowed |log-prob - golden| in nats}
            (default :data:`DEFAULT_TOLERANCES`).
    Raises:
        ValueError: no tolerance for the snapshot's dtype, a row count or shape that does
            not match the snapshot, or a malformed snapshot.
    """
    validate_golden(snapshot)
    tols = DEFAULT_TOLERANCES if tol_by_dtype is None else tol_by_dtype
    dtype = snapshot["dtype"]
    if dtype not in tols:
        raise ValueError(f"no tolerance for the snapshot's dtype {dtype!r}; tolerances given "
                         f"for {sorted(tols)}")
    tol = float(tols[dtype])
    if len(rows) != len(snapshot["token_ids"]):
        raise ValueError(f"{len(rows)} scored sequences for a snapshot of "
                         f"{len(snapshot['token_ids'])}")
    worst, worst_at, failed, checked = -1.0, None, 0, 0
    for i, (r, ids, gold) in enumerate(zip(rows, snapshot["token_ids"], snapshot["logprobs"])):
        r = torch.as_tensor(r)
        if r.dim() != 2 or r.shape[0] != len(ids):
            raise ValueError(f"sequence {i}: expected [{len(ids)}, vocab] rows, got "
                             f"{tuple(r.shape)}")
        err = (M.token_logprobs(r, ids) - torch.tensor(gold, dtype=torch.float64)).abs()
        err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
        failed += int((err > tol).sum())
        checked += err.numel()
        j = int(err.argmax())
        if float(err[j]) > worst:
            worst, worst_at = float(err[j]), (i, j)
    return GoldenResult(failed == 0, dtype, tol, worst, worst_at if worst > tol else None,
                        failed, checked)


def check_golden(llm, snapshot: dict, tol_by_dtype: Optional[Mapping[str, float]] = None
                 ) -> GoldenResult:
    """Score the snapshot's sequences with ``llm`` and :func:`golden_check` them.

    Raises:
        ValueError: the engine's dtype is not the snapshot's (tolerances are per dtype:
            compare a configuration with its own snapshot).
    """
    validate_golden(snapshot)
    have = _dtype_name(llm)
    if have != snapshot["dtype"]:
        raise ValueError(f"the golden snapshot was taken in {snapshot['dtype']}, this engine "
                         f"runs {have}: check a configuration against its own snapshot")
    rows = llm.score(snapshot["token_ids"], mode=snapshot.get("mode", "prefill"))
    return golden_check(snapshot, rows, tol_by_dtype)


def save_golden(snapshot: dict, path: Union[str, Path]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(snapshot) + "\n", encoding="utf-8")
    return p


def load_golden(path: Union[str, Path]) -> dict:
    """Read and validate a snapshot file (ValueError with the reason if it is not one)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read golden snapshot {str(path)!r}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"golden snapshot {str(path)!r} is not JSON: {e}") from None
    return validate_golden(data)


__all__ = ["DEFAULT_TOLERANCES", "GoldenResult", "RegressionReport", "Thresholds", "Verdict",
           "check", "check_golden", "config_label", "default_prompts", "eval_sequences",
           "generate_with_defaults", "golden_check", "golden_snapshot", "is_regression",
           "load_golden", "sampling_defaults", "save_golden", "token_agreement"]
