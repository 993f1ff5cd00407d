"""The vLLM backend on the CPU: plugin registration, vLLM's configuration checks, the plan the
builder attaches, and the impl's launches against the float32 reference (tests/vllm_cpu.py
stands in for vLLM's GPU-only pieces)."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import pathlib
import re
import sys
import types
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from releases import ALL, NEEDS_VLLM, installed, only_where

pytest.importorskip("vllm", reason=NEEDS_VLLM)

import mla_planner  # noqa: E402
from mla_planner.executor.quant import quantize_fp8_ds_mla  # noqa: E402
from mla_planner.calibration.synthetic import random_kv_rows  # noqa: E402
from mla_planner.vllm_backend import fallback, vllm_api  # noqa: E402
from mla_planner.vllm_backend.releases import release  # noqa: E402
from mla_planner.vllm_backend.reservation import Reservation  # noqa: E402
from mla_planner.vllm_backend.backend import PlannedFlashMLASparseMetadataBuilder  # noqa: E402
from mla_planner.engine_model.settings import DEFAULT_SCRATCH_MB, SettingsError, read_settings  # noqa: E402
from fixtures import gen  # noqa: E402, F401  (a pytest fixture)
from vllm_cpu import (  # noqa: E402
    NUM_SMS,
    KernelRecorder,
    RecordingProvider,
    causal_positions,
    common_metadata,
    convert_req_index_to_global_index,
    cpu_vllm,
    custom_backend_in_this_process,
    forward_out,
    model_dir,
    reference_output,
    request_slots,
    shuffled_block_table,
    vllm_config,
)


FACTS = installed()
BACKEND = "mla_planner.vllm_backend.backend.PlannedFlashMLASparseBackend"
TOPK = 128
SCRATCH_MB = 64



@pytest.fixture
def registry() -> Iterator[dict[Any, str]]:
    """vLLM's backend overrides, restored after the test."""
    from vllm.v1.attention.backends import registry as reg

    saved = dict(reg._ATTN_OVERRIDES)
    yield reg._ATTN_OVERRIDES
    reg._ATTN_OVERRIDES.clear()
    reg._ATTN_OVERRIDES.update(saved)


# -- settings -----------------------------------------------------------------------------------


def test_settings_default_and_both_names() -> None:
    assert read_settings({}).scratch_mb == DEFAULT_SCRATCH_MB
    assert read_settings({}).source == "default"
    s = read_settings({"VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB": "512"})
    assert (s.scratch_mb, s.source, s.scratch_bytes) == (512, "VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB", 512 << 20)
    both = read_settings({"MLA_PLANNER_SCRATCH_MB": "256", "VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB": "256"})
    assert both.scratch_mb == 256
    assert read_settings({"MLA_PLANNER_REPLACE_FLASHMLA_SPARSE": "1"}).replace_flashmla_sparse
    assert not read_settings({}).native_prefill_heads
    assert read_settings({"MLA_PLANNER_NATIVE_PREFILL_HEADS": "1"}).native_prefill_heads


@pytest.mark.parametrize(
    "env, words",
    [
        ({"MLA_PLANNER_SCRATCH_MB": "lots"}, ["MLA_PLANNER_SCRATCH_MB='lots'", "whole number"]),
        ({"MLA_PLANNER_SCRATCH_MB": "0"}, ["outside", "default"]),
        ({"MLA_PLANNER_SCRATCH_MB": "-5"}, ["outside"]),
        ({"VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB": "1.5"}, ["VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB"]),
        ({"MLA_PLANNER_SCRATCH_MB": "512", "VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB": "1024"}, ["disagree"]),
        ({"MLA_PLANNER_REPLACE_FLASHMLA_SPARSE": "maybe"}, ["MLA_PLANNER_REPLACE_FLASHMLA_SPARSE", "use 1"]),
        ({"MLA_PLANNER_NATIVE_PREFILL_HEADS": "16"}, ["MLA_PLANNER_NATIVE_PREFILL_HEADS='16'", "use 1", "pad as vLLM"]),
    ],
)
def test_bad_settings_say_what_is_wrong(env: dict[str, str], words: list[str]) -> None:
    with pytest.raises(SettingsError) as err:
        read_settings(env)
    assert isinstance(err.value, ValueError)
    for word in words:
        assert word in str(err.value)


def write_profile(path: pathlib.Path, content: bytes | None = None) -> pathlib.Path:
    """``path`` holding ``content`` (default: a valid profile)."""
    import json

    path.write_bytes(json.dumps(ROUTING_PROFILE).encode() if content is None else content)
    return path


def test_cost_profile_unset_means_the_packaged_one_and_none_means_vllms_rule() -> None:
    for env in ({}, {"MLA_PLANNER_COST_PROFILE": "  "}):
        settings = read_settings(env)
        assert (settings.cost_profile, settings.vllm_rule) == (None, False)
    for value in ("none", "None"):
        settings = read_settings({"MLA_PLANNER_COST_PROFILE": value})
        assert (settings.cost_profile, settings.vllm_rule) == (None, True)


def test_cost_profile_that_parses_is_taken(tmp_path: pathlib.Path) -> None:
    path = write_profile(tmp_path / "profile.json")
    assert read_settings({"MLA_PLANNER_COST_PROFILE": str(path)}).cost_profile == str(path)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda tmp: tmp / "missing.json", "no such file"),
        (lambda tmp: tmp, "a directory, not a file"),
        (lambda tmp: write_profile(tmp / "latin1.json", b'{"format": "caf\xe9"}'), "not UTF-8 text (byte 0xe9 at offset 15)"),
        (lambda tmp: write_profile(tmp / "truncated.json", b'{"format": '), "JSON"),
        (lambda tmp: write_profile(tmp / "other.json", b'{"model": "x"}'), "format"),
        (lambda tmp: write_profile(tmp / "empty.json", b""), "JSON"),
    ],
    ids=["missing", "directory", "not-utf8", "malformed-json", "not-a-profile", "empty"],
)
def test_unusable_cost_profile_fails_naming_variable_path_and_reason(
    tmp_path: pathlib.Path, make: Any, reason: str
) -> None:
    path = make(tmp_path)
    with pytest.raises(SettingsError) as err:
        read_settings({"MLA_PLANNER_COST_PROFILE": str(path)})
    message = str(err.value)
    assert message.startswith(f"MLA_PLANNER_COST_PROFILE={path}: "), message
    assert reason in message
    assert "mla-planner calibrate" in message and "unset it" in message and "to none" in message, "what to do"
    assert "\n" not in message


def test_cost_profile_that_is_not_a_regular_file_fails_without_reading_it(tmp_path: pathlib.Path) -> None:
    import os

    fifo = tmp_path / "profile.fifo"
    os.mkfifo(fifo)  # reading it would block start-up forever
    with pytest.raises(SettingsError, match="not a regular file"):
        read_settings({"MLA_PLANNER_COST_PROFILE": str(fifo)})


def test_unreadable_cost_profile_fails(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_profile(tmp_path / "profile.json")

    def denied(self: pathlib.Path) -> bytes:  # as for a file mode 000, even when the tests run as root
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "read_bytes", denied)
    with pytest.raises(SettingsError, match=r"cannot read it \(Permission denied\)"):
        read_settings({"MLA_PLANNER_COST_PROFILE": str(path)})


def test_relative_cost_profile_shows_where_it_was_looked_for(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SettingsError) as err:
        read_settings({"MLA_PLANNER_COST_PROFILE": "profiles/h200.json"})
    assert str(err.value).startswith(f"MLA_PLANNER_COST_PROFILE=profiles/h200.json ({tmp_path / 'profiles/h200.json'}): no such file")


# -- plugin -------------------------------------------------------------------------------------


