"""The serve driver (run_serve.py; docs/e2e.md): the ``e2e`` test needs a CUDA GPU or ``MLA_SERVE_RESULTS``;
the others run every phase on a CPU, on fakes.py's stand-ins, and check the command lines, logs and reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import matrix_design as md
import report
import run_serve
import serve_proc as proc
import step_log
from run_cases import CASE_PROMPTS, MODEL_DIR, REPLACE_VAR, model_variant
from test_e2e import e2e_unavailable

HERE = Path(__file__).resolve().parent
VOCAB = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
GLM5 = HERE / "tiny-glm5" / "config.json"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return proc.served_model_dir(tmp_path_factory.mktemp("model"))


def driver_cmd(out: Path, *args: str) -> list[str]:
    """run_serve.py on the stand-ins, on any free ports."""
    return [sys.executable, str(HERE / "run_serve.py"), "--out", str(out), "--port-base", "0", "--fake-server", *args]


def driver(out: Path, *args: str, timeout: float = 240, rc: int = 0, **env: str) -> subprocess.CompletedProcess[str]:
    """``driver_cmd``, ``env`` added to the environment; it must exit with ``rc``."""
    r = subprocess.run(driver_cmd(out, *args), capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **env})
    assert r.returncode == rc, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def fake_nvidia_smi(folder: Path, script: str = "echo 1234") -> dict[str, str]:
    """An nvidia-smi on PATH; ``script`` prints memory.used."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{script}\n")
    exe.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def results(out: Path, name: str) -> Any:
    return json.loads((out / name).read_text())


def serve_md(out: Path) -> str:
    return (out / report.SERVE_MD).read_text()


# --- the tokenizer, the design, the command lines --------------------------------------------------


def test_tokenizer_has_the_models_vocab_and_round_trips(model_dir: Path, tmp_path: Path) -> None:
    facts = proc.check_tokenizer(model_dir)  # which asserts size, round trip, bos and eos itself
    assert facts["len"] == VOCAB == 129280 and facts["all_special_ids"] == [0, 1, 2]
    assert json.loads((model_dir / "config.json").read_text()) == json.loads((MODEL_DIR / "config.json").read_text())
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json", *sorted(proc.TOKENIZER_FILES)]
    made = proc.served_model_dir(tmp_path)  # a later call reuses a whole folder, rebuilds a broken one
    stamp = (made / "tokenizer.json").stat().st_mtime_ns
    assert proc.served_model_dir(tmp_path) == made and (made / "tokenizer.json").stat().st_mtime_ns == stamp
    (made / "tokenizer.json").unlink()
    assert (proc.served_model_dir(tmp_path) / "tokenizer.json").is_file()


def test_vllms_random_dataset_gets_exactly_the_lengths_it_samples(model_dir: Path) -> None:
    """What `vllm bench serve --dataset-name random` does with this tokenizer, through vLLM's own
    tokenizer loader (both the client's "auto" and the server's "deepseek_v32" mode)."""
    pytest.importorskip("vllm")
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    doc = proc.WORKLOADS["mix"][1]
    for mode in ("auto", "deepseek_v32"):
        tokenizer: Any = get_tokenizer(str(model_dir), tokenizer_mode=mode)
        assert tokenizer.vocab_size == VOCAB and tokenizer.num_special_tokens_to_add() == 0
        exact = RandomDataset(random_seed=1).sample(tokenizer, 3, input_len=4096, output_len=16)
        assert [r.prompt_len for r in exact] == [4096] * 3
        ranged = RandomDataset(random_seed=2).sample(tokenizer, 4, range_ratio=json.loads(doc.range_ratio or ""),
                                                     input_len=doc.input_len, output_len=doc.output_len)
        for r in exact + ranged:
            ids = tokenizer.encode(r.prompt)  # as the server's completions endpoint counts it
            assert isinstance(r.prompt, str) and len(ids) == r.prompt_len and max(ids) < VOCAB and min(ids) > 2
        assert all(8478 <= r.prompt_len <= 65250 and 66 <= r.expected_output_len <= 510 for r in ranged)


def test_the_design_covers_every_value_and_both_required_pairs() -> None:
    assert md.check_design(md.DESIGN) == [] and md.coverage_gaps(md.DESIGN) == [] and 5 <= len(md.DESIGN) <= 6
    # with CUDA graphs: vLLM pads decode batches to a captured size
    assert md.REQUIRED_PAIRS == ({"mtp": 1, "max_num_seqs": 128, "cuda_graphs": True},
                                 {"budget": 512, "max_num_seqs": 1024, "cuda_graphs": True})
    first, second = (" x ".join(f"{k}={v!r}" for k, v in pair.items()) for pair in md.REQUIRED_PAIRS)
    eager = [replace(c, cuda_graphs=False) if c.mtp == 1 and c.max_num_seqs == 128 else c for c in md.DESIGN]
    assert md.coverage_gaps(eager) == [first]  # every value still there, the pair gone
    moved = [replace(c, max_num_seqs=128) if c.budget == 512 else c for c in md.DESIGN]
    assert second in md.coverage_gaps(moved) and first not in md.coverage_gaps(moved)
    assert md.check_design([*md.DESIGN, replace(md.DESIGN[0], budget=2048)]) == [
        "s1: budget=2048 is not one of ('min', 512, 1024, 4096)", "server name s1 used twice"]


@pytest.mark.parametrize("axis,value", [(a, v) for a, values in md.AXES.items() for v in values])
def test_a_value_no_server_has_is_a_gap(axis: str, value: Any) -> None:
    other = next(v for v in md.AXES[axis] if v != value)  # put wherever ``value`` was
    assert f"{axis}={value!r}" in md.coverage_gaps([replace(c, **{axis: other}) if c.values()[axis] == value else c
                                                    for c in md.DESIGN])


def test_the_tiny_glm5_has_glm5s_attention_geometry_at_tp8() -> None:
    """GLM-5 (transformers' GlmMoeDsaConfig defaults, checkpoint zai-org/GLM-5; vLLM 0.33's GLM-5.2
    row in tests/kernels/test_fused_deepseek_v32_norm_rope.py: q_lora 2048, kv_lora 512, rope 64,
    8 heads per rank, 32 index heads of 128), its 64 heads at TP 8 on one GPU; 2 small layers."""
    config = json.loads(GLM5.read_text())
    assert config["architectures"] == ["GlmMoeDsaForCausalLM"] and config["model_type"] == "glm_moe_dsa"
    geometry = {"kv_lora_rank": 512, "q_lora_rank": 2048, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
                "v_head_dim": 256, "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128, "vocab_size": 154880,
                "num_attention_heads": 64 // 8, "num_key_value_heads": 8, "num_hidden_layers": 2,
                "num_nextn_predict_layers": 0}
    assert {k: config[k] for k in geometry} == geometry
    loaded = pytest.importorskip("transformers").AutoConfig.from_pretrained(str(GLM5.parent))
    assert type(loaded).__name__ == "GlmMoeDsaConfig" and loaded.qk_head_dim == 256
    assert loaded.indexer_types == ["full", "full"] and loaded.mlp_layer_types == ["dense", "sparse"]


