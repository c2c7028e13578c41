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
# # Chapter 25. Tensor parallelism: reduction order and shard layout
#
# **Learning goals.** After this chapter you can
#
# 1. say which `tensor_parallel_size` values a model admits and why (vLLM's checks: the
#    attention heads, the KV heads and the MLP width must split evenly), and what each
#    rank holds: its query heads, its KV head(s), its slice of the MLP;
# 2. say where tensor parallelism changes numbers and where it does not: column-parallel
#    layers and gathers only **move** values; the row-parallel layers (`o_proj`,
#    `down_proj`) cut a dot product into tp partial sums, round each to the model dtype
#    and **add them in the all-reduce's order**;
# 3. tell a reduction-order difference (last bits in fp32, a few 1e-3 nats of KL in bf16,
#    occasional greedy divergence) from a **layout bug** (garbage), and make the reduction
#    bitwise reproducible by fixing its order.
#
# **The incidents.**
#
# - **vllm #2742** "When using tp=2 ... greedy mode ... results are random"
#   (<https://github.com/vllm-project/vllm/issues/2742>, 2024-02-04): on L40S at TP = 2,
#   greedy output changed between runs; `--disable-custom-all-reduce` made it stable.
# - **vllm #3775** "Incorrect output on OLMo models with tensor_parallel_size>1"
#   (<https://github.com/vllm-project/vllm/issues/3775>, 2024-04-01): OLMo's fused
#   `ff_out` was not treated as a merged column-parallel layer, so each rank got the wrong
#   rows; fixed in PR #3869.
# - **vllm #2891** (<https://github.com/vllm-project/vllm/issues/2891>, 2024-02-16): an
#   MPT model gives different greedy output at TP = 1 and TP = 4; most likely a changed
#   reduction order (no maintainer conclusion in the thread).
#
# **What runs here, plainly.** Sections 1-5 use `minivllm/parallel/emulated_tp.py`: in
# **one process**, each decoder layer's `qkv_proj`, `o_proj` and MLP are replaced by tp
# ranks computed one after the other, with Megatron's / vLLM's shards
# (`QKVParallelLinear`, `MergedColumnParallelLinear`, `RowParallelLinear`), each rank's
# partial sums rounded to the model dtype, and an all-reduce that adds them in an order
# you choose. That is the arithmetic a real tp run does between the GEMMs, with every
# order under your control, which is what sections 3-5 need. Section 6 then runs the real
# thing: `LLM(..., tensor_parallel_size=3)` starts two worker processes
# (`distributed_executor_backend="mp"`), each holding its shard and the KV cache of its
# own heads, and the ranks' partial sums meet in a real gloo all-reduce; the embedding
# and LM head are vocab-parallel there (49152 / 3 = 16384 rows per rank; a gather moves
# values without changing any), while the emulation keeps them whole. What real
# collectives add on GPUs is a **choice of order**: NCCL's ring and tree, and vLLM's
# one-stage or two-stage custom all-reduce, each add the ranks' partials in a fixed order
# (the same on every rank, accumulating in float32), so a fixed algorithm gives fixed
# bits; but which one runs, and with how many channels, is chosen by message size, and
# the message size follows the batch. Section 4 emulates orders, including a random one
# per call as a thought experiment.
#
# Everything below is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct, on this machine's CPU.

# %%
# %matplotlib inline
import time

import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams
from minivllm.i18n import Bi, claims_table, say
from minivllm.parallel.emulated_tp import (all_reduce_rank_order, check_tensor_parallel_size,
                                           emulate_tensor_parallel, shard_contiguous,
                                           shard_merged_column, shard_qkv)
from minivllm.precision import evalsets, metrics

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
kw = dict(max_model_len=256, num_gpu_blocks_override=40, enable_prefix_caching=False)
f32 = LLM(MODEL, dtype="float32", **kw)
tok = f32.get_tokenizer()
cfg = f32.llm_engine.model_runner.model.cfg
_text = evalsets.load_corpus()
seqs = [tok.encode(_text[s:s + 1200])[:32] for s in (1000, 4000)]
prompts = [s[:20] for s in seqs[:2]]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def logits(llm):
    """Teacher-forced logits of the sequences, [positions, vocab], float32."""
    return torch.cat(llm.score(seqs, output="logits")).float()


