# Type stubs for the compiled module (rust/bindings/src/). Hand-written;
# checked by mypy against the tests and the package.
from collections.abc import Iterator
from typing import Literal

import numpy as np
import numpy.typing as npt

__version__: str
GLOBAL_TOPK_MASK_MAX_BYTES: int
MIN_HEADS_FOR_BF16_PREFILL: int
NATIVE_PREFILL_HEADS: list[int]
"""Heads FlashMLA's SM90 sparse prefill kernel runs unpadded, in a build with native 16/32-head
prefill kernels (16, 32)."""
ALLOCATOR_RESERVE_BYTES: int
DEFAULT_TOPK: int
H200_NUM_SMS: int
MAX_HEADS: int
"""Most query heads per rank a plan takes (the widest FlashMLA sparse kernels run 128)."""
MAX_DECODE_QUERY_LEN: int
"""Longest decode query a step may hold (one length for every decode of a step)."""

class PanicException(BaseException):
    """A panic in the planner: a bug, never a verdict on the input (bad input raises
    ``ValueError``). pyo3 raises it as a ``BaseException``, so ``except Exception`` lets it
    through; code that must not raise names it."""

IntArray = npt.NDArray[np.int64]
ArrayLike = npt.ArrayLike
Bound = Literal["none", "budget", "int32_stride", "grid"]
PrefillPath = Literal["dense_mha", "masked_mha", "sparse_mqa"]
Mode = Literal["mixed_batch", "separate_prefill_decode", "bf16"]
Kernel = Literal["sparse_decode", "sparse_prefill"]

