"""step_log.py: where a server's time goes, from the plugin's step lines and vLLM's iteration lines
(the breakdown, the summary lines' counts, both engines compared, the ab runs' windows and repeats),
and its logging configuration as vLLM applies it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import step_log


def step_line(t: str, detail: str) -> str:
    return f"(EngineCore pid=7) DEBUG 12-02 02:30:{t} [backend.py:225] mla-planner step: {detail}"


def test_step_log_breakdown() -> None:
    decode = "32 tokens, 32 decode tokens, 0 prefills, stock's code"
    lines = ["(EngineCore pid=7) INFO 12-02 02:29:59.000 [backend.py:1] mla-planner: FP8 steps routed by x"]
    # Five decode-only steps (gaps of 5, 2, 3, 8 and 5 ms), a planned prefill step that lasts 100 ms,
    # two decode steps, then 3 s idle (between bench runs: not busy time) and a decode step beside
    # a dense prefill.
    times = ["00.000", "00.005", "00.007", "00.010", "00.018", "00.023", "00.123", "00.128", "03.128"]
    details = [decode] * 5 + ["32000 tokens, 31 decode tokens, 1 prefills, separate_prefill_decode, 5 launches, "
                              "peak 969808488 B, bound budget"] + [decode] * 2 + [
        "600 tokens, 31 decode tokens, 1 prefills, stock's code"]
    lines += [step_line(t, d) for t, d in zip(times, details)]
    steps = step_log.parse("\n".join(lines))
    assert [s.kind for s in steps] == [step_log.DECODE_ONLY] * 5 + ["planned: separate_prefill_decode"] + [
        step_log.DECODE_ONLY] * 2 + ["decodes + dense prefills, stock's code"]
    assert steps[-1].at_s == pytest.approx(3.128) and steps[5].tokens == 32000
    out = step_log.breakdown(steps)
    assert out[0] == "9 steps logged, 0.13 s busy (gaps under 0.5 s); by the kind of step:"
    assert "| decode-only, stock's code | 7 | 224 | 224 | 0.03 |" in out  # 28 ms of gaps; the 3 s one is idle
    assert "| planned: separate_prefill_decode | 1 | 32,000 | 31 | 0.10 |" in out
    assert "| decodes + dense prefills, stock's code | 1 | 600 | 31 | 0.00 |" in out
    # Inside runs of decode-only steps (the gaps after steps 1-3: 2, 3 and 8 ms) the mean is 4.33 ms,
    # the median 3 ms: 7 x 4.33 ms.
    assert out[-1].startswith("decode-only steps: mean 4.33 ms inside runs of them (3 gaps; median 3.00 ms), so 7 "
                              "take about 0.03 s, 23.7% of the busy time")
    assert step_log.breakdown(steps[:1])[0].startswith("1 step line(s): nothing to measure")
    # a planned step of decodes alone (a budget too small for stock's decode call) is not one stock runs alike
    assert not step_log.parse(step_line("00.000", "2048 tokens, 2048 decode tokens, 0 prefills, mixed_batch, "
                                        "3 launches, peak 1 B, bound budget"))[0].decode_only


def test_step_log_counts_the_steps_a_layer_call_of_which_fell_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reason = "vLLM handed the layer call other tokens than its plan's"
    layer = f"(EngineCore pid=7) DEBUG 12-02 02:30:00.001 [fallback.py:40] mla-planner layer: bounded path ({reason})"
    decode = step_line("00.000", "32 tokens, 32 decode tokens, 0 prefills, stock's code")
    assert step_log.layer_fallbacks(decode) == ["no layer call fell back to the bounded path"]
    log = tmp_path / "plugin.log"
    log.write_text("\n".join([decode, layer, layer, step_line("00.005", "32 tokens, 32 decode tokens, 0 prefills, "
                                                                       "stock's code")]) + "\n")
    assert step_log.main(["report", str(log)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == ["steps a layer call of which fell back to the bounded path: 2", f"- {reason}: 2", "no summary line"]
    assert out[0].startswith("2 steps logged"), "layer lines are not steps"


def test_step_log_checks_the_summary_lines_against_the_step_lines_before_them(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    decode = step_line("00.000", "32 tokens, 32 decode tokens, 0 prefills, stock's code")
    planned = step_line("00.001", "32768 tokens, 0 decode tokens, 1 prefills, mixed_batch, 14 launches, peak 1 B, "
                                  "bound budget")
    one = step_line("00.002", "2048 tokens, 0 decode tokens, 1 prefills, mixed_batch, 1 launches, peak 1 B, bound none")
    fell = step_line("00.003", "900 tokens, 3 decode tokens, 2 prefills, bounded path (the step could not be planned "
                               "(ValueError))")

    def summary(p: int, split: int, launches: int, stock: int, fallbacks: int) -> str:
        reasons = " (the step could not be planned (ValueError): 1)" if fallbacks else ""
        return (f"(EngineCore pid=7) INFO 12-02 02:30:01.000 [backend.py:184] mla-planner: since start-up {p} steps "
                f"planned ({split} split, {launches} launches), {stock} on vLLM's call; largest launch beyond vLLM's "
                f"workspace 600.0 MiB of the 676.4 MiB reserved; {fallbacks} fallbacks{reasons}")

    layer = ("(EngineCore pid=7) DEBUG 12-02 02:30:00.004 [fallback.py:1] mla-planner layer: bounded path (an "
             "allocation failed in a planned launch)")
    text = "\n".join([decode, planned, summary(1, 1, 14, 1, 0), one, fell, summary(2, 1, 15, 1, 1), layer,
                      summary(2, 1, 15, 1, 2)])
    assert step_log.summaries(text) == ["summary lines: 3, 3 of them holding the counts of the step lines before them"]
    wrong = step_log.summaries("\n".join([decode, summary(1, 1, 14, 1, 0)]))
    assert wrong[0].startswith("summary lines: 1, 0 of them") and "count [0, 0, 0, 1, 0]" in wrong[1]
    assert step_log.summaries(decode) == ["no summary line"]
    log = tmp_path / "plugin.log"
    log.write_text(text + "\n")
    assert step_log.main(["report", str(log)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("summary lines: 3, 3 of them")


def iteration_line(ms: int, context: int, decode: int, elapsed: float, dummy: bool = False) -> str:
    """vLLM's line (LoggingStatLogger._log_iteration_details, 0.26 and 0.33) at 12-02 02:30:00 + ms."""
    return (f"(APIServer pid=5) INFO 12-02 02:30:{ms // 1000:02d}.{ms % 1000:03d} [loggers.py:181] Engine 000: "
            f"Iteration(7): {int(context > 0)} context requests, {context} context tokens, {decode} generation "
            f"requests, {decode} generation tokens, iteration elapsed time: {elapsed:.2f} ms"
            f"{' (dummy)' if dummy else ''}, GPU KV cache usage: 1.0%")


