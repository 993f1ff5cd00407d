"""`mla-planner plan`: one scheduler step, its launches and their bytes."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from . import config, policies, routes
from .config import CliError, PlannerConfig
from .policies import Launch, Outcome, Scratches
from .steps import Step
from .units import format_bytes

DEFAULT_TOKENS = 32_768
SCHEMA = "mla-planner.plan/1"
# Column order of per-buffer tables: inputs, split-KV scratch, outputs.
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
        raise CliError(f"{option}: {text!r} is not a comma-separated list of integers") from None


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
        raise CliError("query lengths must be >= 1")
    if any(x < 0 for x in c):
        raise CliError("context lengths must be >= 0")
    if not 0 <= args.num_decodes <= len(q):
        raise CliError(f"--num-decodes must be between 0 and the number of requests ({len(q)})")
    return Step(q, c, args.num_decodes)


def run(args: argparse.Namespace) -> int:
    cfg = PlannerConfig.from_args(args)
    step = step_from_args(args)
    chosen = routes.choose(args.profile, step, cfg) if args.profile is not None else None
    if chosen is not None:
        cfg = dataclasses.replace(cfg, mixed_batch=chosen.mixed_batch)
    scratches = Scratches(cfg)  # refuses a config the planner core refuses
    try:
        planned = policies.planned(step, scratches, detail=True)
        stock = policies.stock(step, scratches)
    except ValueError as e:  # the planner's own message: what and why
        raise CliError(str(e)) from None
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
    print("\n".join(text))
    return 0


# --- JSON -----------------------------------------------------------------


def _launch_json(launch: Launch) -> dict[str, Any]:
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
            "num_heads": cfg.num_heads,
            "topk": cfg.topk,
            "kv_dtype": cfg.kv_dtype,
            "arch": cfg.arch,
            "num_sms": cfg.num_sms,
            "masked_mha": cfg.masked_mha,
            "budget_bytes": cfg.budget_bytes,
            "max_model_len": cfg.max_model_len,
            "gather_workspace_rows": cfg.gather_workspace_rows,
            "indexer_workspace_rows": cfg.indexer_workspace_rows,
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
                {"requests": r, "route": route, "mask_bytes": m}
                for r, route, m in zip(groups.requests.tolist(), groups.routes, groups.mask_bytes.tolist())
            ],
            "prefill_tokens_by_route": planned.route_tokens,
            "gather_chunks": p.gather_chunks.tolist(),
            "gather_workspace_bytes": p.gather_workspace_bytes,
            "indexer_chunks": p.indexer_chunks.tolist(),
            "indexer_peak_bytes": p.indexer_peak_bytes,
        },
        "stock": {
            "launches": [_launch_json(x) for x in stock.launches],
            "peak_bytes": stock.peak_bytes,
            "failure": stock.failure,
            "prefill_tokens_by_route": stock.route_tokens,
        },
    }


# --- text -----------------------------------------------------------------


def _table(launches: list[Launch]) -> list[str]:
    names = [b for b in BUFFER_ORDER if any(b in x.scratch.buffers for x in launches)]
    names += sorted({b for x in launches for b in x.scratch.buffers} - set(names))
    header = ["#", "kernel", "tokens [a,b)", "requests [a,b)", "b x s_q", *names, "total"]
    rows = [header]
    for i, x in enumerate(launches):
        buf = x.scratch.buffers
        rows.append(
            [
                str(i),
                x.kernel,
                f"{x.tokens[0]:,}-{x.tokens[1]:,}",
                f"{x.requests[0]}-{x.requests[1]}",
                f"{x.batch} x {x.s_q:,}",
                *(format_bytes(buf[n]) if n in buf else "-" for n in names),
                format_bytes(x.bytes),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  " + "  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths))) for r in rows]


def _bound_text(bound: str, cfg: PlannerConfig, one_launch_bytes: int | None) -> str:
    would_need = f" (one launch of every sparse token would need {format_bytes(one_launch_bytes)})" if one_launch_bytes else ""
    return {
        "none": "every run of sparse tokens fits one launch",
        "budget": f"the {format_bytes(cfg.budget_bytes)} budget{would_need}",
        "int32_stride": "FlashMLA's int32 stride check (s_q x padded heads x 576 <= 2^31 - 1)",
        "grid": "the CUDA grid limit (s_q <= 65,535)",
    }[bound]


def _launch_word(n: int) -> str:
    return f"{n} launch" + ("" if n == 1 else "es")


def _launches_text(launches: list[Launch]) -> list[str]:
    return _table(launches) if launches else ["  none: no token of this step goes through the sparse kernels"]


def to_text(step: Step, cfg: PlannerConfig, planned: Outcome, stock: Outcome, one_launch_bytes: int | None = None) -> list[str]:
    """The human-readable plan. `one_launch_bytes`: what the step's sparse
    tokens would need in a single launch, to explain a budget bound."""
    p = planned.plan
    assert p is not None
    n, d = len(step.query_lens), step.num_decodes
    out = [
        f"step     {n} request{'s' if n != 1 else ''}, {step.num_tokens:,} query tokens: "
        f"{d} decode{'s' if d != 1 else ''}, {n - d} prefill{'s' if n - d != 1 else ''}",
        *cfg.describe(),
        "",
    ]
    groups = p.prefill_groups
    if len(groups):
        out.append("prefill routes")
        starts = [0]
        for q in step.query_lens:
            starts.append(starts[-1] + q)
        for (r0, r1), route, mask in zip(groups.requests.tolist(), groups.routes, groups.mask_bytes.tolist()):
            mask_text = f", top-k mask {format_bytes(mask)}" if mask else ""
            out.append(f"  requests {r0}-{r1}  {route:<10}  {starts[r1] - starts[r0]:,} tokens{mask_text}")
        out.append("")
    peak_at = next((i for i, x in enumerate(planned.launches) if x.bytes == planned.peak_bytes), 0)
    out.append(f"planned (mla-planner): {_launch_word(planned.num_launches)}")
    out += _launches_text(planned.launches)
    at = f", launch {peak_at}" if planned.launches else ""
    out.append(f"  peak   {format_bytes(planned.peak_bytes)} ({planned.peak_bytes:,} B){at}")
    out.append(f"  bound  {p.bound}: {_bound_text(p.bound, cfg, one_launch_bytes)}")
    if p.indexer_peak_bytes:
        out.append(f"  indexer  {len(p.indexer_chunks)} call(s), peak logits {format_bytes(p.indexer_peak_bytes)}")
    if p.gather_workspace_bytes:
        out.append(f"  gather workspace  {format_bytes(p.gather_workspace_bytes)} in {len(p.gather_chunks)} chunk(s)")
    if planned.failure:
        out.append(f"  FAILS: {planned.failure}")
    out += ["", f"stock vLLM: {_launch_word(stock.num_launches)}"]
    out += _launches_text(stock.launches)
    out.append(f"  peak   {format_bytes(stock.peak_bytes)} ({stock.peak_bytes:,} B)")
    if stock.failure:
        out.append(f"  FAILS: {stock.failure} (the step raises instead of running)")
    return out