class StepConfig:
    """The model, the GPU, the budgets, the workspaces and how plans are executed: everything a
    step plan depends on besides the step (rust/bindings/src/config.rs). Frozen."""

    def __init__(
        self,
        num_heads: int,
        *,
        arch: str = "sm90",
        num_sms: int | None = None,
        topk: int | None = None,
        kv_dtype: str = "fp8",
        scratch_budget_bytes: int | None = None,
        max_model_len: int | None = None,
        gather_workspace_rows: int | None = None,
        indexer_workspace_rows: int | None = None,
        indexer_logits_bytes: int | None = None,
        masked_mha: bool = False,
        force_mqa: bool = False,
        mask_workspace_bytes: int | None = None,
        context_chunk_rows: int | None = None,
        mode: str | None = None,
        execution: Literal["default", "vllm"] = "default",
        translated_indices: bool | None = None,
        align_waves: bool | None = None,
        decode_takes_out: bool | None = None,
        prefill_takes_out: bool | None = None,
        native_prefill_heads: bool = False,
        prefill_padding: int | None = None,
    ) -> None: ...
    def replace(self, **changes: object) -> StepConfig: ...
    def to_dict(self) -> dict[str, object]: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def arch(self) -> Literal["sm90", "sm100"]: ...
    @property
    def num_sms(self) -> int: ...
    @property
    def topk(self) -> int: ...
    @property
    def kv_dtype(self) -> Literal["fp8", "bf16"]: ...
    @property
    def scratch_budget_bytes(self) -> int: ...
    @property
    def launch_budget_bytes(self) -> int:
        """The budget less the allocator's reserve: what one launch may allocate."""
    @property
    def max_model_len(self) -> int | None: ...
    def min_scratch_budget(self, max_step_tokens: int, max_decode_query_len: int) -> int:
        """The smallest ``scratch_budget_bytes`` under which every step of this configuration's route
        plans, for steps of at most ``max_step_tokens`` tokens and decodes of at most
        ``max_decode_query_len`` tokens each."""
    def largest_launch_bytes(self, max_step_tokens: int, max_decode_query_len: int,
                             served_heads: int | None = None) -> int:
        """The most one launch of any plan of this route allocates within those limits, less its
        padded q and kernel output where the kernel runs ``served_heads`` (a workspace holds them)."""
    def bounded_configs(self, allowance: int, shrink: int = 4) -> list[StepConfig]:
        """The bounded path's configurations, one per rung: mixed batch, every launch's bytes
        within ``allowance`` (what is reserved for one launch), each rung's launches a ``shrink``th
        of the one before, down to one token. ``ValueError`` where not even one token fits."""
    @property
    def gather_workspace_rows(self) -> int: ...
    @property
    def indexer_workspace_rows(self) -> int: ...
    @property
    def indexer_logits_bytes(self) -> int: ...
    @property
    def masked_mha(self) -> bool: ...
    @property
    def force_mqa(self) -> bool: ...
    @property
    def mask_workspace_bytes(self) -> int: ...
    @property
    def context_chunk_rows(self) -> int: ...
    @property
    def mode(self) -> Mode:
        """The mode every step takes: the one fixed, or vLLM's rule."""
    @property
    def mode_fixed(self) -> bool: ...
    @property
    def translated_indices(self) -> bool: ...
    @property
    def align_waves(self) -> bool: ...
    @property
    def decode_takes_out(self) -> bool: ...
    @property
    def prefill_takes_out(self) -> bool: ...
    @property
    def native_prefill_heads(self) -> bool:
        """The prefill kernel runs the query heads unpadded (16 or 32 on sm90, given a FlashMLA
        build with native 16/32-head prefill kernels); otherwise vLLM's padding. A cost model may
        also take native heads per step."""
    @property
    def decode_heads(self) -> int:
        """Heads the sparse decode kernel runs (64 or 128)."""
    @property
    def prefill_heads(self) -> int:
        """Heads the sparse prefill kernel runs: ``num_heads`` with ``native_prefill_heads``,
        else ``prefill_padded_heads``."""
    @property
    def prefill_padded_heads(self) -> int:
        """Heads vLLM pads the prefill kernel's q to: what its own code runs."""
    @property
    def prefill_padding(self) -> int:
        """vLLM's ``prefill_padding``, the head multiple it pads the prefill kernel's q to: the one
        given, else the padding by architecture (64 on sm90, 128 on sm100). A FlashMLA build with
        64-head sm100 prefill kernels pads to 64 on both; the release module says which."""
    @property
    def native_prefill_heads_possible(self) -> bool:
        """The prefill kernel can run ``num_heads`` unpadded on this GPU (16 or 32 on sm90), given
        a FlashMLA build with those kernels."""
    @property
    def decode_writes_in_place(self) -> bool: ...
    @property
    def prefill_writes_in_place(self) -> bool: ...

class Scratch:
    """The buffers one kernel call allocates (absent buffers are not listed)."""

    @property
    def buffers(self) -> dict[str, int]: ...
    @property
    def total_bytes(self) -> int: ...

class MixedBatchPlan:
    @property
    def launches(self) -> IntArray:
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
    def paths(self) -> list[PrefillPath]: ...
    @property
    def mask_bytes(self) -> IntArray: ...
    def __len__(self) -> int: ...

class Launch:
    """One kernel call of a plan, as the executor issues it (iterate a :class:`StepPlan`)."""
    @property
    def kernel(self) -> Kernel: ...
    @property
    def tokens(self) -> slice:
        """The step's query tokens it computes: its rows of q and of the output."""
    @property
    def requests(self) -> slice:
        """The step's requests whose tokens it computes."""
    @property
    def gather_chunk(self) -> int | None:
        """Separate route, prefill launches: the gather chunk whose workspace it reads (a row of
        ``StepPlan.gather_chunks``); ``None`` for others."""
    @property
    def bytes(self) -> int:
        """The bytes live while it runs."""
    @property
    def scratch(self) -> Scratch:
        """Those bytes by buffer; their total is ``bytes``. Those the step holds once for every
        launch of the kernel are at its longest launch's size: the mixed route's padded q, the
        separate route's prefill padded q and kernel output. The rest are the launch's own."""

