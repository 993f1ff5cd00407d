"""The serving driver (run_serve.py, issue 14; docs/e2e.md, "Serving").

``test_plugin_serves_the_boundary_cases`` (marker ``e2e``) needs a CUDA GPU and vLLM with its
kernels, and skips elsewhere, saying why; with ``MLA_SERVE_RESULTS=DIR`` it checks a driver's saved
results instead. The others run on a CPU: the generated tokenizer (with vLLM's own tokenizer loader
and random dataset), the server and bench command lines (vLLM's own parsers), the server's process
handling (health wait, fail fast, the group kill, cleanup when the driver is stopped or killed), and
every phase end to end on stand-ins for ``vllm serve`` and ``vllm bench serve`` (serve_fakes.py),
once with vLLM's real bench client against the stand-in server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import run_serve
import serve_bench as sb
import serve_proc as proc
import serve_report
import step_log
from run_cases import CASE_PROMPTS, MODEL_DIR, REPLACE_VAR
from serve_tokenizer import check_tokenizer, served_model_dir
from test_e2e import e2e_unavailable
from test_step_log import iteration_line

HERE = Path(__file__).resolve().parent
VOCAB = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return served_model_dir(tmp_path_factory.mktemp("model"))


def driver(out: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """run_serve.py on the stand-ins, any free ports."""
    cmd = [sys.executable, str(HERE / "run_serve.py"), "--out", str(out), "--port-base", "0", "--fake-server", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def fake_nvidia_smi(folder: Path, script: str = "echo 1234") -> dict[str, str]:
    """An nvidia-smi on PATH: one process (pid 4242) on the GPU; ``script`` prints memory.used."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvidia-smi"
    exe.write_text(f'#!/bin/sh\ncase "$1" in\n--query-compute-apps=*) echo "4242, 900";;\n*) {script};;\nesac\n')
    exe.chmod(0o755)
    return dict(os.environ, PATH=f"{folder}{os.pathsep}{os.environ['PATH']}")


# --- the tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_has_the_models_vocab_and_round_trips(model_dir: Path, tmp_path: Path) -> None:
    facts = check_tokenizer(model_dir)
    assert facts["len"] == facts["vocab_size"] == VOCAB == 129280
    assert facts["round_trip"] and facts["adds_special_tokens"] == 0
    assert facts["all_special_ids"] == [0, 1, 2] and (facts["bos_token_id"], facts["eos_token_id"]) == (0, 1)
    config = json.loads((model_dir / "config.json").read_text())
    assert config == json.loads((MODEL_DIR / "config.json").read_text())
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json", "special_tokens_map.json", "tokenizer.json",
                                                           "tokenizer_config.json"]
    made = served_model_dir(tmp_path)  # a later call reuses a whole folder, rebuilds a broken one
    stamp = (made / "tokenizer.json").stat().st_mtime_ns
    assert served_model_dir(tmp_path) == made and (made / "tokenizer.json").stat().st_mtime_ns == stamp
    (made / "tokenizer.json").unlink()
    assert (served_model_dir(tmp_path) / "tokenizer.json").is_file()


def test_vllms_random_dataset_gets_exactly_the_lengths_it_samples(model_dir: Path) -> None:
    """What `vllm bench serve --dataset-name random` does with this tokenizer, through vLLM's own
    tokenizer loader (both the client's "auto" and the server's "deepseek_v32" mode)."""
    pytest.importorskip("vllm")
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    for mode in ("auto", "deepseek_v32"):
        tokenizer: Any = get_tokenizer(str(model_dir), tokenizer_mode=mode)
        assert tokenizer.vocab_size == VOCAB and tokenizer.num_special_tokens_to_add() == 0
        exact = RandomDataset(random_seed=1).sample(tokenizer, 3, input_len=4096, output_len=16)
        assert [r.prompt_len for r in exact] == [4096] * 3
        doc = sb.WORKLOADS["mix"][1]
        ranged = RandomDataset(random_seed=2).sample(tokenizer, 4, range_ratio=json.loads(doc.range_ratio or ""),
                                                     input_len=doc.input_len, output_len=doc.output_len)
        for r in exact + ranged:
            assert isinstance(r.prompt, str)
            ids = tokenizer.encode(r.prompt)  # as the server's completions endpoint counts it
            assert len(ids) == r.prompt_len and max(ids) < VOCAB and min(ids) > 2
        assert all(8478 <= r.prompt_len <= 65250 and 66 <= r.expected_output_len <= 510 for r in ranged)


# --- command lines ---------------------------------------------------------------------------------

PARSE = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import serve_bench, serve_proc
from vllm.platforms import current_platform
# vLLM 0.26 infers a device type while it builds the serve parser and fails where there is none;
# one is stood in here, in this process alone, so that the parser can be built on a CPU.
current_platform.device_type = current_platform.device_type or "cuda"
try:
    from vllm.entrypoints.openai.cli_args import make_arg_parser  # 0.26
except ImportError:
    from vllm.entrypoints.common.cli_args import make_arg_parser  # 0.33
from vllm.benchmarks.serve import add_cli_args
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = {}
for engine in ("stock", "plugin"):
    spec = serve_proc.ServerSpec(engine, 0.45, 8200, 65536)
    ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(serve_proc.server_args(spec, Path("/m")))
    ns.model = ns.model_tag  # what `vllm serve` does with its positional argument
    ea = AsyncEngineArgs.from_cli_args(ns)
    out[engine] = {k: str(getattr(ea, k)) for k in ("model", "tokenizer", "load_format", "kv_cache_dtype", "block_size",
        "max_model_len", "max_num_batched_tokens", "gpu_memory_utilization", "enable_prefix_caching", "seed",
        "attention_backend", "enforce_eager", "served_model_name", "generation_config")}
    out[engine]["force_mqa"] = ea.attention_config.sparse_mla_force_mqa
    out[engine].update(port=ns.port, host=ns.host, access_log_off=ns.disable_uvicorn_access_log)
    out[engine]["tp"] = ns.tensor_parallel_size
    out[engine]["iterations"] = ea.enable_logging_iteration_details
