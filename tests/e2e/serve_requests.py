"""Requests to a server as plain HTTP POSTs: run_cases' boundary cases and the flag matrix's chat burst.

A case's prompts are token ids (``prompt``: a list of ints, as vLLM's completions endpoint takes
them), drawn as run_cases draws them, so the in-process runs and these ask the same. They are sent
at once, each on its own thread, a few milliseconds apart in the case's order, so the server
receives them as one submission (case 3's 32K blocker first). Throughput is not measured here:
that is ``vllm bench serve``'s job (serve_bench.py).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from run_cases import CASE_MAX_TOKENS, CASE_PROMPTS, MAX_TOKENS, TOKEN_RANGE, case_seed, token_prompt
from serve_proc import SERVED_NAME, post_json

STAGGER_S = 0.02
CHAT_PREFIX, CHAT_LEN, CHAT_MAX_TOKENS, CHAT_SEED = 256, (300, 1100), (16, 256), 2900


def case_prompts(case: str) -> list[list[int]]:
    rng = random.Random(case_seed(case))
    return [token_prompt(n, rng)["prompt_token_ids"] for n in CASE_PROMPTS[case]]


def chat_prompts(n: int, seed: int = CHAT_SEED) -> list[tuple[list[int], int]]:
    """``n`` (token ids, max_tokens): a shared 256-token prefix (a system prompt: prefix caching's
    hits), then each its own tokens to 300-1,100 in all; 16-256 tokens out. The same for every server."""
    rng = random.Random(seed)
    prefix = [rng.randrange(*TOKEN_RANGE) for _ in range(CHAT_PREFIX)]
    prompts = []
    for _ in range(n):
        length = rng.randint(*CHAT_LEN)
        ids = prefix + [rng.randrange(*TOKEN_RANGE) for _ in range(length - CHAT_PREFIX)]
        prompts.append((ids, rng.randint(*CHAT_MAX_TOKENS)))
    return prompts


def completion_body(ids: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy, exactly ``max_tokens`` tokens back (ignore_eos is vLLM's extension of the API)."""
    return {"model": SERVED_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def one_request(url: str, ids: list[int], max_tokens: int, delay_s: float, timeout_s: float) -> dict[str, Any]:
    time.sleep(delay_s)
    t0 = time.perf_counter()
    status, body, error = post_json(url + "/v1/completions", completion_body(ids, max_tokens), timeout_s)
    usage = (body or {}).get("usage") or {}
    tokens = usage.get("completion_tokens")
    ok = status == 200 and tokens == max_tokens
    if status == 200 and not ok:
        error = f"{tokens} tokens back, {max_tokens} asked"
    return {"prompt_len": len(ids), "status": status, "ok": ok, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": tokens, "elapsed_s": time.perf_counter() - t0, "error": error}


def send_all(url: str, prompts: list[tuple[list[int], int]], stagger_s: float, timeout_s: float) -> dict[str, Any]:
    """Every prompt at once, each on its own thread (``stagger_s`` apart), every answer awaited (or
    its error recorded): counts, and the first few errors."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [pool.submit(one_request, url, ids, max_tokens, i * stagger_s, timeout_s)
                   for i, (ids, max_tokens) in enumerate(prompts)]
        requests = [f.result() for f in futures]
    errors: list[str] = []
    for r in requests:
        if not r["ok"] and str(r["error"]) not in errors and len(errors) < 5:
            errors.append(str(r["error"]))
    ok = sum(r["ok"] for r in requests)
    return {"status": "ok" if ok == len(requests) else "error", "error": errors[0] if errors else None,
            "errors": errors, "n_requests": len(requests), "requests_ok": ok, "elapsed_s": time.perf_counter() - t0,
            "prompt_tokens": sum(len(ids) for ids, _ in prompts), "max_tokens": sum(m for _, m in prompts),
            "requests": requests}


def run_case(url: str, case: str, timeout_s: float) -> dict[str, Any]:
    """One of run_cases' cases: its prompts as one submission."""
    max_tokens = CASE_MAX_TOKENS.get(case, MAX_TOKENS)
    result = send_all(url, [(ids, max_tokens) for ids in case_prompts(case)], STAGGER_S, timeout_s)
    return {**result, "prompt_lens": CASE_PROMPTS[case], "max_tokens": max_tokens}


def chat_burst(url: str, n: int, timeout_s: float) -> dict[str, Any]:
    """``n`` chat completions at once (``chat_prompts``); the requests themselves are not kept."""
    result = send_all(url, chat_prompts(n), 0.0, timeout_s)
    del result["requests"]
    return result
