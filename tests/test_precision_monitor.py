"""The drift monitor (minivllm/precision/monitor.py): Page's CUSUM on per-request mean
sampled-token log-prob and entropy, fed by the engine, exported as minivllm: gauges."""

from __future__ import annotations

import math

import pytest
import torch

from minivllm.precision.monitor import DriftMonitor


def _stream(n, mean, sd, seed, tokens=8):
    g = torch.Generator().manual_seed(seed)
    # per-request means: token values whose mean is N(mean, sd)
    for _ in range(n):
        m = float(torch.randn(1, generator=g)) * sd + mean
        yield [m] * tokens


def test_false_alarms_over_200_benign_requests_are_rare():
    alarms = 0
    for seed in range(100):
        mon = DriftMonitor()
        for lp in _stream(300, -1.5, 0.4, seed):  # 100 warmup + 200 watched
            mon.update(lp, [2.0 + x for x in lp])
        alarms += mon.alarm
    print("runs with a false alarm, of 100 x 200 in-control requests:", alarms)
    assert alarms <= 3  # measured 3 of 300 runs (the docstring's numbers)


@pytest.mark.parametrize("shift_sd", [1.0, 2.0])
def test_a_shift_is_flagged_within_the_cusum_delay(shift_sd):
    delays = []
    for seed in range(10):
        mon = DriftMonitor()
        for lp in _stream(100, -1.5, 0.4, seed):
            assert not mon.update(lp)
        start = mon.requests
        for lp in _stream(100, -1.5 - shift_sd * 0.4, 0.4, 1000 + seed):
            if mon.update(lp):
                break
        assert mon.alarm
        delays.append(mon.alarm_at - start)
    print(f"shift of {shift_sd} sd: requests to the alarm", delays)
    # about h / (shift - k) requests: 24 for 1 sd, 8 for 2 sd (measured at most 55, 14)
    assert max(delays) <= {1.0: 60, 2.0: 16}[shift_sd]


def test_a_reference_baseline_skips_warmup_and_nan_raises_at_once():
    mon = DriftMonitor(reference={"logprob": (-1.5, 0.4)})
    assert not mon.update([-1.5] * 5)
    assert mon.update([-1.0, float("nan"), -1.0, -1.0]) and mon.alarm_at == 2
    mon.reset()
    assert not mon.alarm and mon.baseline() == {"logprob": (-1.5, 0.4)}
    assert not mon.update([-1.5, -1.4])  # fewer than min_tokens: not counted
    assert mon.requests == 2


@pytest.mark.parametrize("kw, match", [
    (dict(warmup=1), "warmup"), (dict(threshold=0), "threshold"),
    (dict(allowance=-1), "allowance"), (dict(min_tokens=0), "min_tokens"),
    (dict(reference={"logprob": (0.0, 0.0)}), "std > 0"),
    (dict(reference={"kl": (0.0, 1.0)}), "reference keys"),
])
def test_bad_parameters_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        DriftMonitor(**kw)


def test_the_engine_feeds_raw_statistics_and_an_alarm_follows_a_hotter_default(tiny_model_dir):
    """The planted regression is lm-evaluation-harness #3154's: the served default
    temperature changes (here 0.7 -> 1.6) and nobody is told."""
    from minivllm import LLM, SamplingParams

    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=128,
              max_model_len=64, seed=3)
    mon = DriftMonitor(warmup=30, min_tokens=4)
    llm.set_precision_monitor(mon)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (6,), generator=g).tolist() for _ in range(120)]
    # what the monitor gets equals the request's own raw log-probs
    probe = llm.generate(prompts[0], SamplingParams(temperature=0.7, max_tokens=6, logprobs=0,
                                                    seed=1))[0].outputs[0]
    want = sum(lp[t].logprob for lp, t in zip(probe.logprobs, probe.token_ids)) / 6
    assert math.isclose(mon.state()["last"]["logprob"], want, abs_tol=1e-5)
    assert mon.state()["last"]["entropy"] > 0
    normal = SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True)
    for i in range(0, 60, 10):
        llm.generate(prompts[1 + i:11 + i], normal)
    assert not mon.alarm, mon.state()
    hot = SamplingParams(temperature=1.6, max_tokens=8, ignore_eos=True)
    base = mon.requests
    for i in range(60, 110, 10):
        llm.generate(prompts[1 + i:11 + i], hot)
        if mon.alarm:
            break
    print("monitor after the hotter default:", mon.state())
    assert mon.alarm and mon.alarm_at - base <= 50
    llm.set_precision_monitor(None)
    assert not llm.llm_engine.model_runner.sampler.track_stats


def test_the_server_exports_the_monitor_as_minivllm_gauges(tiny_model_dir):
    from types import SimpleNamespace

    from minivllm.entrypoints.openai.metrics import ServerMetrics

    metrics = ServerMetrics("m", None)
    mon = DriftMonitor(reference={"logprob": (-1.0, 0.1)})
    mon.update([-3.0] * 5)  # 20 sd below: an alarm
    eng = SimpleNamespace(scheduler=SimpleNamespace(num_running=0, num_waiting=0,
                                                    num_preemptions=0),
                          kv_cache_manager=SimpleNamespace(usage=0.0, prefix_cache_queries=0,
                                                           prefix_cache_hits=0),
                          _stats=SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=0,
                                                 num_corrupted_requests=0),
                          precision_monitor=mon)
    metrics.on_step(SimpleNamespace(engine=eng), SimpleNamespace(outputs=[], finished=[]))
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    assert 'minivllm:precision_monitor_alarm{model_name="m"} 1.0' in text
    assert 'minivllm:precision_monitor_requests{model_name="m"} 1.0' in text
    assert 'minivllm:precision_monitor_sampled_logprob{model_name="m"} -3.0' in text


@pytest.mark.parametrize("options, message", [
    ('{"bogus": 1}', "unexpected keyword argument 'bogus'; options: warmup"),
    ('{"warmup": 1}', "warmup must be an integer >= 2"),
])
def test_serve_refuses_bad_monitor_options_before_building_an_engine(options, message, capsys):
    from minivllm.entrypoints.cli import main

    assert main(["serve", "--precision-monitor", options]) == 2
    assert message in capsys.readouterr().err