tp_spec = serve_proc.ServerSpec("plugin", 0.95, 8201, tp=2, log_iterations=True)
ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(serve_proc.server_args(tp_spec, Path("/m")))
ns.model = ns.model_tag
out["tp2"] = [ns.tensor_parallel_size, AsyncEngineArgs.from_cli_args(ns).enable_logging_iteration_details]
parser = FlexibleArgumentParser()
add_cli_args(parser)
for client in sum(serve_bench.WORKLOADS.values(), ()):
    cmd = serve_bench.bench_command(client, python="python3", base_url="http://127.0.0.1:8200", tokenizer=Path("/m"),
                                    seed=7, result=Path("/r/x.json"), metadata={"engine": "plugin"})
    b = parser.parse_args(cmd[cmd.index("serve") + 1:])
    out[client.label] = {k: getattr(b, k) for k in ("backend", "base_url", "model", "tokenizer", "dataset_name",
        "random_input_len", "random_output_len", "random_range_ratio", "num_prompts", "max_concurrency", "seed",
        "ignore_eos", "temperature", "num_warmups", "percentile_metrics", "metric_percentiles", "save_result",
        "result_dir", "result_filename", "metadata", "endpoint")}
print("RESULT " + json.dumps(out))
"""


def test_server_and_bench_command_lines_parse_with_vllms_parsers() -> None:
    pytest.importorskip("vllm")
    r = subprocess.run([sys.executable, "-c", PARSE, str(HERE)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.split("RESULT ", 1)[1])
    for engine, backend in (("stock", "FLASHMLA_SPARSE"), ("plugin", "CUSTOM")):
        s = got[engine]
        assert s["attention_backend"].endswith(backend) and s["model"] == "/m" and s["tokenizer"] == "/m"
        assert (s["load_format"], s["kv_cache_dtype"], s["block_size"]) == ("dummy", "fp8_ds_mla", "64")
        assert (s["max_model_len"], s["max_num_batched_tokens"], s["gpu_memory_utilization"]) == ("70000", "65536", "0.45")
        assert s["enable_prefix_caching"] == "False" and s["seed"] == "0" and s["generation_config"] == "vllm"
        # vLLM's defaults: CUDA graphs on, no forced MQA
        assert s["enforce_eager"] == "False" and s["force_mqa"] is False
        assert s["served_model_name"] == "['tiny-deepseek-v32']"
        assert (s["port"], s["host"], s["access_log_off"]) == (8200, "127.0.0.1", True)
        assert s["tp"] == 1 and s["iterations"] is False
    assert got["tp2"] == [2, True]  # --tensor-parallel-size, --enable-logging-iteration-details
    long, doc = got["long"], got["mix-doc"]
    assert (long["backend"], long["dataset_name"], long["endpoint"]) == ("vllm", "random", "/v1/completions")
    assert (long["random_input_len"], long["random_output_len"], long["num_prompts"], long["max_concurrency"]) == \
        (32768, 16, 32, 16)
    assert long["model"] == "tiny-deepseek-v32" and long["tokenizer"] == "/m" and long["seed"] == 7
    assert long["ignore_eos"] and long["temperature"] == 0 and long["save_result"] and long["num_warmups"] == 1
    assert (long["result_dir"], long["result_filename"], long["metadata"]) == ("/r", "x.json", ["engine=plugin"])
    assert (long["percentile_metrics"], long["metric_percentiles"]) == ("ttft,tpot,itl,e2el", "50,99")
    assert json.loads(doc["random_range_ratio"]) == {"input": 0.77, "output": 0.77} and doc["seed"] == 8
    assert got["chat"]["max_concurrency"] == 64 and got["chat"]["random_range_ratio"] == "0.0"


def test_server_environment() -> None:
    base = {"PYTHONPATH": "/tmp/site", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", REPLACE_VAR: "1",
            "MLA_PLANNER_SCRATCH_MB": "64", "PATH": "/bin"}
    stock = proc.server_env(proc.ServerSpec("stock", 0.9, 1, scratch_mb=None), base)
    plugin = proc.server_env(proc.ServerSpec("plugin", 0.9, 1, scratch_mb=2048), base)
    for env in (stock, plugin):
        assert env["PYTHONPATH"] == "/tmp/site" and env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
        assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and env["CUDA_HOME"] == "/usr/local/cuda"
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and REPLACE_VAR not in env
    assert "MLA_PLANNER_SCRATCH_MB" not in stock and plugin["MLA_PLANNER_SCRATCH_MB"] == "2048"
    cmd = proc.server_command(proc.ServerSpec("plugin", 0.95, 8100), Path("/m"), "python3")
    assert cmd[:5] == ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert "--enforce-eager" not in cmd and not any("force_mqa" in w for w in cmd)


def test_log_facts_leave_the_stops_errors_apart() -> None:
    """What the H200 logged for a stock server that served every request and was then stopped (vLLM
    0.33.0, shortened): the API server's EngineDeadError after the stop is not the engine's error, nor
    is a line logged below ERROR that quotes one (the WARNING line, written for this test)."""
    log = "\n".join([
        "(EngineCore pid=1021) INFO 12-01 15:09:10 [gpu_worker.py:436] Available KV cache memory: 45.52 GiB",
        "(EngineCore pid=1021) INFO 12-01 15:09:11 [kv_cache_utils.py:1687] GPU KV cache size: 31,008,592 tokens",
        "(EngineCore pid=1021) ERROR 12-01 15:10:00 [core.py:1586] torch.OutOfMemoryError: CUDA out of memory. Tried",
        "(EngineCore pid=1021) WARNING 12-01 15:10:01 [x.py:1] retrying after: CUDA out of memory (not the engine's error)",
        "(EngineCore pid=1021) INFO 12-01 15:13:19 [core.py:1525] [shutdown] EngineCore: trigger received signal=SIGTERM",
        "(APIServer pid=835) ERROR 12-01 15:13:19 [async_llm.py:943] Traceback (most recent call last):",
        "(APIServer pid=835) ERROR 12-01 15:13:19 [async_llm.py:943] vllm.v1.engine.exceptions.EngineDeadError: Engine",
        "(APIServer pid=835) ERROR 12-01 15:13:19 [async_llm.py:943] CUDA out of memory",
    ])
    facts = proc.log_facts(log)
    assert (facts["kv_cache_memory_gib"], facts["kv_cache_tokens"]) == (45.52, 31008592)
    assert facts["error_count"] == {"CUDA out of memory": 1, "OutOfMemoryError": 1}
    assert facts["error_lines_at_stop"] == 3
    assert proc.log_facts(log.replace("[shutdown] ", ""))["error_count"]["EngineDeadError"] == 1


# --- the server's process --------------------------------------------------------------------------


def fake_server(tmp_path: Path, model_dir: Path, wrap: str | None = None, **env: str) -> proc.Server:
    """A stand-in server on a free port; ``wrap``: a shell line around its command (``{cmd}``)."""
    spec = proc.ServerSpec("plugin", 0.9, proc.free_port())
    cmd = proc.server_command(spec, model_dir, sys.executable, fake=True)
    if wrap is not None:
        cmd = ["sh", "-c", wrap.format(cmd=" ".join(cmd))]
    return proc.Server(spec, cmd, {**proc.server_env(spec), **env}, tmp_path / "server.log")


def test_health_wait_fails_fast_when_the_server_exits(tmp_path: Path, model_dir: Path) -> None:
    server = fake_server(tmp_path, model_dir, FAKE_SERVE_EXIT_AT_START="1")
    server.start()
    t0 = time.monotonic()
    result = server.wait_healthy(timeout_s=60)
    assert result["status"] == "exited" and result["rc"] == 3 and time.monotonic() - t0 < 20
    assert "fake start-up failure" in result["log_tail"] and server.log_text().startswith("$ ")
    assert server.stop()["left_running"] is False


def test_health_wait_times_out_then_stop_ends_the_group(tmp_path: Path, model_dir: Path) -> None:
    server = fake_server(tmp_path, model_dir, FAKE_SERVE_START_S="60")
    server.start()
    result = server.wait_healthy(timeout_s=1.5, poll_s=0.2)
    assert result["status"] == "timeout" and server.alive() and server.health() is None
    stopped = server.stop()
    assert not server.alive() and stopped["alive_at_stop"] and not stopped["left_running"]


def test_stop_kills_every_process_of_the_server_even_one_ignoring_sigterm(tmp_path: Path, model_dir: Path) -> None:
    """The engine process stand-in (a ``sleep`` that ignores SIGTERM) is in the server's group."""
    server = fake_server(tmp_path, model_dir, "trap '' TERM; sleep 300 & exec {cmd}")
    server.start()
    assert server.wait_healthy(timeout_s=30)["status"] == "ok" and server.health() == 200
    pids = proc.group_pids(server.pid or 0)
    assert len(pids) == 2 and server.pid in pids
    stopped = server.stop(grace_s=1)
    assert stopped["forced"] and not stopped["left_running"] and proc.group_pids(server.pid or 0) == []


