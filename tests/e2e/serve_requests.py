"""Boundary requests against a server: run_cases' exact prompt shapes as plain HTTP POSTs.

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

from run_cases import CASE_MAX_TOKENS, CASE_PROMPTS, MAX_TOKENS, case_seed, token_prompt
from serve_proc import SERVED_NAME, post_json

STAGGER_S = 0.02


def case_prompts(case: str) -> list[list[int]]:
    rng = random.Random(case_seed(case))
    return [token_prompt(n, rng)["prompt_token_ids"] for n in CASE_PROMPTS[case]]


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


def run_case(url: str, case: str, timeout_s: float) -> dict[str, Any]:
    """One case: every prompt sent, every answer awaited (or its error recorded)."""
    prompts = case_prompts(case)
    max_tokens = CASE_MAX_TOKENS.get(case, MAX_TOKENS)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [pool.submit(one_request, url, ids, max_tokens, i * STAGGER_S, timeout_s)
                   for i, ids in enumerate(prompts)]
        requests = [f.result() for f in futures]
    failed = [r for r in requests if not r["ok"]]
    return {"status": "error" if failed else "ok", "error": failed[0]["error"] if failed else None,
            "elapsed_s": time.perf_counter() - t0, "prompt_lens": CASE_PROMPTS[case],
            "prompt_tokens": sum(CASE_PROMPTS[case]), "max_tokens": max_tokens,
            "requests_ok": len(requests) - len(failed), "requests": requests}
