"""`mla-planner doctor`: will this `vllm serve` line survive its worst step, and what fixes it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from mla_planner import profiles
from mla_planner.engine_model import minor_of
from mla_planner.engine_model.settings import NO_PROFILE, PROFILE_VAR, Settings, SettingsError, read_settings

from . import deployment, serve_line, vllm_releases
from .config import CliError
from .deployment import Deployment, Diagnosis, StepVerdict
from .units import GIB, format_bytes, size_arg

SCHEMA = "mla-planner.doctor/1"
PLUGIN_FLAGS = {"--attention-backend": "CUSTOM", "--kv-cache-dtype": "fp8_ds_mla", "--block-size": "64"}


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    releases = " or ".join(vllm_releases.RELEASES)
    p = commands.add_parser(
        "doctor",
        help="will a `vllm serve` line run out of memory on its worst step, and what fixes it",
        description=(
            f"Read a `vllm serve` command line (after --) and say whether stock vLLM ({releases}) and the "
            "mla-planner plugin survive its worst step, what each leaves for the KV cache, and which flags to change."
        ),
    )
    p.add_argument("serve", nargs=argparse.REMAINDER, help="the serve line after --: vllm serve MODEL [flags]")
    p.add_argument("--config", metavar="PATH|PRESET", help="the model's config.json (or its folder), or a preset: "
                   + ", ".join(deployment.PRESET_MODELS) + " (default: from the serve line's model)")  # fmt: skip
    p.add_argument("--gpu", default="H200", help="H200, H100 (measured), B200 (datasheet), or 'present' (default H200)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: the serve line's --tensor-parallel-size)")
    p.add_argument("--weights", type=size_arg, metavar="SIZE", help="model memory per GPU, e.g. 80GiB (default: estimated)")
    p.add_argument("--activation", type=size_arg, metavar="SIZE", help="vLLM's profiled activation peak (default: estimated)")
    p.add_argument("--vllm", choices=sorted(vllm_releases.RELEASES), help="the vLLM release the line runs on (default: "
                   "the installed vLLM where it is one of these, else the newest, " + vllm_releases.NEWEST.minor + ")")
    p.add_argument("--builtin-parser", action="store_true", help="read the serve line with the built-in subset even where vLLM is installed")
    p.add_argument("--json", action="store_true", help=f"print JSON ({SCHEMA}, docs/cli.md)")
    p.set_defaults(run=run)


def plugin_settings(env: dict[str, str]) -> Settings:
    """The plugin's settings from the serve line's environment, read and checked by the plugin's
    own reader (the budget's bounds, its two names agreeing, the flags' values). The cost profile
    is left out: its path names a file on the serving machine, which need not be this one."""
    try:
        return read_settings({name: value for name, value in env.items() if name != PROFILE_VAR})
    except SettingsError as e:
        raise CliError(f"the serve line: {e}") from None


def build(args: argparse.Namespace) -> tuple[Deployment, serve_line.ServeArgs]:
    serve = serve_line.parse([w for w in args.serve if w != "--"], use_vllm=not args.builtin_parser)
    if args.config is not None:
        model = deployment.lookup_model(args.config)
    else:
        if serve.model is None:
            raise CliError("the serve line names no model: give it as `vllm serve MODEL ...`, or pass --config PATH (its "
                           "config.json) or a preset")
        found = deployment.model_for_serve_model(serve.model)
        if found is None:
            raise CliError(f"cannot tell the model of {serve.model!r}: pass --config PATH (its config.json) or a preset")
        model = found
    gpu = deployment.lookup_gpu(args.gpu)
    tp = args.tp if args.tp is not None else serve.tensor_parallel_size
    if tp < 1 or model.num_heads % tp:
        raise CliError(f"{model.num_heads} attention heads do not split over tensor parallel {tp}")
    release = vllm_releases.RELEASES[args.vllm] if args.vllm else vllm_releases.release_for(deployment.installed_vllm())
    default_mnbt, default_seqs = release.default_batch(gpu.total_bytes)
    max_model_len = serve.max_model_len or model.max_position_embeddings
    mnbt = serve.max_num_batched_tokens
    if mnbt is None:
        # Without chunked prefill every prompt is one step: vLLM raises its default to max_model_len.
        mnbt = default_mnbt if serve.chunked_prefill else max(default_mnbt, max_model_len)
    elif not serve.chunked_prefill and mnbt < max_model_len:
        raise CliError(f"the serve line: vLLM refuses --max-num-batched-tokens {mnbt:,} below max_model_len "
                       f"{max_model_len:,} with chunked prefill off")
    settings = plugin_settings(serve.env)
    budget = settings.scratch_bytes
    d = Deployment(
        model=model,
        gpu=gpu,
        tp=tp,
        max_num_batched_tokens=mnbt,
        gpu_memory_utilization=serve.gpu_memory_utilization,
        max_model_len=max_model_len,
        kv_fp8=serve.kv_fp8,
        plugin=(serve.attention_backend or "").upper() == "CUSTOM",
        budget_bytes=budget,
        max_num_seqs=serve.max_num_seqs or default_seqs,
        weights_override=args.weights,
        activation_override=args.activation,
        routes_by_profile=serve.env.get(PROFILE_VAR, "").strip().lower() != NO_PROFILE,
        release=release,
        enforce_eager=serve.enforce_eager,
        num_speculative_tokens=serve.num_speculative_tokens,
        mtp_draft=serve.mtp_draft,
        parallel_drafting=serve.parallel_drafting,
        speculative_method=serve.speculative_method,
        flashinfer_autotune=serve.flashinfer_autotune,
        v2_runner_env=serve.v2_runner_env,
    )
    if d.kv_fp8:
        try:
            deployment.check_plugin_budget(d, settings)
        except SettingsError as e:
            raise CliError(f"the serve line: the plugin would not start: {e}") from None
    return d, serve


def run(args: argparse.Namespace) -> int:
    d, serve = build(args)
    diag = deployment.diagnose(d)
    if diag.stock_kv_bytes <= 0:
        raise CliError(
            f"the model does not load: its non-KV memory {format_bytes(d.non_kv_bytes())} (weights "
            f"{format_bytes(d.weights_per_rank)}) exceeds {serve.gpu_memory_utilization} x {format_bytes(d.gpu.total_bytes)}: "
            "raise --tp or pass --weights if the estimate is off"
        )
    installed = deployment.installed_vllm()
    if args.json:
        print(json.dumps(to_json(diag, serve, installed), indent=2))
    else:
        print("\n".join(to_text(diag, serve, installed)))
    return 0


# --- verdict and fixes ------------------------------------------------------------


def flags_to_add(serve: serve_line.ServeArgs) -> list[str]:
    have = {"--attention-backend": (serve.attention_backend or "").upper(), "--kv-cache-dtype": serve.kv_cache_dtype,
            "--block-size": str(serve.block_size or "")}  # fmt: skip
    return [f"{flag} {value}" for flag, value in PLUGIN_FLAGS.items() if have[flag] != value]


def _limit_text(limit: str, diag: Diagnosis) -> str:
    if limit == "int32_stride":
        return f"one kernel call past FlashMLA's int32 stride limit ({diag.stride_tokens:,} tokens)"
    if limit == "workspace_assert":
        return "a request longer than vLLM's gather workspace"
    return limit


def warmup_shape(w: deployment.Warmup) -> str:
    """``1,024 requests of 32 tokens, decode-only`` (the longest where they differ)."""
    q, d = w.step.query_lens, w.step.num_decodes
    kind = "decode-only" if d == len(q) else "prefill-only" if d == 0 else f"{d:,} of them decodes"
    return f"{len(q):,} request{'s' if len(q) > 1 else ''} of {max(q):,} tokens, {kind}"


def _startup_problem(diag: Diagnosis) -> str:
    w, t = diag.warmup, diag.worst_step.num_tokens
    assert w.stock is not None
    why = (_limit_text(w.stock.limit, diag) if w.stock.limit else
           f"OOM (needs {format_bytes(w.stock.peak_bytes)} of scratch, {format_bytes(max(0, diag.headroom))} free for it)")
    return (f"fails at start-up: vLLM {diag.deployment.release.version}'s warm-up runs a {t:,}-token step "
            f"({warmup_shape(w)}) through the sparse-MLA kernels once the KV cache is allocated: {why}")


def _stock_problem(diag: Diagnosis) -> str:
    if diag.stock_fails_at == "start-up":
        return _startup_problem(diag)
    s, t = diag.stock, diag.worst_step.num_tokens
    if s.limit:
        return f"fails at a {t:,}-token step: {_limit_text(s.limit, diag)}"
    return f"OOM at the first {t:,}-token step (needs {format_bytes(s.peak_bytes)} of scratch, {format_bytes(max(0, diag.headroom))} free for it)"


def verdict(diag: Diagnosis, serve: serve_line.ServeArgs) -> tuple[str, list[str]]:
    """One line, and the flag changes it recommends."""
    d, s, p = diag.deployment, diag.stock, diag.plugin
    plugin_text = (
        f"with the plugin: fits ({format_bytes(d.budget_bytes)} budget; {format_bytes(diag.reserved_bytes)} "
        f"held back from the KV cache, {diag.reserved_kv_tokens:,} tokens)"
        if p.fits else f"with the plugin: does not fit ({format_bytes(p.peak_bytes)} > budget + headroom)"
    )  # fmt: skip
    if d.plugin:
        return (f"plugin (as given): {'fits' if p.fits else 'does not fit'} ({format_bytes(d.budget_bytes)} budget); "
                f"stock would: {'fit' if diag.stock_fails_at is None else _stock_problem(diag)}"), []  # fmt: skip
    if diag.stock_fails_at is None:
        w = diag.warmup.stock
        start = f", its start-up warm-up {format_bytes(w.peak_bytes)}" if w is not None and w.peak_bytes > s.peak_bytes else ""
        return (f"stock: fits (worst step {format_bytes(s.peak_bytes)} of scratch{start}, {format_bytes(diag.headroom)} free "
                f"for it); {plugin_text}"), []  # fmt: skip
    fixes = []
    add = flags_to_add(serve)
    if p.fits:
        fixes.append("add: " + " ".join(add) + " (install the plugin beside vLLM: `pip install .` in an mla-planner checkout, or its wheel; docs/vllm.md)")
    if diag.max_stock_util is not None:
        fixes.append(f"or lower --gpu-memory-utilization to {diag.max_stock_util:.2f}")
    elif diag.stock_limit == "int32_stride":
        fixes.append(f"or lower --max-num-batched-tokens to {diag.stride_tokens:,} (and check again)")
    return f"stock: {_stock_problem(diag)}; {plugin_text}", fixes


def cost_profile(d: Deployment, serve: serve_line.ServeArgs, installed: str | None) -> dict[str, Any]:
    """The cost profile the plugin's engine will route FP8 steps by, and the route that follows:
    ``source`` (``none``, ``file``, ``packaged`` or ``measured at first start``), ``file``,
    ``text`` (one line)."""
    value = serve.env.get(PROFILE_VAR, "").strip()
    if value.lower() == NO_PROFILE:
        return {"source": "none", "file": None,
                "text": f"none ({PROFILE_VAR}={value}): vLLM's rule routes every FP8 step "
                        f"({'mixed batch' if d.heads_per_rank < 32 else 'separate prefill and decode'} at "
                        f"{d.heads_per_rank} heads per rank); a step whose one call fits the budget runs as that call"}
    if value:
        return {"source": "file", "file": value,
                "text": f"{PROFILE_VAR}={value} (read on the serving machine): the cost model picks each step's route"}
    kernels = f"vllm {d.release.version}"
    packaged = profiles.packaged_for_gpu(d.gpu.arch, d.gpu.name, kernels)
    first_start = (f"the engine measures one at its first start (a reduced grid, tens of seconds) and keeps it in "
                   f"{profiles.cache_dir()}/profiles for later starts")
    if packaged is None:
        return {"source": "measured at first start", "file": None,
                "text": f"none packaged for the {d.gpu.name} under {kernels}: {first_start}; the cost model then picks "
                        "each step's route"}
    env = profiles.environment_of(packaged)
    return {"source": "packaged", "file": packaged.name,
            "text": f"packaged {packaged.name} (measured under driver {env.get('driver')}, torch {env.get('torch')}) where "
                    f"the serving machine has that software; elsewhere {first_start}; the cost model picks each step's route"}


# --- output ---------------------------------------------------------------------------


def _verdict_json(v: StepVerdict) -> dict[str, Any]:
    return {"peak_bytes": v.peak_bytes, "launches": v.launches, "limit": v.limit, "fits": v.fits}


def warmup_json(w: deployment.Warmup) -> dict[str, Any]:
    return {"num_tokens": w.step.num_tokens, "query_lens": sorted(set(w.step.query_lens)),
            "num_requests": len(w.step.query_lens), "num_decodes": w.step.num_decodes, "attends": w.attends,
            "why": w.why, "stock": None if w.stock is None else _verdict_json(w.stock)}  # fmt: skip


def warmup_text(diag: Diagnosis) -> str:
    """The ``start-up`` line: vLLM's warm-up step and, where it runs the kernels, stock's calls in it."""
    w, release, t = diag.warmup, diag.deployment.release.version, diag.warmup.step.num_tokens
    if not diag.deployment.flashinfer_autotune:
        return f"vLLM {release}'s warm-up runs no {t:,}-token step ({w.why})"
    head = f"vLLM {release}'s warm-up, once the KV cache is allocated: a {t:,}-token step"
    if w.stock is None:
        return f"{head}; {w.why}"
    s = w.stock
    return (f"{head} ({warmup_shape(w)}) through the sparse-MLA kernels; stock {format_bytes(s.peak_bytes)}: "
            f"{'fits' if s.fits else 'FAILS'}" + (f" ({s.limit})" if s.limit else ""))


def release_line(release: vllm_releases.VllmRelease, installed: str | None) -> str:
    """The release whose figures these are and, where another is installed here, that it differs."""
    line = f"models vLLM {release.version}"
    if installed is None:
        return line
    if minor_of(installed) == release.minor:
        return f"{line} (installed here)"
    return f"{line}; vLLM {installed} is installed here (--vllm picks the release modelled)"


def to_json(diag: Diagnosis, serve: serve_line.ServeArgs, installed: str | None) -> dict[str, Any]:
    d = diag.deployment
    line, fixes = verdict(diag, serve)
    return {
        "schema": SCHEMA,
        "release": {"modelled": d.release.version, "installed": installed},
        "serve": {"parser": serve.parser, "model": serve.model, "env": serve.env, "not_modelled": list(serve.ignored)},
        "deployment": {
            "model": d.model.name, "num_heads": d.model.num_heads, "tp": d.tp, "heads_per_rank": d.heads_per_rank,
            "topk": d.model.topk, "num_layers": d.model.num_layers, "gpu": d.gpu.name, "arch": d.gpu.arch,
            "num_sms": d.gpu.num_sms, "gpu_total_bytes": d.gpu.total_bytes,
            "max_num_batched_tokens": d.max_num_batched_tokens, "gpu_memory_utilization": d.gpu_memory_utilization,
            "max_model_len": d.max_model_len, "kv_cache_fp8": d.kv_fp8, "plugin_selected": d.plugin,
            "budget_bytes": d.budget_bytes, "max_num_seqs": d.max_num_seqs, "enforce_eager": d.enforce_eager,
            "num_speculative_tokens": d.num_speculative_tokens, "mtp_draft": d.mtp_draft,
            "decode_threshold": deployment.plugin_routes(d)[1],
        },
        "memory": {
            "weights_bytes": d.weights_per_rank, "activation_bytes": d.activation,
            "non_kv_bytes": d.non_kv_bytes(), "non_kv_parts": {name: part.bytes for name, part in d.non_kv_parts().items()},
            "step_reserve_bytes": d.step_reserve().bytes, "headroom_bytes": diag.headroom,
        },
        "worst_step": {"num_tokens": diag.worst_step.num_tokens, "stock_path": diag.stock_path, "paths": diag.paths},
        "warmup": warmup_json(diag.warmup),
        "stock": {**_verdict_json(diag.stock), "fits": diag.stock_fails_at is None, "fails_at": diag.stock_fails_at,
                  "kv_bytes": diag.stock_kv_bytes, "kv_tokens": diag.stock_kv_tokens,
                  "max_gpu_memory_utilization": diag.max_stock_util},
        "plugin": {**_verdict_json(diag.plugin), "kv_bytes": diag.plugin_kv_bytes, "kv_tokens": diag.plugin_kv_tokens,
                   "budget_bytes": d.budget_bytes, "budget_kv_tokens": diag.budget_kv_tokens,
                   "reserved_bytes": diag.reserved_bytes},
        "cost_profile": cost_profile(d, serve, installed),
        "int32_stride_tokens": diag.stride_tokens,
        "verdict": line,
        "fixes": fixes,
        "sources": diag.assumptions,
    }  # fmt: skip


def _tag(source: str) -> str:
    for tag in ("measured", "assumed", "fitted", "counted", "given"):
        if source.startswith(tag):
            return tag
    return source


def to_text(diag: Diagnosis, serve: serve_line.ServeArgs, installed: str | None) -> list[str]:
    d, a = diag.deployment, diag.assumptions
    reserve = d.step_reserve()
    paths = diag.paths
    mixed, sep = paths["mixed_batch"], paths["separate"]
    taken = diag.stock_path
    mask = paths["masked_mha_mask"]
    out = [
        f"deployment  {d.model.name}: {d.model.num_heads} heads / TP {d.tp} = {d.heads_per_rank} per rank, "
        f"{d.model.num_layers} layers; {d.gpu.name} ({d.gpu.arch}, {d.gpu.num_sms} SMs, {format_bytes(d.gpu.total_bytes)}, "
        f"{_tag(d.gpu.source)})",
        f"serve line  max_num_batched_tokens {d.max_num_batched_tokens:,}, gpu_memory_utilization {d.gpu_memory_utilization:.2f}, "
        f"max_model_len {d.max_model_len:,}, KV {'fp8' if d.kv_fp8 else 'bf16'}, max_num_seqs {d.max_num_seqs:,}, "
        f"{'eager' if d.enforce_eager else 'CUDA graphs'}, "
        + (f"speculative {serve.speculative_method} x {d.num_speculative_tokens}" if d.num_speculative_tokens else "no speculative decoding")
        + f", chunked prefill {'on' if serve.chunked_prefill else 'off'} ({serve.parser} parser)",
        *([f"            read, not modelled: {', '.join(serve.ignored)}"] if serve.ignored else []),
        f"release     {release_line(d.release, installed)}",
        "",
        f"worst step  {diag.worst_step.num_tokens:,} tokens; one call of them through each path (stock takes {taken}):",
        f"  mixed batch  {format_bytes(mixed['bytes'])}" + (" - past the int32 stride limit" if mixed["limit"] else ""),
        f"  separate     {format_bytes(sep['bytes'])} (padded q + out of the prefill kernel)",
        f"  indexer      {format_bytes(paths['indexer']['bytes'])} logits (vLLM's profile reserves it)",
        "  masked MHA   " + (f"mask {format_bytes(mask['bytes'])}" + ("" if mask["fits_128_mib"] else " > 128 MiB: falls back to sparse MQA")
                             if mask["applies"] else "n/a (sm100 with a bf16 KV cache only" +
                             ("" if mask["release_has_it"] else f"; vLLM {d.release.version} has none") + ")"),
        f"  int32 stride one call takes at most {diag.stride_tokens:,} tokens at {d.heads_per_rank} heads",
        "",
        f"memory      non-KV {format_bytes(d.non_kv_bytes())}: "
        + ", ".join(f"{name.replace('_', ' ')} {format_bytes(part.bytes)} ({_tag(part.source)})"
                    for name, part in d.non_kv_parts().items() if part.bytes or name == "cuda_graphs"),
        f"            free for unreserved scratch: {format_bytes(diag.headroom)} = (1 - {d.gpu_memory_utilization:.2f}) x total "
        f"- {format_bytes(reserve.bytes)} the step holds ({reserve.source})",
        f"start-up    {warmup_text(diag)}",
        f"stock       worst step {format_bytes(diag.stock.peak_bytes)}: {'fits' if diag.stock.fits else 'FAILS'}"
        + (f" ({diag.stock.limit})" if diag.stock.limit else "")
        + f"; KV cache {format_bytes(diag.stock_kv_bytes)} = {diag.stock_kv_tokens:,} tokens"
        + (f"; fits up to gpu_memory_utilization {diag.max_stock_util:.2f}" if diag.max_stock_util is not None else "; no utilization fits"),
        f"plugin      budget {format_bytes(d.budget_bytes)}, worst step {format_bytes(diag.plugin.peak_bytes)} in {diag.plugin.launches} launches: "
        f"{'fits' if diag.plugin.fits else 'FAILS'}; KV cache {format_bytes(diag.plugin_kv_bytes)} = {diag.plugin_kv_tokens:,} tokens "
        f"({format_bytes(diag.reserved_bytes)} held back from it: {diag.reserved_kv_tokens:,} tokens)",
        f"profile     {cost_profile(d, serve, installed)['text']}",
        "",
    ]
    line, fixes = verdict(diag, serve)
    out.append(f"verdict     {line}")
    out += [f"            {fix}" for fix in fixes]
    return out
