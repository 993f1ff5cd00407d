"""Make vLLM's KV-cache sizing leave room for the scratch the plans allocate.

vLLM sizes the KV cache from what model loading allocated plus the peak of a profile run in which
the attention layers return before calling the kernels, so kernel scratch is never seen (stock
never reserves it: that is the OOM). vLLM's ``reserve_workspace()`` hook, where a release has it, does not help here:
its DeepSeek-V3.2 layer returns in the profile run before calling it. So the impl allocates the
bytes the KV cache must leave while the model is built -- vLLM counts them as model memory
(:attr:`.engine.EngineSetup.reserved_bytes`: the largest launch of any plan beyond the
release's workspace, and the step's output too where that workspace has no view for it) -- and gives them back to the driver, where the
kernels' scratch finds them, once vLLM has sized the KV cache and serves.

When that is: at the first FP8 forward outside a CUDA-graph capture over the KV cache vLLM sized:
one of more blocks than the minimal cache vLLM profiles CUDA graphs against, or any cache once a
builder was made for the sized one (:func:`note_kv_cache_sized`; the one sign where an operator's
``--num-gpu-blocks-override`` gives both caches the same blocks). Earlier, vLLM's CUDA-graph memory
profiling captures every graph size against that minimal cache before it sizes the
real one: bytes handed over there, or in its warm-up, lower its estimate and the KV cache takes
them. One reservation per engine, whatever the number of layers, since layers run one at a time: every
layer's impl (the MTP draft's too) asks while the engine is built, and only the first allocates; an
engine built in the same process after an earlier one served gets its own.

Back to the driver, not to PyTorch's cache: the caching allocator gives a freed block only to
allocations on the stream it was allocated on, and vLLM may serve on another stream than the one
the model was built on (its ``current_stream()`` makes one of its own on the first call that finds
none tracked: ``vllm/utils/torch_utils.py``). Cached, the bytes
would then serve no launch, and the launches would allocate as much again beside them; given back,
the next launch allocates them on its own stream, whichever that is. Under vLLM's sleep mode the
model's memory pool is vLLM's and keeps a freed segment mapped: the caller unmaps it from there
(the release's ``release_from_sleep_mode_pool``, at :func:`address`).
"""

from __future__ import annotations

import threading

import torch


class Reservation:
    """One engine's reserved bytes, from its model's construction to the hand-over."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: torch.Tensor | None = None
        self._made = False
        self._stream: int | None = None
        """The CUDA stream the bytes were allocated on (its handle), for the hand-over's log line."""
        self.reserved_bytes = 0
        """Bytes reserved (kept after :meth:`release`)."""
        self.address = 0
        """Device address of the reserved bytes (kept after :meth:`release`)."""
        self.kv_cache_sized = False
        """vLLM has sized this engine's KV cache: a metadata builder was made for it
        (:func:`.vllm_api.kv_cache_sized`). Only its forwards follow."""

    def reserve(self, num_bytes: int, device: torch.device) -> bool:
        """Hold ``num_bytes`` on ``device`` until :meth:`release`, unless this engine reserved
        already (its first layer did); returns whether this call allocated."""
        with self._lock:
            if self._made:
                return False
            self._made = True
            self._held = torch.empty(num_bytes, dtype=torch.uint8, device=device)
            self.address = self._held.data_ptr()
            self._stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
            self.reserved_bytes = num_bytes
            return True

    def release(self) -> bool:
        """Give the reserved bytes back to the driver, for the allocations of whichever stream
        runs the kernels. Returns whether anything was held."""
        with self._lock:
            held, self._held = self._held, None
        if held is None:
            return False
        on_cuda = held.is_cuda
        del held
        if on_cuda:
            try:
                torch.cuda.empty_cache()
            except RuntimeError:  # a synchronisation refused mid-step (VLLM_GPU_SYNC_CHECK=error): they stay cached
                pass
        return True

    def held(self) -> bool:
        return self._held is not None

    def made_on_another_stream(self) -> bool:
        """Whether the bytes were allocated on a CUDA stream other than the current one (what
        giving them back to the driver is for)."""
        return self._stream is not None and torch.cuda.current_stream().cuda_stream != self._stream

    def note_kv_cache_sized(self) -> None:
        self.kv_cache_sized = True

    def serving(self, kv_cache_blocks: int, profiling_kv_blocks: int) -> bool:
        """Whether a forward over a KV cache of ``kv_cache_blocks`` blocks runs after vLLM sized
        this engine's KV cache: outside a CUDA-graph capture, over more blocks than vLLM's
        CUDA-graph memory profiling uses (``profiling_kv_blocks``), or over any once
        :meth:`note_kv_cache_sized`."""
        if kv_cache_blocks <= profiling_kv_blocks and not self.kv_cache_sized:
            return False
        return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
