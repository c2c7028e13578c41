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
# # Chapter 24. CUDA graphs and padded batches: eager vs graph
#
# **Learning goals.** After this chapter you can
#
# 1. say what a CUDA graph records and what it does not: the kernels and the buffers
#    they read, not the Python that launched them; so inputs live in **static buffers
#    written in place**, a batch is **padded** up to a captured size, and a hook or a
#    patch added after capture is **not** run by a replay unless the runner checks, and a
#    kernel launched on a stream the capture does not record (vllm #2147) is not replayed
#    at all: the replay reads whatever its output memory holds;
# 2. pad a decode batch the way vLLM does (capture sizes 1, 2, 4, 8, 16, ...; padding
#    rows with slot -1 and sequence length 0) and check that padding rows change nothing
#    and produce no NaN;
# 3. tell the two classes of graph-versus-eager differences apart: **correctness** (a
#    stale capture, a buffer not written in place, a kernel outside the capture: wrong
#    results, while eager is right) and **numerics** (a kernel whose bits depend on the
#    padded shape: last-bit differences);
# 4. find which op makes a row depend on the batch size, by comparing every layer's output
#    row alone and in a padded batch (hooks on an eager forward at each shape), and check
#    the finding against the kernel alone.
#
# **The incidents.**
#
# - **vllm #2147** "GPTQ models don't support CUDA graph" (2023-12-17):
#   Mixtral-8x7B-GPTQ in float16 failed in the sampler with "probability tensor contains
#   inf/nan" under CUDA graphs, and was fine with `--enforce-eager`. A contributor found
#   the cause (issue comment of 2024-01-01): the exllama kernels were launched without a
#   stream argument, so on CUDA's default stream instead of the stream being captured,
#   and the graph did not contain them. PR #2154 (2023-12-17) forced eager mode for GPTQ
#   models; PR #2318 (2024-01-02) launched the kernels on the current stream and turned
#   graphs back on.
# - **vllm #5569 / bitsandbytes #1308** (2024-08): `dequantize_4bit` gave different
#   weights under graph capture, so the output was nonsense; vLLM forced eager for
#   bitsandbytes (PR #6846) until bitsandbytes shipped a fix.
# - **The seed course (000 §2.2.2)** compares a served model with and without
#   `--enforce-eager` as a standard check.
# - **This project's own incident** (`benchmarks/RESULTS.md`, commit `b4220d8`): on the
#   H200, a forward hook registered on the model after the graphs were captured ran for
#   **1 of 6 steps** (the prefill, which runs eagerly) and a planted fault left the graph
#   steps' log-probs unchanged. The fix: `CUDAGraphRunner.can_run` runs a step eagerly
#   while any forward hook is registered, and `suspended()` (which `LLM.swap_step` and the
#   planted faults enter) does the same for other patches.
#
# CPU has no CUDA graphs. This chapter runs an **emulation** (`emulate_cuda_graphs=True`,
# an engine option that is **not vLLM's**; `minivllm/worker/cuda_graph.py`,
# `EmulatedCUDAGraphRunner`): the same capture sizes, static buffers and padding as the
# CUDA runner, and a replay that re-executes the ATen ops recorded at capture and nothing
# else, so Python changes made after capture are not seen, as on a GPU; ops run inside
# `on_default_stream()` during capture are executed but not recorded, as a kernel on
# another stream is left out of a CUDA graph (section 4). It gives no
# speed-up; the speed numbers below are the H200's, measured elsewhere (section 1 says by
# which command). Everything else is measured when the notebook runs, on the embedded
# SmolLM2-135M-Instruct in float32 with minivllm on this machine's CPU.

# %%
# %matplotlib inline
import contextlib
import math
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

import minivllm.layers.linear as linear_mod
from minivllm import LLM, SamplingParams
from minivllm.i18n import Bi, claims_table, say
from minivllm.attention.backends.torch_ref import decode_attention_ref
from minivllm.precision import faults
from minivllm.worker.cuda_graph import (EmulatedCUDAGraphRunner, capture_sizes,
                                        on_default_stream)

torch.manual_seed(0)
T0 = time.perf_counter()
MODEL = "smollm2-135m-instruct"
MAX_LEN = 128   # keys are padded to max_model_len inside a graph: keep it small on a CPU
kw = dict(dtype="float32", max_model_len=MAX_LEN, max_num_seqs=4, num_gpu_blocks_override=40)
graph_llm = LLM(MODEL, **kw, emulate_cuda_graphs=True)
eager_llm = LLM(MODEL, **kw)  # what enforce_eager=True runs on a GPU
runner = graph_llm.llm_engine.model_runner
graphs = runner.cuda_graphs
model = runner.model
tok = graph_llm.get_tokenizer()


def join(*parts):
    """One text from Bi parts and plain strings, in both languages."""
    return Bi("".join(getattr(p, "en", p) for p in parts),
              "".join(getattr(p, "zh", p) for p in parts))


print(f"captured sizes {graphs.sizes} in {time.perf_counter() - T0:.1f} s "
      f"(engine build included); ops recorded per graph: "
      f"{ {bs: len(g._ops) for bs, (g, _) in graphs.graphs.items()} }")

# %% [markdown]
# ## 1. Why graphs: the H200's numbers
#
# A decode step of a small batch launches hundreds of small kernels (458 in the batch-1
# graph of the Llama-3-8B-shaped benchmark model), and launching them from Python can
# take longer than running them. A graph replays all of them with one call. Measured on
# one NVIDIA H200 by `python benchmarks/gpu_suite.py` (2026-12-01, `benchmarks/RESULTS.md`,
# section "GPU suite on an H200", table (b): random bf16 weights, 128-token prompts, 128
# new tokens; "eager" is the same engine with its graphs off, what `enforce_eager=True`
# runs):
#
# | batch | graphs step (ms) | eager step (ms) | graphs / eager tokens/s |
# |---|---|---|---|
# | 1 | 4.93 | 21.5 | 4.26x |
# | 16 | 5.22 | 16.6 | 3.05x |
# | 64 | 5.92 | 19.5 | 2.82x |
# | 256 | 11.1 | 18.7 | 1.44x |
#
# The gain shrinks as the batch grows: the GPU's work grows, the launch cost does not.
# On a CPU, where each op takes longer than its launch, there is nothing to gain, which
# is why vLLM's CPU backend runs eagerly.
#
# And numerically, on the same GPU: `python benchmarks/graph_vs_eager.py` (H200,
# 2026-12-02, `benchmarks/RESULTS.md` "CUDA graphs against eager, numerically";
# SmolLM2-135M's shapes with **random** weights, because the device has no copy of the
# embedded model; 16 prompts x 32 greedy tokens) found graph and eager log-probs
# **identical bit for bit**, in bfloat16 and float32, for batches of 16 (no padding), of 5
# (the size-8 graph, 3 padding rows), and for 5 prompts alone (M = 1) against padded
# (M = 8): the kernels did not change with M there. Batch-1 cost, prefill included:
# 1.73 ms per token with graphs against 20.46 eagerly (bfloat16), 1.96 against 19.81
# (float32). Whether cuBLAS keeps its kernel for every M, model and GPU is not promised;
# section 6 shows on this CPU a library that does not.

