//! Copy pre-training: a reading warm-up that runs before behaviour cloning. Each sequence is made
//! of uniformly drawn ordinary tokens (no special tokens) in which spans of 2–8 earlier tokens
//! recur at random places, and the model is trained on next-token cross-entropy at the recurring
//! tokens after each span's first: each is predictable only by finding the earlier occurrence of
//! the token before it and copying the token after that (an induction circuit). The spans' sources
//! and offsets vary, so no fixed position can stand in for the lookup; the first third of the steps
//! trains on a run and its repeat instead, which a fixed offset solves. Tasks whose every action
//! copies a name from the context (search QA: the entity of the question, the bridge entity of a
//! passage, the answer) need that circuit before cloning or RL can teach which name to copy; it is
//! the part of language-model pre-training a model trained from scratch here lacks. The sequences
//! are drawn from the tokenizer's vocabulary alone: no fact of any env is taught. The circuit forms
//! abruptly, at a step that varies with the seed; with a target (`until_probability`) the
//! training goes on past its steps, in rounds, until the held-out copy probability reaches it.

use crate::algo::{AdamW, OptimizerConfig};
use crate::config::CopyPretrainConfig;
use crate::model::Model;
use crate::seed;
use crate::tokenizer::Tokenizer;
use crate::train::TrainError;
use candle_core::{Device, Tensor};
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Sequences scored after the training to report how well the model copies.
const HELD_OUT_SEQUENCES: usize = 32;
/// Shortest and longest recurring span.
const SPAN: std::ops::RangeInclusive<usize> = 2..=8;
/// Chance that a span recurs at a position (about half of each sequence is recurring spans).
const RECUR_PROBABILITY: f64 = 0.2;
/// Steps between two checks of the held-out copy probability past `steps`, under
/// `until_probability`.
const ROUND_STEPS: usize = 500;

/// Which copy sequences a step trains on: first a run and its repeat (copying at one fixed
/// offset, learnt within a few hundred steps: the circuit that writes an attended token out),
/// then recurring spans (finding what to copy by content).
#[derive(Clone, Copy)]
enum SequenceKind {
    Repeat,
    RecurringSpans,
}

/// A run of `len / 2` tokens, its repeat (and one more random token for an odd `len`), and the
/// indices of the repeat's tokens after its first.
fn repeat_sequence(vocabulary: &[u32], len: usize, rng: &mut ChaCha8Rng) -> (Vec<u32>, Vec<usize>) {
    let half = len / 2;
    let mut ids: Vec<u32> = (0..half)
        .map(|_| *vocabulary.choose(rng).expect("non-empty vocabulary"))
        .collect();
    ids.extend_from_within(..);
    ids.extend((ids.len()..len).map(|_| *vocabulary.choose(rng).expect("non-empty vocabulary")));
    (ids, (half + 1..2 * half).collect())
}

/// One sequence of `len` tokens and the indices of its copyable tokens: every recurring span's
/// tokens after its first.
fn recurring_spans_sequence(
    vocabulary: &[u32],
    len: usize,
    rng: &mut ChaCha8Rng,
) -> (Vec<u32>, Vec<usize>) {
    let mut ids: Vec<u32> = Vec::with_capacity(len);
    let mut copied = Vec::new();
    while ids.len() < len {
        if ids.len() >= *SPAN.start() && rng.random_bool(RECUR_PROBABILITY) {
            let span = rng.random_range(SPAN).min(ids.len());
            let source = rng.random_range(0..=ids.len() - span);
            for k in 0..span.min(len - ids.len()) {
                if k > 0 {
                    copied.push(ids.len());
                }
                ids.push(ids[source + k]);
            }
        } else {
            ids.push(*vocabulary.choose(rng).expect("non-empty vocabulary"));
        }
    }
    (ids, copied)
}