def test_server_flags_and_environments(tmp_path: Path) -> None:
    """A twin has its server's flags but for the backend and the port; a server's environment has
    run_cases' defaults, its own engine process and the plugin's settings of its spec."""
    for c in md.DESIGN:
        args = proc.server_args(md.spec(c, "plugin", 0.09, 8300, 512), tmp_path)
        stock = proc.server_args(md.spec(c, "stock", 0.09, 8320, None), tmp_path)
        assert args[args.index("--attention-backend") + 1] == "CUSTOM"
        assert stock[stock.index("--attention-backend") + 1] == "FLASHMLA_SPARSE"
        assert [a for a in stock if a not in ("FLASHMLA_SPARSE", "8320")] == [a for a in args if a not in ("CUSTOM", "8300")]
        folder = md.model_source(c, tmp_path)  # MTP: a copy with one MTP layer
        assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == (1 if c.mtp else 0)
        assert (folder == md.MODELS[c.model]) is (not c.mtp)
    by_name = {c.name: c for c in md.DESIGN}
    assert md.util_for(by_name["s4"], 0.09) == 0.12 and md.util_for(by_name["s3"], 0.09) == 0.16
    assert model_variant(md.MODELS["glm5"], tmp_path, mtp_layers=1).name == "tiny-glm5-1mtp"
    base = {"PYTHONPATH": "/tmp/site", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", REPLACE_VAR: "1",
            "MLA_PLANNER_SCRATCH_MB": "64", "PATH": "/bin"}
    stock_env = proc.server_env(proc.ServerSpec("stock", 0.9, 1, scratch_mb=None), base)
    plugin_env = proc.server_env(proc.ServerSpec("plugin", 0.9, 1, scratch_mb=2048), base)
    for env in (stock_env, plugin_env):
        assert env["PYTHONPATH"] == "/tmp/site" and env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
        assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and env["CUDA_HOME"] == "/usr/local/cuda"
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and REPLACE_VAR not in env
    assert "MLA_PLANNER_SCRATCH_MB" not in stock_env and plugin_env["MLA_PLANNER_SCRATCH_MB"] == "2048"
    cmd = proc.server_command(proc.ServerSpec("plugin", 0.95, 8100), Path("/m"), "python3")
    assert cmd[:5] == ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert "--enforce-eager" not in cmd and not any("force_mqa" in w for w in cmd)


PARSE = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
import matrix_design as md, serve_proc
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
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from mla_planner.vllm_backend.vllm_api import give_mtp_draft_the_target_backend
def engine_args(spec, model):
    ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(serve_proc.server_args(spec, model))
    ns.model = ns.model_tag  # what `vllm serve` does with its positional argument
    return ns, AsyncEngineArgs.from_cli_args(ns)
M = Path(sys.argv[2], "m")  # a folder that is there: offline, vLLM looks an absent one up on the Hub
M.mkdir(exist_ok=True)
out = {}
for engine in ("stock", "plugin"):
    ns, ea = engine_args(serve_proc.ServerSpec(engine, 0.45, 8200, 65536), M)
    out[engine] = {k: str(getattr(ea, k)) for k in ("model", "tokenizer", "load_format", "kv_cache_dtype", "block_size",
        "max_model_len", "max_num_batched_tokens", "gpu_memory_utilization", "enable_prefix_caching", "seed",
        "attention_backend", "enforce_eager", "served_model_name", "generation_config")}
    out[engine].update(force_mqa=ea.attention_config.sparse_mla_force_mqa, port=ns.port, host=ns.host,
                       access_log_off=ns.disable_uvicorn_access_log, tp=ns.tensor_parallel_size,
                       iterations=ea.enable_logging_iteration_details)
ns, ea = engine_args(serve_proc.ServerSpec("plugin", 0.95, 8201, log_iterations=True), M)
out["iterations"] = ea.enable_logging_iteration_details
parser = FlexibleArgumentParser()
add_cli_args(parser)
for client in sum(serve_proc.WORKLOADS.values(), ()):
    b = parser.parse_args(serve_proc.bench_args(client, base_url="http://127.0.0.1:8200", tokenizer=M, seed=7,
                                                result=Path("/r/x.json"), metadata={"engine": "plugin"}))
    out[client.label] = {k: getattr(b, k) for k in ("backend", "base_url", "model", "tokenizer", "dataset_name",
        "random_input_len", "random_output_len", "random_range_ratio", "num_prompts", "max_concurrency", "seed",
        "ignore_eos", "temperature", "num_warmups", "percentile_metrics", "metric_percentiles", "save_result",
        "result_dir", "result_filename", "metadata", "endpoint")}
for config in md.DESIGN:  # the matrix's servers into vLLM's engine config (no GPU)
    model = md.model_source(config, Path(sys.argv[2]))
    for engine in ("plugin", "stock"):
        _, ea = engine_args(md.spec(config, engine, 0.09, 8300, 512 if engine == "plugin" else None), model)
        got = {"backend": str(ea.attention_backend), "max_num_seqs": ea.max_num_seqs, "eager": ea.enforce_eager}
        if engine == "plugin":
            vc = ea.create_engine_config()
            sc = vc.speculative_config
            got.update(arch=vc.model_config.architectures[0], heads=vc.model_config.get_num_attention_heads(
                vc.parallel_config), spec_tokens=sc.num_speculative_tokens if sc else 0,
                draft=sc.draft_model_config.architectures[0] if sc else None,
                chunked=vc.scheduler_config.enable_chunked_prefill, mnbt=vc.scheduler_config.max_num_batched_tokens,
                prefix=vc.cache_config.enable_prefix_caching, kv=vc.cache_config.cache_dtype,
                max_model_len=vc.model_config.max_model_len)
            if sc:  # the draft's attention backend as vLLM's model runners build it, after the plugin's start-up
                got.update(draft_named=give_mtp_draft_the_target_backend(vc)[1], draft_v1=str(
                    SpecDecodeBaseProposer._create_draft_vllm_config(SimpleNamespace(speculative_config=sc,
                                                                                     vllm_config=vc))
                    .attention_config.backend))
                if hasattr(sc, "apply_draft_overrides"):  # 0.33's V2 runner
                    got.update(draft_v2=str(sc.apply_draft_overrides(vc).attention_config.backend))
        out[config.name + "-" + engine] = got
