"""A tokenizer for the tiny model, made offline: ``vllm serve`` and ``vllm bench serve`` need one.

The tiny model (``tiny-deepseek-v32``, dummy weights) has none, and the GPU machine cannot download
one. A word-level vocabulary of exactly the model's ``vocab_size`` does: token ``i`` is the word
``w<i>`` (three special tokens first: ``<s>`` 0 and ``</s>`` 1 as the config's bos/eos, ``<unk>`` 2),
words split on whitespace and decoded by joining with spaces. Every id then decodes to one word and
re-encodes to itself, so vLLM's random dataset (which samples ids, decodes them to text and
re-encodes it) gets exactly the prompt lengths it asks for, and the server counts the same tokens.
No post-processor adds a BOS, so a prompt of N words is N tokens on both sides.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from run_cases import MODEL_DIR

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")  # ids 0, 1, 2: the config's bos_token_id and eos_token_id
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def word(token_id: int) -> str:
    return SPECIAL_TOKENS[token_id] if token_id < len(SPECIAL_TOKENS) else f"w{token_id}"


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.json (``tokenizers``' WordLevel) and what transformers' AutoTokenizer reads beside it.

    The special tokens are named in tokenizer_config.json only: transformers registers them (so the
    random dataset leaves them out), and they are vocabulary words, so ``len(tokenizer)`` stays
    ``vocab_size``. (vLLM's DeepSeek-V3.2 tokenizer wrapper, which the server picks for this
    architecture, counts them twice in ``len``: vocab_size + 3. Harmless: vLLM checks prompt ids
    against the model's vocab_size.)"""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # "w5 ." style clean-ups would change the text
        "model_max_length": 1 << 20,  # no truncation warnings at 64K-token prompts
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=1) + "\n")


def served_model_dir(where: Path, model: Path = MODEL_DIR) -> Path:
    """A copy of ``model`` (its config.json) with the tokenizer, under ``where``: what the servers load
    (``--load-format dummy``: no weights) and the bench client's ``--tokenizer``."""
    folder = where / model.name
    config = json.loads((model / "config.json").read_text())
    if folder.is_dir():  # made by an earlier call: reuse it if it is whole and of this config
        if all((folder / f).is_file() for f in TOKENIZER_FILES) and \
                json.loads((folder / "config.json").read_text()) == config:
            return folder
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    shutil.copy(model / "config.json", folder / "config.json")
    write_tokenizer(folder, int(config["vocab_size"]))
    return folder


def check_tokenizer(folder: Path, sample_len: int = 4096, seed: int = 0) -> dict[str, Any]:
    """Loads ``folder`` with transformers' AutoTokenizer, as vLLM does, and checks its size and a
    round trip of random ids (what the random dataset does). Raises AssertionError on a mismatch."""
    import random

    from transformers import AutoTokenizer

    vocab_size = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    tokenizer: Any = AutoTokenizer.from_pretrained(str(folder))
    rng = random.Random(seed)
    ids = [rng.randrange(len(SPECIAL_TOKENS), vocab_size) for _ in range(sample_len)]
    text = tokenizer.decode(ids)
    back = tokenizer.encode(text, add_special_tokens=False)
    with_specials = tokenizer.encode(text)  # what a server's completions endpoint does
    facts = {"class": type(tokenizer).__name__, "len": len(tokenizer), "vocab_size": tokenizer.vocab_size,
             "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
             "all_special_ids": sorted(tokenizer.all_special_ids), "round_trip": back == ids,
             "adds_special_tokens": len(with_specials) - len(back)}
    assert facts["len"] == vocab_size and facts["vocab_size"] == vocab_size, facts
    assert facts["round_trip"] and max(back) < vocab_size, facts
    assert facts["adds_special_tokens"] == 0, facts
    assert (facts["bos_token_id"], facts["eos_token_id"]) == (0, 1), facts
    return facts
