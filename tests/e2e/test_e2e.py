"""In-process end to end (run_cases.py; docs/e2e.md): the ``e2e`` tests need a CUDA GPU and skip elsewhere;
on a CPU, the staging of vLLM for the GPU machine (a toy vLLM), run_cases.py on stand-ins, fault injection."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

import e2e_bundle as eb
import faults
import run_cases

HERE = Path(__file__).resolve().parent


def e2e_unavailable() -> str | None:
    """Why the GPU end-to-end test cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU; none is visible"
    try:
        importlib.import_module("vllm._flashmla_C")
    except Exception as exc:  # not installed, or its CUDA libraries do not load
        return f"vLLM cannot load its CUDA kernels (vllm._flashmla_C): {exc}"
    return None


# run_cases.py's two runs that finish every case at 0.95 (docs/e2e.md, "What runs")
PLANNED_095 = {"planned-0.95-32k": ["--mnbt", "32768", "--cases", "1", "2", "3", "5"],
               "planned-0.95-64k": ["--mnbt", "65536", "--cases", "4", "5"]}


@pytest.mark.e2e
def test_planned_finishes_every_case_at_095(tmp_path: Path) -> None:
    """The planned backend's runs at 0.95, or with ``MLA_E2E_RESULTS=DIR`` every run_cases.py JSON in
    DIR of the planned backend at 0.95: together they ran cases 1-5, and each finished."""
    reason = e2e_unavailable()
    if reason:
        pytest.skip(reason)
    saved = os.environ.get("MLA_E2E_RESULTS")
    out = Path(saved) if saved else tmp_path
    if not saved:
        for name, args in PLANNED_095.items():
            subprocess.run([sys.executable, str(HERE / "run_cases.py"), "--backend", "planned", "--util", "0.95", *args,
                            "--out", str(out / f"{name}.json")], check=True, timeout=450)
    runs = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    runs = {n: d for n, d in runs.items() if isinstance(d, dict) and d.get("schema") == 1 and "phase" not in d
            and d.get("run", {}).get("backend") == "planned" and d["run"].get("util") == 0.95
            and not d["run"].get("faults")}
    seen = set()
    for name, data in runs.items():
        assert data["startup"]["status"] == "ok", data["startup"].get("error")
        for case in data["run"]["cases"]:
            result = data["cases"].get(case, {})
            assert result.get("status") == "ok", f"{name} case {case}: {result.get('error') or result.get('status')}"
            assert result["tokens_back"], f"{name} case {case}: generated tokens did not all come back"
            seen.add(case)
    assert seen >= {"1", "2", "3", "4", "5"}, f"cases run at 0.95 in {out}: {sorted(seen)}"


def engine_script_log(script: str) -> str:
    """The log of ``script`` (vLLM engines in a Python process of their own, the engine core in
    it); skips where vLLM cannot run here, fails where the script does."""
    reason = e2e_unavailable()
    if reason:
        pytest.skip(reason)
    env = {**run_cases.ENV_DEFAULTS, **os.environ}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    return log


# The sized KV cache no larger than the one vLLM profiles CUDA graphs against: with CUDA graphs, 64
# sequences and captures up to 64, that cache has 64 blocks, and so does the override's.
OVERRIDE_BLOCKS = 64
PRELUDE = f"""
import gc, random, sys
sys.path.insert(0, {str(HERE)!r})
import run_cases
from vllm import LLM, SamplingParams
rng = random.Random(0)
def generate(llm, *lengths):
    prompts = [run_cases.token_prompt(n, rng) for n in lengths]
    outputs = llm.generate(prompts, SamplingParams(**run_cases.sampling_kwargs()))
    return [len(o.outputs[0].token_ids) for o in outputs]
"""
OVERRIDE_ENGINE = PRELUDE + f"""
kwargs = run_cases.engine_kwargs("planned", 0.5, 4096, max_model_len={(OVERRIDE_BLOCKS - 1) * 64}, max_num_seqs=64)
kwargs.update(enforce_eager=False, num_gpu_blocks_override={OVERRIDE_BLOCKS},
              compilation_config={{"max_cudagraph_capture_size": 64}})
print("generated", generate(LLM(**kwargs), 3000, 200, 200), flush=True)
"""


@pytest.mark.e2e
def test_the_reservation_is_handed_over_on_a_kv_cache_of_the_profiling_blocks() -> None:
    """``--num-gpu-blocks-override`` at the blocks of the minimal cache vLLM profiles CUDA graphs
    against: the reservation is handed to the kernels once vLLM has sized the KV cache, and the
    requests finish."""
    log = engine_script_log(OVERRIDE_ENGINE)
    assert "generated [4, 4, 4]" in log, log[-4000:]
    sized, handed = log.find("Available KV cache memory"), log.find("handed to the kernels")
    assert sized >= 0 and handed > sized, log[-4000:]
    print(*(line for line in log.splitlines() if re.search("KV cache|reservation|handed|generated", line)), sep="\n")


