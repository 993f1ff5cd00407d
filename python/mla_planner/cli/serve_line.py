"""A `vllm serve` command line, read the way vLLM reads it.

Where vLLM is importable its own serve parser reads the line, so every flag of that version is
understood, also on a machine without a GPU (where vLLM cannot infer a device type to build it, it
is built as for a CPU: the parser's defaults, not a platform, are what is read); otherwise a
built-in subset: the flags that decide the worst step's memory, every other flag passed over
(``--flag value``, ``--flag=value``, or a switch). Either way the flags given that the doctor does
not model are named (:attr:`ServeArgs.ignored`). Leading `NAME=value` words are the command's
environment (MLA_PLANNER_SCRATCH_MB sets the plugin's budget).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import re
import shlex
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from .config import CliError

# CacheConfig.gpu_memory_utilization's default, the same in every release vllm_releases describes; the
# batch defaults, which depend on the GPU and the release, are the release's (VllmRelease.default_batch).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
MODELLED_FLAGS = ("--model", "--tensor-parallel-size", "-tp", "--max-num-batched-tokens", "--gpu-memory-utilization",
                  "--max-model-len", "--kv-cache-dtype", "--block-size", "--attention-backend", "--max-num-seqs",
                  "--enforce-eager", "--speculative-config", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
                  "--enable-flashinfer-autotune", "--no-enable-flashinfer-autotune")
"""The flags whose values the doctor's memory model reads."""
MTP_METHODS = ("mtp", "deepseek_mtp", "glm4_moe_mtp")
"""``--speculative-config`` methods whose draft is the model's own MTP layer."""
_SWITCH_PREFIXES = ("--no-", "--enable-", "--disable-")
_SWITCHES = frozenset({"--trust-remote-code", "--enforce-eager", "--async-scheduling", "--headless",
                       "--skip-tokenizer-init", "--use-tqdm-on-load", "--fully-sharded-loras", "--return-tokens-as-token-ids"})
"""vLLM flags that take no value, for the built-in parser to pass over: vLLM's boolean options are
``--enable-...`` / ``--disable-...`` / ``--no-...`` or one of these."""


@dataclass(frozen=True)
class ServeArgs:
    model: str | None
    tensor_parallel_size: int
    max_num_batched_tokens: int | None  # None: vLLM's default for the GPU
    gpu_memory_utilization: float
    max_model_len: int | None
    kv_cache_dtype: str
    block_size: int | None
    attention_backend: str | None
    max_num_seqs: int | None
    enforce_eager: bool = False
    speculative_config: dict[str, Any] | None = None
    """``--speculative-config`` as vLLM reads it (JSON)."""
    enable_chunked_prefill: bool | None = None
    """``--[no-]enable-chunked-prefill`` (``None``: vLLM's default, on for these models)."""
    enable_flashinfer_autotune: bool | None = None
    """``--[no-]enable-flashinfer-autotune`` (``None``: vLLM's default, on except at ``-O0``)."""
    env: dict[str, str] = field(default_factory=dict)
    parser: str = "built-in"
    ignored: tuple[str, ...] = ()
    """Flags the line gives that the doctor does not model (``--port``, ``--enforce-eager``, ...)."""

    @property
    def kv_fp8(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

    @property
    def num_speculative_tokens(self) -> int:
        return int((self.speculative_config or {}).get("num_speculative_tokens") or 0)

    @property
    def speculative_method(self) -> str | None:
        method = (self.speculative_config or {}).get("method")
        return None if method is None else str(method)

    @property
    def mtp_draft(self) -> bool:
        return self.num_speculative_tokens > 0 and (self.speculative_method or "").lower() in MTP_METHODS

    @property
    def parallel_drafting(self) -> bool:
        return bool((self.speculative_config or {}).get("parallel_drafting"))

    @property
    def chunked_prefill(self) -> bool:
        return self.enable_chunked_prefill is not False

    @property
    def flashinfer_autotune(self) -> bool:
        return self.enable_flashinfer_autotune is not False

    @property
    def v2_runner_env(self) -> bool | None:
        """``VLLM_USE_V2_MODEL_RUNNER`` as vLLM reads it (an integer, nonzero for on), ``None`` where unset."""
        value = self.env.get("VLLM_USE_V2_MODEL_RUNNER")
        if value is None:
            return None
        try:
            return bool(int(value))
        except ValueError:
            raise CliError(f"the serve line: VLLM_USE_V2_MODEL_RUNNER={value} is not an integer (vLLM reads 0 or 1)") from None


def _human_int(text: str) -> int:
    """vLLM's way of writing sizes: 32768, 32k (x1000), 32K (x1024), 1m, 1M."""
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (e.g. 32768 or 32K)")
    unit = m.group(2)
    scale = {"": 1, "k": 10**3, "K": 1 << 10, "m": 10**6, "M": 1 << 20, "g": 10**9, "G": 1 << 30}[unit]
    return int(m.group(1)) * scale


class _Refusing(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"the serve line: {message}")


def _builtin_parser() -> argparse.ArgumentParser:
    p = _Refusing(prog="vllm serve", add_help=False, allow_abbrev=False)
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=_human_int)
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION)
    p.add_argument("--max-model-len", type=_human_int)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--block-size", type=int)
    p.add_argument("--attention-backend")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--speculative-config", type=_json_object)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enable-flashinfer-autotune", action=argparse.BooleanOptionalAction, default=None)
    return p