def wait_for(predicate: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.2)


def soak_server_pid(out: Path) -> int | None:
    try:
        data = json.loads((out / "soak-plugin.json").read_text())
    except (OSError, ValueError):
        return None
    server = data.get("server") or {}
    return server.get("pid") if server.get("startup", {}).get("status") == "ok" else None


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_no_server_outlives_the_driver(tmp_path: Path, how: signal.Signals) -> None:
    """SIGTERM and Ctrl-C: the driver stops its server on the way out. SIGKILL: the server's group
    leader gets SIGTERM from the kernel (PR_SET_PDEATHSIG)."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(HERE / "run_serve.py"), "--phase", "soak", "--soak-s", "300", "--out", str(out),
           "--port-base", "0", "--fake-server", "--fake-bench"]
    log = tmp_path / "driver.log"
    with log.open("w") as f:
        driver_proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=fake_nvidia_smi(tmp_path / "bin"))
    try:
        wait_for(lambda: soak_server_pid(out) is not None)
        pid = soak_server_pid(out) or 0
        assert proc.group_pids(pid) == [pid]
        driver_proc.send_signal(how)
        try:
            driver_proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the driver did not end: {log.read_text()[-3000:]}")
        wait_for(lambda: proc.group_pids(pid) == [], timeout_s=30)
    finally:
        if driver_proc.poll() is None:
            driver_proc.kill()
    if how != signal.SIGKILL:
        data = json.loads((out / "soak-plugin.json").read_text())
        assert "stop" in data["server"], log.read_text()[-3000:]
        assert data["server"]["stop"]["left_running"] is False and data["server"]["alive_at_end"] is True


# --- the phases on stand-ins -----------------------------------------------------------------------


def test_boundary_phase(tmp_path: Path) -> None:
    for engine in ("plugin", "stock"):
        r = driver(tmp_path, "--phase", "boundary", "--engine", engine)
        assert r.returncode == 0, r.stdout + r.stderr
    plugin = json.loads((tmp_path / "boundary-plugin.json").read_text())
    assert plugin["finished"] and [s["mnbt"] for s in plugin["servers"]] == [32768, 65536]
    for s in plugin["servers"]:
        assert list(s["cases"]) == s["case_order"] and s["alive_at_end"] and s["planner_lines"]
        for case, result in s["cases"].items():
            assert result["status"] == "ok" and result["health_after"] == 200, (case, result)
            assert [q["prompt_tokens"] for q in result["requests"]] == CASE_PROMPTS[case]
    stock = json.loads((tmp_path / "boundary-stock.json").read_text())
    first = stock["servers"][0]
    assert first["cases"]["1"]["status"] == "error" and first["cases"]["1"]["health_after"] is None
    assert first["cases"]["2"] == {"status": "not run", "error": "server process exited"}
    assert not first["alive_at_end"] and "CUDA out of memory" in first["errors"] and not first["planner_lines"]
    md = (tmp_path / serve_report.REPORT_MD).read_text()
    assert "boundary (plugin, util 0.95): every case finished" in md
    assert "boundary (stock, util 0.95): not finished: case 1 (32768), 2 (32768), 5 (32768), 4 (65536), 5 (65536)" in md
    assert "| boundary-stock-32k | 2: eight heterogeneous prompts, 32,764 tokens | not run: server process exited |" in md


def test_tensor_parallel_servers_get_the_scaled_model(tmp_path: Path) -> None:
    """--tp 2 --heads 32: every server is started with --tensor-parallel-size 2 on a copy of the model
    with 32 attention heads (16 per rank), tokenizer beside it."""
    r = driver(tmp_path, "--phase", "boundary", "--tp", "2", "--heads", "32")
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "boundary-plugin.json").read_text())
    for server in data["servers"]:
        cmd = server["cmd"]
        assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
        model = Path(cmd[cmd.index("serve") + 1])
        assert json.loads((model / "config.json").read_text())["num_attention_heads"] == 32
        assert (model / "tokenizer.json").is_file()
    r = driver(tmp_path, "--phase", "boundary", "--tp", "0")
    assert r.returncode == 2 and "--tp, --heads and --layers must be at least 1" in r.stderr


def test_layers_give_the_servers_a_deeper_model(tmp_path: Path) -> None:
    """--layers 8: every server loads a copy of the model with 8 hidden layers, nothing else changed,
    and the report says which model ran."""
    r = driver(tmp_path, "--phase", "boundary", "--layers", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "boundary-plugin.json").read_text())
    original = json.loads((MODEL_DIR / "config.json").read_text())
    for server in data["servers"]:
        cmd = server["cmd"]
        model = Path(cmd[cmd.index("serve") + 1])
        assert model.name == "tiny-deepseek-v32-8l"
        assert json.loads((model / "config.json").read_text()) == {**original, "num_hidden_layers": 8}
    assert "8 hidden layers" in (tmp_path / serve_report.REPORT_MD).read_text()
    r = driver(tmp_path, "--phase", "boundary", "--layers", "0")
    assert r.returncode == 2 and "--tp, --heads and --layers must be at least 1" in r.stderr


def test_a_phase_file_holds_one_model(tmp_path: Path) -> None:
    """ab adds to an earlier call's ab.json, but not runs of another model: one report, one model."""
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--workloads", "long", "--repeats", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    before = (tmp_path / "ab.json").read_text()
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--workloads", "long", "--repeats", "1", "--layers", "8")
    assert r.returncode == 2 and "holds runs of another model or parallelism (--tp 1); give another --out" \
        in r.stderr, r.stdout + r.stderr
    assert (tmp_path / "ab.json").read_text() == before


