"""What the tests expect of each supported vLLM release: one module per release here (``v0_26``,
``v0_33``), each ending ``FACTS = ReleaseFacts(...)``, found by name, so that adding a release adds
its module and no shared test changes.

Two kinds of fact live here. The doctor models every release whatever is installed, so the doctor's
tests run over :data:`ALL` (figures the runs of each release measured, what the doctor prints of
them). The backend runs on the installed vLLM only, so its tests read :data:`INSTALLED` (what that
release's module must report, which stock calls it makes) and skip what it lacks with
:func:`only_where`. ``test_vllm_backend.py`` checks the backend's own view of the installed release
against :data:`INSTALLED`, and ``test_doctor.py`` checks that :data:`ALL` covers the releases the
doctor models, so a release module with no facts here fails a test rather than going untested.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from mla_planner.engine_model import minor_of


@dataclass(frozen=True)
class ReleaseFacts:
    version: str
    """The release (``0.26.0``) as the doctor names the one it models."""
    test_extra: str
    """The pyproject extra that installs this release with the test dependencies."""

    # -- the doctor: the e2e engines' serve line (tiny model, TP 1, H200, 32,768 tokens a step) --
    logged_reservation_mib: dict[int, int]
    """max_num_batched_tokens -> the reservation the plugin logged at 16 heads and the default
    budget (floored to whole MiB)."""
    reservation_holds_step_output: bool
    """The plugin's reservation holds the step's output (no vLLM workspace holds it)."""
    warm_up_attends: bool
    """vLLM's start-up autotune step reaches the sparse-MLA kernels by default (model runner V2 for
    these models)."""
    fails_at_095: str
    """Where stock fails on the line at 0.95: ``start-up`` or ``worst step``."""
    verdict_at_095: str
    """The start of the doctor's verdict on the line at 0.95."""
    text_at_095: tuple[str, ...]
    """Text the doctor prints of the line at 0.95."""
    warm_up_at_095: dict[str, Any]
    """The JSON's ``warmup`` members of the line at 0.95 (those named)."""
    warm_up_why: str
    """What the JSON's ``warmup.why`` says of the line at 0.95 (a part of it)."""
    profile_widens_reservation: bool
    """At 16 heads a cost profile's second route makes the reservation larger than vLLM's rule's
    one route alone (``MLA_PLANNER_COST_PROFILE=none``)."""
    dummy_query_lens_10_over_4: tuple[int, ...]
    """The query lengths of the warm-up's dummy step of 10 tokens over 4 requests."""
    step_reserve_measured_under: tuple[str, str] = ("", "")
    """The releases (major.minor) the doctor's step reserve for this release (what a step holds
    outside the attention scratch) was measured under: at TP 1, and at TP 2."""
    tp2_stock_32k_fits: tuple[tuple[float, bool], ...] = ()
    """Stock's 32K step at TP 2 (16 heads a rank) on the tiny model, measured: (utilization, ran)."""
    mtp_draft_loading_gib: tuple[str, float] | None = None
    """A measured line of an MTP server (tests/data/doctor_kv_lines.json) and how much more its model
    loading took than the one without MTP."""
    decode_call_free_gib: float | None = None
    """Free memory vLLM reported at stock's 32K decode-kernel call's last ask (the 8 GiB of
    accumulators) in the in-process engine at 0.95, less what its workspace holds of the call."""

    # -- the packaged cost profiles --
    packaged_profile_gpus: tuple[str, ...] = ()
    """GPUs with a cost profile packaged for this release's kernels."""

    # -- the backend, on the installed release --
    forward_returns_lse: bool = False
    """The FP8 forwards return ``(out, lse)`` rather than ``out``."""
    stock_workspace: bool = False
    """vLLM's workspace manager holds the sparse-MLA impl's padded q and output."""
    masked_mha: bool = False
    """vLLM runs masked-MHA prefill (SM100, FA4) where it can."""
    native_prefill_kernels: bool = False
    """FlashMLA's sparse prefill kernel runs 16 and 32 heads unpadded."""
    prefill_padded_heads: tuple[tuple[str, int], ...] = (("sm90", 64), ("sm100", 128))
    """(arch, heads) the impl pads the prefill kernel's q to at 16 heads."""
    index_groups: bool = False
    """Layers share one indexer's result (vLLM's index groups)."""
    multi_page_blocks: bool = False
    """The FlashMLA sparse backend takes blocks of several 64-row pages (off SM100)."""
    topk_in_hf_text_config: bool = False
    """The sparse-MLA layer reads ``index_topk`` from ``hf_text_config`` (else ``hf_config``)."""
    fixes_route_under: tuple[str, ...] = ()
    """Settings under which vLLM's builder keeps its own route (``hisparse``, ``dcp``)."""
    fp8_mixed_build_takes_common: bool = True
    """Stock's ``_build_fp8_mixed_decode_prefill`` takes the step's common metadata."""
    own_tests_on_cpu: frozenset[str] = frozenset()
    """The tests of vLLM's own sparse-MLA file that pass without a GPU."""
    own_tests_off_cpu: str | None = None
    """Why vLLM's own sparse-MLA file cannot run on a CPU here (``None``: it can)."""

    @property
    def minor(self) -> str:
        return minor_of(self.version)

    @property
    def version_key(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.version.split("."))


def _found() -> dict[str, ReleaseFacts]:
    """Every module here that ends ``FACTS = ReleaseFacts(...)``, oldest release first."""
    made = [importlib.import_module(f"{__name__}.{m.name}").FACTS for m in pkgutil.iter_modules(__path__)]
    facts: list[ReleaseFacts] = [f for f in made if isinstance(f, ReleaseFacts)]
    return {f.minor: f for f in sorted(facts, key=lambda f: f.version_key)}


ALL: dict[str, ReleaseFacts] = _found()
"""The supported releases' facts, by ``major.minor``, oldest first."""
NEWEST: ReleaseFacts = list(ALL.values())[-1]


def _installed() -> ReleaseFacts | None:
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None
    return ALL.get(minor_of(version))


INSTALLED: ReleaseFacts | None = _installed()
"""The installed vLLM's facts (``None``: no vLLM, or one not supported)."""

NEEDS_VLLM = ("the backend tests need vLLM " + " or ".join(f.version for f in ALL.values()) + " (pip install "
              + " or ".join(f"'.[{f.test_extra}]'" for f in ALL.values()) + ")")
"""The reason a test module that imports vLLM skips where none is installed."""


def installed() -> ReleaseFacts:
    """:data:`INSTALLED`, for a test that runs only where vLLM is (it has skipped otherwise)."""
    assert INSTALLED is not None, NEEDS_VLLM
    return INSTALLED


def only_where(has: Callable[[ReleaseFacts], bool], lacks: str) -> pytest.MarkDecorator:
    """Skips a test of what the installed vLLM release does not have (or where none is installed),
    saying what it lacks."""
    return pytest.mark.skipif(INSTALLED is None or not has(INSTALLED),
                              reason=f"vLLM {INSTALLED.version if INSTALLED else '(none)'}: {lacks}")
