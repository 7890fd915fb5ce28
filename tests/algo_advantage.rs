//! Estimators, filters and the replay export on small hand-computed batches. Every expected
//! number is derived from the formulas in the comments, not from the code under test.

use stepppo::algo::config::{
    AdvantageConfig, Estimator, FilterConfig, FilterType, GigpoMode, Grouping, NormMethod,
    RewardNormalization,
};
use stepppo::algo::{
    compute_advantages, replay_rows, uncertainty_filter, zero_signal, AdvantageInputs,
};
use stepppo::store::StepRecord;

const TOL: f32 = 1e-5;

fn rec(traj: u64, group: u64, step: u32, reward: f32, tokens: usize) -> StepRecord {
    StepRecord {
        traj_id: traj,
        group_id: group,
        step_index: step,
        env_tag: "t".into(),
        response_ids: vec![7; tokens],
        response_logprobs: vec![-1.0; tokens],
        reward,
        ..Default::default()
    }
}

fn last(mut r: StepRecord) -> StepRecord {
    r.terminated = true;
    r
}

fn state(mut r: StepRecord, hash: u64, text: &str) -> StepRecord {
    r.state_hash = hash;
    r.info.observation_text = text.into();
    r
}

fn cfg(estimator: Estimator) -> AdvantageConfig {
    AdvantageConfig {
        adv_estimator: estimator,
        ..Default::default()
    }
}

fn close(got: f32, want: f64) {
    assert!(
        (got as f64 - want).abs() < TOL as f64,
        "got {got}, want {want}"
    );
}