# %% [markdown]
# ## 2. Capture sizes and padded rows
#
# A graph has fixed shapes, so the runner captures one per batch size in
# `capture_sizes` (vLLM's: 1, 2, 4, then multiples of 8) and runs a batch of B in the
# smallest captured size >= B, padded. Each step writes its inputs **into** the static
# buffers the graph reads (token ids, positions, slot mapping, sequence lengths, block
# tables). A padding row gets token 0 at position 0, **slot -1** (its K/V is written
# nowhere that a sequence reads) and **sequence length 0** (it attends to nothing).
#
# This is the whole-batch decode graph of vLLM's V0 engine, which this engine emulates.
# vLLM V1 pads the number of scheduled **tokens** of a step (not of sequences) up to a
# captured size, and its `cudagraph_mode` decides what the graph holds: `PIECEWISE`
# captures the pieces between attention calls and runs attention outside the graph,
# `FULL` captures attention too, `FULL_AND_PIECEWISE` (the default in
# `vllm/config/compilation.py`, late 2025) uses full graphs for pure decode steps and
# piecewise ones for mixed prefill/decode steps, `FULL_DECODE_ONLY` full graphs for
# decode steps and none for mixed ones, `NONE` no graphs. The numerical question this
# chapter asks (do the real rows get the same bits in a padded shape?) is the same in
# both; which kernels see the padded shape differs.

# %%
print("capture_sizes(256):", capture_sizes(256))
for b in (1, 3, 5, 9, 17, 250):
    print(f"  a batch of {b:3d} runs in the size-{min(s for s in capture_sizes(256) if s >= b)} "
          f"graph")

text = ("The history of the printing press begins in the fifteenth century, when "
        "Johannes Gutenberg combined movable metal type with an oil-based ink and a "
        "screw press adapted from wine making.")
seq = tok.encode(text)
N_POS = 8
starts = [0, 4, 8]  # three sequences, shifted windows of the same text
seqs = [seq[s:s + N_POS] for s in starts]
bsz = runner.block_size
tables = {str(i): [1 + i] for i in range(len(seqs))}  # one block each (8 tokens < 16)


def step_reqs(idx, p):
    """Decode requests for sequences idx at position p (the token there is the input)."""
    return [SimpleNamespace(request_id=str(i), num_computed_tokens=p, all_token_ids=seqs[i])
            for i in idx]


with torch.inference_mode():
    used = graphs._fill_inputs(step_reqs(range(3), 4), tables)
print(f"\na batch of 3 at position 4 fills the size-{used} graph's buffers:")
print("  input_ids   ", graphs.input_ids[:used].tolist())
print("  positions   ", graphs.positions[:used].tolist())
print("  slot_mapping", graphs.slot_mapping[:used].tolist())
print("  seq_lens    ", graphs.seq_lens[:used].tolist())
print("  block_tables", graphs.block_tables[:used, :2].tolist(), "(first 2 columns)")

# %% [markdown]
# On a GPU the store kernel skips slot -1. The CPU store (`cache[slots] = values`) has no
# skip: -1 is Python's last index. The emulation gives every layer's cache one spare slot
# at the end, which -1 indexes and no block covers (`EmulatedCUDAGraphRunner`'s
# docstring). Without it, a padding row would overwrite the last slot of the last block,
# someone's K/V, whenever that block is in use.
#
# ## 3. A replay is bound at capture: the incident, reproduced
#
# The runner's `can_run` sends a step to a graph only when it is a pure decode step that
# fits, no forward hook is registered, and the runner is not `suspended()`.
# `faults.stale_cuda_graph_capture` plants the runner as it was before commit `b4220d8`:
# those two checks gone. We register a hook on layer 0 (as a probe, a debugger or a
# logging tool would, after the engine is built) and generate 6 tokens: 1 prefill step,
# then 5 decode steps.

# %%
greedy6 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
prompt = "Explain in one sentence what a compiler does."
hook_counts = {}
for stale in (True, False):
    calls = []
    handle = model.layers[0].register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        if stale:
            with faults.stale_cuda_graph_capture(graph_llm):
                graph_llm.generate([prompt], greedy6, use_tqdm=False)
        else:
            graph_llm.generate([prompt], greedy6, use_tqdm=False)
    finally:
        handle.remove()
    hook_counts[stale] = len(calls)
say(f"hook registered after capture, 6 steps: ran {hook_counts[True]} times with the "
    f"stale runner, {hook_counts[False]} times with can_run's hook check",
    f"捕获之后注册的钩子，6 步：使用过期的运行器时运行了 {hook_counts[True]} 次，"
    f"使用 can_run 的钩子检查时运行了 {hook_counts[False]} 次")

# %% [markdown]
# Same with a planted fault: `faults.wrong_rope_theta` swaps layer 1's rotary embedding
# for one with theta = 100 (a wrong config value; chapter 11). The fault patches Python,
# so a replay cannot see it. We generate 6 tokens for 3 prompts with the fault planted in
# both engines, and compare each decode step's chosen-token log-prob with the eager
# engine's under the same fault.

# %%
greedy_lp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
prompts = ["The capital of France is", "Water boils at a temperature of",
           "A haiku about autumn leaves:"]


def run(llm, ps=prompts, sp=greedy_lp):
    return [o.outputs[0] for o in llm.generate(ps, sp, use_tqdm=False)]


def chosen_logprobs(outs):
    return [[step[t].logprob for t, step in zip(o.token_ids, o.logprobs)] for o in outs]


def max_diff(a, b, first=0):
    """Max |difference| of chosen-token log-probs over steps >= first, where the two runs
    chose the same tokens so far (after a divergence the contexts differ)."""
    d = 0.0
    for x, y in zip(a, b):
        for i, (tx, ty, lx, ly) in enumerate(zip(x.token_ids, y.token_ids,
                                                 chosen_logprobs([x])[0], chosen_logprobs([y])[0])):
            if tx != ty:
                break
            if i >= first:
                d = max(d, abs(lx - ly))
    return d


clean = run(eager_llm)
with faults.wrong_rope_theta(graph_llm, 1, 100.0), faults.wrong_rope_theta(eager_llm, 1, 100.0):
    faulty_eager = run(eager_llm)
    faulty_graph_fixed = run(graph_llm)
    with faults.stale_cuda_graph_capture(graph_llm):
        faulty_graph_stale = run(graph_llm)
fault_size = max_diff(faulty_eager, clean, first=1)
fixed_vs_eager = max_diff(faulty_graph_fixed, faulty_eager)
stale_vs_eager = max_diff(faulty_graph_stale, faulty_eager, first=1)
stale_tokens_eq = sum(x.token_ids == y.token_ids for x, y in zip(faulty_graph_stale, faulty_eager))
say(f"the fault itself (eager, decode steps): moves a chosen log-prob by up to {fault_size:.3g}",
    f"故障本身（eager，decode 步骤）：使所选 token 的对数概率最多移动 {fault_size:.3g}")
