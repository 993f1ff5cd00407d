"""The backend's classes under vLLM's own sparse-MLA tests.

vLLM's tests/v1/attention/test_sparse_mla_backends.py calls builder and impl methods on
the class with a stand-in ``self`` (a ``SimpleNamespace`` of the attributes stock reads). An
override that reaches stock through zero-argument ``super()`` fails there with "super(type,
obj): obj must be an instance or subtype of type", and one that reads the backend's own state
fails with an ``AttributeError``. Two ways to hold that off:

* ``test_vllm_sparse_mla_tests_pass_with_planned_classes`` runs vLLM's file itself, from its
  source distribution, with the backend's classes in place of stock's (and with stock's, as the
  control); vLLM's wheel has no tests, so it skips where the sdist is not at hand;
* the rest reproduce what those tests do, here, so CI (which installs the wheel) checks it too.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from types import MethodType, SimpleNamespace
from typing import Any

import pytest
import torch

from releases import NEEDS_VLLM, installed, only_where

pytest.importorskip("vllm", reason=NEEDS_VLLM)

from vllm.v1.attention.backends.mla import flashmla_sparse as stock  # noqa: E402
from vllm.v1.attention.backends.mla import sparse_utils  # noqa: E402
from vllm.v1.attention.backends.mla.flashmla_sparse import (  # noqa: E402
    FlashMLASparseImpl,
    FlashMLASparseMetadata,
    FlashMLASparseMetadataBuilder,
)

from mla_planner.vllm_backend import backend, vllm_api  # noqa: E402
from mla_planner.vllm_backend.reservation import Reservation  # noqa: E402
from mla_planner.vllm_backend.backend import (  # noqa: E402
    PlannedFlashMLASparseImpl,
    PlannedFlashMLASparseMetadataBuilder,
)
from vllm_cpu import KernelRecorder, RecordingProvider, common_metadata, cpu_vllm, model_dir, vllm_config  # noqa: E402
from vllm_hub import STAND_INS, hub_ids_in, offline_hub  # noqa: E402

TESTS_DIR = pathlib.Path(__file__).parent
SDIST_VAR = "MLA_PLANNER_VLLM_SDIST"
VLLM_VERSION = vllm_api.installed_version()
DEFAULT_SDIST = pathlib.Path(f"/tmp/vllm-sdist/vllm-{VLLM_VERSION}.tar.gz")
SPARSE_TESTS = "tests/v1/attention/test_sparse_mla_backends.py"
# The file and what it imports from vLLM's test tree.
NEEDED = ("tests/__init__.py", "tests/v1/__init__.py", SPARSE_TESTS,
          "tests/v1/attention/test_mla_backends.py", "tests/v1/attention/utils.py")

FACTS = installed()
# Which tests of the release's file run without a GPU (the rest need Triton, FlashMLA or FA4:
# tests/vllm_own_tests_plugin.py skips them by name), or why the file does not run on a CPU.
CPU_TESTS = FACTS.own_tests_on_cpu
on_cpu = only_where(lambda f: f.own_tests_off_cpu is None, FACTS.own_tests_off_cpu or "")


# -- vLLM's own file ----------------------------------------------------------------------------


def vllm_test_tree(out: pathlib.Path) -> pathlib.Path | None:
    """A directory holding the installed vLLM version's sparse-MLA tests (the sdist's ``tests/`` files this needs),
    from ``$MLA_PLANNER_VLLM_SDIST`` (the sdist, or an unpacked source tree; it must be one), or
    else the default download place or a source install of vLLM; ``None`` if none is here."""
    import vllm

    named = os.environ.get(SDIST_VAR, "").strip()
    candidates = [pathlib.Path(named)] if named else [DEFAULT_SDIST, pathlib.Path(vllm.__file__).parents[1]]
    for source in candidates:
        if source.is_dir() and (source / SPARSE_TESTS).is_file():
            return source
        if source.is_file() and tarfile.is_tarfile(source):
            with tarfile.open(source) as sdist:
                top = sdist.getnames()[0].split("/")[0]
                if top != f"vllm-{VLLM_VERSION}":  # another version's tests say nothing of this one
                    if named:
                        pytest.fail(f"{SDIST_VAR}={named} is {top}, vLLM {VLLM_VERSION} is installed")
                    continue
                # Read the few files by name rather than extract the archive: nothing else lands.
                for name in NEEDED:
                    member = sdist.extractfile(f"{top}/{name}")
                    assert member is not None, f"{source}: {name} is not a file"
                    (out / name).parent.mkdir(parents=True, exist_ok=True)
                    (out / name).write_bytes(member.read())
            return out
    if named:
        pytest.fail(f"{SDIST_VAR}={named}: neither vLLM's sdist nor a source tree with {SPARSE_TESTS}; "
                    f"point it at vllm-{VLLM_VERSION}.tar.gz or an unpacked one, or unset it")
    return None


def vllm_test_tree_or_skip(out: pathlib.Path) -> pathlib.Path:
    """``vllm_test_tree(out)``, or the test skips saying how to get vLLM's tests."""
    tree = vllm_test_tree(out)
    if tree is None:
        pytest.skip(f"vLLM {VLLM_VERSION}'s {SPARSE_TESTS} is not here (its wheel has none): set {SDIST_VAR} to "
                    f"vllm-{VLLM_VERSION}.tar.gz from `pip download --no-deps --no-binary :all: vllm=={VLLM_VERSION}`, "
                    "or to an unpacked source tree")
    return tree