def generate(llm, ps=prompts, sp=greedy):
    return [o.outputs[0].token_ids for o in llm.generate(ps, sp)]


print({k: cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "hidden_size",
                           "intermediate_size", "vocab_size")})
print(f"{len(seqs)} sequences x {len(seqs[0])} tokens scored; {len(prompts)} prompts x "
      f"{greedy.max_tokens} greedy tokens")

# %% [markdown]
# ## 1. Which tensor-parallel sizes SmolLM2 admits
#
# vLLM checks (`ModelConfig.verify_with_parallel_config` and the parallel layers) that the
# number of attention heads is divisible by tp, that the KV heads either divide evenly
# over the ranks or are replicated (tp divisible by the KV heads), and that the MLP's
# intermediate size splits. SmolLM2-135M has 9 query heads, 3 KV heads and an
# intermediate size of 1536:

# %%
allowed = []
for tp in range(1, 10):
    try:
        check_tensor_parallel_size(cfg, tp)
        allowed.append(tp)
        print(f"tp={tp}: allowed")
    except ValueError as e:
        print(f"tp={tp}: {e}")
print("allowed:", allowed)
TP = 3
print(f"at tp={TP} each rank holds {cfg['num_attention_heads'] // TP} query heads, "
      f"{max(1, cfg['num_key_value_heads'] // TP)} KV head, "
      f"{cfg['intermediate_size'] // TP} of the {cfg['intermediate_size']} MLP units, and "
      f"(vocab-parallel) {cfg['vocab_size'] // TP} of the {cfg['vocab_size']} vocabulary rows")

# %% [markdown]
# tp = 9 passes the head checks but not the MLP's (1536 / 9 is not an integer), so the
# answer is 1 or 3. (The 2-GPU box everyone has cannot serve this model with tp = 2.)
#
# ## 2. The shards, on a labelled toy matrix
#
# Row `i` of each toy weight holds the value `i`, so a shard shows which rows it took.
# A fused QKV weight stacks the Q rows of every head, then K, then V. A fused `gate_up`
# stacks the gate matrix over the up matrix; each rank must hold **its slice of each**,
# `[gate_r; up_r]`, because the activation multiplies gate unit j with up unit j. The
# contiguous cut of vllm #3775 gives rank 1 the end of the gate matrix and the start of
# the up matrix.

# %%
H, Hkv, D = 6, 3, 1  # toy heads; D = 1 row per head
w_qkv = torch.arange((H + 2 * Hkv) * D, dtype=torch.float32)[:, None]
for r in range(3):
    print(f"qkv rank {r}: rows {shard_qkv(w_qkv, r, 3, H, Hkv, D)[:, 0].int().tolist()}"
          "  (q heads, then its K head, then its V head)")
print("6 ranks (H=6, Hkv=3, tp=6): rank r's K/V rows:",
      [shard_qkv(w_qkv, r, 6, H, Hkv, D)[1:, 0].int().tolist() for r in range(6)],
      "(each KV head replicated on 2 ranks)")
inter = 6
w_gu = torch.cat([torch.arange(inter), 100 + torch.arange(inter)]).float()[:, None]
for r in range(3):
    print(f"gate_up rank {r}: merged {shard_merged_column(w_gu, [inter, inter], r, 3)[:, 0].int().tolist()}"
          f"   contiguous (bug) {shard_contiguous(w_gu, [inter, inter], r, 3)[:, 0].int().tolist()}")

# %% [markdown]
# Rows 0-5 are gate units and 100-105 up units. With the merged layout every rank pairs
# gate j with up 100 + j; with the contiguous cut rank 0 computes `silu(gate_0) * gate_2`,
# a function the model never learned.
#
# ## 3. tp = 3 against tp = 1, float32 and bfloat16
#
# Same weights, same inputs; only the row-parallel sums are cut in three and added in rank
# order. In float32 that reorders a 576- or 1536-term dot product into three partial sums:
# a last-bit change. In bfloat16 each partial sum is **rounded to 8 significant bits**
# before the all-reduce, and the all-reduce's additions round again.

# %%
ref32 = logits(f32)
with emulate_tensor_parallel(f32, TP):
    tp32 = logits(f32)
