"""``minivllm`` command line: ``generate``, ``compare``, ``bisect``, ``regress``, ``demo``, ``serve``, ``bench serve``.

Engine flags are generated from :class:`minivllm.engine.arg_utils.EngineArgs`, spelled as
``vllm serve`` spells them (``--kv-cache-dtype``, ``--max-num-seqs``,
``--enable-prefix-caching/--no-enable-prefix-caching`` ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any, Optional

from minivllm.config import ALLOWED_DTYPES, ALLOWED_KV_CACHE_DTYPES, LOGPROBS_MODES
from minivllm.engine.arg_utils import EngineArgs
from minivllm.quantization import QUANTIZATION_METHODS

_CHOICES = {"dtype": ALLOWED_DTYPES, "kv_cache_dtype": ALLOWED_KV_CACHE_DTYPES,
            "device": None, "quantization": QUANTIZATION_METHODS,
            "kv_scale_type": ("static", "dynamic"), "kv_scale_granularity": ("tensor", "head", "channel"),
            "float32_matmul_precision": ("highest", "high"),
            "attention_backend": ("TORCH", "TRITON"), "load_format": ("auto", "dummy"),
            "logprobs_mode": LOGPROBS_MODES}


def _json_object(text: str) -> dict:
    """``--quantization-config '{"group_size": 64}'``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value
_SKIP = {"kv_scale"}  # added by hand below: two numbers


def add_engine_args(parser: argparse.ArgumentParser, only_given: bool = False) -> None:
    """Add one ``--flag`` per EngineArgs field (vLLM spelling). With ``only_given``, flags
    not on the command line are left out of the namespace (no defaults filled in)."""
    group = parser.add_argument_group("engine arguments (as in vLLM)")
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = argparse.SUPPRESS if only_given else getattr(defaults, f.name)
        kind = getattr(defaults, f.name)
        if isinstance(kind, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif f.name in ("num_gpu_blocks_override", "kv_cache_memory_bytes",
                        "max_num_batched_tokens", "max_model_len") or isinstance(kind, int):
            group.add_argument(flag, type=int, default=default)
        elif isinstance(kind, float):
            group.add_argument(flag, type=float, default=default)
        elif f.name == "quantization_config":
            group.add_argument(flag, type=_json_object, default=default,
                               help='JSON object, e.g. \'{"group_size": 64}\'')
        elif f.name == "hf_overrides":  # vLLM's --hf-overrides: a JSON object
            group.add_argument(flag, type=_json_object, default=default,
                               help='JSON object of config fields, e.g. \'{"rope_theta": 10000}\'')
        elif f.name == "override_generation_config":  # vLLM's --override-generation-config
            group.add_argument(flag, type=_json_object, default=default,
                               help='JSON object, e.g. \'{"temperature": 0.5}\'')
        elif f.name == "speculative_config":  # vLLM's --speculative-config
            group.add_argument(flag, type=_json_object, default=default,
                               help='JSON object, e.g. \'{"method": "ngram", '
                                    '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\'')
        else:
            group.add_argument(flag, type=str, default=default, choices=_CHOICES.get(f.name))
    group.add_argument("--kv-scale", nargs=2, type=float, metavar=("K_SCALE", "V_SCALE"),
                       default=argparse.SUPPRESS if only_given else None,
                       help="static KV-cache scales for fp8/int8 (stored = value / scale)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)} - _SKIP
    kv_scale = getattr(ns, "kv_scale", None)
    return EngineArgs(**{n: getattr(ns, n) for n in names},
                      kv_scale=tuple(kv_scale) if kv_scale is not None else None)


def _cmd_generate(ns: argparse.Namespace) -> int:
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams

    prompts = list(ns.prompt or [])
    if ns.prompt_file:
        try:
            with open(ns.prompt_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --prompt-file {ns.prompt_file!r}: {e}") from None
    if not prompts:
        print("error: give at least one --prompt or a --prompt-file", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            min_p=ns.min_p, max_tokens=ns.max_tokens, seed=ns.sampling_seed,
                            stop=ns.stop or None, ignore_eos=ns.ignore_eos,
                            presence_penalty=ns.presence_penalty,
                            frequency_penalty=ns.frequency_penalty,
                            repetition_penalty=ns.repetition_penalty, logprobs=ns.logprobs)
    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                        use_tqdm=len(prompts) > 1)
    else:
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    records = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        records.append({"prompt": p, "text": c.text, "num_prompt_tokens": len(o.prompt_token_ids),
                        "num_generated_tokens": len(c.token_ids), "finish_reason": c.finish_reason})
        if not ns.json:
            print(f"### prompt: {p}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]\n")
    s = llm.stats
    if ns.json:
        print(json.dumps({"outputs": records, "stats": {
            "num_preemptions": s.num_preemptions, "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_queries": s.prefix_cache_queries}}))
    return 0


def _config_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minivllm compare --candidate", add_help=False,
                                exit_on_error=False, allow_abbrev=False)
    add_engine_args(p, only_given=True)
    return p


def parse_config(text: str) -> dict:
    """``"--kv-cache-dtype fp8_e4m3 --block-size 32"`` -> {"kv_cache_dtype": "fp8_e4m3",
    "block_size": 32}; "hf" / "hf-float64" -> the HF reference in that dtype.

    Raises:
        ValueError: an unknown flag or a bad value (the message names it).
    """
    import shlex

    text = text.strip()
    if text in ("hf", "hf-float32", "reference"):
        return {"reference": "float32"}
    if text == "hf-float64":
        return {"reference": "float64"}
    parser = _config_parser()
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"cannot parse engine flags {text!r}: {e}") from None
    if words and not words[0].startswith("--"):
        raise ValueError(f"expected vLLM-style engine flags (e.g. --kv-cache-dtype float16) or "
                         f"'hf' / 'hf-float64', got {text!r}")
    try:
        ns, rest = parser.parse_known_args(words)
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"bad engine flags {text!r}: {e}") from None
    if rest:
        raise ValueError(f"unknown engine flag(s) {rest} in {text!r}; use vLLM-style flags "
                         "such as --kv-cache-dtype float16 (see `minivllm generate --help`)")
    return vars(ns)


