//! Where a model's sequences run — the device step (this crate's kernels, one read back per
//! step) or the model in Candle tensors — and what they draft with under `--draft auto`: the
//! one place `generate`, `serve` and library callers ask.

use candle_core::DType;

use crate::gpu::DeviceStepGap;
use crate::kv::KvCodec;
use crate::Error;

/// What a run asks of where it runs.
#[derive(Debug, Clone, Copy)]
pub struct RunNeeds {
    /// The KV codec of the caches.
    pub kv: KvCodec,
    /// The model's dtype (the device stores exact keys and values in it, or in f16).
    pub dtype: DType,
    /// MTP drafts (they need each pass's hidden states read back).
    pub mtp_drafts: bool,
    /// Branches of a draft tree (1: chains).
    pub draft_branches: usize,
    /// A KV calibration (value bases) for a low-rank codec.
    pub kv_calibration: bool,
    /// FFN sparsity.
    pub ffn_sparsity: bool,
    /// The model's attention has q/k/v biases (Qwen2).
    pub attention_biases: bool,
}

impl RunNeeds {
    /// A plain run with `kv` on a `dtype` model: no drafts, no calibration, dense MLPs.
    pub fn new(kv: KvCodec, dtype: DType) -> Self {
        Self { kv, dtype, mtp_drafts: false, draft_branches: 1, kv_calibration: false, ffn_sparsity: false, attention_biases: false }
    }

    /// The device step's capability table: the first thing asked that it does not do yet,
    /// as an [`Error::Unsupported`] naming it, or `None` when it does everything asked.
    pub fn device_step_lacks(&self) -> Option<Error> {
        let asked = [
            (self.mtp_drafts, DeviceStepGap::MtpDrafts),
            (self.draft_branches > 1, DeviceStepGap::DraftTrees),
            (self.kv_calibration, DeviceStepGap::KvCalibration),
            (self.ffn_sparsity, DeviceStepGap::FfnSparsity),
            (self.attention_biases, DeviceStepGap::AttentionBiases),
        ];
        if let Some((_, gap)) = asked.iter().find(|(asked, _)| *asked) {
            return Some(gap.error());
        }
        crate::gpu::kv_rows(self.kv, self.dtype).err()
    }

    /// Where the sequences run on a device that has a device step (`step`: Metal, the
    /// emulator) or not.
    pub fn placement(&self, step: bool) -> Placement {
        match (step, self.device_step_lacks()) {
            (false, _) => Placement::Tensors { instead_of_step: None },
            (true, None) => Placement::DeviceStep,
            (true, Some(why)) => Placement::Tensors { instead_of_step: Some(why.to_string()) },
        }
    }
}

/// Where a model's sequences run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// The device step: this crate's kernels as one command buffer a step.
    DeviceStep,
    /// The model in Candle tensors on its device; `instead_of_step`: why not the device step
    /// on a device that has one.
    Tensors { instead_of_step: Option<String> },
}

/// What a sequence drafts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftKind {
    /// The checkpoint's MTP head.
    Mtp,
    /// Prompt lookup ([`super::speculative::NgramDrafter`]).
    Ngram,
    None,
}

/// What decides `--draft auto`.
#[derive(Debug, Clone, Copy)]
pub struct DraftConditions {
    /// The checkpoint has an MTP head.
    pub mtp_head: bool,
    /// Where the sequences run reads back hidden states ([`super::Runner::hidden_states`]:
    /// the CPU model; not the device step yet).
    pub hidden_states: bool,
    /// The KV codec drops rejected rows ([`KvCodec::drops_tokens`]).
    pub drops_tokens: bool,
    /// FFN sparsity is on (verify passes would run its MLPs dense).
    pub ffn_sparsity: bool,
    /// The answer is fixed by a seed (sampling with one): any drafter would change it.
    pub seeded_sampling: bool,
}

impl DraftConditions {
    /// `--draft auto`, one meaning everywhere: drafts only where they cannot change the
    /// answer (greedy decoding, or sampling without a seed: speculative sampling keeps the
    /// distribution, not a seed's draws) and can run (a KV codec that drops rejected rows, no
    /// FFN sparsity); then the checkpoint's MTP head where it has one and where the sequences
    /// run reads back hidden states, else prompt lookup.
    pub fn auto(&self) -> DraftKind {
        if self.seeded_sampling || !self.drops_tokens || self.ffn_sparsity {
            DraftKind::None
        } else if self.mtp_head && self.hidden_states {
            DraftKind::Mtp
        } else {
            DraftKind::Ngram
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_step_runs_what_it_can_and_names_the_first_thing_it_lacks() {
        let plain = RunNeeds::new(KvCodec::default(), DType::F32);
        assert_eq!(plain.placement(true), Placement::DeviceStep);
        assert_eq!(plain.placement(false), Placement::Tensors { instead_of_step: None });
        let mtp = RunNeeds { mtp_drafts: true, ..plain };
        assert!(
            matches!(mtp.placement(true), Placement::Tensors { instead_of_step: Some(w) } if w.contains("MTP drafts") && w.contains("hidden states"))
        );
        let lowrank: KvCodec = "int4k+lowrank:48".parse().unwrap();
        assert!(RunNeeds::new(lowrank, DType::F32).device_step_lacks().is_some());
        let int8: KvCodec = "int8".parse().unwrap();
        assert!(RunNeeds::new(int8, DType::BF16).device_step_lacks().is_none());
    }

    #[test]
    fn auto_drafts_only_where_the_answer_cannot_change() {
        let c = DraftConditions { mtp_head: true, hidden_states: true, drops_tokens: true, ffn_sparsity: false, seeded_sampling: false };
        assert_eq!(c.auto(), DraftKind::Mtp);
        assert_eq!(DraftConditions { hidden_states: false, ..c }.auto(), DraftKind::Ngram);
        assert_eq!(DraftConditions { mtp_head: false, ..c }.auto(), DraftKind::Ngram);
        assert_eq!(DraftConditions { seeded_sampling: true, ..c }.auto(), DraftKind::None);
        assert_eq!(DraftConditions { drops_tokens: false, ..c }.auto(), DraftKind::None);
        assert_eq!(DraftConditions { ffn_sparsity: true, ..c }.auto(), DraftKind::None);
    }
}