say(f"graph engine with can_run/suspended(): max |diff| vs eager under the fault "
    f"{fixed_vs_eager:.3g} (bit for bit: {fixed_vs_eager == 0.0})",
    f"带 can_run/suspended() 的图引擎：在故障下与 eager 的最大 |diff| 为 "
    f"{fixed_vs_eager:.3g}（逐位相等：{fixed_vs_eager == 0.0}）")
say(f"stale runner: max |diff| on decode steps {stale_vs_eager:.3g}; "
    f"greedy tokens equal for {stale_tokens_eq}/{len(prompts)} prompts",
    f"过期的运行器：decode 步骤上的最大 |diff| 为 {stale_vs_eager:.3g}；"
    f"{stale_tokens_eq}/{len(prompts)} 个提示词的贪心 token 相等")

# %% [markdown]
# With the stale runner the prefill runs eagerly, with the fault, and every decode step
# replays the clean capture over the faulty prefill's K/V: a mixture that is neither
# engine. Nothing fails loudly. That is the shape of vllm #2147 and #5569 too: what the
# graph ran was not what the eager code path would have run (a kernel on the wrong
# stream, a dequantization captured in a different state), and only the eager comparison
# showed it. Section 4 reproduces the first of those mechanisms.
#
# ## 4. A kernel outside the capture: vllm #2147, reproduced
#
# A CUDA graph records the kernels launched on the stream being captured. The exllama
# GPTQ kernels of vllm #2147 were launched on CUDA's default stream: during capture they
# ran once (on the capture's dummy inputs) and were left out of the graph, so every
# replay read their output memory without anything having written it for this step.
#
# The emulation expresses this with `on_default_stream()`: ops run inside it during a
# capture are executed and not recorded, and a replay reads the tensors they wrote as
# they are at that moment. `DefaultStreamLinear` below is such a kernel: it wraps layer 0's
# `down_proj` and writes its result into a workspace of its own, allocated when the layer
# is built (outside the graph's static buffers), like a kernel that keeps a scratch
# buffer. In an eager step it computes exactly what the wrapped layer computes. We swap it
# into the graph engine's model, capture the graphs again (the engine's own graphs were
# captured without it), and generate 6 greedy tokens for the 3 prompts of section 3
# (`ignore_eos`, log-probs kept). Then the two fixes: the same kernel launched on the
# capturing stream (what PR #2318 did), and the broken capture with every step run eagerly
# (`suspended()`, what PR #2154's forced eager mode did for GPTQ models). The workspace's
# version counter counts the writes into it, replays included.

# %%
T4 = time.perf_counter()


class DefaultStreamLinear(torch.nn.Module):
    """`inner`'s result written into `self.workspace` [rows, out_features] (allocated
    here, once) and returned as a view of it. `default_stream=True`: the write is launched
    on a stream the capture does not record (`on_default_stream()`); False: on the
    capturing stream. Either way an eager step gets the same bits as `inner(x)`."""

    def __init__(self, inner, rows, default_stream):
        super().__init__()
        self.inner, self.default_stream = inner, default_stream
        self.workspace = torch.zeros(rows, inner.weight.shape[0])

    def forward(self, x):
        n = x.shape[0]
        with on_default_stream() if self.default_stream else contextlib.nullcontext():
            self.workspace[:n].copy_(self.inner(x))
        return self.workspace[:n]


graph_clean = run(graph_llm)  # the engine's own graphs, for comparison
down0 = model.layers[0].mlp.down_proj
ds_out, ds_writes = {}, {}
for variant in ("default stream", "capturing stream"):
    layer = DefaultStreamLinear(down0, 256, variant == "default stream")  # 256 > any step
    model.layers[0].mlp.down_proj = layer
    try:
        with torch.inference_mode():
            recaptured = EmulatedCUDAGraphRunner(model, 4, MAX_LEN, bsz, torch.device("cpu"))
        runner.cuda_graphs = recaptured
        v0 = layer.workspace._version
        ds_out[variant] = run(graph_llm)
        ds_writes[variant] = layer.workspace._version - v0
        if variant == "default stream":  # the fix of PR #2154: no graphs for this model
            v0 = layer.workspace._version
            with recaptured.suspended():
                ds_out["forced eager"] = run(graph_llm)
            ds_writes["forced eager"] = layer.workspace._version - v0
    finally:
        runner.cuda_graphs = graphs
        model.layers[0].mlp.down_proj = down0
del recaptured
broken = ds_out["default stream"]
ds_tokens_eq = sum(x.token_ids == y.token_ids for x, y in zip(broken, clean))
ds_first = max_diff(broken, clean, first=1)
ds_fixed_eq = (max_diff(ds_out["capturing stream"], graph_clean) == 0.0 and all(
    x.token_ids == y.token_ids for x, y in zip(ds_out["capturing stream"], graph_clean)))
ds_eager_eq = (max_diff(ds_out["forced eager"], clean) == 0.0 and all(
    x.token_ids == y.token_ids for x, y in zip(ds_out["forced eager"], clean)))
ds_finite = all(math.isfinite(step[t].logprob) for o in broken
                for t, step in zip(o.token_ids, o.logprobs))
n_steps = ds_writes["forced eager"]  # eager: one write per step
print(f"{prompts[0]!r} -> eager: {clean[0].text!r}; graphs with the default-stream "
      f"kernel: {broken[0].text!r}")
say(f"default stream: greedy tokens equal to eager for {ds_tokens_eq}/{len(prompts)} "
    f"prompts; the first decode step's chosen log-prob moves by up to {ds_first:.3g}; "
    f"chosen log-probs finite: {ds_finite}",
    f"默认流：{ds_tokens_eq}/{len(prompts)} 个提示词的贪心 token 与 eager 相等；"
    f"第一个 decode 步骤所选 token 的对数概率最多移动 {ds_first:.3g}；"
    f"所选 token 的对数概率为有限值：{ds_finite}")
say(f"workspace written in {ds_writes['default stream']} of the {n_steps} steps with the "
    f"default-stream kernel, {ds_writes['capturing stream']} of {n_steps} with it on the "
    f"capturing stream, {n_steps} of {n_steps} eagerly",
    f"工作区的写入：kernel 在默认流上时，{n_steps} 步中有 {ds_writes['default stream']} 步；"
    f"在正在捕获的流上时，{n_steps} 步中有 {ds_writes['capturing stream']} 步；"
    f"eager 时，{n_steps} 步中有 {n_steps} 步")
say(f"fix 1, kernel on the capturing stream (PR #2318): equal to the engine's own graphs "
    f"bit for bit: {ds_fixed_eq}",
    f"修复 1，kernel 在正在捕获的流上（PR #2318）：与引擎自己的图逐位相等：{ds_fixed_eq}")
say(f"fix 2, graphs off for this model (PR #2154): equal to the eager engine bit for bit: "
    f"{ds_eager_eq}",
    f"修复 2，对该模型关闭图（PR #2154）：与 eager 引擎逐位相等：{ds_eager_eq}")
print(f"section 4 took {time.perf_counter() - T4:.1f} s")

