//! Constrained decoding on the update side: [`ResponseMasks`] holds, per env tag, the answer
//! grammar the rollout sampled under and turns a packed batch's response tokens into a logit bias,
//! so the update scores each token over the same allowed tokens; [`response_masks`] builds them
//! from a config. The grammars themselves are [`crate::rollout::grammar`]'s; applying the bias in
//! a forward pass is the model's.

use crate::config::Config;
use crate::env::build_session;
use crate::rollout::grammar::{Allowed, ResponseGrammar};
use crate::store::StepRecord;
use crate::tokenizer::Tokenizer;
use crate::train::learner::batch::PackedBatch;
use crate::train::TrainError;
use candle_core::{Device, Tensor};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The update side of constrained decoding: per env tag, the answer grammar the rollout sampled
/// under, so each response token is scored over the same allowed tokens (a `-1e9` logit bias on
/// the others). Empty when constrained decoding is off.
#[derive(Default)]
pub struct ResponseMasks {
    grammars: BTreeMap<String, ResponseGrammar>,
    vocab: usize,
}

/// Logit bias of a token the grammar forbids: its probability underflows to exactly 0.
const FORBIDDEN_LOGIT: f32 = -1e9;

impl ResponseMasks {
    /// Masks for the env tags in `grammars` over a model vocabulary of `vocab` logits.
    pub fn new(grammars: BTreeMap<String, ResponseGrammar>, vocab: usize) -> Self {
        Self { grammars, vocab }
    }

    /// The answer grammar of every env tag (empty when constrained decoding is off), for a
    /// rollout source outside the trainer to sample under.
    pub fn grammars(&self) -> BTreeMap<String, Arc<ResponseGrammar>> {
        self.grammars
            .iter()
            .map(|(tag, g)| (tag.clone(), Arc::new(g.clone())))
            .collect()
    }

    /// How many leading tokens of `rec`'s response the grammar forced (exactly one token
    /// allowed): 0 when constrained decoding is off or the tag has no grammar.
    pub fn forced_prefix(&self, rec: &StepRecord) -> usize {
        let Some(grammar) = self.grammars.get(&rec.env_tag) else {
            return 0;
        };
        let mut forced = 0;
        for allowed in grammar.allowed_per_token(&rec.response_ids) {
            match allowed {
                Some(Allowed::Only(ids)) if ids.len() == 1 => forced += 1,
                _ => break,
            }
        }
        forced
    }

    /// `[rows * width, vocab]` bias of a packed batch, `None` when no response token of it is
    /// constrained. Tokens past the point where a response left its grammar stay unconstrained.
    pub(in crate::train) fn logit_bias(
        &self,
        p: &PackedBatch,
        records: &[StepRecord],
        device: &Device,
    ) -> Result<Option<Tensor>, TrainError> {
        let (w, v) = (p.max_response_len, self.vocab);
        let mut bias: Vec<f32> = Vec::new();
        for (row, &r) in p.record_of_row.iter().enumerate() {
            let rec = &records[r];
            let Some(grammar) = self.grammars.get(&rec.env_tag) else {
                continue;
            };
            for (j, allowed) in grammar
                .allowed_per_token(&rec.response_ids)
                .iter()
                .enumerate()
            {
                let Some(allowed) = allowed else { continue };
                if bias.is_empty() {
                    bias = vec![0.0; p.rows * w * v];
                }
                let slot = &mut bias[(row * w + j) * v..(row * w + j + 1) * v];
                match allowed {
                    Allowed::Only(ids) => {
                        slot.fill(FORBIDDEN_LOGIT);
                        ids.iter()
                            .filter(|&&t| (t as usize) < v)
                            .for_each(|&t| slot[t as usize] = 0.0);
                    }
                    Allowed::AllBut(ids) => {
                        ids.iter()
                            .filter(|&&t| (t as usize) < v)
                            .for_each(|&t| slot[t as usize] = FORBIDDEN_LOGIT);
                    }
                }
            }
        }
        if bias.is_empty() {
            return Ok(None);
        }
        Ok(Some(Tensor::from_vec(bias, (p.rows * w, v), device)?))
    }
}

/// The update side of `cfg.constrained_decoding`: each env tag's answer grammar over a model
/// vocabulary of `vocab` logits (no grammar when it is off).
pub fn response_masks(
    cfg: &Config,
    tok: &Tokenizer,
    vocab: usize,
) -> Result<ResponseMasks, TrainError> {
    if !cfg.constrained_decoding {
        return Ok(ResponseMasks::default());
    }
    let mut grammars = BTreeMap::new();
    for (tag, spec) in &cfg.custom_envs {
        let at = |e: String| TrainError::Data(format!("custom_envs.{tag}: {e}"));
        let session =
            build_session(&spec.env_type, &spec.env_config).map_err(|e| at(e.to_string()))?;
        let grammar = ResponseGrammar::for_session(tok, &session).map_err(|e| at(e.to_string()))?;
        grammars.insert(tag.clone(), grammar);
    }
    Ok(ResponseMasks::new(grammars, vocab))
}