# Two engines one after the other in one process (the engine core in this process, as
# VLLM_ENABLE_V1_MULTIPROCESSING=0 runs it): each reserves, and hands over, its own.
SEQUENTIAL_ENGINES = PRELUDE + """
from vllm.distributed import cleanup_dist_env_and_memory
for engine in range(2):
    llm = LLM(**run_cases.engine_kwargs("planned", 0.4, 4096, max_model_len=8192))
    print("engine", engine, "generated", generate(llm, 3000), flush=True)
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
"""


@pytest.mark.e2e
def test_an_engine_after_another_in_one_process_reserves_its_own() -> None:
    log = engine_script_log(SEQUENTIAL_ENGINES)
    assert "engine 1 generated [4]" in log, log[-4000:]
    print(*(line for line in log.splitlines() if re.search("KV cache|reserved|handed|generated", line)), sep="\n")
    assert log.count("reserved from the KV cache") == 2, "the second engine made no reservation"
    assert log.count("handed to the kernels") == 2


# Sleep mode (vLLM's CuMem allocator): the reservation is made in vLLM's pool for the model, and the
# hand-over unmaps it from there; the engine then sleeps, wakes and serves again.
SLEEP_MODE_ENGINE = PRELUDE + """
from vllm.device_allocator.cumem import CuMemAllocator
from mla_planner.vllm_backend import engine
llm = LLM(**run_cases.engine_kwargs("planned", 0.5, 4096, max_model_len=8192), enable_sleep_mode=True)
pool = CuMemAllocator.get_instance()
reservation = engine._states[-1][1].reservation  # the engine's, the one engine of this process
def in_pool():  # whether a segment of vLLM's pool still covers the reservation's address
    address = reservation.address
    return any(start <= address < start + data.handle[1] for start, data in pool.pointer_to_data.items())
for round in range(2):
    print("round", round, "generated", generate(llm, 3000), "reservation held", reservation.held(),
          "in vLLM's pool", in_pool(), flush=True)
    llm.sleep(level=1)
    llm.wake_up()
"""


@pytest.mark.e2e
def test_under_sleep_mode_the_reservation_leaves_vllms_pool_and_the_engine_sleeps_and_wakes() -> None:
    log = engine_script_log(SLEEP_MODE_ENGINE)
    print(*(line for line in log.splitlines() if re.search("reserved|handed|generated|CuMem", line)), sep="\n")
    assert "round 1 generated [4]" in log, log[-4000:]
    assert "unmapped from vLLM's sleep-mode memory pool" in log, log[-4000:]
    assert "round 0 generated [4] reservation held False in vLLM's pool False" in log, "it stayed in vLLM's pool"


# --- packing and unpacking -------------------------------------------------------------------------


def write_wheel(path: Path, name: str, version: str, files: dict[str, str], entry_points: str = "") -> Path:
    """A minimal pure-Python wheel that pip installs."""
    info = f"{name}-{version}.dist-info"
    meta = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
            f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    if entry_points:
        meta[f"{info}/entry_points.txt"] = entry_points
    everything = {**files, **meta}
    everything[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in everything) + f"{info}/RECORD,,\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for n, text in everything.items():
            zf.writestr(n, text)
    return path


# The vLLM wheel's layout in miniature, with a file of each kind member_kind sorts: kept, FA3's, dropped.
TOY_VLLM = {"vllm/_flashmla_C.abi3.so": "kernels\n", eb.FA3_SO: "fa3\n" * 1000,
            "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": "312\n",
            "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "fa2\n", "vllm/third_party/fmha_sm100/x.hpp": "sm100\n",
            "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": "311\n"}


def stage_toy(root: Path, chunk_bytes: int, version: str = "0.26.0") -> dict[str, Any]:
    """What scripts/e2e_stage.py does, on the toy wheel and a toy dependency: parts in root/.e2e/parts."""
    build = root / "build" / version
    toy = write_wheel(build / f"vllm-{version}-py3-none-any.whl", "vllm", version,
                      {"vllm/__init__.py": f'__version__ = "{version}"\n', **TOY_VLLM})
    core, fa3 = eb.pack_vllm_wheel(toy, build)
    dep_name = f"toydep{version.replace('.', '')}"
    dep = write_wheel(build / f"{dep_name}-1.0-py3-none-any.whl", dep_name, "1.0", {f"{dep_name}/__init__.py": ""})
    bundle = eb.make_bundle(eb.target_for(version),
                            [(eb.CORE_TAR, core), (eb.FA3_TAR, fa3), (f"{eb.WHEELS_DIR}/{dep.name}", dep)],
                            build / eb.BUNDLE)
    return eb.split_into_parts(bundle, root / ".e2e" / "parts", chunk_bytes)