# %% [markdown]
# What the counts say: a step that runs eagerly (here the prefill, and every step with
# graphs off) writes the workspace; a replay of the broken capture does not, because the
# write was never recorded. Each decode step's replay therefore read, as layer 0's MLP
# output, the first rows of whatever the last eager step left in the workspace: rows
# the prefill computed for other tokens. No error was raised: the run finished, with the
# tokens and log-probs printed above. On a GPU the memory that an uncaptured kernel
# wrote can be handed by the graph's memory pool to other tensors, so a replay reads
# whatever was last put there; in vllm #2147 (float16) the sampler's `torch.multinomial`
# then found inf/nan in the probabilities. The emulation keeps the workspace alive, so
# it shows the stale-row form of the same fault (`on_default_stream`'s docstring), and
# the same two fixes: record the kernel (launch it on the capturing stream, so each
# replay writes the buffer the next op reads) or run the model eagerly.

# %% [markdown]
# ## 5. Padded rows and real rows
#
# We teacher-force 3 sequences of 8 tokens through the graphs one decode step at a time
# (each step writes the position's K/V, then attends to it). Two checks per step: the
# padding rows' logits are finite, and the real rows of a replay equal an eager forward
# at the same padded shape (the runner's `_forward`, run without the capture) bit for
# bit.

# %%
def teacher_force(r, idx, check=False):
    """Logits [len(idx), N_POS, vocab] of sequences idx, one graph replay per position."""
    out, finite_pad, same = [], True, True
    with torch.inference_mode():
        for p in range(N_POS):
            logits, _ = r.run(step_reqs(idx, p), tables)
            out.append(logits.clone())
            bs = r.sizes[next(i for i, s in enumerate(r.sizes) if s >= len(idx))]
            full = r.graphs[bs][1][0]
            finite_pad &= bool(torch.isfinite(full).all())
            if check:
                eager_rows, _ = r._forward(bs)  # same buffers, run eagerly
                same &= torch.equal(eager_rows[:len(idx)], logits)
    return torch.stack(out, 1), finite_pad, same


batch3, pad_finite, replay_eq = teacher_force(graphs, range(3), check=True)
say(f"batch of 3 in the size-4 graph, {N_POS} steps: padding rows finite {pad_finite}; "
    f"real rows == eager at the padded shape (torch.equal) {replay_eq}",
    f"大小为 3 的批次在大小为 4 的图中，{N_POS} 步：填充行为有限值 {pad_finite}；"
    f"真实行 == 填充形状下的 eager（torch.equal）{replay_eq}")

q = torch.randn(2, 9, 64)
kv_nan = torch.randn(2, 16, 3, 64)
kv_nan[1] = float("nan")  # a padding row's keys may be anything: stale data, NaN
lens = torch.tensor([16, 0])
raw = F.scaled_dot_product_attention(
    q.unsqueeze(2), kv_nan.transpose(1, 2), kv_nan.transpose(1, 2),
    attn_mask=(torch.arange(16)[None] < lens[:, None])[:, None, None, :], enable_gqa=True)
guarded = decode_attention_ref(q, kv_nan, kv_nan, lens, 64 ** -0.5)
say(f"a padding row (length 0) whose keys hold NaN: SDPA alone gives NaN "
    f"{bool(raw[1].isnan().any())}; decode_attention_ref (with the fully-masked-row "
    f"guard, chapter 9) gives {guarded[1].abs().max().item()}",
    f"一个 key 中含 NaN 的填充行（长度 0）：单独的 SDPA 给出 NaN "
    f"{bool(raw[1].isnan().any())}；decode_attention_ref（带全掩码行保护，第 9 章）"
    f"给出 {guarded[1].abs().max().item()}")

# %% [markdown]
# The guard matters because of the capture: the emulated step was captured on padding
# rows only, so `decode_attention_ref`'s host check ("no row has length 0: skip the
# guard") was decided once, at capture, and the guard runs on every replay. A real CUDA
# graph cannot branch on a host value at all; the GPU path always runs the guard.
#
# ## 6. Does padding change the real rows' numbers?
#
# Padding changes the row count M of every matmul. A GEMM library may pick another
# kernel, tile or summation order for another M, so a real row can come out with other
# bits ("cuBLAS may pick a different kernel for M=8 than for M=5",
# `worker/cuda_graph.py`; chapter 5, section 4, shows how a CPU GEMM's blocking follows
# the instruction set and M). We start from the result a user sees: the same 3 sequences
# replayed one at a time (size-1 graph, M = 1) against all 3 together (size-4 graph,
# M = 4, 1 padding row), with the engine's default oneDNN-packed float32 weights.

# %%
T6 = time.perf_counter()
alone = torch.cat([teacher_force(graphs, [i])[0] for i in range(3)])
packed_diff = (alone - batch3).abs().max().item()
say(f"packed float32: alone vs in a padded batch of 3 (size 4): max |dlogit| {packed_diff:.3g} "
    f"(bit for bit: {torch.equal(alone, batch3)})",
    f"打包的 float32：单独计算与在 3 个序列的填充批次（大小 4）中计算：最大 |dlogit| {packed_diff:.3g}"
    f"（逐位相等：{torch.equal(alone, batch3)}）")

# %% [markdown]
# Which op makes a row depend on the batch? A replay's rows equal an eager forward at the
# same padded shape bit for bit (section 5), so we can look inside with hooks on an eager
# forward (the runner's `_forward`, the ops the graph replays): sequence 0 at its last
# position, alone (M = 1) and in the padded batch (M = 4), and every intermediate row in
# the order the model computes it: embedding, RMSNorm, `qkv_proj`, attention (rotary, K/V
# store, SDPA: the input of `o_proj`), `o_proj`, residual add, RMSNorm, `gate_up_proj`,
# SiLU(gate) * up (the input of `down_proj`), `down_proj`, and so on through 30 layers,
# the final norm and the LM head. Both forwards read the same cached keys for the earlier
# positions. The first row that differs was made by an op whose inputs were all still
# bit-identical: that op is the source.

# %%
def row0_trace(idx):
    """[(label, row 0)] of every intermediate of one eager forward of sequences idx at
    their last position, at the padded shape of their graph, in execution order."""
    trace = []

    def keep(label, pre):
        def pre_hook(mod, args):
            trace.append((label, args[0][0].clone()))

        def post_hook(mod, args, out):
            trace.append((label, out[0].clone()))
        return pre_hook if pre else post_hook

    spots = [(model.embed_tokens, "embedding", False)]
    for i, lay in enumerate(model.layers):
        if i:
            spots.append((lay.input_layernorm, f"layers.{i - 1} residual add (MLP)", True))
        spots += [(lay.input_layernorm, f"layers.{i}.input_layernorm", False),
                  (lay.self_attn.qkv_proj, f"layers.{i}.self_attn.qkv_proj", False),
                  (lay.self_attn.o_proj, f"layers.{i} attention (rotary, SDPA)", True),
                  (lay.self_attn.o_proj, f"layers.{i}.self_attn.o_proj", False),
                  (lay.post_attention_layernorm, f"layers.{i} residual add (attention)", True),
                  (lay.post_attention_layernorm, f"layers.{i}.post_attention_layernorm", False),
                  (lay.mlp.gate_up_proj, f"layers.{i}.mlp.gate_up_proj", False),
                  (lay.mlp.down_proj, f"layers.{i} SiLU(gate) * up", True),
                  (lay.mlp.down_proj, f"layers.{i}.mlp.down_proj", False)]
    spots += [(model.norm, f"layers.{len(model.layers) - 1} residual add (MLP)", True),
              (model.norm, "norm", False)]
    handles = [m.register_forward_pre_hook(keep(lab, True)) if pre
               else m.register_forward_hook(keep(lab, False)) for m, lab, pre in spots]
    try:
        with torch.inference_mode():
            bs = graphs._fill_inputs(step_reqs(idx, N_POS - 1), tables)
            logits, _ = graphs._forward(bs)
    finally:
        for h in handles:
            h.remove()
    return trace + [("LM head", logits[0].clone())]