print("RESULT " + json.dumps(out, default=str))
"""


def test_command_lines_parse_with_vllms_parsers(tmp_path: Path) -> None:
    """Every server's flags through the installed vLLM's serve parser (the matrix's into its engine
    config), every bench client's through its bench parser."""
    pytest.importorskip("vllm")
    r = subprocess.run([sys.executable, "-c", PARSE, str(HERE), str(tmp_path)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.split("RESULT ", 1)[1])
    m = str(tmp_path / "m")
    for engine, backend in (("stock", "FLASHMLA_SPARSE"), ("plugin", "CUSTOM")):
        s = got[engine]
        assert s.pop("attention_backend").endswith(backend)
        # vLLM's defaults: CUDA graphs on, no forced MQA
        assert s == {"model": m, "tokenizer": m, "load_format": "dummy", "kv_cache_dtype": "fp8_ds_mla",
                     "block_size": "64", "max_model_len": "70000", "max_num_batched_tokens": "65536",
                     "gpu_memory_utilization": "0.45", "enable_prefix_caching": "False", "seed": "0",
                     "enforce_eager": "False", "force_mqa": False, "served_model_name": "['tiny-deepseek-v32']",
                     "generation_config": "vllm", "port": 8200, "host": "127.0.0.1", "access_log_off": True, "tp": 1,
                     "iterations": False}
    assert got["iterations"] is True  # --enable-logging-iteration-details
    long, doc = got["long"], got["mix-doc"]
    assert long == {"backend": "vllm", "base_url": "http://127.0.0.1:8200", "model": "tiny-deepseek-v32",
                    "tokenizer": m, "dataset_name": "random", "random_input_len": 32768, "random_output_len": 16,
                    "random_range_ratio": long["random_range_ratio"], "num_prompts": 32, "max_concurrency": 16,
                    "seed": 7, "ignore_eos": True, "temperature": 0, "num_warmups": 1,
                    "percentile_metrics": "ttft,tpot,itl,e2el", "metric_percentiles": "50,99", "save_result": True,
                    "result_dir": "/r", "result_filename": "x.json", "metadata": ["engine=plugin"],
                    "endpoint": "/v1/completions"}
    assert json.loads(doc["random_range_ratio"]) == {"input": 0.77, "output": 0.77} and doc["seed"] == 8
    assert got["chat"]["max_concurrency"] == 64 and got["chat"]["random_range_ratio"] == "0.0"
    for c in md.DESIGN:
        plugin, stock = got[f"{c.name}-plugin"], got[f"{c.name}-stock"]
        assert plugin["backend"].endswith("CUSTOM") and stock["backend"].endswith("FLASHMLA_SPARSE")
        assert plugin["max_num_seqs"] == stock["max_num_seqs"] == c.max_num_seqs
        assert plugin["eager"] is stock["eager"] is (not c.cuda_graphs)
        assert plugin["arch"] == {"v32": "DeepseekV32ForCausalLM", "glm5": "GlmMoeDsaForCausalLM"}[c.model]
        assert plugin["heads"] == {"v32": 16, "glm5": 8}[c.model]
        assert plugin["spec_tokens"] == c.mtp and (plugin["draft"] is None) is (c.mtp == 0)
        assert plugin["chunked"] is c.chunked_prefill and plugin["prefix"] is c.prefix_caching
        assert plugin["mnbt"] == md.mnbt(c) and plugin["max_model_len"] == 70000 and plugin["kv"] == "fp8_ds_mla"
        if c.mtp:
            # vLLM's V1 model runner (0.26's) gives the MTP draft an autoselected backend (stock's)
            # unless the speculative config names one: the plugin's start-up names its own.
            assert plugin["draft_named"] is True and plugin["draft_v1"].endswith("CUSTOM"), plugin
            assert plugin.get("draft_v2", "CUSTOM").endswith("CUSTOM"), plugin


# --- what a log says, the requests ------------------------------------------------------------------


def test_what_a_log_says() -> None:
    """A stock server's H200 log (vLLM 0.33.0, shortened): the EngineDeadError after the stop is not the
    engine's error, nor is a line below ERROR that quotes one; the plugin's refusal names its minimum."""
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
    assert facts["first_errors"] == [log.splitlines()[2]]
    assert proc.log_facts(log.replace("[shutdown] ", ""))["error_count"]["EngineDeadError"] == 1
    refused = ("(EngineCore pid=7) ERROR 12-03 10:00:01 [core.py:1] ValueError: mla-planner: MLA_PLANNER_SCRATCH_MB=64 "
               "is below what one step of this engine can need (64 heads, 1024 sequences); set MLA_PLANNER_SCRATCH_MB=681 "
               "or more")
    line, minimum = proc.refusal("(EngineCore pid=7) INFO 12-03 10:00:00 [backend.py:1] mla-planner: else\n" + refused)
    assert minimum == 681 and line == refused
    assert proc.refusal("... set MLA_PLANNER_SCRATCH_MB=64.4 or more")[1] == 65  # MiB, rounded up
    assert proc.refusal("ValueError: a budget of 64.0 MiB is below the 64.4 MiB ...") == (None, None)
    assert proc.disturbed("AssertionError: Error in memory profiling. Initial free memory") is not None
    assert proc.disturbed(refused) is None
    facts = proc.log_facts("mla-planner: scratch reservation of 1,024 MiB handed to the kernels\nmla-planner: a step "
                           "falls back to the bounded path: x\nmla-planner: a step falls back to the bounded path: y\n"
                           "Traceback (most recent call last):\nValueError: decode query lengths must be one length\n"
                           "[shutdown] EngineCore: trigger\nRuntimeError: after the stop")
    assert (facts["reserved_mib"], facts["fallback_lines"], facts["planner_line_count"]) == (1024, 2, 3)
    assert facts["first_errors"] == ["ValueError: decode query lengths must be one length"]
    quoted = ("(APIServer pid=1) WARNING 12-03 19:33:10 [system_utils.py:299] Found ulimit of 20000 ... fd limit "
              "errors like `OSError: [Errno 24] Too many open files`")
    cause = "(EngineCore pid=2) ERROR 12-03 19:34:57 [core.py:1330] ValueError: No available memory for the cache blocks."
    assert proc.log_facts(f"{quoted}\n{cause}")["first_errors"] == [cause]


def test_chat_prompts() -> None:
    prompts = run_serve.chat_prompts(100)
    assert len(prompts) == 100 and prompts == run_serve.chat_prompts(100)  # the same for every server
    prefix = prompts[0][0][:256]
    assert all(ids[:256] == prefix for ids, _ in prompts)  # a shared prefix: prefix caching's hits
    assert all(300 <= len(ids) <= 1100 and 16 <= m <= 256 for ids, m in prompts)
    assert len({m for _, m in prompts}) > 50 and len({len(ids) for ids, _ in prompts}) > 50


# --- the server's process --------------------------------------------------------------------------


def fake_server(log: Path, model_dir: Path, wrap: str | None = None, **env: str) -> proc.Server:
    """A stand-in server on a free port; ``wrap``: a shell line around its command (``{cmd}``)."""
    spec = proc.ServerSpec("plugin", 0.9, proc.free_port())
    cmd = proc.server_command(spec, model_dir, sys.executable, fake=True)
    if wrap is not None:
        cmd = ["sh", "-c", wrap.format(cmd=" ".join(cmd))]
    return proc.Server(spec, cmd, {**proc.server_env(spec), **env}, log)


def settled(server: proc.Server, limit_s: float) -> dict[str, Any]:
    while (state := server.start_state(limit_s)) is None:
        time.sleep(0.2)
    return state


def test_a_start_settles_and_stop_kills_every_process(tmp_path: Path, model_dir: Path) -> None:
    """A start settles when the server exits or its limit passes; the stop kills every process of the
    server's group, even one ignoring SIGTERM (the engine process stand-in, a ``sleep``)."""
    exits = fake_server(tmp_path / "exits.log", model_dir, FAKE_SERVE_EXIT_AT_START="1")
    exits.start()
    state = settled(exits, 60)
    assert state["status"] == "exited" and state["rc"] == 3 and state["elapsed_s"] < 20
    assert "fake start-up failure" in state["log_tail"] and exits.log_text().startswith("$ ")
    assert exits.stop()["left_running"] is False
    slow = fake_server(tmp_path / "slow.log", model_dir, FAKE_SERVE_START_S="60")
    slow.start()
    assert settled(slow, 1.5)["status"] == "timeout" and slow.alive() and slow.health() is None
    stopped = slow.stop()
    assert not slow.alive() and stopped["alive_at_stop"] and not stopped["left_running"]
    server = fake_server(tmp_path / "server.log", model_dir, "trap '' TERM; sleep 300 & exec {cmd}")
    server.start()
    assert settled(server, 30)["status"] == "ok" and server.health() == 200
    pids = proc.group_pids(server.pid or 0)
    assert len(pids) == 2 and server.pid in pids
    stopped = server.stop(grace_s=1)
    assert stopped["forced"] and not stopped["left_running"] and proc.group_pids(server.pid or 0) == []


def processes_of(folder: Path) -> list[int]:
    """Live processes whose command line names ``folder`` (the servers of a run there)."""
    def names(cmdline: Path) -> bool:
        try:
            return str(folder) in cmdline.read_bytes().decode(errors="replace")
        except OSError:
            return False

    return [int(c.parent.name) for c in Path("/proc").glob("[0-9]*/cmdline")
            if names(c) and proc.proc_stat(c.parent.name)[:1] not in ([], ["Z"])]


def started(out: Path, phase: str) -> bool:
    """The soak's server is up; the matrix's s2 has started (``load``: its 32K request too)."""
    try:
        if phase == "soak":
            return bool(results(out, "soak-plugin.json")["server"]["startup"]["status"] == "ok")
        s2 = results(out, "matrix.json")["servers"]["s2"]
        return "32k" in (s2.get("phases") or {}) if phase == "load" else (out / "logs" / "s2.log").is_file()
    except (OSError, ValueError, KeyError):
        return False


@pytest.mark.parametrize("phase,how", [("soak", signal.SIGTERM), ("soak", signal.SIGINT), ("soak", signal.SIGKILL),
                                       ("starting", signal.SIGTERM), ("load", signal.SIGTERM)])
def test_no_server_outlives_a_stopped_driver(tmp_path: Path, phase: str, how: signal.Signals) -> None:
    """SIGTERM and Ctrl-C: the driver stops its servers (a soak's; the matrix's while starting, or
    during the load, requests hanging). SIGKILL: the kernel sends SIGTERM (PR_SET_PDEATHSIG)."""
    out = tmp_path / "out"
    if phase == "soak":
        args, env = ["--phase", "soak", "--soak-s", "300", "--fake-bench"], fake_nvidia_smi(tmp_path / "bin")
    else:
        args = ["--phase", "matrix", "--servers", "s2,s4", "--request-timeout-s", "120"]
        env = {"FAKE_SERVE_START_S": "60"} if phase == "starting" else {"FAKE_SERVE_HANG_OVER": "20000"}
    with (tmp_path / "driver.log").open("w") as log:
        running = subprocess.Popen(driver_cmd(out, *args), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        deadline = time.monotonic() + 60
        while not started(out, phase):
            assert time.monotonic() < deadline and running.poll() is None, (tmp_path / "driver.log").read_text()
            time.sleep(0.2)
        assert processes_of(out)
        running.send_signal(how)
        running.wait(timeout=60)
        deadline = time.monotonic() + 30
        while processes_of(out):
            assert time.monotonic() < deadline, processes_of(out)
            time.sleep(0.2)
    finally:
        if running.poll() is None:
            running.kill()
    if phase == "soak" and how != signal.SIGKILL:
        server = results(out, "soak-plugin.json")["server"]
        assert server["stop"]["left_running"] is False and server["alive_at_end"] is True
    elif phase != "soak":
        assert results(out, "matrix.json")["finished"] is False
        # The report written at the stop is the one the file left gives: nothing was recorded after it.
        written = (out / "matrix.md").read_text()
        report.write(out)
        assert (out / "matrix.md").read_text() == written


# --- the phases on stand-ins -----------------------------------------------------------------------


def test_boundary_phase(tmp_path: Path) -> None:
    """The plugin's servers, started on a copy of the model with 8 hidden layers (--layers 8: nothing
    else changed, its tokenizer beside it), finish every case; stock's first dies on case 1."""
    driver(tmp_path, "--phase", "boundary", "--engine", "plugin", "--layers", "8")
    driver(tmp_path, "--phase", "boundary", "--engine", "stock")
    plugin = results(tmp_path, "boundary-plugin.json")
    assert plugin["finished"] and [s["mnbt"] for s in plugin["servers"]] == [32768, 65536]
    original = json.loads((MODEL_DIR / "config.json").read_text())
    for s in plugin["servers"]:
        assert list(s["cases"]) == s["case_order"] and s["alive_at_end"] and s["planner_lines"]
        for case, result in s["cases"].items():
            assert result["status"] == "ok" and result["health_after"] == 200, (case, result)
            assert [q["prompt_tokens"] for q in result["requests"]] == CASE_PROMPTS[case]
        model = Path(s["cmd"][s["cmd"].index("serve") + 1])
        assert model.name == "tiny-deepseek-v32-8l" and (model / "tokenizer.json").is_file()
        assert json.loads((model / "config.json").read_text()) == {**original, "num_hidden_layers": 8}
    first = results(tmp_path, "boundary-stock.json")["servers"][0]
    assert first["cases"]["1"]["status"] == "error" and first["cases"]["1"]["health_after"] is None
    assert first["cases"]["2"] == {"status": "not run", "error": "server process exited"}
    assert not first["alive_at_end"] and "CUDA out of memory" in first["error_count"] and not first["planner_lines"]
    md_text = serve_md(tmp_path)
    assert "boundary (plugin, util 0.95): every case finished" in md_text
    assert "boundary (stock, util 0.95): not finished: case 1 (32768), 2 (32768), 5 (32768), 4 (65536), 5 (65536)" \
        in md_text
    assert "| boundary-stock-32k | 2: eight heterogeneous prompts, 32,764 tokens | not run: server process exited |" \
        in md_text
    assert "dummy weights, 8 hidden layers)" in md_text  # the report says which model ran


def test_failrate_phase(tmp_path: Path) -> None:
    driver(tmp_path, "--phase", "failrate", "--failrate-n", "2")
    data = results(tmp_path, "failrate-stock.json")
    assert [t["util"] for t in data["trials"]] == [0.9, 0.95, 0.9, 0.95]  # interleaved
    for t in data["trials"]:
        assert t["server"]["stop"]["left_running"] is False
        assert (t["status"], t["engine_died"], t["oom_in_log"]) == (("ok", False, False) if t["util"] == 0.9
                                                                    else ("error", True, True))
    md_text = serve_md(tmp_path)
    assert "failrate (stock) at 0.9: 0 of 2 failed (0 at start-up, 0 on the 32K prompt), engine died in 0" in md_text
    assert "failrate (stock) at 0.95: 2 of 2 failed (0 at start-up, 2 on the 32K prompt), engine died in 2" in md_text
    assert "| 0.95 | 2 | 0 | 0 | 2 | 2 | 2 | HTTP 500:" in md_text
    # adds to it; this server fails its start-up (stock vLLM 0.33 at 0.95 on the H200 did, every time)
    driver(tmp_path, "--phase", "failrate", "--failrate-n", "1", "--failrate-utils", "0.95",
           FAKE_SERVE_EXIT_AT_START="1")
    data = results(tmp_path, "failrate-stock.json")
    assert [t["label"] for t in data["trials"]][-2:] == ["failrate-stock-0.95-c1-2", "failrate-stock-0.95-c2-1"]
    assert (data["trials"][-1]["status"], data["trials"][-1]["engine_died"], data["trials"][-1]["oom_in_log"]) == (
        "startup failed", None, True)
    md_text = serve_md(tmp_path)
    assert "failrate (stock) at 0.95: 3 of 3 failed (1 at start-up, 2 on the 32K prompt), engine died in 2" in md_text
    assert "| 0.95 | 3 | 0 | 1 | 2 | 2 | 3 | HTTP 500:" in md_text


def test_ab_phase_interleaves_and_a_later_call_replaces_its_workloads(tmp_path: Path) -> None:
    """Warm-ups, then repeats in alternating order; a later call replaces its workloads' runs, keeps the
    others, and refuses another model's. A logging configuration given: the driver writes none."""
    given = tmp_path / "given-logging.json"
    given.write_text('{"version": 1}')
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--repeats", "2", "--log-iterations",
               VLLM_LOGGING_CONFIG_PATH=str(given))
    assert "ab0-r1-long-stock: 32 done, 0 failed" in r.stdout and "servers log with millisecond stamps" not in r.stdout
    data = results(tmp_path, "ab.json")
    order = [(run["repeat"], run["workload"], run["engine"]) for run in data["runs"]]
    # a warm-up round (repeat None), then stock first in repeat 1 and the plugin first in repeat 2:
    # a drift over the call favours neither
    assert order == [(rep, w, e) for rep in (None, 1, 2) for w in ("long", "chat", "mix")
                     for e in (("plugin", "stock") if rep == 2 else ("stock", "plugin"))]
    assert [run["warmup"] for run in data["runs"]] == [True] * 6 + [False] * 12
    assert data["runs"][0]["tag"] == "ab0-w1-long-stock" and data["runs"][6]["tag"] == "ab0-r1-long-stock"
    # the seeds the recorded runs drew: 1000 + 100 x repeat + 10 x the workload's place in serve_proc.WORKLOADS
    assert [run["seed"] for run in data["runs"][::2]] == [900, 910, 920, 1000, 1010, 1020, 1100, 1110, 1120]
    assert all(run["status"] == "ok" and run["healthy_after"] for run in data["runs"])
    mix = data["runs"][10]
    assert mix["workload"] == "mix" and set(mix["clients"]) == {"mix-chat", "mix-doc"} and mix["combined"]["completed"] == 64 + 24
    assert [s["stop"]["left_running"] for s in data["calls"][0]["servers"].values()] == [False, False]
    md_text = serve_md(tmp_path)
    assert "chat: plugin/stock total tokens/s 1.24" in md_text  # the stand-in's plugin is 1.25x faster
    assert "ab servers at util 0.4: KV cache stock 60.00 GiB, plugin 59.00 GiB (stock − plugin 1,024 MiB)" in md_text
    assert "| combined | plugin/stock | – | – | – | – | 1.24" in md_text
    assert "Median over repeats (2 stock, 2 plugin finished; seeds [1020, 1120]" in md_text  # not the warm-up's 920
    driver(tmp_path, "--phase", "ab", "--fake-bench", "--repeats", "1", "--workloads", "long", "--warmup-rounds", "0")
    data = results(tmp_path, "ab.json")
    assert [(run["call"], run["workload"]) for run in data["runs"]].count((1, "long")) == 2
    assert {run["workload"] for run in data["runs"] if run["call"] == 0} == {"chat", "mix"}
    before = (tmp_path / "ab.json").read_text()  # but not runs of another model: one report, one model
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--workloads", "long", "--repeats", "1", "--layers", "8",
               rc=2)
    assert "holds runs of another model (--layers None); give another --out" in r.stderr, r.stdout + r.stderr
    assert (tmp_path / "ab.json").read_text() == before


