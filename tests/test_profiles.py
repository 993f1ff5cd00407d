"""Where an engine's cost profile comes from (mla_planner.profiles, CPU only): packaged for this
machine, cached from an earlier start, or measured now on the reduced grid; the cache's key and
place; a corrupt, stale or too-short cached profile refused and measured anew."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mla_planner import COST_PROFILE_FORMAT, CostModel, StepConfig, profiles
from mla_planner.calibration.grid import FIRST_START_RUNS, first_start_grid, launch_limit
from mla_planner.calibration.measure import CalibrationError
from releases import ALL, NEWEST

KERNELS = f"vllm {NEWEST.version}"
HERE = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.1", "cuda": "13.0", "torch": "2.11.0",
        "kernels": KERNELS, "gather": f"{KERNELS} cp_gather_and_upconvert_fp8_kv_cache"}
CONFIG = StepConfig(16, arch="sm90", num_sms=132, topk=2048, kv_dtype="fp8", max_model_len=70_000)
MAX_STEP = 8192


def measured_profile(environment: dict[str, str] = HERE, reach: int = 65536) -> dict[str, Any]:
    """A profile as the reduced grid makes one: decode and prefill at 64 padded heads up to
    ``reach`` tokens, the prefill kernel at 16 native heads, the gather."""
    return {
        "format": COST_PROFILE_FORMAT, "arch": "sm90", "num_sms": 132, "topk": 2048, "environment": environment,
        "sparse_decode": {"64": [[16, 30.0], [reach, 30.0 + reach]]},
        "sparse_prefill": {"64": [[16, 20.0], [reach, 20.0 + reach / 2]], "16": [[16, 25.0], [reach, 25.0 + reach / 3]]},
        "gather_upconvert": [[64, 5.0], [1 << 20, 1000.0]],
    }


class Measure:
    """A stand-in for the first-start measurement: counts its calls."""

    def __init__(self, profile: dict[str, Any] | None = None, error: Exception | None = None) -> None:
        self.calls = 0
        self.profile = profile or measured_profile()
        self.error = error

    def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.profile


def find(tmp_path: Path, measure: Measure | None, environment: dict[str, str] | None = HERE,
         **kwargs: Any) -> profiles.Found:
    return profiles.find(CONFIG, path=kwargs.pop("path", None), environment=environment, native=kwargs.pop("native", True),
                         max_step_tokens=kwargs.pop("max_step_tokens", MAX_STEP), measure=measure,
                         environ={profiles.CACHE_VAR: str(tmp_path / "cache")}, **kwargs)


def test_the_first_start_measures_caches_and_the_next_start_reads_the_cache(tmp_path: Path) -> None:
    measure = Measure()
    first = find(tmp_path, measure)
    assert (first.source, measure.calls) == ("measured", 1)
    cached = Path(first.where)
    assert cached.parent == tmp_path / "cache" / "profiles" and cached.name.startswith(f"sm90-vllm-{NEWEST.version}-h100-80gb-hbm3-")
    assert json.loads(cached.read_text()) == measure.profile
    assert "measured one in" in first.describe() and str(cached) in first.describe()
    assert "MLA_PLANNER_COST_PROFILE" in first.describe()  # how to skip it
    second = find(tmp_path, measure)
    assert (second.source, second.where, measure.calls) == ("cached", str(cached), 1)
    assert second.model() is not None and second.text == first.text


def test_the_packaged_profile_of_this_machine_comes_first(tmp_path: Path) -> None:
    packaged = profiles.packaged_for_gpu("sm90", profiles.REFERENCE_GPU, KERNELS)
    assert packaged is not None
    measure = Measure()
    found = find(tmp_path, measure, environment=profiles.environment_of(packaged))
    assert (found.source, Path(found.where).name, measure.calls) == ("packaged", packaged.name, 0)
    # The same GPU under another driver: not this machine's; measured here.
    other = dict(profiles.environment_of(packaged), driver="1.0")
    assert find(tmp_path, measure, environment=other).source == "measured" and measure.calls == 1


@pytest.mark.parametrize("content, reason", [
    (b"{not json", "not a valid profile"),
    (json.dumps(measured_profile(dict(HERE, torch="2.99"))).encode(), "measured elsewhere: torch '2.11.0' here, '2.99'"),
    (json.dumps(measured_profile(reach=2048)).encode(), "measured up to 2,048 tokens a launch, this engine's steps reach 8,192"),
    (json.dumps({**measured_profile(), "topk": 512}).encode(), "topk 512"),
])
def test_a_corrupt_stale_or_short_cache_is_refused_and_measured_anew(tmp_path: Path, content: bytes, reason: str) -> None:
    path = profiles.cache_path(CONFIG, HERE, True, {profiles.CACHE_VAR: str(tmp_path / "cache")})
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    measure = Measure()
    found = find(tmp_path, measure)
    assert (found.source, measure.calls) == ("measured", 1)
    assert reason in found.why and reason in found.describe()
    assert json.loads(path.read_text()) == measure.profile  # replaced whole


def test_a_cache_that_prices_no_native_heads_is_refused_where_the_kernel_runs_them(tmp_path: Path) -> None:
    padded_only = measured_profile()
    del padded_only["sparse_prefill"]["16"]
    path = profiles.cache_path(CONFIG, HERE, True, {profiles.CACHE_VAR: str(tmp_path / "cache")})
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(padded_only))
    found = find(tmp_path, Measure())
    assert found.source == "measured" and "no prefill table at 16 native heads" in found.why


def test_the_cache_key_holds_the_environment_and_the_kernels_an_engine_runs(tmp_path: Path) -> None:
    environ = {profiles.CACHE_VAR: str(tmp_path)}
    key = profiles.cache_path(CONFIG, HERE, True, environ)
    assert key == profiles.cache_path(CONFIG.replace(scratch_budget_bytes=1 << 28), HERE, True, environ)  # the budget: not a kernel fact
    others = [profiles.cache_path(CONFIG, dict(HERE, driver="2"), True, environ),
              profiles.cache_path(CONFIG, HERE, False, environ),
              profiles.cache_path(CONFIG.replace(topk=1024), HERE, True, environ),
              profiles.cache_path(StepConfig(128, arch="sm90", num_sms=132, topk=2048, kv_dtype="fp8", max_model_len=70_000), HERE, True, environ)]
    assert len({key, *others}) == 5


def test_where_the_cache_lives(tmp_path: Path) -> None:
    assert profiles.cache_dir({profiles.CACHE_VAR: "/srv/c", "XDG_CACHE_HOME": "/x"}) == Path("/srv/c")
    assert profiles.cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/mla-planner")
    assert profiles.cache_dir({}) == Path.home() / ".cache" / "mla-planner"


def test_a_failed_measurement_routes_by_vllms_rule_and_says_why(tmp_path: Path) -> None:
    found = find(tmp_path, Measure(error=CalibrationError("sm80: no sparse kernels")))
    assert (found.source, found.model()) == ("none", None)
    assert "measuring one failed: sm80: no sparse kernels" in found.describe()
    off = find(tmp_path, None, measure_off="sleep mode")
    assert off.source == "none" and off.why.endswith("and sleep mode")


def test_an_unwritable_cache_path_is_reported_not_raised(tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("a file where the folder should be")
    found = find(tmp_path, Measure())
    assert found.source == "measured" and found.where == "" and found.model() is not None


def test_a_set_file_is_used_where_measured_and_refused_elsewhere(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(measured_profile()))
    measure = Measure()
    assert find(tmp_path, measure, path=str(path)).source == "file"
    elsewhere = find(tmp_path, measure, path=str(path), environment=dict(HERE, gpu="NVIDIA H200"))
    assert elsewhere.source == "none" and "measured elsewhere" in elsewhere.why and measure.calls == 0


def test_no_gpu_visible_prices_by_the_reference_gpus_packaged_profile(tmp_path: Path) -> None:
    measure = Measure()
    found = find(tmp_path, measure, environment=None)
    assert found.source == "packaged" and measure.calls == 0
    assert "packaged for the NVIDIA H200, no GPU being visible" in found.describe()
    model = found.model()
    assert model is not None and model.environment["gpu"] == profiles.REFERENCE_GPU


def test_gpu_names_and_packaged_names() -> None:
    assert profiles.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert profiles.gpu_slug("NVIDIA H200") == "h200"


@pytest.mark.parametrize("minor", list(ALL))
def test_each_release_has_its_packaged_profiles(minor: str) -> None:
    version = ALL[minor].version
    assert profiles.packaged_name("sm90", f"vllm {version}", "NVIDIA H200") == f"sm90-vllm-{version}-h200.json"
    for gpu in ALL[minor].packaged_profile_gpus:
        assert profiles.packaged_for_gpu("sm90", gpu, f"vllm {version}") is not None, gpu
    assert profiles.packaged_for_gpu("sm90", "B200", f"vllm {version}") is None


def test_the_first_start_grid_covers_the_engines_launches_only() -> None:
    grid = first_start_grid(CONFIG, 8192, 70_000, native=True)
    assert grid.tokens == {64: [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]}
    assert grid.native_tokens == {16: grid.tokens[64]}
    assert grid.rows == [64, 256, 1024, 4096, 16384, 65536, 70_000]
    assert (grid.topk, grid.runs) == (2048, FIRST_START_RUNS)
    assert first_start_grid(CONFIG, 8192, 70_000, native=False).native_tokens == {}
    # A step longer than one launch may be: the launch limit ends the grid.
    longest = first_start_grid(CONFIG, 1 << 20, 4096, native=False).tokens[64][-1]
    assert longest == launch_limit(64, False)
    tiny = first_start_grid(CONFIG, 16, 64, native=False)
    assert tiny.tokens[64] == [16, 32] and tiny.rows == [64, 256]  # two points a table, at least


def test_a_measured_profile_prices_the_engine() -> None:
    model = CostModel.from_json(json.dumps(measured_profile()))
    model.check(CONFIG)
    assert model.prices_native_prefill(CONFIG)
