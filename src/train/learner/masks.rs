//! Constrained decoding on the update side: [`ResponseMasks`] holds, per env tag, the answer
//! grammar the rollout sampled under and turns a packed batch's response tokens into a logit bias,
//! so the update scores each token over the same allowed tokens; [`response_masks`] builds them
//! from a config. The grammars themselves are [`crate::rollout::grammar`]'s; applying the bias in
//! a forward pass is the model's.

use crate::config::Config;
use crate::env::{build_session, AgentSession, ProtocolConfig};
use crate::rollout::grammar::{Allowed, ResponseGrammar};
use crate::store::StepRecord;
use crate::tokenizer::Tokenizer;
use crate::train::learner::batch::PackedBatch;
use crate::train::TrainError;
use candle_core::{Device, Tensor};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// The update side of constrained decoding: per env tag, the answer grammar the rollout sampled
/// under, so each response token is scored over the same allowed tokens (a `-1e9` logit bias on
/// the others). A record that stores the admissible actions of its state was sampled among
/// those: its grammar is built from them (and kept for the records that share the list). Empty
/// when constrained decoding is off.
#[derive(Default)]
pub struct ResponseMasks {
    envs: BTreeMap<String, EnvGrammar>,
    vocab: usize,
    /// What encodes a record's admissible actions (set when constrained decoding is on).
    tok: Option<Tokenizer>,
    /// Grammars of admissible-action lists met so far, by env tag, then list.
    of_actions: Mutex<HashMap<String, ActionGrammars>>,
}

/// The grammars of one env tag's admissible-action lists, by list.
type ActionGrammars = HashMap<Vec<String>, Arc<ResponseGrammar>>;

/// One env tag's side of constrained decoding.
struct EnvGrammar {
    /// The grammar of every answer (its named actions); `None` for an env that answers free
    /// text, whose records carry their state's admissible actions.
    fixed: Option<Arc<ResponseGrammar>>,
    protocol: ProtocolConfig,
}

/// Logit bias of a token the grammar forbids: its probability underflows to exactly 0.
const FORBIDDEN_LOGIT: f32 = -1e9;

/// Admissible-action lists of one env tag whose grammars are kept at once (a run's states
/// rarely exceed it; past it the tag's table starts over).
const KEPT_ACTION_LISTS: usize = 4096;

impl ResponseMasks {
    /// Masks for the env of each `(tag, session)` (its protocol and, with named actions, its
    /// answer grammar) over a model vocabulary of `vocab` logits, with action names encoded by
    /// `tok`.
    pub fn for_envs(
        tok: &Tokenizer,
        sessions: impl IntoIterator<Item = (String, AgentSession)>,
        vocab: usize,
    ) -> Result<Self, TrainError> {
        let mut envs = BTreeMap::new();
        for (tag, session) in sessions {
            let fixed = ResponseGrammar::for_env(tok, &session)
                .map_err(|e| TrainError::Data(format!("custom_envs.{tag}: {e}")))?
                .map(Arc::new);
            let protocol = session.protocol().clone();
            envs.insert(tag, EnvGrammar { fixed, protocol });
        }
        Ok(Self {
            envs,
            vocab,
            tok: Some(tok.clone()),
            of_actions: Mutex::default(),
        })
    }

    /// The answer grammar of every env tag with named actions, for a rollout source outside
    /// the trainer to sample under (tags answering free text have none).
    pub fn grammars(&self) -> BTreeMap<String, Arc<ResponseGrammar>> {
        self.envs
            .iter()
            .filter_map(|(tag, g)| Some((tag.clone(), g.fixed.clone()?)))
            .collect()
    }

    /// The grammar `rec`'s response was sampled under (`None`: none, unconstrained).
    fn grammar_of(&self, rec: &StepRecord) -> Result<Option<Arc<ResponseGrammar>>, TrainError> {
        let Some(env) = self.envs.get(&rec.env_tag) else {
            return Ok(None);
        };
        let (Some(tok), false) = (&self.tok, rec.admissible_actions.is_empty()) else {
            return Ok(env.fixed.clone());
        };
        let actions = rec.admissible_actions.as_slice();
        let known = |kept: &HashMap<String, ActionGrammars>| {
            kept.get(&rec.env_tag).and_then(|m| m.get(actions)).cloned()
        };
        if let Some(g) = known(&self.of_actions.lock()) {
            return Ok(Some(g));
        }
        let g = ResponseGrammar::for_actions(tok, (&rec.env_tag, &env.protocol), actions).map_err(
            |e| {
                TrainError::Data(format!(
                    "trajectory {} step {}: its admissible actions: {e}",
                    rec.traj_id, rec.step_index
                ))
            },
        )?;
        let g = Arc::new(g);
        let mut kept = self.of_actions.lock();
        let of_tag = kept.entry(rec.env_tag.clone()).or_default();
        if of_tag.len() >= KEPT_ACTION_LISTS {
            of_tag.clear();
        }
        of_tag.insert(actions.to_vec(), g.clone());
        Ok(Some(g))
    }

    /// How many leading tokens of `rec`'s response the grammar forced (exactly one token
    /// allowed): 0 when constrained decoding is off or the record has no grammar.
    pub fn forced_prefix(&self, rec: &StepRecord) -> Result<usize, TrainError> {
        let Some(grammar) = self.grammar_of(rec)? else {
            return Ok(0);
        };
        let mut forced = 0;
        for allowed in grammar.allowed_per_token(&rec.response_ids) {
            match allowed {
                Some(Allowed::Only(ids)) if ids.len() == 1 => forced += 1,
                _ => break,
            }
        }
        Ok(forced)
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
            let Some(grammar) = self.grammar_of(rec)? else {
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
    let mut sessions = Vec::new();
    for (tag, spec) in &cfg.custom_envs {
        let session = build_session(&spec.env_type, &spec.env_config)
            .map_err(|e| TrainError::Data(format!("custom_envs.{tag}: {e}")))?;
        sessions.push((tag.clone(), session));
    }
    ResponseMasks::for_envs(tok, sessions, vocab)
}
