# Type stubs for the compiled module (rust/bindings/src/lib.rs). Hand-written;
# checked by mypy against the tests and the package.
from typing import Literal

import numpy as np
import numpy.typing as npt

__version__: str
GLOBAL_TOPK_MASK_MAX_BYTES: int
MIN_HEADS_FOR_BF16_PREFILL: int
DEFAULT_TOPK: int
H200_NUM_SMS: int

IntArray = npt.NDArray[np.int64]
ArrayLike = npt.ArrayLike
Bound = Literal["none", "budget", "int32_stride", "grid"]
Route = Literal["dense_mha", "masked_mha", "sparse_mqa"]

class Scratch:
    """The buffers one kernel call allocates (absent buffers are not listed)."""

    @property
    def buffers(self) -> dict[str, int]: ...
    @property
    def total_bytes(self) -> int: ...

class MixedBatchPlan:
    @property
    def chunks(self) -> IntArray:
        """(n, 2) ``[start, end)`` token ranges in launch order."""
    @property
    def launch_bytes(self) -> IntArray: ...
    @property
    def peak_bytes(self) -> int: ...
    @property
    def bound(self) -> Bound: ...
    @property
    def distinct_lengths(self) -> list[int]: ...
    def __len__(self) -> int: ...

class PrefillGroups:
    @property
    def requests(self) -> IntArray: ...
    @property
    def routes(self) -> list[Route]: ...
    @property
    def mask_bytes(self) -> IntArray: ...
    def __len__(self) -> int: ...

class StepPlan:
    @property
    def mode(self) -> Literal["mixed_batch", "separate_prefill_decode", "bf16"]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_decodes(self) -> int: ...
    @property
    def launches(self) -> IntArray:
        """(n, 4): token_start, token_end, req_start, req_end."""
    @property
    def launch_kernels(self) -> list[Literal["sparse_decode", "sparse_prefill"]]: ...
    @property
    def launch_bytes(self) -> IntArray: ...
    @property
    def bound(self) -> Bound: ...
    @property
    def peak_bytes(self) -> int: ...
    @property
    def prefill_groups(self) -> PrefillGroups: ...
    @property
    def gather_chunks(self) -> IntArray:
        """(n, 7): req_start, req_end, query_start, query_end, key_start, key_end, rows."""
    @property
    def indexer_chunks(self) -> IntArray:
        """(n, 5): req_start, req_end, query_start, query_end, kv_rows."""
    @property
    def indexer_peak_bytes(self) -> int: ...
    @property
    def gather_workspace_bytes(self) -> int: ...

def decode_scratch(
    batch: int,
    s_q: int,
    num_heads: int,
    *,
    arch: str = "sm90",
    num_sms: int | None = None,
    topk: int | None = None,
    out_preallocated: bool = False,
    translated_indices: bool = False,
) -> Scratch: ...
def prefill_scratch(
    s_q: int,
    num_heads: int,
    *,
    arch: str = "sm90",
    topk: int | None = None,
    out_preallocated: bool = False,
    translated_indices: bool = False,
) -> Scratch: ...
def prefill_launch_tokens(
    num_heads: int,
    *,
    budget_bytes: int,
    arch: str = "sm90",
    topk: int | None = None,
    out_preallocated: bool = False,
    translated_indices: bool = False,
) -> tuple[int, Bound]:
    """The most query tokens one sparse prefill launch may take within the budget, and what
    caps it (``"budget"`` or a hard limit)."""
def topk_mask_shape(
    batch_size: int, max_query_len: int, max_key_len: int, *, reserve_key_starts_word: bool = False
) -> tuple[int, int, int]: ...
def topk_mask_bytes(
    batch_size: int, max_query_len: int, max_key_len: int, *, reserve_key_starts_word: bool = False
) -> int: ...
def gather_workspace_bytes(rows: int) -> int: ...
def indexer_logits_bytes(query_rows: int, kv_rows: int) -> int: ...
def max_tokens_per_launch(num_heads: int) -> tuple[int, Bound]: ...
def plan_mixed_batch(
    num_tokens: int,
    *,
    num_heads: int,
    budget_bytes: int,
    arch: str = "sm90",
    num_sms: int | None = None,
    topk: int | None = None,
    out_preallocated: bool = True,
    translated_indices: bool = False,
    align_waves: bool = False,
) -> MixedBatchPlan: ...
def split_prefill_chunks(
    seq_lens: ArrayLike, workspace_rows: int, *, request_offset: int | None = None
) -> IntArray: ...
def plan_gather_chunks(query_lens: ArrayLike, context_lens: ArrayLike, workspace_rows: int) -> IntArray: ...
def split_indexer_prefill_chunks(
    seq_lens: ArrayLike,
    query_lens: ArrayLike,
    workspace_rows: int,
    max_logits_bytes: int,
    *,
    request_offset: int | None = None,
) -> IntArray: ...
def masked_mha_workspace_fits(
    batch_size: int, max_query_len: int, max_context_chunk_seq_len: int, *, workspace_bytes: int | None = None
) -> bool: ...
def plan_prefill_groups(
    query_lens: ArrayLike,
    context_lens: ArrayLike,
    *,
    topk: int | None = None,
    workspace_bytes: int | None = None,
    context_chunk_rows: int | None = None,
    available: bool = True,
    stock: bool = False,
    force_mqa: bool = False,
) -> PrefillGroups: ...
def step_mode(
    num_heads: int, *, kv_dtype: str = "fp8", mixed_batch: bool | None = None
) -> Literal["mixed_batch", "separate_prefill_decode", "bf16"]: ...
def plan_step(
    query_lens: ArrayLike,
    context_lens: ArrayLike,
    num_decodes: int,
    *,
    num_heads: int,
    budget_bytes: int,
    kv_dtype: str = "fp8",
    arch: str = "sm90",
    num_sms: int | None = None,
    topk: int | None = None,
    gather_workspace_rows: int,
    indexer_workspace_rows: int,
    indexer_logits_bytes: int | None = None,
    mask_workspace_bytes: int | None = None,
    context_chunk_rows: int | None = None,
    masked_mha_available: bool = False,
    mixed_batch: bool | None = None,
    force_mqa: bool = False,
) -> StepPlan: ...

