"""The doctor's KV-cache model against the measured lines (the H200's, and the H100's that name it) (tests/data/doctor_kv_lines.json):
each line as a :class:`Deployment`, the fit of a release's memory constants from its ``fit`` lines,
and the table of measured against predicted.

Refit (prints each release's constants, then every line's error)::

    cd tests && PYTHONPATH=../python python -m harness.doctor_kv
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

from mla_planner.cli import deployment as dep
from mla_planner.cli import vllm_releases
from mla_planner.cli.vllm_releases import ACTIVATION_HIDDEN, VllmRelease

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]
LINES = ROOT / "tests" / "data" / "doctor_kv_lines.json"
MODELS = {"v32": ROOT / "tests" / "e2e" / "tiny-deepseek-v32", "glm5": ROOT / "tests" / "e2e" / "tiny-glm5"}
MAX_MODEL_LEN = 70_000


def lines(use: str | None = None, release: str | None = None) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads(LINES.read_text(encoding="utf-8"))["lines"]
    return [line for line in found if (use is None or line["use"] == use) and (release is None or line["release"] == release)]


def deployment(line: dict[str, Any], release: VllmRelease | None = None) -> dep.Deployment:
    """The line's engine as the doctor models it, under ``release`` (default: the line's)."""
    plugin = line["engine"] == "plugin"
    return dep.Deployment(
        model=dep.model_from_config(MODELS[line["model"]] / "config.json"), gpu=dep.GPUS[line.get("gpu", "H200")], tp=1,
        max_num_batched_tokens=line["max_num_batched_tokens"], gpu_memory_utilization=line["util"],
        max_model_len=MAX_MODEL_LEN, kv_fp8=True, plugin=plugin,
        budget_bytes=(line["budget_mb"] or 1024) << 20, max_num_seqs=line["max_num_seqs"],
        release=release or vllm_releases.RELEASES[line["release"]], enforce_eager=line["enforce_eager"],
        num_speculative_tokens=line["num_speculative_tokens"], mtp_draft=line["num_speculative_tokens"] > 0,
    )  # fmt: skip


def measured_kv_bytes(line: dict[str, Any]) -> int:
    return int(round(line["kv_gib"] * GIB))


def predicted_kv_bytes(line: dict[str, Any], release: VllmRelease | None = None) -> int:
    """The doctor's KV cache for the line's engine: stock's, or the plugin's (stock's less its
    reservation)."""
    d = deployment(line, release)
    stock = d.stock_kv_bytes()
    return stock - dep.plugin_reservation(d) if line["engine"] == "plugin" else stock


def fit(release: VllmRelease) -> VllmRelease:
    """``release`` with its three memory constants solved from its three ``fit`` lines: what each
    line's measured non-KV memory leaves over the model's counted parts is
    ``fixed + per_token x tokens x hidden / 1024 + graphs x (not eager)``."""
    bare = dataclasses.replace(release, fixed_bytes=0, activation_per_token=0.0, cuda_graph_bytes=0)
    rows, rest = [], []
    for label in release.fitted_on:
        (line,) = [x for x in lines(release=release.minor) if x["label"] == label]
        d = deployment(line, bare)
        # measured non-KV as stock's: the plugin's KV cache is stock's less the reservation
        reserved = dep.plugin_reservation(d) if line["engine"] == "plugin" else 0
        non_kv = int(d.gpu_memory_utilization * d.gpu.total_bytes) - measured_kv_bytes(line) - reserved
        rest.append(non_kv - d.non_kv_bytes())
        scale = d.model.hidden_size / ACTIVATION_HIDDEN
        rows.append((1.0, d.max_num_batched_tokens * scale, 0.0 if d.enforce_eager else 1.0))
    fixed, per_token, graphs = _solve3(rows, rest)
    return dataclasses.replace(release, fixed_bytes=round(fixed), activation_per_token=round(per_token, 1),
                               cuda_graph_bytes=round(graphs))


def _solve3(rows: list[tuple[float, float, float]], rhs: list[int]) -> tuple[float, float, float]:
    """Cramer's rule for three equations in three unknowns (no numpy in the CLI's test venvs needed)."""

    def det(m: list[tuple[float, float, float]]) -> float:
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

    whole = det(rows)
    if abs(whole) < 1e-9:
        raise ValueError("the fit lines do not determine the constants (one fixed, one per-token, one CUDA-graph line needed)")
    out = []
    for k in range(3):
        swapped = [tuple(rhs[i] if j == k else rows[i][j] for j in range(3)) for i in range(3)]
        out.append(det(swapped) / whole)  # type: ignore[arg-type]
    return out[0], out[1], out[2]


class Row(NamedTuple):
    label: str
    use: str
    measured_gib: float
    predicted_gib: float

    @property
    def error_gib(self) -> float:
        return self.predicted_gib - self.measured_gib


def table(use: tuple[str, ...] = ("held_out",)) -> list[Row]:
    return [Row(x["label"], x["use"], x["kv_gib"], predicted_kv_bytes(x) / GIB) for x in lines() if x["use"] in use]


def format_rows(rows: list[Row]) -> str:
    width = max(len(r.label) for r in rows)
    out = [f"{'line':{width}}  {'use':8}  measured GiB  predicted GiB  error GiB"]
    out += [f"{r.label:{width}}  {r.use:8}  {r.measured_gib:12.2f}  {r.predicted_gib:13.2f}  {r.error_gib:+9.2f}" for r in rows]
    return "\n".join(out)


if __name__ == "__main__":
    for made in vllm_releases.RELEASES.values():
        fitted = fit(made)
        print(f"{made.version}: fixed_bytes={fitted.fixed_bytes}, activation_per_token={fitted.activation_per_token}, "
              f"cuda_graph_bytes={fitted.cuda_graph_bytes}")
    print(format_rows(table(("fit", "held_out", "outside", "excluded"))))
