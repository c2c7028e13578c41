"""Tensor-parallel workers start without the caller's ``__main__``, and a worker's death
is an error in the caller, never a hang (minivllm/parallel/multiproc_executor.py).

Workers used to be ``multiprocessing`` "spawn" children, which re-run the parent's main
module: ``python - <<EOF`` made every worker die on ``FileNotFoundError: '<stdin>'`` and
rank 0 waited in the rendezvous forever; a script without an ``if __name__ ==
"__main__"`` guard did the same. Here the same small script runs from stdin, from
``python -c``, as an unguarded script file and in a notebook kernel, each within 120 s
and with tp = 1's greedy tokens; a worker killed with SIGKILL while loading or in the
middle of a generation, or raising, gives a RuntimeError naming it within seconds, and
no worker process is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minivllm import LLM, SamplingParams
from minivllm.parallel.multiproc_executor import MultiprocExecutor, WorkerSpec

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 5, 9, 20, 33, 7], [3, 4, 5], [10, 11, 12, 13, 14, 15, 16, 17, 18, 2, 40]]
WORKER_MARK = "worker_main()"  # in every worker's command line
RUN_LIMIT_S = 120
ERROR_LIMIT_S = 5.0  # a worker's death -> the caller's RuntimeError

# the caller's script: no __main__ guard, as one types it; argv[1] the model folder,
# argv[2] tensor_parallel_size; prints its greedy tokens as JSON
SCRIPT = f"""
import json, sys
from minivllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=int(sys.argv[2]),
          num_gpu_blocks_override=64, max_model_len=128)
outs = llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}],
                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def _greedy(llm) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _workers_of(pid: int) -> list:
    """Worker processes started by process ``pid`` still around (alive or not reaped),
    found by command line, so orphans re-parented elsewhere count too."""
    psutil = pytest.importorskip("psutil")
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(WORKER_MARK in c for c in cmd) and cmd[-1:] == [str(pid)]:
            found.append(p)
    return found


def _run_caller(how: str, model_dir: Path, tp: int, tmp_path: Path) -> tuple[list, float]:
    """Run SCRIPT as ``python -`` (stdin), ``python -c`` or a script file; returns (its
    tokens, seconds). Fails (killing its whole process group) past RUN_LIMIT_S."""
    py = sys.executable
    args = {"stdin": [py, "-"], "-c": [py, "-c", SCRIPT]}.get(how)
    if args is None:
        (tmp_path / "caller.py").write_text(SCRIPT)
        args = [py, str(tmp_path / "caller.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(args + [str(model_dir), str(tp)], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(SCRIPT if how == "stdin" else "", timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"`python {how}` with tensor_parallel_size={tp} still running after "
                    f"{RUN_LIMIT_S} s (the hang of issue 39):\n{out[-3000:]}")
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, out[-3000:]
    assert not _workers_of(proc.pid), "worker processes outlived their caller"
    line = [x for x in out.splitlines() if x.startswith("TOKENS ")]
    assert line, out[-3000:]
    return json.loads(line[-1][len("TOKENS "):]), seconds


@pytest.fixture(scope="module")
def tiny_tp1_tokens(tiny_model_dir):
    return _greedy(LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64,
                       max_model_len=128))


@pytest.mark.parametrize("how", ["stdin", "-c", "script"])
def test_tp2_caller_from_stdin_c_or_unguarded_script(how, tiny_model_dir, tiny_tp1_tokens,
                                                     tmp_path):
    tokens, seconds = _run_caller(how, tiny_model_dir, 2, tmp_path)
    print(f"python {how}, tensor_parallel_size=2: {seconds:.1f} s")
    assert tokens == tiny_tp1_tokens


@pytest.mark.embedded
def test_embedded_tp3_from_stdin_matches_tp1(embedded_model_dir, tmp_path):
    # the case: SmolLM2 at tensor_parallel_size=3 from `python - <<EOF`
    tokens, seconds = _run_caller("stdin", embedded_model_dir, 3, tmp_path)
    ref = _greedy(LLM(str(embedded_model_dir), dtype="float32", num_gpu_blocks_override=64,
                      max_model_len=128))
    print(f"python - (stdin), embedded model, tensor_parallel_size=3: {seconds:.1f} s, "
          f"tokens equal tp=1: {tokens == ref}")
    assert tokens == ref