def test_failrate_phase(tmp_path: Path) -> None:
    r = driver(tmp_path, "--phase", "failrate", "--failrate-n", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "failrate-stock.json").read_text())
    assert [t["util"] for t in data["trials"]] == [0.9, 0.95, 0.9, 0.95]  # interleaved
    for t in data["trials"]:
        assert t["server"]["stop"]["left_running"] is False
        assert (t["status"], t["engine_died"], t["oom_in_log"]) == (("ok", False, False) if t["util"] == 0.9
                                                                    else ("error", True, True))
    md = (tmp_path / serve_report.REPORT_MD).read_text()
    assert "failrate (stock) at 0.9: 0 of 2 failed (0 at start-up, 0 on the 32K prompt), engine died in 0" in md
    assert "failrate (stock) at 0.95: 2 of 2 failed (0 at start-up, 2 on the 32K prompt), engine died in 2" in md
    assert "| 0.95 | 2 | 0 | 0 | 2 | 2 | 2 | HTTP 500:" in md
    # adds to it; this server fails its start-up (stock vLLM 0.33 at 0.95 on the H200 did, every time)
    r = driver(tmp_path, "--phase", "failrate", "--failrate-n", "1", "--failrate-utils", "0.95",
               env=dict(os.environ, FAKE_SERVE_EXIT_AT_START="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "failrate-stock.json").read_text())
    assert [t["label"] for t in data["trials"]][-2:] == ["failrate-stock-0.95-c1-2", "failrate-stock-0.95-c2-1"]
    last = data["trials"][-1]
    assert (last["status"], last["engine_died"], last["oom_in_log"]) == ("startup failed", None, True)
    md = (tmp_path / serve_report.REPORT_MD).read_text()
    assert "failrate (stock) at 0.95: 3 of 3 failed (1 at start-up, 2 on the 32K prompt), engine died in 2" in md
    assert "| 0.95 | 3 | 0 | 1 | 2 | 2 | 3 | HTTP 500:" in md


def test_ab_phase_interleaves_and_keeps_other_workloads(tmp_path: Path) -> None:
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--repeats", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ab0-r1-long-stock: 32 done, 0 failed" in r.stdout
    data = json.loads((tmp_path / "ab.json").read_text())
    order = [(run["repeat"], run["workload"], run["engine"]) for run in data["runs"]]
    # a warm-up round (repeat None), then stock first in repeat 1 and the plugin first in repeat 2:
    # a drift over the call favours neither
    assert order == [(rep, w, e) for rep in (None, 1, 2) for w in ("long", "chat", "mix")
                     for e in (("plugin", "stock") if rep == 2 else ("stock", "plugin"))]
    assert [run["warmup"] for run in data["runs"]] == [True] * 6 + [False] * 12
    assert data["runs"][0]["tag"] == "ab0-w1-long-stock" and data["runs"][6]["tag"] == "ab0-r1-long-stock"
    seeds: dict[tuple[int, str], set[int]] = {(run["repeat"], run["workload"]): set() for run in data["runs"]}
    for run in data["runs"]:
        seeds[(run["repeat"], run["workload"])].add(run["seed"])
        assert run["status"] == "ok" and run["healthy_after"]
    assert all(len(s) == 1 for s in seeds.values()) and len({min(s) for s in seeds.values()}) == 9
    mix = data["runs"][10]
    assert mix["workload"] == "mix" and set(mix["clients"]) == {"mix-chat", "mix-doc"} and mix["combined"]["completed"] == 64 + 24
    servers = data["calls"][0]["servers"]
    assert [s["stop"]["left_running"] for s in servers.values()] == [False, False]
    md = (tmp_path / serve_report.REPORT_MD).read_text()
    assert "chat: plugin/stock total tokens/s 1.24" in md  # the stand-in's plugin is 1.25x faster
    assert "ab servers at util 0.4: KV cache stock 60.00 GiB, plugin 59.00 GiB (stock − plugin 1,024 MiB)" in md
    assert "| combined | plugin/stock | – | – | – | – | 1.24" in md
    assert "Median over repeats (2 stock, 2 plugin finished; seeds [1020, 1120]" in md  # not the warm-up's 920
    assert "Warm-up rounds, not in the medians (combined): stock " in md
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--repeats", "1", "--workloads", "long",
               "--warmup-rounds", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "ab.json").read_text())
    assert [(run["call"], run["workload"]) for run in data["runs"]].count((1, "long")) == 2
    assert {run["workload"] for run in data["runs"] if run["call"] == 0} == {"chat", "mix"}