def test_pack_split_join_unpack_round_trip(tmp_path: Path) -> None:
    manifest = stage_toy(tmp_path, chunk_bytes=4000)
    parts = sorted((tmp_path / ".e2e" / "parts").iterdir())
    assert len(parts) == len(manifest["chunks"]) >= 2
    assert all(sum(f.stat().st_size for f in p.iterdir() if f.name != eb.MANIFEST) <= 4000 for p in parts)
    stash = tmp_path / "stash"
    stash.mkdir()
    for f in (f for part in parts[:-1] for f in part.iterdir()):
        shutil.copy(f, stash)
    assert eb.missing_chunks(stash) == [len(parts)]
    with pytest.raises(FileNotFoundError, match=f"parts \\[{len(parts)}\\]"):
        eb.join_parts(stash, stash / eb.BUNDLE)
    for f in parts[-1].iterdir():
        shutil.copy(f, stash)
    unpacked = eb.unpack_bundle(eb.join_parts(stash, stash / eb.BUNDLE), tmp_path / "unpacked")
    site = tmp_path / "site"
    eb.install_vllm_tree(unpacked, site)
    assert eb.missing_in_site(site) == []
    assert [(site / name).is_file() for name in TOY_VLLM] == [True] * 3 + [False] * 3  # the drops are dropped
    assert [p.name for p in (unpacked / eb.WHEELS_DIR).iterdir()] == ["toydep0260-1.0-py3-none-any.whl"]
    first = stash / f"{eb.BUNDLE}.001"  # a corrupt chunk is refused
    data = bytearray(first.read_bytes())
    data[100] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        eb.join_parts(stash, stash / eb.BUNDLE)


