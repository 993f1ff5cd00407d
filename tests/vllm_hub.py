"""An offline Hugging Face hub for vLLM's own sparse-MLA tests.

vLLM's ``tests/v1/attention/test_sparse_mla_backends.py`` builds its engine configuration with
``create_vllm_config(model_name=...)``, a ``ModelConfig`` that reads the named model's
``config.json`` from the hub. The GPU machine reaches no network, so every test that does so fails
there, with stock's classes as with the backend's. These tests read only the model's kind and
shape from it (and then replace the attention dimensions with their own), so a hub cache holding
a ``config.json`` of each named model's shape, written by transformers' own config class, serves
them: ``offline_hub(root)`` writes it and returns the environment that makes vLLM read it
(``HF_HUB_OFFLINE=1``, ``HF_HUB_CACHE``). No weights and no tokenizer are written; the tests load
neither.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

# hub id -> (transformers model_type, architectures, config values): each model's published shape
# where the tests could read it (heads, MLA ranks and head sizes, context length); the rest are the
# config class's defaults.
STAND_INS: dict[str, tuple[str, list[str], dict[str, Any]]] = {
    "deepseek-ai/DeepSeek-V2-Lite-Chat": ("deepseek_v2", ["DeepseekV2ForCausalLM"], dict(
        hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=163840, vocab_size=102400, n_routed_experts=64, moe_intermediate_size=1408,
        intermediate_size=10944, torch_dtype="bfloat16")),
    "Qwen/Qwen3.5-0.8B": ("qwen3_5", ["Qwen3_5ForConditionalGeneration"], dict(torch_dtype="bfloat16")),
}
REVISION = "0" * 40  # the one snapshot each stand-in has; refs/main names it


def hub_ids_in(test_file: pathlib.Path) -> set[str]:
    """The hub ids a vLLM test file builds configurations of (``model_name="owner/name"``)."""
    return set(re.findall(r'model_name\s*=\s*"([^"/]+/[^"]+)"', test_file.read_text()))


def offline_hub(root: pathlib.Path) -> dict[str, str]:
    """A hub cache under ``root`` with a stand-in ``config.json`` for every id in ``STAND_INS``;
    the environment variables that make vLLM (huggingface_hub, transformers) read it offline."""
    from transformers import AutoConfig

    for hub_id, (model_type, architectures, values) in STAND_INS.items():
        repo = root / ("models--" + hub_id.replace("/", "--"))
        snapshot = repo / "snapshots" / REVISION
        if not (snapshot / "config.json").is_file():
            snapshot.mkdir(parents=True, exist_ok=True)
            config = AutoConfig.for_model(model_type, **values)
            config.architectures = architectures
            config.save_pretrained(snapshot)
            (repo / "refs").mkdir(exist_ok=True)
            (repo / "refs" / "main").write_text(REVISION)
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root)}