def test_ab_at_once_runs_both_engines_together(tmp_path: Path) -> None:
    """--at-once chat: a repeat's two chat runs start together and overlap, share one window, and the
    report pairs them as runs at the same time; mix's go one after the other, as without it."""
    env = dict(os.environ, FAKE_BENCH_HOLD_S="0.5")
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--workloads", "chat,mix", "--repeats", "2",
               "--at-once", "chat", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "ab.json").read_text())
    assert data["calls"][0]["at_once"] == ["chat"]
    runs = data["runs"]
    assert [(run["repeat"], run["workload"]) for run in runs][::2] == [(None, "chat"), (None, "mix"), (1, "chat"),
                                                                        (1, "mix"), (2, "chat"), (2, "mix")]

    def spans(run: dict[str, Any]) -> list[list[float]]:
        return [json.loads((tmp_path / "bench" / f"{run['tag']}-{label}.json").read_text())["fake_span"]
                for label in run["clients"]]

    for first, second in zip(runs[::2], runs[1::2]):
        assert first["seed"] == second["seed"] and first["status"] == second["status"] == "ok"
        both = spans(first) + spans(second)
        if first["workload"] == "chat":
            assert first.get("at_once") and second.get("at_once") and first["window"] == second["window"]
            assert max(s[0] for s in both) < min(s[1] for s in both)  # every client of both engines at once
        else:
            assert not first.get("at_once") and max(s[1] for s in spans(first)) <= min(s[0] for s in spans(second))
    md = (tmp_path / serve_report.REPORT_MD).read_text()
    assert "chat: plugin/stock total tokens/s per repeat, median " in md and "(2 pairs, " in md
    assert "Plugin/stock TPOT p50 per repeat (same seed, at the same time): " in md
    assert "Plugin/stock total tokens/s per repeat (same seed, back to back): " in md  # mix
    r = driver(tmp_path / "all", "--phase", "ab", "--fake-bench", "--workloads", "chat", "--repeats", "1",
               "--warmup-rounds", "0", "--at-once")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "all" / "ab.json").read_text())["calls"][0]["at_once"] == ["chat"]


def test_ab_at_once_runs_all_four_mix_clients_together(tmp_path: Path) -> None:
    """--at-once on mix: both engines' two clients (mix-chat, mix-doc) of a repeat run at once."""
    env = dict(os.environ, FAKE_BENCH_HOLD_S="0.5")
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--workloads", "mix", "--repeats", "1",
               "--warmup-rounds", "0", "--at-once", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "ab.json").read_text())
    assert data["calls"][0]["at_once"] == ["mix"]
    runs = data["runs"]
    assert sorted(run["engine"] for run in runs) == ["plugin", "stock"] and all(run["at_once"] for run in runs)
    spans = [json.loads((tmp_path / "bench" / f"{run['tag']}-{label}.json").read_text())["fake_span"]
             for run in runs for label in run["clients"]]
    assert len(spans) == 4 and max(s[0] for s in spans) < min(s[1] for s in spans)
    assert runs[0]["window"] == runs[1]["window"]
    md = (tmp_path / serve_report.REPORT_MD).read_text()
    assert "Plugin/stock total tokens/s per repeat (same seed, at the same time): " in md


def test_ab_at_once_runs_neither_when_one_cannot(tmp_path: Path) -> None:
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--workloads", "chat", "--repeats", "1", "--at-once",
               "chat", "--deadline-s", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    runs = json.loads((tmp_path / "ab.json").read_text())["runs"]
    assert {run["status"] for run in runs} == {"not run"} and all("deadline" in run["error"] for run in runs)


def test_ab_keeps_step_figures_of_the_runs_it_keeps(tmp_path: Path) -> None:
    """--log-iterations: the call's step figures per workload in ab.json; a later call of the same
    workload replaces them with its runs."""
    config = tmp_path / "given-logging.json"
    config.write_text('{"version": 1}')  # given: the driver writes none of its own
    env = dict(os.environ, VLLM_LOGGING_CONFIG_PATH=str(config))
    for _ in range(2):
        r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--workloads", "long", "--repeats", "1",
                   "--warmup-rounds", "0", "--log-iterations", env=env)
        assert r.returncode == 0 and "servers log with millisecond stamps" not in r.stdout, r.stdout + r.stderr
    data = json.loads((tmp_path / "ab.json").read_text())
    assert "long" not in data["calls"][0]["steps"]  # its runs were replaced by the second call's
    assert "long" not in data["calls"][0]["step_pairs"] and data["calls"][1]["step_pairs"] == {"long": []}
    steps = data["calls"][1]["steps"]["long"]
    assert steps["stock"]["steps"] == steps["plugin"]["steps"] == 0  # the stand-in bench sends no request
    assert "- long, vLLM's iteration lines of the timed runs (call 1): too few steps to compare" in \
        (tmp_path / serve_report.REPORT_MD).read_text()