def _json_object(text: str) -> dict[str, Any]:
    """``--speculative-config``'s JSON, as vLLM reads it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


# Where `vllm serve`'s parser is built, in the order tried: entrypoints.common where the installed
# release has it, else entrypoints.openai.
_VLLM_PARSER_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.cli_args")


def _vllm_namespace(argv: list[str]) -> argparse.Namespace | None:
    """vLLM's own serve parser, or None where vLLM cannot be imported or cannot build its parser
    here (vLLM infers a device type while building it, and fails on a machine with none). vLLM
    logs to stdout (``VLLM_LOGGING_STREAM``'s default), from its import on (Triton's INFO lines):
    everything it prints while it is imported and parses goes to stderr, so stdout holds the
    command's report alone (``doctor --json | jq``)."""
    with contextlib.redirect_stdout(sys.stderr):
        return _vllm_parse(argv)


@contextlib.contextmanager
def _a_device_type() -> Iterator[None]:
    """vLLM's platform with a device type while its parser is built and parses: without a GPU it is
    vLLM's ``UnspecifiedPlatform``, whose empty device type makes the parser's ``DeviceConfig``
    default raise "Failed to infer device type" (vLLM's ``config/device.py``). Parsing reads
    flags and defaults; nothing runs on the device."""
    platform: Any = getattr(importlib.import_module("vllm.platforms"), "current_platform")
    cls = type(platform)
    if platform.device_type:
        yield
        return
    found = cls.device_type
    cls.device_type = "cpu"
    try:
        yield
    finally:
        cls.device_type = found


def _vllm_parse(argv: list[str]) -> argparse.Namespace | None:
    try:
        module = next(filter(None, map(_import_or_none, _VLLM_PARSER_MODULES)), None)
        if module is None:
            return None
        flexible = importlib.import_module("vllm.utils.argparse_utils").FlexibleArgumentParser
        with _a_device_type():
            parser = module.make_arg_parser(flexible(prog="vllm serve"))
    except Exception:
        return None

    def refuse(message: str) -> NoReturn:
        raise CliError(f"the serve line (vLLM's parser): {message}")

    setattr(parser, "error", refuse)  # one line, not argparse's usage block and exit
    try:
        with _a_device_type():
            namespace: argparse.Namespace = parser.parse_args(argv)
    except SystemExit:  # --help and the like
        raise CliError("the serve line: vLLM's parser exited (--help is not a deployment)") from None
    except CliError:
        raise
    except Exception as e:  # the parser's own checks of values
        raise CliError(f"the serve line (vLLM's parser): {e}") from None
    return namespace


def _import_or_none(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _backend_name(ns: argparse.Namespace) -> str | None:
    backend: Any = getattr(ns, "attention_backend", None)
    config: Any = getattr(ns, "attention_config", None)
    if backend is None and config is not None:
        backend = config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)
    if backend is None:
        return None
    return str(getattr(backend, "name", backend))