class StepPlan:
    @property
    def mode(self) -> Literal["mixed_batch", "separate_prefill_decode", "bf16"]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_decodes(self) -> int: ...
    @property
    def decode_query_len(self) -> int:
        """The decodes' query length (1, or 1 + speculative tokens); 0 when no decode has tokens."""
    @property
    def launches(self) -> IntArray:
        """(n, 5): token_start, token_end, req_start, req_end, gather chunk (-1: none)."""
    @property
    def launch_kernels(self) -> list[Kernel]: ...
    @property
    def launch_bytes(self) -> IntArray: ...
    @property
    def bound(self) -> Bound: ...
    @property
    def peak_bytes(self) -> int: ...
    def peak_beyond_workspace(self, decode_heads: int, served_heads: int | None = None) -> int:
        """The largest launch's bytes beyond a workspace that holds the padded q and kernel output
        of launches whose kernel runs ``served_heads`` heads: what of the peak a reservation holds."""
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
    @property
    def prefill_heads(self) -> int:
        """Heads the prefill launches run the kernel at (padded, or native 16/32): the executor
        pads q and sizes the kernel's output to exactly this."""
    @property
    def prefill_writes_in_place(self) -> bool:
        """The prefill launches write straight into the step's output."""
    def longest_launch(self, kernel: Kernel) -> int: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Launch]:
        """Its launches, in order."""

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
    native_heads: bool = False,
    padding: int | None = None,
) -> Scratch: ...
def prefill_launch_tokens(
    num_heads: int,
    *,
    budget_bytes: int,
    arch: str = "sm90",
    topk: int | None = None,
    out_preallocated: bool = False,
    translated_indices: bool = False,
    native_heads: bool = False,
    padding: int | None = None,
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
def padded_heads(
    num_heads: int, *, kernel: Kernel = "sparse_decode", arch: str = "sm90", padding: int | None = None
) -> int:
    """Heads ``kernel`` runs for ``num_heads`` query heads per rank (q is zero-padded up to it);
    ``padding``: vLLM's ``prefill_padding`` for the prefill kernel (default: the padding by
    architecture, 64 on sm90 and 128 on sm100)."""
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
def step_mode(num_heads: int, *, kv_dtype: str = "fp8") -> Mode:
    """vLLM's mode for steps of ``num_heads`` heads per rank."""
def plan_step(query_lens: ArrayLike, context_lens: ArrayLike, num_decodes: int, config: StepConfig, *,
              gather_chunks: ArrayLike | None = None) -> StepPlan:
    """Plan one step under ``config``: its launches are exactly the kernel calls the executor issues.
    ``gather_chunks``: ``(n, 2)`` request ranges in which vLLM gathers the prefills (separate route),
    followed instead of the planner's own."""

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
    @property
    def prefill_heads(self) -> int:
        """Heads the prefill launches were priced at (64/128 padded, 16/32 native); 0 if none."""

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
        """The chosen route's plan: ``plan_step(..., config.replace(mode=self.mode,
        native_prefill_heads=...))`` at the prefill heads it was priced at: ``plan_step(...,
        self.config)``."""
    @property
    def config(self) -> StepConfig:
        """The configuration that plans ``plan``: the one given, with the route's ``mode`` and
        ``native_prefill_heads`` as priced."""

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
    def check(self, config: StepConfig) -> None:
        """ValueError unless the profile prices steps of ``config``."""
    def prices_native_prefill(self, config: StepConfig) -> bool:
        """Whether the profile has a prefill table at exactly ``config``'s 16 or 32 heads (sm90):
        then the separate route is priced padded and native, and the cheaper taken."""
    def predict(self, query_lens: ArrayLike, context_lens: ArrayLike, num_decodes: int, config: StepConfig) -> RoutePrediction: ...
    def choose_route(self, query_lens: ArrayLike, context_lens: ArrayLike, num_decodes: int, config: StepConfig) -> RouteChoice: ...
