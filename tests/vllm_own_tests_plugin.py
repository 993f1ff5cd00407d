"""A pytest plugin (``-p vllm_own_tests_plugin``) for running vLLM's own
``tests/v1/attention/test_sparse_mla_backends.py`` in a pytest of its own: on the CPU (a release
whose file collects there, started by tests/test_vllm_own_tests.py), or on a GPU with
``MLA_PLANNER_OWN_TESTS_ON=gpu`` (any release, started by tests/gpu/test_gpu_vllm_own_tests.py), where nothing is faked or
skipped and the plugin provides the three fixtures of vLLM's conftest the file uses (vLLM's
conftest needs its whole test tree: ``--noconftest``).

``MLA_PLANNER_OWN_TESTS_LOG``: a file that gets one JSON line per test as it finishes (its id, its
outcome as the JUnit report would give it, the first line of its message), so that a run stopped
midway still tells what it ran; under pytest-xdist the controller writes it.

``MLA_PLANNER_CLASSES=planned`` puts the backend's classes in place of stock's in vLLM's
``flashmla_sparse`` module before vLLM's test module imports them, so every
``FlashMLASparse*`` name the tests use (and stock's own global lookups) is ours; ``stock``
leaves them, as the control that the harness itself passes.

vLLM's file skips itself unless the platform is CUDA and evaluates
``torch.cuda.get_device_capability()`` in its decorators; the tests that need a GPU (Triton
index translation, FlashMLA, FA4) are skipped by name below, so only those checks and the
device type are answered for the CPU, and nothing a CPU test runs is faked except pinned
memory.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

CLASS_NAMES = ("FlashMLASparseBackend", "FlashMLASparseImpl", "FlashMLASparseMetadata", "FlashMLASparseMetadataBuilder")

GPU_ONLY = {
    "test_sparse_backend_decode_correctness": "FlashMLA kernels on a CUDA GPU",
    "test_sparse_backend_prefill_correctness": "FA4 on an SM100 GPU",
    "test_triton_convert_req_index_to_global_index_decode_only": "vLLM's Triton kernel on a CUDA GPU",
    "test_triton_convert_req_index_to_global_index_with_prefill_workspace": "vLLM's Triton kernel on a CUDA GPU",
    "test_triton_convert_rejects_req_id_longer_than_token_indices": "vLLM's Triton kernel on a CUDA GPU",
    "test_triton_convert_returns_valid_counts": "vLLM's Triton kernel on a CUDA GPU",
    "test_flashmla_forward_bf16_kv_slices_req_id_to_mqa_tokens": "vLLM's Triton kernel on a CUDA GPU",
}


ON_GPU = os.environ.get("MLA_PLANNER_OWN_TESTS_ON", "cpu") == "gpu"
OUTCOME_LOG = os.environ.get("MLA_PLANNER_OWN_TESTS_LOG")


def swap_classes() -> None:
    """``MLA_PLANNER_CLASSES=planned``: the backend's classes in place of stock's in vLLM's module."""
    import vllm.v1.attention.backends.mla.flashmla_sparse as stock

    classes = os.environ.get("MLA_PLANNER_CLASSES", "stock")
    if classes == "planned":
        from mla_planner.vllm_backend import backend

        for name in CLASS_NAMES:
            setattr(stock, name, getattr(backend, "Planned" + name))
    elif classes != "stock":
        raise pytest.UsageError(f"MLA_PLANNER_CLASSES={classes!r}: use stock or planned")


def pytest_configure(config: pytest.Config) -> None:
    global OUTCOME_LOG
    if hasattr(config, "workerinput"):  # an xdist worker: its reports reach the controller, which logs them
        OUTCOME_LOG = None
    import vllm.v1.attention.backends.mla.flashmla_sparse  # noqa: F401  (before the CPU answers below)
    from vllm.platforms import current_platform

    if ON_GPU:
        swap_classes()
        return

    # Let the module import; the GPU tests are skipped below, not by their capability checks.
    # Without a GPU vLLM's platform is "unspecified", whose device type is "": the tests'
    # tensors go to the CPU instead.
    current_platform.is_cuda = lambda: True  # type: ignore[method-assign]
    current_platform.device_type = "cpu"
    torch.cuda.get_device_capability = lambda device=None: (0, 0)
    # Stock builds pinned CPU tensors, which need a CUDA driver.
    zeros = torch.zeros
    torch.zeros = lambda *a, pin_memory=False, **k: zeros(*a, **k)

    swap_classes()


def pytest_collection_modifyitems(config: pytest.Config, items: list[Any]) -> None:
    planned = os.environ.get("MLA_PLANNER_CLASSES") == "planned"
    for item in items:
        if planned and not all(getattr(item.module, name).__name__ == "Planned" + name for name in CLASS_NAMES):
            # The test module bound stock's classes before the swap: it would test stock, quietly.
            raise pytest.UsageError(f"{item.module.__name__} imported stock's classes, not the backend's")
        reason = None if ON_GPU else GPU_ONLY.get(item.originalname)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs {reason}"))


# -- on a GPU: the fixtures of vLLM's conftest that its sparse-MLA file uses ----------------------


@pytest.fixture
def default_vllm_config() -> Any:
    """A default engine configuration, current while the test runs."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def dist_init(tmp_path: Any) -> Any:
    """One rank's process groups (NCCL), torn down after the test."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{tmp_path / 'store'}",
                                     local_rank=0, backend="nccl")
        initialize_model_parallel(1, 1)
        yield
    cleanup_dist_env_and_memory()


@pytest.fixture
def workspace_init() -> Any:
    """vLLM's workspace manager on the GPU, reset after the test."""
    from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

    init_workspace_manager(torch.device(0))
    yield
    reset_workspace_manager()


# -- each test's outcome as it finishes --------------------------------------------------------------

_outcomes: dict[str, tuple[str, str]] = {}


def first_line(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        text = str(longrepr[2]).removeprefix("Skipped: ")  # as JUnit reports it
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr or "")
    return (text.strip().splitlines() or [""])[0]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """The outcome JUnit would give (a setup failure is an error, a teardown failure turns a pass
    into an error), written when the test's teardown is reported."""
    if OUTCOME_LOG is None:
        return
    if report.when in ("setup", "call") and report.nodeid not in _outcomes:
        if report.skipped:
            _outcomes[report.nodeid] = ("skipped", first_line(report))
        elif report.failed:
            _outcomes[report.nodeid] = ("error" if report.when == "setup" else "failed", first_line(report))
        elif report.when == "call":
            _outcomes[report.nodeid] = ("passed", "")
    if report.when == "teardown":
        outcome = _outcomes.pop(report.nodeid, ("passed", ""))
        if report.failed and outcome[0] == "passed":
            outcome = ("error", first_line(report))
        with open(OUTCOME_LOG, "a") as log:
            log.write(json.dumps({"test": report.nodeid.split("::")[-1], "outcome": outcome[0],
                                  "message": outcome[1]}) + "\n")
