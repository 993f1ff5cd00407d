"""The GPUs the doctor knows by name: each one's architecture, SMs and total memory, measured where
a GPU was at hand, else from its datasheet."""

from __future__ import annotations

from dataclasses import dataclass

from .units import GIB


@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str
    num_sms: int
    total_bytes: int  # what torch.cuda.mem_get_info reports as total
    source: str  # "measured: ..." or "assumed: ..."

    @property
    def measured(self) -> bool:
        return self.source.startswith("measured")


H200_TOTAL_BYTES = 150_109_880_320
"""torch.cuda.mem_get_info()[1] on the H200 the end-to-end runs used (139.80 GiB)."""
H200_DATASHEET_GIB = 141
# The H200 exposes this fraction of its datasheet capacity to torch; the other GPUs are assumed to
# expose the same fraction of theirs.
USABLE_FRACTION = H200_TOTAL_BYTES / (H200_DATASHEET_GIB * GIB)
H100_TOTAL_BYTES = 85_017_493_504
"""torch.cuda.mem_get_info()[1] on the H100 80GB HBM3 the end-to-end runs used (79.18 GiB)."""


def _datasheet(name: str, arch: str, num_sms: int, gib: int) -> Gpu:
    total = int(gib * GIB * USABLE_FRACTION)
    return Gpu(name, arch, num_sms, total, f"assumed: datasheet {gib} GB x the H200's usable fraction {USABLE_FRACTION:.4f}")


GPUS: dict[str, Gpu] = {
    "H200": Gpu("H200", "sm90", 132, H200_TOTAL_BYTES, "measured: torch.cuda.mem_get_info total on an H200"),
    "H100": Gpu("H100", "sm90", 132, H100_TOTAL_BYTES, "measured: torch.cuda.mem_get_info total on an H100 80GB HBM3"),
    "B200": _datasheet("B200", "sm100", 148, 180),
}