def test_vllm_loads_the_entry_point_and_custom_is_ours(registry: dict[Any, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("MLA_PLANNER_REPLACE_FLASHMLA_SPARSE", raising=False)
    vllm.plugins.load_general_plugins()  # type: ignore[no-untyped-call]
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND
    assert AttentionBackendEnum.CUSTOM.get_class().__name__ == "PlannedFlashMLASparseBackend"
    assert AttentionBackendEnum.FLASHMLA_SPARSE.get_path() != BACKEND
    # vLLM may load plugins again in another process or call: harmless.
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()  # type: ignore[no-untyped-call]
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_workers_vllm_starts_register_the_backend(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor parallelism runs the model in worker processes that vLLM starts itself (its
    multiprocessing context, spawn or fork): each must find the entry point on its own."""
    from vllm.utils.system_utils import get_mp_context

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", method)
    monkeypatch.delenv("MLA_PLANNER_REPLACE_FLASHMLA_SPARSE", raising=False)
    context = get_mp_context()  # type: ignore[no-untyped-call]
    results = context.Queue()
    worker = context.Process(target=custom_backend_in_this_process, args=(results,))
    worker.start()
    worker.join(timeout=240)
    assert worker.exitcode == 0, f"the {method} worker failed (exit code {worker.exitcode})"
    assert results.get(timeout=5) == BACKEND


def test_replace_takes_the_place_of_flashmla_sparse(registry: dict[Any, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from mla_planner.vllm_backend import register

    monkeypatch.setenv("MLA_PLANNER_REPLACE_FLASHMLA_SPARSE", "1")
    register()
    assert AttentionBackendEnum.FLASHMLA_SPARSE.get_path() == BACKEND
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND


def test_bad_settings_fail_registration(registry: dict[Any, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_planner.vllm_backend import register

    monkeypatch.setenv("MLA_PLANNER_SCRATCH_MB", "nope")
    with pytest.raises(ValueError, match="MLA_PLANNER_SCRATCH_MB"):
        register()


def test_missing_cost_profile_fails_vllm_start_up(
    registry: dict[Any, str], monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """Through vLLM's own plugin loading, which lets a plugin's error out of start-up."""
    import vllm.plugins

    missing = tmp_path / "h200.json"
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("MLA_PLANNER_COST_PROFILE", str(missing))
    with pytest.raises(SettingsError, match=f"MLA_PLANNER_COST_PROFILE={missing}: no such file"):
        vllm.plugins.load_general_plugins()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_passes_vllm_configuration_checks(kv_cache_dtype: str, capability: tuple[int, int]) -> None:
    from vllm.platforms.interface import DeviceCapability

    from mla_planner.vllm_backend.backend import PlannedFlashMLASparseBackend

    reasons = PlannedFlashMLASparseBackend.validate_configuration(
        head_size=576, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
        block_size=64, use_mla=True, has_sink=False, use_sparse=True, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=DeviceCapability(*capability), attn_type="decoder",
    )
    assert reasons == []
    # And it is not a yes-to-everything: a non-sparse model is refused.
    refused = PlannedFlashMLASparseBackend.validate_configuration(
        head_size=576, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
        block_size=64, use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=DeviceCapability(*capability), attn_type="decoder",
    )
    assert refused


# -- the release modules ------------------------------------------------------------------------

# vLLM internals whose shape differs between releases: only the release modules may name them.
VERSIONED = ("triton_convert_req_index_to_global_index", "get_prefill_workspace_size", "prefill_bf16_workspace",
             "workspace_specs", "current_workspace_manager", "get_simultaneous", "QUANTIZED_DS_MLA_CACHE_FORMATS",
             "is_locked", "dbo_current_ubatch_id", "topk_mask_workspace", "SparseMLAPrefillMetadata")
TORCH_PRIVATE = {"_sleep"}  # torch.cuda._sleep, which the calibration queues launches behind
# Gluon's shared_memory_descriptor._reinterpret: the staged fp8_mma kernel's second view of the same
# shared bytes in another layout (Triton 3.6 and 3.8 have no public way to take one).
TRITON_PRIVATE = {"_reinterpret"}
RELEASE_PATTERN = re.compile(r"\b0\.(26|33)\b|\bV0?33\b")


def outside_the_release_modules() -> list[types.ModuleType]:
    """Every module of the package but the release modules (and the doctor's models of one
    release, under ``cli``, which import no vLLM)."""
    import importlib
    import pkgutil

    import mla_planner

    names = [info.name for info in pkgutil.walk_packages(mla_planner.__path__, "mla_planner.")
             if ".releases" not in info.name and ".cli" not in info.name and not info.name.endswith("__main__")]
    modules = [importlib.import_module(name) for name in names]
    return [module for module in modules if (module.__file__ or "").endswith(".py")]  # not the compiled planner


def test_only_the_release_modules_name_what_differs_between_vllm_releases() -> None:
    """No module outside ``vllm_backend.releases`` names a release, a versioned vLLM internal, or a
    private vLLM member: the private names a module reads are its own (the overrides of stock's
    private methods in ``backend`` are the subclass's surface, and defined there)."""
    import ast
    import inspect

    modules = outside_the_release_modules()
    assert len(modules) > 20
    own: set[str] = set()
    trees = {}
    for module in modules:
        trees[module] = tree = ast.parse(inspect.getsource(module))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
    for module, tree in trees.items():
        source = inspect.getsource(module)
        assert not RELEASE_PATTERN.search(source), f"{module.__name__} names a release: {RELEASE_PATTERN.search(source)}"
        names = {node.attr if isinstance(node, ast.Attribute) else node.id
                 for node in ast.walk(tree) if isinstance(node, (ast.Attribute, ast.Name))}
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        assert not (names | imported) & set(VERSIONED), f"{module.__name__} names {(names | imported) & set(VERSIONED)}"
        private = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                   and node.attr.startswith("_") and not node.attr.startswith("__")} - own - TORCH_PRIVATE - TRITON_PRIVATE
        assert not private, f"{module.__name__} reads private members it does not define: {sorted(private)}"


def test_only_the_seam_imports_vllm() -> None:
    """``vllm_api`` (what every release has alike) and the release modules are the modules that
    import vLLM (the plugin registers with vLLM's registry, the executor's provider calls vLLM's
    kernels, and the calibration times them)."""
    import ast
    import inspect

    allowed = {"mla_planner.vllm_backend.vllm_api", "mla_planner.vllm_backend.plugin",
               "mla_planner.executor.providers", "mla_planner.calibration.kernel_timing"}
    for module in outside_the_release_modules():
        if module.__name__ in allowed:
            continue
        tree = ast.parse(inspect.getsource(module))
        imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not {name for name in imported if name == "vllm" or name.startswith("vllm.")}, module.__name__


def test_the_cli_and_the_engine_model_import_nothing_of_the_backend() -> None:
    """The doctor predicts an engine with the engine model the backend sizes it with: neither it
    nor any command imports the vLLM backend (or vLLM, except the doctor's parser, by name)."""
    import ast
    import pkgutil

    import mla_planner.cli
    import mla_planner.engine_model

    for package in (mla_planner.cli, mla_planner.engine_model):
        for info in pkgutil.iter_modules(package.__path__):
            path = pathlib.Path(package.__path__[0]) / f"{info.name}.py"
            tree = ast.parse(path.read_text())
            # Relative imports resolved against the package (cli's own vllm_releases is no vLLM module).
            base = package.__name__.split(".")
            imported = {".".join([*base[:len(base) + 1 - node.level], *([node.module] if node.module else [])])
                         if node.level else node.module or ""
                         for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
            imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
            bad = {n for n in imported if n.startswith(("mla_planner.vllm_backend", "vllm")) or n == "vllm"}
            assert not bad, f"{path.name} imports {bad}"


def test_the_release_follows_the_installed_vllm(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from mla_planner.vllm_backend import releases

    version = importlib.metadata.version("vllm")
    assert vllm_api.installed_version() == version and version.startswith(release.version + ".")
    assert releases.installed() is release and list(releases.MODULES) == list(ALL)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.40.1")
    supported = " and ".join(re.escape(minor) + r"\.x" for minor in ALL)
    with pytest.raises(ImportError, match=f"supports vLLM {supported}; vLLM 0\\.40\\.1 is installed"):
        releases.installed()
    assert FACTS.minor == release.version
    assert (release.forward_returns_lse, release.stock_workspace, release.masked_mha is not None,
            release.native_prefill_kernels) == (FACTS.forward_returns_lse, FACTS.stock_workspace, FACTS.masked_mha,
                                                FACTS.native_prefill_kernels)
    # vLLM's own gather-workspace rows: 5 x max_model_len by default in every release.
    config = vllm_config(model_dir(tmp_path, num_heads=16, topk=TOPK), max_model_len=4096)
    assert release.prefill_workspace_rows(config) == 5 * 4096
    assert vllm_api.indexer_workspace_rows(config) == 40 * 4096  # 132-byte rows in the same memory
    out = torch.ones(2, 3)
    result = release.forward_result(out)
    if FACTS.forward_returns_lse:
        assert isinstance(result, tuple) and result[0] is out and result[1] is None
    else:
        assert result is out
    cache = torch.zeros(3, 64, 656, dtype=torch.uint8)
    pages, stride = release.fp8_kv_pages(cache, 64)
    assert pages.shape == cache.shape and stride is None


# -- reservation --------------------------------------------------------------------------------


def test_reservation_is_once_per_engine_and_released_once() -> None:
    """Every layer of an engine asks; the first allocates, once for the engine's life."""
    reservation = Reservation()
    assert reservation.reserve(1 << 20, torch.device("cpu"))
    assert not reservation.reserve(1 << 20, torch.device("cpu")), "a second layer must not reserve again"
    assert reservation.reserved_bytes == 1 << 20
    assert reservation.held() and reservation._held is not None and reservation._held.numel() == 1 << 20
    reservation.note_kv_cache_sized()
    assert reservation.release()
    assert not reservation.release()
    assert not reservation.held()
    assert not reservation.reserve(2 << 20, torch.device("cpu")), "an engine that served reserves no more"
    assert reservation.reserved_bytes == 1 << 20


def test_the_released_reservation_goes_back_to_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """A freed block serves only its own stream, and vLLM serves on another than the one the model
    is built on: released, the reservation's bytes are given back to the driver (the cache
    emptied once they are free), for the launches' stream to allocate."""
    reservation = Reservation()
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(reservation._held is None))
    reservation._held = SimpleNamespace(is_cuda=True)  # type: ignore[assignment]
    assert reservation.release() and emptied == [True]
    assert not reservation.release() and emptied == [True]
    reservation._held = torch.empty(1 << 20, dtype=torch.uint8)
    assert reservation.release() and emptied == [True], "nothing to give back off CUDA"

    def refused() -> None:  # as vLLM's VLLM_GPU_SYNC_CHECK=error refuses a synchronisation
        raise RuntimeError("GPU synchronization detected")

    monkeypatch.setattr(torch.cuda, "empty_cache", refused)
    reservation._held = SimpleNamespace(is_cuda=True)  # type: ignore[assignment]
    assert reservation.release() and reservation._held is None, "the hand-over never raises"


def hold_reservation(backend: Backend) -> int:
    """A 1 MiB reservation held by the backend's engine, as its first layer leaves it; returns its
    address."""
    assert backend.impl.engine is not None
    reservation = backend.impl.engine.state.reservation
    reservation._held = held = torch.empty(1 << 20, dtype=torch.uint8)
    reservation.reserved_bytes = 1 << 20
    reservation.address = held.data_ptr()
    return held.data_ptr()


class FakePool:
    """A PyTorch memory pool as vLLM's CuMem allocator keeps one: segments with their live bytes."""

    def __init__(self, *segments: tuple[int, int, int]) -> None:
        self.segments = [{"address": a, "total_size": size, "allocated_size": live} for a, size, live in segments]

    def snapshot(self) -> list[dict[str, int]]:
        return self.segments


def sleep_mode_allocator(monkeypatch: pytest.MonkeyPatch, pools: dict[str, Any],
                         asleep: frozenset[int] = frozenset()) -> list[int]:
    """vLLM's CuMem allocator as sleep mode leaves it (its module imported, its instance made), with
    ``pools`` per tag; returns the list the segments it unmaps are appended to."""
    unmapped: list[int] = []
    data = {seg["address"]: SimpleNamespace(is_asleep=seg["address"] in asleep)
            for entry in pools.values() for pool, _ in (entry if isinstance(entry, list) else [entry])
            for seg in pool.snapshot()}

    def free_callback(address: int) -> tuple[int, int]:
        data.pop(address)
        return (0, address)  # vLLM's handle, which unmap_and_release takes

    allocator = SimpleNamespace(allocator_and_pools=pools, pointer_to_data=data, _python_free_callback=free_callback)
    module = SimpleNamespace(CuMemAllocator=SimpleNamespace(instance=allocator),
                             unmap_and_release=lambda handle: unmapped.append(handle[1]))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", module)
    return unmapped


@pytest.mark.parametrize("per_tag", ["one pool", "a list of pools"])  # as releases keep them
def test_under_sleep_mode_the_freed_reservation_is_unmapped_from_vllms_pool(
        monkeypatch: pytest.MonkeyPatch, per_tag: str) -> None:
    """Under vLLM's CuMem allocator the reservation is made in the model's pool, which keeps a freed
    segment mapped: the hand-over unmaps the one free segment that holds it, and nothing else."""
    monkeypatch.delitem(sys.modules, "vllm.device_allocator.cumem", raising=False)
    assert not release.release_from_sleep_mode_pool(0x1000), "no CuMem allocator: nothing to unmap"
    weights = FakePool((0x1000, 0x400, 0), (0x2000, 0x400, 0x100), (0x3000, 0x400, 0))
    cache = FakePool((0x8000, 0x400, 0))
    pools: dict[str, Any] = ({"weights": (weights, None), "kv_cache": (cache, None)} if per_tag.startswith("one")
                             else {"weights": [(FakePool(), None), (weights, None)], "kv_cache": [(cache, None)]})
    unmapped = sleep_mode_allocator(monkeypatch, pools, asleep=frozenset({0x3000}))
    assert release.release_from_sleep_mode_pool(0x1000 + 0x10) and unmapped == [0x1000]
    assert not release.release_from_sleep_mode_pool(0x1000), "unmapped once"
    assert not release.release_from_sleep_mode_pool(0x2000), "a segment with live blocks stays"
    assert not release.release_from_sleep_mode_pool(0x3000), "a sleeping segment is off the GPU already"
    assert not release.release_from_sleep_mode_pool(0x5000), "an address outside vLLM's pools"
    assert unmapped == [0x1000]


def test_the_hand_over_says_whether_the_reservation_was_made_on_another_stream(
        mixed: Backend, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log line of the hand-over says where vLLM serves on another CUDA stream than the one
    the model was built on (why the bytes go back to the driver), and where it unmapped the bytes
    from vLLM's sleep-mode pool. (CPU: the streams and the pool are stand-ins.)"""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_: SimpleNamespace(cuda_stream=2))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.delitem(sys.modules, "vllm.device_allocator.cumem", raising=False)
    for made_on, said, sleep_mode in ((1, True, False), (2, False, False), (2, False, True)):
        address = hold_reservation(mixed)
        assert mixed.impl.engine is not None
        mixed.impl.engine.state.reservation._stream = made_on
        if sleep_mode:
            unmapped = sleep_mode_allocator(monkeypatch, {"weights": (FakePool((address, 1 << 20, 0)), None)})
        case = mixed.step(QUERY_LENS, CONTEXT_LENS, gen)
        q = case["q"]
        mixed.topk_buffer[: q.shape[0]] = case["positions"]
        with debug_lines() as lines:
            mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[: q.shape[0]],
                                                   case["metadata"])
        handed = [line for line in lines if "handed to the kernels" in line]
        assert len(handed) == 1 and ("made on another CUDA stream" in handed[0]) == said, lines
        assert ("unmapped from vLLM's sleep-mode memory pool" in handed[0]) == sleep_mode, lines
    assert unmapped == [address]


def test_a_failed_unmap_from_the_sleep_mode_pool_is_said_and_the_step_runs_its_plan(
        mixed: Backend, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's unmap raising (a CUDA error) at the hand-over: a warning, the hand-over's line, and the
    layer call runs its plan, never raising."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    address = hold_reservation(mixed)
    sleep_mode_allocator(monkeypatch, {"weights": (FakePool((address, 1 << 20, 0)), None)})

    def failing_unmap(handle: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(sys.modules["vllm.device_allocator.cumem"], "unmap_and_release", failing_unmap)
    case = mixed.step(QUERY_LENS, CONTEXT_LENS, gen)
    q, md = case["q"], case["metadata"]
    mixed.topk_buffer[: q.shape[0]] = case["positions"]
    with debug_lines() as lines:
        out = forward_out(mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[: q.shape[0]], md))
    assert any("unmapping the scratch reservation" in line and "illegal memory access" in line for line in lines), lines
    assert any("handed to the kernels" in line and "sleep-mode" not in line for line in lines), lines
    assert mixed.impl.engine is not None and not mixed.impl.engine.state.reservation.held()
    assert not any("bounded path" in line for line in lines), lines
    torch.testing.assert_close(out, case["expected"], rtol=1e-5, atol=1e-5)


# -- builder and impl ---------------------------------------------------------------------------


class Backend:
    """A builder and an impl of one layer, on the CPU, with the reference kernels."""

    def __init__(self, tmp: pathlib.Path, monkeypatch: pytest.MonkeyPatch, *, num_heads: int,
                 cost_profile: pathlib.Path | None = None, dense_prefill: bool = False, scratch_mb: int = 0,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 2048, max_model_len: int = 4096,
                 reshape_config: Callable[[Any], None] | None = None, block_size: int = 64,
                 real_reservation: bool = False) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.v1.kv_cache_interface import MLAAttentionSpec
        from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

        from mla_planner.vllm_backend.backend import PlannedFlashMLASparseImpl

        monkeypatch.setenv("MLA_PLANNER_SCRATCH_MB", str(scratch_mb or SCRATCH_MB))
        # No profile unless the test gives one: the packaged H200 profile must not leak in (it
        # would, with no GPU to say the machine differs).
        monkeypatch.setenv("MLA_PLANNER_COST_PROFILE", str(cost_profile or "none"))
        self.reserved: list[int] = []  # what the impl asks the reservation to hold, per call

        def reserve(_: Reservation, num_bytes: int, device: torch.device) -> bool:
            self.reserved.append(num_bytes)
            return False  # nothing held: a test holds what it needs (hold_reservation)

        if not real_reservation:
            monkeypatch.setattr(Reservation, "reserve", reserve)
        self.num_heads = num_heads
        self.provider = RecordingProvider()
        self.kernels = KernelRecorder()
        self.config = vllm_config(model_dir(tmp, num_heads=num_heads, topk=TOPK), dense_prefill=dense_prefill,
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len)
        self.config.cache_config.block_size = self.block_size = block_size
        if reshape_config is not None:
            reshape_config(self.config)
        self._cpu = cpu_vllm(monkeypatch, self.provider, self.kernels)
        self._cpu.__enter__()
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                                cache_dtype_str="fp8_ds_mla")
        if not is_workspace_manager_initialized():
            init_workspace_manager(torch.device("cpu"))
        self.topk_buffer = torch.empty((2048, TOPK), dtype=torch.int32)
        self.spec = spec
        with set_current_vllm_config(self.config):
            self.builder = self.new_builder()
            self.impl = PlannedFlashMLASparseImpl(
                num_heads, 576, 576**-0.5, 1, None, None, "fp8_ds_mla", None, "decoder", None,
                q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192,
                v_head_dim=128, kv_b_proj=None, topk_indices_buffer=self.topk_buffer,
            )

    def close(self) -> None:
        self._cpu.__exit__(None, None, None)

    def new_builder(self) -> PlannedFlashMLASparseMetadataBuilder:
        """A metadata builder of this engine, as vLLM makes one per KV cache it builds."""
        return PlannedFlashMLASparseMetadataBuilder(self.spec, ["layers.0.attn"], self.config, torch.device("cpu"))

    def fp8_forward(self, md: Any) -> Callable[..., Any]:
        """The impl's FP8 forward on the route a step's metadata names, as vLLM's layer picks it."""
        if md.fp8_use_mixed_batch:
            return self.impl._forward_fp8_kv_mixed_batch
        return self.impl._forward_fp8_kv_separate_prefill_decode

    def step(self, query_lens: list[int], context_lens: list[int], gen: torch.Generator, *,
             draft_after_padding: int = 0, exact_seq_lens: bool = True, padding_tokens: int = 0) -> dict[str, Any]:
        """The step's metadata, from the builder, and its inputs and reference output.
        ``draft_after_padding``: the metadata the MTP draft is given after vLLM padded the target
        step with that many requests of length 0 (the runner's ``unpadded`` of the padded one);
        ``exact_seq_lens``: see :func:`vllm_cpu.common_metadata`; ``padding_tokens``: tokens past
        the requests' that the metadata counts, as vLLM's full-CUDA-graph metadata does: q has a
        row for each, the reference output the requests' rows only."""
        seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
        block_table, num_blocks = shuffled_block_table(seq_lens, gen, self.block_size)
        kv_cache = quantize_fp8_ds_mla(random_kv_rows(num_blocks * self.block_size, gen)).view(
            num_blocks, self.block_size, 656)
        pad = draft_after_padding
        common = common_metadata(query_lens + [0] * pad, context_lens + [0] * pad,
                                 torch.cat([block_table, block_table.new_zeros((pad, block_table.shape[1]))]),
                                 exact_seq_lens=exact_seq_lens)
        if pad:
            common = common.unpadded(sum(query_lens), len(query_lens))
        tokens = sum(query_lens)
        if padding_tokens:
            common = dataclasses.replace(common, num_actual_tokens=tokens + padding_tokens,
                                         slot_mapping=torch.zeros(tokens + padding_tokens, dtype=torch.int64))
        metadata = self.builder.build(0, common)
        positions = causal_positions(query_lens, context_lens, TOPK, gen)
        q = torch.randn((tokens + padding_tokens, self.num_heads, 576), generator=gen)
        slots = request_slots(positions, query_lens, block_table, self.block_size)
        return dict(metadata=metadata, kv_cache=kv_cache, positions=positions, q=q,
                    expected=reference_output(q[:tokens], kv_cache, slots, 576**-0.5))


@pytest.fixture
def mixed(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    backend = Backend(tmp_path, monkeypatch, num_heads=16)
    yield backend
    backend.close()


@pytest.fixture
def separate(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    backend = Backend(tmp_path, monkeypatch, num_heads=32)
    yield backend
    backend.close()


# Decodes first, then prefills with and without context: about 900 tokens.
QUERY_LENS = [1, 1, 1, 350, 520]
CONTEXT_LENS = [70, 200, 5, 0, 130]


def test_the_mtp_draft_is_given_the_targets_backend_only_where_none_is_named() -> None:
    """Only an MTP draft with no backend of its own is given the target's; a draft the operator
    named another backend for keeps it (and says which); other speculative methods are vLLM's."""
    def config(method: str | None, draft: str | None, target: str | None = "CUSTOM") -> Any:
        spec = None if method is None else SimpleNamespace(method=method, attention_backend=draft)
        return SimpleNamespace(speculative_config=spec, attention_config=SimpleNamespace(backend=target))

    named = config("mtp", None)
    assert vllm_api.give_mtp_draft_the_target_backend(named) == ("CUSTOM", True)
    assert named.speculative_config.attention_backend == "CUSTOM"
    assert vllm_api.give_mtp_draft_the_target_backend(named) == ("CUSTOM", False)  # now the target's
    assert vllm_api.give_mtp_draft_the_target_backend(config("mtp", "FLASHMLA_SPARSE")) == ("FLASHMLA_SPARSE", False)
    for untouched in (config(None, None), config("eagle3", None), config("mtp", None, target=None),
                      config("eagle3", "FLASH_ATTN")):
        before = None if untouched.speculative_config is None else untouched.speculative_config.attention_backend
        assert vllm_api.give_mtp_draft_the_target_backend(untouched) is None
        assert before == (None if untouched.speculative_config is None else untouched.speculative_config.attention_backend)


def test_the_impl_names_its_backend_for_the_mtp_draft_at_construction(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The target model's impls are built before vLLM builds the MTP draft's config: the impl is
    where the draft is given this backend (vllm_api.give_mtp_draft_the_target_backend, held against vLLM's
    own draft configs in tests/e2e/test_serve.py)."""
    asked: list[Any] = []

    def record(config: Any) -> None:
        asked.append(config)
        return None

    monkeypatch.setattr(vllm_api, "give_mtp_draft_the_target_backend", record)
    backend = Backend(tmp_path, monkeypatch, num_heads=16)
    try:
        assert asked and all(config is backend.config for config in asked)
    finally:
        backend.close()


def as_vllms_own_test_shapes_it(config: Any) -> None:
    """The model config as vLLM's own sparse-MLA tests shape it: a namespace of MLA dims for
    ``hf_text_config``, and the top-k only where the release's sparse-MLA layer reads it
    (``hf_config``, or ``hf_text_config`` and deleted from ``hf_config``: the release's facts)."""
    model = config.model_config
    topk = model.hf_config.index_topk
    model.hf_text_config = SimpleNamespace(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                                           qk_rope_head_dim=64, v_head_dim=128, model_type="deepseek_v2")
    if FACTS.topk_in_hf_text_config:
        model.hf_text_config.index_topk = topk
        del model.hf_config.index_topk


def test_the_top_k_is_read_where_this_releases_layer_reads_it(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                               gen: torch.Generator) -> None:
    """An engine whose top-k is where vLLM's own tests put it builds and plans (a release's file
    failed 84 tests on the H200 with an AttributeError while the setup read ``hf_text_config``)."""
    backend = Backend(tmp_path, monkeypatch, num_heads=16, reshape_config=as_vllms_own_test_shapes_it)
    try:
        assert backend.builder.engine.config.topk == TOPK
        case = backend.step(QUERY_LENS, CONTEXT_LENS, gen)
        md, q = case["metadata"], case["q"]
        assert md.planned is not None and len(md.planned.plan) > 1
        backend.topk_buffer[: q.shape[0]] = case["positions"]
        out = forward_out(backend.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], backend.topk_buffer[: q.shape[0]], md))
        torch.testing.assert_close(out, case["expected"], rtol=1e-5, atol=1e-5)
    finally:
        backend.close()


def test_builder_attaches_the_planned_mixed_batch(mixed: Backend, gen: torch.Generator) -> None:
    metadata = mixed.step(QUERY_LENS, CONTEXT_LENS, gen)["metadata"]
    assert metadata.fp8_use_mixed_batch
    step = metadata.planned
    assert step is not None
    config = mixed.builder.engine.config
    assert (config.translated_indices, config.align_waves, config.scratch_budget_bytes) == (True, True, SCRATCH_MB << 20)
    assert (config.gather_workspace_rows, config.indexer_workspace_rows) == (5 * 4096, 40 * 4096)
    expected = mla_planner.plan_step(QUERY_LENS, CONTEXT_LENS, 3, config)
    assert step.plan.mode == "mixed_batch"
    assert step.plan.launches.tolist() == expected.launches.tolist()
    assert len(step.plan) > 1, "the test budget must cut the step"
    assert step.plan.peak_bytes <= config.launch_budget_bytes


def step_log_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """tests/e2e/step_log.py, which reads the backend's step lines from a server's log."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent / "e2e"))
    return importlib.import_module("step_log")


@contextmanager
def debug_lines() -> Iterator[list[str]]:
    """The backend's log lines at debug level while the block runs, as a server logs them (vLLM's
    prefix and a millisecond stamp, as tests/e2e/step_log.py reads them)."""
    messages: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.mla_planner")
    # vLLM's suppress_logging() (some releases') leaves logging.disable(INFO) on when its body raises, as when
    # test_doctor probes vLLM's serve parser on a machine without a GPU: undone for this block.
    disabled, level = logging.root.manager.disable, logger.level
    logging.disable(logging.NOTSET)
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    lines: list[str] = []
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logging.disable(disabled)
        lines += [f"DEBUG 12-02 02:30:00.{i:03d} [backend.py:1] {m}" for i, m in enumerate(messages)]


def test_decode_only_steps_carry_no_plan(mixed: Backend, gen: torch.Generator) -> None:
    metadata = mixed.step([1, 1, 1], [40, 9, 300], gen)["metadata"]
    assert metadata.num_prefills == 0 and metadata.planned is None
    # Stock's one call for them is the planner's plan of such a step too.
    plan = mla_planner.plan_step([1, 1, 1], [40, 9, 300], 3, mixed.builder.engine.config)
    assert plan.launches[:, :2].tolist() == [[0, 3]]


def test_every_fp8_step_is_logged_for_the_step_log(mixed: Backend, gen: torch.Generator,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """At debug level the builder logs planned and unplanned steps alike, in the form
    tests/e2e/step_log.py reads."""
    step_log = step_log_module(monkeypatch)
    with debug_lines() as lines:
        mixed.step([1, 1, 1], [40, 9, 300], gen)
        mixed.step(QUERY_LENS, CONTEXT_LENS, gen)
    steps = step_log.parse("\n".join(lines))
    assert [(s.tokens, s.decode_tokens, s.prefills, s.kind) for s in steps] == [
        (3, 3, 0, step_log.DECODE_ONLY), (sum(QUERY_LENS), 3, 2, "planned: mixed_batch")], lines


def test_the_builder_counts_every_step_and_says_the_summary_at_vllms_interval(mixed: Backend,
                                                                               gen: torch.Generator) -> None:
    """Planned steps (split or not, with their launches) and steps on vLLM's one call are counted
    as the builder makes them; the summary line comes at vLLM's stats interval, from the build."""
    assert mixed.impl.engine is not None
    stats = mixed.impl.engine.state.stats
    assert stats.interval_s == vllm_api.stats_interval_s() > 0
    assert stats.reserved_bytes == mixed.impl.engine.reserved_bytes
    clock = [0.0]
    stats.clock = lambda: clock[0]
    with debug_lines() as lines:
        run_step(mixed, [1, 1, 1], [40, 9, 300], gen)
        md = run_step(mixed, QUERY_LENS, CONTEXT_LENS, gen)
        clock[0] += stats.interval_s
        run_step(mixed, [1, 1], [5, 6], gen)
    plan = md.planned.plan
    assert (stats.planned, stats.split, stats.launches, stats.stock_calls) == (1, int(len(plan) > 1), len(plan), 2)
    assert stats.largest_launch_bytes == md.planned.reserved_peak <= mixed.impl.engine.stock_call_allowance
    assert md.planned.reserved_peak == plan.peak_beyond_workspace(64, mixed.impl.engine.workspace_heads)
    assert (md.planned.reserved_peak < plan.peak_bytes) == release.stock_workspace, "a workspace holds q and out"
    summaries = [line for line in lines if "since start-up" in line]
    assert len(summaries) == 1 and f"1 steps planned ({stats.split} split, {len(plan)} launches), 2 on vLLM's call" \
        in summaries[0], lines


def test_the_reservation_is_handed_over_only_once_vllm_serves(mixed: Backend, gen: torch.Generator,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CUDA-graph memory profiling runs forwards, planned ones too, against a minimal KV cache
    before it sizes the real one: bytes freed there lower its estimate and the KV cache takes
    them. The reservation is handed over at the first forward over a larger cache, once."""
    hold_reservation(mixed)
    assert mixed.impl.engine is not None
    reservation = mixed.impl.engine.state.reservation
    profiling_blocks = mixed.impl.engine.profiling_kv_blocks
    assert profiling_blocks == min(16, mixed.config.compilation_config.max_cudagraph_capture_size or 0) or 1
    case = mixed.step(QUERY_LENS, CONTEXT_LENS, gen)
    md, q = case["metadata"], case["q"]
    assert md.planned is not None
    mixed.topk_buffer[: q.shape[0]] = case["positions"]
    minimal = torch.zeros((profiling_blocks, 64, 656), dtype=torch.uint8)
    mixed.impl._forward_fp8_kv_mixed_batch(q, minimal, mixed.topk_buffer[: q.shape[0]], md)
    assert reservation.held(), "a forward over the profiling cache must not hand it over"
    mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[: q.shape[0]], md)
    assert case["kv_cache"].shape[0] > profiling_blocks and not reservation.held()


def test_the_reservation_is_handed_over_on_a_sized_cache_no_larger_than_the_profiling_one(
        mixed: Backend, gen: torch.Generator) -> None:
    """With ``--num-gpu-blocks-override`` at or below the profiling cache's blocks, both caches have
    the same blocks: once vLLM has made the builders of the cache it sized (it sets
    ``num_gpu_blocks`` first), a forward over that cache hands the reservation over."""
    hold_reservation(mixed)
    assert mixed.impl.engine is not None
    reservation = mixed.impl.engine.state.reservation

    def forward_over_the_profiling_blocks() -> None:
        assert mixed.impl.engine is not None
        blocks = mixed.impl.engine.profiling_kv_blocks
        case = mixed.step(QUERY_LENS, CONTEXT_LENS, gen)
        md, q = case["metadata"], case["q"]
        assert md.planned is not None
        mixed.topk_buffer[: q.shape[0]] = case["positions"]
        same_blocks = torch.zeros((blocks, 64, 656), dtype=torch.uint8)
        mixed.impl._forward_fp8_kv_mixed_batch(q, same_blocks, mixed.topk_buffer[: q.shape[0]], md)

    forward_over_the_profiling_blocks()  # the builder was made before vLLM set num_gpu_blocks
    assert reservation.held(), "no builder of a sized cache yet: this may be the profiling cache"
    mixed.config.cache_config.num_gpu_blocks = vllm_api.profiling_kv_blocks(mixed.config)
    mixed.builder = mixed.new_builder()  # vLLM's builder for the cache it sized, of as many blocks
    forward_over_the_profiling_blocks()
    assert not reservation.held()


def test_each_engine_in_a_process_reserves_hands_over_and_warms_up_its_own(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator) -> None:
    """Two engines side by side (two ``LLM`` objects, an RL trainer's colocated engines), and one
    made after another served: each reserves at its construction, hands over at its own first
    serving forward, and warms up once; the MTP draft's copy of an engine's configuration is that
    engine."""
    from vllm.config.utils import replace

    from mla_planner.vllm_backend import engine

    first, second = (Backend(tmp_path, monkeypatch, num_heads=16, real_reservation=True) for _ in range(2))
    try:
        states = [b.impl.engine.state for b in (first, second) if b.impl.engine is not None]
        assert len(states) == 2 and states[0] is not states[1]
        assert all(s.reservation.held() and s.reservation.reserved_bytes > 0 for s in states)
        draft = replace(first.config, attention_config=replace(first.config.attention_config, backend=None))
        assert draft is not first.config and engine.state_of(draft) is states[0]
        run_step(first, QUERY_LENS, CONTEXT_LENS, gen)
        assert not states[0].reservation.held() and not states[0].warm_up.pending
        assert states[1].reservation.held() and states[1].warm_up.pending, "the first engine served, not the second"
        run_step(second, QUERY_LENS, CONTEXT_LENS, gen)
        assert not states[1].reservation.held() and not states[1].warm_up.pending
    finally:
        first.close()
        second.close()
    later = Backend(tmp_path, monkeypatch, num_heads=16, real_reservation=True)
    try:
        assert later.impl.engine is not None and later.impl.engine.state.reservation.held()
    finally:
        later.close()


def test_decode_only_steps_of_several_tokens_each_are_planned(mixed: Backend, gen: torch.Generator) -> None:
    """vLLM (its newer releases) counts a request of up to 128 query tokens as a decode at 16 heads, and its start-up
    warm-up sends 32K such tokens through the decode kernel at once: a decode-only step that does not
    fit one launch of the budget runs in the plan's launches, as a step with prefills does."""
    mixed.builder.reorder_batch_threshold = 128  # whatever the release's own at 16 heads
    lens, contexts = [100] * 9, [0, 5, 300, 40, 0, 1000, 7, 64, 129]
    case = mixed.step(lens, contexts, gen)
    md, q = case["metadata"], case["q"]
    assert md.num_prefills == 0 and md.num_decodes == 9
    assert md.planned is not None and len(md.planned.plan) > 1, "900 tokens exceed one launch of the test budget"
    mixed.topk_buffer[: q.shape[0]] = case["positions"]
    out = forward_out(mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[: q.shape[0]], md))
    torch.testing.assert_close(out, case["expected"], rtol=1e-5, atol=1e-5)
    assert mixed.kernels.decode_calls == [], "stock's single call must not run"
    assert len(mixed.provider.launch_q) == len(md.planned.plan)


def test_decode_only_steps_of_several_tokens_each_are_planned_on_the_separate_route(separate: Backend,
                                                                                   gen: torch.Generator) -> None:
    """The same at 32 heads, where vLLM's rule takes the separate route: the decodes run in the
    plan's decode launches, never stock's one call."""
    separate.builder.reorder_batch_threshold = 128  # a release's own at 32 heads
    lens, contexts = [40] * 12, [0, 5, 300, 40, 0, 1000, 7, 64, 129, 3, 900, 50]
    case = separate.step(lens, contexts, gen)
    md, q = case["metadata"], case["q"]
    assert md.num_prefills == 0 and not md.fp8_use_mixed_batch
    assert md.planned is not None and len(md.planned.plan) > 1, "480 tokens at 32 heads exceed one launch of the budget"
    separate.topk_buffer[: q.shape[0]] = case["positions"]
    out = forward_out(separate.impl._forward_fp8_kv_separate_prefill_decode(
        q, case["kv_cache"], separate.topk_buffer[: q.shape[0]], md))
    torch.testing.assert_close(out, case["expected"], rtol=1e-5, atol=1e-5)
    assert separate.kernels.decode_calls == [], "stock's single call must not run"


@only_where(lambda f: f.index_groups, "no index groups")
@pytest.mark.parametrize("route", ["mixed", "separate"])
def test_a_planned_first_layer_fills_its_index_groups_topk_for_the_later_layers(
        route: str, request: pytest.FixtureRequest, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a model whose layers share one indexer's result (vLLM's index groups), vLLM's decode path
    of a later layer reads the slots the group's first layer converted into the group's buffer.
    The first layer running a decode-only step's plan fills that buffer as stock's does; a later
    layer whose planned launches fail runs the bounded path, translating its own slots."""
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    backend: Backend = request.getfixturevalue(route)
    impl: Any = backend.impl  # index-group attributes, which not every release's type has
    groups = SparseMLAIndexGroupBuilder(backend.topk_buffer, max_decode_rows=512)
    impl.index_group, impl.index_group_index = groups.register_layer(True)  # the first layer: the indexer's
    groups.register_layer(False)
    group = impl.index_group
    group.physical_topk_indices.zero_()  # an earlier step's slots
    group.valid_topk_counts.fill_(TOPK)
    backend.builder.reorder_batch_threshold = 128  # a release's own at 16 and 32 heads
    lens, contexts = [40] * 12, [0, 5, 300, 40, 0, 1000, 7, 64, 129, 3, 900, 50]
    case = backend.step(lens, contexts, gen)
    md, q = case["metadata"], case["q"]
    n = q.shape[0]
    assert md.num_prefills == 0 and md.planned is not None
    assert md.fp8_use_mixed_batch == (route == "mixed")
    backend.topk_buffer[:n] = case["positions"]
    forward = (impl._forward_fp8_kv_mixed_batch if route == "mixed" else impl._forward_fp8_kv_separate_prefill_decode)
    torch.testing.assert_close(forward_out(forward(q, case["kv_cache"], backend.topk_buffer[:n], md)),
                               case["expected"], rtol=1e-5, atol=1e-5)
    assert backend.kernels.decode_calls == [], "the first layer ran the plan"
    # The group's buffer holds this step's slots, valid ones first, with their counts.
    slots = request_slots(case["positions"], lens, md.block_table)
    counts = (slots >= 0).sum(1).to(torch.int32)
    assert torch.equal(group.valid_topk_counts[:n], counts)
    for row in range(n):
        assert torch.equal(group.physical_topk_indices[row, : counts[row]].sort().values,
                           slots[row][slots[row] >= 0].sort().values)

    name = "_run_mixed" if route == "mixed" else "_run_separate"
    run = getattr(impl, name)
    failed: list[int] = []

    def fail_once(*args: Any) -> Any:
        if not failed:
            failed.append(1)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return run(*args)

    impl.index_group_index = 1  # a later layer of the group, whose planned launches fail
    monkeypatch.setattr(impl, name, fail_once)
    out = forward_out(forward(q, case["kv_cache"], backend.topk_buffer[:n], md))
    assert failed and backend.kernels.decode_calls == [], "the bounded path, not vLLM's whole-step call, runs the layer"
    torch.testing.assert_close(out, case["expected"], rtol=1e-5, atol=1e-5)


def test_short_decode_steps_are_planned_where_they_can_outgrow_a_launch(mixed: Backend) -> None:
    """16 one-token decodes (the test's max_num_seqs) fit one launch of the 64 MiB test budget, so
    decode-only steps of up to 16 tokens run stock's code unplanned; 1,024 of them (vLLM's default
    max_num_seqs) would not, and then every decode-only step is planned."""
    from mla_planner.vllm_backend import engine

    assert mixed.builder.engine.stock_decode_tokens == mixed.config.scheduler_config.max_num_seqs == 16
    assert engine.stock_decode_tokens(mixed.builder.engine, 1024, 1) == 0


def test_decode_steps_run_unplanned_only_where_every_decode_shape_fits_a_launch(separate: Backend) -> None:
    """One-token decodes do not bound a decode batch's bytes on the separate route: at 32 heads and
    the 64 MiB test budget, 168 of them are one launch, but one request of 167 tokens fits no
    launch. Where vLLM counts such requests as decodes (its decode threshold), no decode step runs
    stock's code unplanned."""
    from mla_planner.vllm_backend import engine

    setup, config = separate.builder.engine, separate.builder.engine.config
    assert len(mla_planner.plan_step([1] * 168, [config.topk] * 168, 168, config)) == 1
    with pytest.raises(ValueError, match="one decode request"):
        mla_planner.plan_step([167], [config.topk], 1, config)
    roomy = dataclasses.replace(setup, stock_call_allowance=1 << 40)  # the budget alone decides here
    assert engine.stock_decode_tokens(dataclasses.replace(roomy, max_decode_query_len=1), 168, 1) == 168
    assert engine.stock_decode_tokens(dataclasses.replace(roomy, max_decode_query_len=167), 168, 1) == 0


@pytest.mark.parametrize("heads", [16, 32])
def test_decode_steps_run_unplanned_only_within_the_stock_call_allowance(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, heads: int) -> None:
    """Stock's decode call allocates its padded q and output itself: they must fit what the
    reservation holds for the kernels (the engine's allowance, which builder and impl share)."""
    from mla_planner.vllm_backend import engine

    backend = Backend(tmp_path, monkeypatch, num_heads=heads)
    try:
        setup = backend.builder.engine
        assert setup is backend.impl.engine, "one setup per engine, read by builder and impl"
        n = backend.config.scheduler_config.max_num_seqs
        one = dataclasses.replace(setup, max_decode_query_len=1)
        peak = mla_planner.plan_step([1] * n, [setup.config.topk] * n, n, setup.config).peak_bytes
        assert engine.stock_decode_tokens(dataclasses.replace(one, stock_call_allowance=peak), n, 1) == n
        assert engine.stock_decode_tokens(dataclasses.replace(one, stock_call_allowance=peak - 1), n, 1) == 0
    finally:
        backend.close()


def test_mixed_batch_impl_runs_the_planned_launches(mixed: Backend, gen: torch.Generator) -> None:
    case = mixed.step(QUERY_LENS, CONTEXT_LENS, gen)
    md, q = case["metadata"], case["q"]
    mixed.topk_buffer[: q.shape[0]] = case["positions"]
    plan = md.planned.plan
    for layer in range(2):  # two layers share the step's plan and schedules
        out = forward_out(mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[: q.shape[0]], md))
        torch.testing.assert_close(out, case["expected"], rtol=1e-5, atol=1e-5)
    launches = mixed.provider.launch_q
    assert len(launches) == 2 * len(plan)
    longest = plan.longest_launch("sparse_decode")
    for (start, end), launch_q in zip(plan.launches[:, :2].tolist(), launches):
        assert launch_q.shape == (1, end - start, 64, 576)
        assert torch.equal(launch_q[0, :, :16], q[start:end])
        assert not launch_q[0, :, 16:].any(), "padded heads must be zero"
    assert end - start <= longest
    lengths = {end - start for start, end in plan.launches[:, :2].tolist()}
    assert mixed.provider.schedules_created == len(lengths)
    assert mixed.kernels.decode_calls == [], "the stock single call must not run"


def test_mixed_decode_only_runs_stock(mixed: Backend, gen: torch.Generator) -> None:
    case = mixed.step([1, 1, 1], [40, 9, 300], gen)
    q = case["q"]
    mixed.topk_buffer[:3] = case["positions"]
    out = forward_out(mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[:3], case["metadata"]))
    torch.testing.assert_close(out, case["expected"], rtol=1e-5, atol=1e-5)
    assert mixed.kernels.decode_calls == [(1, 3, 64, 576)] and mixed.provider.launch_q == []


@pytest.fixture
def chat(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    """16 heads with a dense-MHA prefill backend, as vLLM serves a chat workload: short prefills
    (at most top-k tokens) never reach the sparse kernels."""
    backend = Backend(tmp_path, monkeypatch, num_heads=16, dense_prefill=True)
    yield backend
    backend.close()


# Three decodes and a new 40-token prompt: under top-k (128), so it runs dense MHA.
CHAT_QUERY_LENS, CHAT_CONTEXT_LENS = [1, 1, 1, 40], [70, 200, 5, 0]


def test_a_chat_step_runs_stocks_code_unplanned(chat: Backend, gen: torch.Generator) -> None:
    """Decodes next to a prefill vLLM runs dense: only the decode tokens reach the sparse kernels,
    as in a decode-only step, so the builder plans nothing and stock's code runs the step (its
    plan would be one decode launch, exactly stock's call)."""
    case = chat.step(CHAT_QUERY_LENS, CHAT_CONTEXT_LENS, gen)
    md = case["metadata"]
    assert not chat.builder.force_mqa and md.fp8_use_mixed_batch and md.num_prefills == 1
    assert getattr(md, "planned", None) is None
    plan = mla_planner.plan_step(CHAT_QUERY_LENS[:3], CHAT_CONTEXT_LENS[:3], 3, chat.builder.engine.config)
    assert plan.launches.tolist() == [[0, 3, 0, 3, -1]] and 3 <= chat.builder.engine.stock_decode_tokens
    q = case["q"][:3]  # vLLM hands the sparse kernels the decode tokens only
    chat.topk_buffer[:3] = case["positions"][:3]
    for _ in range(2):
        out = forward_out(chat.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], chat.topk_buffer[:3], md))
        torch.testing.assert_close(out, case["expected"][:3], rtol=1e-5, atol=1e-5)
    assert chat.kernels.decode_calls == [(1, 3, 64, 576)] * 2, "stock's one call per layer"
    assert chat.provider.launch_q == []


def test_a_prefill_past_top_k_beside_decodes_is_planned(chat: Backend, gen: torch.Generator) -> None:
    """The same engine, a prefill longer than top-k: vLLM sends every token to the sparse kernels,
    so the step is planned."""
    case = chat.step([1, 1, 1, TOPK + 1], CHAT_CONTEXT_LENS, gen)
    step = case["metadata"].planned
    assert step is not None and step.sparse_tokens == 3 + TOPK + 1


def test_a_plan_of_one_launch_runs_as_stocks_call(mixed: Backend, gen: torch.Generator) -> None:
    """Sparse prefill tokens too: a step the budget leaves whole is stock's one call."""
    case = mixed.step([1, 1, 100], [70, 9, 0], gen)
    md, q = case["metadata"], case["q"]
    assert md.planned.plan.launches[:, :2].tolist() == [[0, 102]]
    mixed.topk_buffer[:102] = case["positions"]
    out = forward_out(mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[:102], md))
    torch.testing.assert_close(out, case["expected"], rtol=1e-5, atol=1e-5)
    assert mixed.kernels.decode_calls == [(1, 102, 64, 576)] and mixed.provider.launch_q == []


def test_a_launch_over_the_stock_allowance_runs_the_planned_launches(mixed: Backend, gen: torch.Generator) -> None:
    """Where stock's call would allocate more than the reservation holds for it (with a vLLM
    workspace the reservation holds what this backend allocates beyond it, not the padded q and
    output stock allocates itself), the executor runs the plan's one launch."""
    case = mixed.step([1, 1, 100], [70, 9, 0], gen)
    md, q = case["metadata"], case["q"]
    assert mixed.impl.engine is not None
    mixed.impl.engine = dataclasses.replace(mixed.impl.engine, stock_call_allowance=md.planned.stock_call_bytes - 1)
    mixed.topk_buffer[:102] = case["positions"]
    out = forward_out(mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[:102], md))
    torch.testing.assert_close(out, case["expected"], rtol=1e-5, atol=1e-5)
    assert [tuple(x.shape) for x in mixed.provider.launch_q] == [(1, 102, 64, 576)] and mixed.kernels.decode_calls == []


def test_tokens_the_plan_does_not_cover_take_the_bounded_path(chat: Backend, gen: torch.Generator,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A layer call whose sparse tokens are not its plan's raises nothing: it takes the bounded
    path -- here vLLM's own call, the one bounded launch for its three tokens --, the reason is
    counted, and a debug line says so for the step log."""
    case = chat.step([1, 1, 1, TOPK + 1], CHAT_CONTEXT_LENS, gen)  # every token sparse: 132
    chat.topk_buffer[:3] = case["positions"][:3]
    with caplog.at_level(logging.DEBUG, logger="vllm.mla_planner"):
        out = forward_out(chat.impl._forward_fp8_kv_mixed_batch(case["q"][:3], case["kv_cache"], chat.topk_buffer[:3],
                                                                case["metadata"]))
    torch.testing.assert_close(out, case["expected"][:3], rtol=1e-5, atol=1e-5)
    assert chat.kernels.decode_calls == [(1, 3, 64, 576)] and chat.provider.launch_q == []
    reason = "vLLM handed the layer call other tokens than its plan's"
    assert chat.impl.engine is not None and chat.impl.engine.state.stats.fallbacks == {reason: 1}
    assert f"mla-planner layer: bounded path ({reason})" in [r.getMessage() for r in caplog.records]


def test_separate_decodes_next_to_a_dense_prefill_run_stocks_call(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                                   gen: torch.Generator) -> None:
    backend = Backend(tmp_path, monkeypatch, num_heads=32, dense_prefill=True)
    try:
        case = backend.step(CHAT_QUERY_LENS, CHAT_CONTEXT_LENS, gen)
        md = case["metadata"]
        assert not md.fp8_use_mixed_batch and getattr(md, "planned", None) is None  # decodes only: unplanned
        backend.topk_buffer[:3] = case["positions"][:3]
        out = forward_out(backend.impl._forward_fp8_kv_separate_prefill_decode(
            case["q"][:3], case["kv_cache"], backend.topk_buffer[:3], md))
        torch.testing.assert_close(out, case["expected"][:3], rtol=1e-5, atol=1e-5)
        assert backend.kernels.decode_calls == [(3, 1, 64, 576)] and backend.provider.launch_q == []
    finally:
        backend.close()


def test_separate_impl_runs_the_planned_launches(separate: Backend, gen: torch.Generator) -> None:
    case = separate.step(QUERY_LENS, CONTEXT_LENS, gen)
    md, q = case["metadata"], case["q"]
    assert not md.fp8_use_mixed_batch
    plan = md.planned.plan
    assert plan.mode == "separate_prefill_decode"
    assert plan.launches.tolist() == mla_planner.plan_step(QUERY_LENS, CONTEXT_LENS, 3, separate.builder.engine.config).launches.tolist()
    separate.topk_buffer[: q.shape[0]] = case["positions"]
    out = forward_out(separate.impl._forward_fp8_kv_separate_prefill_decode(q, case["kv_cache"], separate.topk_buffer[: q.shape[0]], md))
    torch.testing.assert_close(out, case["expected"], rtol=1e-4, atol=1e-4)
    kernels = plan.launch_kernels
    decode_rows = [row for row, k in zip(plan.launches.tolist(), kernels) if k == "sparse_decode"]
    prefill_rows = [row for row, k in zip(plan.launches.tolist(), kernels) if k == "sparse_prefill"]
    # One decode-kernel call per planned decode launch (batch x s_q x padded heads), stock's none.
    assert [tuple(q_.shape) for q_ in separate.provider.launch_q] == [(r[3] - r[2], 1, 64, 576) for r in decode_rows]
    assert separate.kernels.decode_calls == []
    # One prefill-kernel call per planned prefill launch, of exactly its tokens.
    assert [shape[0] for shape in separate.provider.prefill_calls] == [r[1] - r[0] for r in prefill_rows]
    assert len(prefill_rows) > len(plan.gather_chunks), "the test budget must cut a chunk's prefill"
    assert all(shape[1] == 64 for shape in separate.provider.prefill_calls)
    assert separate.kernels.prefill_calls == [], "stock's call must not run"
    # One padded q and one kernel output for the step, reused by every call; padded heads zero.
    assert len(set(separate.provider.prefill_out_ptrs)) == 1
    assert len(separate.provider.prefill_out_ptrs) == len(prefill_rows)
    assert all(not bool(kq[:, 32:].any()) for kq in separate.provider.prefill_q)
    assert separate.provider.gathers == len(plan.gather_chunks)


@only_where(lambda f: f.multi_page_blocks, "its FlashMLA sparse backend takes 64-row blocks only")
@pytest.mark.parametrize("block_size", [128, 256])
@pytest.mark.parametrize("num_heads", [16, 32])  # the mixed route and the separate one
@pytest.mark.parametrize("gap_rows", [0, 64])
def test_blocks_of_several_pages_run_planned(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                              gen: torch.Generator, block_size: int, num_heads: int,
                                              gap_rows: int) -> None:
    """With blocks of several 64-row pages (``--block-size 128`` on Hopper) the kernels read the
    cache as pages and the prefill gather reads it as blocks, whose ids the chunks' block tables
    hold: a planned step's output is the reference's, on either route, with no step left to vLLM.
    ``gap_rows``: the blocks lie that many rows apart beyond their own (a layout with the block
    outermost: each layer's block a slice of a larger one)."""
    backend = Backend(tmp_path, monkeypatch, num_heads=num_heads, block_size=block_size)
    try:
        case = backend.step(QUERY_LENS, CONTEXT_LENS, gen)
        md, q = case["metadata"], case["q"]
        if gap_rows:
            blocks = case["kv_cache"]
            spaced = blocks.new_zeros((blocks.shape[0], block_size + gap_rows, blocks.shape[2]))
            spaced[:, :block_size] = blocks
            case["kv_cache"] = spaced[:, :block_size]
        assert md.block_size == block_size and md.planned is not None
        backend.topk_buffer[: q.shape[0]] = case["positions"]
        topk = backend.topk_buffer[: q.shape[0]]
        assert backend.impl.engine is not None
        stats = backend.impl.engine.state.stats
        if num_heads == 16:
            assert md.planned.plan.mode == "mixed_batch"
            out = forward_out(backend.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], topk, md))
        else:
            assert md.planned.plan.mode == "separate_prefill_decode"
            out = forward_out(backend.impl._forward_fp8_kv_separate_prefill_decode(q, case["kv_cache"], topk, md))
            assert backend.provider.gathers == len(md.planned.plan.gather_chunks) > 0
        assert not stats.fallbacks, "a step fell back"
        torch.testing.assert_close(out, case["expected"], rtol=1e-4, atol=1e-4)
    finally:
        backend.close()


# A profile in which the separate route wins any prefill of more than a few hundred tokens:
# decode 10 + T us, prefill 200 + T/2 us, gather almost free.
ROUTING_PROFILE = {
    "format": mla_planner.COST_PROFILE_FORMAT,
    "arch": "sm90",
    "num_sms": NUM_SMS,
    "topk": TOPK,
    "environment": {"gpu": "CPU test", "driver": "-", "cuda": "-", "torch": "-", "kernels": "-", "gather": "-"},
    "sparse_decode": {"64": [[1, 11], [65536, 65546]], "128": [[1, 11], [65536, 65546]]},
    "sparse_prefill": {"64": [[2, 201], [65536, 32968]], "128": [[1, 204], [65536, 262344]]},
    "gather_upconvert": [[1000, 6], [1000000, 1005]],
}


def profiled(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, profile: dict[str, Any]) -> Iterator[Backend]:
    """A 16-head backend routed by ``profile``."""
    import json

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    backend = Backend(tmp_path, monkeypatch, num_heads=16, cost_profile=path)
    yield backend
    backend.close()


@pytest.fixture
def routed(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    yield from profiled(tmp_path, monkeypatch, ROUTING_PROFILE)


def test_cost_profile_puts_a_16_head_prefill_on_the_separate_route(routed: Backend, gen: torch.Generator) -> None:
    assert routed.builder.engine.cost_model is not None
    assert routed.builder.force_mqa, "no dense prefill backend here: every prefill is sparse MQA"
    case = routed.step(QUERY_LENS, CONTEXT_LENS, gen)
    md, q = case["metadata"], case["q"]
    # vLLM's rule would take mixed batch at 16 heads; the profile says separate is faster here.
    assert not md.fp8_use_mixed_batch and md.planned.plan.mode == "separate_prefill_decode"
    routed.topk_buffer[: q.shape[0]] = case["positions"]
    out = forward_out(routed.impl._forward_fp8_kv_separate_prefill_decode(q, case["kv_cache"], routed.topk_buffer[: q.shape[0]], md))
    torch.testing.assert_close(out, case["expected"], rtol=1e-4, atol=1e-4)
    assert routed.provider.prefill_calls and routed.kernels.prefill_calls == routed.kernels.decode_calls == []
    assert [tuple(x.shape) for x in routed.provider.launch_q] == [(3, 1, 64, 576)], "the three decodes: one planned launch"
    # A short prefill stays on the mixed route, where the profile prices it cheaper.
    small = routed.step([1, 1, 40], [70, 200, 0], gen)["metadata"]
    assert small.fp8_use_mixed_batch and small.planned.plan.mode == "mixed_batch"


# A planner bug (a Rust panic) arrives as pyo3's PanicException, a BaseException.
FAILURES = [RuntimeError, mla_planner.PanicException]


def fallbacks(backend: Backend) -> int:
    """Steps of the backend's engine that fell back to the bounded path."""
    assert backend.impl.engine is not None
    return sum(backend.impl.engine.state.stats.fallbacks.values())


def bounded_launches(backend: Backend, tokens: int, rung: int = 0) -> list[tuple[int, ...]]:
    """The q shapes of the bounded path's launches of ``tokens`` tokens at ``rung``; each
    launch's bytes checked to be within the engine's allowance."""
    setup = backend.impl.engine
    assert setup is not None
    plan = mla_planner.plan_step([tokens], [0], 0, setup.bounded_configs[rung])
    assert all(launch.bytes <= setup.stock_call_allowance for launch in plan)
    return [(1, launch.tokens.stop - launch.tokens.start, 64, 576) for launch in plan]


def layer_calls(backend: Backend, case: dict[str, Any], layers: int = 2, rtol: float = 1e-4) -> None:
    """The step's FP8 forward on each of ``layers`` layers, each checked against the reference."""
    md, q = case["metadata"], case["q"]
    n = q.shape[0]
    backend.topk_buffer[:n] = case["positions"]
    for _ in range(layers):
        out = forward_out(backend.fp8_forward(md)(q, case["kv_cache"], backend.topk_buffer[:n], md))
        torch.testing.assert_close(out, case["expected"], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("error", [*FAILURES, torch.OutOfMemoryError])
def test_a_layer_call_that_cannot_run_its_plan_falls_back_within_the_reservation(
        routed: Backend, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]) -> None:
    """An error while a layer call runs its plan raises nothing: the call runs the bounded path,
    mixed-batch launches each within the reservation's allowance, and so do the step's later
    layers, without trying the plan again; the step is counted once, by reason. vLLM's own call
    over the whole step never runs."""
    case = routed.step(QUERY_LENS, CONTEXT_LENS, gen)
    md = case["metadata"]
    assert not md.fp8_use_mixed_batch and md.planned.vllm_route is not None and md.planned.vllm_route[0]
    tried: list[int] = []

    def fail(*args: Any, **kwargs: Any) -> None:
        tried.append(1)
        raise error("a launch failed")

    monkeypatch.setattr(routed.impl.separate, "run", fail)
    layer_calls(routed, case)
    assert tried == [1], "the step decided once: its second layer went straight to the bounded path"
    bounded = bounded_launches(routed, sum(QUERY_LENS))
    assert len(bounded) > 1 and [tuple(x.shape) for x in routed.provider.launch_q] == bounded * 2
    assert routed.kernels.decode_calls == [] and routed.kernels.prefill_calls == [], "vLLM's whole-step call never ran"
    reason = ("an allocation failed in a planned launch" if error is torch.OutOfMemoryError
              else f"the layer call could not run its plan ({error.__name__})")
    assert routed.impl.engine is not None and routed.impl.engine.state.stats.fallbacks == {reason: 1}
    assert not md.fp8_use_mixed_batch and md.planned.bounded is not None, "the step's metadata is left as planned"


def test_an_allocation_failure_in_a_split_steps_second_launch_frees_the_first_then_falls_back(
        mixed: Backend, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planned launches' buffers -- what the failed launch and the exception's frames held --
    are gone before the bounded path's first launch allocates."""
    import weakref

    case = mixed.step(QUERY_LENS, CONTEXT_LENS, gen)
    assert len(case["metadata"].planned.launches) > 1
    decode = mixed.provider.sparse_decode
    launches: list[int] = []
    held: list[weakref.ref[torch.Tensor]] = []

    def second_fails(q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        launches.append(q.shape[1])
        if len(launches) == 2:
            scratch = torch.empty(1 << 16)  # what the kernel had allocated when it failed
            held.append(weakref.ref(scratch))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        if len(launches) > 2:
            assert held and held[0]() is None, "the failed launch's buffers outlived it"
        return decode(q, *args, **kwargs)

    monkeypatch.setattr(mixed.provider, "sparse_decode", second_fails)
    layer_calls(mixed, case)
    bounded = [shape[1] for shape in bounded_launches(mixed, sum(QUERY_LENS))]
    assert launches[2:] == bounded * 2


def test_an_allocation_failure_on_the_bounded_path_takes_smaller_launches(
        mixed: Backend, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where memory is short even for the bounded launches, each retry's launches take a quarter of
    the bytes; the step's later layers start at the rung that ran."""
    case = mixed.step(QUERY_LENS, CONTEXT_LENS, gen)
    decode = mixed.provider.sparse_decode
    lengths: list[int] = []

    def only_short(q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        lengths.append(q.shape[1])
        if q.shape[1] > 40:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return decode(q, *args, **kwargs)

    monkeypatch.setattr(mixed.provider, "sparse_decode", only_short)
    layer_calls(mixed, case)
    assert mixed.impl.engine is not None
    rungs = mixed.impl.engine.bounded_configs
    ran = next(r for r in range(len(rungs)) if max(s[1] for s in bounded_launches(mixed, sum(QUERY_LENS), r)) <= 40)
    assert ran >= 1, "the first rung's launches fit the test's memory: nothing to retry"
    second_layer = [s[1] for s in bounded_launches(mixed, sum(QUERY_LENS), ran)]
    assert lengths[-len(second_layer):] == second_layer
    assert sum(1 for n in lengths if n > 40) == ran + 1, "one failed launch per rung above, the plan's included"


def test_a_failure_no_bounded_path_avoids_reaches_vllm_in_one_line(
        mixed: Backend, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not even one-token launches allocate: an OutOfMemoryError naming the call's tokens and the
    bytes asked. Another error on the bounded path too: a RuntimeError saying so. Both counted."""
    case = mixed.step(QUERY_LENS, CONTEXT_LENS, gen)
    md, q = case["metadata"], case["q"]
    n = q.shape[0]
    mixed.topk_buffer[:n] = case["positions"]

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(mixed.provider, "sparse_decode", no_memory)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[:n], md)
    message = str(raised.value)
    assert "\n" not in message and f"a layer call of {n:,} tokens" in message and "bytes asked" in message
    assert "launches of 1 tokens" in message and "an allocation failed in a planned launch" in message

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("an illegal shape")

    case = mixed.step(QUERY_LENS, CONTEXT_LENS, gen)
    monkeypatch.setattr(mixed.provider, "sparse_decode", broken)
    with pytest.raises(RuntimeError, match=f"a layer call of {n:,} tokens failed on the bounded path too"):
        mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[:n], case["metadata"])
    assert mixed.impl.engine is not None and mixed.impl.engine.state.stats.unavoidable == 2


def test_where_vllms_one_call_fails_the_steps_layers_run_the_bounded_launches(
        mixed: Backend, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of one bounded launch on vLLM's mixed route runs vLLM's own call; where that call
    fails otherwise than for memory, the layer call runs the bounded launch itself, and the step's
    later layers do so without trying vLLM's call again."""
    from mla_planner import routing

    def refuse(*args: Any) -> Any:
        raise ValueError("a step no rule admits")

    def broken(*args: Any, **kwargs: Any) -> Any:
        tried.append(1)
        raise RuntimeError("vLLM's call failed")

    tried: list[int] = []
    monkeypatch.setattr(routing, "choose_plan", refuse)
    case = mixed.step([1, 1, 1, 40], [70, 200, 5, 0], gen)
    assert isinstance(case["metadata"].planned, fallback.BoundedStep)
    assert len(bounded_launches(mixed, 43)) == 1
    monkeypatch.setattr(fallback, "stock_forward", broken)
    layer_calls(mixed, case)
    assert tried == [1], "the second layer did not try vLLM's call again"
    assert [tuple(x.shape) for x in mixed.provider.launch_q] == bounded_launches(mixed, 43) * 2


def test_a_layer_call_of_no_tokens_on_the_bounded_path_returns_an_empty_output(
        mixed: Backend, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_planner import routing

    def refuse(*args: Any) -> Any:
        raise ValueError("a step no rule admits")

    monkeypatch.setattr(routing, "choose_plan", refuse)
    case = mixed.step(QUERY_LENS, CONTEXT_LENS, gen)
    out = forward_out(mixed.impl._forward_fp8_kv_mixed_batch(case["q"][:0], case["kv_cache"], mixed.topk_buffer[:0],
                                                             case["metadata"]))
    assert tuple(out.shape) == (0, 16, 512) and mixed.provider.launch_q == [] and mixed.kernels.decode_calls == []


@pytest.mark.parametrize("error", FAILURES)
def test_a_step_whose_launches_cannot_be_derived_keeps_vllms_route_and_takes_the_bounded_path(
        routed: Backend, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]) -> None:
    """The builder changes the step's metadata only once the whole plan is derived: a failure
    while deriving it leaves vLLM's route and metadata as vLLM's rule built them, and the step's
    layer calls take the bounded path on them."""
    from mla_planner.vllm_backend import backend

    class Failing:
        @classmethod
        def of(cls, *args: Any) -> None:
            raise error("no launches")

    monkeypatch.setattr(backend, "SeparateLaunches", Failing)
    case = routed.step(QUERY_LENS, CONTEXT_LENS, gen)
    md = case["metadata"]
    assert md.fp8_use_mixed_batch and isinstance(md.planned, fallback.BoundedStep)
    layer_calls(routed, case)
    assert [tuple(x.shape) for x in routed.provider.launch_q] == bounded_launches(routed, sum(QUERY_LENS)) * 2
    assert routed.kernels.decode_calls == []
    reason = f"the step could not be planned ({error.__name__})"
    assert routed.impl.engine is not None and routed.impl.engine.state.stats.fallbacks == {reason: 1}


# ROUTING_PROFILE with the prefill kernel at 16 native heads: 50 + T/10 us, cheaper than padded.
NATIVE_PROFILE = dict(ROUTING_PROFILE, sparse_prefill={
    "64": [[2, 201], [65536, 32968]], "128": [[1, 204], [65536, 262344]], "16": [[1, 50.1], [65536, 6603.6]]})


@pytest.fixture
def native_routed(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    yield from profiled(tmp_path, monkeypatch, NATIVE_PROFILE)


def prefill_rows(plan: mla_planner.StepPlan) -> list[list[int]]:
    return [row for row, k in zip(plan.launches.tolist(), plan.launch_kernels) if k == "sparse_prefill"]


def test_a_native_plan_runs_the_prefill_kernel_at_16_heads(native_routed: Backend, gen: torch.Generator) -> None:
    """A profile that prices 16 native heads cheaper: where vLLM's FlashMLA has the unpadded
    kernels the plan runs the prefill kernel on the rank's 16 heads, q unpadded and the kernel
    writing the step's output rows in place; elsewhere the profile is not used."""
    if not FACTS.native_prefill_kernels:
        assert native_routed.builder.engine.cost_model is None, "this release cannot run what this profile may choose"
        assert native_routed.step(QUERY_LENS, CONTEXT_LENS, gen)["metadata"].planned.plan.mode == "mixed_batch"
        return
    assert native_routed.builder.engine.cost_model is not None
    case = native_routed.step(QUERY_LENS, CONTEXT_LENS, gen)
    md, q = case["metadata"], case["q"]
    plan = md.planned.plan
    assert (plan.mode, plan.prefill_heads, plan.prefill_writes_in_place) == ("separate_prefill_decode", 16, True)
    config = native_routed.builder.engine.config.replace(mode="separate_prefill_decode", native_prefill_heads=True)
    assert plan.launches.tolist() == mla_planner.plan_step(QUERY_LENS, CONTEXT_LENS, 3, config).launches.tolist()
    native_routed.topk_buffer[: q.shape[0]] = case["positions"]
    out = forward_out(native_routed.impl._forward_fp8_kv_separate_prefill_decode(
        q, case["kv_cache"], native_routed.topk_buffer[: q.shape[0]], md))
    torch.testing.assert_close(out, case["expected"], rtol=1e-4, atol=1e-4)
    kernels = native_routed.provider
    rows = prefill_rows(plan)
    assert [shape[:2] for shape in kernels.prefill_calls] == [(r[1] - r[0], 16) for r in rows]
    # No padded q: each call reads the step's q rows as they are and writes the step's output rows.
    assert kernels.prefill_out_ptrs == [out[r[0]].data_ptr() for r in rows]
    assert all(torch.equal(kq, q[r[0]:r[1]]) for kq, r in zip(kernels.prefill_q, rows))


@only_where(lambda f: f.native_prefill_kernels, "no native plan runs (the test above checks the profile is dropped)")
def test_a_one_launch_native_plan_is_not_stocks_call(native_routed: Backend, gen: torch.Generator) -> None:
    """Stock's own call pads q to 64 heads: a native plan of one launch runs through the backend."""
    case = native_routed.step([520], [130], gen)
    md, q = case["metadata"], case["q"]
    assert len(md.planned.plan) == 1 and md.planned.plan.prefill_heads == 16
    assert md.planned.stock_call_bytes is None
    native_routed.topk_buffer[: q.shape[0]] = case["positions"]
    out = forward_out(native_routed.impl._forward_fp8_kv_separate_prefill_decode(
        q, case["kv_cache"], native_routed.topk_buffer[: q.shape[0]], md))
    torch.testing.assert_close(out, case["expected"], rtol=1e-4, atol=1e-4)
    assert native_routed.provider.prefill_calls == [(520, 16, 576)]


@pytest.mark.parametrize("family", [90, 100])
def test_prefill_padding_is_the_impls(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, family: int) -> None:
    """The plan pads the prefill kernel's q as this vLLM's impl does: 64 heads on Hopper; on
    Blackwell 128 or 64 as the release's FlashMLA has the 64-head kernel there or not."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_device_capability_family", lambda f, device_id=0: f == family)
    backend = Backend(tmp_path, monkeypatch, num_heads=16)
    try:
        config = backend.builder.engine.config
        assert config.arch == ("sm100" if family == 100 else "sm90")
        assert config.prefill_padding == backend.impl.prefill_padding
        assert config.prefill_padded_heads == dict(FACTS.prefill_padded_heads)[config.arch]
        plan = mla_planner.plan_step([40_000], [0], 0, config.replace(mode="separate_prefill_decode"))
        assert plan.prefill_heads == config.prefill_padded_heads
    finally:
        backend.close()


@pytest.mark.parametrize("num_heads", [32, 64])
def test_asking_for_native_prefill_heads(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator,
                                         num_heads: int) -> None:
    """MLA_PLANNER_NATIVE_PREFILL_HEADS=1: every separate step at the rank's own heads where vLLM's
    FlashMLA has the unpadded kernels and the heads are 16 or 32; refused at start-up, in one line,
    anywhere else."""
    monkeypatch.setenv("MLA_PLANNER_NATIVE_PREFILL_HEADS", "1")
    if not FACTS.native_prefill_kernels or num_heads == 64:
        with pytest.raises(SettingsError) as err:
            Backend(tmp_path, monkeypatch, num_heads=num_heads).close()
        message = str(err.value)
        assert message.startswith("MLA_PLANNER_NATIVE_PREFILL_HEADS=1: ") and "\n" not in message, message
        assert ("also at 16 and 32" in message) if not FACTS.native_prefill_kernels else "16 or 32" in message, message
        assert "unset MLA_PLANNER_NATIVE_PREFILL_HEADS" in message
        return
    backend = Backend(tmp_path, monkeypatch, num_heads=num_heads)
    try:
        assert backend.builder.engine.config.native_prefill_heads
        case = backend.step(QUERY_LENS, CONTEXT_LENS, gen)
        md, q = case["metadata"], case["q"]
        assert (md.planned.plan.mode, md.planned.plan.prefill_heads) == ("separate_prefill_decode", num_heads)
        backend.topk_buffer[: q.shape[0]] = case["positions"]
        out = forward_out(backend.impl._forward_fp8_kv_separate_prefill_decode(q, case["kv_cache"], backend.topk_buffer[: q.shape[0]], md))
        torch.testing.assert_close(out, case["expected"], rtol=1e-4, atol=1e-4)
        assert {shape[1] for shape in backend.provider.prefill_calls} == {num_heads}
    finally:
        backend.close()


def test_no_profile_is_vllms_rule(mixed: Backend) -> None:
    assert mixed.builder.engine.cost_model is None


HERE = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.1", "cuda": "13.0", "torch": "2.11.0",
        "kernels": f"vllm {vllm_api.installed_version()}", "gather": f"vllm {vllm_api.installed_version()} cp_gather_and_upconvert_fp8_kv_cache"}


class FirstStart:
    """An engine start on a GPU whose environment no packaged profile names: the measurement a
    stand-in that prices the separate route cheap (counted), the cache under ``tmp``."""

    def __init__(self, tmp: pathlib.Path, monkeypatch: pytest.MonkeyPatch, environment: dict[str, str] = HERE) -> None:
        from mla_planner import routing
        from mla_planner.vllm_backend import engine

        self.measured = 0
        self.profile: dict[str, Any] = dict(ROUTING_PROFILE, environment=environment)
        if release.native_prefill_kernels:  # the grid times the prefill kernel at native heads where it runs them
            prefill: Any = ROUTING_PROFILE["sparse_prefill"]
            self.profile["sparse_prefill"] = {**prefill, "16": [[1, 150], [65536, 9000]]}
        monkeypatch.setenv("MLA_PLANNER_CACHE_DIR", str(tmp / "cache"))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the machine check runs on a GPU only
        monkeypatch.setattr(routing, "current_environment", lambda kernels, gather: dict(environment))
        monkeypatch.setattr(engine, "measure_first_start", self.measure)
        monkeypatch.setattr(engine, "_found", {})  # a fresh process

    def measure(self, grid: Any, device: torch.device) -> dict[str, Any]:
        self.measured += 1
        return self.profile

    def setup(self, backend: Backend) -> Any:
        from mla_planner.vllm_backend import engine

        return engine.make_setup(backend.config, backend.num_heads, torch.device("cpu"), read_settings())


def test_an_engine_without_a_profile_for_its_machine_measures_one_at_its_first_start_and_caches_it(
    mixed: Backend, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Unset: no packaged profile names this machine, none cached: measured once, cached, said in
    one line (a second setup in the process, as vLLM's builders make, is told the same); the
    next process reads the cache; both route by it (both FP8 routes)."""
    from mla_planner.vllm_backend import engine, log

    start = FirstStart(tmp_path, monkeypatch)
    monkeypatch.delenv("MLA_PLANNER_COST_PROFILE")
    log._said.clear()
    with caplog.at_level(logging.INFO, logger="vllm.mla_planner"):
        first = start.setup(mixed)
        assert start.setup(mixed).cost_model is not None
        engine._found.clear()  # the next process
        second = start.setup(mixed)
    assert start.measured == 1
    assert first.cost_model is not None and second.cost_model is not None
    assert first.routes == second.routes == ("mixed_batch", "separate_prefill_decode")
    lines = [r.getMessage() for r in caplog.records if "cost profile" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "measured one in" in lines[0] and str(tmp_path / "cache" / "profiles") in lines[0]
    assert "MLA_PLANNER_COST_PROFILE" in lines[0]  # how to skip it
    assert "measured on this machine at an earlier start" in lines[1]


def test_none_skips_the_measurement_and_routes_by_vllms_rule(
    mixed: Backend, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = FirstStart(tmp_path, monkeypatch)
    setup = start.setup(mixed)  # the fixture set MLA_PLANNER_COST_PROFILE=none
    assert (setup.cost_model, setup.routes, start.measured) == (None, ("mixed_batch",), 0)


def test_sleep_mode_measures_nothing_at_start_up(
    mixed: Backend, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mla_planner.vllm_backend import log

    start = FirstStart(tmp_path, monkeypatch)
    monkeypatch.delenv("MLA_PLANNER_COST_PROFILE")
    mixed.config.model_config.enable_sleep_mode = True
    log._said.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.mla_planner"):
        setup = start.setup(mixed)
    assert (setup.cost_model, start.measured) == (None, 0)
    assert any("sleep mode" in r.getMessage() and "vLLM's rule" in r.getMessage() for r in caplog.records)


class TensorParallelGroup:
    """vLLM's tensor-parallel group coordinator for one rank of two, in one process: rank 0's
    broadcast is kept for rank 1 to receive."""

    sent: list[Any] = []

    def __init__(self, rank: int) -> None:
        self.world_size, self.rank_in_group = 2, rank

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        if self.rank_in_group == src:
            TensorParallelGroup.sent.append(obj)
            return obj
        return TensorParallelGroup.sent.pop(0)


def test_tensor_parallel_ranks_route_by_the_first_ranks_profile(
    mixed: Backend, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 measures and shares; rank 1, whose own cache holds another machine's profile,
    measures nothing and takes rank 0's: every step gets the same route on both."""
    from vllm.distributed import parallel_state

    from mla_planner import routing

    start = FirstStart(tmp_path, monkeypatch)
    monkeypatch.delenv("MLA_PLANNER_COST_PROFILE")
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    setups = []
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "get_tp_group", lambda rank=rank: TensorParallelGroup(rank))
        if rank == 1:  # what rank 1 would find alone: another cache, whose profile routes otherwise
            monkeypatch.setenv("MLA_PLANNER_CACHE_DIR", str(tmp_path / "rank1-cache"))
            monkeypatch.setattr(routing, "current_environment", lambda kernels, gather: dict(HERE, driver="9"))
        setups.append(start.setup(mixed))
    assert start.measured == 1 and TensorParallelGroup.sent == []
    rank0, rank1 = setups
    assert rank0.cost_model is not None and rank1.cost_model is not None
    assert rank1.cost_model.environment == rank0.cost_model.environment == HERE
    for query_lens, context_lens, decodes in (([1] * 4 + [3000], [900] * 4 + [0], 4), ([64], [0], 0), ([1] * 8, [5000] * 8, 8)):
        modes = {routing.choose_plan(s.cost_model, query_lens, context_lens, decodes, s.config).mode for s in setups}
        assert len(modes) == 1, (query_lens, modes)


# -- vLLM's workspace manager's views (where a release has one); the reservation on any release ----

needs_workspace = only_where(lambda f: f.stock_workspace, "no workspace manager")


def bf16_case(backend: Backend, gen: torch.Generator, query_lens: list[int] = QUERY_LENS,
              context_lens: list[int] = CONTEXT_LENS) -> dict[str, Any]:
    """A step with a bf16 q, as vLLM runs it (the workspace views are bf16); the reference in
    float32 from the same q."""
    case = backend.step(query_lens, context_lens, gen)
    case["q"] = case["q"].to(torch.bfloat16)
    slots = request_slots(case["positions"], query_lens, case["metadata"].block_table)
    case["expected"] = reference_output(case["q"].float(), case["kv_cache"], slots, 576**-0.5)
    backend.topk_buffer[: case["q"].shape[0]] = case["positions"]
    return case


def view_ptr(view: torch.Tensor | None) -> int:
    assert view is not None
    return view.data_ptr()


@needs_workspace
def test_mixed_batch_pads_in_stocks_unused_prefill_views(mixed: Backend, gen: torch.Generator) -> None:
    case = bf16_case(mixed, gen)
    md, q = case["metadata"], case["q"]
    out = forward_out(mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[: q.shape[0]], md))
    torch.testing.assert_close(out.float(), case["expected"], rtol=2e-2, atol=2e-2)
    views = release.workspace_views(mixed.impl)
    assert len(mixed.provider.launch_ptrs) == len(md.planned.plan) > 1
    assert set(mixed.provider.launch_ptrs) == {(view_ptr(views.q_padded()), view_ptr(views.padded_out()))}
    assert out.data_ptr() == view_ptr(views.compact_out()), "several launches write the step's output view"


@needs_workspace
def test_a_step_of_one_planned_launch_returns_the_kernels_output_as_stock_does(
        mixed: Backend, gen: torch.Generator) -> None:
    """A step the plan runs in one launch (stock's call is over the allowance, the launch beyond
    the workspace is not) returns the kernel's output in the padded-output view, its real heads
    (strided), as stock's call returns its own: no copy, no second output."""
    case = bf16_case(mixed, gen, [1, 1, 1, 150], [70, 200, 5, 130])
    md, q = case["metadata"], case["q"]
    step, setup = md.planned, mixed.impl.engine
    assert setup is not None and len(step.plan) == 1 and step.stock_call_bytes > setup.stock_call_allowance
    out = forward_out(mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"], mixed.topk_buffer[: q.shape[0]], md))
    torch.testing.assert_close(out.float(), case["expected"], rtol=2e-2, atol=2e-2)
    views = release.workspace_views(mixed.impl)
    assert mixed.provider.launch_ptrs == [(view_ptr(views.q_padded()), view_ptr(views.padded_out()))]
    assert out.data_ptr() == view_ptr(views.padded_out()) and out.shape == (q.shape[0], 16, 512)
    assert out.stride() == (64 * 512, 512, 1), "the real heads of the 64 the kernel ran"


@needs_workspace
def test_once_vllm_locks_its_workspace_a_steps_layers_share_their_views(
        mixed: Backend, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Views are made anew per call while the manager may still grow its buffer; once it is
    locked (vLLM serves), the step's later layers reuse the first's, per micro-batch."""
    from vllm.v1.worker.workspace import lock_workspace, unlock_workspace

    from mla_planner.vllm_backend.releases import v0_33

    case = bf16_case(mixed, gen)
    md, q = case["metadata"], case["q"]
    memo = md.planned.workspace
    first = release.workspace_views(mixed.impl, memo)
    assert release.workspace_views(mixed.impl, memo) is not first and not memo, "unlocked: nothing kept"
    lock_workspace()
    try:
        for _layer in range(2):
            out = forward_out(mixed.impl._forward_fp8_kv_mixed_batch(q, case["kv_cache"],
                                                                     mixed.topk_buffer[: q.shape[0]], md))
            torch.testing.assert_close(out.float(), case["expected"], rtol=2e-2, atol=2e-2)
        assert len(memo) == 1
        kept = release.workspace_views(mixed.impl, memo)
        assert kept is next(iter(memo.values()))
        assert kept.q_padded(8) is kept.q_padded(8), "a view of the same rows is made once"
        monkeypatch.setattr(v0_33._ubatching, "dbo_current_ubatch_id", lambda: 1)
        assert release.workspace_views(mixed.impl, memo) is not kept and len(memo) == 2, "another micro-batch's own"
        monkeypatch.setattr(v0_33, "_workspace_lane", None)  # a vLLM without the lane variable
        assert release.workspace_views(mixed.impl, memo) is not release.workspace_views(mixed.impl, memo)
    finally:
        unlock_workspace()
    assert {ptrs for ptrs in mixed.provider.launch_ptrs} == {(view_ptr(kept.q_padded()), view_ptr(kept.padded_out()))}


@needs_workspace
def test_a_workspace_placed_elsewhere_than_the_layout_reads_is_a_start_up_error(
        mixed: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_planner.vllm_backend.releases import v0_33

    manager = v0_33._workspace.current_workspace_manager()
    real = manager.get_simultaneous

    def shifted(*specs: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
        """Stock's request placed 256 bytes further on than the single span the backend asks for."""
        views: list[torch.Tensor] = real(((256,), torch.uint8), *specs)[1:] if len(specs) > 1 else real(*specs)
        return views

    monkeypatch.setattr(manager, "get_simultaneous", shifted)
    with pytest.raises(RuntimeError, match="elsewhere than this backend reads it"):
        release.workspace_layout(mixed.impl)


@needs_workspace
def test_a_workspace_view_is_never_longer_than_its_spec(mixed: Backend) -> None:
    layout = mixed.impl.workspace_layout
    assert layout is not None and layout.q_padded is not None
    views = release.workspace_views(mixed.impl)
    rows = layout.q_padded.shape[0]
    assert view_ptr(views.q_padded(rows)) == view_ptr(views.q_padded())
    with pytest.raises(ValueError, match="rows of a workspace view"):
        views.q_padded(rows + 1)  # past it lies the next spec's memory


@needs_workspace
def test_separate_route_runs_in_stocks_workspace_views(separate: Backend, gen: torch.Generator) -> None:
    case = bf16_case(separate, gen)
    md, q = case["metadata"], case["q"]
    out = forward_out(separate.impl._forward_fp8_kv_separate_prefill_decode(q, case["kv_cache"], separate.topk_buffer[: q.shape[0]], md))
    torch.testing.assert_close(out.float(), case["expected"], rtol=2e-2, atol=2e-2)
    views = release.workspace_views(separate.impl)
    q_padded, padded_out = view_ptr(views.q_padded()), view_ptr(views.padded_out())
    assert out.data_ptr() == view_ptr(views.compact_out()), "the step's output is stock's, as stock's is"
    assert len(separate.provider.prefill_calls) > 1
    assert set(separate.provider.prefill_q_ptrs) == {q_padded}
    assert set(separate.provider.prefill_out_ptrs) == {padded_out}
    # The decode launches pad q and take the kernel's output in the same views.
    assert {ptrs for ptrs in separate.provider.launch_ptrs} == {(q_padded, padded_out)}


class FakeWorkspaceManager:
    """vLLM's workspace manager as far as stock's impl uses it at construction: records each request."""

    def __init__(self) -> None:
        self.requests: list[tuple[tuple[tuple[int, ...], torch.dtype], ...]] = []

    def get_simultaneous(self, *specs: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
        self.requests.append(specs)
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]


@only_where(lambda f: not f.stock_workspace, "its impl reserves a workspace: the next test")
def test_construction_reserves_the_budget_and_the_output_where_vllm_has_no_workspace(mixed: Backend) -> None:
    """Without vLLM's workspace the reservation holds the largest launch (the budget bounds it) and
    the step's output, which the executors allocate."""
    setup = mixed.impl.engine
    assert setup is not None and setup.stock_call_allowance <= SCRATCH_MB << 20
    assert setup.stock_call_allowance == setup.config.largest_launch_bytes(2048, 128, None)
    output = 2048 * 16 * 512 * 2  # max_num_batched_tokens x heads x kv_lora_rank, bf16
    assert mixed.reserved == [setup.stock_call_allowance + output]


@needs_workspace
@pytest.mark.parametrize("num_heads", [16, 32])
def test_construction_reserves_the_largest_launch_beyond_stocks_workspace(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, num_heads: int) -> None:
    """At construction (vLLM counts it as model memory; its DeepSeek-V3.2 layer calls no impl
    hook in the profile run) stock's impl requests its workspace, whose padded q and output views
    hold every launch's, and the backend reserves the rest of the largest launch any plan of the
    engine's limits runs, on every route a step may take (with a cost profile either, and where the
    release has them native prefill heads: the next test)."""
    manager = FakeWorkspaceManager()
    import vllm.v1.attention.backends.mla.flashmla_sparse as stock_module

    monkeypatch.setattr(stock_module, "current_workspace_manager", lambda: manager)
    backend = Backend(tmp_path, monkeypatch, num_heads=num_heads)
    backend.close()
    setup = backend.impl.engine
    assert setup is not None and setup.max_step_tokens == 2048 and setup.max_decode_query_len == 128
    config = setup.config
    routes = setup.route_configs()  # no cost profile here: vLLM's rule's one route
    assert [c.mode for c in routes] == [config.mode]
    largest = [c.largest_launch_bytes(2048, 128, 64) for c in routes]
    # Every launch of every plan the limits admit stays within it (the planner's property tests
    # cover random steps; here, steps of the engine's largest size on each route).
    for c in routes:
        for q, d in (([2048], 0), ([1] * 16 + [2032], 16), ([128] * 16, 16)):
            plan = mla_planner.plan_step(q, [0] * len(q), d, c)
            for launch in plan:
                buffers = launch.scratch.buffers
                heads = config.decode_heads if launch.kernel == "sparse_decode" else plan.prefill_heads
                served = buffers.get("q_padded", 0) + buffers.get("out", 0) if heads == 64 else 0
                assert launch.bytes - served <= max(largest)
    assert backend.reserved == [max(largest)] == [setup.stock_call_allowance]

    specs: Any = getattr(backend.impl, "workspace_specs")  # the workspace's; mypy may read a release without it
    assert manager.requests == [tuple(specs)], "stock's impl reserves its whole workspace at construction"
    (q_rows, q_heads, q_width), q_dtype = specs[-3]
    (o_rows, o_heads, o_width), o_dtype = specs[-2]
    assert (q_heads, q_width, o_heads, o_width) == (64, 576, 64, 512) and q_rows == o_rows == 2048
    assert q_dtype == o_dtype == torch.bfloat16


def test_the_process_settings_are_read_once_per_set_of_values(monkeypatch: pytest.MonkeyPatch) -> None:
    import mla_planner.engine_model.settings as settings_module

    monkeypatch.setenv("MLA_PLANNER_SCRATCH_MB", "512")
    first = read_settings()
    assert read_settings() is first, "registration, the builder and every layer share one read"
    monkeypatch.setenv("MLA_PLANNER_SCRATCH_MB", "256")
    assert read_settings().scratch_mb == 256, "another value is read anew"
    assert settings_module.read_settings({"MLA_PLANNER_SCRATCH_MB": "128"}).scratch_mb == 128


# -- Triton warm-up -------------------------------------------------------------------------------


@pytest.mark.parametrize("routes, expected", [
    ({"mixed_batch"}, [(False, False)]),
    ({"separate_prefill_decode"}, [(True, True), (True, False)]),
    ({"mixed_batch", "separate_prefill_decode"}, [(False, False), (True, True), (True, False)]),
])
def test_warm_up_translates_once_per_variant_stock_does_not_compile(
    monkeypatch: pytest.MonkeyPatch, routes: set[str], expected: list[tuple[bool, bool]]
) -> None:
    """Each variant of vLLM's translation the routes use beyond stock's own (no workspace, row 0):
    with or without the prefill workspace, request ids on or off a 16-byte boundary (Triton
    specializes pointers on it), shaped like the call's block table and top-k."""
    from mla_planner.vllm_backend import warmup

    calls: list[tuple[bool, bool, tuple[int, ...], int]] = []

    def recording(req_id: torch.Tensor, block_table: torch.Tensor, token_indices: torch.Tensor, **kwargs: Any) -> Any:
        prefill = kwargs.get("HAS_PREFILL_WORKSPACE", False)
        if prefill:
            ids = kwargs["prefill_workspace_request_ids"]
            assert ids.data_ptr() % 16 == req_id.data_ptr() % 16, "both id pointers start at the launch's row"
        calls.append((prefill, req_id.data_ptr() % 16 == 0, tuple(block_table.shape), kwargs["NUM_TOPK_TOKENS"]))
        return convert_req_index_to_global_index(req_id, block_table, token_indices, **kwargs)

    import vllm.v1.attention.backends.mla.sparse_utils as sparse_utils  # the release module calls it there

    monkeypatch.setattr(sparse_utils, "triton_convert_req_index_to_global_index", recording)
    block_table = torch.zeros((5, 320), dtype=torch.int32)
    warmup.warm_up(warmup.variants(routes), block_table, 64, None, TOPK)
    assert calls == [(prefill, aligned, (1, 320), TOPK) for prefill, aligned in expected]


def test_the_first_fp8_forward_warms_up_once(mixed: Backend, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the call's block table width, block size, the cache's block stride and top-k, before
    stock's code runs (a decode-only step: vLLM's capture warm-up); once per engine."""
    from mla_planner.vllm_backend.warmup import WarmUp

    calls: list[tuple[tuple[str, ...], int, int, int | None, int]] = []

    def recording(self: WarmUp, routes: Collection[str], block_table: torch.Tensor, block_size: int,
                  block_stride_rows: int | None, topk: int) -> None:
        calls.append((tuple(routes), block_table.shape[1], block_size, block_stride_rows, topk))
        self.pending = False

    monkeypatch.setattr(WarmUp, "maybe", recording)
    case = mixed.step([1, 1, 1], [40, 9, 300], gen)
    mixed.topk_buffer[:3] = case["positions"]
    for _ in range(2):
        mixed.impl._forward_fp8_kv_mixed_batch(case["q"], case["kv_cache"], mixed.topk_buffer[:3], case["metadata"])
    stride = release.fp8_kv_pages(case["kv_cache"], 64)[1]
    assert calls == [(("mixed_batch",), case["metadata"].block_table.shape[1], 64, stride, TOPK)]


def pending(warm_up: Any) -> bool:
    """A warm-up's flag, read afresh (an assert on the attribute would narrow it for mypy)."""
    return bool(warm_up.pending)


def test_no_warm_up_off_cuda_or_inside_a_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_planner.vllm_backend import warmup

    warmed: list[object] = []
    monkeypatch.setattr(warmup, "warm_up", lambda *args: warmed.append(args))
    on_cpu = warmup.WarmUp()
    on_cpu.maybe(["mixed_batch"], torch.zeros((1, 8), dtype=torch.int32), 64, None, TOPK)
    assert warmed == [] and not pending(on_cpu), "no Triton on the CPU: nothing to compile, ever"

    class CudaTable:  # what maybe reads of a CUDA block table
        device = torch.device("cuda")

    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    first = warmup.WarmUp()
    first.maybe(["mixed_batch"], CudaTable(), 64, None, TOPK)  # type: ignore[arg-type]
    assert warmed == [] and pending(first), "a capture would record the warm-up into the graph: later"
    capturing[0] = False
    first.maybe(["mixed_batch"], CudaTable(), 64, None, TOPK)  # type: ignore[arg-type]
    assert len(warmed) == 1 and not pending(first)
    first.maybe(["mixed_batch"], CudaTable(), 64, None, TOPK)  # type: ignore[arg-type]
    assert len(warmed) == 1, "once per engine"
    second = warmup.WarmUp()  # another engine in the process
    second.maybe(["mixed_batch"], CudaTable(), 64, None, TOPK)  # type: ignore[arg-type]
    assert len(warmed) == 2 and not pending(second)
    third = warmup.WarmUp()
    third.maybe([], CudaTable(), 64, None, TOPK)  # type: ignore[arg-type]  # the engine plans no step
    assert len(warmed) == 2 and not pending(third), "stock's code only: nothing beyond vLLM's own variants"


# -- after start-up, never raise: the shapes vLLM builds ------------------------------------------


@pytest.fixture(params=[16, 32], ids=["mixed", "separate"])
def routes(request: pytest.FixtureRequest, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    """16 heads (vLLM's rule: the mixed route) and 32 (the separate route)."""
    backend = Backend(tmp_path, monkeypatch, num_heads=request.param)
    yield backend
    backend.close()


def run_step(backend: Backend, query_lens: list[int], context_lens: list[int], gen: torch.Generator,
             rtol: float = 1e-4, **metadata: Any) -> Any:
    """Build a step's metadata (``metadata``: how vLLM shaped it, :meth:`Backend.step`), run the
    layer's FP8 forward on vLLM's route for it, and check the output against the float32
    reference; the metadata back."""
    case = backend.step(query_lens, context_lens, gen, **metadata)
    md = case["metadata"]
    n = sparse_rows(backend, md, case["q"].shape[0])
    if n == 0:  # dense prefills alone: the layer calls no FP8 forward
        return md
    q, expected = case["q"][:n], case["expected"][:n]
    backend.topk_buffer[:n] = case["positions"][:n]
    out = forward_out(backend.fp8_forward(md)(q, case["kv_cache"], backend.topk_buffer[:n], md))
    if out.dtype == torch.bfloat16:  # vLLM's own separate route where it runs in BF16 (q, KV and output)
        error = float((out.float() - expected).norm() / expected.norm())
        assert error <= 1e-2, f"relative error {error:.2e} of BF16 output"  # about 3e-3 here
    else:
        torch.testing.assert_close(out, expected, rtol=rtol, atol=rtol)
    return md


def sparse_rows(backend: Backend, md: Any, rows: int) -> int:
    """The rows of a step's q (``rows`` of them) that vLLM's layer hands the FP8 forward: all, or
    the decodes' only where it runs the step's prefills dense (a dense prefill backend, and vLLM's
    verdict in the metadata, the release's ``prefills_run_dense``)."""
    if backend.builder.force_mqa or not release.prefills_run_dense(md):
        return rows
    return int(md.num_decode_tokens)


CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48]  # vLLM's first CUDA-graph capture sizes


@pytest.mark.parametrize("size", CAPTURE_SIZES)
def test_decode_batches_padded_to_a_captured_size_run(routes: Backend, gen: torch.Generator, size: int) -> None:
    """vLLM pads a decode batch up to a captured CUDA-graph size with requests of length 0, counted
    as decodes: planned (past the 16 tokens stock's call holds) or not, the step runs, its plan
    covers the real tokens, and the output is the reference's."""
    before = fallbacks(routes)
    real = max(1, size - 3)
    lens = [1] * real + [0] * (size - real)
    md = run_step(routes, lens, [40 + 7 * i if q else 0 for i, q in enumerate(lens)], gen)
    assert md.num_decodes == size
    if real > routes.builder.engine.stock_decode_tokens:
        assert md.planned is not None and md.planned.sparse_tokens == real
    assert fallbacks(routes) == before, "a step fell back"


@pytest.mark.parametrize("spec_tokens", [0, 2])
def test_full_cuda_graph_metadata_run_eagerly_is_planned_with_its_padding(
        routes: Backend, gen: torch.Generator, spec_tokens: int) -> None:
    """vLLM's full-CUDA-graph metadata counts the padded batch's tokens (``num_actual_tokens``)
    and its padding requests at length 0; where dual-batch overlap runs it eagerly, q has a row for
    every padded token. The plan covers those rows too: no fallback to stock's one call, and the
    real rows are the reference's."""
    assert routes.impl.engine is not None
    every_decode_step_planned = dataclasses.replace(routes.impl.engine, stock_decode_tokens=0)
    routes.builder.engine = routes.impl.engine = every_decode_step_planned
    routes.builder.reorder_batch_threshold = per_request = 1 + spec_tokens
    real, size = 13, 16
    lens = [per_request] * real + [0] * (size - real)
    case = routes.step(lens, [40 + 7 * i if q else 0 for i, q in enumerate(lens)], gen,
                       padding_tokens=per_request * (size - real))
    md, q = case["metadata"], case["q"]
    tokens, padded = per_request * real, q.shape[0]
    assert md.num_prefills == 0 and md.planned is not None and md.planned.sparse_tokens == padded
    routes.topk_buffer[:padded] = -1
    routes.topk_buffer[:tokens] = case["positions"]
    before = fallbacks(routes)
    out = forward_out(routes.fp8_forward(md)(q, case["kv_cache"], routes.topk_buffer[:padded], md))
    torch.testing.assert_close(out[:tokens], case["expected"], rtol=1e-4, atol=1e-4)
    assert fallbacks(routes) == before, "a layer call fell back"


@pytest.mark.parametrize("query_lens, padding, expected", [
    ([3, 3, 0, 0], 6, [3, 3, 3, 3]),  # the padding requests take the requests' length
    ([3, 3, 0, 0], 9, [3, 3, 3, 3, 3]),  # and further ones of it
    ([3, 3, 0, 0], 4, [1] * 10),  # not a whole number of them: one-token decodes
    ([1, 1, 0], 5, [1] * 7),
    ([2, 1, 0], 2, [1] * 5),  # already not uniform (a speculative decode cut short)
    ([0, 0], 3, [1, 1, 1]),
])
def test_padding_tokens_keep_a_decode_step_uniform(query_lens: list[int], padding: int, expected: list[int]) -> None:
    from mla_planner.vllm_backend.backend import with_padding_tokens

    context = np.array([40 + i if n else 0 for i, n in enumerate(query_lens)], dtype=np.int64)
    lens, contexts = with_padding_tokens(np.array(query_lens, dtype=np.int64), context, padding)
    assert lens.tolist() == expected and sum(expected) == sum(query_lens) + padding
    assert len(contexts) == len(lens) and set(contexts[sum(1 for n in query_lens if n):].tolist()) <= {0}


@settings(max_examples=200, deadline=None)
@given(per_request=st.integers(1, 4), real=st.integers(0, 12), zeros=st.integers(0, 6), padding=st.integers(0, 40))
def test_padded_decode_steps_plan_on_either_route(per_request: int, real: int, zeros: int, padding: int) -> None:
    """Whatever the padding, the padded step's decodes are uniform: the planner takes them on
    either route, covering every token."""
    from mla_planner.vllm_backend.backend import with_padding_tokens

    lens = np.array([per_request] * real + [0] * zeros, dtype=np.int64)
    q, c = with_padding_tokens(lens, np.full(len(lens), 50, dtype=np.int64), padding)
    assert int(q.sum()) == per_request * real + padding
    for heads in (16, 32):
        config = mla_planner.StepConfig(heads, scratch_budget_bytes=256 << 20, topk=TOPK, max_model_len=4096)
        plan = mla_planner.plan_step(q, c, len(q), config)
        covered = int(plan.launches[-1, 1]) if len(plan) else 0
        assert covered == int(q.sum()), (q.tolist(), heads)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("prefill", [False, True])
def test_speculative_decodes_run(routes: Backend, gen: torch.Generator, k: int, prefill: bool) -> None:
    """MTP with k speculative tokens: decodes of 1 + k tokens each (in a decode-only step,
    CUDA-graph padding of length 0 after them), next to a prefill or not. The separate route's
    decode launches run whole requests of 1 + k tokens: in the plan's launches, or as stock's one
    call where the plan is that call."""
    lens = [1 + k] * 12 + ([300] if prefill else [0] * 4)
    md = run_step(routes, lens, [50 + 13 * i for i in range(len(lens))], gen)
    plan = md.planned.plan
    assert plan.decode_query_len == 1 + k and md.planned.sparse_tokens == sum(lens)
    if plan.mode == "separate_prefill_decode":
        shapes = [tuple(q.shape[:2]) for q in routes.provider.launch_q] or \
            [tuple(shape[:2]) for shape in routes.kernels.decode_calls]
        assert shapes and all(s_q == 1 + k for _batch, s_q in shapes)
        assert sum(batch for batch, _ in shapes) == 12


def test_the_mtp_drafts_step_after_a_padded_step_is_planned(routes: Backend, gen: torch.Generator) -> None:
    """The MTP draft's metadata after a target step vLLM padded for a CUDA graph goes through
    ``unpadded``, which on a release that keeps them drops the CPU sequence lengths that planning and vLLM's own
    separate-route build read: the step is planned all the same, none runs vLLM's own code, and
    the output is the reference's."""
    before = fallbacks(routes)
    lens = [2] * 12 + [300]
    md = run_step(routes, lens, [50 + 13 * i for i in range(len(lens))], gen, draft_after_padding=3)
    assert md.planned is not None and md.planned.sparse_tokens == sum(lens)
    assert fallbacks(routes) == before, "a step fell back"


def test_the_mtp_drafts_decode_step_without_cpu_sequence_lengths_is_planned(routes: Backend,
                                                                           gen: torch.Generator) -> None:
    """Under async scheduling vLLM's runner (a release that keeps them) keeps no exact CPU sequence lengths, so the MTP
    draft's step after a padded decode step has none at all: its decodes are planned with contexts
    of 0 (a decode's context shapes no plan; the planner's proptest
    ``decode_context_lens_shape_no_plan``), none runs vLLM's own code, and the output is the
    reference's."""
    before = fallbacks(routes)
    lens = [2] * 40
    md = run_step(routes, lens, [50 + 13 * i for i in range(len(lens))], gen, draft_after_padding=8,
                  exact_seq_lens=False)
    assert md.num_decodes == len(lens) and sum(lens) > routes.builder.engine.stock_decode_tokens
    assert md.planned is not None and md.planned.sparse_tokens == sum(lens)
    assert fallbacks(routes) == before, "a step fell back"


@st.composite
def batch_mixes(draw: st.DrawFn, decode_threshold: int, max_tokens: int, max_model_len: int,
                max_requests: int) -> tuple[list[int], list[int]]:
    """A step as vLLM lays one out: decodes first (requests of up to the decode threshold's query
    tokens: single tokens, speculative tokens, short chunks), then prefills past the threshold,
    with or without context; or, after decodes of one length, CUDA-graph padding (requests of
    length 0); within ``max_num_batched_tokens``, ``max_model_len`` and ``max_num_seqs``."""
    longest = min(max_tokens, max_model_len)  # one request's tokens
    decode_threshold = min(decode_threshold, longest)
    decode_len = st.integers(1, decode_threshold)
    lens = draw(st.lists(st.one_of(st.just(1), decode_len), max_size=12))
    prefill_len = st.integers(decode_threshold + 1, longest)
    prefills = draw(st.lists(prefill_len, max_size=3)) if decode_threshold < longest else []
    uniform = len(set(lens)) <= 1
    padding = draw(st.integers(0, 4)) if uniform and not prefills else 0
    lens = lens + prefills
    while sum(lens) > max_tokens or len(lens) > max_requests:
        lens.pop()
    if not lens:
        lens = [1]
    padding = min(padding, max_requests - len(lens))
    contexts = [draw(st.integers(0, max_model_len - q)) for q in lens]
    return lens + [0] * padding, contexts + [0] * padding


@pytest.fixture(params=["mixed", "separate", "routed", "native_routed", "chat"])
def any_engine(request: pytest.FixtureRequest) -> Backend:
    """vLLM's rule on either route (16 and 32 heads), a cost profile choosing the route step by
    step, at padded and at native prefill heads, and a dense prefill backend beside the sparse
    kernels (``chat``)."""
    backend: Backend = request.getfixturevalue(request.param)
    return backend


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_batch_mix_runs_and_matches_the_reference(any_engine: Backend, data: st.DataObject) -> None:
    """Random steps: the layer call's output is the float32 reference's, and no step or layer call
    falls back to vLLM's code for want of a plan."""
    md, query_lens, _context_lens = run_a_drawn_step(any_engine, data)
    if md.planned is not None:
        assert md.planned.sparse_tokens == sparse_rows(any_engine, md, sum(query_lens))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_batch_mix_whose_launch_fails_runs_within_the_reservation(any_engine: Backend, data: st.DataObject) -> None:
    """Random steps whose k-th kernel launch fails (an allocation failure or any error): the layer
    call raises nothing and matches the float32 reference; from the failure on, it runs the
    bounded path's launches (each within the allowance, :func:`bounded_launches`), or vLLM's own
    call where that is the one bounded launch; the step is counted once."""
    backend = any_engine
    scheduler = backend.config.scheduler_config
    query_lens, context_lens = data.draw(batch_mixes(backend.builder.reorder_batch_threshold or 1,
                                                     scheduler.max_num_batched_tokens,
                                                     backend.config.model_config.max_model_len, scheduler.max_num_seqs))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    fail_at = data.draw(st.integers(1, 3), label="the failing launch")
    error = data.draw(st.sampled_from([torch.OutOfMemoryError, RuntimeError]), label="error")
    launched: list[str] = []
    decode, prefill = backend.provider.sparse_decode, backend.provider.sparse_prefill

    def counted(run: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            launched.append(kind)
            if len(launched) == fail_at:
                raise error("injected")
            return run(*args, **kwargs)
        return launch

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(backend.provider, "sparse_decode", counted(decode, "decode"))
        monkeypatch.setattr(backend.provider, "sparse_prefill", counted(prefill, "prefill"))
        before, stock_before = fallbacks(backend), len(backend.kernels.decode_calls)
        md = run_step(backend, query_lens, context_lens, gen)
    if len(launched) < fail_at:  # the step ran fewer launches (or stock's one call): nothing failed
        assert fallbacks(backend) == before
        return
    assert fallbacks(backend) == before + 1
    tokens = sparse_rows(backend, md, sum(query_lens))
    bounded = bounded_launches(backend, tokens)
    after = [tuple(q.shape) for q in backend.provider.launch_q][-(len(launched) - fail_at):] if len(launched) > fail_at else []
    if len(bounded) == 1 and len(backend.kernels.decode_calls) > stock_before:
        assert backend.kernels.decode_calls[-1] == (1, tokens, 64, 576) and after == []
    else:
        assert after == bounded and launched[fail_at:] == ["decode"] * len(bounded)


def run_a_drawn_step(backend: Backend, data: st.DataObject) -> tuple[Any, list[int], list[int]]:
    """A step drawn within the engine's limits (:func:`batch_mixes`), run and checked by
    :func:`run_step`, and not fallen back: its metadata and lengths."""
    scheduler = backend.config.scheduler_config
    query_lens, context_lens = data.draw(batch_mixes(backend.builder.reorder_batch_threshold or 1,
                                                     scheduler.max_num_batched_tokens,
                                                     backend.config.model_config.max_model_len, scheduler.max_num_seqs))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    before = fallbacks(backend)
    md = run_step(backend, query_lens, context_lens, gen)
    backend.provider.launch_q.clear()
    backend.provider.prefill_q.clear()
    assert fallbacks(backend) == before, (query_lens, context_lens)
    return md, query_lens, context_lens


@st.composite
def engine_flags(draw: st.DrawFn) -> dict[str, Any]:
    """What an operator sets: heads per rank (the model's heads over the tensor-parallel size), the
    budget, vLLM's batch limits and context length, MTP, a cost profile or vLLM's rule; and whether
    the layer has a dense prefill backend (short prefills run dense, beside the sparse kernels)."""
    max_num_seqs = draw(st.integers(1, 256))
    return dict(
        num_heads=draw(st.sampled_from([16, 32, 64, 128])),
        scratch_mb=draw(st.integers(64, 160)),  # 64 MiB the least allowed; at the tests' top-k of 128 engines need about that
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max(max_num_seqs, 64), 2048)),
        max_model_len=draw(st.integers(256, 8192)),
        spec_tokens=draw(st.sampled_from([0, 0, 1, 3])),
        profile=draw(st.booleans()),
        dense_prefill=draw(st.booleans()),
    )


def started(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, flags: dict[str, Any]) -> Backend:
    """The engine ``flags`` describe, or, where it refuses its budget at start-up, the one at the
    budget its error names: that error is one line, names a larger budget, and that one starts."""
    import json
    import re

    options = dict(flags)  # the drawn flags stay as drawn, for hypothesis's report of a failure
    profile = None
    if options.pop("profile"):
        profile = tmp_path / "profile.json"
        profile.write_text(json.dumps(ROUTING_PROFILE))
    spec_tokens = options.pop("spec_tokens")
    scratch_mb = options.pop("scratch_mb")

    def speculative(config: Any) -> None:  # MTP: decodes of 1 + k tokens (what vLLM's builder reads of it)
        if spec_tokens:
            config.speculative_config = SimpleNamespace(method="mtp", num_speculative_tokens=spec_tokens,
                                                        parallel_drafting=False, attention_backend=None)

    def start(budget_mb: int) -> Backend:
        return Backend(tmp_path, monkeypatch, cost_profile=profile, reshape_config=speculative, scratch_mb=budget_mb,
                       **options)

    try:
        return start(scratch_mb)
    except SettingsError as err:
        message = str(err)
        named = re.search(r"set MLA_PLANNER_SCRATCH_MB=(\d+) or more$", message)
        assert named and "\n" not in message, message
        assert int(named.group(1)) > scratch_mb, message
        return start(int(named.group(1)))


def assert_within_the_reservation(backend: Backend, md: Any, query_lens: list[int], context_lens: list[int]) -> None:
    """The step allocates no more than the engine holds for it: a planned launch no more than the
    budget, and a step run as vLLM's one call (no plan, or a plan of that one call) no more than
    the reservation."""
    setup = backend.builder.engine
    step = md.planned
    if step is None:  # only decodes reach the sparse kernels: a decode-only step, or beside dense prefills
        assert sparse_rows(backend, md, sum(query_lens)) == md.num_decode_tokens <= setup.stock_decode_tokens
        decodes = int(md.num_decodes)
        if decodes:
            call = mla_planner.plan_step(query_lens[:decodes], context_lens[:decodes], decodes, setup.config)
            assert len(call) == 1 and call.peak_bytes <= setup.stock_call_allowance, (len(call), call.peak_bytes)
    elif step.stock_call_bytes is None or step.stock_call_bytes > setup.stock_call_allowance:
        budget = setup.config.launch_budget_bytes
        assert max(launch.bytes for launch in step.launches) <= budget


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=engine_flags(), data=st.data())
def test_any_engine_that_starts_runs_any_step_within_its_reservation(tmp_path: pathlib.Path,
                                                                     flags: dict[str, Any], data: st.DataObject) -> None:
    """Random operator flags: the engine starts, or refuses its budget at start-up naming one that
    starts; then random steps within its limits run without falling back to vLLM's code, within
    the bytes the engine holds for them, and match the float32 reference."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        backend = started(tmp_path, monkeypatch, flags)
        try:
            for _ in range(2):
                assert_within_the_reservation(backend, *run_a_drawn_step(backend, data))
        finally:
            backend.close()


def test_vllms_own_gather_chunks_are_followed(separate: Backend, gen: torch.Generator,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Where vLLM gathers the prefills in chunks of its own (its test patches one request a chunk),
    the plan's launches follow them, and the output is the reference's."""
    import vllm.v1.attention.backends.mla.flashmla_sparse as stock_module

    monkeypatch.setattr(stock_module, "split_prefill_chunks", lambda rows, capacity: [(i, i + 1) for i in range(len(rows))])
    md = run_step(separate, QUERY_LENS, CONTEXT_LENS, gen)
    plan = md.planned.plan
    assert plan.gather_chunks[:, :2].tolist() == [[3, 4], [4, 5]], "one chunk a prefill, as vLLM gathers them"
    assert separate.provider.gathers == 2


def test_a_step_the_planner_refuses_takes_the_bounded_path(mixed: Backend, gen: torch.Generator,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the planner raises in a build, the build raises nothing: the step takes the
    bounded path, and the reason is counted once per step."""
    from mla_planner import routing

    def refuse(*args: Any) -> Any:
        raise ValueError("a step no rule admits")

    monkeypatch.setattr(routing, "choose_plan", refuse)
    step_log = step_log_module(monkeypatch)
    with debug_lines() as lines:
        md = run_step(mixed, QUERY_LENS, CONTEXT_LENS, gen, rtol=1e-5)
    assert isinstance(md.planned, fallback.BoundedStep) and mixed.kernels.decode_calls == []
    assert [tuple(x.shape) for x in mixed.provider.launch_q] == bounded_launches(mixed, sum(QUERY_LENS))
    assert mixed.impl.engine is not None
    assert mixed.impl.engine.state.stats.fallbacks == {"the step could not be planned (ValueError)": 1}
    # The step log counts it (tests/e2e/step_log.py reads the debug line).
    assert [s.kind for s in step_log.parse("\n".join(lines))] == [step_log.FALLBACK], lines


def test_the_fallback_warning_names_where_a_bare_assert_failed() -> None:
    """A step left to vLLM's code is logged once per reason with the exception's message; an
    exception with none (a bare ``assert``, vLLM's or the backend's) is named by where it was
    raised, so that the one warning still says which check failed."""
    import inspect

    def check(n: int) -> None:
        if n <= 0:  # a bare assert's failure (pytest rewrites the asserts of a test module)
            raise AssertionError

    with pytest.raises(AssertionError) as raised:
        check(0)
    line = inspect.getsourcelines(check)[1] + 2
    assert fallback.describe(raised.value).startswith("(no message) raised at ")
    assert fallback.describe(raised.value).endswith(f"test_vllm_backend.py:{line} in check")
    assert fallback.describe(ValueError("two  words\non two lines")) == "two words on two lines"


@pytest.mark.parametrize("num_heads", [16, 32, 64])
def test_a_budget_below_what_the_engine_needs_is_refused_at_start_up(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator, num_heads: int) -> None:
    """The smallest budget any step of the engine needs (its decodes up to vLLM's threshold, every
    route it may take) is checked when the engine is built: one line naming the variable, the
    value and the minimum; at the minimum every step plans and runs."""
    from mla_planner.vllm_backend import engine

    probe = Backend(tmp_path, monkeypatch, num_heads=num_heads, scratch_mb=1024)
    setup = probe.builder.engine
    probe.close()
    needed = max(c.min_scratch_budget(setup.max_step_tokens, setup.max_decode_query_len) for c in setup.route_configs())
    minimum = -(-needed // (1 << 20))
    if minimum > 64:
        with pytest.raises(SettingsError) as err:
            Backend(tmp_path, monkeypatch, num_heads=num_heads, scratch_mb=minimum - 1).close()
        message = str(err.value)
        assert "\n" not in message and f"MLA_PLANNER_SCRATCH_MB={minimum - 1} is below the {minimum} MiB" in message
        assert f"set MLA_PLANNER_SCRATCH_MB={minimum} or more" in message
    at_minimum = Backend(tmp_path, monkeypatch, num_heads=num_heads, scratch_mb=max(minimum, 64))
    try:
        assert engine.setup(at_minimum.config, num_heads, torch.device("cpu")) is at_minimum.builder.engine
        for lens, contexts in ((QUERY_LENS, CONTEXT_LENS), ([2] * 20 + [0] * 4, [9] * 24), ([128] * 3, [5, 70, 900])):
            md = run_step(at_minimum, lens, contexts, gen)
            assert md.planned is not None or sum(lens) <= at_minimum.builder.engine.stock_decode_tokens
    finally:
        at_minimum.close()


def test_the_decode_threshold_is_the_builders(routes: Backend) -> None:
    """The engine's setup (made before any builder) reads vLLM's decode threshold as the builder
    computes it."""
    assert routes.builder.engine.max_decode_query_len == min(routes.builder.reorder_batch_threshold,
                                                             routes.config.scheduler_config.max_num_batched_tokens)


def test_a_cost_profile_reserves_for_every_route_it_may_take(routed: Backend) -> None:
    """With a cost profile a step may take either FP8 route (and, where this vLLM's FlashMLA has the
    kernel, native prefill heads): the budget is checked and the reservation sized for all."""
    setup = routed.builder.engine
    configs = setup.route_configs()
    assert [c.mode for c in configs][:2] == ["mixed_batch", "separate_prefill_decode"]
    assert [c.native_prefill_heads for c in configs] == [False, False] + ([True] if release.native_prefill_kernels else [])
    served = 64 if release.stock_workspace else None
    assert setup.stock_call_allowance == max(c.largest_launch_bytes(2048, 128, served) for c in configs)
    assert routed.reserved == [setup.reserved_bytes]


@pytest.mark.parametrize("setting", ["hisparse", "dcp"])
def test_where_vllm_fixes_the_route_nothing_is_checked_or_reserved(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    """Where vLLM keeps its own route (HiSparse and decode context parallelism, in the releases whose
    builder has them) every step runs its code, so a budget below the plan's minimum is no reason
    to stop the engine, and nothing is reserved."""
    from mla_planner.vllm_backend import engine, vllm_api

    config = vllm_config(model_dir(tmp_path, num_heads=64, topk=TOPK))
    if setting == "hisparse":
        monkeypatch.setattr(config.attention_config, "hisparse_config", SimpleNamespace(), raising=False)
    else:
        monkeypatch.setattr(config.parallel_config, "decode_context_parallel_size", 2, raising=False)
    if setting not in FACTS.fixes_route_under:
        assert release.stock_route_reason(config) is None, "this release's builder fixes no route here"
        return
    assert release.stock_route_reason(config) == {"hisparse": "HiSparse", "dcp": "DCP"}[setting]
    monkeypatch.setenv("MLA_PLANNER_SCRATCH_MB", "64")  # below 64 heads' minimum on the separate route
    monkeypatch.setenv("MLA_PLANNER_COST_PROFILE", "none")
    monkeypatch.setattr(vllm_api, "num_sms", lambda device: NUM_SMS)
    setup = engine.setup(config, 64, torch.device("cpu"))
    assert not setup.plans_fp8 and setup.reserved_bytes == 0
    # Nor is a cost profile sought (or measured at start-up): no step of it is routed.
    monkeypatch.delenv("MLA_PLANNER_COST_PROFILE")
    monkeypatch.setattr(engine, "find_profile", lambda *args: pytest.fail("a profile was sought for an engine that routes nothing"))
    assert engine.make_setup(config, 64, torch.device("cpu"), read_settings()).cost_model is None