tr_alone, tr_batch = row0_trace([0]), row0_trace(range(3))
assert [lab for lab, _ in tr_alone] == [lab for lab, _ in tr_batch]
first_diff = next(((k, lab, (a - b).abs().max().item())
                   for k, ((lab, a), (_, b)) in enumerate(zip(tr_alone, tr_batch))
                   if not torch.equal(a, b)), None)
if first_diff is None:
    say(f"all {len(tr_alone)} intermediate rows of sequence 0 are bit-identical alone "
        f"and in the padded batch",
        f"序列 0 的全部 {len(tr_alone)} 个中间行在单独计算和填充批次中逐位相同")
else:
    k, lab, d = first_diff
    say(f"{k} of {len(tr_alone)} intermediate rows bit-identical alone and in the padded "
        f"batch ({', '.join(lab for lab, _ in tr_alone[:k])}); the first that differs: "
        f"{lab} (max |d| {d:.2g}); the LM head's row then differs by "
        f"{(tr_alone[-1][1] - tr_batch[-1][1]).abs().max().item():.2g}",
        f"{len(tr_alone)} 个中间行中有 {k} 个在单独计算和填充批次中逐位相同"
        f"（{', '.join(lab for lab, _ in tr_alone[:k])}）；第一个出现差异的是："
        f"{lab}（最大 |d| {d:.2g}）；随后 LM head 的行相差 "
        f"{(tr_alone[-1][1] - tr_batch[-1][1]).abs().max().item():.2g}")

# %% [markdown]
# Then the kernel alone, with the engine's packed weights: row 0 of `x[:M] @ W.T` for
# each linear of layer 0 and the LM head, on random inputs, at M = 2, 4, 8 against M = 1.
# And an engine-level check of the same thing: if only M = 1 is special, a single
# sequence replayed in the size-2 graph (one padding row, M = 2) gets the bits it gets in
# the size-4 graph. The runner's `sizes` decides which graph a batch pads to; we leave out
# size 1 for this run.

# %%
engine_linears = {"qkv_proj": model.layers[0].self_attn.qkv_proj.weight,
                  "o_proj": model.layers[0].self_attn.o_proj.weight,
                  "gate_up_proj": model.layers[0].mlp.gate_up_proj.weight,
                  "down_proj": model.layers[0].mlp.down_proj.weight,
                  "LM head": model.embed_tokens.weight}  # tied embedding


def packed_row0(xs, w):
    """Row 0 of the engine's float32 linear (`float_linear`: oneDNN-packed weight, the
    engine's own packed copy, kept on the weight)."""
    return linear_mod.packed_cpu_linear(xs.contiguous(), w, None, w)[0]


lin_m1, lin_m2 = {}, {}  # name -> [row 0 at M = 2, 4, 8 bit-identical to M = 1], [4, 8 to M = 2]
with torch.inference_mode():
    for name, w in engine_linears.items():
        xs = torch.randn(8, w.shape[1])
        rows = {m: packed_row0(xs[:m], w) for m in (1, 2, 4, 8)}
        lin_m1[name] = [torch.equal(rows[m], rows[1]) for m in (2, 4, 8)]
        lin_m2[name] = [torch.equal(rows[m], rows[2]) for m in (4, 8)]
        say(f"{name:12s} ({w.shape[1]:4d} -> {w.shape[0]:5d}): row 0 at M = 2, 4, 8 "
            f"bit-identical to M = 1: {lin_m1[name]}; at M = 4, 8 to M = 2: {lin_m2[name]}",
            f"{name:12s} ({w.shape[1]:4d} -> {w.shape[0]:5d})：M = 2, 4, 8 时的第 0 行"
            f"与 M = 1 逐位相同：{lin_m1[name]}；M = 4, 8 时与 M = 2：{lin_m2[name]}")

graphs.sizes = [2, 4]  # no size-1 graph: a single sequence runs padded to 2 rows
try:
    alone_m2 = torch.cat([teacher_force(graphs, [i])[0] for i in range(3)])
finally:
    graphs.sizes = capture_sizes(4)
m2_eq = torch.equal(alone_m2, batch3)
say(f"each sequence alone in the size-2 graph (M = 2) vs in the padded batch (M = 4): "
    f"max |dlogit| {(alone_m2 - batch3).abs().max().item():.3g} (bit for bit: {m2_eq})",
    f"每个序列单独在大小为 2 的图中（M = 2）与在填充批次中（M = 4）相比："
    f"最大 |dlogit| {(alone_m2 - batch3).abs().max().item():.3g}（逐位相等：{m2_eq}）")
print(f"section 6 so far: {time.perf_counter() - T6:.1f} s")

# %%
_m1_special = [n for n, same in lin_m1.items() if not all(same)]
if torch.equal(alone, batch3):
    say("Verdict: on this CPU the padded batch left every real row's bits unchanged; "
        "no op needed isolating.",
        "结论：在这块 CPU 上，填充批次没有改变任何真实行的位；不需要定位任何算子。")
else:
    say(join(
        Bi("Verdict: on this CPU the rows of a sequence alone (M = 1) and in the padded batch "
           f"differ, starting at {first_diff[1] if first_diff else 'no hooked row'}; the "
           "packed linears whose row 0 changes between M = 1 and M > 1: "
           f"{_m1_special or 'none'}; a single sequence padded to M = 2 matches the batch ",
           "结论：在这块 CPU 上，一个序列单独计算（M = 1）与在填充批次中计算的行"
           f"不同，差异从 {first_diff[1] if first_diff else '没有挂钩子的行'} 开始；"
           "第 0 行在 M = 1 与 M > 1 之间变化的打包线性层："
           f"{_m1_special or '无'}；单个序列填充到 M = 2 时与批次"),
        Bi("bit for bit, so M = 1 alone is special here.",
           "逐位相等，所以这里只有 M = 1 是特殊的。") if m2_eq else
        Bi("only approximately, so M > 1 is not one path either.",
           "只是近似相等，所以 M > 1 也不是同一条路径。")))

