"""Shared fixtures: tiny random Llama models (float64, seeded) and Hydra-composed run configs."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from del_bench.config import CONFIG_DIR
from del_bench.models.loading import build_tiny_random

# Tiny models are all per-op overhead: a second thread only adds synchronisation (10× slower here).
torch.set_num_threads(1)

TINY = dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
            init_std=0.1, late_residual_scale=0.3, seed=0)

# Devices the lossless tests run on: the CPU always, CUDA where one is present — skipped otherwise, with a reason that
# `pytest -rs` (addopts) prints, so a CPU-only run says what it did not check.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: the lossless tests ran on CPU only"))]


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: runs only where a CUDA device is (marked at collection: conftest)")


def pytest_collection_modifyitems(items):
    """Mark `cuda` every test that runs only where a CUDA device is — skipped without one, the reason saying so
    (DEVICES' "cuda" half, and the tests like it) — so a GPU node runs them alone (`pytest -m cuda`, make gpu-check),
    not the CPU tests whose names merely mention CUDA (the CUDA-graph runner replayed on the CPU)."""
    for item in items:
        if any(m.name == "skipif" and "CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers()):
            item.add_marker(pytest.mark.cuda)


# A hung test (a lock nobody will release, a child that never answers) must end the run, red, with where it hung —
# not run CI into its time limit with nothing printed, as a leftover build lock once did (models/fused.build_lock).
# pytest's faulthandler_timeout (pyproject.toml) prints the stacks first; this ends the process a little after (under
# make test's xdist, the worker's: xdist reports the test failed with its worker and runs the rest on a new one).
@pytest.fixture(autouse=True)
def _a_hung_test_ends_the_run(request):
    timer = threading.Timer(float(request.config.getini("faulthandler_timeout")) + 15, os._exit, (70,))
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


def tiny_model(dtype=torch.float64, **overrides):
    """float64 where exactness matters; bfloat16/float16 for the half-precision rule (tests/test_half_precision.py)."""
    model, tokenizer = build_tiny_random(OmegaConf.create({**TINY, **overrides}), dtype)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def tiny():
    return tiny_model()


def compose_run(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="run", overrides=list(overrides), return_hydra_config=False)


@pytest.fixture
def run_cfg(tmp_path):
    """Compose a run on the tiny model into a temporary out_dir."""

    def make(*overrides: str):
        # products pinned (not auto, timed): runs compared bit for bit must share one layout
        return compose_run("model=tiny-random", "task=humaneval", "limit=3", "max_new_tokens=16",
                           "warmup_tokens=0", "threads=1", "products=wt_x", f"out_dir={tmp_path / 'run'}", *overrides)

    return make


# ---- the report's golden mini-records (tests/data/report_golden), shared by the table and figure tests ----
@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    from tests.data.report_golden.records import write_records

    return write_records(tmp_path_factory.mktemp("golden"))


@pytest.fixture(scope="module")
def df(runs_dir):
    from del_bench.report.collect import load_runs

    return load_runs([runs_dir])
