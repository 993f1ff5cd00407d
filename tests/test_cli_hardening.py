"""The command line on bad input: one line on stderr naming the file or
option, exit 2, and no file (or temporary file) left behind. Also the
checks against the model, stdin traces, and the all-or-nothing writes."""

from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

import mla_planner
from mla_planner.cli import main, presets
from mla_planner.cli.atomic import atomic_files
from mla_planner.cli.config import CliError
from mla_planner.cli.simulate import _count_lines
from mla_planner.cli.units import parse_bytes

PYTHON_CLI = [sys.executable, "-m", "mla_planner.cli"]
DECODE = {"query_len": 1, "context_len": 3, "decode": True}


def run_cli(*args: str, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PYTHON_CLI, *args], input=stdin, capture_output=True, text=True, timeout=120, cwd=cwd)


def refused(*args: str, cwd: Path | None = None) -> str:
    """The command must exit 2 with exactly one line on stderr; returns it."""
    r = run_cli(*args, cwd=cwd)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert " error: " in lines[0]
    return lines[0]


def trace_file(path: Path, *steps: Sequence[Mapping[str, object]]) -> Path:
    path.write_text("".join(json.dumps({"requests": s}) + "\n" for s in steps))
    return path


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


# --- destinations ---------------------------------------------------------------


def test_simulate_out_is_an_existing_file(tmp_path: Path) -> None:
    out = tmp_path / "report"
    out.write_text("keep me")
    line = refused("simulate", "--out", str(out), "--no-plot")
    assert f"--out {out} is a file; give --out a folder" in line
    assert out.read_text() == "keep me" and listing(tmp_path) == ["report"]


def test_simulate_out_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    line = refused("simulate", "--out", str(tmp_path / "f" / "report"), "--no-plot")
    assert f"{tmp_path / 'f'} is a file" in line and "--out" in line


