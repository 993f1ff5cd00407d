"""Model presets: heads per rank for a model at a tensor-parallel size, and
the FP8 path vLLM takes there (mixed batch below 32 heads per rank, the rule of
every release :mod:`.vllm_releases` describes)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mla_planner import MIN_HEADS_FOR_BF16_PREFILL, step_mode

from . import vllm_releases


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    num_heads: int
    tensor_parallel: tuple[int, ...]
    topk: int = 2048

    def heads_per_rank(self, tp: int) -> int:
        if tp not in self.tensor_parallel:
            sizes = ", ".join(map(str, self.tensor_parallel))
            raise ValueError(f"preset {self.name} supports --tp {sizes}, not {tp}")
        return self.num_heads // tp


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("deepseek-v3.2", "DeepSeek-V3.2: 128 heads, topk 2048, kv_lora 512 + rope 64", 128, (1, 2, 4, 8)),
        Preset("glm-5", "GLM-5-class: 64 heads, topk 2048, kv_lora 512 + rope 64", 64, (4, 8)),
    )
}
DEFAULT_PRESET = "deepseek-v3.2"
DEFAULT_TP = 8


def lookup(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(PRESETS)
        raise ValueError(f"unknown preset {name!r}; known presets: {known}") from None


def vllm_path(num_heads: int, kv_dtype: str, *, short: bool = False) -> str:
    """The attention path vLLM's FLASHMLA_SPARSE backend takes (every supported release's rule)."""
    mode = step_mode(num_heads, kv_dtype=kv_dtype)
    if short:
        return {"bf16": "bf16 sparse prefill kernel", "mixed_batch": "mixed batch"}.get(mode, "separate prefill/decode")
    if mode == "bf16":
        return "bf16: every sparse token through the BF16 sparse prefill kernel"
    if mode == "mixed_batch":
        return (
            f"mixed batch ({num_heads} heads per rank < {MIN_HEADS_FOR_BF16_PREFILL}): "
            "every sparse token through the FP8 sparse decode kernel"
        )
    return (
        f"separate prefill/decode ({num_heads} heads per rank >= {MIN_HEADS_FOR_BF16_PREFILL}): "
        "decodes through the FP8 decode kernel, prefills gathered to BF16 for the prefill kernel"
    )


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("presets", help="list model presets and the vLLM path each TP size takes")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for preset in PRESETS.values():
        print(f"--preset {preset.name}: {preset.description}")
        for tp in preset.tensor_parallel:
            heads = preset.heads_per_rank(tp)
            print(f"  --tp {tp}: {heads:3d} heads per rank; FP8 KV takes vLLM's {vllm_path(heads, 'fp8', short=True)} path")
    print(
        f"vLLM {vllm_releases.names(list(vllm_releases.RELEASES.values()))} run FP8 steps in mixed batch below "
        f"{MIN_HEADS_FOR_BF16_PREFILL} heads per rank, "
        "separate prefill/decode otherwise.\nAnything else: --heads N (query heads per rank) and --topk."
    )
    return 0
