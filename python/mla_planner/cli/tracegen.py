"""A seeded workload generator: requests arrive, a simple model of vLLM's
scheduler packs them into steps, and each step is one trace line.

The scheduler: a token budget per step (`max_num_batched_tokens`); running
decodes first (one token each), then running prompts continue their chunked
prefill, then waiting requests are admitted first-come first-served while
budget and `max_num_seqs` allow. A prefill chunk carries as context every
token of its request already in the KV cache (prefix-cache hit included).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from .steps import Step

DEFAULT_BATCHED_TOKENS = (8192, 16384, 32768, 65536)


@dataclass(frozen=True)
class Mix:
    """What arrives, per scheduler step. Documented in docs/cli.md."""

    # Chat turns: a new message on top of a prefix-cached conversation.
    chat_per_step: float = 0.08
    chat_prompt_median: int = 800
    chat_prompt_max: int = 16_384
    chat_followup_share: float = 0.6  # turns whose earlier conversation is cached
    chat_cached_max: int = 16_384
    chat_output_median: int = 200
    chat_output_max: int = 2_000
    # Long documents: one prompt, log-uniform in length, short answer.
    doc_per_step: float = 0.03
    doc_prompt_min: int = 8_192
    doc_prompt_max: int = 131_072
    doc_output_min: int = 64
    doc_output_max: int = 512
    # The server.
    max_num_seqs: int = 32
    max_waiting: int = 64  # clients back off beyond this queue length


@dataclass
class _Request:
    prompt: int  # tokens the request must have in the KV cache before decoding
    computed: int  # tokens in the KV cache now
    output: int  # tokens to generate
    generated: int = 0

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt


class _Arrivals:
    def __init__(self, mix: Mix, seed: int) -> None:
        self.mix = mix
        self.rng = random.Random(seed)

    def _poisson(self, rate: float) -> int:
        # Knuth's method: fine for the small per-step rates used here.
        limit, k, p = math.exp(-rate), 0, self.rng.random()
        while p > limit:
            k += 1
            p *= self.rng.random()
        return k

    def _lognormal(self, median: int, cap: int, floor: int = 16) -> int:
        return max(floor, min(cap, round(self.rng.lognormvariate(math.log(median), 1.0))))

    def _chat(self) -> _Request:
        m, rng = self.mix, self.rng
        cached = rng.randint(1_000, m.chat_cached_max) if rng.random() < m.chat_followup_share else 0
        new = self._lognormal(m.chat_prompt_median, m.chat_prompt_max)
        return _Request(cached + new, cached, self._lognormal(m.chat_output_median, m.chat_output_max))

    def _document(self) -> _Request:
        m, rng = self.mix, self.rng
        prompt = round(math.exp(rng.uniform(math.log(m.doc_prompt_min), math.log(m.doc_prompt_max))))
        return _Request(prompt, 0, rng.randint(m.doc_output_min, m.doc_output_max))

    def step(self) -> list[_Request]:
        new = [self._chat() for _ in range(self._poisson(self.mix.chat_per_step))]
        new += [self._document() for _ in range(self._poisson(self.mix.doc_per_step))]
        self.rng.shuffle(new)
        return new


def generate(num_steps: int, seed: int, batched_tokens: tuple[int, ...], mix: Mix = Mix()) -> Iterator[Step]:
    """`num_steps` steps; the run is cut into equal phases, one per
    `max_num_batched_tokens` value, in the order given."""
    arrivals = _Arrivals(mix, seed)
    waiting: deque[_Request] = deque()
    running: list[_Request] = []
    for i in range(num_steps):
        budget = batched_tokens[i * len(batched_tokens) // num_steps]
        for r in arrivals.step():
            if len(waiting) < mix.max_waiting:
                waiting.append(r)
        scheduled: list[tuple[_Request, int]] = []
        for r in sorted(running, key=lambda r: r.prefilling):  # decodes first, order kept
            n = min(r.prompt - r.computed, budget) if r.prefilling else 1
            if n <= budget and n > 0:
                scheduled.append((r, n))
                budget -= n
        while waiting and budget > 0 and len(running) < mix.max_num_seqs:
            r = waiting.popleft()
            running.append(r)
            n = min(r.prompt - r.computed, budget)
            scheduled.append((r, n))
            budget -= n
        yield Step.from_requests([(n, r.computed, not r.prefilling) for r, n in scheduled])
        for r, n in scheduled:
            r.computed += n
            if not r.prefilling:  # the last prefill chunk samples the first token too
                r.generated += 1
        running = [r for r in running if r.generated < r.output]