# %% [markdown]
# How to read this. oneDNN picks the kernel of a packed float32 linear from the
# instruction set it finds and from the shape (chapter 5, section 4). If the first row
# that differs in the trace is a linear's output, every row before it (its input
# included) kept its bits, so that linear is where the batch size enters, and every layer
# after it carries the difference on to the logits. If the kernel sweep then shows that
# linear's row 0 changing only between M = 1 and M > 1, and a single sequence padded to
# 2 rows matches the padded batch bit for bit, a single row evidently takes its own path
# through that kernel (its dot products come out with other rounding, so they are summed
# in another order over the K inputs) and every M > 1 shares one. The verdict above says which of these this CPU showed; under AVX2 kernels
# (`make course-isa`) the packed linears may keep their bits at every M, and then alone
# and padded are bit-identical and the trace finds no differing row.
#
# Then the same comparison with MKL: a second set of graphs captured on the same model
# after setting `PACK_CPU_WEIGHTS = False` (plain MKL `F.linear`). Note that the switch
# only affects graphs captured *after* it: the first runner's graphs recorded the packed
# calls and keep replaying them. The sweep below is over more M for one layer,
# `gate_up_proj` (576 -> 3072), and `down_proj` packed, for comparison, and `gate_up_proj`
# in bfloat16 (`F.linear`); each against M = 1.

# %%
W = model.layers[0].mlp.gate_up_proj.weight
Wd = model.layers[0].mlp.down_proj.weight
x = torch.randn(64, W.shape[1])
xd = torch.randn(64, Wd.shape[1])
Ms = [1, 2, 3, 4, 5, 8, 16, 33, 64]
row0 = {
    "float32, oneDNN packed, gate_up_proj (default)": lambda m: packed_row0(x[:m], W),
    "float32, oneDNN packed, down_proj (default)": lambda m: packed_row0(xd[:m], Wd),
    "float32, MKL F.linear, gate_up_proj (no packing)": lambda m: F.linear(x[:m].contiguous(), W)[0],
    "bfloat16 F.linear, gate_up_proj": lambda m: F.linear(x[:m].bfloat16(), W.bfloat16())[0].float(),
}
m_dep = {}
with torch.inference_mode():
    for name, f in row0.items():
        ref = f(1)
        m_dep[name] = [(f(m) - ref).abs().max().item() for m in Ms]
        print(f"{name:49s} max |row0(M) - row0(1)|: "
              + " ".join(f"{d:.1e}" if d else "0" for d in m_dep[name]))

