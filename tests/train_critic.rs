//! The step-level critic learns: on a fixed dataset whose return is a function of the state
//! (which of four observations the step saw), critic-only updates (the policy frozen, as in the
//! critic warm-up) raise the explained variance of the step-start values over the whole batch
//! from about 0 to near 1, for a separate critic, for a feature critic on the policy's
//! detached hidden states and for a state critic on the records' critic states.

use candle_core::Device;
use stepppo::algo::loss::explained_variance;
use stepppo::algo::{AdamW, CriticTarget, LossConfig, OptimizerConfig};
use stepppo::model::{Critic as CriticTrunk, Model, ModelConfig, ValueMlp};
use stepppo::store::StepRecord;
use stepppo::train::learner::critic::fit::state_values;
use stepppo::train::learner::critic::{FeatureCritic, SeparateCritic, StateCritic, ValueReading};
use stepppo::train::learner::masks::ResponseMasks;
use stepppo::train::learner::update::{
    ppo_update, CriticLearner, Learners, UpdateInputs, UpdateSettings,
};
use stepppo::train::BatchLayout;
use stepppo::train::Scalars;

const VOCAB: usize = 64;
/// Width of the records' critic states: a one-hot of the four states.
const STATE_WIDTH: usize = 4;

/// Four states, each seen by four one-step trajectories; the return of state s is s / 3.
fn records() -> Vec<StepRecord> {
    (0..16u64)
        .map(|i| {
            let s = (i % 4) as u32;
            StepRecord {
                traj_id: i,
                group_id: i / 4,
                obs_ids: vec![1, 10 + s, 20 + s, 30 + s, 2],
                response_ids: vec![40, 41],
                response_logprobs: vec![-0.7, -0.7],
                reward: s as f32 / 3.0,
                terminated: true,
                state_hash: u64::from(s),
                critic_state: (0..STATE_WIDTH as u32)
                    .map(|k| f32::from(u8::from(k == s)))
                    .collect(),
                ..StepRecord::default()
            }
        })
        .collect()
}

/// The layout of every pass: the default, a prefix tree per group.
const TREE: BatchLayout = BatchLayout {
    pad_id: 0,
    tree: true,
};

type Critic = dyn stepppo::train::learner::critic::Critic;

fn explained(
    critic: &Critic,
    policy: &Model,
    records: &[StepRecord],
    sequences: &[Vec<usize>],
) -> f64 {
    let values = values_of(critic, policy, records, sequences);
    let v: Vec<f64> = values.iter().map(|v| f64::from(v[0])).collect();
    let r: Vec<f64> = records.iter().map(|r| f64::from(r.reward)).collect();
    explained_variance(&v, &r)
}

/// Step-start values of every record: read from the token positions, or a state critic's from
/// the records' critic states.
fn values_of(
    critic: &Critic,
    policy: &Model,
    records: &[StepRecord],
    sequences: &[Vec<usize>],
) -> Vec<Vec<f32>> {
    let reading = ValueReading {
        policy,
        records,
        sequences,
        target: CriticTarget::StepStart,
        chunks: (16, TREE),
        masks: &ResponseMasks::default(),
        dist: &stepppo::dist::Single,
    };
    critic.record_values(&reading).unwrap()
}

/// Learning rate of every fit.
const LR: f64 = 3e-3;

/// How [`fit`] trains: `rounds` critic-only updates of `critic_epochs` passes; with
/// `alternate`, even rounds train the critic on the steps of states 0 and 1 only, odd rounds on
/// states 2 and 3.
struct Plan {
    rounds: u64,
    critic_epochs: usize,
    alternate: bool,
}

impl Plan {
    fn plain(rounds: u64, critic_epochs: usize) -> Self {
        Plan {
            rounds,
            critic_epochs,
            alternate: false,
        }
    }
}

/// A state critic on [`STATE_WIDTH`] wide states, fitting on the rows of its last
/// `history_batches` batches.
fn state_critic(history_batches: usize) -> StateCritic {
    let mlp =
        ValueMlp::with_width(STATE_WIDTH, &ModelConfig::tiny(VOCAB), 2, &Device::Cpu).unwrap();
    StateCritic::new(mlp, history_batches)
}