def start_vllm_tests(tree: pathlib.Path, classes: str, work: pathlib.Path, env: dict[str, str] | None = None,
                     args: tuple[str, ...] = ()) -> tuple[subprocess.Popen[str], pathlib.Path]:
    """vLLM's file in a pytest of its own (vLLM's file and the plugin patch its process), started
    in a process group of its own (``stop_vllm_tests``), reading model configurations from an
    offline stand-in hub (tests/vllm_hub.py); ``env``: more of its environment; ``args``: more
    pytest arguments (``-k``, xdist's ``-n``). Its JUnit report's path comes back with it; beside
    it, ``<classes>.jsonl`` gets each test's outcome as it finishes."""
    work.mkdir(parents=True, exist_ok=True)
    report = work / f"{classes}.xml"
    ini = work / "pytest.ini"
    ini.write_text("[pytest]\n")  # not vLLM's pytest settings, nor ours
    full_env = dict(os.environ, MLA_PLANNER_CLASSES=classes, **offline_hub(work / "hub"), **(env or {}),
                    MLA_PLANNER_OWN_TESTS_LOG=str(report.with_suffix(".jsonl")),
                    PYTHONPATH=os.pathsep.join([str(tree), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    log = (work / f"{classes}.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-c", str(ini), "--rootdir", str(tree), "-p", "no:cacheprovider",
         "--noconftest", "-p", "vllm_own_tests_plugin", f"--junitxml={report}", *args, str(tree / SPARSE_TESTS)],
        cwd=tree, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    return proc, report


def stop_vllm_tests(proc: subprocess.Popen[str]) -> None:
    """A started run stopped, its xdist workers with it (they share its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def outcomes_of(proc: subprocess.Popen[str], report: pathlib.Path, timeout_s: float = 600) -> dict[str, tuple[str, str]]:
    """Each test of a started run, by id: its outcome (passed, skipped, failed, error) and the
    first line of its failure's message."""
    proc.wait(timeout=timeout_s)
    log = pathlib.Path(str(report)[: -len(".xml")] + ".log").read_text()
    assert report.exists(), f"vLLM's tests did not run (exit {proc.returncode}):\n{log[-4000:]}"
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child for child in case if child.tag in ("failure", "error", "skipped")]
        kind = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(kinds[0].tag if kinds else "", "passed")
        message = (kinds[0].get("message") or "").strip().splitlines()[:1] if kinds else []
        outcomes[case.attrib["name"]] = (kind, message[0] if message else "")
    assert proc.returncode in (0, 1), f"pytest exit {proc.returncode}:\n{log[-4000:]}"
    if any(o in ("failed", "error") for o, _ in outcomes.values()):
        print(log[-8000:])
    return outcomes


def finished_outcomes(report: pathlib.Path) -> dict[str, tuple[str, str]]:
    """The outcomes a run (perhaps stopped midway) wrote as its tests finished, by test id."""
    path = report.with_suffix(".jsonl")
    lines = path.read_text().splitlines() if path.exists() else []
    return {entry["test"]: (entry["outcome"], entry["message"]) for entry in map(json.loads, lines)}


def engine_run(name: str) -> tuple[str, dict[str, str]] | None:
    """A run of vLLM's file by name, as ``MLA_PLANNER_OWN_TESTS_RUNS`` gives it: its classes and
    environment: ``stock``, ``planned`` (the default budget) or ``planned-N``
    (``MLA_PLANNER_SCRATCH_MB=N``); ``None`` for another name."""
    if name in ("stock", "planned"):
        return name, {}
    budget = re.fullmatch(r"planned-([1-9][0-9]*)", name)
    return ("planned", {"MLA_PLANNER_SCRATCH_MB": budget[1]}) if budget else None


def test_runs_are_named_by_classes_and_budget() -> None:
    assert engine_run("stock") == ("stock", {}) and engine_run("planned") == ("planned", {})
    assert engine_run("planned-130") == ("planned", {"MLA_PLANNER_SCRATCH_MB": "130"})
    assert [engine_run(bad) for bad in ("planned-0", "planned-", "planned-64x", "stock-64", "")] == [None] * 5


def run_vllm_tests(tree: pathlib.Path, classes: str, work: pathlib.Path) -> dict[str, str]:
    """Each test of vLLM's file, by id, and its outcome (passed, skipped, failed, error); the
    outcome log written as the tests finished says the same."""
    proc, report = start_vllm_tests(tree, classes, work)
    outcomes = outcomes_of(proc, report)
    assert finished_outcomes(report) == outcomes
    return {name: kind for name, (kind, _) in outcomes.items()}


def test_the_sdist_is_fetched_checked_and_kept(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/fetch_vllm_sdist.py (scripts/test.sh runs it): the file PyPI's JSON index names, its
    sha256 checked, kept for the next run; a wrong hash leaves nothing behind."""
    import hashlib
    import importlib.util
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    spec = importlib.util.spec_from_file_location("fetch_vllm_sdist", TESTS_DIR.parent / "scripts" / "fetch_vllm_sdist.py")
    assert spec is not None and spec.loader is not None
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    body = b"a tarball's bytes"
    served: dict[str, Any] = {"digest": hashlib.sha256(body).hexdigest(), "hits": 0}

    class Index(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/simple/vllm/":
                data = json.dumps({"files": [{"filename": "vllm-9.9.9.tar.gz", "url": f"{served['base']}/f",
                                              "hashes": {"sha256": served["digest"]}}]}).encode()
            else:
                served["hits"] += 1
                data = body
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Index)
    served["base"] = f"http://127.0.0.1:{httpd.server_address[1]}"
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(fetch, "INDEX", f"{served['base']}/simple/vllm/")
        monkeypatch.setattr(fetch, "version", lambda name: "9.9.9")
        got = fetch.fetch(tmp_path / "sdist")
        assert got == tmp_path / "sdist" / "vllm-9.9.9.tar.gz" and got.read_bytes() == body
        assert fetch.fetch(tmp_path / "sdist") == got and served["hits"] == 1  # kept: not fetched again
        served["digest"] = "0" * 64  # the index now names another file's hash
        with pytest.raises(ValueError, match="sha256 differs"):
            fetch.fetch(tmp_path / "other")
        assert list((tmp_path / "other").iterdir()) == []
        monkeypatch.setattr(fetch, "version", lambda name: "1.0.0")
        assert fetch.main([str(tmp_path / "other")]) == 1  # "lists no vllm-1.0.0.tar.gz": the test will skip
    finally:
        httpd.shutdown()
    assert fetch.main([]) == 2


@on_cpu
@pytest.mark.parametrize("classes", ["stock", "planned"])
def test_vllm_sparse_mla_tests_pass_with_planned_classes(classes: str, tmp_path: pathlib.Path) -> None:
    tree = vllm_test_tree_or_skip(tmp_path)
    work = tmp_path / "run"
    work.mkdir()
    outcomes = run_vllm_tests(tree, classes, work)
    broken = {name: o for name, o in outcomes.items() if o in ("failed", "error")}
    assert not broken, f"vLLM's tests with the {classes} classes: {broken}"
    passed = {name for name, o in outcomes.items() if o == "passed"}
    assert passed == CPU_TESTS, \
        f"expected vLLM's CPU tests to pass: missing {CPU_TESTS - passed}, extra {passed - CPU_TESTS}"


@on_cpu
def test_a_run_stopped_midway_still_says_what_it_ran(tmp_path: pathlib.Path) -> None:
    """The GPU runs are stopped at a deadline: the tests finished by then are in the outcome log."""
    tree = vllm_test_tree_or_skip(tmp_path / "tree")
    proc, report = start_vllm_tests(tree, "stock", tmp_path / "run")
    log = report.with_suffix(".jsonl")
    deadline = time.monotonic() + 240
    while proc.poll() is None and not (log.exists() and log.read_text().count("\n") >= 3):
        assert time.monotonic() < deadline, "no test finished in 240 s"
        time.sleep(0.05)
    stop_vllm_tests(proc)
    finished = finished_outcomes(report)
    assert proc.returncode is not None and len(finished) >= 3
    assert all(kind in ("passed", "skipped") for kind, _ in finished.values()), finished


def test_every_model_vllms_file_names_has_an_offline_stand_in(tmp_path: pathlib.Path) -> None:
    """The GPU machine reaches no network: each hub id the file builds a configuration of has a
    stand-in, from which vLLM's ModelConfig builds with the hub offline."""
    tree = vllm_test_tree_or_skip(tmp_path / "tree")
    named = hub_ids_in(tree / SPARSE_TESTS)
    assert named and named <= set(STAND_INS), f"no stand-in for {named - set(STAND_INS)}: add them to tests/vllm_hub.py"
    env = dict(os.environ, **offline_hub(tmp_path / "hub"))
    script = ("import sys; from vllm.config import ModelConfig\n"
              "for name in sys.argv[1:]:\n"
              "    m = ModelConfig(model=name, tokenizer=name, trust_remote_code=False, dtype='auto', seed=0, max_model_len=1024)\n"
              "    print(name, m.architectures[0], m.use_mla)\n")
    out = subprocess.run([sys.executable, "-c", script, *sorted(named)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "deepseek-ai/DeepSeek-V2-Lite-Chat DeepseekV2ForCausalLM True" in out.stdout.splitlines()


# -- the same calls, here -----------------------------------------------------------------------


def test_no_override_reaches_stock_through_zero_argument_super() -> None:
    tree = ast.parse(inspect.getsource(backend))
    bare = [
        node.lineno for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args
    ]
    assert bare == [], f"backend.py lines {bare}: call the stock class's method with self instead"


def separate_metadata(num_tokens: int, num_decodes: int, num_prefills: int, num_decode_tokens: int) -> FlashMLASparseMetadata:
    num_reqs = num_decodes + num_prefills
    return FlashMLASparseMetadata(
        num_reqs=num_reqs, max_query_len=num_tokens, max_seq_len=num_tokens, num_actual_tokens=num_tokens,
        query_start_loc=torch.zeros(num_reqs + 1, dtype=torch.int32), slot_mapping=torch.arange(num_tokens),
        block_table=torch.zeros(num_reqs, 1, dtype=torch.int32), req_id_per_token=torch.zeros(num_tokens, dtype=torch.int32),
        num_decodes=num_decodes, num_prefills=num_prefills, num_decode_tokens=num_decode_tokens,
    )


def fields(value: Any) -> Any:
    """A dataclass tree as plain values, tensors as lists, for comparing two builds."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [fields(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {name: fields(getattr(value, name)) for name in value.__dataclass_fields__}
    return value


@pytest.fixture
def no_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **k: zeros(*a, **k))


def test_builder_fp8_separate_metadata_with_a_stand_in_self(no_pinned_memory: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stock, "get_mla_metadata", lambda: (object(), None))
    # vLLM's tests: a prefill-only step, and decodes whose last request is zero-token padding.
    prefill = (
        # Some releases read the workspace factor and the PCP+DCP flag too; the others ignore them.
        SimpleNamespace(device=torch.device("cpu"), pcp_dcp_kv_gather=False, vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=8),
            attention_config=SimpleNamespace(sparse_mla_prefill_workspace_factor=5))),
        SimpleNamespace(num_actual_tokens=1, seq_lens_cpu_upper_bound=torch.tensor([1]), seq_lens=torch.tensor([1]),
                        query_start_loc_cpu=torch.tensor([0, 1]), block_table_tensor=torch.zeros(1, 1, dtype=torch.int32)),
        separate_metadata(1, 0, 1, 0),
    )
    padded = (
        SimpleNamespace(device=torch.device("cpu"), dummy_block_table=torch.zeros(7, 1), max_model_len_tensor=torch.zeros(7),
                        pcp_dcp_kv_gather=False),
        SimpleNamespace(num_actual_tokens=660, query_start_loc_cpu=torch.tensor([0, 110, 220, 330, 440, 550, 660, 660]),
                        seq_lens=torch.arange(7)),
        separate_metadata(660, 7, 0, 660),
    )
    for builder, common, metadata in (prefill, padded):
        ours = PlannedFlashMLASparseMetadataBuilder._build_fp8_separate_prefill_decode(builder, common, metadata)  # type: ignore[arg-type]
        theirs = FlashMLASparseMetadataBuilder._build_fp8_separate_prefill_decode(builder, common, metadata)  # type: ignore[arg-type]
        ours_fields, theirs_fields = fields(ours), fields(theirs)
        for meta in (ours_fields, theirs_fields):  # a fresh object() per call: compare the rest
            if meta["decode"] is not None:
                meta["decode"]["kernel_metadata"]["scheduler_metadata"] = None
        assert ours_fields == theirs_fields
    assert (ours.num_decodes, ours.num_decode_tokens, ours.decode.decode_query_len) == (6, 660, 110)  # type: ignore[union-attr]


def test_builder_fp8_mixed_metadata_with_a_stand_in_self(monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = object()
    monkeypatch.setattr(stock, "get_mla_metadata", lambda **kwargs: (schedule, None))
    builder = SimpleNamespace(fp8_decode_padded_heads=64, topk_tokens=128, topk_tokens_tensor=torch.full((4,), 128),
                              max_model_len_tensor=torch.full((4,), 4096), dummy_block_table=torch.zeros(4, 1))
    # Whether stock's takes the step's metadata is the release's (release.build_fp8_mixed).
    common = (SimpleNamespace(num_actual_tokens=5),) if FACTS.fp8_mixed_build_takes_common else ()
    ours = PlannedFlashMLASparseMetadataBuilder._build_fp8_mixed_decode_prefill(builder, *common)  # type: ignore[arg-type]
    theirs = FlashMLASparseMetadataBuilder._build_fp8_mixed_decode_prefill(builder, *common)  # type: ignore[arg-type]
    assert fields(ours) == fields(theirs)
    assert ours.scheduler_metadata is schedule


def test_builder_build_with_a_stand_in_self(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``build`` on a stock builder is stock's build: stock's metadata, no plan, and no engine's
    scratch reservation handed over; on a namespace it fails as stock's does."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    monkeypatch.delenv("MLA_PLANNER_COST_PROFILE", raising=False)
    released: list[bool] = []

    def release(self: Reservation) -> bool:
        released.append(True)
        return True

    monkeypatch.setattr(Reservation, "release", release)
    config = vllm_config(model_dir(tmp_path, num_heads=16, topk=128))
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8, cache_dtype_str="fp8_ds_mla")
    common = common_metadata([1, 1, 300], [70, 5, 0], torch.arange(12, dtype=torch.int32).view(3, 4))
    with cpu_vllm(monkeypatch, RecordingProvider(), KernelRecorder()), set_current_vllm_config(config):
        stock_builder = FlashMLASparseMetadataBuilder(spec, ["layers.0.attn"], config, torch.device("cpu"))
        ours = PlannedFlashMLASparseMetadataBuilder.build(stock_builder, 0, common)  # type: ignore[arg-type]
        theirs = FlashMLASparseMetadataBuilder.build(stock_builder, 0, common)
    assert type(ours) is FlashMLASparseMetadata and not hasattr(ours, "planned")
    assert ours.fp8_use_mixed_batch == theirs.fp8_use_mixed_batch
    assert fields(ours.fp8_extra_metadata)["cache_lens"] == fields(theirs.fp8_extra_metadata)["cache_lens"]
    assert released == [], "a stand-in builder must not hand over a reservation"

    stand_in = SimpleNamespace(use_fp8_kv_cache=True, num_heads=16)
    errors = []
    for cls in (PlannedFlashMLASparseMetadataBuilder, FlashMLASparseMetadataBuilder):
        with pytest.raises(TypeError) as err:
            cls.build(stand_in, 0, common)  # type: ignore[arg-type]
        errors.append(str(err.value))
    assert errors[0] == errors[1], "a namespace fails in stock's own super(), as with stock's class"


def fp8_decode_subset_case(use_mixed_batch: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """vLLM's ``test_flashmla_fp8_paths_accept_decode_subset``: q holds only the step's 2 decode
    tokens of 5 (the prefills went to dense MHA); the impl is a namespace with a recording kernel."""
    num_decode_tokens, num_batch_tokens = 2, 5
    q = torch.zeros(num_decode_tokens, 2, 3)
    topk_indices = torch.zeros(num_decode_tokens, 4)
    kernel_q_shapes: list[tuple[int, ...]] = []

    def convert_indices(*args: Any, **kwargs: Any) -> Any:
        assert not kwargs.get("HAS_PREFILL_WORKSPACE", False)
        if not kwargs.get("return_valid_counts", False):
            return topk_indices
        return topk_indices, torch.full((num_decode_tokens,), 4, dtype=torch.int32)

    def run_kernel(**kwargs: Any) -> tuple[torch.Tensor, None]:
        kernel_q_shapes.append(tuple(kwargs["q"].shape))
        return kwargs["q"][..., :1], None

    monkeypatch.setattr(stock, "triton_convert_req_index_to_global_index", convert_indices)
    # The backend calls it through the release, from sparse_utils.
    monkeypatch.setattr(sparse_utils, "triton_convert_req_index_to_global_index", convert_indices)
    fp8: Any
    if use_mixed_batch:
        fp8 = FlashMLASparseMetadata.FP8KernelMetadata(
            scheduler_metadata=object(), dummy_block_table=torch.zeros(1, 1, dtype=torch.int32),  # type: ignore[arg-type]
            cache_lens=torch.zeros(1, dtype=torch.int32))
    else:
        meta = FlashMLASparseMetadata.FP8SeparatePrefillDecode
        fp8 = meta(
            num_decodes=1, num_prefills=1, num_decode_tokens=num_decode_tokens,
            num_prefill_tokens=num_batch_tokens - num_decode_tokens,
            decode=meta.Decode(seq_lens=torch.zeros(1, dtype=torch.int32), kernel_metadata=object(),  # type: ignore[arg-type]
                               decode_query_len=num_decode_tokens),
            prefill=meta.Prefill(request_ids=torch.zeros(num_batch_tokens, dtype=torch.int32),
                                 workspace_starts=torch.zeros(1, dtype=torch.int32), chunks=[]),
        )
    metadata = SimpleNamespace(fp8_extra_metadata=fp8, fp8_use_mixed_batch=use_mixed_batch, num_actual_tokens=num_batch_tokens,
                               req_id_per_token=torch.zeros(num_batch_tokens, dtype=torch.int32),
                               block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=64,
                               num_decode_tokens=num_decode_tokens)
    # Some releases' stock also reads the query width, context parallelism and the index group.
    impl = SimpleNamespace(kv_cache_dtype="fp8_ds_mla", topk_indices_buffer=topk_indices, num_heads=2, kv_lora_rank=1,
                           _fp8_flash_mla_kernel=run_kernel, q_head_size=3, dcp_world_size=1,
                           need_to_return_lse_for_decode=False, pcp_dcp_kv_gather=False, index_group=None,
                           _convert_logical_to_physical_topk=lambda topk, md, *, block_stride_rows, return_valid_counts:
                           convert_indices(return_valid_counts=return_valid_counts))
    return q, metadata, impl, kernel_q_shapes


@pytest.mark.parametrize("use_mixed_batch", [False, True])
def test_impl_fp8_paths_with_a_stand_in_self(use_mixed_batch: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    results = {}
    for cls in (PlannedFlashMLASparseImpl, FlashMLASparseImpl):
        q, metadata, impl, kernel_q_shapes = fp8_decode_subset_case(use_mixed_batch, monkeypatch)
        # As vLLM's test binds them: the class's FP8 paths, on the namespace.
        impl._forward_fp8_kv_mixed_batch = MethodType(cls._forward_fp8_kv_mixed_batch, impl)
        impl._forward_fp8_kv_separate_prefill_decode = MethodType(cls._forward_fp8_kv_separate_prefill_decode, impl)
        output, lse = cls.forward_mqa(impl, q, torch.zeros(0), metadata, None)  # type: ignore[arg-type]
        results[cls.__name__] = (output.tolist(), lse, kernel_q_shapes)
    assert results["PlannedFlashMLASparseImpl"] == results["FlashMLASparseImpl"]
    assert results["PlannedFlashMLASparseImpl"][2] == [(1, 2, 2, 3)]
