"""``compare``: one baseline against candidate configurations on the evaluation sets.

    from minivllm.precision import compare
    rep = compare({"kv_cache_dtype": "float32"},
                  [{"kv_cache_dtype": "float16"}, {"kv_cache_dtype": "fp8_e4m3"}],
                  eval_sets=("corpus", "passkey"))
    print(rep.to_markdown()); rep.figures["kl_by_position"]; rep.save("reports/compare")

What is measured, per candidate against the baseline:

* on the scoring sets ("corpus", "conversations"): teacher-forced full distributions of
  the same tokens (``LLM.score``): mean KL with a cluster-bootstrap 95 % CI, top-1
  agreement (llama.cpp's "same top p"), top-5 overlap, max/mean |log-prob diff|, and the
  perplexity ratio;
* on "passkey": greedy retrieval accuracy per context length;
* on "qa": greedy answer accuracy (normalized match);
* a layer diff on the first scored sequence.

The noise floor is the baseline against itself with its MLP reduction reordered
(:mod:`minivllm.precision.noise`); a candidate *exceeds the noise floor* when the lower end
of its KL interval is above the upper end of the noise floor's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from minivllm.precision import metrics as M
from minivllm.precision import evalsets as E

SCORING_SETS = ("corpus", "conversations")
DEFAULT_BASELINE = {"dtype": "float32", "kv_cache_dtype": "float32"}
# Enough KV for a 4096-token passkey prompt plus batches of short prompts, in float32.
DEFAULT_KV_BYTES = 512 * 1024 * 1024


def config_label(cfg: Mapping[str, Any], model: Optional[str] = None) -> str:
    """Short label: the settings given, 'k=v' joined (the model only when it is not the
    comparison's default model)."""
    items = [f"{k}={v}" for k, v in cfg.items() if k != "model" or v != model]
    return ", ".join(items) if items else "defaults"


class _Runner:
    """A configuration to run: an engine (``LLM``) or the HF reference."""

    def __init__(self, label: str, config: dict, model: str, default_kv_bytes: int):
        from minivllm import LLM
        from minivllm.precision.reference import ReferenceModel

        self.label, self.config = label, dict(config)
        self.llm: Optional[LLM] = None
        self.ref: Optional[ReferenceModel] = None
        kind = self.config.pop("reference", None)
        if kind is not None:
            extra = sorted(set(self.config) - {"model"})
            if extra:
                raise ValueError(f"a reference configuration takes only 'reference' (and "
                                 f"'model'); these engine settings would be ignored: {extra}")
            self.ref = ReferenceModel(self.config.get("model", model), dtype=kind)
            self.tokenizer = self.ref.tokenizer
        else:
            kw = dict(self.config)
            kw.setdefault("model", model)
            # Drift is measured from float32: an engine configuration that does not name
            # a dtype runs in float32, not under dtype="auto" (which would serve the
            # float32 checkpoint in bfloat16 and mix that error into every candidate).
            kw.setdefault("dtype", "float32")
            if "kv_cache_memory_bytes" not in kw and "num_gpu_blocks_override" not in kw:
                kw["kv_cache_memory_bytes"] = default_kv_bytes
            self.llm = LLM(**kw)
            self.tokenizer = self.llm.get_tokenizer()

    @property
    def model(self):
        return self.llm if self.llm is not None else self.ref

    def score(self, seqs: list[list[int]], mode: str):
        if self.llm is not None:
            return self.llm.score(seqs, mode=mode)
        assert self.ref is not None
        return [self.ref.score(s) for s in seqs]

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        from minivllm import SamplingParams

        if self.llm is not None:
            outs = self.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
            return [o.outputs[0].text for o in outs]
        assert self.ref is not None
        ref = self.ref
        return [str(self.tokenizer.decode(t, skip_special_tokens=True))
                for t in (ref.generate(p, max_tokens) for p in prompts)]


@dataclass
class CandidateResult:
    label: str
    config: dict
    drift: Optional[M.DriftSummary] = None
    kl_per_sequence: list = field(default_factory=list)
    top1_per_sequence: list = field(default_factory=list)
    passkey_accuracy: dict = field(default_factory=dict)
    qa_accuracy: Optional[float] = None
    qa_agreement: Optional[float] = None
    layer_diff: Any = None
    exceeds_noise_floor: Optional[bool] = None

    def as_json(self) -> dict:
        d = self.drift
        return {
            "label": self.label, "config": self.config,
            "mean_kl": d.mean_kl if d else None, "kl_ci": list(d.kl_ci) if d else None,
            "top1_agreement": d.top1_agreement if d else None,
            "same_top_p": list(d.same_top_p) if d else None,
            "top5_overlap": d.top5_overlap if d else None,
            "max_abs_logprob_diff": d.max_abs_diff if d else None,
            "ppl_ratio": d.ppl_ratio if d else None,
            "passkey_accuracy": {str(k): v for k, v in sorted(self.passkey_accuracy.items())},
            "qa_accuracy": self.qa_accuracy,
            "exceeds_noise_floor": self.exceeds_noise_floor,
            "first_jump_layer": self.layer_diff.first_jump_layer if self.layer_diff else None,
        }


@dataclass
class ComparisonReport:
    """What :func:`compare` returns. ``figures`` maps a name to a matplotlib Figure."""

    baseline: CandidateResult
    results: list[CandidateResult]
    noise_floor: Optional[CandidateResult]
    eval_sets: tuple
    mode: str
    figures: dict = field(default_factory=dict)

    @property
    def table(self) -> list[dict]:
        """One row per candidate (and the noise floor first, if measured)."""
        rows = [self.noise_floor] if self.noise_floor is not None else []
        return [r.as_json() for r in rows + self.results]

    def to_json(self) -> dict:
        """JSON-ready dict; NaN and infinities become null (JSON has no NaN)."""
        return _json_safe(self._to_json())

    def _to_json(self) -> dict:
        return {"baseline": {"label": self.baseline.label, "config": self.baseline.config,
                             "passkey_accuracy": {str(k): v for k, v in
                                                  sorted(self.baseline.passkey_accuracy.items())},
                             "qa_accuracy": self.baseline.qa_accuracy},
                "eval_sets": list(self.eval_sets), "mode": self.mode,
                "noise_floor": self.noise_floor.as_json() if self.noise_floor else None,
                "results": [r.as_json() for r in self.results]}

    def to_markdown(self) -> str:
        lines = [f"Baseline: **{self.baseline.label}**; eval sets: {', '.join(self.eval_sets)}; "
                 f"scoring mode: {self.mode}.", ""]
        rows = ([self.noise_floor] if self.noise_floor else []) + self.results
        if any(r.drift for r in rows):
            lines += ["| config | mean KL (nats) [95% CI] | top-1 agree | top-5 overlap | "
                      "max abs logprob diff | PPL ratio | above noise floor |",
                      "|---|---|---|---|---|---|---|"]
            for r in rows:
                d = r.drift
                if d is None:
                    continue
                flag = {None: "-", True: "**yes**", False: "no"}[r.exceeds_noise_floor]
                lines.append(f"| {r.label} | {d.mean_kl:.3g} [{d.kl_ci[0]:.3g}, {d.kl_ci[1]:.3g}] "
                             f"| {100 * d.top1_agreement:.2f}% | {100 * d.top5_overlap:.2f}% | "
                             f"{d.max_abs_diff:.3g} | {d.ppl_ratio:.5f} | {flag} |")
            lines.append("")
        acc_rows = [self.baseline] + self.results
        if any(r.passkey_accuracy for r in acc_rows):
            lengths = sorted(self.baseline.passkey_accuracy)
            lines += ["Passkey retrieval accuracy by context length (tokens):", "",
                      "| config | " + " | ".join(str(n) for n in lengths) + " |",
                      "|---|" + "---|" * len(lengths)]
            for r in acc_rows:
                lines.append(f"| {r.label} | " + " | ".join(
                    f"{r.passkey_accuracy.get(n, float('nan')):.2f}" for n in lengths) + " |")
            lines.append("")
        if any(r.qa_accuracy is not None for r in acc_rows):
            lines += ["| config | QA accuracy | same answer as baseline |", "|---|---|---|"]
            for r in acc_rows:
                acc = "-" if r.qa_accuracy is None else f"{100 * r.qa_accuracy:.1f}%"
                agree = "-" if r.qa_agreement is None else f"{100 * r.qa_agreement:.1f}%"
                lines.append(f"| {r.label} | {acc} | {agree} |")
            lines.append("")
        diffs = [r for r in self.results if r.layer_diff is not None]
        if diffs:
            lines += ["First layer where the error jumps (layer diff on one sequence):", ""]
            for r in diffs:
                ld = r.layer_diff
                where = ("none (smooth growth)" if ld.first_jump_layer is None else
                         f"layer {ld.first_jump_layer}" + (f" ({ld.first_jump_block})"
                                                           if ld.first_jump_block else ""))
                lines.append(f"- {r.label}: {where}; final-norm relative error "
                             f"{ld.error('norm'):.2e}")
            lines.append("")
        return "\n".join(lines)

    def save(self, out_dir: Union[str, Path]) -> dict[str, Path]:
        """Write report.md, report.json and one PNG per figure. Returns {name: path}."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name, fig in self.figures.items():
            p = out / f"{name}.png"
            fig.savefig(p)
            paths[name] = p
        md = self.to_markdown() + "\n" + "\n".join(f"![{n}]({p.name})" for n, p in paths.items())
        (out / "report.md").write_text(md + "\n", encoding="utf-8")
        (out / "report.json").write_text(json.dumps(self.to_json(), indent=2) + "\n",
                                         encoding="utf-8")
        paths["report.md"], paths["report.json"] = out / "report.md", out / "report.json"
        return paths


def _json_safe(x):
    if isinstance(x, float) and not np.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _check_limit(name: str, value, minimum: int = 1) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} (or None for no limit), "
                         f"got {value!r}")


def _score_sequences(tokenizer, eval_sets, seq_len, max_sequences) -> list[list[int]]:
    seqs: list[list[int]] = []
    if "corpus" in eval_sets:
        seqs += E.corpus_sequences(tokenizer, seq_len, max_sequences)
    if "conversations" in eval_sets:
        seqs += E.conversation_sequences(tokenizer, max_sequences)
    return seqs


def compare(baseline: Optional[Mapping[str, Any]] = None,
            candidates: Sequence[Mapping[str, Any]] = (),
            eval_sets: Union[str, Sequence[str]] = ("corpus", "passkey"),
            *, model: str = "smollm2-135m-instruct", mode: str = "prefill",
            seq_len: int = 512, max_sequences: Optional[int] = None,
            passkey_lengths: Optional[Sequence[int]] = None, max_passkey_items: Optional[int] = None,
            max_qa: Optional[int] = None, noise_floor: bool = True,
            layer_diff_tokens: int = 128, batch_size: int = 4,
            default_kv_bytes: int = DEFAULT_KV_BYTES, progress: bool = True) -> ComparisonReport:
    """Compare candidate configurations against a baseline on evaluation sets.

    Args:
        baseline: ``EngineArgs`` fields (default float32 weights and KV cache), or
            ``{"reference": "float32" | "float64"}`` for the HF reference.
        candidates: one dict of ``EngineArgs`` fields per candidate (``model`` defaults
            to ``model``, ``dtype`` to "float32", also for the baseline); a candidate may
            also be ``{"reference": ...}``.
        eval_sets: any of "corpus", "conversations", "passkey", "qa".
        mode: "prefill" or "decode" scoring (see ``LLM.score``).
        seq_len: corpus window length in tokens.
        max_sequences: cap on corpus windows and on conversations (each).
        passkey_lengths: only these length buckets (default: all, 256..4096).
        max_passkey_items: cap on passkey items per length bucket.
        max_qa: cap on QA items.
        noise_floor: measure the baseline against its reduction-reordered self (needs an
            engine baseline).
        layer_diff_tokens: tokens of the first scored sequence used for the layer diff
            (0 disables it).
        batch_size: sequences scored together.
    Raises:
        ValueError: unknown eval set, no candidates, or a bad mode.
    """
    from tqdm.auto import tqdm

    from minivllm.precision.layer_diff import layer_diff as run_layer_diff
    from minivllm.precision.noise import permuted_mlp_reduction
    from minivllm.precision import plots

    for name, value, minimum in (("max_sequences", max_sequences, 1), ("max_qa", max_qa, 1),
                                 ("max_passkey_items", max_passkey_items, 1),
                                 ("seq_len", seq_len, 2), ("batch_size", batch_size, 1),
                                 ("layer_diff_tokens", layer_diff_tokens, 0)):
        _check_limit(name, value, minimum)
    if passkey_lengths is not None:
        if isinstance(passkey_lengths, (int, str)):
            raise ValueError(f"passkey_lengths must be a list of lengths, got {passkey_lengths!r}")
        buckets = sorted({it.target_tokens for it in E.load_passkey()})
        bad = [n for n in passkey_lengths if n not in buckets]
        if bad or not passkey_lengths:
            raise ValueError(f"passkey_lengths {list(passkey_lengths)}: allowed lengths are {buckets}")
    if isinstance(candidates, (dict, str)) or (baseline is not None and not isinstance(baseline, dict)):
        raise TypeError("baseline must be a dict of engine settings (or None) and candidates a "
                        "list of such dicts")
    if isinstance(eval_sets, str):
        eval_sets = (eval_sets,)
    eval_sets = tuple(eval_sets)
    unknown = [s for s in eval_sets if s not in E.EVAL_SETS]
    if unknown or not eval_sets:
        raise ValueError(f"unknown eval set(s) {unknown or eval_sets}; allowed: {list(E.EVAL_SETS)}")
    if not candidates:
        raise ValueError("give at least one candidate configuration")
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    base_cfg = dict(DEFAULT_BASELINE if baseline is None else baseline)
    labels = [config_label(c, model) for c in candidates]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"candidates must differ; these appear more than once: {dupes}")
    base = _Runner("baseline: " + config_label(base_cfg, model), base_cfg, model, default_kv_bytes)
    cands = [_Runner(lab, dict(c), model, default_kv_bytes) for lab, c in zip(labels, candidates)]
    tok = base.tokenizer
    want_noise = noise_floor and base.llm is not None and any(x in SCORING_SETS for x in eval_sets)

    base_res = CandidateResult(base.label, base_cfg)
    results = [CandidateResult(c.label, c.config if not c.ref else dict(candidates[i]))
               for i, c in enumerate(cands)]
    noise_res = CandidateResult("noise floor (baseline, reordered MLP sum)", base_cfg) \
        if want_noise else None

    # 1. Teacher-forced scoring, a few sequences at a time (full [T, vocab] rows are big).
    seqs = _score_sequences(tok, eval_sets, seq_len, max_sequences)
    drifts: dict[int, list] = {i: [] for i in range(len(cands))}
    noise_drifts: list = []
    for start in tqdm(range(0, len(seqs), batch_size), desc="scoring", disable=not progress or not seqs):
        batch = seqs[start:start + batch_size]
        ref_rows = base.score(batch, mode)
        if want_noise:
            with permuted_mlp_reduction(base.llm, seed=start):
                rows = base.score(batch, mode)
            noise_drifts += [M.sequence_drift(r, c, s) for r, c, s in zip(ref_rows, rows, batch)]
        for i, c in enumerate(cands):
            rows = c.score(batch, mode)
            drifts[i] += [M.sequence_drift(r, x, s) for r, x, s in zip(ref_rows, rows, batch)]
        del ref_rows
    if seqs:
        for i, r in enumerate(results):
            r.drift = M.summarize(drifts[i])
            r.kl_per_sequence = [d.kl for d in drifts[i]]
            r.top1_per_sequence = [d.top1_same for d in drifts[i]]
        if noise_res is not None:  # want_noise
            noise = noise_res.drift = M.summarize(noise_drifts)
            noise_res.kl_per_sequence = [d.kl for d in noise_drifts]
            hi = noise.kl_ci[1]
            for r in results:
                drift = r.drift
                assert drift is not None
                # NaN (a broken candidate) is never "within the noise"; with a single
                # sequence there is no interval to compare, so no verdict
                if drift.num_sequences < 2 and np.isfinite(drift.mean_kl):
                    r.exceeds_noise_floor = None
                else:
                    r.exceeds_noise_floor = not bool(drift.kl_ci[0] <= hi)

    # 2. Passkey retrieval (greedy).
    if "passkey" in eval_sets:
        items = E.load_passkey()
        if passkey_lengths is not None:
            items = [it for it in items if it.target_tokens in set(passkey_lengths)]
        if max_passkey_items is not None:
            kept: list = []
            seen: dict[int, int] = {}
            for it in items:
                seen[it.target_tokens] = seen.get(it.target_tokens, 0) + 1
                if seen[it.target_tokens] <= max_passkey_items:
                    kept.append(it)
            items = kept
        prompts = [E.chat_prompt_ids(tok, [{"role": "user", "content": it.prompt}]) for it in items]
        for runner, res in tqdm(list(zip([base] + cands, [base_res] + results)), desc="passkey",
                                disable=not progress or not items):
            outs = []
            for p in prompts:  # one at a time: long prompts, and no batch effects
                outs += runner.greedy([p], 12)
            by_len: dict[int, list[bool]] = {}
            for it, o in zip(items, outs):
                by_len.setdefault(it.target_tokens, []).append(E.passkey_correct(o, it.passkey))
            res.passkey_accuracy = {n: float(np.mean(v)) for n, v in sorted(by_len.items())}

    # 3. QA (greedy, batched).
    if "qa" in eval_sets:
        qa = E.load_qa()[:max_qa]
        prompts = [E.chat_prompt_ids(tok, E.qa_prompt(it.question)) for it in qa]
        answers = {}
        for runner, res in tqdm(list(zip([base] + cands, [base_res] + results)), desc="qa",
                                disable=not progress or not qa):
            outs = runner.greedy(prompts, 24)
            answers[res.label] = outs
            res.qa_accuracy = float(np.mean([E.answer_matches(o, it.answers)
                                             for o, it in zip(outs, qa)]))
        for res in results:
            res.qa_agreement = float(np.mean([a == b for a, b in
                                              zip(answers[res.label], answers[base_res.label])]))

    # 4. Layer diff on the start of the first scored sequence.
    if layer_diff_tokens and seqs:
        ids = seqs[0][:layer_diff_tokens]
        for c, r in zip(cands, results):
            r.layer_diff = run_layer_diff(c.model, base.model, ids, mode=mode)

    report = ComparisonReport(base_res, results, noise_res, eval_sets, mode)
    # 5. Figures.
    if seqs:
        kl = {r.label: r.kl_per_sequence for r in results}
        report.figures["kl_by_position"] = plots.plot_kl_by_position(
            kl, noise_floor=noise_res.drift.mean_kl if noise_res and noise_res.drift else None)
        report.figures["agreement_by_position"] = plots.plot_agreement_by_position(
            {r.label: r.top1_per_sequence for r in results})
    if "passkey" in eval_sets:
        report.figures["passkey_by_length"] = plots.plot_accuracy_by_length(
            {r.label: r.passkey_accuracy for r in [base_res] + results})
    if any(r.layer_diff is not None for r in results):
        report.figures["layer_error"] = plots.plot_layer_errors(
            {r.label: r.layer_diff for r in results if r.layer_diff is not None})
    return report