def engine_log(gap_ms: int, prefill_ms: int, elapsed: float) -> str:
    """Five decode-only steps, a step with 8,000 context tokens beside 63 decodes, two decode-only
    steps, 3 s idle and one more (a DP dummy iteration is not a step). vLLM writes a step's line as
    its output arrives: the prefill's time is the gap before its line."""
    times = [k * gap_ms for k in range(5)]
    times += [times[-1] + prefill_ms + k * gap_ms for k in range(3)]
    times.append(times[-1] + 3000)
    lines = [iteration_line(t, 8000 if k == 5 else 0, 63 if k == 5 else 64, elapsed) for k, t in enumerate(times)]
    return "\n".join(lines[:2] + [iteration_line(times[1], 0, 0, 0.0, dummy=True)] + lines[2:])


def test_step_log_compares_the_engines_from_vllms_iteration_lines(tmp_path: Path) -> None:
    stock = step_log.parse_iterations(engine_log(3, 100, 2.0))
    plugin = step_log.parse_iterations(engine_log(4, 80, 1.5))
    assert [s.kind for s in stock] == ["decode-only"] * 5 + ["with context tokens"] + ["decode-only"] * 3
    assert stock[5].tokens == 8063 and stock[5].decode_tokens == 63 and stock[0].elapsed_ms == 2.0
    # stock: busy 5 x 3 + 100 + 3 = 118 ms; inside runs of decode-only steps 3 ms (the 3 s gap is idle),
    # so its 8 take 24 ms and the other step 94 ms for 8,063 tokens; the plugin: 104 ms, 4 ms, 32 and 72 ms.
    out = step_log.compare(step_log.summarize(stock), step_log.summarize(plugin))
    assert "| busy s | 0.12 | 0.10 | 0.881 |" in out
    assert "| decode-only: mean gap inside runs of them, ms | 3.000 | 4.000 | 1.333 |" in out
    assert "| decode-only: mean iteration elapsed time, ms | 2.000 | 1.500 | 0.750 |" in out
    assert "| other steps: tokens (those with busy time) | 8,063 | 8,063 |  |" in out
    assert "| other steps: time per 1K tokens, ms | 11.658 | 8.930 | 0.766 |" in out
    assert "decode-only steps: the plugin's +33.3% against stock's (2 and 2 gaps)" in out
    assert "other steps: stock's time per token 1.306x the plugin's (r)" in out
    assert step_log.compare(step_log.summarize(stock), step_log.summarize([]))[0].startswith(
        "iteration lines: stock 9, plugin 0: nothing to compare")


