//! The two forward paths agree: incremental decoding over the KV pool (prefill in chunks, mixed
//! batches) and the padded training path give the same logits; rollout log-probs equal the
//! training path's recomputed ones; every parameter receives a gradient.

use candle_core::{Device, Tensor, D};
use stepppo::kv::KvPool;
use stepppo::model::{Critic, LogitsWanted, Model, ModelConfig, PaddedBatch, SeqChunk, TrainInput};
use stepppo::rollout::engine::{CacheMode, Engine, EngineConfig, GenRequest};
use stepppo::rollout::sampling::SamplingParams;
use stepppo::tokenizer::Tokenizer;

fn tiny(tied: bool) -> Model {
    let cfg = ModelConfig {
        tie_word_embeddings: tied,
        ..ModelConfig::tiny(97)
    };
    Model::new(&cfg, 7, &Device::Cpu).unwrap()
}

fn seqs() -> Vec<Vec<u32>> {
    [3usize, 9, 1, 14]
        .iter()
        .enumerate()
        .map(|(s, &len)| {
            (0..len)
                .map(|i| ((i * 31 + s * 17 + 5) % 97) as u32)
                .collect()
        })
        .collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Logits `[len, vocab]` of every position of `seq` from the training path row `b`.
fn train_rows(train: &Tensor, b: usize, len: usize) -> Tensor {
    train.get(b).unwrap().narrow(0, 0, len).unwrap()
}

#[test]
fn incremental_and_training_logits_agree_with_padding_and_chunks() {
    for tied in [true, false] {
        let model = tiny(tied);
        let seqs = seqs();
        let batch = PaddedBatch::right_padded(&seqs, 0, &Device::Cpu).unwrap();
        let train = model
            .forward_train(&batch.input_ids, &batch.attention_mask)
            .unwrap();

        // All sequences in one batch; each prefilled in a first chunk of half its length
        // (at least one token), then the rest one token per call.
        let mut pool = KvPool::new(model.config(), 64, &Device::Cpu).unwrap();
        let slots: Vec<Vec<u32>> = seqs.iter().map(|s| pool.alloc(s.len()).unwrap()).collect();
        let mut outs: Vec<Vec<Tensor>> = vec![Vec::new(); seqs.len()];
        let mut fed = vec![0usize; seqs.len()];
        while fed.iter().zip(&seqs).any(|(f, s)| f < &s.len()) {
            let active: Vec<usize> = (0..seqs.len())
                .filter(|&i| fed[i] < seqs[i].len())
                .collect();
            let ends: Vec<usize> = active
                .iter()
                .map(|&i| {
                    if fed[i] == 0 {
                        seqs[i].len().div_ceil(2)
                    } else {
                        fed[i] + 1
                    }
                })
                .collect();
            let chunks: Vec<SeqChunk> = active
                .iter()
                .zip(&ends)
                .map(|(&i, &end)| SeqChunk {
                    new_tokens: &seqs[i][fed[i]..end],
                    slots: &slots[i][..end],
                })
                .collect();
            let logits = model
                .forward_incremental(&chunks, &mut pool, LogitsWanted::All)
                .unwrap();
            let mut row = 0;
            for (&i, &end) in active.iter().zip(&ends) {
                outs[i].push(logits.narrow(0, row, end - fed[i]).unwrap());
                row += end - fed[i];
                fed[i] = end;
            }
        }
        for (b, s) in seqs.iter().enumerate() {
            let inc = Tensor::cat(&outs[b], 0).unwrap();
            let diff = max_abs_diff(&inc, &train_rows(&train, b, s.len()));
            assert!(diff < 1e-4, "tied={tied} seq {b}: max |Δ| = {diff}");
        }
    }
}

#[test]
fn last_logits_match_and_left_padding_matches_right_padding() {
    let model = tiny(true);
    let seqs = seqs();
    let mut pool = KvPool::new(model.config(), 64, &Device::Cpu).unwrap();
    let slots: Vec<Vec<u32>> = seqs.iter().map(|s| pool.alloc(s.len()).unwrap()).collect();
    let chunks: Vec<SeqChunk> = seqs
        .iter()
        .zip(&slots)
        .map(|(s, sl)| SeqChunk {
            new_tokens: s,
            slots: sl,
        })
        .collect();
    let last = model
        .forward_incremental(&chunks, &mut pool, LogitsWanted::Last)
        .unwrap();
    assert_eq!(last.dims(), &[seqs.len(), 97]);

    // Left-padded batch through the training path: the last column is every sequence's last token.
    let t_len = seqs.iter().map(Vec::len).max().unwrap();
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    for s in &seqs {
        ids.extend(std::iter::repeat_n(0u32, t_len - s.len()).chain(s.iter().copied()));
        mask.extend((0..t_len).map(|t| u32::from(t >= t_len - s.len())));
    }
    let ids = Tensor::from_vec(ids, (seqs.len(), t_len), &Device::Cpu).unwrap();
    let mask = Tensor::from_vec(mask, (seqs.len(), t_len), &Device::Cpu).unwrap();
    let train = model.forward_train(&ids, &mask).unwrap();
    let train_last = train.narrow(1, t_len - 1, 1).unwrap().squeeze(1).unwrap();
    let diff = max_abs_diff(&last, &train_last);
    assert!(diff < 1e-4, "max |Δ| = {diff}");
}

#[test]
fn rollout_logprobs_equal_training_logprobs() {
    let model = tiny(false);
    let prompts = [vec![1u32, 2, 3, 4, 5], vec![9u32, 8], vec![40u32; 7]];
    let params = SamplingParams {
        temperature: 0.7,
        top_p: 0.95,
        top_k: 40,
        greedy: false,
    };
    let cfg = EngineConfig {
        cache_mode: CacheMode::None,
        num_slots: 128,
        ..EngineConfig::default()
    };
    let mut engine = Engine::for_model(&model, cfg).unwrap();
    let requests: Vec<GenRequest> = prompts
        .iter()
        .zip(0u64..)
        .map(|(p, i)| GenRequest::plain(p.clone(), params, stepppo::seed::derive(11, &[i]), 12))
        .collect();
    let gens = engine
        .generate(&model, &Tokenizer::builtin(), &requests)
        .unwrap();
    assert_eq!(engine.pool_usage().free, 128, "every slot back in the pool");

    let full: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&gens)
        .map(|(p, g)| [p.clone(), g.tokens.clone()].concat())
        .collect();
    let inputs: Vec<Vec<u32>> = full.iter().map(|f| f[..f.len() - 1].to_vec()).collect();
    let targets: Vec<Vec<u32>> = full.iter().map(|f| f[1..].to_vec()).collect();
    let batch = PaddedBatch::right_padded(&inputs, 0, &Device::Cpu).unwrap();
    let tgt = PaddedBatch::right_padded(&targets, 0, &Device::Cpu).unwrap();
    let (logp, entropy) = model
        .token_logprobs_entropy(
            &batch.input_ids,
            &batch.attention_mask,
            &tgt.input_ids,
            params.temperature,
        )
        .unwrap();
    assert!(entropy
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .all(|e| *e > 0.0));
    for (b, (p, g)) in prompts.iter().zip(&gens).enumerate() {
        let row = logp.get(b).unwrap().to_vec1::<f32>().unwrap();
        for (i, lp) in g.logprobs.iter().enumerate() {
            let recomputed = row[p.len() - 1 + i];
            assert!(
                (lp - recomputed).abs() < 1e-4,
                "seq {b} token {i}: {lp} vs {recomputed}"
            );
        }
    }
    // The training path scores only the generated positions: same log-probs and entropies.
    let width = batch.input_ids.dim(1).unwrap();
    let positions: Vec<u32> = prompts
        .iter()
        .zip(&gens)
        .enumerate()
        .flat_map(|(b, (p, g))| {
            (0..g.logprobs.len()).map(move |i| (b * width + p.len() - 1 + i) as u32)
        })
        .collect();
    let flat_targets = tgt
        .input_ids
        .flatten_all()
        .unwrap()
        .to_vec1::<u32>()
        .unwrap();
    let picked: Vec<u32> = positions
        .iter()
        .map(|&i| flat_targets[i as usize])
        .collect();
    let (at_logp, at_entropy) = model
        .logprobs_entropy_at(
            &batch.input_ids,
            &batch.attention_mask,
            &Tensor::new(positions.as_slice(), &Device::Cpu).unwrap(),
            &Tensor::new(picked.as_slice(), &Device::Cpu).unwrap(),
            params.temperature,
            None,
        )
        .unwrap();
    let rollout: Vec<f32> = gens.iter().flat_map(|g| g.logprobs.clone()).collect();
    let full_entropy = entropy.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let at_logp = at_logp.to_vec1::<f32>().unwrap();
    let at_entropy = at_entropy.to_vec1::<f32>().unwrap();
    for (k, &pos) in positions.iter().enumerate() {
        assert!((at_logp[k] - rollout[k]).abs() < 1e-4, "position {pos}");
        assert!(
            (at_entropy[k] - full_entropy[pos as usize]).abs() < 1e-4,
            "position {pos}"
        );
    }
}