def test_tp2_in_a_notebook_kernel(tiny_model_dir, tiny_tp1_tokens):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(SCRIPT.replace("sys.argv[1]", repr(str(tiny_model_dir)))
                                          .replace("int(sys.argv[2])", "2")),
                # a function of the notebook's __main__ cannot reach the workers: refused
                # before anything is sent, and the engine keeps running
                nbformat.v4.new_code_cell(
                    "def f(model):\n    return 1\n"
                    "try:\n    llm.llm_engine.collective_rpc(f)\n"
                    "except ValueError as e:\n    print('REFUSED', e)\n"
                    "print('AGAIN', json.dumps(llm.generate([{'prompt_token_ids': [3, 4, 5]}], "
                    "SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), "
                    "use_tqdm=False)[0].outputs[0].token_ids))\n"
                    "pids = [w.pid for w in llm.llm_engine.model_executor.procs]\n"
                    "llm.llm_engine.shutdown()\nprint('PIDS', json.dumps(pids))")]
    t0 = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=RUN_LIMIT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    print(f"notebook kernel, tensor_parallel_size=2: {time.perf_counter() - t0:.1f} s")
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    lines = {x.split(" ", 1)[0]: x.split(" ", 1)[1] for x in text.splitlines() if " " in x}
    assert json.loads(lines["TOKENS"]) == tiny_tp1_tokens
    assert "__main__" in lines["REFUSED"]
    assert json.loads(lines["AGAIN"]) == tiny_tp1_tokens[1]
    psutil = pytest.importorskip("psutil")
    assert not [p for p in json.loads(lines["PIDS"]) if psutil.pid_exists(p)]


# --- a worker's death -------------------------------------------------------------------

def _tiny_tp2(model_dir):
    return LLM(str(model_dir), dtype="float32", tensor_parallel_size=2,
               num_gpu_blocks_override=64, max_model_len=128)


def _no_workers_left():
    assert not _workers_of(os.getpid()), "worker processes left behind"
    assert not dist.is_initialized(), "the process group was not freed"


def test_worker_killed_mid_generation_raises_within_seconds(tiny_model_dir, tiny_tp1_tokens):
    llm = _tiny_tp2(tiny_model_dir)
    try:
        worker = llm.llm_engine.model_executor.procs[0]
        assert _workers_of(os.getpid()) and worker.is_alive()
        # SIGKILL the worker inside rank 0's 5th forward (the 4th decode step), between
        # two of its all-reduces, while the worker runs the same forward
        calls, killed_at = [0], []

        def kill_worker(module, inputs):
            calls[0] += 1
            if calls[0] == 5:
                os.kill(worker.pid, signal.SIGKILL)
                killed_at.append(time.perf_counter())

        hook = llm.llm_engine.model_runner.model.layers[1].register_forward_pre_hook(
            kill_worker)
        with pytest.raises(RuntimeError) as err:
            _greedy(llm)
        seconds = time.perf_counter() - killed_at[0]
        hook.remove()
        msg = str(err.value)
        print(f"SIGKILL mid-generation -> RuntimeError after {seconds:.2f} s: {msg}")
        assert f"tensor-parallel worker 1 (pid {worker.pid})" in msg
        assert "exit code -9, SIGKILL" in msg
        assert seconds < ERROR_LIMIT_S
        _no_workers_left()
        # the engine stays dead and says why
        with pytest.raises(RuntimeError, match="worker 1 .* died"):
            _greedy(llm)
    finally:
        llm.llm_engine.shutdown()
    _no_workers_left()


def test_worker_killed_while_idle_is_reported_at_the_next_call(tiny_model_dir):
    llm = _tiny_tp2(tiny_model_dir)
    try:
        worker = llm.llm_engine.model_executor.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        time.sleep(0.5)  # the monitor stops the group meanwhile
        with pytest.raises(RuntimeError, match=r"worker 1 \(pid \d+\) died \(exit code -9"):
            _greedy(llm)
    finally:
        llm.llm_engine.shutdown()
    _no_workers_left()