def test_step_log_gives_a_prefills_host_work_to_the_prefill() -> None:
    """vLLM writes a step's iteration line as its output arrives, after the engine has done the
    next step's host work (async scheduling): the gap that closes the last decode-only step before
    a step with context tokens holds that step's scheduling, build and launches (on the H200, 38-51
    ms in the 8-layer mix). It is the prefill's time, not a decode-only step's."""
    # decode-only steps 3 ms apart; the gap closing step 5 (decode-only) holds step 6's host work
    # (40 ms), step 6 (context tokens) its GPU time (60 ms); then decode-only steps 3 ms apart.
    times = [0, 3, 6, 9, 12, 52, 112, 115, 118, 121, 124]
    steps = step_log.parse_iterations("\n".join(
        iteration_line(t, 8000 if k == 6 else 0, 32, 0.1) for k, t in enumerate(times)))
    summary = step_log.summarize(steps)
    assert summary["decode_gaps"] == 4 and summary["decode_gap_ms"] == pytest.approx(3.0)  # not (5 x 3 + 40) / 6
    assert summary["decode_s"] == pytest.approx(0.030)  # 10 decode-only steps of 3 ms
    assert summary["other_ms_per_1k"] == pytest.approx(94 / 8.032)  # 124 - 30 ms for 8,032 tokens
    assert summary["host_gaps"] == 1 and summary["host_gap_ms"] == pytest.approx(40.0)  # shown apart
    assert "| other steps after decode-only ones: the gap before, with their host work, ms | 40.000 | 40.000 | 1.000 |" \
        in step_log.compare(summary, summary)
    # the plugin's own lines are written as a step is built, after its planning: the gap after the
    # last decode-only line holds the next step's planning, and the rule there is one step shorter
    plugin = step_log.parse("\n".join(step_line(f"00.{t:03d}", "32 tokens, 32 decode tokens, 0 prefills, stock's code")
                                      for t in (0, 3, 6, 9)))
    assert len(step_log.split(plugin).decode_gaps) == 2  # after lines 1 and 2 (each with both neighbours)
    assert len(step_log.split(plugin, before=True).decode_gaps) == 1  # after line 2 it would need line 4


VLLM_ITERATION_LINES = """
import logging, types
from vllm.v1.metrics import loggers
from vllm.v1.metrics.stats import SchedulerIterationDetails, SchedulerStats
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(handler.format(record))
handler.setFormatter(logging.Formatter("(APIServer pid=5) %(levelname)s %(asctime)s.%(msecs)03d %(message)s",
                                       "%m-%d %H:%M:%S"))
loggers.logger.addHandler(handler)
loggers.logger.setLevel(logging.INFO)  # 0.33 configures vLLM's loggers in a server's processes only
# the logger's own method, on a stand-in for the LoggingStatLogger that vllm serve's API server holds
me = types.SimpleNamespace(_log_prefix_for_engine=lambda i: "Engine 000: ", kv_cache_device="GPU")
for context, dummy in ((1000, False), (0, False), (0, True)):
    stats = SchedulerStats()
    stats.iteration_details = SchedulerIterationDetails(
        iteration_index=3, num_ctx_requests=int(context > 0), num_ctx_tokens=context, num_generation_requests=5,
        num_generation_tokens=5, elapsed_ms=1.25, is_dummy=dummy)
    loggers.LoggingStatLogger._log_iteration_details(me, stats, 0)
print("RESULT " + "\\n".join(lines))
"""


