"""`mla-planner plan`: one scheduler step, its launches and their bytes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import textwrap
from pathlib import Path
from typing import Any

from . import checks, config, policies, routes
from .config import CliError, PlannerConfig, in_flags
from .policies import LaunchRow, Outcome, Scratches
from .steps import Step
from .units import UNITS, format_bytes

DEFAULT_TOKENS = 32_768
SCHEMA = "mla-planner.plan/2"
# Column order of per-buffer tables: inputs, split-KV scratch, outputs.
LINE_WIDTH = 100
BUFFER_ORDER = ("q_padded", "o_accum", "lse_accum", "out", "max_logits", "lse")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "plan",
        help="plan one scheduler step and show its launches and bytes",
        description=(
            "Plan one scheduler step. With no arguments: one 32,768-token prompt, DeepSeek-V3.2 at TP 8 "
            "(16 heads per rank, FP8 mixed batch), 1 GiB budget, sm90 with 132 SMs."
        ),
    )
    s = p.add_argument_group("the step (decodes first)")
    s.add_argument("--tokens", type=int, help=f"one prompt of N tokens, no context (default {DEFAULT_TOKENS})")
    s.add_argument("--query-lens", help="query tokens per request, comma-separated, e.g. 1,1,8192")
    s.add_argument("--context-lens", help="tokens already in the KV cache per request (default all 0)")
    s.add_argument("--num-decodes", type=int, default=0, help="the first N requests are decodes (default 0)")
    checks.add_spec_tokens(s)
    config.add_options(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema in docs/cli.md)")
    p.add_argument(
        "--profile",
        type=Path,
        metavar="FILE",
        help="cost profile (mla-planner calibrate): plan the FP8 route it predicts faster, and show both routes' times",
    )
    p.set_defaults(run=run)


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise CliError(f"{option}: {checks.shorten(text)!r} is not a comma-separated list of integers") from None


def _check_against_model(q: list[int], c: list[int], args: argparse.Namespace) -> None:
    """Decodes of 1 token (1 + --spec-tokens), requests within --max-model-len."""
    decode_len = 1 + args.spec_tokens
    for i, qi in enumerate(q[: args.num_decodes]):
        if qi > decode_len:
            raise CliError(
                f"--num-decodes {args.num_decodes}: request {i} has {checks.shorten(f'{qi:,}')} query tokens, but a decode has "
                + ("1; list prefills after the decodes, or pass --spec-tokens" if decode_len == 1
                   else f"at most {decode_len} (1 + --spec-tokens)")
            )  # fmt: skip
    for i, (qi, ci) in enumerate(zip(q, c)):
        if qi + ci > args.max_model_len:
            qs, cs = checks.shorten(f"{qi:,}"), checks.shorten(f"{ci:,}")
            where = (f"--tokens {qs}" if args.tokens is not None else f"request {i}: --query-lens {qs}") + (
                f" + --context-lens {cs}" if ci else "")
            raise CliError(
                f"{where} is more than --max-model-len {args.max_model_len:,} tokens; "
                "pass the model's own --max-model-len if it is longer"
            )


def step_from_args(args: argparse.Namespace) -> Step:
    if args.tokens is not None and args.query_lens is not None:
        raise CliError("give either --tokens or --query-lens, not both")
    if args.query_lens is not None:
        q = _int_list(args.query_lens, "--query-lens")
    else:
        q = [DEFAULT_TOKENS if args.tokens is None else args.tokens]
    c = _int_list(args.context_lens, "--context-lens") if args.context_lens is not None else [0] * len(q)
    if len(c) != len(q):
        raise CliError(f"--context-lens has {len(c)} values, --query-lens {len(q)}: give one per request")
    if any(x < 1 for x in q):
        raise CliError(f"{'--tokens' if args.tokens is not None else '--query-lens'} must be at least 1, got {min(q):,}")
    if any(x < 0 for x in c):
        raise CliError(f"--context-lens must be at least 0, got {min(c):,}")
    if not 0 <= args.num_decodes <= len(q):
        raise CliError(f"--num-decodes must be between 0 and the number of requests ({len(q)})")
    _check_against_model(q, c, args)
    return Step(q, c, args.num_decodes)


def run(args: argparse.Namespace) -> int:
    cfg = PlannerConfig.from_args(args)
    step = step_from_args(args)
    chosen = routes.choose(args.profile, step, cfg) if args.profile is not None else None
    if chosen is not None:
        cfg = dataclasses.replace(cfg, route=chosen.mode, native_prefill_heads=chosen.native_prefill_heads)
    scratches = Scratches(cfg)  # refuses a config the planner core refuses
    try:
        planned = policies.planned(step, scratches, detail=True)
        stock = policies.stock(step, scratches)
    except ValueError as e:  # the planner's own message: what and why
        raise CliError(in_flags(str(e))) from None
    if args.json:
        doc = to_json(step, cfg, planned, stock)
        if chosen is not None:
            doc["routing"] = routes.to_json(chosen)
        print(json.dumps(doc, indent=2))
        return 0
    one_launch = None
    if planned.plan is not None and planned.plan.mode == "mixed_batch" and planned.launches:
        sparse_tokens = sum(x.s_q for x in planned.launches)
        one_launch = scratches.decode(1, sparse_tokens, True).total_bytes
    text = to_text(step, cfg, planned, stock, one_launch)
    if chosen is not None:
        at = text.index("")  # after the step and config lines
        text[at + 1 : at + 1] = routes.to_text(chosen)
    print("\n".join(wrap(text)))
    return 0


# --- JSON -----------------------------------------------------------------


def _launch_json(launch: LaunchRow) -> dict[str, Any]:
    return {
        "kernel": launch.kernel,
        "tokens": list(launch.tokens),
        "requests": list(launch.requests),
        "batch": launch.batch,
        "s_q": launch.s_q,
        "bytes": launch.bytes,
        "buffers": launch.scratch.buffers,
    }


def to_json(step: Step, cfg: PlannerConfig, planned: Outcome, stock: Outcome) -> dict[str, Any]:
    p = planned.plan
    assert p is not None
    groups = p.prefill_groups
    return {
        "schema": SCHEMA,
        "config": {
            "preset": cfg.preset,
            "tp": cfg.tp,
            "num_heads": cfg.step.num_heads,
            "topk": cfg.step.topk,
            "kv_dtype": cfg.step.kv_dtype,
            "arch": cfg.step.arch,
            "num_sms": cfg.step.num_sms,
            "masked_mha": cfg.step.masked_mha,
            "budget_bytes": cfg.step.scratch_budget_bytes,
            "max_model_len": cfg.max_model_len,
            "gather_workspace_rows": cfg.step.gather_workspace_rows,
            "indexer_workspace_rows": cfg.step.indexer_workspace_rows,
        },
        "step": {
            "query_lens": step.query_lens,
            "context_lens": step.context_lens,
            "num_decodes": step.num_decodes,
            "num_tokens": step.num_tokens,
        },
        "mode": p.mode,
        "vllm_path": cfg.vllm_path,
        "planned": {
            "launches": [_launch_json(x) for x in planned.launches],
            "peak_bytes": planned.peak_bytes,
            "bound": p.bound,
            "failure": planned.failure,
            "prefill_groups": [
                {"requests": r, "path": path, "mask_bytes": m}
                for r, path, m in zip(groups.requests.tolist(), groups.paths, groups.mask_bytes.tolist())
            ],
            "prefill_tokens_by_path": planned.path_tokens,
            "gather_chunks": p.gather_chunks.tolist(),
            "gather_workspace_bytes": p.gather_workspace_bytes,
            "indexer_chunks": p.indexer_chunks.tolist(),
            "indexer_peak_bytes": p.indexer_peak_bytes,
        },
        "stock": {
            "launches": [_launch_json(x) for x in stock.launches],
            "peak_bytes": stock.peak_bytes,
            "failure": stock.failure,
            "prefill_tokens_by_path": stock.path_tokens,
        },
    }


# --- text -----------------------------------------------------------------


def _table(launches: list[LaunchRow]) -> list[str]:
    header = ["#", "kernel", "tokens [a,b)", "requests [a,b)", "b x s_q", "scratch"]
    rows = [header]
    for i, x in enumerate(launches):
        rows.append(
            [
                str(i),
                x.kernel,
                f"{x.tokens[0]:,}-{x.tokens[1]:,}",
                f"{x.requests[0]}-{x.requests[1]}",
                f"{x.batch} x {x.s_q:,}",
                format_bytes(x.bytes),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  " + "  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths))) for r in rows]


def _in_unit(n: int, unit: str) -> str:
    """`n` bytes as a number in `unit`, with format_bytes' precision."""
    if unit == "B":
        return f"{n:,}"
    digits = 2 if unit == "GiB" else 1
    value = n / UNITS[unit]
    smallest = 10.0**-digits
    return f"<{smallest:g}" if 0 < value < smallest / 2 else f"{value:.{digits}f}"


