"""The model, GPU and budget settings shared by `plan` and `simulate`:
their command-line options and the keyword arguments the planner takes."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass

from mla_planner import H200_NUM_SMS, MAX_HEADS, StepConfig

from . import checks, presets, vllm_releases
from .units import GIB, format_bytes, size_arg

DEFAULT_MAX_MODEL_LEN = 163_840  # DeepSeek-V3.2's context length


class CliError(Exception):
    """Bad input: printed as one line, exit status 2, no traceback."""


FLAGS = {
    "scratch_budget_bytes": "--budget",
    "max_model_len": "--max-model-len",
    "num_sms": "--num-sms",
    "num_heads": "--heads",
    "context_lens + query_lens": "--context-lens + --query-lens",
    "context_len + query_len": "--context-lens + --query-lens",
    "query_lens": "--query-lens",
    "context_lens": "--context-lens",
    "num_decodes": "--num-decodes",
}
"""The planner's argument names, as the flags `plan` and `simulate` take them."""


def in_flags(message: str, names: Mapping[str, str] = FLAGS) -> str:
    """A planner message with its argument names as the user gave them (the flags by default):
    an error should name what the user typed, not the planner's field."""
    for name in sorted(names, key=len, reverse=True):
        message = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w])", names[name], message)
    return message


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and GPU")
    g.add_argument("--preset", help=f"model preset: {', '.join(presets.PRESETS)} (default {presets.DEFAULT_PRESET})")
    g.add_argument("--tp", type=_positive_int, help=f"tensor-parallel size for the preset (default {presets.DEFAULT_TP})")
    g.add_argument("--heads", type=checks.int_in(1, MAX_HEADS), help="query heads per rank, instead of --preset/--tp")
    g.add_argument("--topk", type=checks.int_in(1, checks.MAX_TOPK), default=2048, help="KV tokens each query attends to (default 2048)")
    g.add_argument("--kv-dtype", choices=("fp8", "bf16"), default="fp8", help="KV cache dtype (default fp8)")
    g.add_argument("--arch", choices=("sm90", "sm100"), default="sm90", help="GPU architecture (default sm90)")
    g.add_argument("--num-sms", type=checks.int_in(1, checks.MAX_NUM_SMS), default=H200_NUM_SMS, help=f"SM count (default {H200_NUM_SMS}, H200)")
    masked = vllm_releases.names(vllm_releases.with_masked_mha())
    g.add_argument("--masked-mha", action="store_true", help=f"masked-MHA prefill available (vLLM {masked}: sm100 + bf16 KV only)")
    b = p.add_argument_group("budgets")
    b.add_argument("--budget", type=size_arg, default=GIB, help="bytes one attention launch may allocate, e.g. 1GiB, 512MiB (default 1GiB)")
    b.add_argument(
        "--max-model-len",
        type=checks.int_in(1, checks.MAX_MODEL_LEN),
        default=DEFAULT_MAX_MODEL_LEN,
        help=f"sizes vLLM's gather (5x) and indexer (40x) workspaces (default {DEFAULT_MAX_MODEL_LEN})",
    )


@dataclass(frozen=True)
class PlannerConfig:
    """The step configuration the flags describe, and how its heads were chosen (for people reading
    the output). `step` follows vLLM's rule for the FP8 route; `route` is a cost model's choice for
    the planned policy, when one was made."""

    step: StepConfig
    heads_from: str
    preset: str | None
    tp: int | None
    route: str | None = None
    native_prefill_heads: bool = False
    """The cost model priced the separate route's prefill kernel at native heads (16 or 32)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlannerConfig:
        if args.heads is not None:
            if args.preset is not None or args.tp is not None:
                raise CliError("give either --heads or --preset/--tp, not both")
            heads, heads_from, preset, tp = args.heads, "--heads", None, None
        else:
            preset, tp = args.preset or presets.DEFAULT_PRESET, args.tp or presets.DEFAULT_TP
            try:
                heads = presets.lookup(preset).heads_per_rank(tp)
            except ValueError as e:
                raise CliError(str(e)) from None
            heads_from = f"{preset} at TP {tp}"
        if args.masked_mha and (args.arch, args.kv_dtype) != ("sm100", "bf16"):
            raise CliError("--masked-mha needs --arch sm100 and --kv-dtype bf16 (vLLM's masked MHA runs on FA4 only)")
        try:
            step = StepConfig(
                heads,
                arch=args.arch,
                num_sms=args.num_sms,
                topk=args.topk,
                kv_dtype=args.kv_dtype,
                scratch_budget_bytes=args.budget,
                max_model_len=args.max_model_len,
                masked_mha=args.masked_mha,
                # The backend's way of running plans, so that `plan` and `simulate` show its launches.
                execution="vllm",
            )
        except ValueError as e:
            raise CliError(in_flags(str(e))) from None
        return cls(step, heads_from, preset, tp)

    @property
    def planned(self) -> StepConfig:
        """The configuration the planned policy plans with: the cost model's route, if chosen."""
        if self.route is None:
            return self.step
        return self.step.replace(mode=self.route, native_prefill_heads=self.native_prefill_heads)

    @property
    def mode(self) -> str:
        """vLLM's step mode name (as ``StepPlan.mode``): the stock policy follows it."""
        return self.step.mode

    @property
    def max_model_len(self) -> int:
        """The flag's value (the CLI always sizes the workspaces from it)."""
        assert self.step.max_model_len is not None
        return self.step.max_model_len

    @property
    def vllm_path(self) -> str:
        return presets.vllm_path(self.step.num_heads, self.step.kv_dtype)

    def describe(self) -> list[str]:
        c = self.step
        return [
            f"model    {c.num_heads} query heads per rank ({self.heads_from}), topk {c.topk}, "
            f"{c.kv_dtype} KV, {c.arch} with {c.num_sms} SMs"
            + (", masked MHA available" if c.masked_mha else ""),
            f"path     {self.vllm_path}",
            f"budget   {format_bytes(c.scratch_budget_bytes)} per launch; max_model_len {self.max_model_len:,} "
            f"(gather workspace {c.gather_workspace_rows:,} rows, indexer {c.indexer_workspace_rows:,} rows)",
        ]