#[test]
fn every_parameter_gets_a_gradient_from_a_logprob_loss() {
    for tied in [true, false] {
        let model = tiny(tied);
        let seqs = seqs();
        let batch = PaddedBatch::right_padded(&seqs, 0, &Device::Cpu).unwrap();
        let (logp, _) = model
            .token_logprobs_entropy(
                &batch.input_ids,
                &batch.attention_mask,
                &batch.input_ids,
                1.0,
            )
            .unwrap();
        let loss = (logp
            * &batch
                .attention_mask
                .to_dtype(candle_core::DType::F32)
                .unwrap())
            .unwrap();
        let loss = loss.sum_all().unwrap().neg().unwrap();
        let grads = loss.backward().unwrap();
        let vars = model.named_vars();
        assert_eq!(vars.len(), Model::param_shapes(model.config()).len());
        for (name, var) in vars {
            let g = grads
                .get(&var)
                .unwrap_or_else(|| panic!("tied={tied}: no gradient for {name}"));
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(norm > 0.0, "tied={tied}: zero gradient for {name}");
        }
    }
}

#[test]
fn critic_and_shared_head_values_have_gradients_everywhere() {
    let cfg = ModelConfig::tiny(97);
    let critic = Critic::new(&cfg, 3, &Device::Cpu).unwrap();
    let batch = PaddedBatch::right_padded(&seqs(), 0, &Device::Cpu).unwrap();
    let values = critic
        .values(&batch.input_ids, &batch.attention_mask)
        .unwrap();
    assert_eq!(values.dims(), batch.input_ids.dims());
    let grads = values.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    for (name, var) in critic.named_vars() {
        assert!(grads.get(&var).is_some(), "critic: no gradient for {name}");
    }
    let mut policy = tiny(true);
    policy.attach_value_head(5).unwrap();
    let v = policy.values(&TrainInput::Padded(batch)).unwrap();
    let grads = v.sum_all().unwrap().backward().unwrap();
    let head = policy
        .named_vars()
        .into_iter()
        .find(|(n, _)| n == "score.weight")
        .unwrap()
        .1;
    assert!(grads.get(&head).is_some());
    assert_eq!(v.max(D::Minus1).unwrap().dims(), &[4]);
}

#[test]
fn incremental_path_records_no_graph_and_rejects_bad_input() {
    let model = tiny(true);
    let mut pool = KvPool::new(model.config(), 8, &Device::Cpu).unwrap();
    let slots = pool.alloc(2).unwrap();
    let logits = model
        .forward_incremental(
            &[SeqChunk {
                new_tokens: &[1, 2],
                slots: &slots,
            }],
            &mut pool,
            LogitsWanted::Last,
        )
        .unwrap();
    let grads = logits.sum_all().unwrap().backward().unwrap();
    assert!(model
        .named_vars()
        .iter()
        .all(|(_, v)| grads.get(v).is_none()));
    let bad_id = model.forward_incremental(
        &[SeqChunk {
            new_tokens: &[500],
            slots: &slots[..1],
        }],
        &mut pool,
        LogitsWanted::Last,
    );
    assert!(bad_id.unwrap_err().to_string().contains("500"));
    let no_slots = model.forward_incremental(
        &[SeqChunk {
            new_tokens: &[1, 2],
            slots: &slots[..1],
        }],
        &mut pool,
        LogitsWanted::Last,
    );
    assert!(no_slots.is_err());
}