def test_step_log_compares_each_workloads_timed_runs(tmp_path: Path) -> None:
    """compare --ab: the lines inside a workload's timed runs, per engine; warm-ups and the other
    workload's runs left out."""
    def window(a_ms: int, b_ms: int) -> list[str]:
        return [f"12-02 02:30:{t // 1000:02d}.{t % 1000:03d}" for t in (a_ms, b_ms)]

    runs = [  # (workload, engine, warm-up, window in ms after 02:30:00)
        ("chat", "stock", True, (0, 999)), ("chat", "plugin", True, (1000, 1999)),
        ("chat", "stock", False, (2000, 2999)), ("chat", "plugin", False, (3000, 3999)),
        ("mix", "stock", False, (4000, 4999)), ("mix", "plugin", False, (5000, 5999))]
    data = {"calls": [{"id": 0, "workloads": ["chat", "mix"], "servers": {
        "stock": {"log": "logs/s.log"}, "plugin": {"log": "logs/p.log"}}}],
        "runs": [{"call": 0, "workload": w, "engine": e, "warmup": warm, "window": window(*ms)}
                 for w, e, warm, ms in runs]}
    (tmp_path / "logs").mkdir()
    (tmp_path / "ab.json").write_text(json.dumps(data))
    # every run's lines: decode-only steps 3 ms apart (stock) or 4 ms (plugin), one with context tokens
    for name, engine, gap in (("s.log", "stock", 3), ("p.log", "plugin", 4)):
        lines = []
        for w, e, _, (a, _b) in runs:
            if e == engine:
                lines += [iteration_line(a + k * gap, 100 if k == 3 else 0, 8 if w == "chat" else 2, 1.0)
                          for k in range(10)]
        (tmp_path / "logs" / name).write_text("\n".join(lines))
    out = step_log.compare_ab(tmp_path)
    chat, mix = out.index("### call 0, chat (2 timed runs)"), out.index("### call 0, mix (2 timed runs)")
    assert "| steps | 10 | 10 |  |" in out[chat:mix]  # the timed run's ten, not the warm-up's
    assert "| decode-only: mean gap inside runs of them, ms | 3.000 | 4.000 | 1.333 |" in out[chat:mix]
    assert "| other steps: tokens (those with busy time) | 108 | 108 |  |" in out[chat:mix]
    assert "| other steps: tokens (those with busy time) | 102 | 102 |  |" in out[mix:]
    assert "decode-only steps per repeat, plugin/stock: 1.333; median 1.333 (1 pairs)" in out[chat:mix]
    assert step_log.main(["compare", "--ab", str(tmp_path)]) == 0
    with pytest.raises(SystemExit):
        step_log.main(["compare", str(tmp_path / "logs" / "s.log")])


def test_step_log_pairs_each_repeats_runs(tmp_path: Path) -> None:
    """step_figures' pairs: plugin/stock decode-only gap per repeat (the runs of one seed), in repeat order;
    a repeat one engine did not run makes no pair."""
    gaps = {(1000, "stock"): 4, (1000, "plugin"): 5, (1100, "stock"): 5, (1100, "plugin"): 4, (1200, "stock"): 3}
    runs: list[dict[str, Any]] = []
    lines: dict[str, list[str]] = {"stock": [], "plugin": []}
    for k, ((seed, engine), gap) in enumerate(gaps.items()):
        start = 1000 * k
        runs.append({"call": 0, "workload": "chat", "engine": engine, "seed": seed, "warmup": False,
                     "window": [f"12-02 02:30:{start // 1000:02d}.000", f"12-02 02:30:{start // 1000:02d}.999"]})
        lines[engine] += [iteration_line(start + i * gap, 0, 8, 1.0) for i in range(20)]
    call = {"id": 0, "workloads": ["chat"], "servers": {e: {"log": f"{e}.log"} for e in lines}}
    for engine, text in lines.items():
        (tmp_path / f"{engine}.log").write_text("\n".join(text))
    pairs = step_log.step_figures(tmp_path, {"runs": runs}, call)["step_pairs"]
    assert pairs == {"chat": [pytest.approx(1.25), pytest.approx(0.8)]}
    assert step_log.pairs_line(pairs["chat"]) == (
        "decode-only steps per repeat, plugin/stock: 1.250 0.800; median 1.025 (2 pairs, 0.800-1.250)")


