"""The impl's workspace for one layer call, as the backend's launches take it: where a release's
impl reserves its workspace at construction (its ``workspace_specs``, placed by vLLM's workspace
manager), views of that buffer; where it reserves none, the impl's own gather workspace alone.
Torch only: the release module (:mod:`.releases`) reads the layout from vLLM."""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Slot:
    """One of the impl's ``workspace_specs``: where vLLM's ``get_simultaneous`` puts it in the
    workspace manager's buffer (bytes from the buffer's start), its shape and dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def of(self, buffer: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """This spec's view of ``buffer`` (the manager's, as bytes): its first ``rows`` rows, all
        of them by default."""
        if rows is None:
            rows = self.shape[0]
        elif not 0 <= rows <= self.shape[0]:  # past the spec is the next spec's memory
            raise ValueError(f"{rows} rows of a workspace view of {self.shape[0]}")
        row_bytes = self.dtype.itemsize * math.prod(self.shape[1:])
        return buffer[self.offset : self.offset + rows * row_bytes].view(self.dtype).view((rows, *self.shape[1:]))


@dataclasses.dataclass(frozen=True)
class WorkspaceLayout:
    """The impl's workspace, read at construction from where vLLM's ``get_simultaneous`` put each
    of its ``workspace_specs`` and checked: a layout this backend does not know is a start-up
    error, never a silent allocation per step. ``q_concat`` ``(max_tokens, heads padded to 64,
    576)``, the sparse-MQA query stock's ``forward_mqa`` concatenates; on an FP8 cache then the
    separate path's BF16 ``gather`` workspace, ``q_padded`` ``(max_tokens, padded heads, 576)`` and
    ``padded_out`` ``(max_tokens, padded heads, 512)`` -- the BF16 prefill kernel's padded q and
    output, which the backend's launches of either kernel take theirs from -- and ``compact_out``
    ``(max_tokens, heads, 512)``, the step's output. ``span``: the bytes they take together."""

    q_concat: Slot
    gather: Slot | None
    q_padded: Slot | None
    padded_out: Slot | None
    compact_out: Slot | None
    span: int


@dataclasses.dataclass(frozen=True)
class WorkspaceViews:
    """The impl's workspace for one layer call: views of the workspace manager's buffer
    (``buffer``, as bytes), each made when first asked for and exactly the rows asked for; or,
    where the release reserves no workspace, the impl's own gather workspace alone (the rest are
    ``None``)."""

    buffer: torch.Tensor | None
    layout: WorkspaceLayout | None
    legacy_gather: torch.Tensor | None = None
    _made: dict[tuple[int, int | None], torch.Tensor] = dataclasses.field(default_factory=dict, compare=False)

    def _view(self, slot: Slot | None, rows: int | None) -> torch.Tensor | None:
        if slot is None or self.buffer is None:
            return None
        key = (id(slot), rows)
        view = self._made.get(key)
        if view is None:
            view = self._made[key] = slot.of(self.buffer, rows)
        return view

    def gather(self) -> torch.Tensor | None:
        return self.legacy_gather if self.layout is None else self._view(self.layout.gather, None)

    def q_concat(self, rows: int | None = None) -> torch.Tensor | None:
        return None if self.layout is None else self._view(self.layout.q_concat, rows)

    def q_padded(self, rows: int | None = None) -> torch.Tensor | None:
        return None if self.layout is None else self._view(self.layout.q_padded, rows)

    def padded_out(self, rows: int | None = None) -> torch.Tensor | None:
        return None if self.layout is None else self._view(self.layout.padded_out, rows)

    def compact_out(self, rows: int | None = None) -> torch.Tensor | None:
        return None if self.layout is None else self._view(self.layout.compact_out, rows)
