"""Mystery engines: one unnamed fault from the fault library, hidden behind one config key.

A real precision bug lives in the code path one setting turns on (the chunked-prefill
kernel, the block-size-32 variant, the eager path) and in one place of the network. A
:class:`Mystery` reproduces that shape for practice (chapter 27): drawn from a seed, it
holds

* a good configuration (float32, the engine's defaults) and a bad one that changes a few
  keys, each of them harmless on its own in float32 (they change the schedule or the
  memory layout, not the arithmetic; ``tests/test_bisect.py`` checks that all of them
  together give the good configuration's logits bit for bit);
* a *trigger*: one of those keys; an engine built with the trigger at its bad value gets
  the fault planted, any other engine is clean;
* the fault: one of :data:`MYSTERY_FAULTS`, planted in one decoder layer through the step
  registry (:mod:`minivllm.precision.faults`).

Finding it takes the playbook: bisect the configuration (:mod:`minivllm.precision.bisect`)
to find the trigger key, then diff the bad engine against the good one layer by layer
(:mod:`minivllm.precision.layer_diff`) to find the layer and the block.

Which faults of the library qualify: the ones that change the numbers of a float32
prefill in one layer of the model, so they leave a KL above the float32 noise floor
(~1e-11 nats) and a first jump at their layer. Measured for each of the 30 layers
(three corpus windows of 24 tokens, ``layer_diff`` against a clean engine of the same
configuration; ``tests/test_bisect.py`` repeats it for the first, the last and a random
layer): ``fp16_rmsnorm`` before attention or before the MLP and ``wrong_rope_theta``
(10,000 for the model's 100,000) are found at their layer and block in all 90 cases,
with a mean KL of at least 9.6e-8 nats. ``low_precision_rope_table`` (bf16 angles, one
layer) is too faint: in layers 14, 15 and 20 its error stays under the diff's 1e-5 jump
floor (no layer found) and its KL falls to 2.2e-8, so it is a candidate that does not
qualify (:data:`CANDIDATE_FAULTS`; :func:`survey` repeats the measurement). The rest of
the library (24 context managers in :mod:`minivllm.precision.faults` when this was
written) does not qualify either:

* sampling: ``top_p_before_top_k``, ``penalty_accounting_mixed``,
  ``penalty_prompt_accounting`` (teacher-forced scoring never samples);
* scheduler and cache state: ``drop_outputs_on_resume``, ``double_append_on_resume``
  (need a preemption), ``unchained_block_hash``, ``skip_prefix_reset_on_rescale`` (need
  prefix-cache hits), ``spec_accept_first_unverified`` (needs speculative decoding);
* every layer at once, so no layer to find: ``off_by_one_slots``, ``reader_block_size``,
  ``zeroed_block_tables``, ``chunk_seqlen_k_full``, ``chunk_no_past_kv``;
* the prompt, not the network: ``doubled_bos``, ``right_truncation``;
* exact or at the noise floor in float32 (float16 faults): ``rmsnorm_no_upcast``,
  ``softmax_without_max``, ``eager_kq_attention``, and the exact reparametrizations
  ``residual_scale_reparam``, ``qk_scale_reparam``;
* decode-only: ``decode_softmax_low_precision`` shows only under
  ``LLM.score(mode="decode")``, 20x slower than a prefill on a CPU (32 tokens: 8 s
  against 0.4 s).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any, Callable

import torch

# name -> (plant(llm, layer) -> context manager, the block the layer diff must name):
# the layer-local faults considered (CANDIDATE_FAULTS) and those that qualify
# (MYSTERY_FAULTS, what mysteries draw from); :func:`survey` measures them.
CANDIDATE_FAULTS: dict[str, tuple[Callable, str]] = {}
MYSTERY_FAULTS: dict[str, tuple[Callable, str]] = {}


def _register(name: str, block: str, qualifies: bool = True):
    def deco(fn):
        CANDIDATE_FAULTS[name] = (fn, block)
        if qualifies:
            MYSTERY_FAULTS[name] = (fn, block)
        return fn
    return deco


@_register("fp16_input_rmsnorm", "self_attn")
def _fp16_input_rmsnorm(llm, layer):
    from minivllm.precision import faults

    return faults.fp16_rmsnorm(llm, layer, "input_layernorm")


@_register("fp16_post_attention_rmsnorm", "mlp")
def _fp16_post_rmsnorm(llm, layer):
    from minivllm.precision import faults

    return faults.fp16_rmsnorm(llm, layer, "post_attention_layernorm")


@_register("rope_theta_10000", "self_attn")
def _rope_theta(llm, layer):
    from minivllm.precision import faults

    return faults.wrong_rope_theta(llm, layer, 10000.0)


@_register("rope_table_bf16_angles", "self_attn", qualifies=False)
def _rope_bf16(llm, layer):
    from minivllm.precision import faults

    return faults.low_precision_rope_table(llm, torch.bfloat16, "angles", layer)


def survey(faults=None, layers=None, num_windows: int = 3, window: int = 24,
           progress: bool = True) -> list[dict]:
    """Measure which faults qualify for a mystery: plant each in each layer of a float32
    engine and record the mean KL against a clean engine on corpus windows and what
    ``layer_diff`` names. The numbers in this module's docstring come from
    ``python -c "from minivllm.precision.mystery import survey; survey()"`` (all 4
    candidates x 30 layers: about 3 minutes on an idle 2-core CPU).

    Returns:
        one dict per (fault, layer): fault, layer, found_layer, found_block, block, kl, ok.
    """
    from minivllm.llm import LLM
    from minivllm.precision import evalsets, metrics
    from minivllm.precision.layer_diff import layer_diff

    base: dict[str, Any] = {"model": "smollm2-135m-instruct", "dtype": "float32",
                            "max_model_len": 128, "num_gpu_blocks_override": 16}
    llm, ref = LLM(**base), LLM(**base)
    seqs = evalsets.corpus_sequences(llm.get_tokenizer(), window, num_windows)
    want = ref.score(seqs, output="logits")
    rows = []
    for name in (faults or sorted(CANDIDATE_FAULTS)):
        plant, block = CANDIDATE_FAULTS[name]
        for layer in (layers if layers is not None else range(len(llm.llm_engine.model_runner.model.layers))):
            with plant(llm, layer):
                d = layer_diff(llm, ref, seqs[0])
                got = llm.score(seqs, output="logits")
            kl = sum(metrics.mean_kl(a, b) for a, b in zip(want, got)) / len(seqs)
            row = {"fault": name, "layer": layer, "block": block, "kl": kl,
                   "found_layer": d.first_jump_layer, "found_block": d.first_jump_block,
                   "ok": (d.first_jump_layer, d.first_jump_block) == (layer, block)}
            rows.append(row)
            if progress:
                print(f"{name:28s} layer {layer:2d}: found {d.first_jump_layer} "
                      f"{d.first_jump_block}, KL {kl:.2e}{'' if row['ok'] else '  MISSED'}",
                      flush=True)
    if progress:
        for name in sorted({r["fault"] for r in rows}):
            rs = [r for r in rows if r["fault"] == name]
            print(f"{name}: found {sum(r['ok'] for r in rs)}/{len(rs)}, min KL "
                  f"{min(r['kl'] for r in rs):.2e}")
    return rows


GOOD_CONFIG: dict = {"dtype": "float32", "kv_cache_dtype": "auto", "block_size": 16,
                     "enable_prefix_caching": True, "enable_chunked_prefill": True,
                     "max_num_seqs": 256, "enforce_eager": False}

# keys a mystery may change, with their bad values (each exact in float32 on its own)
HARMLESS_CHANGES: dict = {"kv_cache_dtype": "float32", "block_size": 32,
                          "enable_prefix_caching": False, "enable_chunked_prefill": False,
                          "max_num_seqs": 8, "enforce_eager": True}


@dataclass(frozen=True)
class Mystery:
    """One mystery (see the module docstring). Build engines with :meth:`build`; the
    answer is in :meth:`reveal` (for graders and tests, not for the learner).

    Attributes:
        seed: what it was drawn from.
        good, bad: the two configurations (dicts of ``EngineArgs`` fields).
        base: engine arguments every build gets (model, max_model_len, a small pool).
    """

    seed: int
    good: dict
    bad: dict
    base: dict
    _fault: str
    _layer: int
    _trigger: str

    def triggered(self, cfg: dict) -> bool:
        """Whether an engine with configuration ``cfg`` carries the fault."""
        return cfg.get(self._trigger, GOOD_CONFIG[self._trigger]) == self.bad[self._trigger]

    def build(self, cfg: dict | None = None, **kwargs):
        """An ``LLM`` with ``base``, then ``cfg`` (default: the bad configuration), then
        ``kwargs``; the fault is planted (for the engine's lifetime) iff the
        configuration has the trigger key at its bad value."""
        from minivllm.llm import LLM

        args = {**self.base, **(self.bad if cfg is None else cfg), **kwargs}
        llm = LLM(**args)
        if self.triggered(args):
            stack = contextlib.ExitStack()
            stack.enter_context(self.plant(llm))
            setattr(llm, "_mystery_fault", stack)  # lives as long as the engine
        return llm

    def plant(self, llm):
        """Plant this mystery's fault into an existing engine (a context manager),
        whatever its configuration."""
        fn, _ = MYSTERY_FAULTS[self._fault]
        return fn(llm, self._layer)

    def reveal(self) -> dict:
        """The answer: {"fault", "layer", "block", "culprit"} (the trigger key)."""
        return {"fault": self._fault, "layer": self._layer,
                "block": MYSTERY_FAULTS[self._fault][1], "culprit": self._trigger}

    def __repr__(self) -> str:  # no spoilers
        return f"Mystery(seed={self.seed}, bad={self.bad})"


def mystery(seed: int, num_keys: int = 4, faults=None, num_layers: int = 30,
            base: dict | None = None) -> Mystery:
    """Draw a :class:`Mystery` from ``seed``.

    Args:
        seed: any int; the same seed gives the same mystery.
        num_keys: how many keys the bad configuration changes (1 .. 6).
        faults: the fault names to draw from (default: all of :data:`MYSTERY_FAULTS`).
        num_layers: decoder layers of the model (30 for the embedded SmolLM2).
        base: engine arguments for every build (default: the embedded model,
            ``max_model_len=128``, ``num_gpu_blocks_override=16``).
    Raises:
        ValueError: ``num_keys`` out of range, an unknown fault name.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if isinstance(num_keys, bool) or not isinstance(num_keys, int) \
            or not 1 <= num_keys <= len(HARMLESS_CHANGES):
        raise ValueError(f"num_keys must be in [1, {len(HARMLESS_CHANGES)}], got {num_keys!r}")
    names = sorted(MYSTERY_FAULTS) if faults is None else list(faults)
    unknown = [n for n in names if n not in MYSTERY_FAULTS]
    if unknown or not names:
        raise ValueError(f"unknown fault(s) {unknown or names}; known: {sorted(MYSTERY_FAULTS)}")
    rng = random.Random(seed)
    fault = rng.choice(names)
    layer = rng.randrange(num_layers)
    keys = rng.sample(sorted(HARMLESS_CHANGES), num_keys)
    trigger = rng.choice(keys)
    bad = dict(GOOD_CONFIG)
    for k in keys:
        bad[k] = HARMLESS_CHANGES[k]
    base = dict(base) if base is not None else {
        "model": "smollm2-135m-instruct", "max_model_len": 128, "num_gpu_blocks_override": 16}
    return Mystery(seed=seed, good=dict(GOOD_CONFIG), bad=bad, base=base, _fault=fault,
                   _layer=layer, _trigger=trigger)