def test_ab_stops_when_a_server_does_not_start(tmp_path: Path) -> None:
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", env=dict(os.environ, FAKE_SERVE_EXIT_AT_START="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "ab.json").read_text())
    assert data["runs"] == [] and list(data["calls"][0]["servers"]) == ["stock"]
    assert data["calls"][0]["servers"]["stock"]["startup"]["status"] == "exited"
    md = (tmp_path / serve_report.REPORT_MD).read_text()
    assert "**ab call 0: stock server did not start: exited** (no bench run)" in md
    assert "| ab0-stock | stock | 0.4 | 32768 | exited, " in md and "RuntimeError: fake start-up failure |" in md


def test_ab_deadline_leaves_runs_not_run(tmp_path: Path) -> None:
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--repeats", "1", "--deadline-s", "30")
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "ab.json").read_text())
    assert data["finished"] and {run["status"] for run in data["runs"]} == {"not run"}
    assert "ab0-w1-long-stock: not run: deadline" in r.stdout
    md = (tmp_path / serve_report.REPORT_MD).read_text()
    assert "- ab0-r1-mix-plugin: not run: deadline" in md


def test_ab_with_vllms_bench_client(tmp_path: Path) -> None:
    """vLLM's `bench serve` itself, against the stand-in server: its command line, the tokenizer it
    loads, the prompts it sends (exactly 32,768 tokens each) and the result file the driver reads."""
    pytest.importorskip("vllm")
    r = driver(tmp_path, "--phase", "ab", "--workloads", "long", "--repeats", "1", "--warmup-rounds", "0",
               "--prompt-scale", "0.0625", "--log-iterations", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    # no VLLM_LOGGING_CONFIG_PATH given: the driver writes one with millisecond stamps for the servers
    assert f"servers log with millisecond stamps (VLLM_LOGGING_CONFIG_PATH={tmp_path / 'logging.json'})" in r.stdout
    assert "%(msecs)03d" in (tmp_path / "logging.json").read_text()
    data = json.loads((tmp_path / "ab.json").read_text())
    for run in data["runs"]:
        assert run["window"][0] < run["window"][1]  # stamps as vLLM's log lines have them
        result = run["clients"]["long"]["result"]
        assert run["status"] == "ok" and run["clients"]["long"]["rc"] == 0, run
        assert (result["completed"], result["failed"], result["num_prompts"]) == (2, 0, 2)
        assert result["total_input_tokens"] == 2 * 32768 and result["total_output_tokens"] == 2 * 16
        assert all(isinstance(result[k], float) for k in ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
                                                          "output_throughput", "total_token_throughput"))
    for server in data["calls"][0]["servers"].values():
        log = (tmp_path / server["log"]).read_text()
        # one warm-up request and the two prompts, each exactly as long as asked
        assert log.count("completion request of 32768 prompt tokens") == log.count("completion request of") == 3
        assert "--enable-logging-iteration-details" in server["cmd"]
    # each workload's timed runs from the two servers' iteration lines (the stand-in's: two a request)
    compared = step_log.compare_ab(tmp_path)
    assert compared[0] == "### call 0, long (2 timed runs)"
    # bench's warm-up request and the run's two, two steps each: bench warms up inside the run's window
    assert "| steps | 6 | 6 |  |" in compared and "| other steps | 3 | 3 |  |" in compared
    steps = data["calls"][0]["steps"]["long"]  # kept in ab.json when the servers have stopped
    assert steps["stock"]["steps"] == steps["plugin"]["steps"] == 6
    # no run of three decode-only steps in the stand-in's lines: the report says so
    assert "- long, vLLM's iteration lines of the timed runs (call 0): too few steps to compare" in \
        (tmp_path / serve_report.REPORT_MD).read_text()


def test_soak_phase(tmp_path: Path) -> None:
    counter = tmp_path / "n"
    env = fake_nvidia_smi(tmp_path / "bin", f'n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}; '
                                            'echo $((1000 + 10 * n))')
    r = driver(tmp_path, "--phase", "soak", "--fake-bench", "--soak-s", "3", "--sample-s", "0.3", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "soak-plugin.json").read_text())
    assert data["finished"] and len(data["iterations"]) >= 2 and data["same_processes"]
    assert data["pids_at_start"] == [data["server"]["pid"]]
    samples = data["samples"]
    assert len(samples) >= 5 and all(s["health"] == 200 and s["alive"] for s in samples)
    used = [s["used_mib"][0] for s in samples]
    assert used == sorted(used) and used[0] >= 1000  # the stand-in's memory grows by 10 MiB a sample
    warm = data["iterations"][0]["t_end_s"]
    flat = serve_report.memory_flatness(samples, warm)
    after = [s["used_mib"][0] for s in samples if s["t_s"] >= warm]
    assert flat["spread_mib"] == max(after) - min(after) > 0
    md = (tmp_path / serve_report.REPORT_MD).read_text()
    assert f"**max − min {flat['spread_mib']:,} MiB**" in md and "same processes" in md
    assert all(s["processes"] == [[4242, 900]] for s in samples)
    assert "| processes holding GPU memory (nvidia-smi) | at most 1 in a sample, 1 distinct pids |" in md
    assert "| steps of 16 MiB or more between samples after warm-up | none |" in md  # 10 MiB a sample


def test_memory_steps_show_where_growth_stops() -> None:
    used = [1000, 1000, 2000, 2004, 2520, 2521, 2522, 2524, 2523]  # warm-up, a larger shape, then flat
    samples = [{"t_s": 5.0 * i, "used_mib": [u]} for i, u in enumerate(used)]
    assert serve_report.memory_steps(samples, 0.0) == [(10.0, 1000), (20.0, 516)]
    assert serve_report.memory_steps(samples, 12.0) == [(20.0, 516)]  # only steps from a sample at 12 s on
    after = serve_report.settled(samples, 12.0)
    assert after is not None and (after["at_s"], after["span_s"], after["spread_mib"]) == (20.0, 20.0, 4)
    assert serve_report.steps_row(after) == (
        "| steps of 16 MiB or more between samples after warm-up | +516 MiB at 20 s; from the last (20 s) to the "
        "end (20 s, 5 samples): 2,520–2,524 MiB, max − min 4 MiB |")
    assert serve_report.settled(samples, 21.0) is None