def _flag_name(word: str) -> str | None:
    """``--port`` of ``--port`` or ``--port=8000``; ``None`` for a value or the model."""
    if not word.startswith("-") or re.fullmatch(r"-\d.*", word):
        return None
    return word.split("=", 1)[0]


def unmodelled(argv: Sequence[str]) -> tuple[str, ...]:
    """The flags of ``argv`` the doctor does not model, in order, once each."""
    names = (_flag_name(w) for w in argv)
    return tuple(dict.fromkeys(n for n in names if n is not None and n not in MODELLED_FLAGS))


def without_unmodelled(argv: Sequence[str]) -> list[str]:
    """``argv`` less every flag the built-in parser does not know, with its value: the next word,
    unless the flag holds it (``=``), is a switch, or the next word is a flag."""
    kept: list[str] = []
    i = 0
    while i < len(argv):
        word, name = argv[i], _flag_name(argv[i])
        if name is None or name in MODELLED_FLAGS:
            kept.append(word)
            i += 1
            continue
        switch = "=" in word or name in _SWITCHES or name.startswith(_SWITCH_PREFIXES)
        i += 1 if switch or i + 1 == len(argv) or _flag_name(argv[i + 1]) is not None else 2
    return kept


def split_line(words: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The environment words and the arguments after `vllm serve` (one quoted string or words)."""
    argv = shlex.split(words[0]) if len(words) == 1 else list(words)
    env = {}
    while argv and _ENV_WORD.match(argv[0]):
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    if argv[:2] == ["vllm", "serve"]:
        argv = argv[2:]
    elif argv[:1] == ["serve"]:
        argv = argv[1:]
    elif argv and argv[0] == "vllm":
        raise CliError(f"the serve line runs `vllm {' '.join(argv[1:2])}`, not `vllm serve`")
    return env, argv


def parse(words: Sequence[str], *, use_vllm: bool = True) -> ServeArgs:
    if not words:
        raise CliError("give the serve line after --, e.g. -- vllm serve deepseek-ai/DeepSeek-V3.2 -tp 8")
    env, argv = split_line(words)
    ns = _vllm_namespace(argv) if use_vllm else None
    parser = "vllm"
    if ns is None:
        ns, parser = _builtin_parser().parse_args(without_unmodelled(argv)), "built-in"
    util = float(ns.gpu_memory_utilization if ns.gpu_memory_utilization is not None else DEFAULT_GPU_MEMORY_UTILIZATION)
    if not 0 < util <= 1:
        raise CliError(f"the serve line: --gpu-memory-utilization {util} is not in (0, 1]")
    tp = int(ns.tensor_parallel_size or 1)
    if tp < 1:
        raise CliError(f"the serve line: --tensor-parallel-size {tp} must be at least 1")
    for name in ("max_num_batched_tokens", "max_model_len", "max_num_seqs"):
        value = getattr(ns, name, None)
        if value is not None and value < 1:
            raise CliError(f"the serve line: --{name.replace('_', '-')} {value} must be at least 1")
    return ServeArgs(
        model=ns.model_tag or getattr(ns, "model", None),
        tensor_parallel_size=tp,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        gpu_memory_utilization=util,
        max_model_len=ns.max_model_len,
        kv_cache_dtype=str(ns.kv_cache_dtype or "auto"),
        block_size=ns.block_size,
        attention_backend=_backend_name(ns),
        max_num_seqs=ns.max_num_seqs,
        enforce_eager=bool(getattr(ns, "enforce_eager", False)),
        speculative_config=_speculative_config(getattr(ns, "speculative_config", None)),
        enable_chunked_prefill=getattr(ns, "enable_chunked_prefill", None),
        enable_flashinfer_autotune=getattr(ns, "enable_flashinfer_autotune", None),
        env=env,
        parser=parser,
        ignored=unmodelled(argv),
    )


def _speculative_config(value: Any) -> dict[str, Any] | None:
    """``--speculative-config`` from either parser: a dict (vLLM's parser parses the JSON), or its
    JSON text."""
    if value is None or isinstance(value, dict):
        return value
    try:
        return _json_object(str(value))
    except argparse.ArgumentTypeError as e:
        raise CliError(f"the serve line: --speculative-config: {e}") from None