def test_step_log_reads_the_lines_vllm_writes() -> None:
    """The installed vLLM's own iteration line (0.26 and 0.33 word it alike up to the KV cache usage)."""
    pytest.importorskip("vllm")
    r = subprocess.run([sys.executable, "-c", VLLM_ITERATION_LINES], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = step_log.parse_iterations(r.stdout.split("RESULT ", 1)[1])
    assert [(s.tokens, s.decode_tokens, s.prefills, s.kind, s.elapsed_ms) for s in steps] == [
        (1005, 5, 1, "with context tokens", 1.25), (5, 5, 0, "decode-only", 1.25)]  # the dummy is no step


def test_step_log_config_logs_the_plugin_alone(tmp_path: Path) -> None:
    """The configuration, applied by vLLM itself (VLLM_LOGGING_CONFIG_PATH), lets the plugin's debug
    lines through with millisecond timestamps and no other vLLM logger's."""
    path, quiet = tmp_path / "logging.json", tmp_path / "quiet.json"
    assert step_log.main(["config", str(path)]) == 0
    step_log.write_config(quiet, plugin_steps=False)  # run_serve.py --log-iterations
    # vLLM 0.26 applies it when vllm.logger is imported, 0.33 when a process configures its logging.
    code = """if True:
        import logging
        import vllm.logger
        if hasattr(vllm.logger, "configure_logging"):
            from vllm.config.logging import LoggingConfig
            vllm.logger.configure_logging(LoggingConfig())
        logging.getLogger("vllm.mla_planner").debug("mla-planner step: 1 tokens, 1 decode tokens, 0 prefills, stock's code")
        logging.getLogger("vllm.engine").debug("not shown")
        logging.getLogger("vllm.engine").info("shown")
    """
    runs = {}
    for config in (path, quiet):
        env = dict(os.environ, VLLM_LOGGING_CONFIG_PATH=str(config))
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stderr
        assert "not shown" not in run.stdout and "shown" in run.stdout
        assert re.search(r"INFO \d\d-\d\d \d\d:\d\d:\d\d\.\d{3} .*shown", run.stdout)  # milliseconds
        runs[config] = step_log.parse(run.stdout)
    assert [(s.tokens, s.kind) for s in runs[path]] == [(1, step_log.DECODE_ONLY)]
    assert runs[quiet] == []  # plugin_steps=False: the plugin's debug line is not written


def test_ranks_compares_the_workers_of_a_tensor_parallel_run(tmp_path: Path) -> None:
    same_steps = ["32768 tokens, separate_prefill_decode, 5 launches"]

    def log(steps1: list[str] = same_steps, reserve1: bool = True, reserved: str = "reserved") -> Path:
        lines = ["INFO engine line without a rank"]
        for rank, steps in ((0, same_steps), (1, steps1)):
            p = f"\x1b[36m(Worker_TP{rank} pid={100 + rank})\x1b[0m "
            if rank == 0:  # vLLM logs this on rank 0 only; the line below on every rank
                lines += [p + "INFO 12-01 [gpu_worker.py:561] Available KV cache memory: 60.5 GiB"]
            lines += [p + "INFO 12-01 [gpu_worker.py:857] Free memory on device ... Current kv cache memory in use is 60.5 GiB."]
            if rank == 0 or reserve1:
                sep = "; " if reserved.startswith("676") else ", "
                lines += [p + f"INFO [backend.py:178] mla-planner: sparse MLA scratch budget 1024 MiB (default){sep}{reserved}"]
            lines += [p + f"DEBUG [backend.py:120] mla-planner step: {s}" for s in steps]
        path = tmp_path / "run.log"
        path.write_text("\n".join(lines) + "\n")
        return path

    same = log()
    lines, found = step_log.rank_report(same)
    assert found == [] and "every rank logged the same 1 step plans" in lines[-1]
    assert "  rank 1: KV cache 60.50 GiB, reserved 1024 MiB, 1 step plans logged" in lines
    assert step_log.main(["ranks", str(same)]) == 0
    _, found = step_log.rank_report(log(["32768 tokens, mixed_batch, 14 launches"]))
    assert found == ["rank 1: 1 step plans differ from rank 0's 1"]
    _, found = step_log.rank_report(log(reserve1=False))
    assert found == ["rank 1: no scratch reservation"]
    lines, _ = step_log.rank_report(log(reserved="648 MiB of it reserved from the KV cache"))  # vLLM 0.33's line
    assert "  rank 1: KV cache 60.50 GiB, reserved 648 MiB, 1 step plans logged" in lines
    lines, _ = step_log.rank_report(log(reserved="676 MiB reserved from the KV cache"))  # the line the plugin logs now
    assert "  rank 1: KV cache 60.50 GiB, reserved 676 MiB, 1 step plans logged" in lines
