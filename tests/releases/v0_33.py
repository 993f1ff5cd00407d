"""What the tests expect of vLLM 0.33.0 (docs/results-vllm-0.33.md for the measured figures)."""

from __future__ import annotations

from . import ReleaseFacts

FACTS = ReleaseFacts(
    version="0.33.0",
    test_extra="test-vllm033",
    # The padded q and output are vLLM's workspace views, so the reservation holds neither them nor
    # the output: 676 MiB at 16 heads and the default budget, whatever the step size.
    logged_reservation_mib={32_768: 676},
    reservation_holds_step_output=False,
    # Model runner V2 runs these models, and its warm-up step their attention: every fresh server at
    # 0.95 died in it (33.4); at 0.90 it served.
    warm_up_attends=True,
    fails_at_095="start-up",
    verdict_at_095=("stock: fails at start-up: vLLM 0.33.0's warm-up runs a 32,768-token step "
                    "(1,024 requests of 32 tokens, decode-only)"),
    text_at_095=("start-up    vLLM 0.33.0's warm-up, once the KV cache is allocated: a 32,768-token step",
                 "through the sparse-MLA kernels; stock 12.27 GiB: FAILS\n"),
    warm_up_at_095={"attends": True, "num_tokens": 32_768, "num_requests": 1024, "query_lens": [32], "num_decodes": 1024},
    warm_up_why="",
    # At 16 heads both routes' largest launches lie within the workspace's padded views.
    profile_widens_reservation=False,
    dummy_query_lens_10_over_4=(2, 2, 3, 3),
    # 33.21: the accumulators' 8 GiB ask came with 2.02 GiB free of the 6.15 beside the engine at 0.95.
    decode_call_free_gib=2.02,
    # TP 1 measured under 0.33 (33.35); no TP 2 engine has run under it.
    step_reserve_measured_under=("0.33", "0.26"),
    packaged_profile_gpus=("H100", "H200"),
    forward_returns_lse=True,
    stock_workspace=True,
    masked_mha=True,
    # FlashMLA has the 64-head Blackwell prefill kernel, and the unpadded 16- and 32-head ones on SM90.
    native_prefill_kernels=True,
    prefill_padded_heads=(("sm90", 64), ("sm100", 64)),
    index_groups=True,
    multi_page_blocks=True,
    # hf_text_config holds it; vLLM deletes it from hf_config.
    topk_in_hf_text_config=True,
    fixes_route_under=("hisparse", "dcp"),
    # Its builder reads the step from its own state.
    fp8_mixed_build_takes_common=False,
    own_tests_off_cpu=("its sparse-MLA file cannot be collected on a CPU (it needs vLLM's compiled ops): it runs "
                       "on the GPU, tests/gpu/test_gpu_vllm_own_tests.py"),
)
