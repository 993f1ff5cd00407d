"""The flag matrix driver (run_matrix.py, issue 29; docs/vllm.md, "The flag matrix").

On a CPU, in CI: the design covers every value of every axis and the two required pairs (and a
design missing any of them says so); the servers' command lines parse with the installed vLLM's own
parser and build its engine config (the tiny GLM-5 model, MTP, chunked prefill off included); the
driver end to end on serve_fakes.py's stand-in server: the minimum budget resolved from the
plugin's refusal line (or 64 where the 64 MiB start is up), stock twins' KV figures, the load, a
dead engine and failed requests reported as such, a start disturbed by the others retried alone,
``--detach``/``--follow``, and the ``--report-only`` table.
"""

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
import matrix_report
import run_matrix
from run_cases import CASE_PROMPTS, model_variant
from serve_proc import server_args

HERE = Path(__file__).resolve().parent
GLM5 = HERE / "tiny-glm5" / "config.json"


def driver(out: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """run_matrix.py on the stand-in server, any free ports."""
    cmd = [sys.executable, str(HERE / "run_matrix.py"), "--out", str(out), "--port-base", "0", "--fake-server", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def with_env(**values: str) -> dict[str, str]:
    return {**os.environ, **values}


# --- the design -------------------------------------------------------------------------------------


def test_the_design_covers_every_value_and_both_required_pairs() -> None:
    assert md.check_design(md.DESIGN) == []
    assert md.coverage_gaps(md.DESIGN) == []
    assert 5 <= len(md.DESIGN) <= 6
    for pair in md.REQUIRED_PAIRS:  # with CUDA graphs: vLLM pads decode batches to a captured size
        assert pair["cuda_graphs"] is True
    assert {"mtp": 1, "max_num_seqs": 128, "cuda_graphs": True} in md.REQUIRED_PAIRS
    assert {"budget": 512, "max_num_seqs": 1024, "cuda_graphs": True} in md.REQUIRED_PAIRS


def without(axis: str, value: Any) -> list[md.Config]:
    """The design with ``value`` of ``axis`` replaced, wherever it appears, by another of the axis's values."""
    other = next(v for v in md.AXES[axis] if v != value)
    return [replace(c, **{axis: other}) if c.values()[axis] == value else c for c in md.DESIGN]


@pytest.mark.parametrize("axis,value", [(a, v) for a, values in md.AXES.items() for v in values])
def test_a_value_no_server_has_is_a_gap(axis: str, value: Any) -> None:
    assert f"{axis}={value!r}" in md.coverage_gaps(without(axis, value))


def test_a_required_pair_no_server_has_is_a_gap() -> None:
    first, second = (" x ".join(f"{k}={v!r}" for k, v in pair.items()) for pair in md.REQUIRED_PAIRS)
    eager = [replace(c, cuda_graphs=False) if c.mtp == 1 and c.max_num_seqs == 128 else c for c in md.DESIGN]
    assert md.coverage_gaps(eager) == [first]  # every value still there, the pair gone
    moved = [replace(c, max_num_seqs=128) if c.budget == 512 else c for c in md.DESIGN]
    assert second in md.coverage_gaps(moved) and first not in md.coverage_gaps(moved)
    assert md.check_design([*md.DESIGN, replace(md.DESIGN[0], budget=2048)]) == [
        "s1: budget=2048 is not one of ('min', 512, 1024, 4096)", "server name s1 used twice"]


def test_each_server_gets_its_flags(tmp_path: Path) -> None:
    by_name = {c.name: c for c in md.DESIGN}
    for c in md.DESIGN:
        spec = md.spec(c, "plugin", 0.09, 8300, 512)
        args = server_args(spec, tmp_path)
        assert args[args.index("--max-num-seqs") + 1] == str(c.max_num_seqs)
        assert ("--enforce-eager" in args) is (not c.cuda_graphs)
        assert ("--no-enable-chunked-prefill" in args) is (not c.chunked_prefill)
        assert ("--enable-prefix-caching" in args) is c.prefix_caching
        assert ("--no-enable-prefix-caching" in args) is (not c.prefix_caching)
        mnbt = int(args[args.index("--max-num-batched-tokens") + 1])
        assert mnbt == (32768 if c.chunked_prefill else 70000) and int(args[args.index("--max-model-len") + 1]) == 70000
        if c.mtp:
            assert json.loads(args[args.index("--speculative-config") + 1]) == {"method": "mtp",
                                                                                 "num_speculative_tokens": c.mtp}
        else:
            assert "--speculative-config" not in args
        assert args[args.index("--attention-backend") + 1] == "CUSTOM"
        stock = server_args(md.spec(c, "stock", 0.09, 8320, None), tmp_path)
        assert stock[stock.index("--attention-backend") + 1] == "FLASHMLA_SPARSE"
        assert [a for a in stock if a != "FLASHMLA_SPARSE" and a != "8320"] == \
            [a for a in args if a != "CUSTOM" and a != "8300"]  # the twin: the same flags
    assert md.util_for(by_name["s4"], 0.09) == 0.12 and md.util_for(by_name["s3"], 0.09) == 0.16


def test_mtp_servers_serve_a_copy_with_one_mtp_layer(tmp_path: Path) -> None:
    for c in md.DESIGN:
        folder = md.model_source(c, tmp_path)
        config = json.loads((folder / "config.json").read_text())
        assert config["num_nextn_predict_layers"] == (1 if c.mtp else 0)
        assert (folder == md.MODELS[c.model]) is (not c.mtp)
    assert model_variant(md.MODELS["glm5"], tmp_path, mtp_layers=1).name == "tiny-glm5-1mtp"


def test_the_tiny_glm5_has_glm5s_attention_geometry_at_tp8() -> None:
    """GLM-5 (transformers' GlmMoeDsaConfig defaults, checkpoint zai-org/GLM-5; vLLM 0.33's GLM-5.2
    row in tests/kernels/test_fused_deepseek_v32_norm_rope.py: q_lora 2048, kv_lora 512, rope 64,
    8 heads per rank, 32 index heads of 128), its 64 heads at TP 8 on one GPU; 2 small layers."""
    config = json.loads(GLM5.read_text())
    assert config["architectures"] == ["GlmMoeDsaForCausalLM"] and config["model_type"] == "glm_moe_dsa"
    geometry = {k: config[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                       "v_head_dim", "index_topk", "index_n_heads", "index_head_dim", "vocab_size")}
    assert geometry == {"kv_lora_rank": 512, "q_lora_rank": 2048, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
                        "v_head_dim": 256, "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128,
                        "vocab_size": 154880}
    assert config["num_attention_heads"] == 64 // 8 == config["num_key_value_heads"]
    assert config["num_hidden_layers"] == 2 and config["num_nextn_predict_layers"] == 0
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoConfig.from_pretrained(str(GLM5.parent))
    assert type(loaded).__name__ == "GlmMoeDsaConfig" and loaded.qk_head_dim == 256
    assert loaded.indexer_types == ["full", "full"] and loaded.mlp_layer_types == ["dense", "sparse"]


PARSE = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import matrix_design as md, serve_proc
from vllm.platforms import current_platform
current_platform.device_type = current_platform.device_type or "cuda"  # as test_serve.py's PARSE
try:
    from vllm.entrypoints.openai.cli_args import make_arg_parser  # 0.26
except ImportError:
    from vllm.entrypoints.common.cli_args import make_arg_parser  # 0.33
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from types import SimpleNamespace
from mla_planner.vllm_backend.vllm_api import give_mtp_draft_the_target_backend
out = {}
for config in md.DESIGN:
    model = md.model_source(config, Path(sys.argv[2]))
    for engine in ("plugin", "stock"):
        spec = md.spec(config, engine, 0.09, 8300, 512 if engine == "plugin" else None)
        ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(serve_proc.server_args(spec, model))
        ns.model = ns.model_tag
        ea = AsyncEngineArgs.from_cli_args(ns)
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


def test_command_lines_parse_and_build_vllms_engine_config(tmp_path: Path) -> None:
    """Every server's flags through the installed vLLM's serve parser into its engine config (no GPU:
    the model config, the MTP draft, the scheduler and cache settings)."""
    pytest.importorskip("vllm")
    r = subprocess.run([sys.executable, "-c", PARSE, str(HERE), str(tmp_path)], capture_output=True, text=True,
                       timeout=300, env=with_env(HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.split("RESULT ", 1)[1])
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


# --- what a log says --------------------------------------------------------------------------------


def test_the_minimum_comes_from_the_refusal_line() -> None:
    text = "\n".join([
        "(EngineCore pid=7) INFO 12-03 10:00:00 [backend.py:1] mla-planner: something else",
        "(EngineCore pid=7) ERROR 12-03 10:00:01 [core.py:1] ValueError: mla-planner: MLA_PLANNER_SCRATCH_MB=64 is "
        "below what one step of this engine can need (64 heads, 1024 sequences); set MLA_PLANNER_SCRATCH_MB=681 or more",
    ])
    line, minimum = run_matrix.refusal(text)
    assert minimum == 681 and line is not None and line.endswith("set MLA_PLANNER_SCRATCH_MB=681 or more")
    assert run_matrix.refusal("... set MLA_PLANNER_SCRATCH_MB=64.4 or more")[1] == 65  # MiB, rounded up
    assert run_matrix.refusal("ValueError: a budget of 64.0 MiB is below the 64.4 MiB ...") == (None, None)
    assert run_matrix.disturbed("AssertionError: Error in memory profiling. Initial free memory") is not None
    facts = run_matrix.plugin_facts("mla-planner: scratch reservation of 1,024 MiB handed to the kernels\n"
                                    "mla-planner: a step falls back to the bounded path: x\nmla-planner: a step "
                                    "falls back to the bounded path: y\nother line")
    assert facts["reserved_mib"] == 1024 and facts["fallback_lines"] == 2 and facts["mla_planner_line_count"] == 3
    errors = run_matrix.first_errors("Traceback (most recent call last):\nValueError: decode query lengths must be "
                                     "one length\n[shutdown] EngineCore: trigger\nRuntimeError: after the stop")
    assert errors == ["ValueError: decode query lengths must be one length"]
    quoted = ("(APIServer pid=1) WARNING 12-03 19:33:10 [system_utils.py:299] Found ulimit of 20000 ... fd limit "
              "errors like `OSError: [Errno 24] Too many open files`")
    cause = "(EngineCore pid=2) ERROR 12-03 19:34:57 [core.py:1330] ValueError: No available memory for the cache blocks."
    assert run_matrix.first_errors(f"{quoted}\n{cause}") == [cause]


def test_chat_prompts() -> None:
    prompts = run_matrix.chat_prompts(100)
    assert len(prompts) == 100 and prompts == run_matrix.chat_prompts(100)  # the same for every server
    prefix = prompts[0][0][:256]
    assert all(ids[:256] == prefix for ids, _ in prompts)  # a shared prefix: prefix caching's hits
    assert all(300 <= len(ids) <= 1100 and 16 <= m <= 256 for ids, m in prompts)
    assert len({m for _, m in prompts}) > 50 and len({len(ids) for ids, _ in prompts}) > 50


# --- the driver on stand-ins ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The whole design with stock twins, once, on the stand-in server (which answers /health 2 s
    after its KV lines, as a server capturing CUDA graphs: staggered starts go on before that)."""
    out = tmp_path_factory.mktemp("matrix")
    return out, driver(out, "--stock-twins", env=with_env(FAKE_SERVE_START_S="2"))


def test_the_whole_matrix_on_stand_ins(full_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, r = full_run
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    data = json.loads((out / "matrix.json").read_text())
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
    # staggered: each start once the one before has sized its KV cache, twin after its server
    windows = sorted(w for rec in data["servers"].values() for w in (rec["plugin"]["window_s"],
                                                                     rec["twin"]["window_s"]))
    assert all(later[0] >= earlier[1] for earlier, later in zip(windows, windows[1:]))
    order = sorted((rec[k]["window_s"][0], rec[k]["label"]) for rec in data["servers"].values() for k in ("plugin",
                                                                                                         "twin"))
    assert [label for _, label in order][:4] == ["s1", "s1-stock", "s2", "s2-stock"]
    for name, rec in data["servers"].items():  # a twin, and a server with one, start once the one before is up
        plugin_up = rec["plugin"]["window_s"][0] + rec["plugin"]["startup"]["elapsed_s"]
        assert rec["twin"]["window_s"][0] >= plugin_up - 0.5, (name, rec["twin"]["window_s"], plugin_up)
    # "min": refused at 64 MiB with the minimum (the stand-in's: 64 + max_num_seqs / 8), started again with it
    for name, minimum in (("s3", 66), ("s5", 192)):
        rec = data["servers"][name]
        assert rec["probe"]["outcome"] == "refused" and rec["probe"]["min_mb"] == minimum == rec["scratch_mb"]
        assert rec["probe"]["refusal_line"].endswith(f"set MLA_PLANNER_SCRATCH_MB={minimum} or more")
        assert rec["probe"]["rc"] != 0 and rec["probe"]["startup"]["status"] == "exited"
        assert f"budget {minimum} MiB (MLA_PLANNER_SCRATCH_MB)" in rec["plugin"]["mla_planner_lines"][0]
    assert data["servers"]["s5"]["plugin"]["cmd"][3].endswith("tiny-glm5-1mtp")  # [python, serve_fakes.py, serve, model
    assert set(p.name for p in (out / "model").iterdir()) == {"tiny-deepseek-v32", "tiny-deepseek-v32-1mtp",
                                                              "tiny-glm5-1mtp"}
    md_text = (out / "matrix.md").read_text()
    assert "| s3 | v32 | 2 | 16 | min → 66 | yes | **off** | **on** |" in md_text
    assert "| 59.94 | 60.00 | -0.06 | 0.06 | 66 | 100/100 | 1/1 | 8/8 | 1/1 | 1 | yes |" in md_text
    assert "| s4 | v32 | – | 128 | 4096 | eager | on | off |" in md_text and "| 56.00 | 60.00 | -4.00 | 4.00 | – |" in md_text
    assert "Coverage: every value of every axis, and both required pairs" in md_text
    assert "engines dead at the end: none; servers not up: none" in md_text
    assert "refusal at 64 MiB: `mla_planner.engine_model.settings.SettingsError" in md_text


def test_report_only_prints_the_table(full_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = full_run
    r = subprocess.run([sys.executable, str(HERE / "run_matrix.py"), "--report-only", str(out)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (out / "matrix.md").read_text() + "\n"
    header = next(line for line in r.stdout.splitlines() if line.startswith("| server |"))
    rows = [line for line in r.stdout.splitlines() if line.startswith("| s") and line != header]
    assert len(rows) == 6 and all(row.count(" | ") == header.count(" | ") for row in rows)


def test_a_64_mib_start_that_comes_up_is_the_minimum(tmp_path: Path) -> None:
    r = driver(tmp_path, "--servers", "s3", env=with_env(FAKE_SERVE_MIN_MB="64"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = json.loads((tmp_path / "matrix.json").read_text())["servers"]["s3"]
    assert rec["probe"]["outcome"] == "started" and rec["probe"]["min_mb"] == 64 == rec["scratch_mb"]
    assert rec["plugin"]["label"] == "s3-min64" and not (tmp_path / "logs" / "s3.log").exists()  # not restarted
    assert all(result["status"] == "ok" for result in rec["phases"].values())
    assert "| min → 64 |" in r.stdout and "| 64 (64 started) |" in r.stdout
    assert "**missing model='glm5'" in r.stdout  # one server: the coverage gaps are said


def test_failures_and_a_dead_engine_are_reported(tmp_path: Path) -> None:
    """Engines that die on the 64K prompt: the phase failed, the engine dead, its first errors."""
    r = driver(tmp_path, "--servers", "s2,s4", env=with_env(FAKE_SERVE_DIE_OVER="40000"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "matrix.json").read_text())
    for name in ("s2", "s4"):
        rec = data["servers"][name]
        assert [rec["phases"][k]["status"] for k in ("chat", "32k", "eight", "64k")] == ["ok", "ok", "ok", "error"]
        assert rec["phases"]["64k"]["health_after"] is None and not rec["plugin"]["alive_at_end"]
        assert any("CUDA out of memory" in line for line in rec["plugin"]["first_errors"])
    md_text = (tmp_path / "matrix.md").read_text()
    assert "| 100/100 | 1/1 | 8/8 | 0/1, **1 failed** | 0 | **no** (after 64K) |" in md_text
    assert "Phases with failed requests: 2; engines dead at the end: s2, s4;" in md_text
    assert "- error: `torch.OutOfMemoryError: CUDA out of memory." in md_text


def test_report_of_hand_made_results() -> None:
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
    text = matrix_report.render(data)
    assert "**not finished**" in text and "**missing budget=4096**" in text
    assert ("| s1 | v32 | 1 | 128 | 1024 | yes | on | off | 91 s | 5.50 | 6.25 | -0.75 | – | – | 97/100, **3 failed** "
            "| not run | – | – | 3 | **no** (after chat burst) |") in text
    assert "| s3 | v32 | 2 | 16 | min | yes | **off** | **on** | not run | – | – | – | – | **none** (failed) |" in text
    assert "| 1/1 | **cut** (driver ended) | – | – | – | yes |" in text
    assert "engines dead at the end: s1; servers not up: s3." in text
    assert "- error: `ValueError: decode query lengths must be one length`" in text
    assert matrix_report.render({}).startswith("# Flag matrix")


def test_a_start_the_others_disturbed_is_retried_alone(tmp_path: Path) -> None:
    r = driver(tmp_path, "--servers", "s2,s4", "--start", "together",
               env=with_env(FAKE_SERVE_DISTURB_ONCE=str(tmp_path / "disturbed")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    servers = json.loads((tmp_path / "matrix.json").read_text())["servers"]
    retried = [rec for rec in servers.values() if rec.get("attempts")]
    assert len(retried) == 1, r.stdout
    rec = retried[0]
    assert rec["attempts"][0]["startup"]["status"] == "exited"
    assert "Error in memory profiling" in rec["attempts"][0]["first_errors"][0]
    assert rec["plugin"]["startup"]["status"] == "ok" and rec["plugin"]["label"] == f"{rec['name']}-retry1"
    assert all(result["status"] == "ok" for result in rec["phases"].values())
    assert "(retry 1)" in r.stdout and "first start failed, retried alone: `AssertionError: Error in memory" in r.stdout


def test_together_starts_every_server_at_once_and_stops_the_twins_after(tmp_path: Path) -> None:
    r = driver(tmp_path, "--servers", "s1,s2,s4", "--stock-twins", "s1,s2", "--start", "together")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    servers = json.loads((tmp_path / "matrix.json").read_text())["servers"]
    assert "twin" not in servers.pop("s4") and not (tmp_path / "logs" / "s4-stock.log").exists()  # not named
    records = [rec[k] for rec in servers.values() for k in ("plugin", "twin")]
    assert max(rec["window_s"][0] for rec in records) < min(rec["window_s"][1] for rec in records)  # all at once
    assert all(rec["twin"]["startup"]["status"] == "ok" and rec["twin"]["alive_at_end"] for rec in servers.values())
    assert all(rec["phases"]["64k"]["status"] == "ok" for rec in servers.values())
    assert "`--start together`" in r.stdout and "**All servers started at once**" in r.stdout


def test_servers_spread_over_gpus_start_chained_on_each(tmp_path: Path) -> None:
    """--gpus 2: servers round robin over two GPUs (CUDA_VISIBLE_DEVICES), each with its twin; each
    GPU's starts one after the other (chained: the next once the server is up, its twin sized), the
    two GPUs' side by side."""
    r = driver(tmp_path, "--servers", "s1,s2,s3", "--gpus", "2", "--stock-twins", "--start", "chained",
               env=with_env(FAKE_SERVE_START_S="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    servers = json.loads((tmp_path / "matrix.json").read_text())["servers"]
    for name, gpu in (("s1", 0), ("s2", 1), ("s3", 0)):
        for log in (f"{name}.log", f"{name}-stock.log"):
            assert f"CUDA_VISIBLE_DEVICES={gpu}" in (tmp_path / "logs" / log).read_text(), log
    assert "CUDA_VISIBLE_DEVICES=0" in (tmp_path / "logs" / "s3-min64.log").read_text()
    w = {rec[k]["label"]: rec[k]["window_s"] for rec in servers.values() for k in ("plugin", "twin")}
    assert w["s1"][1] <= w["s1-stock"][0] and w["s1-stock"][1] <= w["s3"][0] and w["s3"][1] <= w["s3-stock"][0]
    assert w["s2"][1] <= w["s2-stock"][0]
    assert abs(w["s1"][0] - w["s2"][0]) < 1 and w["s2"][0] < w["s1"][1]  # the two GPUs side by side
    assert all(rec["phases"]["64k"]["status"] == "ok" for rec in servers.values())


def test_what_the_deadline_leaves_out_is_not_run(tmp_path: Path) -> None:
    r = driver(tmp_path, "--servers", "s2,s3", "--deadline-s", "60")  # below a server's 120 s: nothing starts
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    servers = json.loads((tmp_path / "matrix.json").read_text())["servers"]
    assert servers["s3"]["probe"]["outcome"] == "not run" and servers["s2"]["plugin"]["startup"]["status"] == "not run"
    assert all(p["status"] == "not run" for rec in servers.values() for p in rec["phases"].values())
    assert "| s2 | v32 | – | 1024 | 512 | yes | on | off | not run |" in r.stdout
    assert "servers not up: s2, s3." in r.stdout and not (tmp_path / "logs").exists()


def processes_of(folder: Path) -> list[int]:
    """Live processes whose command line names ``folder`` (the servers of a run there)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(folder) in cmdline.read_bytes().decode(errors="replace") and \
                    Path(cmdline.parent, "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("phase", ["starting", "load"])
def test_no_server_outlives_a_stopped_driver(tmp_path: Path, phase: str) -> None:
    """SIGTERM while a server is starting (the scheduler's loop), or during the load (its threads)."""
    out = tmp_path / "out"
    env = with_env(FAKE_SERVE_START_S="60") if phase == "starting" else with_env(FAKE_SERVE_START_S="0.2")
    args = ["--servers", "s2,s4"] + (["--chat-n", "100", "--request-timeout-s", "120"] if phase == "load" else [])
    cmd = [sys.executable, str(HERE / "run_matrix.py"), "--out", str(out), "--port-base", "0", "--fake-server", *args]
    if phase == "load":  # requests that hang: the engine "dies" silently on the 32K prompt
        env["FAKE_SERVE_HANG_OVER"] = "20000"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        marker = out / "logs" / "s2.log"
        while not (marker.is_file() and ("32k" in _phases(out) if phase == "load" else True)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
        assert processes_of(out)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while processes_of(out):
            assert time.monotonic() < deadline, processes_of(out)
            time.sleep(0.2)
        assert json.loads((out / "matrix.json").read_text())["finished"] is False
    finally:
        if proc.poll() is None:
            proc.kill()


def _phases(out: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((out / "matrix.json").read_text())["servers"]["s2"].get("phases") or {})
    except (OSError, ValueError, KeyError):
        return {}


def test_detach_and_follow(tmp_path: Path) -> None:
    slow = with_env(FAKE_SERVE_START_S="6")  # the run outlasts the first call's follow
    r = driver(tmp_path, "--servers", "s2", "--detach", "--deadline-s", "0.5", env=slow)
    assert r.returncode == 0 and "matrix: still running" in r.stdout and "with --follow within" in r.stdout, \
        r.stdout + r.stderr
    pid = int((tmp_path / "matrix-driver.pid").read_text())
    r = driver(tmp_path, "--servers", "s2", "--follow", "--deadline-s", "120")
    assert r.returncode == 0 and f"matrix: finished (pid {pid} ended)" in r.stdout, r.stdout + r.stderr
    data = json.loads((tmp_path / "matrix.json").read_text())
    assert data["finished"] and data["run"]["deadline_s"] > 600
    assert data["servers"]["s2"]["phases"]["64k"]["status"] == "ok" and "| s2 | v32 |" in r.stdout


def test_arguments() -> None:
    args = run_matrix.parse_args(["--out", "x"])
    assert (args.servers, args.util, args.start, args.retries, args.chat_n, args.deadline_s) == (
        [c.name for c in md.DESIGN], 0.09, "staggered", 1, 100, 540)
    assert run_matrix.parse_args(["--out", "x", "--stock-twins"]).util == 0.09  # one twin at a time
    assert run_matrix.parse_args(["--out", "x", "--stock-twins", "--start", "together"]).util == 0.04
    assert run_matrix.parse_args(["--out", "x", "--servers", "s1,s5"]).servers == ["s1", "s5"]
    assert run_matrix.parse_args(["--out", "x", "--stock-twins"]).stock_twins == [c.name for c in md.DESIGN]
    assert run_matrix.parse_args(["--out", "x", "--servers", "s3,s5,s6", "--stock-twins", "s5,s6"]).stock_twins == [
        "s5", "s6"]
    assert run_matrix.parse_args(["--out", "x"]).stock_twins == []
    assert run_matrix.parse_args(["--out", "x", "--gpus", "6", "--util", "0.38", "--stock-twins"]).gpus == 6
    for bad in (["--servers", "s9"], ["--gpus", "0"], ["--gpus", "2", "--util", "0.4"], ["--detach", "--follow"], ["--util", "0"], ["--util", "0.2"], ["--chat-n", "0"],
                ["--stock-twins", "--start", "together", "--util", "0.09"], ["--servers", "s3", "--stock-twins", "s5"], ["--start", "now"]):
        with pytest.raises(SystemExit):
            run_matrix.parse_args(["--out", "x", *bad])
    with pytest.raises(SystemExit):
        run_matrix.parse_args([])
    assert run_matrix.parse_args(["--report-only", "x"]).report_only == Path("x")
