"""The flag matrix (docs/e2e.md): the ``vllm serve`` configurations ``run_serve.py --phase matrix`` starts,
on the axes operators of DeepSeek-V3.2 and GLM-5 set."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Union

from run_cases import model_variant
from serve_proc import HERE, ServerSpec

MODELS = {"v32": HERE / "tiny-deepseek-v32", "glm5": HERE / "tiny-glm5"}
MAX_MODEL_LEN = 70000
CHUNKED_MNBT = 32768  # --max-num-batched-tokens with chunked prefill (the serving driver's)
PROBE_MB = 64  # the budget "min" starts at: the plugin refuses it naming the minimum, or it is the minimum
Budget = Union[int, str]  # MiB, or "min"

AXES: dict[str, tuple[Any, ...]] = {
    "model": ("v32", "glm5"),
    "mtp": (0, 1, 2),
    "max_num_seqs": (16, 128, 1024),
    "budget": ("min", 512, 1024, 4096),
    "cuda_graphs": (True, False),
    "chunked_prefill": (True, False),
    "prefix_caching": (False, True),
}
# two configurations that once killed the engine, kept with CUDA graphs (their padded decode batches)
REQUIRED_PAIRS: tuple[dict[str, Any], ...] = (
    {"mtp": 1, "max_num_seqs": 128, "cuda_graphs": True},
    {"budget": 512, "max_num_seqs": 1024, "cuda_graphs": True},
)


@dataclass(frozen=True)
class Config:

    name: str
    model: str
    mtp: int
    max_num_seqs: int
    budget: Budget
    cuda_graphs: bool = True
    chunked_prefill: bool = True
    prefix_caching: bool = False

    def values(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "name"}


DESIGN: tuple[Config, ...] = (
    Config("s1", "v32", mtp=1, max_num_seqs=128, budget=1024),  # the first of those deaths (MTP 1 x 128)
    Config("s2", "v32", mtp=0, max_num_seqs=1024, budget=512),  # its second (512 MiB x 1024)
    Config("s3", "v32", mtp=2, max_num_seqs=16, budget="min", chunked_prefill=False, prefix_caching=True),
    Config("s4", "v32", mtp=0, max_num_seqs=128, budget=4096, cuda_graphs=False),
    Config("s5", "glm5", mtp=1, max_num_seqs=1024, budget="min"),
    Config("s6", "glm5", mtp=2, max_num_seqs=16, budget=1024, cuda_graphs=False, chunked_prefill=False,
           prefix_caching=True),
)


def coverage_gaps(design: tuple[Config, ...] | list[Config]) -> list[str]:
    """What ``design`` misses: each axis value no server has, each required pair no server has."""
    gaps = [f"{axis}={value!r}" for axis, values in AXES.items() for value in values
            if not any(c.values()[axis] == value for c in design)]
    for pair in REQUIRED_PAIRS:
        if not any(all(c.values()[k] == v for k, v in pair.items()) for c in design):
            gaps.append(" x ".join(f"{k}={v!r}" for k, v in pair.items()))
    return gaps


def check_design(design: tuple[Config, ...] | list[Config]) -> list[str]:
    """Values outside the axes and repeated names: a design the driver cannot run."""
    problems = [f"{c.name}: {axis}={value!r} is not one of {AXES[axis]}" for c in design
                for axis, value in c.values().items() if value not in AXES[axis]]
    names = [c.name for c in design]
    problems += [f"server name {n} used twice" for n in sorted({n for n in names if names.count(n) > 1})]
    return problems


def mnbt(config: Config) -> int:
    """With chunked prefill off, vLLM needs --max-num-batched-tokens at least max_model_len."""
    return CHUNKED_MNBT if config.chunked_prefill else MAX_MODEL_LEN


def spec(config: Config, engine: str, util: float, port: int, scratch_mb: int | None) -> ServerSpec:
    """``config``'s server: the plugin with budget ``scratch_mb`` (stock: none), or its stock twin."""
    spec_decode = json.dumps({"method": "mtp", "num_speculative_tokens": config.mtp})
    extra = ("--max-num-seqs", str(config.max_num_seqs), *(["--speculative-config", spec_decode] if config.mtp else []),
             *([] if config.cuda_graphs else ["--enforce-eager"]),
             *([] if config.chunked_prefill else ["--no-enable-chunked-prefill"]))
    return ServerSpec(engine, util, port, mnbt(config), max_model_len=MAX_MODEL_LEN,
                      scratch_mb=scratch_mb if engine == "plugin" else None, prefix_caching=config.prefix_caching,
                      extra_args=extra)


# chunked prefill off: vLLM profiles a step of 70,000 tokens, which left the engine 6.5 GiB short of
# any KV cache at 0.09 on the H200
UNCHUNKED_EXTRA = 0.07


def util_for(config: Config, base: float, total_gib: float = 140.0) -> float:
    """``base``, plus a numeric budget's share of the GPU (rounded up to 0.01: a large budget must
    not eat the KV cache the 64K case needs), plus UNCHUNKED_EXTRA with chunked prefill off."""
    extra = UNCHUNKED_EXTRA if not config.chunked_prefill else 0.0
    if isinstance(config.budget, int):
        extra += -(-config.budget * 100 // int(total_gib * 1024)) / 100
    return round(base + extra, 2)


def model_source(config: Config, where: Path) -> Path:
    """The model's folder, or (MTP) a copy under ``where`` with one MTP layer."""
    return model_variant(MODELS[config.model], where, mtp_layers=1 if config.mtp else None)


def describe(config: Config) -> str:
    return ", ".join([config.model, f"MTP {config.mtp}" if config.mtp else "no MTP",
                      f"--max-num-seqs {config.max_num_seqs}",
                      f"budget {config.budget}" + ("" if config.budget == "min" else " MiB"),
                      "CUDA graphs" if config.cuda_graphs else "--enforce-eager",
                      *([] if config.chunked_prefill else ["--no-enable-chunked-prefill"]),
                      *(["--enable-prefix-caching"] if config.prefix_caching else [])])