def device_install(repo: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=sys.executable, E2E_STASH=str(tmp / "stash"), E2E_SITE=str(tmp / "site"))
    return subprocess.run(["bash", str(repo / "tests/e2e/device_install.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=300)


def toy_repo(tmp_path: Path) -> Path:
    """A checkout of what the GPU machine runs (device_install.sh, e2e_bundle.py), and this
    project's wheel in .whl/ (``our_wheel``)."""
    repo = tmp_path / "repo"
    (repo / "tests/e2e").mkdir(parents=True)
    for name in ("device_install.sh", "e2e_bundle.py"):
        shutil.copy(HERE / name, repo / "tests/e2e" / name)
    our_wheel(repo, entry_point=True)
    return repo


def our_wheel(repo: Path, entry_point: bool) -> None:
    """This project's wheel in .whl/, with its vLLM plugin entry point or without."""
    write_wheel(repo / ".whl/mla_planner-0.1.0-py3-none-any.whl", "mla_planner", "0.1.0",
                {"mla_planner/__init__.py": '__version__ = "0.1.0"\n'},
                entry_points="[vllm.general_plugins]\nmla_planner = mla_planner:register\n" if entry_point else "")


def test_device_install_stashes_installs_checks_and_switches_version(tmp_path: Path) -> None:
    """Staging 0.33 after 0.26: the site ends with 0.33's vLLM and wheels only, none of 0.26's. A wheel
    of ours without the plugin's entry point fails the check."""
    repo = toy_repo(tmp_path)
    n = len(stage_toy(repo, chunk_bytes=4000)["chunks"])
    r = device_install(repo, tmp_path, "stash", str(n + 1))
    assert r.returncode == 2 and f"part{n + 1}" in r.stderr
    for k in range(1, n):
        r = device_install(repo, tmp_path, "stash", str(k))
        assert r.returncode == 0, r.stderr
    r = device_install(repo, tmp_path, "install")
    assert r.returncode != 0 and f"parts [{n}]" in r.stderr
    assert device_install(repo, tmp_path, "stash", str(n)).returncode == 0
    r = device_install(repo, tmp_path, "install")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "installed 1 dependency wheels" in r.stdout
    assert "import ok: vllm 0.26.0" in r.stdout and "mla_planner = mla_planner:register" in r.stdout
    assert (tmp_path / "site/toydep0260/__init__.py").is_file()
    r = device_install(repo, tmp_path, "install")  # idempotent: vLLM skipped, our wheel reinstalled
    assert r.returncode == 0 and "already installed from this bundle: skipped" in r.stdout, r.stdout + r.stderr
    for k in range(1, len(stage_toy(repo, chunk_bytes=1 << 20, version="0.33.0")["chunks"]) + 1):
        assert device_install(repo, tmp_path, "stash", str(k)).returncode == 0
    r = device_install(repo, tmp_path, "install")
    assert r.returncode == 0 and "import ok: vllm 0.33.0" in r.stdout, r.stdout + r.stderr
    assert "holds another staging: clearing it" in r.stdout
    site = tmp_path / "site"
    assert sorted(p.name for p in site.glob("vllm-*.dist-info")) == ["vllm-0.33.0.dist-info"]
    assert (site / "toydep0330").is_dir() and not (site / "toydep0260").exists()
    our_wheel(repo, entry_point=False)
    r = device_install(repo, tmp_path, "install")
    assert r.returncode != 0 and "entry point is missing" in r.stderr


def test_device_install_pythonpath_names_what_pth_files_add(tmp_path: Path) -> None:
    """A package that reaches its modules through a .pth file (CUTLASS's DSL) is importable with
    the printed PYTHONPATH, though not with the site alone."""
    site = tmp_path / "site"
    (site / "dsl/dsl_packages/cutelike").mkdir(parents=True)
    (site / "dsl/__init__.py").write_text("")
    (site / "dsl/dsl_packages/cutelike/__init__.py").write_text("")
    (site / "dsl.pth").write_text("import sys, os, dsl; sys.path.insert(0, os.path.join(dsl.__path__[0], 'dsl_packages'))")
    r = device_install(HERE.parent.parent, tmp_path, "pythonpath")
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip()
    assert path.split(":")[0] == str(site) and str(site / "dsl/dsl_packages") in path.split(":")
    probe = [sys.executable, "-S", "-c", "import cutelike"]
    assert subprocess.run(probe, env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True).returncode != 0
    assert subprocess.run(probe, env=dict(os.environ, PYTHONPATH=path), capture_output=True).returncode == 0


def test_staging_targets_pin_one_version_of_each_wheel() -> None:
    for minor, target in eb.TARGETS.items():
        assert target.vllm.startswith(minor + ".") and eb.target_for(target.vllm) is target
        names = [re.sub(r"[-_.]+", "-", dep.split("==")[0]).lower() for dep in target.dependencies]
        assert all(dep.count("==") == 1 for dep in target.dependencies), minor
        assert len(names) == len(set(names)), f"{minor}: a wheel named twice"
        # What the image has stays the image's; what the run never imports stays out.
        assert not {"torch", "triton", "vllm", "numpy", "transformers", "tokenizers"} & set(names), minor
    with pytest.raises(ValueError, match="no staging target for vLLM 0.27"):
        eb.target_for("0.27.1")


# --- run_cases ------------------------------------------------------------------------------------


def test_run_cases_arguments_cases_and_model_variants(tmp_path: Path) -> None:
    args = run_cases.parse_args(["--backend", "planned", "--util", "0.95", "--cases", "1,2", "3", "same_function",
                                 "--out", "x.json"])
    assert args.cases == ["1", "2", "3", "same_function"]
    for bad in (["--cases", "6"], ["--cases", "1", "--util", "1.5"], ["--cases", "1", "--block-size", "96"]):
        with pytest.raises(SystemExit):
            run_cases.parse_args(["--backend", "stock", "--util", "0.9", "--out", "x.json", *bad])
    assert sum(run_cases.CASE_PROMPTS["2"]) == 32764 and len(run_cases.CASE_PROMPTS["2"]) == 8
    assert sum(run_cases.CASE_PROMPTS["3"][1:]) + 1 == 32768  # the queued prompts + the blocker's decode token
    kwargs = run_cases.engine_kwargs("planned", 0.9, 32768, tp=2, block_size=128)
    assert (kwargs["attention_backend"], kwargs["tensor_parallel_size"], kwargs["block_size"]) == ("CUSTOM", 2, 128)
    assert run_cases.engine_kwargs("stock", 0.9, 32768)["attention_backend"] == "FLASHMLA_SPARSE"
    # tensor parallel 2 keeps 16 heads per rank: a copy of the model's config with 32
    scaled = run_cases.model_variant(run_cases.MODEL_DIR, tmp_path, heads=32)
    original = json.loads((run_cases.MODEL_DIR / "config.json").read_text())
    assert json.loads((scaled / "config.json").read_text()) == {**original, "num_attention_heads": 32}
    assert scaled.name == "tiny-deepseek-v32-32h"
    assert run_cases.model_variant(run_cases.MODEL_DIR, tmp_path, heads=16, layers=2) == run_cases.MODEL_DIR


def run_cases_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HERE / "run_cases.py"), *args], capture_output=True, text=True,
                          timeout=300)


