//! Plain batched generation for `stepppo generate` and the generation bench: each sequence gets
//! contiguous slots from the [`KvPool`] for its prompt and response (the simple per-sequence KV
//! buffer), the prompts are prefilled in one incremental call, then all unfinished sequences decode
//! one token per call. The rollout engine's radix-cached scheduler is separate.
//! [`forced_logprobs`] walks the same decode path with the tokens given rather than sampled.

use candle_core::Tensor;
use rand::Rng;

use super::sampling::{log_softmax, sample, SamplingParams};
use crate::kv::KvPool;
use crate::model::{LogitsWanted, Model, ModelError, Result, SeqChunk};

/// One generated continuation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub output_ids: Vec<u32>,
    /// Log-prob of each output token under the sampler's temperature-scaled distribution.
    pub logprobs: Vec<f32>,
}

struct Running {
    ids: Vec<u32>,
    prompt_len: usize,
    slots: Vec<u32>,
    gen: Generation,
    done: bool,
}

/// Generates up to `max_new_tokens` per prompt, stopping a sequence after `stop_id`; `rngs[i]`
/// samples sequence i. Slots are taken from `pool` and returned before this returns.
pub fn generate<R: Rng>(
    model: &Model,
    pool: &mut KvPool,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    params: &SamplingParams,
    rngs: &mut [R],
    stop_id: Option<u32>,
) -> Result<Vec<Generation>> {
    if rngs.len() != prompts.len() || prompts.iter().any(Vec::is_empty) {
        return Err(ModelError::Input(
            "generate needs one rng and a non-empty prompt per sequence".into(),
        ));
    }
    let mut seqs: Vec<Running> = Vec::with_capacity(prompts.len());
    for p in prompts {
        let Some(slots) = pool.alloc(p.len() + max_new_tokens) else {
            seqs.iter().for_each(|s| pool.free(&s.slots));
            return Err(ModelError::Input(format!(
                "KV pool has {} free slots, too few for the batch",
                pool.num_free()
            )));
        };
        let gen = Generation {
            output_ids: Vec::new(),
            logprobs: Vec::new(),
        };
        seqs.push(Running {
            ids: p.clone(),
            prompt_len: p.len(),
            slots,
            gen,
            done: max_new_tokens == 0,
        });
    }
    let result = decode_loop(
        model,
        pool,
        &mut seqs,
        max_new_tokens,
        params,
        rngs,
        stop_id,
    );
    seqs.iter().for_each(|s| pool.free(&s.slots));
    result?;
    Ok(seqs.into_iter().map(|s| s.gen).collect())
}

fn decode_loop<R: Rng>(
    model: &Model,
    pool: &mut KvPool,
    seqs: &mut [Running],
    max_new_tokens: usize,
    params: &SamplingParams,
    rngs: &mut [R],
    stop_id: Option<u32>,
) -> Result<()> {
    let mut fed = vec![0usize; seqs.len()];
    loop {
        let active: Vec<usize> = (0..seqs.len()).filter(|&i| !seqs[i].done).collect();
        if active.is_empty() {
            return Ok(());
        }
        let chunks: Vec<SeqChunk> = active
            .iter()
            .map(|&i| SeqChunk {
                new_tokens: &seqs[i].ids[fed[i]..],
                slots: &seqs[i].slots[..seqs[i].ids.len()],
            })
            .collect();
        let logits = model.forward_incremental(&chunks, pool, LogitsWanted::Last)?;
        for (row, &i) in active.iter().enumerate() {
            let s = &mut seqs[i];
            fed[i] = s.ids.len();
            let (token, logprob) = sample(&row_vec(&logits, row)?, params, &mut rngs[i]);
            s.ids.push(token);
            s.gen.output_ids.push(token);
            s.gen.logprobs.push(logprob);
            s.done = Some(token) == stop_id || s.ids.len() - s.prompt_len >= max_new_tokens;
        }
    }
}

/// Log-probs (temperature 1) the decode path gives `tokens` after `prompt`: the prompt prefilled,
/// then one token a call, as [`generate`] decodes, the tokens forced rather than sampled. What
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