kl32 = metrics.mean_kl(ref32, tp32)
diff32 = (ref32 - tp32).abs().max().item()
top1_32 = metrics.top1_agreement(ref32, tp32)
print(f"float32  tp=3 vs tp=1: mean KL {kl32:.2e} nats, max |logit diff| {diff32:.2e}, "
      f"top-1 agreement {100 * top1_32:.1f}% ({len(ref32)} positions)")

b16 = LLM(MODEL, dtype="bfloat16", **kw)
ref16 = logits(b16)
with emulate_tensor_parallel(b16, TP):
    tp16 = logits(b16)
    tp16_again = logits(b16)
    g16_tp = generate(b16)
g16 = generate(b16)
kl16 = metrics.mean_kl(ref16, tp16)
diff16 = (ref16 - tp16).abs().max().item()
top1_16 = metrics.top1_agreement(ref16, tp16)
kl16_vs32 = metrics.mean_kl(ref32, ref16)
div16 = [metrics.first_divergence(a, b) for a, b in zip(g16, g16_tp)]
print(f"bfloat16 tp=3 vs tp=1: mean KL {kl16:.2e} nats, max |logit diff| {diff16:.3g}, "
      f"top-1 agreement {100 * top1_16:.1f}%, greedy first divergence {div16} "
      f"(None = all {greedy.max_tokens} equal)")
print(f"for scale, bfloat16 tp=1 vs float32 tp=1: mean KL {kl16_vs32:.2e} nats")
say(f"bfloat16 tp=3 run twice: bit-identical {torch.equal(tp16, tp16_again)}",
    f"bfloat16 tp=3 运行两次：逐位相同 {torch.equal(tp16, tp16_again)}")

# %% [markdown]
# In float32 the split is invisible in the distribution (KL many orders below anything a
# benchmark could see); in bfloat16 tp = 3 moves the distribution by about as much as
# bfloat16 itself does against float32 (compare the two KLs printed above), and the top-1
# token changes at a few percent of positions, where a greedy continuation can fork (the
# first divergences are printed here and, for another order, in section 4). That is
# vllm #2891's "TP = 1 and TP = 4 differ": nothing is wrong, the sums are different sums. Run
# twice with the same order, the bits are the same.
#
# ## 4. The all-reduce's order
#
# The emulation's default adds the partials in rank order, `(p0 + p1) + p2`. Real
# collectives do not promise that. Two other orders, each a plain Python function
# plugged in as `all_reduce_fn`:
#
# - **ring-like**: NCCL's ring reduce-scatter cuts the vector into tp chunks and starts
#   chunk c at rank c + 1, so different hidden units are summed in different orders;
# - **arrival order**: the partials added in a random order per call (seeded here so the
#   notebook is reproducible). A thought experiment: neither NCCL nor vLLM's custom
#   all-reduce adds in arrival order; it stands for "a different order on each call",
#   which is what a batch-size-dependent choice of algorithm amounts to across requests.

