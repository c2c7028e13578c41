"""Shared fixtures: a tiny random Llama folder, and the embedded model (integration)."""

from __future__ import annotations

import minivllm_kernels  # noqa: F401  (before torch/transformers import Triton: interpreter on CPU)
import pytest
import torch

from tests.tiny_model import make_tiny_llama

# --- running in parallel (`make test` runs `pytest -n auto`, pytest-xdist) ----------------
#
# Most of the suite is single-threaded Python (Triton's interpreter, nbgrader, imports),
# so two workers on the 2-core CI machine get through it in about half the time. Work is
# handed out in units (xdist's LoadScopeScheduling, with the units below):
# - one unit per test module, so module-scoped engines are built once;
# - the chapter notebooks and the website in ONE unit, in that order: tests/test_site.py
#   renders the chapters tests/test_course.py has just executed (docs/notebooks.py), and
#   would execute them all again if it ran first on another worker;
# - each lab's grading its own unit (they are the largest items; independent course roots).
# Each worker's torch, and the notebook and grading kernels it starts, use one thread
# per worker: two 2-thread processes on 2 cores oversubscribe them (two chapters run
# side by side took 77 s with 2 threads each, 59 s with 1).
MAX_AUTO_WORKERS = 4  # each worker holds engines and kernels of ~1-4 GB


def _unit(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    if path.endswith(("tests/test_course.py", "tests/test_site.py")):
        return "chapters-then-site"
    if path.endswith("tests/test_grading.py") and name.startswith(
            ("test_lab_fixtures_get_exact_scores", "test_generic_fixtures_get_exact_scores")):
        return nodeid
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class CourseScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return CourseScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    import os

    return max(1, min(os.cpu_count() or 1, MAX_AUTO_WORKERS))


def pytest_configure(config):
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and os.environ.get("PYTEST_XDIST_WORKER"):
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # kernels started from here
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one intra-op thread avoids oversubscribing a shared 2-core box
    (restored after the module)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path to a tiny random Llama HF folder (2 layers, hidden 64, GQA 4/2 heads)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    """transformers' LlamaForCausalLM on the same tiny weights, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def embedded_model_dir():
    """The converted SmolLM2-135M-Instruct folder (fetched and converted on first use)."""
    from minivllm.models.embedded import ensure_embedded_model

    return ensure_embedded_model()
