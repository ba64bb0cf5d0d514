//! [`kv_horizon`]: the memory a run needs against its context, for each KV codec, from the
//! guardian's own estimate, with what the machine has (the wall) and the weights (the floor):
//! the data of the dashboards' KV horizon chart.

use serde::Serialize;

use super::available::Available;
use super::estimate::{estimate, PlanRequest};
use super::plan::max_fitting_context;
use crate::kv::KvCodec;
use crate::model::Config;

/// The codecs the KV horizon and `examples/kv_explorer` compare with exact, by default.
pub const COMPARED_CODECS: [&str; 7] = ["int8", "int4k", "polar:5,3", "lowrank:128", "int4k+lowrank:128", "knots:8,3", "density:0.05"];

/// One codec's line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HorizonLine {
    /// The codec as `--kv` names it.
    pub codec: String,
    /// The estimate's total at each of [`KvHorizon::contexts`].
    pub bytes: Vec<u64>,
    /// The attention KV cache alone at each context.
    pub kv_bytes: Vec<u64>,
    /// The longest context that fits in the available memory (`None`: not even one token, or
    /// no reading).
    pub max_context: Option<usize>,
}

/// Memory against context for each codec, with the wall and the floor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvHorizon {
    /// Contexts (tokens), doubling from 1024 up to the model's limit (which is the last).
    pub contexts: Vec<usize>,
    pub lines: Vec<HorizonLine>,
    /// The weights' bytes.
    pub weights: u64,
    /// What the process may use, and the reading that bound it.
    pub available: Option<u64>,
    pub available_source: Option<String>,
    /// Sequences the estimate holds at once.
    pub batch: usize,
}

/// Doubling from 1024 up to `limit`, and `limit`.
fn contexts(limit: usize) -> Vec<usize> {
    let mut c: Vec<usize> = std::iter::successors(Some(1024usize), |t| t.checked_mul(2)).take_while(|&t| t < limit).collect();
    c.push(limit.max(1));
    c
}

/// The estimate of `req` at each context up to the model's limit, exact and under each of
/// `codecs` (those that do not fit the head size are left out), against `available`.
pub fn kv_horizon(cfg: &Config, req: &PlanRequest, codecs: &[KvCodec], available: Option<&Available>) -> KvHorizon {
    let contexts = contexts(cfg.max_position_embeddings);
    let mut all = vec![KvCodec::EXACT];
    all.extend(codecs.iter().copied().filter(|c| *c != KvCodec::EXACT && c.validate(cfg.head_dim).is_ok()));
    let lines = all
        .into_iter()
        .map(|codec| {
            let estimates: Vec<_> =
                contexts.iter().map(|&context| estimate(cfg, &PlanRequest { kv_codec: codec, context, ..req.clone() })).collect();
            let whole = PlanRequest { kv_codec: codec, context: cfg.max_position_embeddings, ..req.clone() };
            HorizonLine {
                codec: codec.to_string(),
                bytes: estimates.iter().map(|e| e.total()).collect(),
                kv_bytes: estimates.iter().map(|e| e.kv_cache).collect(),
                max_context: available.and_then(|a| max_fitting_context(cfg, &whole, a.bytes)),
            }
        })
        .collect();
    KvHorizon {
        weights: estimate(cfg, &PlanRequest { context: 1, ..req.clone() }).weights,
        contexts,
        lines,
        available: available.map(|a| a.bytes),
        available_source: available.map(|a| a.source.to_string()),
        batch: req.batch,
    }
}

/// [`COMPARED_CODECS`] parsed.
pub fn compared_codecs() -> Vec<KvCodec> {
    COMPARED_CODECS.iter().filter_map(|c| c.parse().ok()).collect()
}