def test_ab_at_once_runs_both_engines_together(tmp_path: Path) -> None:
    """--at-once chat,mix: a repeat's two runs of each overlap (mix: four clients) in one window, and
    the report pairs them as at the same time; long's go one after the other."""
    driver(tmp_path, "--phase", "ab", "--fake-bench", "--workloads", "chat,mix,long", "--repeats", "1",
           "--at-once", "chat,mix", FAKE_BENCH_HOLD_S="0.5")
    data = results(tmp_path, "ab.json")
    assert data["calls"][0]["at_once"] == ["chat", "mix"]
    runs = data["runs"]
    assert [(run["repeat"], run["workload"]) for run in runs][::2] == [(None, "chat"), (None, "mix"), (None, "long"),
                                                                        (1, "chat"), (1, "mix"), (1, "long")]

    def spans(run: dict[str, Any]) -> list[list[float]]:
        return [results(tmp_path / "bench", f"{run['tag']}-{label}.json")["fake_span"] for label in run["clients"]]

    for first, second in zip(runs[::2], runs[1::2]):
        assert first["seed"] == second["seed"] and first["status"] == second["status"] == "ok"
        both = spans(first) + spans(second)
        if first["workload"] != "long":  # every client of both engines at once
            assert first["at_once"] and second["at_once"] and first["window"] == second["window"]
            assert len(both) == (4 if first["workload"] == "mix" else 2)
            assert max(s[0] for s in both) < min(s[1] for s in both)
        else:
            assert not first["at_once"] and max(s[1] for s in spans(first)) <= min(s[0] for s in spans(second))
    md_text = serve_md(tmp_path)
    assert "chat: plugin/stock total tokens/s per repeat, median " in md_text
    assert "Plugin/stock TPOT p50 per repeat (same seed, at the same time): " in md_text
    assert "Plugin/stock total tokens/s per repeat (same seed, back to back): " in md_text  # long