fn unbiased_std(xs: &[f64]) -> f64 {
    let m = xs.iter().sum::<f64>() / xs.len() as f64;
    (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

#[test]
fn step_gae_uneven_lengths_shuffled_input_and_step_whitening() {
    // traj 1: rewards [0, 1], V [0.5, 0.2], terminated; traj 2: reward 2, V 1, terminated.
    let records = vec![
        last(rec(2, 1, 0, 2.0, 3)),
        last(rec(1, 1, 1, 1.0, 2)),
        rec(1, 1, 0, 0.0, 4),
    ];
    let values = [1.0, 0.2, 0.5];
    let c = AdvantageConfig {
        gamma: 0.5,
        lambd: 0.5,
        ..cfg(Estimator::StepGae)
    };
    let out = compute_advantages(
        &records,
        &AdvantageInputs {
            values: Some(&values),
            ..Default::default()
        },
        &c,
    )
    .unwrap();
    // traj 1, t=1: δ = 1 − 0.2 = 0.8 = Â; R = 1.0. t=0: δ = 0 + 0.5·0.2 − 0.5 = −0.4; Â = −0.4 + 0.25·0.8 = −0.2; R = 0.3
    // traj 2: δ = 2 − 1 = 1 = Â; R = 2
    let raw = [1.0, 0.8, -0.2];
    for (s, (&a, r)) in out.per_step.iter().zip(raw.iter().zip([2.0, 1.0, 0.3])) {
        close(s.advantage_raw, a);
        close(s.ret, r);
    }
    let mean = 1.6 / 3.0;
    let std = unbiased_std(&raw);
    for (s, a) in out.per_step.iter().zip(raw) {
        close(s.advantage, (a - mean) / (std + 1e-8));
    }
    // broadcast to tokens
    let tokens = out.token_advantages(&records);
    assert_eq!(tokens[2].len(), 4);
    assert!(tokens[2].iter().all(|&a| a == out.per_step[2].advantage));
}

#[test]
fn step_gae_values_the_state_after_a_cut_or_terminated_trajectory_at_zero() {
    let values = [0.5];
    let base = AdvantageConfig {
        gamma: 0.9,
        ..cfg(Estimator::StepGae)
    };
    for (truncated, terminated) in [(true, false), (false, true), (false, false)] {
        let mut r = rec(9, 1, 0, 0.0, 1);
        r.truncated = truncated;
        r.terminated = terminated;
        let inputs = AdvantageInputs {
            values: Some(&values),
            ..Default::default()
        };
        let out = compute_advantages(&[r], &inputs, &base).unwrap();
        // δ = 0 + 0.9·0 − 0.5
        close(out.per_step[0].advantage_raw, -0.5);
        close(out.per_step[0].ret, 0.0);
    }
}

#[test]
fn token_gae_skips_observation_tokens_and_whitens_tokens() {
    // step 0: tokens V [0.1, 0.2], reward 0.5 on its last token; step 1: V [0.3], reward 1.
    let records = vec![rec(1, 1, 0, 0.5, 2), last(rec(1, 1, 1, 1.0, 1))];
    let tv = vec![vec![0.1, 0.2], vec![0.3]];
    let c = AdvantageConfig {
        gamma: 0.9,
        lambd: 0.8,
        ..cfg(Estimator::TokenGae)
    };
    let out = compute_advantages(
        &records,
        &AdvantageInputs {
            token_values: Some(&tv),
            ..Default::default()
        },
        &c,
    )
    .unwrap();
    // (1,0): δ = 1 − 0.3 = 0.7; (0,1): δ = 0.5 + 0.9·0.3 − 0.2 = 0.57, A = 0.57 + 0.72·0.7 = 1.074
    // (0,0): δ = 0.9·0.2 − 0.1 = 0.08, A = 0.08 + 0.72·1.074 = 0.85328
    let raw = [0.85328, 1.074, 0.7];
    let tok = out.per_token.as_ref().unwrap();
    close(tok.returns[0][0], 0.85328 + 0.1);
    close(tok.returns[0][1], 1.074 + 0.2);
    close(tok.returns[1][0], 1.0);
    close(out.per_step[0].advantage_raw, 0.85328);
    let mean = raw.iter().sum::<f64>() / 3.0;
    let scale = 1.0 / (unbiased_std(&raw).powi(2) + 1e-8).sqrt();
    close(tok.advantages[0][0], (raw[0] - mean) * scale);
    close(tok.advantages[0][1], (raw[1] - mean) * scale);
    close(tok.advantages[1][0], (raw[2] - mean) * scale);
}

/// Group 1: scores 1 (2 steps), 0 (1 step), 1 (3 steps); group 2: one trajectory;
/// group 3: two trajectories with equal scores.
fn score_batch() -> Vec<StepRecord> {
    vec![
        rec(1, 1, 0, 0.0, 1),
        last(rec(1, 1, 1, 1.0, 1)),
        last(rec(2, 1, 0, 0.0, 1)),
        rec(3, 1, 0, 0.0, 1),
        rec(3, 1, 1, 0.0, 1),
        last(rec(3, 1, 2, 1.0, 1)),
        last(rec(4, 2, 0, 3.0, 1)),
        last(rec(5, 3, 0, 0.5, 1)),
        last(rec(6, 3, 0, 0.5, 1)),
    ]
}

fn per_step_raw(estimator: Estimator, tweak: impl Fn(&mut AdvantageConfig)) -> Vec<f32> {
    let mut c = cfg(estimator);
    tweak(&mut c);
    let out = compute_advantages(&score_batch(), &AdvantageInputs::default(), &c).unwrap();
    out.per_step.iter().map(|s| s.advantage_raw).collect()
}

#[test]
fn grpo_counts_each_trajectory_once_and_zeroes_singleton_and_zero_std_groups() {
    let adv = per_step_raw(Estimator::Reinforce, |_| {});
    // group 1 scores [1, 0, 1]: mean 2/3, unbiased std sqrt(1/3)
    let std = (1.0f64 / 3.0).sqrt() + 1e-6;
    let (hi, lo) = ((1.0 / 3.0) / std, (-2.0 / 3.0) / std);
    let want = [hi, hi, lo, hi, hi, hi, 0.0, 0.0, 0.0];
    adv.iter().zip(want).for_each(|(&g, w)| close(g, w));
}

#[test]
fn dr_grpo_rloo_and_batch_identity() {
    let dr = per_step_raw(Estimator::DrGrpo, |_| {});
    let want = [
        1.0 / 3.0,
        1.0 / 3.0,
        -2.0 / 3.0,
        1.0 / 3.0,
        1.0 / 3.0,
        1.0 / 3.0,
        0.0,
        0.0,
        0.0,
    ];
    dr.iter().zip(want).for_each(|(&g, w)| close(g, w));
    // RLOO: 1 − (0+1)/2 = 0.5; 0 − (1+1)/2 = −1; singleton 0; equal pair 0
    let rloo = per_step_raw(Estimator::Rloo, |_| {});
    let want = [0.5, 0.5, -1.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0];
    rloo.iter().zip(want).for_each(|(&g, w)| close(g, w));
    // batch + mean: six scores 1, 0, 1, 3, 0.5, 0.5 → mean 1
    let batch = per_step_raw(Estimator::Reinforce, |c| {
        c.reward_normalization = RewardNormalization {
            grouping: Some(Grouping::Batch),
            method: Some(NormMethod::Mean),
        }
    });
    let want = [0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 2.0, -0.5, -0.5];
    batch.iter().zip(want).for_each(|(&g, w)| close(g, w));
    // identity + reward_clip 0.5 clamps the score 3 of traj 4
    let clipped = per_step_raw(Estimator::Reinforce, |c| {
        c.reward_normalization.method = Some(NormMethod::Identity);
        c.reward_clip = Some(0.5);
    });
    close(clipped[6], 0.5);
    close(clipped[0], 0.5);
}

#[test]
fn score_estimator_returns_are_reward_to_go() {
    let c = AdvantageConfig {
        gamma: 0.5,
        ..cfg(Estimator::Reinforce)
    };
    let out = compute_advantages(&score_batch(), &AdvantageInputs::default(), &c).unwrap();
    // traj 3 rewards [0, 0, 1], γ 0.5 → [0.25, 0.5, 1]
    close(out.per_step[3].ret, 0.25);
    close(out.per_step[4].ret, 0.5);
    close(out.per_step[5].ret, 1.0);
}

#[test]
fn invalid_steps_earn_no_positive_advantage_when_clamped() {
    let valid = |mut r: StepRecord| {
        r.info.action_is_valid = true;
        r
    };
    // Trajectory 0: a malformed answer (penalty −0.1), then the goal; trajectory 1: one valid
    // step into a hole; trajectory 2: one malformed answer and the end.
    let records = vec![
        rec(0, 0, 0, -0.1, 2),
        last(valid(rec(0, 0, 1, 1.0, 2))),
        last(valid(rec(1, 0, 0, 0.0, 2))),
        last(rec(2, 0, 0, -0.1, 2)),
    ];
    let values = [0.0f32; 4];
    let inputs = AdvantageInputs {
        values: Some(&values),
        ..Default::default()
    };
    let c = |clamp| AdvantageConfig {
        whiten_advantages: Some(false),
        clamp_invalid_advantages: clamp,
        ..cfg(Estimator::StepGae)
    };
    // γ = λ = 1, V = 0: Â = reward-to-go = [0.9, 1, 0, −0.1].
    let plain = compute_advantages(&records, &inputs, &c(false)).unwrap();
    let want = [0.9, 1.0, 0.0, -0.1];
    for (s, w) in plain.per_step.iter().zip(want) {
        close(s.advantage, w);
    }
    let clamped = compute_advantages(&records, &inputs, &c(true)).unwrap();
    for (s, w) in clamped.per_step.iter().zip([0.0, 1.0, 0.0, -0.1]) {
        close(s.advantage, w);
    }
    assert_eq!(clamped.token_advantages(&records)[0], vec![0.0, 0.0]);
    assert_eq!(clamped.metrics["advantage/invalid_clamped_frac"], 0.25);
    // The return targets (the critic's) are untouched.
    close(clamped.per_step[0].ret, 0.9);
}

#[test]
fn whitening_and_advantage_clip_on_a_step_level_estimator() {
    let c = AdvantageConfig {
        whiten_advantages: Some(true),
        advantage_clip: Some(0.5),
        ..cfg(Estimator::DrGrpo)
    };
    let out = compute_advantages(&score_batch(), &AdvantageInputs::default(), &c).unwrap();
    let raw = [
        1.0 / 3.0,
        1.0 / 3.0,
        -2.0 / 3.0,
        1.0 / 3.0,
        1.0 / 3.0,
        1.0 / 3.0,
        0.0,
        0.0,
        0.0,
    ];
    let mean = raw.iter().sum::<f64>() / 9.0;
    let std = unbiased_std(&raw) + 1e-8;
    let mut clipped = 0;
    for (s, r) in out.per_step.iter().zip(raw) {
        let w = (r - mean) / std;
        if w.abs() > 0.5 {
            clipped += 1;
        }
        close(s.advantage, w.clamp(-0.5, 0.5));
    }
    assert!(clipped > 0);
    assert_eq!(out.metrics["advantage/clip_frac"], clipped as f64 / 9.0);
}

#[test]
fn reinforce_plus_plus_token_returns_and_baseline_token_whitening() {
    // step 0: 2 tokens, reward 1; step 1: 1 token, reward 2; γ 0.5
    let records = vec![rec(1, 1, 0, 1.0, 2), last(rec(1, 1, 1, 2.0, 1))];
    let c = AdvantageConfig {
        gamma: 0.5,
        whiten_advantages: Some(false),
        ..cfg(Estimator::ReinforcePlusPlus)
    };
    let out = compute_advantages(&records, &AdvantageInputs::default(), &c).unwrap();
    // token rewards [0, 1], [2]: returns (1,0)=2, (0,1)=1+0.5·2=2, (0,0)=0.5·2=1
    assert_eq!(
        out.per_token.as_ref().unwrap().advantages,
        vec![vec![1.0, 2.0], vec![2.0]]
    );
    let whitened = compute_advantages(
        &records,
        &AdvantageInputs::default(),
        &AdvantageConfig {
            whiten_advantages: None,
            ..c
        },
    )
    .unwrap();
    // mean 5/3, unbiased var 1/3
    let scale = 1.0 / (1.0f64 / 3.0 + 1e-8).sqrt();
    close(
        whitened.per_token.unwrap().advantages[0][0],
        (1.0 - 5.0 / 3.0) * scale,
    );

    // baseline: S = 1 (2 tokens) and S = 0 (1 token) → A = ±0.5; token-weighted mean 1/6, var 1/3
    let records = vec![last(rec(1, 1, 0, 1.0, 2)), last(rec(2, 1, 0, 0.0, 1))];
    let out = compute_advantages(
        &records,
        &AdvantageInputs::default(),
        &cfg(Estimator::ReinforcePlusPlusBaseline),
    )
    .unwrap();
    close(out.per_step[0].advantage_raw, 0.5);
    close(out.per_step[0].advantage, (0.5 - 1.0 / 6.0) * scale);
    close(out.per_step[1].advantage, (-0.5 - 1.0 / 6.0) * scale);
}

fn gigpo_batch() -> Vec<StepRecord> {
    vec![
        state(rec(1, 1, 0, 0.0, 1), 100, "start"),
        last(state(rec(1, 1, 1, 1.0, 1), 101, "left")),
        state(rec(2, 1, 0, 0.0, 1), 100, "start"),
        last(state(rec(2, 1, 1, 0.0, 1), 102, "right")),
        // same anchor hash in another trajectory group: must not join group 1's step group
        last(state(rec(3, 2, 0, 5.0, 1), 100, "start")),
    ]
}

#[test]
fn gigpo_repeated_and_unique_anchor_states() {
    let c = AdvantageConfig {
        step_reward_gamma: 0.5,
        ..cfg(Estimator::Gigpo)
    };
    let out = compute_advantages(&gigpo_batch(), &AdvantageInputs::default(), &c).unwrap();
    // episode (mean_norm): scores 1, 0 → ±0.5; traj 3 alone → 0
    // step returns: traj 1 [0.5, 1], traj 2 [0, 0]; anchor 100 in group 1: {0.5, 0} → ±0.25; others unique → 0
    let want = [0.75, 0.5, -0.75, -0.5, 0.0];
    out.per_step
        .iter()
        .zip(want)
        .for_each(|(s, w)| close(s.advantage_raw, w));
    close(out.per_step[0].ret, 0.5);
    assert_eq!(out.metrics["gigpo/num_step_groups"], 4.0);
    assert_eq!(out.metrics["gigpo/singleton_fraction"], 0.75);

    // mean_std_norm and ω = 2: episode ±0.5/(√0.5 + 1e-6); anchor 100: ±0.25/(√0.125 + 1e-6)
    let c = AdvantageConfig {
        step_reward_gamma: 0.5,
        gigpo: stepppo::algo::config::GigpoConfig {
            mode: GigpoMode::MeanStdNorm,
            step_weight: 2.0,
            ..Default::default()
        },
        ..cfg(Estimator::Gigpo)
    };
    let out = compute_advantages(&gigpo_batch(), &AdvantageInputs::default(), &c).unwrap();
    let e = 0.5 / (0.5f64.sqrt() + 1e-6);
    let s = 0.25 / (0.125f64.sqrt() + 1e-6);
    close(out.per_step[0].advantage_raw, e + 2.0 * s);
    close(out.per_step[1].advantage_raw, e);
    close(out.per_step[2].advantage_raw, -e - 2.0 * s);
    close(out.per_step[4].advantage_raw, 0.0);
}

#[test]
fn gigpo_similarity_threshold_joins_near_identical_observations() {
    // "abcd" vs "abce": ratio 2·3/8 = 0.75
    let records = vec![
        last(state(rec(1, 1, 0, 1.0, 1), 1, "abcd")),
        last(state(rec(2, 1, 0, 0.0, 1), 2, "abce")),
    ];
    let mut c = AdvantageConfig {
        step_reward_gamma: 1.0,
        ..cfg(Estimator::Gigpo)
    };
    c.gigpo.episode_weight = 0.0;
    let exact = compute_advantages(&records, &AdvantageInputs::default(), &c).unwrap();
    close(exact.per_step[0].advantage_raw, 0.0);
    c.gigpo.similarity_threshold = Some(0.7);
    let similar = compute_advantages(&records, &AdvantageInputs::default(), &c).unwrap();
    close(similar.per_step[0].advantage_raw, 0.5);
    close(similar.per_step[1].advantage_raw, -0.5);
    c.gigpo.similarity_threshold = Some(0.8);
    close(
        compute_advantages(&records, &AdvantageInputs::default(), &c)
            .unwrap()
            .per_step[0]
            .advantage_raw,
        0.0,
    );
}

#[test]
fn step_reinforce_normalises_discounted_step_returns() {
    // traj 1 rewards [0, 1] → G [0.5, 1]; traj 2 reward [1] → G [1]; group mean 5/6
    let records = vec![
        rec(1, 1, 0, 0.0, 1),
        last(rec(1, 1, 1, 1.0, 1)),
        last(rec(2, 1, 0, 1.0, 1)),
    ];
    let mut c = AdvantageConfig {
        step_reward_gamma: 0.5,
        ..cfg(Estimator::StepReinforce)
    };
    c.reward_normalization.method = Some(NormMethod::Mean);
    let out = compute_advantages(&records, &AdvantageInputs::default(), &c).unwrap();
    let want = [0.5 - 5.0 / 6.0, 1.0 - 5.0 / 6.0, 1.0 - 5.0 / 6.0];
    out.per_step
        .iter()
        .zip(want)
        .for_each(|(s, w)| close(s.advantage_raw, w));
    close(out.per_step[0].ret, 0.5);
}

#[test]
fn kl_in_reward_penalty_lowers_step_rewards() {
    let records = vec![last(rec(1, 1, 0, 1.0, 2))];
    let penalty = vec![vec![0.1, 0.2]];
    let values = [0.0];
    let inputs = AdvantageInputs {
        values: Some(&values),
        token_reward_penalty: Some(&penalty),
        ..Default::default()
    };
    let out = compute_advantages(&records, &inputs, &cfg(Estimator::StepGae)).unwrap();
    close(out.per_step[0].reward, 0.7);
    close(out.per_step[0].advantage_raw, 0.7);
}

#[test]
fn zero_signal_detects_group_size_one_with_group_normalisation() {
    let records = vec![last(rec(1, 1, 0, 1.0, 1)), last(rec(2, 2, 0, 0.0, 1))];
    let out = compute_advantages(
        &records,
        &AdvantageInputs::default(),
        &cfg(Estimator::Reinforce),
    )
    .unwrap();
    assert_eq!(out.metrics["advantage/zero_fraction"], 1.0);
    let adv: Vec<f32> = out.per_step.iter().map(|s| s.advantage).collect();
    let warning = zero_signal(&adv).expect("all-zero batch must warn");
    assert!(warning.message.contains("all 2 advantages are zero"));
    assert!(zero_signal(&[0.0, 0.1]).is_none());
    assert!(zero_signal(&[]).is_none());
}

#[test]
fn uncertainty_filter_keeps_top_std_groups() {
    // group stds (unbiased): g1 {0,1} → 0.707; g2 {0,0} → 0; g3 {0,4} → 2.83; g4 {1,2} → 0.707
    let mut records = Vec::new();
    for (g, (a, b)) in [
        (1, (0.0, 1.0)),
        (2, (0.0, 0.0)),
        (3, (0.0, 4.0)),
        (4, (1.0, 2.0)),
    ] {
        records.push(last(rec(g * 10, g, 0, a, 1)));
        records.push(last(rec(g * 10 + 1, g, 0, b, 1)));
    }
    // a format penalty of −1 inside group 2's reward is not counted
    records[2].reward = -1.0;
    records[2].info.format_penalty = -1.0;
    let keep = |t: FilterType, ratio: f32| {
        uncertainty_filter(
            &records,
            &FilterConfig {
                filter_type: t,
                keep_ratio: ratio,
            },
        )
    };
    let top = keep(FilterType::Std, 0.5);
    assert_eq!(
        top.kept_groups.iter().copied().collect::<Vec<_>>(),
        vec![1, 3]
    ); // tie 1 vs 4 → lower id
    assert_eq!(
        top.keep,
        vec![true, true, false, false, true, true, false, false]
    );
    assert!((top.metrics["filter/std_max_after"] - 8f64.sqrt()).abs() < 1e-9);
    let rev = keep(FilterType::StdRev, 0.25);
    assert_eq!(rev.kept_groups.iter().copied().collect::<Vec<_>>(), vec![2]);
    assert!(keep(FilterType::Std, 1.0).keep.iter().all(|&k| k));
    // never empty
    assert_eq!(keep(FilterType::Std, 0.1).kept_groups.len(), 1);
}

#[test]
fn replay_rows_use_zero_values_without_a_critic() {
    let records = vec![rec(1, 4, 0, 0.0, 1), last(rec(1, 4, 1, 1.0, 1))];
    let export = replay_rows(
        &records,
        &AdvantageInputs::default(),
        &cfg(Estimator::StepGae),
    )
    .unwrap();
    assert!(export.zero_values);
    // V = 0, γ = λ = 1: Â = [1, 1], returns [1, 1]; whitening of equal values gives 0
    let row = &export.rows[0];
    assert_eq!((row.traj_id, row.group_id, row.step_index), (1, 4, 0));
    close(row.advantage_raw, 1.0);
    close(row.ret, 1.0);
    close(row.advantage, 0.0);
    let json = serde_json::to_value(row).unwrap();
    for key in [
        "traj_id",
        "group_id",
        "step_index",
        "reward",
        "value",
        "advantage_raw",
        "advantage",
        "return",
    ] {
        assert!(json.get(key).is_some(), "missing {key}");
    }
    let grpo = replay_rows(
        &records,
        &AdvantageInputs::default(),
        &cfg(Estimator::Reinforce),
    )
    .unwrap();
    assert!(!grpo.zero_values);
}

#[test]
fn malformed_batches_are_errors_not_panics() {
    let dup = vec![rec(1, 1, 0, 0.0, 1), rec(1, 1, 0, 0.0, 1)];
    let err = compute_advantages(
        &dup,
        &AdvantageInputs::default(),
        &cfg(Estimator::Reinforce),
    )
    .unwrap_err();
    assert!(err.to_string().contains("step 0 twice"), "{err}");
    let one = vec![rec(1, 1, 0, 0.0, 1)];
    let err = compute_advantages(&one, &AdvantageInputs::default(), &cfg(Estimator::StepGae))
        .unwrap_err();
    assert!(err.to_string().contains("per-step critic values"), "{err}");
    let err = compute_advantages(
        &one,
        &AdvantageInputs {
            values: Some(&[0.0, 1.0]),
            ..Default::default()
        },
        &cfg(Estimator::StepGae),
    )
    .unwrap_err();
    assert!(err.to_string().contains("values"), "{err}");
    let tv = vec![vec![0.0, 0.0]];
    let err = compute_advantages(
        &one,
        &AdvantageInputs {
            token_values: Some(&tv),
            ..Default::default()
        },
        &cfg(Estimator::TokenGae),
    )
    .unwrap_err();
    assert!(err.to_string().contains("traj 1 step 0"), "{err}");
    let mut nan = rec(1, 1, 0, f32::NAN, 1);
    nan.terminated = true;
    assert!(compute_advantages(
        &[nan],
        &AdvantageInputs::default(),
        &cfg(Estimator::Reinforce)
    )
    .is_err());
    let mixed = vec![rec(1, 1, 0, 0.0, 1), rec(1, 2, 1, 0.0, 1)];
    assert!(compute_advantages(
        &mixed,
        &AdvantageInputs::default(),
        &cfg(Estimator::Reinforce)
    )
    .is_err());
    assert!(
        compute_advantages(&[], &AdvantageInputs::default(), &cfg(Estimator::Gigpo))
            .unwrap()
            .per_step
            .is_empty()
    );
}

#[test]
fn step_returns_are_discounted_within_each_trajectory_in_any_order() {
    let step = |traj_id, step_index, reward| StepRecord {
        traj_id,
        step_index,
        reward,
        ..StepRecord::default()
    };
    let records = [step(0, 1, 1.0), step(1, 0, 5.0), step(0, 0, 0.0)];
    let returns = stepppo::algo::step_returns(&records, 0.5).unwrap();
    assert_eq!(returns, vec![1.0, 5.0, 0.5]);
}
