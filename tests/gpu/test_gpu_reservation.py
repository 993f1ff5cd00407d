"""On the GPU: the reservation's hand-over gives its bytes back to the driver, so that launches on
any stream find them (docs/vllm.md, "Reserving the budget from the KV cache").

PyTorch's caching allocator gives a freed block only to allocations on the stream it was allocated
on. vLLM may serve on another stream than the one the model (and the reservation) was built on;
cached, the bytes would serve no launch there, and the launches would take as much again from the
device. Measured with the driver's free memory (``torch.cuda.mem_get_info``), which counts every
allocation of the process, cached or live."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mla_planner.vllm_backend.reservation import Reservation

from gpu_helpers import MiB

pytestmark = pytest.mark.gpu

RESERVED = 512 * MiB
SLACK = 4 * MiB
"""Driver-level noise between two readings: the allocator's 2 MiB rounding, a small segment."""


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.fixture
def reservation() -> Iterator[Reservation]:
    """One engine's reservation, nothing held yet."""
    made = Reservation()
    torch.cuda.empty_cache()
    yield made
    made.release()
    torch.cuda.empty_cache()


def test_the_hand_over_gives_the_bytes_back_to_the_driver(reservation: Reservation) -> None:
    before = free_bytes()
    assert reservation.reserve(RESERVED, torch.device("cuda"))
    held = free_bytes()
    assert before - held >= RESERVED, (before, held)
    assert reservation.release() and not reservation.held()
    after = free_bytes()
    print(f"free MiB: before {before // MiB}, reserved {held // MiB}, handed over {after // MiB}")
    assert after - held >= RESERVED - SLACK, "the freed reservation stayed in PyTorch's cache"


def test_a_launch_on_another_stream_after_the_hand_over_takes_no_more_than_the_reservation(
        reservation: Reservation) -> None:
    # vLLM's own stream, made after the model was built. Made before the first reading: the first
    # stream PyTorch hands out creates its pool of streams, whose device memory is no launch's.
    serving = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    before = free_bytes()
    assert reservation.reserve(RESERVED, torch.device("cuda"))  # the model's stream
    with torch.cuda.stream(serving):
        assert reservation.made_on_another_stream()
        reservation.release()
        scratch = torch.empty(RESERVED, dtype=torch.uint8, device="cuda")  # a launch's scratch
        peak_taken = before - free_bytes()
        del scratch
    print(f"taken from the device while the launch's scratch is live: {peak_taken // MiB} MiB "
          f"(reservation {RESERVED // MiB} MiB)")
    assert peak_taken <= RESERVED + SLACK, "the launch allocated beside the cached reservation"


def test_under_sleep_mode_the_hand_over_gives_the_bytes_back_to_the_driver(reservation: Reservation) -> None:
    """Under vLLM's CuMem allocator (``--enable-sleep-mode``) the reservation is made in the model's
    memory pool, which keeps a freed segment mapped: the hand-over unmaps it from there, and the
    allocator still sleeps and wakes."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError as exc:  # no vLLM, or one without its CuMem extension
        pytest.skip(f"vLLM's CuMem allocator does not load here: {exc}")
    from mla_planner.vllm_backend.releases import release

    allocator = CuMemAllocator.get_instance()
    before = free_bytes()
    with allocator.use_memory_pool(tag="weights"):  # as vLLM builds the model under sleep mode
        weight = torch.ones(8 * MiB, dtype=torch.uint8, device="cuda")
        assert reservation.reserve(RESERVED, torch.device("cuda"))
    held = free_bytes()
    assert before - held >= RESERVED, (before, held)
    assert reservation.release()
    cached = free_bytes()
    assert release.release_from_sleep_mode_pool(reservation.address)
    after = free_bytes()
    print(f"free MiB: before {before // MiB}, reserved {held // MiB}, released {cached // MiB}, "
          f"unmapped {after // MiB}")
    assert after - held >= RESERVED - SLACK, "the reservation stayed mapped in vLLM's pool"
    assert not release.release_from_sleep_mode_pool(reservation.address), "unmapped once"
    allocator.sleep(offload_tags=("weights",))
    allocator.wake_up()
    assert int(weight.sum().item()) == 8 * MiB, "the model's pool no longer sleeps and wakes intact"
    # Leave vLLM's allocator (one per process) as a later engine's start-up expects it: holding nothing.
    address = weight.data_ptr()
    del weight
    assert release.release_from_sleep_mode_pool(address) and allocator.get_current_usage() == 0