def test_ab_without_time_or_a_server_runs_no_bench(tmp_path: Path) -> None:
    """Too little time left: no run starts, and a pair at once runs neither when one cannot. A server
    that does not start: the call stops there."""
    r = driver(tmp_path / "late", "--phase", "ab", "--fake-bench", "--workloads", "chat,long", "--repeats", "1",
               "--at-once", "chat", "--deadline-s", "30")
    data = results(tmp_path / "late", "ab.json")
    assert data["finished"] and {run["status"] for run in data["runs"]} == {"not run"}
    assert all("deadline" in run["error"] for run in data["runs"])
    assert "ab0-w1-chat-stock: not run: deadline" in r.stdout
    assert "- ab0-r1-long-plugin: not run: deadline" in serve_md(tmp_path / "late")
    driver(tmp_path, "--phase", "ab", "--fake-bench", FAKE_SERVE_EXIT_AT_START="1")
    data = results(tmp_path, "ab.json")
    assert data["runs"] == [] and list(data["calls"][0]["servers"]) == ["stock"]
    assert data["calls"][0]["servers"]["stock"]["startup"]["status"] == "exited"
    md_text = serve_md(tmp_path)
    assert "**ab call 0: stock server did not start: exited** (no bench run)" in md_text
    assert "| ab0-stock | stock | 0.4 | 32768 | exited, " in md_text and "RuntimeError: fake start-up failure |" in md_text


def test_ab_with_vllms_bench_client(tmp_path: Path) -> None:
    """vLLM's `bench serve` itself, against the stand-in server: its command line, the tokenizer it
    loads, the prompts it sends (exactly 32,768 tokens each) and the result file the driver reads."""
    pytest.importorskip("vllm")
    r = driver(tmp_path, "--phase", "ab", "--workloads", "long", "--repeats", "1", "--warmup-rounds", "0",
               "--prompt-scale", "0.0625", "--log-iterations", timeout=400)
    # no VLLM_LOGGING_CONFIG_PATH given: the driver writes one with millisecond stamps for the servers
    assert f"servers log with millisecond stamps (VLLM_LOGGING_CONFIG_PATH={tmp_path / 'logging.json'})" in r.stdout
    assert "%(msecs)03d" in (tmp_path / "logging.json").read_text()
    data = results(tmp_path, "ab.json")
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
    # step_log.py compare --ab on the run's windows: bench's warm-up request and the run's two, two
    # steps each (bench warms up inside the run's window)
    compared = step_log.compare_ab(tmp_path)
    assert "| steps | 6 | 6 |  |" in compared and "| other steps | 3 | 3 |  |" in compared


