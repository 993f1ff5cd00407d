"""Runs the FP8-direct Triton kernel under Triton's interpreter, in a process of its own:

    TRITON_INTERPRET=1 python tests/harness/fp8_direct_interpret.py CASES.pt RESULTS.pt

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates the kernel (at import), so the
interpreter needs a fresh process; tests/test_fp8_direct.py starts this one, so the rest of a
pytest session keeps the compiled path. CASES.pt: ``{"attention": [...], "dequant": [...]}``.
Each attention case is a dict of the launcher's arguments (``config`` as a dict of
:class:`KernelConfig` fields) and gives ``{"out", "lse", "in_place", "pad_untouched", "seconds"}``;
each dequant case (``{"nope": (R, 512) uint8, "scales": (R, 4) float32, "dequant": mode}``, R a
multiple of 16) runs the kernel's own dequantisation of that mode alone on those rows and gives
their ``(R, 512)`` BF16 values. RESULTS.pt: ``{"attention": [...], "dequant": [...]}``. ``out`` and ``lse`` start as NaN, so an element the
kernel never writes shows up; with ``out_pad_heads`` > 0 in a case, ``out`` is a strided head
slice of a wider buffer (as vLLM passes it) whose other heads must stay untouched.

Three fixes to Triton 3.8's interpreter (numpy), none touching the kernel or its GPU path:

* ``tl.dot`` on bfloat16 operands multiplies their raw uint16 bit patterns (the interpreter keeps
  bfloat16 as uint16 and only up-converts 8-bit floats before ``np.matmul``): the patch
  up-converts bfloat16 operands to float32 first (exact; the GPU's tensor cores multiply them
  exactly and accumulate in float32 too);
* the float32 -> bfloat16 cast truncates: the patch rounds to nearest even, as the GPU's
  ``cvt.rn.bf16.f32`` does;
* inline PTX does not run: the kernel's one piece of it, the 16-byte tile-scale load
  (``SCALES_V4_ASM``, ``KernelConfig(scales="v4")``), is carried out as the PTX states it (four
  words at each valid row's address, zeros elsewhere), checking the address's 16-byte alignment;
  any other inline PTX still raises. So the interpreter checks the addresses, masks and the order
  in which the four words become tile scales; the PTX text itself runs on the GPU only.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any


class _Results:
    """What the interpreter's inline-asm call returns: its outputs, by index."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def get_result(self, i: int) -> Any:
        return self.handles[i]


def patch_interpreter() -> None:
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original_dot = builder.create_dot
    original_cast = builder.cast_impl
    original_inline_asm = builder.create_inline_asm
    from mla_planner.kernels.fp8_direct import SCALES_V4_ASM

    def to_f32(handle: Any) -> Any:
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16  # a bfloat16 is the top half of a float32
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        return original_dot(self, to_f32(a), to_f32(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(rounded.view(np.uint16), tl.bfloat16)
        return original_cast(self, src, dst_type)

    def create_inline_asm(self: Any, asm: str, constraints: str, values: list[Any], types: list[Any], is_pure: bool,
                          pack: int) -> Any:
        if asm != SCALES_V4_ASM.value:
            return original_inline_asm(self, asm, constraints, values, types, is_pure, pack)
        # What the PTX does: where $5 is nonzero, the four 32-bit words at address $4; else zeros.
        # The address must be 16-byte aligned, as ld.global.v4 needs on the GPU.
        addresses, valid = values[0].data.astype(np.uint64).ravel(), values[1].data.ravel()
        words = np.zeros((addresses.size, 4), dtype=np.int32)
        for i in np.flatnonzero(valid):
            assert int(addresses[i]) % 16 == 0, f"scale load at {int(addresses[i]):#x}: not 16-byte aligned"
            words[i] = np.frombuffer(ctypes.string_at(int(addresses[i]), 16), dtype=np.int32)
        shape = values[0].data.shape
        return _Results([interpreter.TensorHandle(words[:, j].reshape(shape).copy(), tl.int32) for j in range(4)])

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder.create_inline_asm = create_inline_asm
    # create_fp_trunc and friends are lambdas that look cast_impl up on the instance, so they
    # take the patched one.


def main(cases_path: str, results_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    patch_interpreter()
    import torch

    from harness.fp8_direct_dequant import dequant_rows
    from mla_planner.kernels.fp8_direct import KernelConfig, sparse_attention_fp8

    cases = torch.load(cases_path)
    dequantised = [dequant_rows(c["nope"], c["scales"], c["dequant"]) for c in cases["dequant"]]
    results = []
    for case in cases["attention"]:
        q = case["q"]
        t, h = q.shape[0], q.shape[1]
        buffer = torch.full((t, h + case["out_pad_heads"], 512), float("nan"), dtype=torch.bfloat16)
        out = buffer[:, :h]
        lse = torch.full((t, h), float("nan"), dtype=torch.float32)
        start = time.perf_counter()
        o, l = sparse_attention_fp8(q, case["kv_cache"], case["indices"], case["softmax_scale"], out=out, lse=lse,
                                    topk_length=case["topk_length"], attn_sink=case["attn_sink"],
                                    config=KernelConfig(**case["config"]))
        seconds = time.perf_counter() - start
        results.append({"out": out.clone(), "lse": lse, "in_place": o is out and l is lse,
                        "pad_untouched": bool(buffer[:, h:].isnan().all()), "seconds": seconds})
    torch.save({"attention": results, "dequant": dequantised}, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