# --- cost model (rust/bindings/src/cost.rs) --------------------------------

COST_PROFILE_FORMAT: str
COST_PROFILE_ENVIRONMENT_KEYS: list[str]
FP8Route = Literal["mixed_batch", "separate_prefill_decode"]
ProfileTable = Literal["sparse_decode", "sparse_prefill", "gather_upconvert"]

class RouteTime:
    """One route's predicted time for a step, by part (microseconds, launch counts)."""

    @property
    def total_us(self) -> float: ...
    @property
    def decode_us(self) -> float: ...
    @property
    def gather_us(self) -> float: ...
    @property
    def prefill_us(self) -> float: ...
    @property
    def decode_launches(self) -> int: ...
    @property
    def gathers(self) -> int: ...
    @property
    def prefill_launches(self) -> int: ...

class RoutePrediction:
    """Both FP8 routes; a route the budget cannot hold is ``None`` with its planner error."""

    @property
    def mixed(self) -> RouteTime | None: ...
    @property
    def separate(self) -> RouteTime | None: ...
    @property
    def mixed_error(self) -> str | None: ...
    @property
    def separate_error(self) -> str | None: ...

class RouteChoice:
    @property
    def mode(self) -> FP8Route: ...
    @property
    def mixed_batch(self) -> bool: ...
    @property
    def prediction(self) -> RoutePrediction: ...
    @property
    def plan(self) -> StepPlan:
        """The chosen route's plan (as ``plan_step(..., mixed_batch=self.mixed_batch)``)."""

class CostModel:
    """Kernel times measured on one GPU (``mla-planner calibrate``); see docs/routing.md."""

    @staticmethod
    def from_json(text: str | bytes) -> CostModel: ...
    @property
    def arch(self) -> Literal["sm90", "sm100"]: ...
    @property
    def num_sms(self) -> int: ...
    @property
    def topk(self) -> int: ...
    @property
    def environment(self) -> dict[str, str]: ...
    @property
    def decode_heads(self) -> list[int]: ...
    @property
    def prefill_heads(self) -> list[int]: ...
    def time_us(self, kernel: ProfileTable, size: int, *, padded_heads: int | None = None) -> float: ...
    def check(self, num_heads: int, *, arch: str = "sm90", num_sms: int | None = None, topk: int | None = None) -> None:
        """ValueError unless the profile prices this configuration (``num_sms`` defaults to the profile's)."""
    def predict(
        self,
        query_lens: ArrayLike,
        context_lens: ArrayLike,
        num_decodes: int,
        *,
        num_heads: int,
        budget_bytes: int,
        arch: str = "sm90",
        num_sms: int | None = None,
        topk: int | None = None,
        gather_workspace_rows: int,
        indexer_workspace_rows: int,
        indexer_logits_bytes: int | None = None,
        mask_workspace_bytes: int | None = None,
        context_chunk_rows: int | None = None,
        force_mqa: bool = False,
    ) -> RoutePrediction: ...
    def choose_route(
        self,
        query_lens: ArrayLike,
        context_lens: ArrayLike,
        num_decodes: int,
        *,
        num_heads: int,
        budget_bytes: int,
        arch: str = "sm90",
        num_sms: int | None = None,
        topk: int | None = None,
        gather_workspace_rows: int,
        indexer_workspace_rows: int,
        indexer_logits_bytes: int | None = None,
        mask_workspace_bytes: int | None = None,
        context_chunk_rows: int | None = None,
        force_mqa: bool = False,
    ) -> RouteChoice: ...