def test_soak_phase(tmp_path: Path) -> None:
    counter = tmp_path / "n"
    path = fake_nvidia_smi(tmp_path / "bin", f'n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}; '
                                             'echo $((1000 + 10 * n))')["PATH"]
    driver(tmp_path, "--phase", "soak", "--fake-bench", "--soak-s", "3", "--sample-s", "0.3", PATH=path)
    data = results(tmp_path, "soak-plugin.json")
    assert data["finished"] and len(data["iterations"]) >= 2 and data["same_processes"]
    assert data["pids_at_start"] == [data["server"]["pid"]]
    assert [i["seed"] for i in data["iterations"]][:2] == [1000, 1010]
    samples = data["samples"]
    assert len(samples) >= 5 and all(s["health"] == 200 and s["alive"]
                                      for s in samples)
    used = [s["used_mib"][0] for s in samples]
    assert used == sorted(used) and used[0] >= 1000  # the stand-in's memory grows by 10 MiB a sample
    warm = data["iterations"][0]["t_end_s"]
    flat = report.memory_flatness(samples, warm)
    after = [s["used_mib"][0] for s in samples if s["t_s"] >= warm]
    assert flat["spread_mib"] == max(after) - min(after) > 0
    md_text = serve_md(tmp_path)
    assert f"**max − min {flat['spread_mib']:,} MiB**" in md_text and "same processes" in md_text
    assert "| steps of 16 MiB or more between samples after warm-up | none |" in md_text  # 10 MiB a sample
    used = [1000, 1000, 2000, 2004, 2520, 2521, 2522, 2524, 2523]  # warm-up, a larger shape, then flat
    samples = [{"t_s": 5.0 * i, "used_mib": [u]} for i, u in enumerate(used)]
    assert (report.settled(samples, 0.0) or {})["steps"] == [(10.0, 1000), (20.0, 516)]
    settled_after = report.settled(samples, 12.0)  # only steps from a sample at 12 s on
    assert settled_after is not None and (settled_after["steps"], settled_after["at_s"], settled_after["span_s"],
                                          settled_after["spread_mib"]) == ([(20.0, 516)], 20.0, 20.0, 4)
    assert report.steps_row(settled_after) == (
        "| steps of 16 MiB or more between samples after warm-up | +516 MiB at 20 s; from the last (20 s) to the "
        "end (20 s, 5 samples): 2,520–2,524 MiB, max − min 4 MiB |")
    assert report.settled(samples, 21.0) is None


def test_a_phase_detaches_and_is_followed(tmp_path: Path) -> None:
    # the phase outlasts the follower's first look, 5 s on
    r = driver(tmp_path, "--phase", "ab", "--fake-bench", "--workloads", "long", "--repeats", "1",
               "--warmup-rounds", "0", "--detach", "--deadline-s", "0.5", FAKE_BENCH_HOLD_S="8")
    assert "ab: still running" in r.stdout and "with --phase ab --follow" in r.stdout, r.stdout + r.stderr
    pid = int((tmp_path / "ab-driver.pid").read_text())
    r = driver(tmp_path, "--phase", "ab", "--follow", "--deadline-s", "120")
    assert f"ab: finished (pid {pid} ended)" in r.stdout, r.stdout
    assert "  | ab0-r1-long-plugin: 32 done" in r.stdout  # the detached driver's log, followed
    data = results(tmp_path, "ab.json")
    assert data["finished"] and data["run"]["deadline_s"] == run_serve.DETACHED_DEADLINE_S
    assert [run["status"] for run in data["runs"]] == ["ok", "ok"]
    r = driver(tmp_path, "--phase", "boundary", "--follow", "--deadline-s", "1", rc=2)
    assert "no detached boundary in" in r.stderr