def _cmd_compare(ns: argparse.Namespace) -> int:
    import os

    from minivllm.precision.report import compare

    if os.path.exists(ns.out) and not os.path.isdir(ns.out):
        raise ValueError(f"--out {ns.out!r} exists and is not a folder")

    common = {k: v for k, v in vars(ns).items() if k in EngineArgs.__dataclass_fields__}
    model = common.pop("model", EngineArgs.model)
    base = parse_config(ns.baseline)
    if "reference" not in base:
        base = {**common, **base}
    cands = []
    for text in ns.candidate:
        c = parse_config(text)
        cands.append(c if "reference" in c else {**common, **c})
    rep = compare(base, cands, eval_sets=ns.eval_set or ["corpus", "passkey"], model=model,
                  mode=ns.mode, seq_len=ns.seq_len, max_sequences=ns.max_sequences,
                  passkey_lengths=ns.passkey_lengths, max_passkey_items=ns.max_passkey_items,
                  max_qa=ns.max_qa, noise_floor=not ns.no_noise_floor,
                  layer_diff_tokens=ns.layer_diff_tokens, progress=not ns.json)
    paths = rep.save(ns.out)
    if ns.json:
        for name, p in paths.items():
            print(f"wrote {p}", file=sys.stderr)
        print(json.dumps(rep.to_json()))
    else:
        print(rep.to_markdown())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _cmd_bisect(ns: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from minivllm.precision.bisect import KLMeasure, bisect_config

    if not (ns.threshold > 0 and ns.threshold < float("inf")):
        raise ValueError(f"--threshold must be a finite number > 0, got {ns.threshold}")
    if ns.num_prompts < 1 or ns.prompt_len < 2:
        raise ValueError(f"--num-prompts must be >= 1 and --prompt-len >= 2, got "
                         f"{ns.num_prompts} and {ns.prompt_len}")
    common = {k: v for k, v in vars(ns).items() if k in EngineArgs.__dataclass_fields__}
    mys = None
    if ns.mystery is not None:
        from minivllm.precision.mystery import mystery

        mys = mystery(ns.mystery)
        common = {**mys.base, **common}
    if ns.bad is None and mys is None:
        raise ValueError("give the bad configuration: --bad \"--kv-cache-dtype fp8_e4m3 ...\" "
                         "(or --mystery SEED for a planted one)")
    configs = {}
    for name, text in (("good", ns.good), ("bad", ns.bad)):
        if text is None and mys is not None:
            configs[name] = dict(getattr(mys, name))
            continue
        text = "--dtype float32" if text is None else text
        cfg = parse_config(text)
        if "reference" in cfg:
            raise ValueError(f"--{name} must be engine flags, not the HF reference {text!r}")
        configs[name] = cfg
    for name, cfg in configs.items():
        try:
            EngineArgs(**{**common, **cfg}).validate()
        except (TypeError, ValueError) as e:
            raise ValueError(f"--{name}: {e}") from None
    good, bad = configs["good"], configs["bad"]
    # a key given on one side only is compared against the EngineArgs default
    defaults = EngineArgs()
    for a, b in ((good, bad), (bad, good)):
        for k in b:
            if k not in a:
                a[k] = common.get(k, getattr(defaults, k))
    common.setdefault("num_gpu_blocks_override", 64)
    common.setdefault("max_model_len", max(128, ns.prompt_len))

    from minivllm.llm import LLM
    from minivllm.precision import evalsets

    ref_cfg = parse_config(ns.reference)
    ref_common = {k: v for k, v in common.items() if k in ("model", "max_model_len",
                                                          "num_gpu_blocks_override")}
    ref: Any  # the HF reference or an engine: both score() teacher-forced logits
    if "reference" in ref_cfg:
        from minivllm.precision.reference import ReferenceModel

        ref = ReferenceModel(common.get("model", EngineArgs.model), dtype=ref_cfg["reference"])
        tok = ref.tokenizer
    else:
        ref = LLM(**{**ref_common, **ref_cfg})
        tok = ref.get_tokenizer()
    prompts = evalsets.corpus_sequences(tok, ns.prompt_len, ns.num_prompts)
    if len(prompts) < ns.num_prompts:
        raise ValueError(f"the corpus holds only {len(prompts)} windows of {ns.prompt_len} tokens")
    if "reference" in ref_cfg:
        reference = [ref.score(p, output="logits") for p in prompts]
    else:
        reference = ref.score(prompts, output="logits")
    del ref
    measure = KLMeasure(prompts, reference, base=common,
                        build=(lambda args: mys.build(args)) if mys is not None else None)
    bar = tqdm(desc="bisect", unit="config", disable=ns.json)

    def progress(m):
        bar.update(1)
        bar.set_postfix_str(f"{'+'.join(m.keys) or 'good'}: KL {m.value:.2e}")

    try:
        res = bisect_config(good, bad, measure, ns.threshold, progress=progress)
    finally:
        bar.close()
    out = res.to_json()
    out["reference"] = ns.reference
    out["prompts"] = {"num": len(prompts), "tokens": ns.prompt_len}
    if mys is not None and ns.reveal:
        out["mystery"] = mys.reveal()
    if ns.json:
        print(json.dumps(out))
    else:
        print(f"measure: mean KL (nats) against {ns.reference!r} on {len(prompts)} corpus "
              f"windows of {ns.prompt_len} tokens")
        print(res.to_text())
        if "mystery" in out:
            print(f"mystery {ns.mystery} revealed: {out['mystery']}")
    return 0


def _cmd_regress(ns: argparse.Namespace) -> int:
    """Exit 0: every check passed; 1: a regression (the report says which); 2: bad input."""
    import os

    from minivllm.precision import regress as R

    if os.path.exists(ns.out) and not os.path.isdir(ns.out):
        raise ValueError(f"--out {ns.out!r} exists and is not a folder")
    thresholds = R.Thresholds(max_kl=ns.max_kl, min_top1=ns.min_top1,
                              min_default_agreement=ns.min_default_agreement)
    for name in ("num_sequences", "seq_len", "num_prompts", "max_tokens"):
        if getattr(ns, name) < (2 if name in ("num_sequences", "seq_len") else 0 if
                                name == "num_prompts" else 1):
            raise ValueError(f"--{name.replace('_', '-')} is too small: {getattr(ns, name)}")
    tolerances = dict(R.DEFAULT_TOLERANCES)
    for item in ns.tolerance or []:
        dtype, _, value = item.partition("=")
        try:
            tolerances[dtype] = float(value)
        except ValueError:
            raise ValueError(f"--tolerance takes DTYPE=NATS (e.g. bfloat16=0.5), got {item!r}") \
                from None
        if not (tolerances[dtype] >= 0 and math.isfinite(tolerances[dtype])):
            raise ValueError(f"--tolerance {item!r}: the tolerance must be a finite number >= 0")
    candidates = list(ns.candidate or [])
    if ns.update_golden and not ns.golden:
        raise ValueError("--update-golden needs --golden FILE (where to write the snapshot)")
    if ns.golden and len(candidates) != 1:
        raise ValueError(f"--golden checks one configuration: give exactly one --candidate "
                         f"(got {len(candidates)})")
    if not ns.golden and not candidates:
        raise ValueError("give --candidate FLAGS (against --baseline) and/or --golden FILE")
    snapshot = None
    if ns.golden and not ns.update_golden:
        snapshot = R.load_golden(ns.golden)  # a bad file is refused before any engine
    common = {k: v for k, v in vars(ns).items() if k in EngineArgs.__dataclass_fields__}
    common.setdefault("dtype", "float32")
    if "kv_cache_memory_bytes" not in common and "num_gpu_blocks_override" not in common:
        common["kv_cache_memory_bytes"] = 256 * 1024 * 1024
    common.setdefault("max_model_len", max(512, ns.seq_len + 64))
    configs = {}
    for text in ([ns.baseline] if ns.baseline is not None or not ns.golden else []):
        configs["baseline"] = parse_config(text or "--dtype float32 --kv-cache-dtype float32")
    for text in candidates:
        configs[text] = parse_config(text)
    for name, cfg in configs.items():
        if "reference" in cfg:
            raise ValueError(f"regress compares engines: {name!r} must be engine flags, not the "
                             f"HF reference")
        try:
            EngineArgs(**{**common, **cfg}).validate()
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name!r}: {e}") from None
    from minivllm.llm import LLM

    engines = {name: LLM(**{**common, **cfg}) for name, cfg in configs.items()}
    cand_text = candidates[0] if candidates else None
    if ns.update_golden:
        assert cand_text is not None  # --golden takes exactly one candidate
        llm = engines[cand_text]
        seqs = R.eval_sequences(llm.get_tokenizer(), ns.seq_len, ns.num_sequences)
        snap = R.golden_snapshot(llm, seqs, config={**common, **configs[cand_text]})
        path = R.save_golden(snap, ns.golden)
        print(f"wrote golden snapshot of {cand_text!r} ({snap['dtype']}, {len(seqs)} sequences "
              f"of {ns.seq_len} tokens) to {path}")
        return 0
    if "baseline" in engines:
        base = engines.pop("baseline")
        rep = R.check(base, engines, thresholds=thresholds, seq_len=ns.seq_len,
                      num_sequences=ns.num_sequences, num_prompts=ns.num_prompts,
                      max_tokens=ns.max_tokens, noise_floor=not ns.no_noise_floor,
                      baseline_label=ns.baseline or "--dtype float32 --kv-cache-dtype float32")
    else:
        rep = R.RegressionReport("-", thresholds)
    if snapshot is not None:
        assert cand_text is not None
        rep.golden = R.check_golden(engines[cand_text], snapshot, tolerances)
    paths = rep.save(ns.out)
    if ns.json:
        print(json.dumps(rep.to_json()))
    else:
        print(rep.to_markdown())
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if rep.passed else 1