fig = Figure(figsize=(7.5, 2.8), layout="constrained")
ax = fig.add_subplot()
for name, ds in m_dep.items():
    ax.plot(Ms, [max(d, 1e-9) for d in ds], marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("rows M in the matmul")
ax.set_ylabel("max |row 0 - row 0 at M=1|\n(1e-9 = bit-identical)")
ax.legend(fontsize=7)
fig

# %%
linear_mod.PACK_CPU_WEIGHTS = False
try:
    mkl_graphs = EmulatedCUDAGraphRunner(model, 4, MAX_LEN, bsz, torch.device("cpu"))
    mkl_batch = teacher_force(mkl_graphs, range(3))[0]
    mkl_alone = torch.cat([teacher_force(mkl_graphs, [i])[0] for i in range(3)])
    stale_switch = teacher_force(graphs, range(3))[0]  # the packed capture, after the switch
finally:
    linear_mod.PACK_CPU_WEIGHTS = True
mkl_diff = (mkl_alone - mkl_batch).abs().max().item()
mkl_top1 = (mkl_alone.argmax(-1) == mkl_batch.argmax(-1)).float().mean().item()
say(f"MKL float32:    alone vs in a padded batch of 3 (size 4): max |dlogit| {mkl_diff:.3g}, "
    f"top-1 agreement {100 * mkl_top1:.0f}% of {mkl_batch.shape[0] * N_POS} positions",
    f"MKL float32：单独计算与在 3 个序列的填充批次（大小 4）中计算：最大 |dlogit| {mkl_diff:.3g}，"
    f"{mkl_batch.shape[0] * N_POS} 个位置上的 top-1 一致率 {100 * mkl_top1:.0f}%")
say(f"first graphs replayed after PACK_CPU_WEIGHTS=False: unchanged "
    f"{torch.equal(stale_switch, batch3)} (they replay the packed ops they recorded)",
    f"设置 PACK_CPU_WEIGHTS=False 之后重放第一组图：结果不变 "
    f"{torch.equal(stale_switch, batch3)}（它们重放的是自己录制的打包算子）")
del mkl_graphs

# %% [markdown]
# Finally, graph against eager as a user would compare them: the whole engine, with and
# without `emulate_cuda_graphs`, 3 prompts, 6 greedy tokens. Here a second shape changes:
# inside a graph the keys are padded to `max_model_len` (the kernel's grid is recorded
# for it), in an eager step to the longest sequence of the step, and float32 SDPA on a
# CPU can give other bits for another padded key length (the second line below measures
# it on random tensors).

# %%
graph_out = graph_clean  # the engine's graphs, run in section 4
e2e = max_diff(graph_out, clean, first=1)
e2e_tokens = sum(x.token_ids == y.token_ids for x, y in zip(graph_out, clean))
qa = torch.randn(4, 9, 64)
ka, va = torch.randn(4, MAX_LEN, 3, 64), torch.randn(4, MAX_LEN, 3, 64)
la = torch.tensor([20, 33, 7, 41])
short = decode_attention_ref(qa, ka[:, :41].contiguous(), va[:, :41].contiguous(), la, 0.125)
longk = decode_attention_ref(qa, ka, va, la, 0.125)
sdpa_l = (short - longk).abs().max().item()
say(f"engine, graph vs eager: greedy tokens equal for {e2e_tokens}/{len(prompts)} prompts; "
    f"decode-step chosen log-probs differ by up to {e2e:.3g}",
    f"引擎，图与 eager：{e2e_tokens}/{len(prompts)} 个提示词的贪心 token 相等；"
    f"decode 步骤所选 token 的对数概率最多相差 {e2e:.3g}")
print(f"float32 SDPA, keys padded to 41 vs {MAX_LEN} (same real keys): max |d out| {sdpa_l:.3g}")

# %% [markdown]
# ## 7. The fix, measured
#
# | failure | fix | measured here |
# |---|---|---|
# | a hook or a patch added after capture is not run by a replay | `can_run` runs the step eagerly while a forward hook is registered; `suspended()` around any other patch (`LLM.swap_step`, the planted faults) | section 3 prints in how many of the 6 steps the hook ran, and whether the graph engine under the fault equals eager bit for bit |
# | a padding row writes or reads someone's K/V, or gives NaN | slot -1 written nowhere a sequence reads; length 0 attends to nothing; the fully-masked-row guard | section 5 prints whether the padding rows are finite and whether the real rows equal eager at the padded shape bit for bit |
# | inputs written into a new tensor instead of the static buffer | write in place (`_fill_inputs`: NumPy views of the buffers, `copy_`) | the lab's `write_static` (a new tensor leaves the replay reading the last step's inputs) |
# | a kernel outside the capture (launched on another stream, vllm #2147): the replay reads a buffer nothing wrote this step | launch it on the capturing stream (PR #2318), or run that model eagerly (PR #2154) | section 4 prints both fixes against the engine's own graphs and the eager engine (bit for bit or not) and how many steps wrote the buffer |
# | last-bit differences from the padded shape | M-invariant kernels (on the GPU the fixed-split decode kernel; on this CPU, section 6 prints which packed float32 linears keep a row's bits at every M, and whether a sequence padded to 2 rows matches the batch); or compare with a tolerance | section 6 |
#
# ## 8. Claim vs measurement

# %%
_mkl = m_dep["float32, MKL F.linear, gate_up_proj (no packing)"]
_ds_reproduced = (ds_tokens_eq < len(prompts) or ds_first > 1e-3) and ds_eager_eq
_lin_inv = [n for n, same in lin_m1.items() if all(same)]
_hook_ok = hook_counts[True] == 1 and hook_counts[False] == 6
_m_first = next((m for m, d in zip(Ms, _mkl) if d), None)
rows = [
    (Bi("a hook registered after capture runs for 1 of 6 steps on the H200 (b4220d8)",
        "在 H200 上，捕获之后注册的钩子只在 6 步中的 1 步运行（b4220d8）"),
     join(Bi("reproduced", "复现") if _hook_ok else Bi("not reproduced", "未复现"),
          Bi(f" with the emulation: {hook_counts[True]} of 6 with the stale runner, "
             f"{hook_counts[False]} of 6 with can_run's check",
             f"（模拟）：使用过期的运行器时 6 步中有 {hook_counts[True]} 步，"
             f"使用 can_run 的检查时 6 步中有 {hook_counts[False]} 步"))),
    (Bi("a planted fault leaves the graph steps' log-probs unchanged",
        "植入的故障不改变图步骤的对数概率"),
     Bi(f"with the stale "
        f"runner the decode steps differ from the faulty eager engine's by up to "
        f"{stale_vs_eager:.3g} (the fault itself moves them by up to {fault_size:.3g}); with "
        f"suspended(): {fixed_vs_eager:.3g}",
        f"使用过期的运行器时，decode 步骤与带故障的 eager 引擎最多相差 "
        f"{stale_vs_eager:.3g}（故障本身最多使它们移动 {fault_size:.3g}）；使用 "
        f"suspended() 时：{fixed_vs_eager:.3g}")),
    (Bi("padded rows (slot -1, length 0) are harmless", "填充行（槽位 -1，长度 0）无害"),
     Bi(f"padding rows finite: {pad_finite}; "
        f"real rows equal an eager forward at the padded shape: {replay_eq}; a length-0 row "
        f"over NaN keys: NaN without the guard ({bool(raw[1].isnan().any())}), max |out| with "
        f"it {guarded[1].abs().max().item():.3g}",
        f"填充行为有限值：{pad_finite}；"
        f"真实行等于填充形状下的 eager 前向计算：{replay_eq}；key 为 NaN 的长度 0 行："
        f"没有保护时为 NaN（{bool(raw[1].isnan().any())}），有保护时最大 |out| 为 "
        f"{guarded[1].abs().max().item():.3g}")),
    (Bi("vllm #2147: a kernel outside the capture gives wrong output with graphs, eager is "
        "fine",
        "vllm #2147：捕获之外的 kernel 在使用图时给出错误输出，eager 正常"),
     join(Bi("reproduced", "复现") if _ds_reproduced else Bi("not reproduced", "未复现"),
          Bi(f" with the emulation (layer 0's down_proj writing its workspace on a stream the "
             f"capture does not record): greedy tokens equal to eager for {ds_tokens_eq}/"
             f"{len(prompts)} prompts, first decode log-prob moved by up to {ds_first:.3g}, "
             f"chosen log-probs finite: {ds_finite}",
             f"（模拟：第 0 层的 down_proj 在捕获不录制的流上写它的工作区）："
             f"{ds_tokens_eq}/{len(prompts)} 个提示词的贪心 token 与 eager 相等，"
             f"第一个 decode 步骤的对数概率最多移动 {ds_first:.3g}，"
             f"所选 token 的对数概率为有限值：{ds_finite}"),
          Bi(" (no NaN here: the emulation reads stale rows, not reused memory)",
             "（这里没有 NaN：模拟读到的是过期的行，而不是被复用的内存）") if ds_finite else "",
          Bi(f"; workspace written in "
             f"{ds_writes['default stream']} of {n_steps} steps; the same engine with graphs "
             f"off equal to eager bit for bit: {ds_eager_eq}",
             f"；工作区在 {n_steps} 步中被写了 "
             f"{ds_writes['default stream']} 步；同一引擎关闭图时与 eager 逐位相等：{ds_eager_eq}"))),
    (Bi("the fixes restore eager's output (PR #2318: launch on the current stream; PR "
        "#2154: enforce eager)",
        "修复恢复了 eager 的输出（PR #2318：在当前流上启动；PR "
        "#2154：强制 eager）"),
     Bi(f"kernel recorded: equal to the engine's own graphs bit for "
        f"bit: {ds_fixed_eq}; graphs off: equal to the eager engine bit for bit: "
        f"{ds_eager_eq}",
        f"kernel 被录制：与引擎自己的图逐位相等：{ds_fixed_eq}；"
        f"关闭图：与 eager 引擎逐位相等：{ds_eager_eq}")),
    (Bi("packed oneDNN fp32 is M-invariant, so padding has no numeric effect by default",
        "打包的 oneDNN fp32 与 M 无关，所以默认情况下填充没有数值影响"),
     join(Bi(f"alone vs padded batch, engine graphs: max |dlogit| {packed_diff:.3g}; ",
             f"单独计算与填充批次，引擎的图：最大 |dlogit| {packed_diff:.3g}；"),
          Bi("confirmed on this CPU: no row changed, and every hooked intermediate row was "
             "bit-identical",
             "在这块 CPU 上得到证实：没有任何行改变，每个挂钩子的中间行都逐位相同")
          if packed_diff == 0 and first_diff is None else
          join(Bi("not on this CPU: ", "在这块 CPU 上不成立："),
               Bi(f"the first intermediate row that differs is {first_diff[1]}",
                  f"第一个出现差异的中间行是 {first_diff[1]}")
               if first_diff else Bi("no hooked row differs", "没有挂钩子的行出现差异"),
               Bi(f"; packed linears whose row 0 changes between M = 1 and M = 2, 4, 8: "
                  f"{_m1_special or 'none'} (M-invariant: {_lin_inv or 'none'}); one sequence "
                  f"padded to M = 2 equals the batch bit for bit: {m2_eq}",
                  f"；第 0 行在 M = 1 与 M = 2, 4, 8 之间变化的打包线性层："
                  f"{_m1_special or '无'}（与 M 无关的：{_lin_inv or '无'}）；单个序列"
                  f"填充到 M = 2 时与批次逐位相等：{m2_eq}")))),
    (Bi("with PACK_CPU_WEIGHTS=False, MKL fp32 F.linear depends on M",
        "设置 PACK_CPU_WEIGHTS=False 时，MKL fp32 F.linear 依赖于 M"),
     Bi(f"row 0 differs from "
        f"M=1 by up to {max(_mkl):.2g} (first M with a difference: "
        f"{_m_first}); "
        f"engine graphs alone vs padded: max |dlogit| {mkl_diff:.3g}, top-1 {100 * mkl_top1:.0f}%",
        f"第 0 行与 "
        f"M=1 最多相差 {max(_mkl):.2g}（第一个出现差异的 M："
        f"{_m_first}）；"
        f"引擎的图单独计算与填充后相比：最大 |dlogit| {mkl_diff:.3g}，top-1 {100 * mkl_top1:.0f}%")),
    (Bi("graph and eager give the same numbers (the enforce-eager check)",
        "图与 eager 给出相同的数值（enforce-eager 检查）"),
     join(Bi("bit for bit", "逐位相等") if e2e == 0 else Bi("not bit for bit", "并非逐位相等"),
          Bi(f" in float32 on this CPU: decode log-probs differ by up to {e2e:.3g} (SDPA's key "
             f"padding: {sdpa_l:.2g} in the attention output), greedy tokens equal for "
             f"{e2e_tokens}/{len(prompts)} prompts; on the GPU the decode kernel is invariant to "
             f"the padded length and a tiny fp32 Llama's greedy tokens matched (RESULTS.md)",
             f"（在这块 CPU 上，float32）：decode 对数概率最多相差 {e2e:.3g}（SDPA 的 key "
             f"填充：注意力输出中相差 {sdpa_l:.2g}），"
             f"{e2e_tokens}/{len(prompts)} 个提示词的贪心 token 相等；在 GPU 上，decode kernel "
             f"与填充长度无关，一个很小的 fp32 Llama 的贪心 token 一致（RESULTS.md）"))),
    (Bi("graphs speed up decoding", "图能加速解码"),
     Bi("on the H200, 4.26x at batch 1 falling to 1.44x at batch "
        "256 (RESULTS.md, 8B shapes); on the CPU, none (a replay runs the same ops)",
        "在 H200 上，批大小 1 时 4.26x，到批大小 256 时降到 1.44x"
        "（RESULTS.md，8B 形状）；在 CPU 上没有加速（重放运行的是同样的算子）")),
    (Bi("on a GPU, padding to a capture size changes the logits' last bits",
        "在 GPU 上，填充到捕获大小会改变 logits 的最后几位"),
     Bi("not measured "
        "so on the H200: SmolLM2 shapes (random weights), bf16 and fp32, graph vs eager and "
        "alone vs padded all bit-identical (RESULTS.md, graph_vs_eager.py)",
        "在 H200 上测得并非如此：SmolLM2 的形状（随机权重），bf16 和 fp32，图与 eager、"
        "单独与填充后，全都逐位相同（RESULTS.md，graph_vs_eager.py）")),
]
claims_table(rows, header=(Bi("claim", "论断"), Bi("what we measured here", "本次实测")))

# %% [markdown]
# ## Common misconceptions
#
# - *"A graph replays my model."* It replays the kernels that one forward pass launched,
#   with the buffer addresses it used. Python is not run: hooks, patched functions,
#   branches on host values and new tensors are all frozen at capture.
# - *"`--enforce-eager` and graphs must agree bit for bit, or there is a bug."* Not
#   necessarily: padding changes shapes, and a shape can change a kernel's summation
#   order (section 6). A bug looks different: a hook that ran once, a fault that did not
#   apply, NaN in the sampler (vllm #2147), nonsense (vllm #5569).
# - *"Padding rows are wasted but harmless."* Only if they are written nowhere (slot -1
#   really skipped: the CPU store needed a spare slot) and attend to nothing without
#   producing NaN.
# - *"If the logits are finite, the capture is fine."* The stale runner raised nothing,
#   and its greedy text need not change (section 3 prints for how many of the 3 prompts
#   it equals the faulty eager engine's): the log-prob comparison with the eager engine
#   under the same change is what shows the fault was missing.
# - *"Whatever my forward pass computes during capture is in the graph."* Only the
#   kernels launched on the stream being captured are. A kernel launched on another
#   stream (vllm #2147's exllama kernels) runs once, at capture, and never again; the ops
#   after it read its output buffer as it happens to be (section 4). Eager mode launches
#   it every step, so the fault shows only with graphs: that asymmetry is the signature
#   of a capture bug.
# - *"A sequence alone and in a padded batch differ because attention sees the padding."*
#   Inside these graphs the padding rows attend to nothing and every row's keys are
#   padded to `max_model_len` in both cases; section 6's trace prints which op the
#   difference starts at on this CPU, and the kernel sweep whether that op depends on M.
#
# ## Lab
#
# `labs/source/ch24/` starts from an emulated graph runner with two faults: inputs
# written into fresh tensors instead of the static buffers, and a runner that replays
# while a hook is registered. You write `pad_batch` (the capture size and the padded
# rows), `write_static` (the step's inputs into the static buffers, in place) and
# `graph_safe` (refuse a replay while a hook or a patch is active). The grader checks
# them on fresh batch sizes, then plugs them into the engine's emulated graphs: the real
# rows' logits must equal eager ones (`torch.equal`) with no NaN, and the stale-buffer
# and replay-skips-patch faults must be caught.
#
# ## On real vLLM
#
# - `--enforce-eager` (`LLM(..., enforce_eager=True)`) turns off both torch.compile and
#   CUDA graphs in V1; `-O.cudagraph_mode=NONE` (`compilation_config={"cudagraph_mode":
#   "NONE"}`) turns off graphs only and `-O.mode=0` compilation only (vLLM's
#   `docs/design/debug_vllm_compile.md`), so a difference can be pinned on the graphs
#   rather than on the compiler.
# - Which graphs are captured: `compilation_config={"cudagraph_mode":
#   "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]}` (an explicit list),
#   or `max_cudagraph_capture_size` (CLI `--max-cudagraph-capture-size`, also
#   `--cudagraph-capture-sizes`; vllm PR #26016, 2025-10, renamed `max_capture_size`):
#   the default list is 1, 2, 4, multiples of 8 below 256, then multiples of 16 up to
#   that maximum, which defaults to min(2 x `max_num_seqs`, 512). V0's
#   `max_seq_len_to_capture` (longer sequences ran eagerly) was removed with V0 (vllm
#   PR #25543, 2025-09).
# - To compare graph and eager on a deployment: two servers of the same model and
#   version, one with `--enforce-eager` (or `-O.cudagraph_mode=NONE`), the same prompts
#   at `temperature=0` with `logprobs`, one at a time and then concurrently (other
#   padded sizes). Last-bit log-prob differences and late greedy divergences are usually
#   numerics (section 6); NaN, a sampler error, or text that breaks at the first decode
#   step only with graphs points to a capture bug of the vllm #2147 kind (section 4).
# - Checked against `vllm/config/compilation.py` (`CUDAGraphMode`, `CompilationConfig`,
#   late 2025, v0.11-v0.12 era), `docs/design/debug_vllm_compile.md`, vllm issue #2147
#   and vllm PRs #2154, #2318, #25543 and #26016.
# - This engine differs: `emulate_cuda_graphs=True` is not a vLLM option but a CPU
#   emulation of V0-style whole-batch decode graphs (padded by sequences, not tokens;
#   no piecewise mode); a replay re-executes the recorded ATen ops from Python, so it
#   is no faster; `on_default_stream()` models a kernel left out of the capture but keeps
#   its buffer alive, so a replay reads stale rows rather than memory reused by other
#   tensors. vLLM's CPU backend does not use graphs.

# %%
print(f"chapter 24 ran in {time.perf_counter() - T0:.0f} s")
