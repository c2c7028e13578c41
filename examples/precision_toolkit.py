# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The precision toolkit in ten cells
#
# Score a fixed text with the engine and with the float32 reference, measure the drift
# of a KV-cache dtype, see where a planted bug starts with the layer diff, and draw the
# figures. Runs on the embedded model by default (set `MINIVLLM_EXAMPLE_MODEL` to any
# local HF Llama folder to use another one).

# %%
# %matplotlib inline
import os

from minivllm import LLM
from minivllm.precision import ReferenceModel, faults, layer_diff, metrics
from minivllm.precision import evalsets, plots

MODEL = os.environ.get("MINIVLLM_EXAMPLE_MODEL", "smollm2-135m-instruct")
SEQ_LEN = int(os.environ.get("MINIVLLM_EXAMPLE_SEQ_LEN", "256"))

# %% [markdown]
# ## Teacher-forced scores
# `LLM.score` returns `[T, vocab]` log-probs for a fixed token sequence: no sampling, so
# no generation cascade hides or exaggerates a precision effect.

# %%
base = LLM(MODEL, dtype="float32", kv_cache_dtype="float32", kv_cache_memory_bytes=256 << 20)
ref = ReferenceModel(MODEL, dtype="float32")
tok = base.get_tokenizer()
seqs = evalsets.corpus_sequences(tok, seq_len=SEQ_LEN, max_sequences=3)
rows = base.score(seqs)
ref_rows = [ref.score(s) for s in seqs]
print("engine float32 vs HF float32: mean KL =",
      sum(metrics.mean_kl(r, x) for r, x in zip(ref_rows, rows)) / len(seqs))

# %% [markdown]
# ## A KV-cache dtype against the float32 engine

# %%
drift = {}
for kv in ("float16", "fp8_e4m3"):
    cand = LLM(MODEL, dtype="float32", kv_cache_dtype=kv, kv_cache_memory_bytes=256 << 20)
    cand_rows = cand.score(seqs)
    drift[kv] = [metrics.sequence_drift(r, c, s) for r, c, s in zip(rows, cand_rows, seqs)]
    s = metrics.summarize(drift[kv])
    print(f"{kv:>9}: mean KL {s.mean_kl:.3g} nats, CI [{s.kl_ci[0]:.3g}, {s.kl_ci[1]:.3g}], "
          f"top-1 agreement {100 * s.top1_agreement:.2f}%, PPL ratio {s.ppl_ratio:.4f}")

# %%
plots.plot_kl_by_position({kv: [d.kl for d in ds] for kv, ds in drift.items()})

# %% [markdown]
# ## Where does a bug start? Plant one, then run the layer diff

# %%
with faults.fp16_rmsnorm(base, layer=1):
    d = layer_diff(base, ref, seqs[0][:64])
print("first jump at layer", d.first_jump_layer, "in", d.first_jump_block)
d.plot(label="fp16 RMSNorm in layer 1")