/// What a copy pre-training did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CopyReport {
    /// Training steps run in all (`steps` plus any run toward `until_probability`).
    pub steps: usize,
    /// Mean cross-entropy over the repeated half, in the first and the last few steps.
    pub first_loss: f64,
    /// Mean cross-entropy over the repeated half in the last few steps.
    pub final_loss: f64,
    /// Mean probability the model gives the right token over the repeats of held-out sequences
    /// (1/vocabulary before any training, 1 for a perfect copier).
    pub held_out_copy_probability: f64,
    /// Under `until_probability`: (steps run, held-out copy probability) at each check, the
    /// first after `steps`. The same held-out sequences decide when to stop and give the
    /// reported probability, which is therefore a little optimistic.
    pub checks: Vec<(usize, f64)>,
    /// `until_probability`, when set.
    pub target: Option<f64>,
    /// Wall-clock seconds the copy pre-training took.
    pub seconds: f64,
}

impl CopyReport {
    /// The target, when the copy pre-training stopped at `max_steps` below it: the copy circuit
    /// did not form, and a warm start on a task that copies names from its context stands on
    /// nothing.
    pub fn missed_target(&self) -> Option<f64> {
        self.target
            .filter(|&target| self.held_out_copy_probability < target)
    }
}

/// A batch of copy sequences as the model's inputs: ids `[B, 2n]`, an all-ones mask, the flat
/// positions that predict a repeated token and those tokens.
struct CopyBatch {
    ids: Tensor,
    mask: Tensor,
    positions: Tensor,
    targets: Tensor,
}

impl CopyBatch {
    /// `batch` copy sequences of `len` tokens drawn from `vocabulary` with `rng`.
    fn draw(
        vocabulary: &[u32],
        (batch, len): (usize, usize),
        kind: SequenceKind,
        rng: &mut ChaCha8Rng,
        device: &Device,
    ) -> Result<Self, TrainError> {
        let mut ids = Vec::with_capacity(batch * len);
        let (mut positions, mut targets) = (Vec::new(), Vec::new());
        for b in 0..batch {
            let (sequence, copied) = match kind {
                SequenceKind::Repeat => repeat_sequence(vocabulary, len, rng),
                SequenceKind::RecurringSpans => recurring_spans_sequence(vocabulary, len, rng),
            };
            for t in copied {
                positions.push((b * len + t - 1) as u32);
                targets.push(sequence[t]);
            }
            ids.extend(sequence);
        }
        Ok(CopyBatch {
            ids: Tensor::from_vec(ids, (batch, len), device)?,
            mask: Tensor::ones((batch, len), candle_core::DType::U32, device)?,
            positions: Tensor::new(positions.as_slice(), device)?,
            targets: Tensor::new(targets.as_slice(), device)?,
        })
    }

    /// Log-probs of the repeated tokens under `policy` (differentiable), `[N]`.
    fn logprobs(&self, policy: &Model) -> Result<Tensor, TrainError> {
        let (logp, _) = policy.logprobs_entropy_at(
            &self.ids,
            &self.mask,
            &self.positions,
            &self.targets,
            1.0,
            None,
        )?;
        Ok(logp)
    }
}

/// Trains `policy` for `cfg.steps` AdamW steps at `lr` on copy sequences over `tok`'s ordinary
/// tokens, drawn from `seed`; a no-op report when `cfg.steps` is 0.
pub fn copy_pretrain(
    policy: &Model,
    tok: &Tokenizer,
    cfg: &CopyPretrainConfig,
    lr: f64,
    seed: u64,
) -> Result<CopyReport, TrainError> {
    if cfg.steps == 0 {
        return Ok(CopyReport::default());
    }
    let vocabulary = tok.ordinary_ids();
    if vocabulary.len() < 2 {
        return Err(TrainError::Data(
            "sft.copy: the tokenizer has fewer than two ordinary tokens to copy".into(),
        ));
    }
    train_on(policy, &vocabulary, cfg, lr, seed)
}