def _breakdown(launch: LaunchRow) -> str:
    """A launch's bytes buffer by buffer, all in the unit of its total, so
    the numbers on the line add up at a glance."""
    unit = format_bytes(launch.bytes).split()[-1]
    buf = launch.scratch.buffers
    names = [b for b in BUFFER_ORDER if b in buf] + sorted(set(buf) - set(BUFFER_ORDER))
    return " + ".join(f"{n} {_in_unit(buf[n], unit)}" for n in names) + f" {unit}"


def _bound_text(bound: str, cfg: PlannerConfig, one_launch_bytes: int | None) -> str:
    would_need = f" (one launch of every sparse token would need {format_bytes(one_launch_bytes)})" if one_launch_bytes else ""
    return {
        "none": "every run of sparse tokens fits one launch",
        "budget": f"the {format_bytes(cfg.step.scratch_budget_bytes)} budget{would_need}",
        "int32_stride": "FlashMLA's int32 stride check (s_q x padded heads x 576 <= 2^31 - 1)",
        "grid": "the CUDA grid limit (s_q <= 65,535)",
    }[bound]


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def _launches_text(launches: list[LaunchRow]) -> list[str]:
    return _table(launches) if launches else ["  none: no token of this step goes through the sparse kernels"]


def _peak_text(outcome: Outcome) -> str:
    if not outcome.launches:
        return "  peak     0 B"
    at = next(i for i, x in enumerate(outcome.launches) if x.bytes == outcome.peak_bytes)
    where = f", launch {at}" if len(outcome.launches) > 1 else ""
    return f"  peak     {format_bytes(outcome.peak_bytes)}{where} = {_breakdown(outcome.launches[at])}"