/// Runs `plan`'s critic-only updates at [`LR`]; returns the explained variance over every record
/// before and after and the last update's metrics, and asserts the frozen policy did not move.
fn fit(critic: &mut Critic, policy: &Model, plan: &Plan) -> (f64, f64, Scalars) {
    let opt_cfg = OptimizerConfig {
        lr: LR,
        critic_lr: LR,
        weight_decay: 0.0,
        ..OptimizerConfig::default()
    };
    let mut actor_opt = AdamW::new(policy.named_vars(), &opt_cfg).unwrap();
    let mut critic_opt = AdamW::new(critic.trainable_vars(policy), &opt_cfg).unwrap();
    let records = records();
    let sequences: Vec<Vec<usize>> = (0..records.len()).map(|i| vec![i]).collect();
    let before = explained(critic, policy, &records, &sequences);
    let mut last = Scalars::new();

    let returns: Vec<Vec<f32>> = records.iter().map(|r| vec![r.reward; 2]).collect();
    let loss = LossConfig::default();
    let masks = ResponseMasks::default();
    let policy_before = policy.named_vars()[0].1.as_tensor().to_vec1_flat();
    for round in 0..plan.rounds {
        let critic_keep = records
            .iter()
            .map(|r| {
                !plan.alternate
                    || (r.critic_state[2] + r.critic_state[3] == 1.0) == (round % 2 == 1)
            })
            .collect();
        let old_values = values_of(critic, policy, &records, &sequences);
        let inputs = UpdateInputs {
            records: &records,
            sequences: sequences.clone(),
            actor_keep: vec![true; records.len()],
            critic_keep,
            advantages: vec![vec![0.0; 2]; records.len()],
            returns: returns.clone(),
            old_values,
            critic_target: Some(CriticTarget::StepStart),
            ref_logprobs: None,
            replay: None,
            proximal_logprobs: None,
        };
        let settings = UpdateSettings {
            loss: &loss,
            epochs: 1,
            critic_epochs: plan.critic_epochs,
            mini_batch: 8,
            actor_lr: LR,
            critic_lr: LR,
            max_grad_norm: 1.0,
            temperature: 1.0,
            pad_id: 0,
            shuffle_seed: round,
            masks: &masks,
            freeze_actor: true,
            dist: &stepppo::dist::Single,
            tree_forward: TREE.tree,
            memory: None,
        };
        let mut learners = Learners {
            policy,
            actor_opt: &mut actor_opt,
            critic: Some(CriticLearner {
                critic: &mut *critic,
                opt: &mut critic_opt,
            }),
        };
        last = ppo_update(&inputs, &settings, &mut learners)
            .unwrap()
            .scalars;
    }
    let after = explained(critic, policy, &records, &sequences);
    let policy_after = policy.named_vars()[0].1.as_tensor().to_vec1_flat();
    assert_eq!(policy_before, policy_after, "the frozen policy moved");
    (before, after, last)
}

/// Runs [`fit`] and checks that the critic went from explaining little of the
/// return to nearly all of it.
fn assert_learns(critic: &mut Critic, policy: &Model, plan: Plan) {
    let (before, after, _) = fit(critic, policy, &plan);
    assert!(
        before < 0.3,
        "an untrained critic explains little: {before}"
    );
    assert!(after > 0.9, "explained variance {before:.3} → {after:.3}");
}

#[test]
fn critic_only_updates_raise_the_explained_variance_on_a_fixed_dataset() {
    let cfg = ModelConfig::tiny(VOCAB);
    let policy = Model::new(&cfg, 1, &Device::Cpu).unwrap();
    let mut critic = SeparateCritic::new(CriticTrunk::new(&cfg, 2, &Device::Cpu).unwrap());
    assert_learns(&mut critic, &policy, Plan::plain(30, 1));
}

#[test]
fn a_feature_critic_fits_the_frozen_policys_features() {
    let cfg = ModelConfig::tiny(VOCAB);
    let policy = Model::new(&cfg, 1, &Device::Cpu).unwrap();
    let mut critic = FeatureCritic::new(ValueMlp::new(&policy, 2).unwrap());
    assert_learns(&mut critic, &policy, Plan::plain(3, 10));
}

#[test]
fn a_state_critic_fits_the_records_critic_states() {
    let cfg = ModelConfig::tiny(VOCAB);
    let policy = Model::new(&cfg, 1, &Device::Cpu).unwrap();
    assert_learns(&mut state_critic(1), &policy, Plan::plain(3, 10));
}

#[test]
fn a_state_critic_with_a_history_fits_the_states_of_earlier_batches() {
    // Each round trains on half the states; a history of two batches holds all four.
    let cfg = ModelConfig::tiny(VOCAB);
    let policy = Model::new(&cfg, 1, &Device::Cpu).unwrap();
    let plan = Plan {
        rounds: 6,
        critic_epochs: 10,
        alternate: true,
    };
    let (before, after, metrics) = fit(&mut state_critic(2), &policy, &plan);
    assert_eq!(metrics["critic/history_rows"], 16.0);
    assert!(after > 0.9, "explained variance {before:.3} → {after:.3}");
}

#[test]
fn a_state_critic_names_a_record_without_a_critic_state() {
    let critic =
        ValueMlp::with_width(STATE_WIDTH, &ModelConfig::tiny(VOCAB), 2, &Device::Cpu).unwrap();
    let mut records = records();
    records[5].critic_state.clear();
    let error = state_values(&critic, &records, CriticTarget::StepStart, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("trajectory 5, step 0") && error.contains("0 numbers"),
        "{error}"
    );
}

trait Flat {
    fn to_vec1_flat(&self) -> Vec<f32>;
}

impl Flat for candle_core::Tensor {
    fn to_vec1_flat(&self) -> Vec<f32> {
        self.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }
}

#[test]
fn a_critic_copied_from_the_policy_starts_from_its_trunk_and_owns_its_weights() {
    let cfg = ModelConfig::tiny(VOCAB);
    let policy = Model::new(&cfg, 1, &Device::Cpu).unwrap();
    let critic = CriticTrunk::from_policy(&policy, 2, false).unwrap();
    let policy_vars: std::collections::HashMap<String, Vec<f32>> = policy
        .named_vars()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().to_vec1_flat()))
        .collect();
    let mut trunk = 0;
    for (name, var) in critic.named_vars() {
        if name.starts_with("score.") {
            continue;
        }
        assert_eq!(policy_vars[&name], var.as_tensor().to_vec1_flat(), "{name}");
        var.set(&var.as_tensor().zeros_like().unwrap()).unwrap();
        trunk += 1;
    }
    assert!(trunk > 0);
    for (name, var) in policy.named_vars() {
        assert_eq!(
            policy_vars[&name],
            var.as_tensor().to_vec1_flat(),
            "{name} moved"
        );
    }
}
