"""`mla-planner doctor`: the memory model against what the H200 runs showed (docs/results-vllm-*.md;
each release's figures in tests/releases, the KV-cache lines in tests/data/doctor_kv_lines.json), and
the command line (one subprocess per run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mla_planner.cli import deployment as dep
from mla_planner.cli import doctor
from mla_planner.cli import serve_line
from mla_planner.cli import vllm_releases
from mla_planner.cli.config import CliError
from mla_planner.cli.steps import Step
from mla_planner.cli.units import format_bytes
from mla_planner.engine_model.settings import DEFAULT_SCRATCH_MB, MAX_SCRATCH_MB
from harness import doctor_kv
from releases import ALL, NEWEST, ReleaseFacts

GIB = 1 << 30
TINY = Path(__file__).resolve().parent / "e2e" / "tiny-deepseek-v32"
KV_TOLERANCE_GIB = 0.25


def cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "mla_planner.cli", *args], capture_output=True, text=True, timeout=300)
    if ok:
        assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return r


def modelled(facts: ReleaseFacts) -> vllm_releases.VllmRelease:
    return vllm_releases.RELEASES[facts.minor]


def tiny(util: float, mnbt: int, release: vllm_releases.VllmRelease) -> dep.Deployment:
    """The e2e engines: tiny model, TP 1, H200, fp8_ds_mla, the plugin's default budget, in-process
    (eager, 16 sequences)."""
    return dep.Deployment(dep.model_from_config(TINY / "config.json"), dep.GPUS["H200"], 1, mnbt, util,
                          163_840, True, False, 1 << 30, 16, release=release, enforce_eager=True)  # fmt: skip


# Each e2e case as the step that broke stock (docs/e2e.md, "What runs"): the second step of case 3 is
# the five queued prompts with the blocker's first decode.
CASES = {
    1: (32_768, Step([32_768], [0], 0)),
    2: (32_768, Step([12_288, 8_192, 4_096, 4_096, 2_048, 1_024, 512, 508], [0] * 8, 0)),
    3: (32_768, Step([1, 16_384, 4_096, 4_096, 4_096, 4_095], [32_768, 0, 0, 0, 0, 0], 1)),
    4: (65_536, Step([65_536], [0], 0)),
}


def test_the_tests_know_every_release_the_doctor_models() -> None:
    """Each release the doctor models has its facts in tests/releases, and nothing else does."""
    assert list(ALL) == list(vllm_releases.RELEASES)
    assert all(modelled(facts).version == facts.version for facts in ALL.values())
    assert NEWEST.version == vllm_releases.NEWEST.version


MTP_LOADING = [f for f in ALL.values() if f.mtp_draft_loading_gib is not None]


@pytest.mark.parametrize("facts", MTP_LOADING, ids=[f.minor for f in MTP_LOADING])
def test_mtp_draft_is_what_was_measured_loading(facts: ReleaseFacts) -> None:
    """An MTP server's model loading exceeded the one without MTP by what the MTP layer and the
    draft's own top-k buffer (which vLLM replaces by the target's) hold."""
    assert facts.mtp_draft_loading_gib is not None
    label, gib = facts.mtp_draft_loading_gib
    d = doctor_kv.deployment(next(x for x in doctor_kv.lines() if x["label"] == label))
    assert abs(d.non_kv_parts()["mtp_draft"].bytes / GIB - gib) <= 0.01


@pytest.mark.parametrize("minor", list(ALL))
@pytest.mark.parametrize("case", sorted(CASES))
def test_h200_at_095_stock_fails_plugin_fits(case: int, minor: str) -> None:
    mnbt, step = CASES[case]
    d = tiny(0.95, mnbt, modelled(ALL[minor]))
    assert not dep.stock_step(d, step).fits
    assert dep.plugin_step(d, step).fits
    if case == 4:
        assert dep.stock_step(d, step).limit == "int32_stride"


@pytest.mark.parametrize("minor", list(ALL))
def test_h200_at_090_stock_32k_step_fits(minor: str) -> None:
    d = tiny(0.90, 32_768, modelled(ALL[minor]))
    assert dep.stock_step(d, CASES[1][1]).fits
    assert dep.diagnose(d).max_stock_util == 0.90


LOGGED = [(minor, mnbt, mib) for minor, f in ALL.items() for mnbt, mib in f.logged_reservation_mib.items()]


@pytest.mark.parametrize(("minor", "mnbt", "reserved_mib"), LOGGED)
def test_reservation_is_what_the_plugin_logged(minor: str, mnbt: int, reserved_mib: int) -> None:
    """The reservation the doctor sizes with the engine's functions is the one the plugin logged at
    16 heads and the default budget ("1535 MiB reserved", floored to whole MiB; where the padded q
    and output are vLLM's workspace views, the reservation holds neither the output nor them)."""
    diag = dep.diagnose(tiny(0.95, mnbt, modelled(ALL[minor])))
    assert diag.reserved_bytes >> 20 == reserved_mib
    assert diag.stock_kv_bytes - diag.plugin_kv_bytes == diag.reserved_bytes


@pytest.mark.parametrize("release", sorted(vllm_releases.RELEASES))
def test_kv_constants_are_the_fit_of_their_lines(release: str) -> None:
    """Each release's memory constants are the exact fit of the lines it names (fitted_on), so a
    changed line or a changed counted part shows here: refit with `cd tests && python -m harness.doctor_kv`."""
    made = vllm_releases.RELEASES[release]
    assert {x["label"] for x in doctor_kv.lines("fit", release)} == set(made.fitted_on)
    fitted = doctor_kv.fit(made)
    assert abs(fitted.fixed_bytes - made.fixed_bytes) <= 1 << 20
    assert abs(fitted.activation_per_token - made.activation_per_token) <= 1
    assert abs(fitted.cuda_graph_bytes - made.cuda_graph_bytes) <= 1 << 20


HELD_OUT = doctor_kv.lines("held_out")


@pytest.mark.parametrize("line", HELD_OUT, ids=[x["label"] for x in HELD_OUT])
def test_kv_cache_of_each_held_out_line(line: dict[str, Any]) -> None:
    """The doctor's Deployment model of each measured line outside its release's fit predicts vLLM's
    logged KV cache within 0.25 GiB. `pytest -s -k kv_table` prints every line's error."""
    measured, predicted = line["kv_gib"], doctor_kv.predicted_kv_bytes(line) / GIB
    assert abs(predicted - measured) <= KV_TOLERANCE_GIB, f"{line['label']}: measured {measured:.2f}, predicted {predicted:.2f} GiB"


def test_kv_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Print measured against predicted for every line (held out, fitted, outside the model); the
    lines outside the model are reported, not asserted."""
    rows = doctor_kv.table(("held_out", "fit", "outside"))
    with capsys.disabled():
        print("\n" + doctor_kv.format_rows(rows))
    assert all(abs(r.error_gib) <= KV_TOLERANCE_GIB for r in rows if r.use != "outside")


TP2_RUNS = [f for f in ALL.values() if f.tp2_stock_32k_fits]


@pytest.mark.parametrize("facts", TP2_RUNS, ids=[f.minor for f in TP2_RUNS])
def test_tp2_reserve_matches_the_tp2_runs(facts: ReleaseFacts) -> None:
    """At TP 2 (16 heads per rank) stock's 32K step failed or ran as the release's runs did."""
    model = dep.model_from_config(TINY / "config.json")
    model = dep.Model(**{**model.__dict__, "num_heads": 32})
    for util, ok in facts.tp2_stock_32k_fits:
        d = dep.Deployment(model, dep.GPUS["H200"], 2, 32_768, util, 163_840, True, False, 1 << 30, 1024,
                           release=modelled(facts))
        assert dep.stock_step(d, CASES[1][1]).fits is ok, util


E2E_LINE = ["--", "vllm", "serve", str(TINY), "--gpu-memory-utilization", "0.95", "--max-num-batched-tokens", "32768",
            "--kv-cache-dtype", "fp8_ds_mla", "--block-size", "64"]  # fmt: skip
MODELLED = vllm_releases.release_for(dep.installed_vllm())


def doctor_json(*args: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(cli("doctor", "--json", *args).stdout)
    return doc


@pytest.mark.parametrize("minor", list(ALL))
def test_cli_e2e_line_json(minor: str) -> None:
    """The reservation at 16 heads and the default budget is the one the plugin logged."""
    doc = doctor_json("--builtin-parser", "--vllm", minor, *E2E_LINE)
    assert doc["schema"] == "mla-planner.doctor/1"
    assert doc["release"]["modelled"] == ALL[minor].version
    assert doc["serve"]["parser"] == "built-in"
    assert doc["deployment"]["heads_per_rank"] == 16
    assert doc["stock"]["fits"] is False and doc["plugin"]["fits"] is True
    assert doc["stock"]["peak_bytes"] == 13_178_503_168
    assert doc["stock"]["kv_bytes"] - doc["plugin"]["kv_bytes"] == doc["plugin"]["reserved_bytes"]
    assert doc["plugin"]["reserved_bytes"] >> 20 == ALL[minor].logged_reservation_mib[32_768]
    assert doc["memory"]["non_kv_parts"]["cuda_graphs"] == modelled(ALL[minor]).cuda_graph_bytes
    assert doc["stock"]["max_gpu_memory_utilization"] == 0.90
    assert doc["fixes"] == ["add: --attention-backend CUSTOM (install the plugin beside vLLM: `pip install .` in an mla-planner checkout, or its wheel; docs/vllm.md)", "or lower --gpu-memory-utilization to 0.90"]
    assert set(doc["sources"]) >= {"gpu_total", "weights", "activation", "fixed", "cuda_graphs", "step_reserve"}
    assert doc["memory"]["non_kv_bytes"] == sum(doc["memory"]["non_kv_parts"].values())


def test_cli_names_the_release_it_models_and_the_one_installed() -> None:
    doc = doctor_json("--builtin-parser", *E2E_LINE)
    assert doc["release"] == {"modelled": MODELLED.version, "installed": dep.installed_vllm()}
    out = cli("doctor", "--builtin-parser", *E2E_LINE).stdout
    assert f"release     {doctor.release_line(MODELLED, dep.installed_vllm())}\n" in out
    for minor, made in vllm_releases.RELEASES.items():
        assert doctor_json("--builtin-parser", "--vllm", minor, *E2E_LINE)["release"]["modelled"] == made.version


def a_later_patch(version: str) -> str:
    major, minor, _ = version.split(".")
    return f"{major}.{minor}.3"


def a_later_minor(version: str) -> str:
    major, minor, _ = version.split(".")
    return f"{major}.{int(minor) + 7}.0"


DEFAULT_RELEASES = [(None, NEWEST.version), (a_later_minor(NEWEST.version), NEWEST.version),
                    *((f.version, f.version) for f in ALL.values()),
                    *((a_later_patch(f.version), f.version) for f in ALL.values())]  # fmt: skip


@pytest.mark.parametrize("installed, modelled", DEFAULT_RELEASES)
def test_default_release_is_the_installed_one_else_the_newest(installed: str | None, modelled: str) -> None:
    assert vllm_releases.release_for(installed).version == modelled


RELEASE_LINES = [
    *((f.minor, None, f"models vLLM {f.version}") for f in ALL.values()),
    *((f.minor, f.version, f"models vLLM {f.version} (installed here)") for f in ALL.values()),
    *((f.minor, o.version, f"models vLLM {f.version}; vLLM {o.version} is installed here (--vllm picks")
      for f in ALL.values() for o in ALL.values() if o is not f),
]  # fmt: skip


@pytest.mark.parametrize("minor, installed, says", RELEASE_LINES)
def test_release_line_says_where_the_installed_vllm_is_another(minor: str, installed: str | None, says: str) -> None:
    assert doctor.release_line(modelled(ALL[minor]), installed).startswith(says)


@pytest.mark.parametrize("minor", list(ALL))
def test_cli_text_and_quoted_line(minor: str) -> None:
    out = cli("doctor", "--builtin-parser", "--vllm", minor, "vllm serve " + " ".join(E2E_LINE[3:])).stdout
    assert all(text in out for text in ALL[minor].text_at_095), out
    assert f"verdict     {ALL[minor].verdict_at_095}" in out
    assert f"the step holds (measured on the test model under vLLM {ALL[minor].step_reserve_measured_under[0]}, TP 1)" in out


def test_cli_text_says_which_figures_stand_in_from_the_test_model() -> None:
    out = cli("doctor", "--builtin-parser", "--", "vllm", "serve", "deepseek-ai/DeepSeek-V3.2", "-tp", "8").stdout
    assert f"fixed {format_bytes(MODELLED.fixed_bytes)} (assumed)" in out
    assert f"cuda graphs {format_bytes(MODELLED.cuda_graph_bytes)} (assumed)" in out
    assert f"the step holds (assumed: the test model's under vLLM {ALL[MODELLED.minor].step_reserve_measured_under[1]} at TP 2)" in out


@pytest.mark.parametrize("minor", list(ALL))
def test_cli_plugin_budget_from_env_word(minor: str) -> None:
    doc = doctor_json("--builtin-parser", "--vllm", minor, "--", "MLA_PLANNER_SCRATCH_MB=2048", *E2E_LINE[1:])
    assert doc["deployment"]["budget_bytes"] == 2048 << 20
    output = 32_768 * 16 * 512 * 2 if ALL[minor].reservation_holds_step_output else 0
    launches = doc["plugin"]["reserved_bytes"] - output  # less the step's output where the reservation holds it
    assert 1024 << 20 < launches <= 2048 << 20, "the largest launch grows with the budget and stays within it"
    assert doc["stock"]["kv_bytes"] - doc["plugin"]["kv_bytes"] == doc["plugin"]["reserved_bytes"]


def test_cli_plugin_budget_default_and_alias() -> None:
    assert doctor_json("--builtin-parser", *E2E_LINE)["deployment"]["budget_bytes"] == DEFAULT_SCRATCH_MB << 20
    doc = doctor_json("--builtin-parser", "--", "VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB=512", "MLA_PLANNER_SCRATCH_MB=512",
                      *E2E_LINE[1:])  # fmt: skip
    assert doc["deployment"]["budget_bytes"] == 512 << 20


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        # The plugin's own reader (engine_model.settings) checks the serve line's knobs: its maximum,
        # its minimum, whole numbers, both names agreeing, the flags' values.
        (["MLA_PLANNER_SCRATCH_MB=" + str(MAX_SCRATCH_MB + 1)], f"outside 64..{MAX_SCRATCH_MB} MiB"),
        (["MLA_PLANNER_SCRATCH_MB=32"], "outside 64.."),
        (["VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB=1.5"], "not a whole number"),
        (["MLA_PLANNER_SCRATCH_MB=2048", "VLLM_FLASHMLA_SPARSE_MAX_SCRATCH_MB=1024"], "disagree"),
        (["MLA_PLANNER_REPLACE_FLASHMLA_SPARSE=maybe"], "MLA_PLANNER_REPLACE_FLASHMLA_SPARSE='maybe'"),
    ],
)
def test_cli_plugin_settings_checked_as_the_plugin_does(env: list[str], needle: str) -> None:
    r = cli("doctor", "--builtin-parser", "--", *env, *E2E_LINE[1:], ok=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "the serve line: " in r.stderr and needle in r.stderr, r.stderr


def test_cli_cost_profile_of_the_serving_machine_is_not_read_here() -> None:
    doc = doctor_json("--builtin-parser", "--", "MLA_PLANNER_COST_PROFILE=/on/the/gpu/host/sm90.json", *E2E_LINE[1:])
    assert doc["deployment"]["budget_bytes"] == DEFAULT_SCRATCH_MB << 20


def test_cli_json_alone_on_stdout_where_vllm_is_installed() -> None:
    """`doctor --json ... | jq`: whatever vLLM prints while it is imported to read the line (vLLM
    logs Triton's INFO lines to stdout in some releases) goes to stderr."""
    pytest.importorskip("vllm")
    r = cli("doctor", "--json", *E2E_LINE)
    doc = json.loads(r.stdout)
    assert doc["schema"] == "mla-planner.doctor/1" and doc["stock"]["fits"] is False


# Run the CLI with vLLM's serve parser built on a machine with no GPU: vLLM is first imported inside
# the doctor (as in a real run), and its platform then says CUDA, so the parser builds and reads the line.
VLLM_PARSER_ON_CPU = """
import sys
from mla_planner.cli import main, serve_line
vllm_parse = serve_line._vllm_parse
def parse_as_on_a_gpu(argv):
    import vllm.platforms
    from vllm.platforms.interface import Platform
    class Cuda(Platform):
        device_type = "cuda"
    vllm.platforms._current_platform = Cuda()
    return vllm_parse(argv)
serve_line._vllm_parse = parse_as_on_a_gpu
sys.exit(main(sys.argv[1:]))
"""


def test_cli_json_alone_on_stdout_with_vllms_parser() -> None:
    pytest.importorskip("vllm")
    r = subprocess.run([sys.executable, "-c", VLLM_PARSER_ON_CPU, "doctor", "--json", *E2E_LINE, "--attention-backend", "CUSTOM"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["serve"]["parser"] == "vllm", r.stderr
    assert doc["deployment"]["plugin_selected"] is True and doc["deployment"]["max_num_batched_tokens"] == 32_768


@pytest.mark.parametrize("minor", list(ALL))
@pytest.mark.parametrize("gpu", ["H200", "B200"])
def test_cli_deepseek_v32_tp8(gpu: str, minor: str) -> None:
    doc = doctor_json("--gpu", gpu, "--builtin-parser", "--vllm", minor, "--", "vllm", "serve", "deepseek-ai/DeepSeek-V3.2",
                      "-tp", "8", "--kv-cache-dtype", "fp8_ds_mla", "--max-num-batched-tokens", "32768")  # fmt: skip
    assert doc["deployment"]["heads_per_rank"] == 16
    assert doc["worst_step"]["stock_path"] == "mixed batch"
    call = doc["worst_step"]["paths"]["mixed_batch"]
    assert call["bytes"] == 13_178_503_168
    # A decode-kernel call allocates its padded q and output itself on both releases
    assert doc["stock"]["peak_bytes"] == call["bytes"]
    assert doc["plugin"]["peak_bytes"] <= doc["plugin"]["budget_bytes"]
    assert doc["plugin"]["kv_tokens"] < doc["stock"]["kv_tokens"]
    assert doc["sources"]["gpu_total"].startswith("measured" if gpu == "H200" else "assumed")


def test_cli_glm5_default_flags() -> None:
    doc = doctor_json("--builtin-parser", "--", "vllm", "serve", "zai-org/GLM-5-FP8", "-tp", "8")
    assert doc["deployment"]["heads_per_rank"] == 8
    assert doc["deployment"]["max_num_batched_tokens"] == MODELLED.default_batch(dep.H200_TOTAL_BYTES)[0] == 8192
    assert doc["deployment"]["max_num_seqs"] == 1024
    assert doc["deployment"]["gpu_memory_utilization"] == serve_line.DEFAULT_GPU_MEMORY_UTILIZATION
    assert doc["deployment"]["kv_cache_fp8"] is False
    assert doc["verdict"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--", "vllm", "serve", "some/unknown-model"], "cannot tell the model"),
        (["--", "vllm", "serve", "--max-num-seqs", "8"], "the serve line names no model"),
        # The engine's own check: 64 heads per rank need 67 MiB on the separate route.
        (["--", "MLA_PLANNER_SCRATCH_MB=64", "vllm", "serve", "deepseek-ai/DeepSeek-V3.2", "-tp", "2", "--kv-cache-dtype",
          "fp8_ds_mla"], "the plugin would not start: MLA_PLANNER_SCRATCH_MB=64 is below the 67 MiB this engine needs"),
        (["--config", "/nonexistent", "--", "vllm", "serve", "x"], "--config"),
        (["--gpu", "TPU", "--", "vllm", "serve", "deepseek-ai/DeepSeek-V3.2"], "--gpu"),
        (["--", "vllm", "serve", "deepseek-ai/DeepSeek-V3.2", "-tp", "3"], "tensor parallel 3"),
        (["--", "vllm", "serve", "deepseek-ai/DeepSeek-V3.2", "--max-num-batched-tokens", "lots"], "serve line"),
        (["--", "vllm", "serve", "deepseek-ai/DeepSeek-V3.2", "--gpu-memory-utilization", "1.5"], "serve line"),
        (["--", "vllm", "bench", "x"], "not `vllm serve`"),
        ([], "serve line"),
        (["--", "vllm", "serve", "deepseek-ai/DeepSeek-V3.2", "-tp", "1"], "does not load"),
    ],
)
def test_cli_bad_input_one_line(args: list[str], needle: str) -> None:
    r = cli("doctor", "--builtin-parser", *args, ok=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr


OPERATORS_LINE = ["vllm", "serve", "deepseek-ai/DeepSeek-V3.2", "-tp", "8", "--port", "8000", "--served-model-name", "ds",
                  "--trust-remote-code", "--enforce-eager", "--enable-prefix-caching", "--speculative-config",
                  '{"method": "mtp", "num_speculative_tokens": 1}', "--load-format", "dummy", "--max-num-seqs", "64",
                  "--kv-cache-dtype", "fp8_ds_mla"]  # fmt: skip
"""A serve line as operators run it: flags the memory model does not read among those it does."""
NOT_MODELLED = ("--port", "--served-model-name", "--trust-remote-code", "--enable-prefix-caching", "--load-format")


def test_vllm_parser_reads_the_line_without_a_gpu() -> None:
    """vLLM's own parser, built on this machine, which has no GPU (vLLM cannot infer a device type
    here; the parser is built as for a CPU), reads every flag of the installed release."""
    args = serve_line.parse(["vllm", "serve", "m", "-tp", "8", "--max-num-batched-tokens", "32768",
                             "--attention-backend", "CUSTOM", "--kv-cache-dtype", "fp8_ds_mla"])  # fmt: skip
    assert args.parser == "vllm"
    assert (args.model, args.tensor_parallel_size, args.max_num_batched_tokens) == ("m", 8, 32_768)
    assert args.attention_backend == "CUSTOM" and args.kv_fp8 and args.ignored == ()
    operators = serve_line.parse(OPERATORS_LINE)
    assert (operators.parser, operators.model, operators.max_num_seqs, operators.ignored) == (
        "vllm", "deepseek-ai/DeepSeek-V3.2", 64, NOT_MODELLED)
    from vllm.platforms import current_platform

    assert current_platform.device_type == ""  # handed back as found
    with pytest.raises(CliError, match="the serve line \\(vLLM's parser\\): .*--no-such-flag"):
        serve_line.parse(["vllm", "serve", "m", "--no-such-flag"])


def test_builtin_parser_passes_over_the_flags_it_does_not_model() -> None:
    args = serve_line.parse(OPERATORS_LINE, use_vllm=False)
    assert (args.parser, args.model, args.tensor_parallel_size, args.max_num_seqs, args.kv_fp8) == (
        "built-in", "deepseek-ai/DeepSeek-V3.2", 8, 64, True)
    assert args.ignored == NOT_MODELLED
    # The model after flags of either kind; a flag's value given with "=".
    later = serve_line.parse(["vllm", "serve", "--port", "8000", "--enforce-eager", "--load-format=dummy", "m", "-tp", "2"],
                             use_vllm=False)
    assert (later.model, later.tensor_parallel_size, later.ignored) == ("m", 2, ("--port", "--load-format"))


def test_cli_names_the_flags_it_does_not_model() -> None:
    doc = doctor_json("--", *OPERATORS_LINE)
    assert doc["serve"]["not_modelled"] == list(NOT_MODELLED)
    out = cli("doctor", "--builtin-parser", "--", *OPERATORS_LINE).stdout
    assert "            read, not modelled: " + ", ".join(NOT_MODELLED) + "\n" in out


def test_builtin_parser_reads_the_line() -> None:
    args = serve_line.parse(["A=1", "vllm", "serve", "--model", "m", "-tp", "2", "--max-model-len", "32K"], use_vllm=False)
    assert (args.parser, args.model, args.tensor_parallel_size, args.max_model_len, args.env) == ("built-in", "m", 2, 32_768, {"A": "1"})


@pytest.mark.parametrize("gpu, env, source, file", [
    ("H100", [], "packaged", "sm90-vllm-{v}-h100-80gb-hbm3.json"),
    ("H200", [], "packaged", "sm90-vllm-{v}-h200.json"),
    ("B200", [], "measured at first start", None),
    ("H100", ["MLA_PLANNER_COST_PROFILE=none"], "none", None),
    ("H100", ["MLA_PLANNER_COST_PROFILE=/srv/h100.json"], "file", "/srv/h100.json"),
])  # fmt: skip
def test_cli_names_the_cost_profile_the_engine_will_use(gpu: str, env: list[str], source: str, file: str | None) -> None:
    """Packaged for the GPU and the installed vLLM's kernels (where there is one), measured at the
    first start where not, none or a file as the serve line's environment sets; the reservation
    covers both routes unless none."""
    version = MODELLED.version
    doc = doctor_json("--builtin-parser", "--gpu", gpu, "--", *env, *E2E_LINE[1:])
    profile = doc["cost_profile"]
    assert (profile["source"], profile["file"]) == (source, file and file.format(v=version))
    # vLLM's rule's one route reserves less than both where a profile's second route is larger at 16
    # heads, and the same where both lie within the workspace's padded views.
    for minor, facts in ALL.items():
        ours, packaged = [doctor_json("--builtin-parser", "--vllm", minor, "--gpu", gpu, "--", *e, *E2E_LINE[1:])["plugin"]
                          ["reserved_bytes"] for e in (env, [])]
        assert ours <= packaged and (ours < packaged) == (source == "none" and facts.profile_widens_reservation), minor
    out = cli("doctor", "--builtin-parser", "--gpu", gpu, "--", *env, *E2E_LINE[1:]).stdout
    assert f"profile     {profile['text']}\n" in out


FLAGS_LINE = ["vllm", "serve", str(TINY), "--enforce-eager", "--speculative-config",
              '{"method": "mtp", "num_speculative_tokens": 2}', "--no-enable-chunked-prefill", "--max-num-seqs", "16",
              "--max-model-len", "70000", "--kv-cache-dtype", "fp8_ds_mla"]  # fmt: skip


@pytest.mark.parametrize("use_vllm", [False, True])
def test_both_parsers_read_the_flags_that_change_memory(use_vllm: bool) -> None:
    """vLLM's own parser (its namespace: enforce_eager, speculative_config, enable_chunked_prefill,
    max_num_seqs) and the built-in one read the same values."""
    if use_vllm:
        pytest.importorskip("vllm")
    args = serve_line.parse(FLAGS_LINE, use_vllm=use_vllm)
    assert args.parser == ("vllm" if use_vllm else "built-in")
    assert (args.enforce_eager, args.num_speculative_tokens, args.mtp_draft, args.chunked_prefill, args.max_num_seqs) == (
        True, 2, True, False, 16)
    assert args.ignored == ()
    plain = serve_line.parse(["vllm", "serve", "m", "--enable-chunked-prefill"], use_vllm=use_vllm)
    assert (plain.enforce_eager, plain.num_speculative_tokens, plain.mtp_draft, plain.chunked_prefill) == (False, 0, False, True)


@pytest.mark.parametrize("minor", sorted(vllm_releases.RELEASES))
def test_cli_models_eager_mtp_and_chunked_prefill_off(minor: str) -> None:
    """--enforce-eager drops the CUDA-graph estimate; MTP loads its layer; without chunked prefill
    vLLM's default step is max_model_len; a verification longer than the builder's table raises the
    decode threshold the reservation is sized with."""
    doc = doctor_json("--builtin-parser", "--vllm", minor, "--", *FLAGS_LINE)
    parts = doc["memory"]["non_kv_parts"]
    assert parts["cuda_graphs"] == 0 and parts["mtp_draft"] > 0
    assert doc["deployment"]["max_num_batched_tokens"] == 70_000
    assert doc["deployment"]["decode_threshold"] == 128
    graphs = doctor_json("--builtin-parser", "--vllm", minor, "--", *[w for w in FLAGS_LINE if w != "--enforce-eager"])
    assert graphs["memory"]["non_kv_parts"]["cuda_graphs"] == vllm_releases.RELEASES[minor].cuda_graph_bytes
    long = [w.replace('"num_speculative_tokens": 2', '"num_speculative_tokens": 200') for w in FLAGS_LINE]
    assert doctor_json("--builtin-parser", "--vllm", minor, "--", *long)["deployment"]["decode_threshold"] == 201


def test_cli_refuses_a_step_below_max_model_len_without_chunked_prefill() -> None:
    r = cli("doctor", "--builtin-parser", "--", *FLAGS_LINE, "--max-num-batched-tokens", "32768", ok=False)
    assert r.returncode == 2 and "vLLM refuses --max-num-batched-tokens 32,768 below max_model_len 70,000" in r.stderr


@pytest.mark.parametrize("minor", list(ALL))
def test_stock_decode_kernel_call_is_whole_on_every_release(minor: str) -> None:
    """vLLM's FP8 decode-kernel call pads q into a fresh tensor and lets the kernel allocate its
    output on every release (a workspace's padded views are the prefill kernel's), so stock's
    mixed-batch call of 32,768 tokens at 16 heads is counted whole: 12.27 GiB, whose last ask, the
    8 GiB of accumulators, came with the free memory the release's run measured beside the
    in-process engine at 0.95: 6.15 GiB less what its workspace holds (the padded q and output)."""
    from mla_planner import decode_scratch

    facts, (util, (mnbt, step)) = ALL[minor], (0.95, CASES[1])
    d = tiny(util, mnbt, modelled(facts))
    call, stock = decode_scratch(1, mnbt, 16), dep.stock_step(d, step)
    assert stock.peak_bytes == call.total_bytes and 12.2 * GIB < call.total_bytes < 12.3 * GIB
    held = call.buffers["q_padded"] + call.buffers["out"] if modelled(facts).workspace_holds_padded_views else 0
    if facts.decode_call_free_gib is not None:
        assert abs((d.headroom() - held) / GIB - facts.decode_call_free_gib) < 0.2
    assert not stock.fits  # 0.95 leaves 6.15 GiB beside the engine


def test_stock_prefill_call_is_counted_beyond_the_workspace() -> None:
    """A workspace that holds the sparse prefill kernel's padded q and output (counted with the
    non-KV memory) leaves a stock prefill call only the rest to allocate; a decode call, all of it."""
    from mla_planner import decode_scratch, prefill_scratch
    from mla_planner.cli import policies

    prefill_call, decode_call = prefill_scratch(4096, 16), decode_scratch(1, 4096, 16)
    prefill = policies.LaunchRow("sparse_prefill", (0, 4096), (0, 1), 1, 4096, prefill_call)
    decode = policies.LaunchRow("sparse_decode", (0, 4096), (0, 1), 1, 4096, decode_call)
    held = prefill_call.buffers["q_padded"] + prefill_call.buffers["out"]
    assert held > 0 and dep.in_workspace(prefill) == held
    assert decode_call.buffers["q_padded"] > 0 and dep.in_workspace(decode) == 0


# --- vLLM's start-up warm-up ------------------------------------------------------------------
# Every release runs FlashInfer's autotune once the KV cache is allocated, with a dummy step of
# max_num_batched_tokens; model runner V2 runs its attention, V1 does not. Which runner a release
# picks, and what its servers did at 0.95 and 0.90, are its facts (tests/releases).
WARM_UP_ATTENDS = [f for f in ALL.values() if f.warm_up_attends]


@pytest.mark.parametrize("minor", list(ALL))
def test_at_095_stock_fails_where_the_release_failed(minor: str) -> None:
    facts = ALL[minor]
    doc = doctor_json("--builtin-parser", "--vllm", minor, *E2E_LINE)
    w = doc["warmup"]
    assert {k: w[k] for k in facts.warm_up_at_095} == facts.warm_up_at_095
    assert w["attends"] is facts.warm_up_attends
    assert facts.warm_up_why in w["why"]
    if facts.warm_up_attends:
        assert w["stock"]["fits"] is False and w["stock"]["peak_bytes"] == doc["stock"]["peak_bytes"]  # the same one call
    else:
        assert w["stock"] is None
    assert doc["stock"]["fails_at"] == facts.fails_at_095 and doc["stock"]["fits"] is False
    assert doc["verdict"].startswith(facts.verdict_at_095)


@pytest.mark.parametrize("minor", list(ALL))
def test_at_090_stock_starts_and_fits(minor: str) -> None:
    doc = doctor_json("--builtin-parser", "--vllm", minor, *[w if w != "0.95" else "0.90" for w in E2E_LINE])
    assert doc["warmup"]["attends"] is ALL[minor].warm_up_attends
    assert doc["warmup"]["stock"] is None if not ALL[minor].warm_up_attends else doc["warmup"]["stock"]["fits"] is True
    assert doc["stock"]["fails_at"] is None and doc["stock"]["fits"] is True
    assert doc["verdict"].startswith("stock: fits")


@pytest.mark.parametrize("minor", list(ALL))
def test_enforce_eager_keeps_the_warm_up(minor: str) -> None:
    """--enforce-eager turns off compilation and CUDA graphs, not FlashInfer's autotune (nor does it
    change the optimization level, whose default turns the autotune on), so the warm-up step runs
    as with CUDA graphs."""
    doc = doctor_json("--builtin-parser", "--vllm", minor, *E2E_LINE, "--enforce-eager")
    assert doc["deployment"]["enforce_eager"] is True
    assert doc["warmup"]["attends"] is ALL[minor].warm_up_attends
    assert doc["stock"]["fails_at"] == ALL[minor].fails_at_095


@pytest.mark.parametrize("facts", WARM_UP_ATTENDS, ids=[f.minor for f in WARM_UP_ATTENDS])
def test_s6_stock_twin_dies_in_its_warm_up_past_the_int32_limit(facts: ReleaseFacts) -> None:
    """docs/results-vllm-*.md, "KV cache against stock's": the s6 stock twin (tiny GLM-5, 8 heads,
    eager, chunked prefill off, 70,000 tokens a step, 16 sequences) sized its KV cache, then died in
    its warm-up with FlashMLA's int64_stride_to_int: one decode-kernel call over 70,000 tokens."""
    glm5 = str(TINY.parent / "tiny-glm5")
    doc = doctor_json("--builtin-parser", "--vllm", facts.minor, "--", "vllm", "serve", glm5, "--enforce-eager",
                      "--no-enable-chunked-prefill", "--max-num-batched-tokens", "70000", "--max-num-seqs", "16",
                      "--max-model-len", "70000", "--kv-cache-dtype", "fp8_ds_mla", "--block-size", "64")  # fmt: skip
    assert (doc["warmup"]["num_requests"], doc["warmup"]["query_lens"]) == (16, [4375])
    assert doc["warmup"]["stock"]["limit"] == "int32_stride"
    assert doc["stock"]["fails_at"] == "start-up" and doc["stock"]["max_gpu_memory_utilization"] is None
    assert "past FlashMLA's int32 stride limit" in doc["verdict"]


# (the serve line's environment, a flag, whether the warm-up attends: None where the release's default)
WARM_UP_SWITCHES: list[tuple[list[str], str | None, bool | None]] = [
    ([], "--no-enable-flashinfer-autotune", False),
    ([], "--enable-flashinfer-autotune", None),
    (["VLLM_USE_V2_MODEL_RUNNER=0"], None, False),
    (["VLLM_USE_V2_MODEL_RUNNER=1"], None, True),
]


@pytest.mark.parametrize("minor", list(ALL))
@pytest.mark.parametrize(("env", "flag", "attends"), WARM_UP_SWITCHES)
def test_warm_up_follows_the_autotune_flag_and_the_runner(minor: str, env: list[str], flag: str | None,
                                                          attends: bool | None) -> None:
    line = [E2E_LINE[0], *env, *E2E_LINE[1:], *([flag] if flag else [])]
    doc = doctor_json("--builtin-parser", "--vllm", minor, *line)
    expected = ALL[minor].warm_up_attends if attends is None else attends
    assert doc["warmup"]["attends"] is expected
    assert doc["stock"]["fails_at"] == ("start-up" if expected else "worst step")


# (the speculative settings, whether V2 runs: None where the release's default)
RUNNER_CASES: list[tuple[dict[str, Any], bool | None]] = [
    ({}, None),
    ({"parallel_drafting": True, "speculative_method": "mtp"}, False),
    ({"parallel_drafting": True, "speculative_method": "dflash"}, None),
]


@pytest.mark.parametrize("minor", list(ALL))
@pytest.mark.parametrize(("spec", "v2"), RUNNER_CASES)
def test_the_model_runner_each_release_picks(minor: str, spec: dict[str, Any], v2: bool | None) -> None:
    d = dep.Deployment(**{**tiny(0.95, 32_768, modelled(ALL[minor])).__dict__, "num_speculative_tokens": 1, **spec})
    assert dep.runs_v2(d) is (ALL[minor].warm_up_attends if v2 is None else v2)


@pytest.mark.parametrize("minor", list(ALL))
def test_dummy_step_remainder_as_each_release_spreads_it(minor: str) -> None:
    assert modelled(ALL[minor]).dummy_query_lens(10, 4) == list(ALL[minor].dummy_query_lens_10_over_4)


@pytest.mark.parametrize("facts", WARM_UP_ATTENDS, ids=[f.minor for f in WARM_UP_ATTENDS])
def test_a_warm_up_larger_than_the_worst_step_sets_the_highest_utilization(facts: ReleaseFacts) -> None:
    """At 32 heads per rank stock sends decodes to the decode kernel apart from the prefill, so the
    warm-up's 1,024 decodes of 32 tokens are one decode call of all the tokens while the worst
    step's prefill goes through the prefill kernel: here the warm-up's call is the larger."""
    model = dep.model_from_config(TINY / "config.json")
    model = dep.Model(**{**model.__dict__, "num_heads": 32})
    d = dep.Deployment(model, dep.GPUS["H200"], 1, 32_768, 0.95, 163_840, True, False, 1 << 30, 1024,
                       release=modelled(facts))  # fmt: skip
    diag = dep.diagnose(d)
    w = diag.warmup.stock
    assert w is not None and w.launches == 1 and w.peak_bytes > diag.stock.peak_bytes
    with_warmup, worst_alone = dep.max_stock_util(d, w.peak_bytes), dep.max_stock_util(d, diag.stock.peak_bytes)
    assert with_warmup is not None and worst_alone is not None
    assert diag.max_stock_util == with_warmup < worst_alone


@pytest.mark.parametrize("use_vllm", [False, True])
def test_both_parsers_read_the_autotune_flag_and_the_runner_variable(use_vllm: bool) -> None:
    if use_vllm:
        pytest.importorskip("vllm")
    off = serve_line.parse(["VLLM_USE_V2_MODEL_RUNNER=0", "vllm", "serve", "m", "--no-enable-flashinfer-autotune"], use_vllm=use_vllm)
    assert (off.flashinfer_autotune, off.v2_runner_env, off.ignored) == (False, False, ())
    plain = serve_line.parse(["vllm", "serve", "m"], use_vllm=use_vllm)
    assert (plain.flashinfer_autotune, plain.v2_runner_env) == (True, None)