def test_worker_killed_while_loading_fails_the_start(tiny_model_dir):
    psutil = pytest.importorskip("psutil")
    me, killed_at, stop = psutil.Process(), [], threading.Event()

    def kill_first_worker():  # once a worker has run for 1 s (importing, loading)
        while not stop.is_set():
            for p in me.children():
                if any(WORKER_MARK in c for c in p.cmdline()) \
                        and time.time() - p.create_time() > 1.0:
                    killed_at.append(time.perf_counter())
                    p.kill()
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_first_worker, daemon=True)
    killer.start()
    try:
        with pytest.raises(RuntimeError) as err:
            _tiny_tp2(tiny_model_dir)
    finally:
        stop.set()
        killer.join()
    seconds = time.perf_counter() - killed_at[0]
    msg = str(err.value)
    print(f"SIGKILL while loading -> RuntimeError after {seconds:.2f} s: {msg}")
    assert msg.startswith("Engine core initialization failed: tensor-parallel worker 1")
    assert "SIGKILL" in msg and seconds < ERROR_LIMIT_S
    _no_workers_left()


@pytest.mark.parametrize("tp, victim", [(2, 1), (4, 3)])
def test_worker_killed_while_joining_the_group_fails_the_start(tiny_model_dir, monkeypatch,
                                                               tiny_tp1_tokens, tp, victim):
    # every worker has loaded; the victim is killed as rank 0 goes to join the gloo group
    # (rank 1 hosts the rendezvous store; rank 3 does not). Then a new engine starts: the
    # failed join must not leave this process rendezvousing under another group name
    loaded, killed_at = MultiprocExecutor._wait_loaded, []

    def loaded_then_kill(self):
        store = loaded(self)
        killed_at.append(time.perf_counter())
        self.procs[victim - 1].kill()
        return store

    monkeypatch.setattr(MultiprocExecutor, "_wait_loaded", loaded_then_kill)
    with pytest.raises(RuntimeError) as err:
        LLM(str(tiny_model_dir), dtype="float32", tensor_parallel_size=tp,
            num_gpu_blocks_override=64, max_model_len=128)
    seconds = time.perf_counter() - killed_at[0]
    msg = str(err.value)
    print(f"tp={tp}, worker {victim} killed at the join -> RuntimeError after "
          f"{seconds:.2f} s: {msg}")
    assert msg.startswith(f"Engine core initialization failed: tensor-parallel worker {victim} ")
    assert "SIGKILL" in msg and seconds < ERROR_LIMIT_S
    _no_workers_left()
    monkeypatch.undo()
    llm = _tiny_tp2(tiny_model_dir)
    try:
        assert _greedy(llm) == tiny_tp1_tokens
    finally:
        llm.llm_engine.shutdown()
    _no_workers_left()


def test_worker_exception_while_loading_fails_the_start_with_its_traceback(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64,
              max_model_len=128)
    engine = llm.llm_engine
    spec = WorkerSpec(load_args=(tiny_model_dir / "no-such-folder", engine.vllm_config.hf_config,
                                 torch.float32, 128,
                                 "cpu", engine.attention_backend),
                      load_kwargs={}, model_config=engine.model_config,
                      cache_config=engine.cache_config, device="cpu", seed=0,
                      batch_invariant=False, logprobs_mode="raw_logprobs")
    with pytest.raises(RuntimeError, match=r"(?s)initialization failed: tensor-parallel worker "
                       r"1 .*exit code 1.*Traceback"):
        MultiprocExecutor(engine.model_runner.model, spec, 2)
    _no_workers_left()


def raise_on_workers(model) -> None:
    """collective_rpc target: the workers raise, then rank 0 waits in an all-reduce."""
    if dist.get_rank() > 0:
        raise ValueError("boom on a worker")
    dist.all_reduce(torch.zeros(1))


def test_worker_exception_mid_step_reaches_the_caller(tiny_model_dir):
    llm = _tiny_tp2(tiny_model_dir)
    try:
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"(?s)worker 1 .*exit code 1.*boom on a worker"):
            llm.llm_engine.collective_rpc(raise_on_workers)
        assert time.perf_counter() - t0 < ERROR_LIMIT_S
    finally:
        llm.llm_engine.shutdown()
    _no_workers_left()
