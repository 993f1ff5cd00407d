//! Masked-MHA routing of a prefill set (where vLLM has it: SM100 with FA4 and a
//! BF16 KV cache): which top-k masks a set needs, whether they fit the mask
//! workspace, and a partition into groups that each fit, so masked MHA stays
//! in use where vLLM would send the whole step to sparse MQA.

use std::ops::Range;

use super::gather::check_requests;
use super::PrefillRequest;
use crate::error::{check_launches, PlanError, Result};
use crate::scratch::{topk_mask_shape, MaskShape, GLOBAL_TOPK_MASK_MAX_BYTES};

/// How one group of prefills is attended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillPath {
    /// Every sequence is within top-k: plain causal MHA.
    DenseMha,
    /// MHA with a bit-packed top-k mask.
    MaskedMha,
    /// The sparse MQA kernels (FlashMLA sparse prefill or decode).
    SparseMqa,
}

impl PrefillPath {
    pub fn name(self) -> &'static str {
        match self {
            PrefillPath::DenseMha => "dense_mha",
            PrefillPath::MaskedMha => "masked_mha",
            PrefillPath::SparseMqa => "sparse_mqa",
        }
    }
}

/// What masked-MHA routing needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskConfig {
    pub topk: u32,
    /// The mask workspace (vLLM: `GLOBAL_TOPK_MASK_MAX_BYTES`).
    pub workspace_bytes: u64,
    /// Rows of the chunked-context workspace: no context chunk holds a
    /// longer per-request slice, so it bounds a chunk mask's key length.
    pub context_chunk_rows: u64,
    /// SM100, FA4 and a BF16 KV cache (vLLM's `_is_masked_mha_available`).
    pub available: bool,
    /// Every prefill runs sparse MQA, short ones too: vLLM's
    /// `attention_config.sparse_mla_force_mqa`, or no dense prefill backend.
    pub force_mqa: bool,
}

impl MaskConfig {
    pub fn vllm_default(topk: u32, available: bool) -> Self {
        MaskConfig {
            topk,
            workspace_bytes: GLOBAL_TOPK_MASK_MAX_BYTES,
            context_chunk_rows: 64 * 1024,
            available,
            force_mqa: false,
        }
    }
}

/// The masks a prefill set needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskSet {
    /// Causal mask over the new tokens: key length = query length.
    pub suffix: MaskShape,
    /// The largest per-context-chunk mask (key length = the chunk's longest
    /// per-request context slice); `None` without context.
    pub context_chunk: Option<MaskShape>,
    /// One mask over whole sequences plus the key-starts word, tried first
    /// when there is context; used only if it fits.
    pub global: Option<MaskShape>,
    /// The shape vLLM's fit test sizes: all prefills, the longest query,
    /// the longest of query and context-chunk keys.
    pub fit_test: MaskShape,
    /// `fit_test` fits the workspace (`_masked_mha_workspace_fits`).
    pub fits: bool,
    /// The global mask fits too, and replaces the suffix and chunk masks.
    pub global_fits: bool,
}

impl MaskSet {
    /// Bytes of the largest mask built at once (masks reuse the workspace
    /// one after another).
    pub fn peak_bytes(&self) -> Result<u64> {
        if let (true, Some(global)) = (self.global_fits, self.global) {
            return global.bytes();
        }
        let suffix = self.suffix.bytes()?;
        Ok(match self.context_chunk {
            Some(c) => suffix.max(c.bytes()?),
            None => suffix,
        })
    }
}