@pytest.mark.parametrize("where", ["/proc/mla-planner-report", "/proc/self/mla-planner-report"])
def test_simulate_out_in_proc(where: str) -> None:
    line = refused("simulate", "--out", where, "--no-plot")
    assert f"--out {where}: cannot write in /proc" in line and "choose another --out" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_simulate_out_unwritable(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    line = refused("simulate", "--out", str(locked / "report"), "--no-plot")
    assert f"cannot write in {locked}" in line


def test_trace_gen_output_is_a_folder_leaves_no_temp_file(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    line = refused("trace", "gen", "--steps", "3", "-o", str(tmp_path / "d"))
    assert f"--output {tmp_path / 'd'} is a folder" in line
    assert line.startswith("mla-planner trace gen: error:")
    assert listing(tmp_path) == ["d"] and listing(tmp_path / "d") == []


def test_trace_gen_output_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    line = refused("trace", "gen", "--steps", "3", "-o", str(tmp_path / "f" / "t.jsonl"))
    assert f"cannot be created: {tmp_path / 'f'} is a file" in line and "--output" in line
    assert listing(tmp_path) == ["f"]


def test_trace_gen_output_in_proc() -> None:
    assert "cannot write in /proc" in refused("trace", "gen", "--steps", "3", "-o", "/proc/t.jsonl")


def test_simulate_out_with_a_folder_in_place_of_a_report_file_changes_nothing(tmp_path: Path) -> None:
    trace = trace_file(tmp_path / "t.jsonl", [DECODE])
    out = tmp_path / "out"
    r = run_cli("simulate", str(trace), "--out", str(out), "--no-plot")
    assert r.returncode == 0, r.stderr
    before = {name: (out / name).read_bytes() for name in listing(out)}
    (out / "simulate.md").unlink()
    (out / "simulate.md").mkdir()
    line = refused("simulate", str(trace), "--out", str(out), "--no-plot", "--budget", "2GiB")
    assert f"{out / 'simulate.md'} is a folder" in line
    assert listing(out) == sorted(before)  # no temporary file
    for name, data in before.items():
        if name != "simulate.md":
            assert (out / name).read_bytes() == data, name


def test_a_failed_rename_puts_every_file_back(tmp_path: Path) -> None:
    """The folder check happens again at commit time; a destination that
    turns into a folder after the writes stops the set half-way."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("old a")
    with pytest.raises(CliError, match="b.txt is a folder"):
        with atomic_files() as files:
            files.write_bytes(a, b"new a")
            files.write_bytes(b, b"new b")
            b.mkdir()
    assert a.read_text() == "old a"
    assert listing(tmp_path) == ["a.txt", "b.txt"]


def test_a_failed_set_removes_the_folders_it_made(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with atomic_files() as files:
            files.write_bytes(tmp_path / "new" / "deeper" / "a.txt", b"a")
            raise RuntimeError("the plot failed")
    assert listing(tmp_path) == []


def test_a_new_set_replaces_the_old_one(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("old a")
    with atomic_files() as files:
        files.write_bytes(a, b"new a")
        files.write_bytes(b, b"new b")
    assert (a.read_text(), b.read_text()) == ("new a", "new b")
    assert listing(tmp_path) == ["a.txt", "b.txt"]


# --- inputs that used to end in a traceback -----------------------------------------


def test_deeply_nested_trace_line(tmp_path: Path) -> None:
    trace = tmp_path / "deep.jsonl"
    trace.write_text("[" * 100_000 + "\n")
    assert f"{trace}:1: JSON nested too deeply" in refused("simulate", str(trace), "--out", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "1e400"])
def test_headroom_must_be_a_finite_positive_number(value: str) -> None:
    assert "argument --headroom-gib: must be a number > 0" in refused("simulate", f"--headroom-gib={value}")


def test_a_400_digit_budget_is_too_large() -> None:
    line = refused("plan", "--budget", "9" * 400)
    assert "argument --budget:" in line and "larger than 1 PiB" in line
    assert len(line) < 200  # the number is shortened, not echoed whole


@pytest.mark.parametrize("extra", [[], ["--dry-run"]])
def test_calibrate_topk_beyond_32_bits(extra: list[str], tmp_path: Path) -> None:
    line = refused("calibrate", "--topk", "4294967296", "-o", str(tmp_path / "p.json"), *extra)
    assert "--topk must be a multiple of 128 from 128 to 1,048,576" in line


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_simulate_dev_zero(tmp_path: Path) -> None:
    line = refused("simulate", "/dev/zero", "--out", str(tmp_path / "o"))
    assert "/dev/zero:1: line longer than 16 MiB: not a trace" in line


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_plan_profile_dev_zero() -> None:
    assert "--profile /dev/zero is not a regular file" in refused("plan", "--profile", "/dev/zero")


@pytest.mark.parametrize("heads", ["0", "129", "1" * 400])
def test_heads_outside_1_to_128(heads: str) -> None:
    assert "argument --heads: must be between 1 and 128" in refused("plan", "--heads", heads)


def test_option_errors_are_one_line_with_a_pointer_to_help() -> None:
    assert refused("plan", "--no-such-option").endswith("unrecognized arguments: --no-such-option (see mla-planner --help)")
    assert refused("plan", "--tokens", "x").endswith("(see mla-planner plan --help)")


# --- steps checked against the model ------------------------------------------


def test_plan_tokens_above_max_model_len() -> None:
    line = refused("plan", "--tokens", "10000000")
    assert "--tokens 10,000,000 is more than --max-model-len 163,840" in line
    refused("plan", "--tokens", "5000", "--max-model-len", "4096")
    assert run_cli("plan", "--tokens", "163840").returncode == 0  # exactly the limit fits


def test_plan_context_plus_query_above_max_model_len() -> None:
    line = refused("plan", "--query-lens", "1,9000", "--context-lens", "0,160000", "--num-decodes", "1")
    assert "request 1: --query-lens 9,000 + --context-lens 160,000 is more than --max-model-len 163,840" in line


def test_plan_decode_longer_than_one_token() -> None:
    line = refused("plan", "--query-lens", "8192,1,1", "--num-decodes", "2")
    assert "--num-decodes 2: request 0 has 8,192 query tokens, but a decode has 1" in line


def test_plan_spec_tokens_allow_longer_decodes() -> None:
    args = ["plan", "--json", "--query-lens", "3,3,4096", "--context-lens", "50,60,0", "--num-decodes", "2"]
    assert "at most 2 (1 + --spec-tokens)" in refused(*args, "--spec-tokens", "1")
    r = run_cli(*args, "--spec-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"]["num_decodes"] == 2


def test_plan_spec_tokens_reach_the_planners_longest_decode() -> None:
    """--spec-tokens is bounded by the planner core's own limit, not a second copy of it: the longest
    decode it admits plans, one token more is refused by the option."""
    longest = mla_planner.MAX_DECODE_QUERY_LEN
    args = ["plan", "--json", "--query-lens", f"{longest},{longest}", "--context-lens", "100,200", "--num-decodes", "2"]
    r = run_cli(*args, "--spec-tokens", str(longest - 1))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"]["num_tokens"] == 2 * longest
    assert f"--spec-tokens: must be between 0 and {longest - 1:,}, got {longest}" in refused(*args, "--spec-tokens", str(longest))


def test_simulate_trace_checked_against_the_model(tmp_path: Path) -> None:
    long = trace_file(tmp_path / "long.jsonl", [DECODE], [{"query_len": 8192, "context_len": 160_000}])
    line = refused("simulate", str(long), "--out", str(tmp_path / "o"))
    assert f"{long}:2: request 0: context_len 160,000 + query_len 8,192 = 168,192 tokens" in line
    assert "--max-model-len 163,840" in line
    spec = trace_file(tmp_path / "spec.jsonl", [{"query_len": 3, "context_len": 9, "decode": True}])
    assert f"{spec}:1: request 0 is a decode of 3 query tokens" in refused("simulate", str(spec), "--out", str(tmp_path / "o"))
    r = run_cli("simulate", str(spec), "--spec-tokens", "2", "--no-plot", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "o" / "simulate.png").exists()


# --- stdin, progress, output ----------------------------------------------------------


def test_simulate_reads_stdin(tmp_path: Path) -> None:
    text = "".join(json.dumps({"requests": s}) + "\n" for s in ([DECODE], [{"query_len": 9000, "context_len": 0}]))
    (tmp_path / "t.jsonl").write_text(text)
    r = run_cli("simulate", "-", "--out", str(tmp_path / "a"), "--no-plot", stdin=text)
    assert r.returncode == 0, r.stderr
    assert "trace: stdin, 2 steps" in r.stdout
    run_cli("simulate", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "b"), "--no-plot")
    a = list(csv.reader((tmp_path / "a" / "simulate_steps.csv").open()))
    assert a == list(csv.reader((tmp_path / "b" / "simulate_steps.csv").open())) and len(a) == 3


def test_trace_gen_dash_writes_stdout() -> None:
    r = run_cli("trace", "gen", "--steps", "4", "-o", "-")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 4


def test_simulate_ends_with_a_verdict_and_the_report_path(tmp_path: Path) -> None:
    steps = [[DECODE], [{"query_len": 32768, "context_len": 0}]]
    trace = trace_file(tmp_path / "t.jsonl", *steps)
    r = run_cli("simulate", "t.jsonl", "--out", "rel", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    *_, where, verdict = r.stdout.splitlines()
    assert where.startswith(f"report: {tmp_path / 'rel' / 'simulate.md'} (beside it: simulate.png")
    assert verdict == "stock fails 1 of 2 steps, worst 12.27 GiB; planned 0, worst 981.5 MiB"
    one = trace_file(tmp_path / "one.jsonl", [DECODE])
    out = run_cli("simulate", str(one), "--out", str(tmp_path / "one"), cwd=tmp_path).stdout
    assert f"trace: {one}, 1 step\n" in out and "of 1 step," in out
    assert (tmp_path / "one" / "simulate.png").read_bytes().startswith(b"\x89PNG")
    assert trace.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_progress_bar_on_a_terminal_has_the_total(tmp_path: Path) -> None:
    import fcntl
    import pty
    import struct
    import termios

    trace = trace_file(tmp_path / "t.jsonl", [DECODE], [DECODE], [DECODE])
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 0-column terminal draws no bar
    p = subprocess.Popen([*PYTHON_CLI, "simulate", str(trace), "--no-plot", "--out", str(tmp_path / "o")],
                         stdout=subprocess.DEVNULL, stderr=terminal)  # fmt: skip
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the command closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    assert p.wait(timeout=120) == 0
    assert b"simulating: 100%" in shown and b"3/3 [" in shown


def test_progress_total_counts_lines(tmp_path: Path) -> None:
    plain = trace_file(tmp_path / "t.jsonl", [DECODE], [DECODE], [DECODE])
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert _count_lines(plain) == _count_lines(packed) == 3
    assert _count_lines(Path("-")) is None


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--heads", "64", "--query-lens", "1,1,70000", "--context-lens", "9,9,0", "--num-decodes", "2"],
        ["--preset", "deepseek-v3.2", "--tp", "4", "--query-lens", "1,1,70000", "--context-lens", "9,9,0", "--num-decodes", "2"],
        ["--heads", "128", "--kv-dtype", "bf16", "--arch", "sm100", "--masked-mha", "--query-lens", "30000,4000"],
    ],
)  # fmt: skip
def test_plan_text_fits_100_columns(args: list[str]) -> None:
    r = run_cli("plan", *args)
    assert r.returncode == 0, r.stderr
    assert max(map(len, r.stdout.splitlines())) <= 100
    assert "call(s)" not in r.stdout and "1 steps" not in r.stdout


def test_plan_text_wording() -> None:
    out = run_cli("plan", "--heads", "64", "--query-lens", "1,1,9000", "--context-lens", "9,9,0", "--num-decodes", "2").stdout
    assert "  request 2  sparse_mqa  9,000 tokens" in out
    assert "requests 0-1" not in out
    # The indexer and gather workspace are not under the budget: their own block.
    budget_part, workspaces = out.split("vLLM's own workspaces (reserved at start-up, outside the budget)")
    assert "peak logits" not in budget_part and "  indexer  peak logits" in workspaces
    assert "  gather   900.0 MiB BF16 workspace, 1 chunk\n" in workspaces


# --- errors that are bugs ----------------------------------------------------------


def test_an_unexpected_exception_is_reported_as_a_bug(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def broken(args: object) -> int:
        raise KeyError("oops")

    monkeypatch.setattr(presets, "run", broken)
    monkeypatch.delenv("MLA_PLANNER_DEBUG", raising=False)
    assert main(["presets"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "internal error (a bug in mla-planner" in err and "MLA_PLANNER_DEBUG=1" in err
    monkeypatch.setenv("MLA_PLANNER_DEBUG", "1")
    with pytest.raises(KeyError):
        main(["presets"])


def test_parse_bytes_is_exact() -> None:
    assert parse_bytes("1.5GiB") == 3 << 29
    assert parse_bytes("0.1KiB") == 102  # 102.4 bytes, truncated
    with pytest.raises(ValueError, match="larger than 1 PiB"):
        parse_bytes("1" + "0" * 400)