def test_soak_detaches_and_is_followed(tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path / "bin")
    r = driver(tmp_path, "--phase", "soak", "--fake-bench", "--detach", "--soak-s", "3", "--deadline-s", "1", env=env)
    assert r.returncode == 0 and "still running" in r.stdout, r.stdout + r.stderr
    pid = int((tmp_path / "soak-driver.pid").read_text())
    r = driver(tmp_path, "--phase", "soak", "--follow", "--deadline-s", "120", env=env)
    assert r.returncode == 0 and f"soak: finished (pid {pid} ended)" in r.stdout, r.stdout + r.stderr
    assert "  | soak iteration 1" in r.stdout
    data = json.loads((tmp_path / "soak-plugin.json").read_text())
    assert data["finished"] and data["run"]["deadline_s"] > 600 and data["iterations"]


def test_ab_detaches_and_is_followed(tmp_path: Path) -> None:
    hold = dict(os.environ, FAKE_BENCH_HOLD_S="8")  # the phase outlasts the follower's first look, 5 s on
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--workloads", "long", "--repeats", "1",
               "--warmup-rounds", "0", "--detach", "--deadline-s", "0.5", env=hold)
    assert r.returncode == 0 and "ab: still running" in r.stdout, r.stdout + r.stderr
    pid = int((tmp_path / "ab-driver.pid").read_text())
    r = driver(tmp_path, "--phase", "ab", "--follow", "--deadline-s", "120")
    assert r.returncode == 0 and f"ab: finished (pid {pid} ended)" in r.stdout, r.stdout + r.stderr
    data = json.loads((tmp_path / "ab.json").read_text())
    assert data["finished"] and data["run"]["deadline_s"] == run_serve.DETACHED_DEADLINE_S
    assert [run["status"] for run in data["runs"]] == ["ok", "ok"]
    r = driver(tmp_path, "--phase", "boundary", "--follow", "--deadline-s", "1")
    assert r.returncode == 2 and "no detached boundary in" in r.stderr


# --- the report ------------------------------------------------------------------------------------