/// Whether a mask of `shape` fits a workspace of `workspace_bytes`, counted
/// in int32 words as vLLM counts them. A mask too large to count fits no
/// workspace.
fn fits_workspace(shape: &MaskShape, workspace_bytes: u64) -> Result<bool> {
    match shape.bytes() {
        Ok(bytes) => Ok(bytes / 4 <= workspace_bytes / 4),
        Err(PlanError::Overflow { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// vLLM's `_masked_mha_workspace_fits`: one shape bounds the suffix mask and
/// every context-chunk mask — all prefills, the longest query, the longer of
/// that query and the longest context-chunk slice. The global mask is not in
/// it: it is tried on its own and dropped when too big.
pub fn masked_mha_workspace_fits(
    batch_size: u64,
    max_query_len: u64,
    max_context_chunk_seq_len: u64,
    workspace_bytes: u64,
) -> Result<bool> {
    fits_workspace(&fit_test_shape(batch_size, max_query_len, max_context_chunk_seq_len)?, workspace_bytes)
}

fn fit_test_shape(batch_size: u64, max_query_len: u64, max_context_chunk_seq_len: u64) -> Result<MaskShape> {
    topk_mask_shape(batch_size, max_query_len, max_query_len.max(max_context_chunk_seq_len), false)
}

/// The masks of `requests` taken as one prefill set.
pub fn prefill_masks(requests: &[PrefillRequest], cfg: &MaskConfig) -> Result<MaskSet> {
    check_requests(requests)?;
    SetSummary::of(requests, cfg).masks(cfg)
}

/// Everything the masks and the route of a prefill set depend on: counts
/// and maxima, so a group grows one request at a time without rescanning
/// it.
#[derive(Debug, Clone, Copy, Default)]
struct SetSummary {
    batch: u64,
    max_q: u64,
    max_seq: u64,
    /// Requests with context, and the longest query among them.
    with_context: u64,
    context_max_q: u64,
    /// The longest per-request context slice one context chunk holds.
    chunk_keys: u64,
}

impl SetSummary {
    fn of(requests: &[PrefillRequest], cfg: &MaskConfig) -> Self {
        requests.iter().fold(SetSummary::default(), |set, r| set.with(r, cfg))
    }

    /// The set with `r` added. Counts are at most the requests' number and
    /// maxima at most one request's size, so nothing here can wrap.
    fn with(self, r: &PrefillRequest, cfg: &MaskConfig) -> Self {
        let mut set = SetSummary {
            batch: self.batch + 1,
            max_q: self.max_q.max(r.query_len),
            max_seq: self.max_seq.max(r.seq_len()),
            ..self
        };
        if r.context_len > 0 {
            set.with_context += 1;
            set.context_max_q = set.context_max_q.max(r.query_len);
            set.chunk_keys = set.chunk_keys.max(r.context_len.min(cfg.context_chunk_rows));
        }
        set
    }

    fn masks(&self, cfg: &MaskConfig) -> Result<MaskSet> {
        let SetSummary { batch, max_q, max_seq, with_context, context_max_q, chunk_keys } = *self;
        let suffix = topk_mask_shape(batch, max_q, max_q, false)?;
        let (context_chunk, global) = if with_context == 0 {
            (None, None)
        } else {
            (
                Some(topk_mask_shape(with_context, context_max_q, chunk_keys, false)?),
                Some(topk_mask_shape(batch, max_q, max_seq, true)?),
            )
        };
        let fit_test = fit_test_shape(batch, max_q, chunk_keys)?;
        let fits = fits_workspace(&fit_test, cfg.workspace_bytes)?;
        let global_fits = match &global {
            Some(g) => fits_workspace(g, cfg.workspace_bytes)?,
            None => false,
        };
        Ok(MaskSet { suffix, context_chunk, global, fit_test, fits, global_fits })
    }

    fn route(&self, cfg: &MaskConfig) -> Result<(PrefillPath, MaskSet)> {
        let masks = self.masks(cfg)?;
        let route = if cfg.force_mqa {
            PrefillPath::SparseMqa
        } else if self.max_seq <= u64::from(cfg.topk) {
            PrefillPath::DenseMha
        } else if cfg.available && masks.fits {
            PrefillPath::MaskedMha
        } else {
            PrefillPath::SparseMqa
        };
        Ok((route, masks))
    }

    fn group(&self, requests: Range<usize>, cfg: &MaskConfig) -> Result<PrefillGroup> {
        let (route, masks) = self.route(cfg)?;
        let mask_bytes = if route == PrefillPath::MaskedMha { masks.peak_bytes()? } else { 0 };
        Ok(PrefillGroup { requests, path: route, mask_bytes })
    }
}

/// A contiguous group of prefills and how it is attended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillGroup {
    pub requests: Range<usize>,
    pub path: PrefillPath,
    /// Bytes of the largest mask, for masked MHA; 0 otherwise.
    pub mask_bytes: u64,
}

/// vLLM's decision: one route for the whole prefill set.
pub fn stock_prefill_groups(requests: &[PrefillRequest], cfg: &MaskConfig) -> Result<Vec<PrefillGroup>> {
    if requests.is_empty() {
        return Ok(vec![]);
    }
    check_requests(requests)?;
    Ok(vec![SetSummary::of(requests, cfg).group(0..requests.len(), cfg)?])
}

/// The fewest contiguous groups that each run as MHA (dense or masked); a
/// request that cannot run as MHA even alone goes to sparse MQA, together
/// with its neighbours that cannot either. Both conditions only get harder
/// as a group grows, so growing each group greedily is optimal.
pub fn plan_prefill_groups(requests: &[PrefillRequest], cfg: &MaskConfig) -> Result<Vec<PrefillGroup>> {
    if !cfg.available {
        return stock_prefill_groups(requests, cfg);
    }
    check_requests(requests)?;
    let runs_as_mha = |set: &SetSummary| -> Result<bool> { Ok(set.route(cfg)?.0 != PrefillPath::SparseMqa) };
    let alone = |i: usize| SetSummary::default().with(&requests[i], cfg);
    let mut groups: Vec<PrefillGroup> = Vec::new();
    let mut start = 0;
    while start < requests.len() {
        let mut set = alone(start);
        let mut end = start + 1;
        if runs_as_mha(&set)? {
            while end < requests.len() {
                let grown = set.with(&requests[end], cfg);
                if !runs_as_mha(&grown)? {
                    break;
                }
                (set, end) = (grown, end + 1);
            }
        } else {
            while end < requests.len() && !runs_as_mha(&alone(end))? {
                (set, end) = (set.with(&requests[end], cfg), end + 1);
            }
        }
        // Every group is at least one attention call of the step.
        check_launches("the prefill groups", groups.len() as u64 + 1, "pass fewer prefill requests at once")?;
        groups.push(set.group(start..end, cfg)?);
        start = end;
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scratch::topk_mask_bytes;
    use proptest::prelude::*;

    fn req(query_len: u64, context_len: u64) -> PrefillRequest {
        PrefillRequest { query_len, context_len }
    }

    fn cfg() -> MaskConfig {
        MaskConfig::vllm_default(2048, true)
    }

    #[test]
    fn forced_mqa_routes_every_prefill_to_sparse_mqa() {
        let short =
            [PrefillRequest { query_len: 100, context_len: 0 }, PrefillRequest { query_len: 5000, context_len: 0 }];
        assert_eq!(plan_prefill_groups(&short[..1], &cfg()).unwrap()[0].path, PrefillPath::DenseMha);
        let forced = MaskConfig { force_mqa: true, ..cfg() };
        for groups in [plan_prefill_groups(&short, &forced).unwrap(), stock_prefill_groups(&short, &forced).unwrap()] {
            assert!(groups.iter().all(|g| g.path == PrefillPath::SparseMqa && g.mask_bytes == 0));
        }
    }

    #[test]
    fn fit_boundary_matches_vllm() {
        assert!(prefill_masks(&[req(32768, 0)], &cfg()).unwrap().fits);
        assert!(!prefill_masks(&[req(33024, 0)], &cfg()).unwrap().fits);
        assert!(prefill_masks(&[req(16384, 0), req(16384, 0)], &cfg()).unwrap().fits);
        // The global mask is left out of the fit test.
        let set = prefill_masks(&[req(1000, 60000)], &cfg()).unwrap();
        assert_eq!(set.fit_test, topk_mask_shape(1, 1000, 60000, false).unwrap());
        assert_eq!(set.global.unwrap(), topk_mask_shape(1, 1000, 61000, true).unwrap());
        assert!(set.fits && set.global_fits);
    }

    #[test]
    fn stock_falls_back_whole_planned_keeps_masked_mha() {
        // Two 24K prompts: 2 x 24576 x 768 words = 144 MiB > 128 MiB together, 72 MiB alone.
        let reqs = [req(24576, 0), req(24576, 0)];
        assert_eq!(topk_mask_bytes(2, 24576, 24576, false).unwrap(), 144 << 20);
        let stock = stock_prefill_groups(&reqs, &cfg()).unwrap();
        assert_eq!(stock.len(), 1);
        assert_eq!(stock[0].path, PrefillPath::SparseMqa);
        let planned = plan_prefill_groups(&reqs, &cfg()).unwrap();
        assert_eq!(planned.iter().map(|g| g.path).collect::<Vec<_>>(), [PrefillPath::MaskedMha; 2]);
        assert_eq!(planned[0].mask_bytes, 72 << 20);
    }

    #[test]
    fn too_large_alone_goes_to_mqa_with_its_neighbours() {
        let reqs = [req(4096, 0), req(40000, 0), req(50000, 0), req(3000, 0)];
        let groups = plan_prefill_groups(&reqs, &cfg()).unwrap();
        let routes: Vec<_> = groups.iter().map(|g| (g.requests.clone(), g.path)).collect();
        assert_eq!(
            routes,
            [(0..1, PrefillPath::MaskedMha), (1..3, PrefillPath::SparseMqa), (3..4, PrefillPath::MaskedMha)]
        );
    }

    #[test]
    fn short_sequences_are_dense() {
        let groups = plan_prefill_groups(&[req(1000, 1000), req(5, 0)], &cfg()).unwrap();
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].path, PrefillPath::DenseMha);
        let unavailable = MaskConfig::vllm_default(2048, false);
        let groups = plan_prefill_groups(&[req(24576, 0), req(24576, 0)], &unavailable).unwrap();
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].path, PrefillPath::SparseMqa);
    }

    /// The route of a set taken whole, as vLLM decides it.
    fn route_of(requests: &[PrefillRequest], cfg: &MaskConfig) -> PrefillPath {
        stock_prefill_groups(requests, cfg).unwrap()[0].path
    }

    /// Fewest contiguous groups, by dynamic programming over every cut.
    fn brute_force(reqs: &[PrefillRequest], cfg: &MaskConfig) -> usize {
        let ok = |a: usize, b: usize| route_of(&reqs[a..b], cfg) != PrefillPath::SparseMqa;
        let mut best = vec![usize::MAX; reqs.len() + 1];
        best[0] = 0;
        for end in 1..=reqs.len() {
            for start in 0..end {
                let all_mqa = (start..end).all(|i| !ok(i, i + 1));
                if best[start] != usize::MAX && (ok(start, end) || all_mqa) {
                    best[end] = best[end].min(best[start] + 1);
                }
            }
        }
        best[reqs.len()]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        #[test]
        fn groups_are_minimal_and_fit(
            reqs in prop::collection::vec((1u64..40_000, 0u64..80_000), 0..8),
            mib in 1u64..256,
        ) {
            let reqs: Vec<_> = reqs.into_iter().map(|(q, c)| req(q, c)).collect();
            let c = MaskConfig { workspace_bytes: mib << 20, ..cfg() };
            let groups = plan_prefill_groups(&reqs, &c).unwrap();
            let mut next = 0;
            for g in &groups {
                prop_assert_eq!(g.requests.start, next);
                next = g.requests.end;
                if g.path == PrefillPath::MaskedMha {
                    prop_assert!(g.mask_bytes <= c.workspace_bytes);
                }
            }
            prop_assert_eq!(next, reqs.len());
            prop_assert_eq!(groups.len(), brute_force(&reqs, &c));
        }
    }
}