def _cmd_demo(ns: argparse.Namespace) -> int:
    from minivllm.entrypoints.demo import run_demo

    run_demo(model=ns.model, max_tokens=ns.max_tokens, out_path=ns.output)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts (offline, like vllm.LLM)")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompt-file", help="a file with one prompt per line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat turn")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(g)
    g.set_defaults(func=_cmd_generate)

    d = sub.add_parser("demo", help="the first incident: KV-cache dtypes against the float32 "
                                    "HF reference on the embedded model")
    d.add_argument("--model", default=EngineArgs.model)
    d.add_argument("--max-tokens", type=int, default=96)
    d.add_argument("--output", default="reports/demo.md", help="markdown report path")
    d.set_defaults(func=_cmd_demo)

    c = sub.add_parser(
        "compare", help="drift of candidate engine configs against a baseline on eval sets",
        description="Compare candidate configurations against a baseline (precision toolkit). "
                    "Engine flags given here apply to every engine; --baseline and each "
                    "--candidate take a quoted string of vLLM-style engine flags that "
                    "override them (or 'hf' / 'hf-float64' for the HF reference).",
        epilog='example: minivllm compare --candidate "--kv-cache-dtype float16" '
               '--candidate "--kv-cache-dtype fp8_e4m3" --eval-set corpus --json')
    c.add_argument("--baseline", default="--dtype float32 --kv-cache-dtype float32",
                   help="engine flags of the baseline, or 'hf' / 'hf-float64' "
                        "(default: %(default)r)")
    c.add_argument("--candidate", action="append", required=True,
                   help="engine flags of one candidate (repeatable)")
    c.add_argument("--eval-set", action="append", choices=["corpus", "conversations",
                                                           "passkey", "qa"],
                   help="evaluation set (repeatable; default corpus and passkey)")
    c.add_argument("--mode", choices=["prefill", "decode"], default="prefill",
                   help="scoring path for the KL metrics (see LLM.score)")
    c.add_argument("--seq-len", type=int, default=512, help="corpus window length (tokens)")
    c.add_argument("--max-sequences", type=int, default=None,
                   help="at most this many corpus windows and conversations")
    c.add_argument("--passkey-lengths", type=int, nargs="+", default=None,
                   help="only these passkey length buckets (256 512 1024 2048 4096)")
    c.add_argument("--max-passkey-items", type=int, default=None, help="per length bucket")
    c.add_argument("--max-qa", type=int, default=None)
    c.add_argument("--no-noise-floor", action="store_true",
                   help="skip the reordered-reduction noise floor")
    c.add_argument("--layer-diff-tokens", type=int, default=128,
                   help="tokens for the per-layer diff (0 disables)")
    c.add_argument("--out", default="reports/compare", help="folder for report.md/json and PNGs")
    c.add_argument("--json", action="store_true",
                   help="print one JSON object as the last line (progress bars off)")
    add_engine_args(c, only_given=True)
    c.set_defaults(func=_cmd_compare)

    b = sub.add_parser(
        "bisect", help="find the config key(s) that make a bad engine configuration drift",
        description="Bisect from a good engine configuration to a bad one, one key at a time: "
                    "each configuration is built and scored on a few corpus windows, and "
                    "its mean KL against a float32 reference decides good (< --threshold) "
                    "or bad. Prints the culprit key(s) with the numbers. Engine flags given "
                    "here apply to every engine; --good and --bad take a quoted string of "
                    "vLLM-style engine flags.",
        epilog='example: minivllm bisect --good "--dtype float32" --bad "--dtype float32 '
               '--kv-cache-dtype fp8_e4m3 --block-size 32 --no-enable-prefix-caching"')
    b.add_argument("--good", default=None,
                   help="engine flags of the good configuration (default: --dtype float32, "
                        "or the mystery's)")
    b.add_argument("--bad", default=None, help="engine flags of the bad configuration")
    b.add_argument("--reference", default="--dtype float32 --kv-cache-dtype float32",
                   help="what KL is measured against: engine flags, or 'hf' / 'hf-float64' "
                        "(default: %(default)r)")
    b.add_argument("--threshold", type=float, default=1e-8,
                   help="a configuration is bad when its mean KL >= this, in nats (default "
                        "%(default)s: 1000x the float32 noise floor of ~1e-11)")
    b.add_argument("--num-prompts", type=int, default=3, help="corpus windows to score")
    b.add_argument("--prompt-len", type=int, default=32, help="tokens per window")
    b.add_argument("--mystery", type=int, default=None, metavar="SEED",
                   help="bisect a mystery engine (a planted fault behind one key; "
                        "minivllm.precision.mystery)")
    b.add_argument("--reveal", action="store_true", help="print the mystery's answer at the end")
    b.add_argument("--json", action="store_true", help="print one JSON object (no progress bar)")
    add_engine_args(b, only_given=True)
    b.set_defaults(func=_cmd_bisect)

    r = sub.add_parser(
        "regress", help="precision regression gate for CI: candidate vs baseline, golden "
                        "log-prob snapshots; exit 1 on a regression",
        description="A precision regression check for CI (not a vLLM command). Against "
                    "--baseline, each --candidate is scored on fixed corpus windows (mean KL "
                    "with a bootstrap interval, top-1 agreement, both against the noise floor "
                    "of the baseline with its MLP reduction reordered) and generates from "
                    "fixed chat prompts with its own default sampling parameters (which "
                    "catches a changed generation_config). With --golden FILE the one "
                    "candidate is checked against a saved log-prob snapshot at its dtype's "
                    "tolerance (--update-golden writes it). Writes report.md and report.json; "
                    "exit status 0 pass, 1 regression, 2 bad input.",
        epilog='examples: minivllm regress --baseline "--kv-cache-dtype auto" --candidate '
               '"--kv-cache-dtype fp8_e4m3"; minivllm regress --golden golden.json '
               '--update-golden --candidate "--dtype bfloat16"; minivllm regress --golden '
               'golden.json --candidate "--dtype bfloat16"')
    r.add_argument("--baseline", default=None,
                   help="engine flags of the baseline (default --dtype float32 "
                        "--kv-cache-dtype float32; with --golden only: no comparison)")
    r.add_argument("--candidate", action="append", help="engine flags of one candidate "
                                                        "(repeatable)")
    r.add_argument("--max-kl", type=float, default=1e-3,
                   help="tolerated mean KL in nats (default %(default)s)")
    r.add_argument("--min-top1", type=float, default=0.98,
                   help="lowest top-1 agreement, a fraction (default %(default)s)")
    r.add_argument("--min-default-agreement", type=float, default=0.9,
                   help="lowest fraction of default-sampled tokens equal to the baseline's "
                        "(default %(default)s)")
    r.add_argument("--no-noise-floor", action="store_true",
                   help="judge against the thresholds alone (no reordered-reduction floor)")
    r.add_argument("--num-sequences", type=int, default=8, help="corpus windows to score")
    r.add_argument("--seq-len", type=int, default=64, help="tokens per corpus window")
    r.add_argument("--num-prompts", type=int, default=8,
                   help="chat prompts for the default-sampling check (0 skips it)")
    r.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    r.add_argument("--golden", default=None, metavar="FILE", help="golden log-prob snapshot")
    r.add_argument("--update-golden", action="store_true",
                   help="write the candidate's snapshot to --golden instead of checking it")
    r.add_argument("--tolerance", action="append", metavar="DTYPE=NATS",
                   help="golden tolerance for a dtype (repeatable; defaults float32=1e-3, "
                        "float16=0.1, bfloat16=0.5)")
    r.add_argument("--out", default="reports/regress", help="folder for report.md/json")
    r.add_argument("--json", action="store_true", help="print the JSON report")
    add_engine_args(r, only_given=True)
    r.set_defaults(func=_cmd_regress)

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (like vllm serve)")
    v.add_argument("model_tag", nargs="?", default=None,
                   help="the model (alias or folder); same as --model")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model argument)")
    v.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* routes")
    v.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 while this many requests already wait (default: no limit)")
    v.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats log line")
    v.add_argument("--log-interval", type=float, default=5.0,
                   help="seconds between stats log lines (default: %(default)s)")
    v.add_argument("--precision-monitor", type=_json_object, default=None, metavar="JSON",
                   help="watch served log-probs for drift (not a vLLM flag): DriftMonitor "
                        "options as a JSON object, e.g. '{}' or '{\"warmup\": 200}'; "
                        "exported as minivllm:precision_monitor_* gauges on /metrics")
    add_engine_args(v)
    v.set_defaults(func=_cmd_serve)

    from minivllm.entrypoints.bench_serve import add_parser as add_bench_parser
    add_bench_parser(sub)
    return parser


