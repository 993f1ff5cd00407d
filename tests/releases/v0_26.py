"""What the tests expect of vLLM 0.26.0 (docs/results-vllm-0.26.md for the measured figures)."""

from __future__ import annotations

from . import ReleaseFacts

FACTS = ReleaseFacts(
    version="0.26.0",
    test_extra="test",
    # "1535 MiB reserved" in the plugin's log at 32K; the reservation holds the step's output, which
    # the executors allocate (no workspace holds it).
    logged_reservation_mib={32_768: 1535, 65_536: 2047},
    reservation_holds_step_output=True,
    # Model runner V1 runs these models: its warm-up step builds no attention metadata. At 0.95 the
    # server started and died at the first 32K prompt.
    warm_up_attends=False,
    fails_at_095="worst step",
    verdict_at_095="stock: OOM at the first 32,768-token step",
    text_at_095=("start-up    vLLM 0.26.0's warm-up, once the KV cache is allocated: a 32,768-token step; model "
                 "runner V1 builds no attention metadata for it, so the sparse-MLA kernels do not run in it",),
    warm_up_at_095={"attends": False, "stock": None},
    warm_up_why="model runner V1",
    # vLLM's rule takes the mixed route at 16 heads; a profile adds the separate one.
    profile_widens_reservation=True,
    dummy_query_lens_10_over_4=(2, 2, 2, 4),
    step_reserve_measured_under=("0.26", "0.26"),
    # Stock's 32K step at TP 2 failed at 0.95 and 0.90 and ran at 0.85.
    tp2_stock_32k_fits=((0.95, False), (0.90, False), (0.85, True)),
    # "KV cache against stock's": s1's model loading 2.11 GiB against s2's 1.82 (the MTP layer and
    # the draft's own top-k buffer, which vLLM replaces by the target's).
    mtp_draft_loading_gib=("0.26 matrix s1 stock twin (run E)", 2.11 - 1.82),
    packaged_profile_gpus=("H100", "H200"),
    # FlashMLA pads the prefill kernel's q to 128 heads on Blackwell, and runs no unpadded 16 or 32.
    prefill_padded_heads=(("sm90", 64), ("sm100", 128)),
    # vLLM's own sparse-MLA file: every test that runs without a GPU (the rest need Triton, FlashMLA
    # or FA4: tests/vllm_own_tests_plugin.py skips them by name).
    own_tests_on_cpu=frozenset({
        *(f"test_split_prefill_chunks[seq_lens{i}-{buf}-expected{i}]" for i, buf in enumerate([5, 5, 10, 100])),
        *(f"test_split_indexer_prefill_chunks[seq_lens{i}-query_lens{i}-{ws}-{lb}-expected{i}]"
          for i, (ws, lb) in enumerate([(100, 1000), (1000, 5000), (100, 10000), (50, 1000000), (100, 1000)])),
        "test_split_indexer_prefill_chunks_single_request_overflow",
        "test_flashmla_cache_dtype_aliases_use_ds_layout",
        "test_flashmla_fp8_metadata_reuses_common_batch_split",
        "test_flashmla_common_metadata_requires_uniform_decodes",
        "test_flashmla_fp8_metadata_excludes_zero_token_decode_padding",
        "test_flashmla_fp8_paths_accept_decode_subset[False]",
        "test_flashmla_fp8_paths_accept_decode_subset[True]",
    }),
)
