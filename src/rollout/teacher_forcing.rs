//! Teacher forcing on the decode path ([`forced_logprobs`], `stepppo score`): a prompt prefilled,
//! then given tokens fed one per incremental call as a rollout decodes them, each one's log-prob
//! read before it is fed: what a sampler would have recorded for a sequence another stack
//! produced. Generation itself is the [`super::engine`]'s.

use candle_core::Tensor;

use super::sampling::log_softmax;
use crate::kv::KvPool;
use crate::model::{LogitsWanted, Model, ModelError, Result, SeqChunk};

/// Log-probs (temperature 1) the decode path gives `tokens` after `prompt`: the prompt prefilled,
/// then one token a call, as the engine decodes, the tokens forced rather than sampled. What
/// a sampler would have recorded for them, to compare against another implementation's.
pub fn forced_logprobs(
    model: &Model,
    pool: &mut KvPool,
    prompt: &[u32],
    tokens: &[u32],
) -> Result<Vec<f32>> {
    if prompt.is_empty() {
        return Err(ModelError::Input("forced_logprobs needs a prompt".into()));
    }
    let all = [prompt, tokens].concat();
    let Some(slots) = pool.alloc(all.len()) else {
        return Err(ModelError::Input(format!(
            "KV pool has {} free slots, the sequence needs {}",
            pool.num_free(),
            all.len()
        )));
    };
    let mut logprobs = Vec::with_capacity(tokens.len());
    let mut fed = 0;
    let result = (|| {
        for (i, &token) in tokens.iter().enumerate() {
            let end = prompt.len() + i;
            let chunk = SeqChunk {
                new_tokens: &all[fed..end],
                slots: &slots[..end],
            };
            let logits = model.forward_incremental(&[chunk], pool, LogitsWanted::Last)?;
            fed = end;
            let logp = log_softmax(&row_vec(&logits, 0)?, 1.0);
            logprobs.push(logp[token as usize] as f32);
        }
        Ok(())
    })();
    pool.free(&slots);
    result.map(|()| logprobs)
}

fn row_vec(logits: &Tensor, row: usize) -> Result<Vec<f32>> {
    Ok(logits.get(row)?.to_vec1::<f32>()?)
}