# %%
def all_reduce_ring(partials):
    """Ring reduce-scatter's order: chunk c of the hidden vector summed starting at rank
    c + 1, i.e. ((p[c+1] + p[c+2]) + ... ) + p[c] (indices mod tp)."""
    tp, n = len(partials), partials[0].shape[-1]
    out = []
    for c in range(tp):
        sl = slice(c * n // tp, (c + 1) * n // tp)
        order = [(c + 1 + i) % tp for i in range(tp)]
        acc = partials[order[0]][..., sl]
        for r in order[1:]:
            acc = acc + partials[r][..., sl]
        out.append(acc)
    return torch.cat(out, dim=-1)


class AllReduceArrivalOrder:
    """Adds the partials in a random order drawn per call (the 'arrival' order)."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, partials):
        order = torch.randperm(len(partials), generator=self.g).tolist()
        return all_reduce_rank_order([partials[i] for i in order])


orders = {"ring-like": all_reduce_ring,
          "arrival, run 1": AllReduceArrivalOrder(1), "arrival, run 2": AllReduceArrivalOrder(2)}
by_order = {"rank order": tp16}
for name, fn in orders.items():
    with emulate_tensor_parallel(b16, TP, all_reduce_fn=fn):
        by_order[name] = logits(b16)
print(f"{'bfloat16, tp=3':16s} {'vs rank order: equal bits':>26s} {'logits differing':>17s} "
      f"{'max |diff|':>10s} {'KL (nats)':>10s} {'KL vs tp=1':>10s}")
for name, lg in by_order.items():
    print(f"{name:16s} {str(torch.equal(lg, tp16)):>26s} "
          f"{100 * (lg != tp16).float().mean().item():16.1f}% "
          f"{(lg - tp16).abs().max().item():10.3g} {metrics.mean_kl(tp16, lg):10.2e} "
          f"{metrics.mean_kl(ref16, lg):10.2e}")
runs_differ = not torch.equal(by_order["arrival, run 1"], by_order["arrival, run 2"])
say(f"arrival order, run 1 vs run 2: bits differ {runs_differ}, KL "
    f"{metrics.mean_kl(by_order['arrival, run 1'], by_order['arrival, run 2']):.2e}",
    f"到达顺序，第 1 次与第 2 次运行：位不同 {runs_differ}，KL "
    f"{metrics.mean_kl(by_order['arrival, run 1'], by_order['arrival, run 2']):.2e}")
with emulate_tensor_parallel(b16, TP, all_reduce_fn=all_reduce_ring):
    g16_ring = generate(b16)
div_ring = [metrics.first_divergence(a, b) for a, b in zip(g16_tp, g16_ring)]
say(f"greedy, ring-like vs rank order: first divergence {div_ring}",
    f"贪心输出，类 ring 与 rank 顺序：首次分歧位置 {div_ring}")

# %%
fig = Figure(figsize=(7.5, 3.0), layout="constrained")
ax = fig.add_subplot()
curves = {"bf16 tp=1 vs fp32 tp=1": metrics.kl_divergence(ref32, ref16),
          "bf16 tp=3 (rank order) vs bf16 tp=1": metrics.kl_divergence(ref16, tp16),
          "bf16 tp=3 ring-like vs rank order": metrics.kl_divergence(tp16, by_order["ring-like"]),
          "fp32 tp=3 vs fp32 tp=1": metrics.kl_divergence(ref32, tp32)}
for name, k in curves.items():
    ax.plot(k.clamp(min=1e-14).numpy(), label=name, lw=1)
ax.set_yscale("log")
ax.set_xlabel(f"position ({len(seqs)} sequences of {len(seqs[0])} tokens, concatenated)")
ax.set_ylabel("KL per position (nats)\n(1e-14 = floor)")
ax.legend(fontsize=7)
fig

# %% [markdown]
# Three bf16 curves of the same height: changing the reduction order moves a bf16 model
# about as much as going from tp = 1 to tp = 3, or from float32 to bfloat16 in the first
# place. The fp32 curve sits orders of magnitude lower. Fixed order, fixed bits; a
# different order, different bits; an order that changes from call to call, different
# bits **from run to run**: vllm #2742's symptom. That thread shows the symptom and the
# workaround (`--disable-custom-all-reduce`), not the mechanism; the plausible ones are a
# switch between one- and two-stage kernels or NCCL algorithms with the message size
# (which follows the batch), or a bug, not an arrival order.
#
# ## 5. The layout bug: contiguous `gate_up` shards (vllm #3775)
#
# Now the bug itself, planted through the emulation's `shard_merged_column_fn` argument:
# `shard_contiguous` cuts the fused `[gate; up]` weight into three contiguous pieces. In
# float32, where section 3 showed the correct layout is exact to the last bits:

# %%
with emulate_tensor_parallel(f32, TP, shard_merged_column_fn=shard_contiguous):
    bad32 = logits(f32)
    question = tok.encode("The capital of France is")
    bad_text = tok.decode(generate(f32, [question], SamplingParams(temperature=0, max_tokens=12,
                                                                   ignore_eos=True))[0])
good_text = tok.decode(generate(f32, [question], SamplingParams(temperature=0, max_tokens=12,
                                                                ignore_eos=True))[0])
kl_bad = metrics.mean_kl(ref32, bad32)
top1_bad = metrics.top1_agreement(ref32, bad32)
print(f"contiguous gate_up shards, float32 tp=3: mean KL {kl_bad:.3g} nats, top-1 "
      f"agreement {100 * top1_bad:.1f}% (merged layout: KL {kl32:.2e})")
print(f"'The capital of France is' ->\n  tp=1:           {good_text!r}\n  contiguous bug: "
      f"{bad_text!r}")

# %% [markdown]
# That is the difference between a precision effect and a bug: the reduction order moved
# KL by a few 1e-3 nats in bf16 (sections 3-4) and left float32 exact to rounding; the
# wrong layout moves it by tens of nats in **float32**, where no rounding argument can
# explain it. A check of tp > 1 against tp = 1 **in float32** separates the two at once.
#
# ## 6. Real processes: `tensor_parallel_size=3` over gloo
#
# The same model, now as three ranks in three processes: this one (rank 0: it schedules,
# runs its shard and samples) and two worker processes (fresh interpreters, which do not
# import this notebook). Before each forward, rank 0 sends the step's inputs to the
# workers over a socket; inside the forward the ranks meet in
# 2 all-reduces per layer plus one for the embedding, and an all-gather for the logits
# (`minivllm/parallel/multiproc_executor.py`, `tensor_parallel.py`). On a 2-core machine,
# three processes share two cores: each worker gets `max(1, cores // 3)` = 1 thread, and
# every collective waits for the slowest rank, so expect it to be slower than tp = 1, not
# faster (this notebook times only the tp = 3 run). The point here is the numbers, not
# the speed.

# %%
from minivllm.precision.faults import tp_gate_up_contiguous  # noqa: E402

t_start = time.perf_counter()
real = LLM(MODEL, dtype="float32", tensor_parallel_size=TP, **kw)
t_start = time.perf_counter() - t_start
rank0 = real.llm_engine.model_runner.model.layers[0].self_attn
print(f"tensor_parallel_size={TP}: started in {t_start:.1f} s; {len(real.llm_engine.model_executor.procs)} "
      f"worker processes alive: {[p.is_alive() for p in real.llm_engine.model_executor.procs]}")
print(f"rank 0 holds {rank0.num_heads} query heads, {rank0.num_kv_heads} KV head; its KV cache "
      f"per layer: {list(real.llm_engine.model_runner.kv_caches[0].key.shape)} "
      "[slots, KV heads, head_dim]")
t_real = time.perf_counter()
real32 = logits(real)
t_real = time.perf_counter() - t_real
g32 = generate(f32)
g_real = generate(real)
kl_real = metrics.mean_kl(ref32, real32)
diff_real = (ref32 - real32).abs().max().item()
diff_real_emu = (tp32 - real32).abs().max().item()
same_greedy = g_real == g32
with tp_gate_up_contiguous(real):
    bad_real = logits(real)
kl_bad_real = metrics.mean_kl(ref32, bad_real)
real.llm_engine.shutdown()
say(f"float32, real tp=3 vs tp=1: mean KL {kl_real:.2e} nats, max |logit diff| "
    f"{diff_real:.2e}, greedy tokens equal: {same_greedy}",
    f"float32，真实 tp=3 与 tp=1：平均 KL {kl_real:.2e} nats，最大 |logit diff| "
    f"{diff_real:.2e}，贪心 token 相等：{same_greedy}")
say(f"real tp=3 vs the emulation (rank order): max |logit diff| {diff_real_emu:.2e}, "
    f"bit-identical: {torch.equal(real32, tp32)}",
    f"真实 tp=3 与模拟（rank 顺序）：最大 |logit diff| {diff_real_emu:.2e}，"
    f"逐位相同：{torch.equal(real32, tp32)}")
print(f"real tp=3 with contiguous gate_up shards: mean KL {kl_bad_real:.3g} nats")
print(f"scoring {len(seqs)} x {len(seqs[0])} tokens took {t_real:.2f} s over 3 processes")

# %% [markdown]
# The real run lands where the emulation said it would: float32 rounding away from
# tp = 1 (compare section 3's emulated numbers), and the same greedy tokens. Whether it is
# bit-identical to the emulation depends on the order in which gloo adds three partial
# sums, which is gloo's choice, not ours (printed above). The planted layout bug, now
# applied on every rank through `LLM.collective_rpc`, gives garbage again: the float32
# parity check against tp = 1 separates the two cases in real processes just as it did
# in the emulation. Try `minivllm generate --tensor-parallel-size 3 --prompt "..."` in a
# terminal.
#
# ## 7. Claim vs measurement

# %%
claims_table([
    (Bi("SmolLM2 admits tensor_parallel_size 1 or 3 only",
        "SmolLM2 只允许 tensor_parallel_size 为 1 或 3"),
     Bi(f"vLLM's checks allow {allowed}; "
        f"at tp=3 each rank has 3 query heads, 1 KV head, 512 MLP units",
        f"vLLM 的检查允许 {allowed}；"
        f"tp=3 时每个 rank 有 3 个 query 头、1 个 KV 头、512 个 MLP 单元")),
    (Bi("fp32: KL at noise level", "fp32：KL 处于噪声水平"),
     Bi(f"tp=3 vs tp=1: mean KL {kl32:.1e} nats, max |logit diff| "
        f"{diff32:.1e}, top-1 {100 * top1_32:.0f}% of {len(ref32)} positions",
        f"tp=3 与 tp=1：平均 KL {kl32:.1e} nats，最大 |logit diff| "
        f"{diff32:.1e}，{len(ref32)} 个位置上 top-1 {100 * top1_32:.0f}%")),
    (Bi("bf16: larger, greedy divergence possible (course plan estimate)",
        "bf16：更大，可能出现贪心分歧（课程计划的估计）"),
     Bi(f"tp=3 vs tp=1: "
        f"mean KL {kl16:.1e} "
        f"nats (bf16 vs fp32 at tp=1: {kl16_vs32:.1e}), max |logit diff| {diff16:.2g}, top-1 "
        f"{100 * top1_16:.1f}%, greedy first divergence {div16}",
        f"tp=3 与 tp=1："
        f"平均 KL {kl16:.1e} "
        f"nats（tp=1 时 bf16 与 fp32：{kl16_vs32:.1e}），最大 |logit diff| {diff16:.2g}，top-1 "
        f"{100 * top1_16:.1f}%，贪心首次分歧位置 {div16}")),
    (Bi("run-to-run variation appears only when the reduction order varies",
        "只有当归约顺序变化时，才会出现运行之间的差异"),
     Bi(f"fixed order run "
        f"twice: bit-identical {torch.equal(tp16, tp16_again)}; arrival order run twice: bits "
        f"differ {runs_differ}",
        f"固定顺序运行"
        f"两次：逐位相同 {torch.equal(tp16, tp16_again)}；到达顺序运行两次：位"
        f"不同 {runs_differ}")),
    (Bi("the reduction order itself matters in bf16", "在 bf16 中，归约顺序本身就有影响"),
     Bi(f"ring-like vs rank order: "
        f"{100 * (by_order['ring-like'] != tp16).float().mean().item():.0f}% of logits differ, "
        f"KL {metrics.mean_kl(tp16, by_order['ring-like']):.1e}; greedy first divergence "
        f"{div_ring}",
        f"类 ring 与 rank 顺序："
        f"{100 * (by_order['ring-like'] != tp16).float().mean().item():.0f}% 的 logits 不同，"
        f"KL {metrics.mean_kl(tp16, by_order['ring-like']):.1e}；贪心首次分歧位置 "
        f"{div_ring}")),
    (Bi("contiguous gate_up shards give garbage (KL >> 1)",
        "连续切分的 gate_up 分片给出乱码（KL >> 1）"),
     Bi(f"float32 tp=3: mean KL "
        f"{kl_bad:.3g} nats, top-1 {100 * top1_bad:.1f}%",
        f"float32 tp=3：平均 KL "
        f"{kl_bad:.3g} nats，top-1 {100 * top1_bad:.1f}%")),
    (Bi("real processes reproduce the emulated numbers", "真实进程复现了模拟的数值"),
     Bi(f"gloo tp=3 vs tp=1 float32: mean KL "
        f"{kl_real:.1e}, max |logit diff| {diff_real:.1e}, greedy equal {same_greedy}; contiguous "
        f"gate_up: KL {kl_bad_real:.3g}",
        f"gloo tp=3 与 tp=1，float32：平均 KL "
        f"{kl_real:.1e}，最大 |logit diff| {diff_real:.1e}，贪心输出相等 {same_greedy}；连续切分的 "
        f"gate_up：KL {kl_bad_real:.3g}")),
    (Bi("vllm #2891: TP=1 vs TP=4 greedy outputs differ, probably reduction order",
        "vllm #2891：TP=1 与 TP=4 的贪心输出不同，可能是归约顺序所致"),
     Bi("consistent with section 3 (bf16 tp=3 vs tp=1 above); not reproduced on MPT",
        "与第 3 节一致（上面 bf16 tp=3 与 tp=1 的比较）；没有在 MPT 上复现")),
], header=(Bi("claim", "论断"), Bi("what we measured here", "本次实测")))

# %% [markdown]
# ## Common misconceptions
#
# - *"Tensor parallelism is exact; only the speed changes."* Column-parallel layers and
#   gathers are exact; every row-parallel layer changes the sum. In float32 that is the
#   last bits; in bf16, each rank's partial sum is rounded before the all-reduce, a
#   change of the same order as bf16 itself.
# - *"Different outputs at tp = 1 and tp = 4 mean a bug."* Not by themselves (vllm #2891).
#   Compare in float32: a reduction-order effect shrinks to ~1e-11 nats (section 3), a
#   layout bug does not.
# - *"Greedy decoding is deterministic, so runs must agree."* Only if every reduction
#   happens in the same order every time. A collective whose algorithm (and so order)
#   depends on the message size, and so on the batch, breaks that (vllm #2742's symptom).
# - *"Sharding a fused weight is just `chunk(tp)`."* Only for a single matrix. A fused
#   weight (`gate_up`, QKV) must be cut per component (vllm #3775 / PR #3869).
# - *"With 3 KV heads and tp = 6 some rank has no KV head."* Each KV head is replicated
#   on tp / H_kv ranks (section 2).
#
# ## What this chapter does not show
#
# GPUs: NCCL's orders and accumulation precisions inside the collective, a per-rank GEMM
# of a third of the width picking another kernel than the full GEMM, and the time of 60
# all-reduces per step against the GEMMs they split (the speed side of tensor
# parallelism). The real run of section 6 is CPU processes over gloo; the GPU table
# comes from two H200s when that machine is available.
#
# ## Lab
#
# `labs/source/ch25/` starts from the contiguous-shard engine. You write `shard_qkv`
# (each rank's query heads and its KV head, replicated when there are fewer KV heads
# than ranks), `shard_merged_column` (a fused weight cut per component) and
# `all_reduce_fixed_order` (partials that arrive in any order, added in rank order). The
# grader checks the shards on fresh shapes, then plugs all three into the emulated tp = 3
# engine on fresh text: KL against tp = 1 within float32's noise floor and the same bits
# whatever the arrival order, while the contiguous layout fails the same check.
#
# ## On real vLLM
#
# - `--tensor-parallel-size` must split the attention heads evenly; the all-reduce after
#   `o_proj` and `down_proj` is vLLM's custom all-reduce where it applies, NCCL
#   otherwise; `--disable-custom-all-reduce` forces NCCL (the workaround in vllm #2742).
# - NCCL chooses its algorithm and protocol from the message size, among other things
#   (an NCCL maintainer in NVIDIA/nccl #754), and the size follows the batch.
#   `NCCL_ALGO` (e.g. `Ring`) and `NCCL_PROTO` (e.g. `Simple`) pin them: an A/B for a
#   suspected reduction-order effect, not a production setting.
# - `VLLM_BATCH_INVARIANT=1` under tensor parallelism keeps the custom all-reduce with a
#   fixed order (the one-stage kernel, large inputs in fixed-size chunks) and turns off
#   the FlashInfer, AITER and QuickReduce all-reduces and sequence parallelism. Its docs
#   warn that all-reduces whose size is not a multiple of 16 bytes can still switch
#   between NCCL and the custom kernel with the batch size.
# - Checked against vLLM's batch invariance docs, `ParallelConfig`
#   (`disable_custom_all_reduce`) and NCCL's environment-variable docs (2025-2026). This
#   engine reduces over gloo on CPU (section 6) and emulates every order in one process
#   (sections 3-5); it has no custom all-reduce.

# %%
print(f"chapter 25 ran in {time.perf_counter() - T0:.0f} s")