def test_engine_arguments_are_known_to_the_installed_vllm() -> None:
    pytest.importorskip("vllm")
    r = run_cases_cli("--backend", "planned", "--util", "0.95", "--cases", "1", "--out", "unused.json", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    plan = json.loads(r.stdout[r.stdout.index("{"):])
    assert plan["problems"] == [] and plan["prompt_lens"] == {"1": [32768]}


def test_bench_on_stand_ins_a_tensor_parallel_run_never_touches_the_gpu_and_a_hung_engine_errs() -> None:
    import fakes

    torch, llm, params = fakes.modules()

    class NoCuda:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"torch.cuda.{name} called in the driver of a tensor-parallel run")

    torch.cuda = NoCuda()
    bench = run_cases.Bench(run_cases.engine_kwargs("planned", 0.95, 32768, tp=2), (torch, llm, params))
    assert bench.memory() == {}
    result = run_cases.run_case(bench, "5", 1)
    assert result["status"] == "ok" and "peak_allocated_bytes" not in result
    bench = run_cases.Bench(run_cases.engine_kwargs("stock", 0.9, 32768), fakes.modules(), case_timeout_s=0.2)
    bench.llm.llm_engine.step = lambda: []  # never progresses: a case error, not a hang
    result = run_cases.run_prompts_case(bench, "5")
    assert result["status"] == "error" and "TimeoutError" in result["error"] and not result["tokens_back"]
    assert bench.abort_all() == 1 and not bench.llm.llm_engine.has_unfinished_requests()


# --- fault injection (run_cases --faults) ----------------------------------------------------------


def test_each_fault_mode_fires_where_it_says() -> None:
    """oom2: the second launch after the step's metadata was built, once; launch: its first."""
    calls: list[str] = []

    class Inner:
        name = "inner"

        def sparse_decode(self, *args: Any) -> str:
            calls.append("decode")
            return "out"

        def sparse_prefill(self, *args: Any) -> str:
            calls.append("prefill")
            return "out"

    provider = faults.FaultyProvider(Inner(), MemoryError)
    assert provider.name == "inner"
    faults.arm("oom2")
    assert provider.sparse_decode() == "out"
    with pytest.raises(MemoryError):
        provider.sparse_prefill()
    assert provider.sparse_decode() == "out" and faults.read()["faults_fired"] == 1
    faults.arm("launch")
    with pytest.raises(RuntimeError):
        provider.sparse_decode()
    assert provider.sparse_decode() == "out" and calls == ["decode", "decode", "decode"]
    faults.arm("none")
    assert provider.sparse_decode() == "out" and provider.sparse_prefill() == "out"
    assert faults.read()["faults_fired"] == 0 and faults.read()["kernel_launches"] == 2
    with pytest.raises(ValueError, match="unknown fault mode"):
        faults.arm("sometimes")


def test_a_layer_calls_peak_is_what_it_took_beyond_its_start() -> None:
    class Cuda:
        allocated, peak = 1000, 5000

        def memory_allocated(self) -> int:
            return self.allocated

        def reset_peak_memory_stats(self) -> None:
            self.peak = self.allocated

        def max_memory_allocated(self) -> int:
            return self.peak

    torch = type("torch", (), {"cuda": Cuda()})()

    def forward(extra: int) -> None:
        torch.cuda.peak = max(torch.cuda.peak, torch.cuda.allocated + extra)
        if extra == 0:
            wrapped(300)  # a nested call (stock's code under ours) is the outer call's

    wrapped = faults.measured(forward, torch)
    faults.arm("none")
    wrapped(700)
    wrapped(0)
    assert faults.read()["attention_peak_bytes"] == 700 and faults.read()["attention_layer_calls"] == 2


def test_run_cases_runs_the_cases_once_per_fault_mode(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    r = run_cases_cli("--backend", "planned", "--util", "0.95", "--cases", "5", "--faults", "none,plan", "--out",
                      str(out), "--fake-engine")
    assert r.returncode == 0, r.stdout + r.stderr
    cases = json.loads(out.read_text())["cases"]
    assert list(cases) == ["none/5", "plan/5"] and all(c["status"] == "ok" for c in cases.values())
    assert [c["faults"]["mode"] for c in cases.values()] == ["none", "plan"]
    bad = run_cases_cli("--backend", "stock", "--util", "0.95", "--cases", "5", "--faults", "plan", "--out", str(out),
                        "--dry-run")
    assert bad.returncode == 2 and "--faults takes" in bad.stderr