def bench_result(tok_s: float, ttft: float, failed: int = 0, tpot: float = 4.0) -> dict[str, Any]:
    return {"completed": 10 - failed, "failed": failed, "duration": 2.0, "total_input_tokens": 1000,
            "total_output_tokens": 100, "output_throughput": tok_s / 10, "total_token_throughput": tok_s,
            "p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "p50_tpot_ms": tpot, "p99_tpot_ms": 8.0}


def test_report_from_hand_made_results(tmp_path: Path) -> None:
    runs = []
    for rep, (s_tok, p_tok) in enumerate(((100.0, 130.0), (300.0, 330.0), (200.0, 260.0)), start=1):
        for engine, tok in (("stock", s_tok), ("plugin", p_tok)):
            tpot = 4.0 if engine == "stock" else (4.0, 4.2, 3.6)[rep - 1]  # per repeat 1.05 and 0.9, median 4.0
            result = bench_result(tok, 50.0 if engine == "stock" else 40.0, failed=1 if rep == 2 else 0, tpot=tpot)
            runs.append({"workload": "chat", "engine": engine, "repeat": rep, "seed": 1000 + 100 * rep, "call": 0,
                         "tag": f"ab0-r{rep}-chat-{engine}", "status": "ok", "clients": {"chat": {"result": result}},
                         "combined": result})
    runs.append({"workload": "chat", "engine": "plugin", "repeat": 4, "seed": 1400, "call": 0,
                 "tag": "ab0-r4-chat-plugin", "status": "not run", "error": "deadline: 12 s left"})
    server = {"startup": {"status": "ok", "elapsed_s": 80.0}, "kv_cache_memory_gib": 50.0, "planner_lines": []}
    ab = {"schema": 1, "phase": "ab", "finished": False, "runs": runs, "workload_titles": sb.WORKLOAD_TITLES,
          "calls": [{"id": 0, "util": 0.45, "servers": {
              "stock": {**server, "label": "ab0-stock", "engine": "stock"},
              "plugin": {**server, "label": "ab0-plugin", "engine": "plugin", "kv_cache_memory_gib": 49.0}}}]}
    boundary = {"schema": 1, "phase": "boundary", "finished": False, "run": {"engine": "plugin", "util": 0.95},
                "case_titles": {"1": "one 32,768-token prompt"}, "servers": [
                    {"label": "b-32k", "engine": "plugin", "mnbt": 32768, "startup": {"status": "ok", "elapsed_s": 70},
                     "planner_lines": ["mla-planner: x"], "case_order": ["1", "2"],
                     "cases": {"1": {"status": "started"}}}]}
    (tmp_path / "ab.json").write_text(json.dumps(ab))
    (tmp_path / "boundary-plugin.json").write_text(json.dumps(boundary))
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a phase file: ignored
    assert run_serve.main(["--report-only", str(tmp_path)]) == 0
    md = (tmp_path / serve_report.REPORT_MD).read_text()
    assert "chat: plugin/stock total tokens/s 1.300 (medians of 3 and 3 repeats)" in md  # 260 / 200
    assert "| chat | stock | 50.0 | 100.0 | 4.00 | 8.00 | 20 | 200 | 1 |" in md  # medians; failures summed
    assert "| chat | plugin/stock | 0.800 | 0.800 | 1.000 | 1.000 | 1.300 | 1.300 | |" in md
    assert "Total tokens/s per repeat (chat): stock 100 300 200; plugin 130 330 260." in md
    # each repeat's pair (same seed), then their median: not the ratio of the medians above
    assert "Plugin/stock total tokens/s per repeat (same seed, back to back): 1.300 1.100 1.300; median 1.300." in md
    assert "chat: plugin/stock total tokens/s per repeat, median 1.300 (3 pairs, 1.100–1.300, back to back)" in md
    assert "Plugin/stock TPOT p50 per repeat (same seed, back to back): 1.000 1.050 0.900; median 1.000." in md
    assert "chat: plugin/stock TPOT p50 per repeat, median 1.000 (3 pairs, 0.900–1.050, back to back)" in md
    assert "- ab0-r4-chat-plugin: not run: deadline: 12 s left" in md
    assert "**ab0-plugin: plugin server logged 0 mla-planner lines**" in md
    assert "KV cache stock 50.00 GiB, plugin 49.00 GiB (stock − plugin 1,024 MiB)" in md
    assert "`ab.json` (the driver did not finish this phase)" in md
    assert "| b-32k | 1: one 32,768-token prompt | no result: the driver ended during this case |" in md
    assert "| b-32k | 2:  | no result: the driver ended |" in md
    assert "boundary (plugin, util 0.95): not finished: case 1 (32768), 2 (32768)" in md


def test_report_counts_the_steps_again_from_the_logs(tmp_path: Path) -> None:
    """--report-only counts an ab call's step figures again from its server logs (a run stores
    them as the step_log of its day counted them); without the logs the stored figures stand."""
    window = ["12-02 02:30:00.000", "12-02 02:30:00.999"]
    runs = [{"call": 0, "workload": "chat", "engine": e, "seed": 1010, "repeat": 1, "warmup": False, "status": "ok",
             "tag": f"ab0-r1-chat-{e}", "window": window, "clients": {"chat": {"result": bench_result(100.0, 50.0)}},
             "combined": bench_result(100.0, 50.0)} for e in ("stock", "plugin")]
    stale = {e: step_log.summarize([]) | {"decode_gap_ms": 9.0, "decode_gaps": 1} for e in ("stock", "plugin")}
    stale["plugin"]["decode_gap_ms"] = 18.0  # +100% as stored
    call = {"id": 0, "workloads": ["chat"], "util": 0.4, "steps": {"chat": stale}, "step_pairs": {"chat": [2.0]},
            "servers": {e: {"label": f"ab0-{e}", "engine": e, "log": f"logs/{e}.log"} for e in ("stock", "plugin")}}
    (tmp_path / "ab.json").write_text(json.dumps({"schema": 1, "phase": "ab", "finished": True, "runs": runs,
                                                  "calls": [call]}))
    assert run_serve.main(["--report-only", str(tmp_path)]) == 0
    assert "decode-only steps: the plugin's +100.0% against stock's (1 and 1 gaps)" in \
        (tmp_path / serve_report.REPORT_MD).read_text()  # no logs: as stored
    (tmp_path / "logs").mkdir()
    for engine, gap in (("stock", 4), ("plugin", 5)):  # decode-only steps 4 and 5 ms apart
        (tmp_path / "logs" / f"{engine}.log").write_text("\n".join(iteration_line(k * gap, 0, 8, 1.0)
                                                                  for k in range(20)))
    assert run_serve.main(["--report-only", str(tmp_path)]) == 0
    md = (tmp_path / serve_report.REPORT_MD).read_text()
    assert "decode-only steps: the plugin's +25.0% against stock's (17 and 17 gaps)" in md
    assert "decode-only steps per repeat, plugin/stock: 1.250; median 1.250 (1 pairs)" in md
    assert json.loads((tmp_path / "ab.json").read_text())["calls"][0]["steps"] == {"chat": stale}  # not rewritten



def test_arguments() -> None:
    args = run_serve.parse_args(["--phase", "failrate", "--out", "x"])
    assert (args.engine, args.failrate_utils, args.failrate_n) == ("stock", [0.9, 0.95], 2)
    args = run_serve.parse_args(["--phase", "ab", "--out", "x", "--workloads", "mix,long"])
    assert (args.util, args.workloads, args.repeats, args.warmup_rounds, args.deadline_s) == (
        0.40, ["mix", "long"], 3, 1, 540)
    assert args.at_once == []
    assert run_serve.parse_args(["--phase", "ab", "--out", "x", "--at-once", "chat"]).at_once == ["chat"]
    assert run_serve.parse_args(["--phase", "soak", "--out", "x"]).engine == "plugin"
    for bad in (["--workloads", "huge"], ["--util", "1.5"], ["--detach", "--follow"], ["--repeats", "0"],
                ["--warmup-rounds", "-1"], ["--workloads", "mix", "--at-once", "chat"]):
        with pytest.raises(SystemExit):
            run_serve.parse_args(["--phase", "ab", "--out", "x", *bad])
    with pytest.raises(SystemExit):
        run_serve.parse_args(["--phase", "ab"])


# --- on the GPU ------------------------------------------------------------------------------------


gpu_unavailable = e2e_unavailable  # the same conditions as the in-process e2e test's


@pytest.mark.e2e
def test_plugin_serves_the_boundary_cases(tmp_path: Path) -> None:
    saved = os.environ.get("MLA_SERVE_RESULTS")
    if not saved:
        reason = gpu_unavailable()
        if reason:
            pytest.skip(reason)
    out = Path(saved) if saved else tmp_path
    if not saved:
        subprocess.run([sys.executable, str(HERE / "run_serve.py"), "--phase", "boundary", "--out", str(out)],
                       check=True, timeout=600)
    data = json.loads((out / "boundary-plugin.json").read_text())
    assert data["finished"] and len(data["servers"]) == 2
    for server in data["servers"]:
        assert server["startup"]["status"] == "ok", server["startup"]
        assert server["planner_lines"], f"{server['label']}: the plugin logged nothing: not our backend?"
        for case in server["case_order"]:
            result = server["cases"].get(case, {})
            assert result.get("status") == "ok", f"{server['label']} case {case}: {result.get('error')}"
            assert result["health_after"] == 200