def _requests_text(r0: int, r1: int) -> str:
    return f"request {r0}" if r1 - r0 == 1 else f"requests [{r0},{r1})"


def wrap(lines: list[str], width: int = LINE_WIDTH) -> list[str]:
    """Lines longer than `width`, folded at spaces; a continuation starts
    under the text after the line's label (`budget   `, `  peak     `)."""
    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        label = re.match(r"\s*\S+\s{2,}", line)
        indent = " " * (len(label.group(0)) if label else 4)
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False)
    return out


def to_text(step: Step, cfg: PlannerConfig, planned: Outcome, stock: Outcome, one_launch_bytes: int | None = None) -> list[str]:
    """The human-readable plan. `one_launch_bytes`: what the step's sparse
    tokens would need in a single launch, to explain a budget bound."""
    p = planned.plan
    assert p is not None
    n, d = len(step.query_lens), step.num_decodes
    out = [
        f"step     {_plural(n, 'request')}, {_plural(step.num_tokens, 'query token')}: "
        f"{_plural(d, 'decode')}, {_plural(n - d, 'prefill')}",
        *cfg.describe(),
        "",
    ]
    groups = p.prefill_groups
    if len(groups):
        out.append("prefill paths")
        starts = [0]
        for q in step.query_lens:
            starts.append(starts[-1] + q)
        ranges = groups.requests.tolist()
        width = max(len(_requests_text(r0, r1)) for r0, r1 in ranges)
        for (r0, r1), path, mask in zip(ranges, groups.paths, groups.mask_bytes.tolist()):
            mask_text = f", top-k mask {format_bytes(mask)}" if mask else ""
            tokens = _plural(starts[r1] - starts[r0], "token")
            out.append(f"  {_requests_text(r0, r1):<{width}}  {path:<10}  {tokens}{mask_text}")
        out.append("")
    out.append(f"planned (mla-planner): {_plural(planned.num_launches, 'launch', 'launches')}")
    out += _launches_text(planned.launches)
    out.append(_peak_text(planned))
    out.append(f"  bound    {p.bound}: {_bound_text(p.bound, cfg, one_launch_bytes)}")
    if planned.failure:
        out.append(f"  FAILS: {planned.failure}")
    if p.indexer_peak_bytes or p.gather_workspace_bytes:
        # Reserved by vLLM at start-up: the budget does not bound them.
        out += ["", "vLLM's own workspaces (reserved at start-up, outside the budget)"]
        if p.indexer_peak_bytes:
            calls = _plural(len(p.indexer_chunks), "call")
            out.append(f"  indexer  peak logits {format_bytes(p.indexer_peak_bytes)}, {calls}")
        if p.gather_workspace_bytes:
            chunks = _plural(len(p.gather_chunks), "chunk")
            out.append(f"  gather   {format_bytes(p.gather_workspace_bytes)} BF16 workspace, {chunks}")
    out += ["", f"stock vLLM: {_plural(stock.num_launches, 'launch', 'launches')}"]
    out += _launches_text(stock.launches)
    out.append(_peak_text(stock))
    if stock.failure:
        out.append(f"  FAILS: {stock.failure} (the step raises instead of running)")
    return out