# --- the matrix on stand-ins -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The whole design with stock twins, once, on the stand-in server (which answers /health 2 s
    after its KV lines, as a server capturing CUDA graphs: staggered starts go on before that)."""
    out = tmp_path_factory.mktemp("matrix")
    return out, driver(out, "--phase", "matrix", "--stock-twins", FAKE_SERVE_START_S="2")


def test_the_whole_matrix_on_stand_ins(full_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, r = full_run
    data = results(out, "matrix.json")
    assert data["finished"] and data["coverage_gaps"] == [] and list(data["servers"]) == [c.name for c in md.DESIGN]
    for name, rec in data["servers"].items():
        plugin = rec["plugin"]
        assert plugin["startup"]["status"] == "ok" and plugin["alive_at_end"] and plugin["health_at_end"] == 200, name
        assert rec["twin"]["startup"]["status"] == "ok" and rec["twin"]["stop"]["alive_at_stop"]
        assert rec["twin"]["kv_cache_memory_gib"] == 60.0
        assert plugin["kv_cache_memory_gib"] == pytest.approx(60 - rec["scratch_mb"] / 1024, abs=0.005)
        assert plugin["reserved_mib"] == rec["scratch_mb"] and plugin["first_errors"] == []
        assert plugin["fallback_lines"] == (1 if rec["config"]["mtp"] else 0)
        assert list(rec["phases"]) == ["chat", "32k", "eight", "64k"]
        for key, result in rec["phases"].items():
            assert result["status"] == "ok" and result["health_after"] == 200, (name, key, result)
        assert rec["phases"]["chat"]["n_requests"] == rec["phases"]["chat"]["requests_ok"] == 100
        assert [q["prompt_tokens"] for q in rec["phases"]["64k"]["requests"]] == CASE_PROMPTS["4"]
        assert [q["prompt_tokens"] for q in rec["phases"]["eight"]["requests"]] == CASE_PROMPTS["2"]
        cmd = plugin["cmd"]
        assert cmd[cmd.index("--max-num-seqs") + 1] == str(rec["config"]["max_num_seqs"])
        assert rec["twin"]["startup"]["until"] == "KV cache sized"  # stopped at its KV line, before /health
        # a twin, and a server with one, start once the one before is up
        plugin_up = rec["plugin"]["window_s"][0] + rec["plugin"]["startup"]["elapsed_s"]
        assert rec["twin"]["window_s"][0] >= plugin_up - 0.5, (name, rec["twin"]["window_s"], plugin_up)
    # staggered: each start once the one before has sized its KV cache, twin after its server
    windows = sorted(rec[k]["window_s"] for rec in data["servers"].values() for k in ("plugin", "twin"))
    assert all(later[0] >= earlier[1] for earlier, later in zip(windows, windows[1:]))
    order = sorted((rec[k]["window_s"][0], rec[k]["label"]) for rec in data["servers"].values() for k in ("plugin",
                                                                                                         "twin"))
    assert [label for _, label in order][:4] == ["s1", "s1-stock", "s2", "s2-stock"]
    # "min": refused at 64 MiB with the minimum (the stand-in's: 64 + max_num_seqs / 8), started again with it
    for name, minimum in (("s3", 66), ("s5", 192)):
        rec = data["servers"][name]
        assert rec["probe"]["outcome"] == "refused" and rec["probe"]["min_mb"] == minimum == rec["scratch_mb"]
        assert rec["probe"]["refusal_line"].endswith(f"set MLA_PLANNER_SCRATCH_MB={minimum} or more")
        assert rec["probe"]["rc"] != 0 and rec["probe"]["startup"]["status"] == "exited"
        assert f"budget {minimum} MiB (MLA_PLANNER_SCRATCH_MB)" in rec["plugin"]["planner_lines"][0]
    assert data["servers"]["s5"]["plugin"]["cmd"][3].endswith("tiny-glm5-1mtp")  # [python, fakes.py, serve, model
    assert set(p.name for p in (out / "model").iterdir()) == {"tiny-deepseek-v32", "tiny-deepseek-v32-1mtp",
                                                              "tiny-glm5-1mtp"}
    md_text = (out / "matrix.md").read_text()
    assert "| s3 | v32 | 2 | 16 | min → 66 | yes | **off** | **on** |" in md_text
    assert "| 59.94 | 60.00 | -0.06 | 0.06 | 66 | 100/100 | 1/1 | 8/8 | 1/1 | 1 | yes |" in md_text
    assert "| s4 | v32 | – | 128 | 4096 | eager | on | off |" in md_text and "| 56.00 | 60.00 | -4.00 | 4.00 | – |" in md_text
    assert "Coverage: every value of every axis, and both required pairs" in md_text
    assert "engines dead at the end: none; servers not up: none" in md_text
    assert "refusal at 64 MiB: `mla_planner.engine_model.settings.SettingsError" in md_text
    r = subprocess.run([sys.executable, str(HERE / "report.py"), str(out)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == md_text + "\n", r.stderr
    header = next(line for line in r.stdout.splitlines() if line.startswith("| server |"))
    rows = [line for line in r.stdout.splitlines() if line.startswith("| s") and line != header]
    assert len(rows) == 6 and all(row.count(" | ") == header.count(" | ") for row in rows)


def test_a_64_mib_start_that_comes_up_is_kept_and_dead_engines_are_reported(tmp_path: Path) -> None:
    """s3's 64 MiB start comes up: 64 is its minimum and it is not started again. Both engines die on
    the 64K prompt: the step failed, the engine dead, its first errors."""
    driver(tmp_path, "--phase", "matrix", "--servers", "s3,s4", FAKE_SERVE_MIN_MB="64", FAKE_SERVE_DIE_OVER="40000")
    servers = results(tmp_path, "matrix.json")["servers"]
    s3 = servers["s3"]
    assert s3["probe"]["outcome"] == "started" and s3["probe"]["min_mb"] == 64 == s3["scratch_mb"]
    assert s3["plugin"]["label"] == "s3-min64" and not (tmp_path / "logs" / "s3.log").exists()  # not restarted
    for rec in servers.values():
        assert [rec["phases"][k]["status"] for k in ("chat", "32k", "eight", "64k")] == ["ok", "ok", "ok", "error"]
        assert rec["phases"]["64k"]["health_after"] is None and not rec["plugin"]["alive_at_end"]
        assert any("CUDA out of memory" in line for line in rec["plugin"]["first_errors"])
    md_text = (tmp_path / "matrix.md").read_text()
    assert "| min → 64 |" in md_text and "| 64 (64 started) |" in md_text
    assert "**missing model='glm5'" in md_text  # two servers: the coverage gaps are said
    assert "| 100/100 | 1/1 | 8/8 | 0/1, **1 failed** | 0 | **no** (after 64K) |" in md_text
    assert "Phases with failed requests: 2; engines dead at the end: s3, s4;" in md_text
    assert "- error: `torch.OutOfMemoryError: CUDA out of memory." in md_text


def test_a_start_the_others_disturbed_is_retried_alone(tmp_path: Path) -> None:
    r = driver(tmp_path, "--phase", "matrix", "--servers", "s2,s4", "--start", "together",
               FAKE_SERVE_DISTURB_ONCE=str(tmp_path / "disturbed"))
    retried = [rec for rec in results(tmp_path, "matrix.json")["servers"].values() if rec.get("attempts")]
    assert len(retried) == 1, r.stdout
    rec = retried[0]
    assert rec["attempts"][0]["startup"]["status"] == "exited"
    assert "Error in memory profiling" in rec["attempts"][0]["first_errors"][0]
    assert rec["plugin"]["startup"]["status"] == "ok" and rec["plugin"]["label"] == f"{rec['name']}-retry1"
    assert all(result["status"] == "ok" for result in rec["phases"].values())
    assert "(retry 1)" in r.stdout and "first start failed, retried alone: `AssertionError: Error in memory" in r.stdout


def test_together_starts_every_server_at_once_and_stops_the_twins_after(tmp_path: Path) -> None:
    r = driver(tmp_path, "--phase", "matrix", "--servers", "s1,s2,s4", "--stock-twins", "s1,s2", "--start", "together")
    servers = results(tmp_path, "matrix.json")["servers"]
    assert "twin" not in servers.pop("s4") and not (tmp_path / "logs" / "s4-stock.log").exists()  # not named
    records = [rec[k] for rec in servers.values() for k in ("plugin", "twin")]
    assert max(rec["window_s"][0] for rec in records) < min(rec["window_s"][1] for rec in records)  # all at once
    assert all(rec["twin"]["startup"]["status"] == "ok" and rec["twin"]["alive_at_end"] for rec in servers.values())
    assert all(rec["phases"]["64k"]["status"] == "ok" for rec in servers.values())
    assert "`--start together`" in r.stdout and "**All servers started at once**" in r.stdout


def test_chained_starts_each_once_the_one_before_is_up(tmp_path: Path) -> None:
    """--start chained: each server, then its twin, once the one before is up (a twin: sized)."""
    driver(tmp_path, "--phase", "matrix", "--servers", "s1,s3", "--stock-twins", "--start", "chained",
           FAKE_SERVE_START_S="1")
    servers = results(tmp_path, "matrix.json")["servers"]
    w = {rec[k]["label"]: rec[k]["window_s"] for rec in servers.values() for k in ("plugin", "twin")}
    assert w["s1"][1] <= w["s1-stock"][0] and w["s1-stock"][1] <= w["s3"][0] and w["s3"][1] <= w["s3-stock"][0]
    up_s1 = servers["s1"]["plugin"]["window_s"][0] + servers["s1"]["plugin"]["startup"]["elapsed_s"]
    assert w["s1-stock"][0] >= up_s1 - 0.5
    assert all(rec["phases"]["64k"]["status"] == "ok" for rec in servers.values())


def test_what_the_deadline_leaves_out_is_not_run(tmp_path: Path) -> None:
    # below a server's 120 s: nothing starts
    r = driver(tmp_path, "--phase", "matrix", "--servers", "s2,s3", "--stock-twins", "s2", "--deadline-s", "60")
    servers = results(tmp_path, "matrix.json")["servers"]
    assert servers["s3"]["probe"]["outcome"] == "not run" and servers["s2"]["plugin"]["startup"]["status"] == "not run"
    assert servers["s2"]["twin"]["startup"]["status"] == "not run"
    assert all(p["status"] == "not run" for rec in servers.values() for p in rec["phases"].values())
    assert "| s2 | v32 | – | 1024 | 512 | yes | on | off | not run |" in r.stdout
    assert "servers not up: s2, s3." in r.stdout and not (tmp_path / "logs").exists()


# --- the reports ------------------------------------------------------------------------------------


def bench_result(tok_s: float, ttft: float, failed: int = 0, tpot: float = 4.0) -> dict[str, Any]:
    return {"completed": 10 - failed, "failed": failed, "duration": 2.0, "total_input_tokens": 1000,
            "total_output_tokens": 100, "output_throughput": tok_s / 10, "total_token_throughput": tok_s,
            "p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "p50_tpot_ms": tpot, "p99_tpot_ms": 8.0}


def test_serve_report_from_hand_made_results(tmp_path: Path) -> None:
    """ab's medians, per-repeat pairs and runs not run, and a boundary phase cut by the driver's end."""
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
    ab = {"schema": 1, "phase": "ab", "finished": False, "runs": runs, "workload_titles": proc.WORKLOAD_TITLES,
          "calls": [{"id": 0, "util": 0.45, "servers": {
              "stock": {**server, "label": "ab0-stock", "engine": "stock"},
              "plugin": {**server, "label": "ab0-plugin", "engine": "plugin", "kv_cache_memory_gib": 49.0}}}]}
    boundary = {"schema": 1, "phase": "boundary", "finished": False, "run": {"engine": "plugin", "util": 0.95},
                "case_titles": {"1": "one 32,768-token prompt"}, "servers": [
                    {"label": "b-32k", "engine": "plugin", "mnbt": 32768, "startup": {"status": "ok", "elapsed_s": 70},
                     "planner_lines": ["mla-planner: x"], "planner_line_count": 1, "case_order": ["1", "2"],
                     "cases": {"1": {"status": "started"}}}]}
    (tmp_path / "ab.json").write_text(json.dumps(ab))
    (tmp_path / "boundary-plugin.json").write_text(json.dumps(boundary))
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a phase file: ignored
    report.write(tmp_path)
    md_text = serve_md(tmp_path)
    assert "chat: plugin/stock total tokens/s 1.300 (medians of 3 and 3 repeats)" in md_text  # 260 / 200
    assert "| chat | stock | 50.0 | 100.0 | 4.00 | 8.00 | 20 | 200 | 1 |" in md_text  # medians; failures summed
    assert "| chat | plugin/stock | 0.800 | 0.800 | 1.000 | 1.000 | 1.300 | 1.300 | |" in md_text
    assert "Total tokens/s per repeat (chat): stock 100 300 200; plugin 130 330 260." in md_text
    # each repeat's pair (same seed), then their median: not the ratio of the medians above
    assert "Plugin/stock total tokens/s per repeat (same seed, back to back): 1.300 1.100 1.300; median 1.300." in md_text
    assert "chat: plugin/stock total tokens/s per repeat, median 1.300 (3 pairs, 1.100–1.300, back to back)" in md_text
    assert "Plugin/stock TPOT p50 per repeat (same seed, back to back): 1.000 1.050 0.900; median 1.000." in md_text
    assert "chat: plugin/stock TPOT p50 per repeat, median 1.000 (3 pairs, 0.900–1.050, back to back)" in md_text
    assert "- ab0-r4-chat-plugin: not run: deadline: 12 s left" in md_text
    assert "**ab0-plugin: plugin server logged 0 mla-planner lines**" in md_text
    assert "KV cache stock 50.00 GiB, plugin 49.00 GiB (stock − plugin 1,024 MiB)" in md_text
    assert "`ab.json` (the driver did not finish this phase)" in md_text
    assert "| b-32k | 1: one 32,768-token prompt | no result: the driver ended during this case |" in md_text
    assert "| b-32k | 2:  | no result: the driver ended |" in md_text
    assert "boundary (plugin, util 0.95): not finished: case 1 (32768), 2 (32768)" in md_text
    assert not (tmp_path / report.MATRIX_MD).exists()  # no matrix.json here


def test_matrix_report_from_hand_made_results() -> None:
    """A server whose chat burst lost requests and died, one not started (no minimum), one cut."""
    ok = {"status": "ok", "n_requests": 1, "requests_ok": 1, "health_after": 200}
    data = {"schema": 1, "finished": False, "run": {"start": "together", "util": 0.09}, "versions": {"vllm": "0.33.0"},
            "coverage_gaps": ["budget=4096"], "servers": {
                "s1": {"name": "s1", "config": md.DESIGN[0].values(), "scratch_mb": 1024,
                       "plugin": {"startup": {"status": "ok", "elapsed_s": 91.2}, "alive_at_end": False,
                                  "health_at_end": None, "kv_cache_memory_gib": 5.5, "fallback_lines": 3,
                                  "first_errors": ["ValueError: decode query lengths must be one length"]},
                       "twin": {"startup": {"status": "ok"}, "kv_cache_memory_gib": 6.25},
                       "phases": {"chat": {"status": "error", "n_requests": 100, "requests_ok": 97, "health_after": None,
                                           "error": "HTTP 500"},
                                  "32k": {"status": "not run", "error": "server process exited"}}},
                "s3": {"name": "s3", "config": md.DESIGN[2].values(), "probe": {"outcome": "failed", "min_mb": None},
                       "plugin": {"startup": {"status": "not run", "error": "no minimum"}}},
                "s4": {"name": "s4", "config": md.DESIGN[3].values(), "scratch_mb": 4096,
                       "plugin": {"startup": {"status": "ok", "elapsed_s": 60}, "alive_at_end": True,
                                  "health_at_end": 200},
                       "phases": {"chat": ok, "32k": {"status": "started"}}}}}
    text = report.render_matrix(data)
    assert "**not finished**" in text and "**missing budget=4096**" in text
    assert ("| s1 | v32 | 1 | 128 | 1024 | yes | on | off | 91 s | 5.50 | 6.25 | -0.75 | – | – | 97/100, **3 failed** "
            "| not run | – | – | 3 | **no** (after chat burst) |") in text
    assert "| s3 | v32 | 2 | 16 | min | yes | **off** | **on** | not run | – | – | – | – | **none** (failed) |" in text
    assert "| 1/1 | **cut** (driver ended) | – | – | – | yes |" in text
    assert "engines dead at the end: s1; servers not up: s3." in text
    assert "- error: `ValueError: decode query lengths must be one length`" in text
    assert report.render_matrix({}).startswith("# Flag matrix")


# --- arguments --------------------------------------------------------------------------------------


def test_arguments() -> None:
    """Each phase's defaults, and what the driver refuses: a workload it lacks, at once outside
    --workloads, a matrix whose utilizations (twins alive at once included) overfill a GPU."""
    def parse(*argv: str) -> Any:
        return run_serve.parse_args(["--out", "x", *argv])

    assert (parse("--phase", "failrate").engine, parse("--phase", "soak").engine) == ("stock", "plugin")
    args = parse("--phase", "ab", "--workloads", "chat,mix", "--at-once")
    assert (args.util, args.at_once, args.start_timeout_s, args.request_timeout_s) == (0.40, ["chat", "mix"], 240, 120)
    args = parse("--phase", "matrix", "--stock-twins")
    assert (args.util, args.stock_twins, args.start_timeout_s, args.request_timeout_s) == (
        0.09, [c.name for c in md.DESIGN], 360, 180)
    assert parse("--phase", "matrix", "--stock-twins", "--start", "together").util == 0.04  # every twin at once
    assert run_serve.detached_deadline(parse("--phase", "soak", "--soak-s", "300")) == 300 + run_serve.DETACHED_MARGIN_S
    for phase, bad in [("ab", b) for b in (["--workloads", "huge"], ["--util", "1.5"], ["--detach", "--follow"],
                                           ["--workloads", "mix", "--at-once", "chat"])] + [
            ("matrix", b) for b in (["--servers", "s9"], ["--util", "0.2"],
                                    ["--stock-twins", "--start", "together", "--util", "0.09"],
                                    ["--servers", "s3", "--stock-twins", "s5"])]:
        with pytest.raises(SystemExit):
            parse("--phase", phase, *bad)


# --- on the GPU ------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_plugin_serves_the_boundary_cases(tmp_path: Path) -> None:
    saved = os.environ.get("MLA_SERVE_RESULTS")
    reason = None if saved else e2e_unavailable()  # the same conditions as the in-process e2e test's
    if reason:
        pytest.skip(reason)
    out = Path(saved) if saved else tmp_path
    if not saved:
        subprocess.run([sys.executable, str(HERE / "run_serve.py"), "--phase", "boundary", "--out", str(out)],
                       check=True, timeout=600)
    data = results(out, "boundary-plugin.json")
    assert data["finished"] and len(data["servers"]) == 2
    for server in data["servers"]:
        assert server["startup"]["status"] == "ok", server["startup"]
        assert server["planner_lines"], f"{server['label']}: the plugin logged nothing: not our backend?"
        for case in server["case_order"]:
            result = server["cases"].get(case, {})
            assert result.get("status") == "ok", f"{server['label']} case {case}: {result.get('error')}"
            assert result["health_after"] == 200