def _cmd_serve(ns: argparse.Namespace) -> int:
    from minivllm.entrypoints.openai.api_server import run_server

    if ns.model_tag is not None:
        ns.model = ns.model_tag
    if ns.max_waiting_requests is not None and ns.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {ns.max_waiting_requests}")
    monitor = None
    if ns.precision_monitor is not None:
        from minivllm.precision.monitor import DriftMonitor

        try:
            monitor = DriftMonitor(**ns.precision_monitor)
        except TypeError as e:  # an unknown option
            raise ValueError(f"--precision-monitor: {e}; options: warmup, threshold, "
                             "allowance, min_tokens, reference") from None
    run_server(engine_args_from(ns), host=ns.host, port=ns.port,
               served_model_names=ns.served_model_name, api_key=ns.api_key,
               max_waiting_requests=ns.max_waiting_requests,
               log_stats=not ns.disable_log_stats, log_interval_s=ns.log_interval,
               precision_monitor=monitor)
    return 0


def _join_flag_values(argv: list[str]) -> list[str]:
    """``--candidate --no-enable-prefix-caching`` -> ``--candidate=--no-enable-prefix-caching``
    (argparse would read a lone value that starts with '--' as an option)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("--candidate", "--baseline", "--good", "--bad", "--reference") \
                and i + 1 < len(argv) \
                and argv[i + 1].startswith("-") and " " not in argv[i + 1]:
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["compare"], ["bisect"], ["regress"]):
        argv = _join_flag_values(argv)
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, TypeError, RuntimeError, NotImplementedError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