/// [`copy_pretrain`] over the token ids `vocabulary`.
fn train_on(
    policy: &Model,
    vocabulary: &[u32],
    cfg: &CopyPretrainConfig,
    lr: f64,
    seed: u64,
) -> Result<CopyReport, TrainError> {
    let start = std::time::Instant::now();
    let mut run = CopyRun::new(policy, vocabulary, cfg, lr, seed)?;
    for step in 0..cfg.steps {
        run.step(if step < cfg.steps / 3 {
            SequenceKind::Repeat
        } else {
            SequenceKind::RecurringSpans
        })?;
    }
    let held_out = |run: &CopyRun| {
        held_out_probability(
            policy,
            vocabulary,
            cfg.length,
            SequenceKind::RecurringSpans,
            seed,
        )
        .map(|p| (run.losses.len(), p))
    };
    let mut checks = vec![held_out(&run)?];
    if let Some(target) = cfg.until_probability {
        while checks
            .last()
            .is_some_and(|&(steps, p)| p < target && steps < cfg.max_steps)
        {
            for _ in 0..ROUND_STEPS.min(cfg.max_steps - run.losses.len()) {
                run.step(SequenceKind::RecurringSpans)?;
            }
            checks.push(held_out(&run)?);
        }
    }
    let (first_loss, final_loss) = crate::train::warm_start::first_and_final(&run.losses);
    let (steps, probability) = *checks.last().expect("one check at least");
    Ok(CopyReport {
        steps,
        first_loss,
        final_loss,
        held_out_copy_probability: probability,
        checks: if cfg.until_probability.is_some() {
            checks
        } else {
            Vec::new()
        },
        target: cfg.until_probability,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The optimizer, the sequence stream and the losses of one copy pre-training.
struct CopyRun<'a> {
    policy: &'a Model,
    vocabulary: &'a [u32],
    shape: (usize, usize),
    lr: f64,
    opt: AdamW,
    rng: ChaCha8Rng,
    losses: Vec<f64>,
}

impl<'a> CopyRun<'a> {
    fn new(
        policy: &'a Model,
        vocabulary: &'a [u32],
        cfg: &CopyPretrainConfig,
        lr: f64,
        seed: u64,
    ) -> Result<Self, TrainError> {
        let opt_cfg = OptimizerConfig {
            lr,
            weight_decay: 0.0,
            ..OptimizerConfig::default()
        };
        Ok(CopyRun {
            policy,
            vocabulary,
            shape: (cfg.batch_size, cfg.length),
            lr,
            opt: AdamW::new(policy.named_vars(), &opt_cfg)?,
            rng: ChaCha8Rng::seed_from_u64(seed::derive(seed, &[0xC0B1])),
            losses: Vec::with_capacity(cfg.steps),
        })
    }

    /// One AdamW step on a fresh batch of `kind` sequences.
    fn step(&mut self, kind: SequenceKind) -> Result<(), TrainError> {
        let device = self.policy.device();
        let batch = CopyBatch::draw(self.vocabulary, self.shape, kind, &mut self.rng, device)?;
        let loss = batch.logprobs(self.policy)?.mean_all()?.neg()?;
        self.opt
            .step(&crate::model::backward(&loss)?, self.lr, Some(1.0))?;
        self.losses.push(f64::from(loss.to_scalar::<f32>()?));
        Ok(())
    }
}

/// Mean probability `policy` gives the copyable tokens of [`HELD_OUT_SEQUENCES`] sequences of
/// `kind` and length `len` (drawn from `seed`, apart from the training's).
fn held_out_probability(
    policy: &Model,
    vocabulary: &[u32],
    len: usize,
    kind: SequenceKind,
    seed: u64,
) -> Result<f64, TrainError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed::derive(seed, &[0xC0B1, 1]));
    let batch = CopyBatch::draw(
        vocabulary,
        (HELD_OUT_SEQUENCES, len),
        kind,
        &mut rng,
        policy.device(),
    )?;
    let probability = batch.logprobs(policy)?.detach().exp()?.mean_all()?;
    Ok(f64::from(probability.to_scalar::<f32>()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;

    #[test]
    fn recurring_spans_are_copies_of_earlier_tokens_and_only_they_are_targets() {
        let vocabulary: Vec<u32> = (100..1100).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let (ids, copied) = recurring_spans_sequence(&vocabulary, 64, &mut rng);
        assert_eq!(ids.len(), 64);
        assert!(copied.len() > 10, "{copied:?}");
        for &t in &copied {
            // The token before a copied one occurs earlier, followed by the copied token.
            assert!(
                (1..t - 1).any(|s| ids[s - 1] == ids[t - 1] && ids[s] == ids[t]),
                "{t}: {ids:?}"
            );
        }
        let b = CopyBatch::draw(
            &vocabulary,
            (2, 64),
            SequenceKind::RecurringSpans,
            &mut rng,
            &Device::Cpu,
        )
        .unwrap();
        let flat: Vec<u32> = b.ids.flatten_all().unwrap().to_vec1().unwrap();
        let positions: Vec<u32> = b.positions.to_vec1().unwrap();
        let targets: Vec<u32> = b.targets.to_vec1().unwrap();
        for (p, t) in positions.iter().zip(&targets) {
            assert_eq!(flat[*p as usize + 1], *t);
        }
    }

    #[test]
    fn copy_pretraining_teaches_a_tiny_model_to_copy_a_repeat() {
        // 16 tokens: a model that does not copy gives a copied token at most 1/16 on average.
        let vocabulary: Vec<u32> = (10..26).collect();
        let cfg = ModelConfig::tiny(Tokenizer::builtin().vocab_size());
        let policy = Model::new(&cfg, 3, &Device::Cpu).unwrap();
        let before =
            held_out_probability(&policy, &vocabulary, 16, SequenceKind::Repeat, 7).unwrap();
        let copy = CopyPretrainConfig {
            steps: 600,
            batch_size: 16,
            length: 16,
            ..CopyPretrainConfig::default()
        };
        let report = train_on(&policy, &vocabulary, &copy, 3e-3, 7).unwrap();
        assert_eq!(report.steps, 600);
        assert!(report.final_loss < report.first_loss, "{report:?}");
        let after =
            held_out_probability(&policy, &vocabulary, 16, SequenceKind::Repeat, 7).unwrap();
        let chance = 1.0 / vocabulary.len() as f64;
        assert!(
            before < chance && after > 2.0 * chance,
            "{before} → {after}"
        );
    }

    #[test]
    fn a_copy_target_trains_in_rounds_until_it_is_met_or_the_cap_is_reached() {
        let vocabulary: Vec<u32> = (10..26).collect();
        let cfg = ModelConfig::tiny(Tokenizer::builtin().vocab_size());
        let run = |until: Option<f64>, max_steps: usize| {
            let policy = Model::new(&cfg, 3, &Device::Cpu).unwrap();
            let copy = CopyPretrainConfig {
                steps: 20,
                batch_size: 4,
                length: 16,
                until_probability: until,
                max_steps,
            };
            train_on(&policy, &vocabulary, &copy, 3e-3, 7).unwrap()
        };
        let plain = run(None, 0);
        assert_eq!((plain.steps, plain.checks.len()), (20, 0));
        // Met at once: nothing past `steps`, the very model of the plain run.
        let met = run(Some(1e-9), 600);
        assert_eq!(met.checks, vec![(20, plain.held_out_copy_probability)]);
        assert_eq!(met.missed_target(), None);
        assert_eq!(
            met.held_out_copy_probability,
            plain.held_out_copy_probability
        );
        // Out of reach: one full round, then the rest of the cap.
        let capped = run(Some(1.0), 20 + ROUND_STEPS + 30);
        let steps: Vec<usize> = capped.checks.iter().map(|c| c.0).collect();
        assert_eq!(steps, vec![20, 20 + ROUND_STEPS, 20 + ROUND_STEPS + 30]);
        assert_eq!(capped.steps, 20 + ROUND_STEPS + 30);
        assert_eq!(capped.held_out_copy_probability, capped.checks[2].1);
        assert_eq!(capped.missed_target(), Some(1.0));
        assert_eq!(plain.missed_target(), None);
    }
}
