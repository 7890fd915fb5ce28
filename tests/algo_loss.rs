//! PPO/GSPO actor loss, critic loss and aggregation on hand-computed cases, plus gradient
//! checks (candle backward vs central finite differences in f64 on a tiny linear model).

use candle_core::{DType, Device, IndexOp, Tensor, Var, D};
use stepppo::algo::config::{KlConfig, KlEstimator, KlMode, LossAggMode, LossConfig, RatioType};
use stepppo::algo::loss::{agg_loss, kl_reward_penalty, policy_loss, value_loss, VarianceParts};

fn t(rows: &[&[f64]]) -> Tensor {
    let v: Vec<Vec<f64>> = rows.iter().map(|r| r.to_vec()).collect();
    Tensor::new(v, &Device::Cpu).unwrap()
}

fn scalar(x: &Tensor) -> f64 {
    x.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

/// Config values are f32, so clip bounds carry f32 rounding (≈ 3e-9).
fn close(got: f64, want: f64) {
    assert!((got - want).abs() < 1e-7, "got {got}, want {want}");
}

#[test]
fn every_loss_agg_mode() {
    // rows: [1, 2, 3] all valid; [4, ·, ·] one token; [5, 5, 5] fully masked (ignored)
    let loss = t(&[&[1.0, 2.0, 3.0], &[4.0, 9.0, 9.0], &[5.0, 5.0, 5.0]]);
    let mask = t(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
    let agg = |mode, len| scalar(&agg_loss(&loss, &mask, mode, len).unwrap());
    close(agg(LossAggMode::TokenMean, None), 10.0 / 4.0);
    close(agg(LossAggMode::SeqMeanTokenSum, None), (6.0 + 4.0) / 2.0);
    close(agg(LossAggMode::SeqMeanTokenMean, None), (2.0 + 4.0) / 2.0);
    close(
        agg(LossAggMode::SeqMeanTokenSumNorm, None),
        (6.0 + 4.0) / 2.0 / 3.0,
    );
    close(
        agg(LossAggMode::SeqMeanTokenSumNorm, Some(5)),
        (6.0 + 4.0) / 2.0 / 5.0,
    );
}

fn token_cfg() -> LossConfig {
    LossConfig {
        loss_agg_mode: LossAggMode::TokenMean,
        ..Default::default()
    }
}

/// Loss of single tokens with the given log-ratio and advantage.
fn single_token(log_ratio: f64, adv: f64, cfg: &LossConfig) -> (f64, stepppo::algo::PolicyMetrics) {
    let lp = t(&[&[log_ratio]]);
    let old = t(&[&[0.0]]);
    let (loss, m) = policy_loss(
        &lp,
        &old,
        &t(&[&[adv]]),
        &t(&[&[1.0]]),
        None,
        &t(&[&[0.0]]),
        cfg,
    )
    .unwrap();
    (scalar(&loss), m)
}

#[test]
fn clipped_surrogate_symmetric_and_asymmetric() {
    let ln = f64::ln;
    // A = 1, ρ = 1.5, ε 0.2 → max(−1.5, −1.2) = −1.2
    let (l, m) = single_token(ln(1.5), 1.0, &token_cfg());
    close(l, -1.2);
    assert_eq!(
        (m.clipfrac, m.clipfrac_high, m.clipfrac_low),
        (1.0, 1.0, 0.0)
    );
    // ε_high 0.28 → −1.28
    let asym = LossConfig {
        pg_clip_high: Some(0.28),
        ..token_cfg()
    };
    close(single_token(ln(1.5), 1.0, &asym).0, -1.28);
    // A = −1, ρ = 0.5 → max(0.5, 0.8) = 0.8
    let (l, m) = single_token(ln(0.5), -1.0, &token_cfg());
    close(l, 0.8);
    assert_eq!(m.clipfrac_low, 1.0);
    // inside the trust region: −A·ρ
    close(single_token(ln(1.1), 2.0, &token_cfg()).0, -2.2);
}

#[test]
fn dual_clip_bounds_negative_advantages_only() {
    let ln = f64::ln;
    let dual = LossConfig {
        dual_clip_loss: true,
        dual_clip_c: Some(3.0),
        ..token_cfg()
    };
    // A = −1, ρ = 5: max(5, 1.2) = 5 → min(5, 3) = 3
    let (l, m) = single_token(ln(5.0), -1.0, &dual);
    close(l, 3.0);
    assert_eq!(m.clipfrac_lower, 1.0);
    close(single_token(ln(5.0), -1.0, &token_cfg()).0, 5.0);
    // A = +1, ρ = 5: clipped to −1.2, dual clip does not apply
    let (l, m) = single_token(ln(5.0), 1.0, &dual);
    close(l, -1.2);
    assert_eq!(m.clipfrac_lower, 0.0);
    // default c = 1 + 2·0.2 = 1.4
    let roll = LossConfig {
        dual_clip_loss: true,
        ..token_cfg()
    };
    close(single_token(ln(5.0), -2.0, &roll).0, 2.8);
}

#[test]
fn gspo_segment_ratio_is_the_geometric_mean_of_token_ratios() {
    let lp = t(&[&[-1.0, -0.5, -2.0, 0.0]]);
    let old = t(&[&[-1.2, -0.3, -2.05, 0.0]]);
    let mask = t(&[&[1.0, 1.0, 1.0, 0.0]]);
    let cfg = LossConfig {
        ratio_type: RatioType::Segment,
        pg_clip: 10.0,
        ..Default::default()
    };
    let (loss, m) = policy_loss(
        &lp,
        &old,
        &t(&[&[1.0; 4]]),
        &mask,
        None,
        &t(&[&[0.0; 4]]),
        &cfg,
    )
    .unwrap();
    // token ratios e^{0.2}, e^{−0.2}, e^{0.05}: geometric mean = (Π ρ)^{1/3}
    let geo = (0.2f64.exp() * (-0.2f64).exp() * 0.05f64.exp()).powf(1.0 / 3.0);
    close(m.ratio_mean, geo);
    close(m.ratio_min, geo);
    close(m.ratio_max, geo);
    close(scalar(&loss), -geo);
}

#[test]
fn kl_loss_and_entropy_bonus() {
    let lp = t(&[&[-1.0, -2.0]]);
    let reference = t(&[&[-1.5, -1.0]]);
    let ent = t(&[&[0.3, 0.5]]);
    let cfg = LossConfig {
        loss_agg_mode: LossAggMode::TokenMean,
        kl: KlConfig {
            coef: 0.1,
            estimator: KlEstimator::K3,
            mode: KlMode::Loss,
        },
        entropy_loss_coef: 0.01,
        ..Default::default()
    };
    let zeros = t(&[&[0.0, 0.0]]);
    let (loss, m) = policy_loss(
        &lp,
        &lp,
        &zeros,
        &t(&[&[1.0, 1.0]]),
        Some(&reference),
        &ent,
        &cfg,
    )
    .unwrap();
    // lr = 0.5, −1: k3 = e^{−lr} + lr − 1
    let k3 = |x: f64| (-x).exp() + x - 1.0;
    let kl = (k3(0.5) + k3(-1.0)) / 2.0;
    close(m.kl_loss, kl);
    close(m.entropy, 0.4);
    close(scalar(&loss), 0.1 * kl - 0.01 * 0.4);
    // a KL coefficient without a reference is an error
    assert!(policy_loss(&lp, &lp, &zeros, &t(&[&[1.0, 1.0]]), None, &ent, &cfg).is_err());
    // KL in reward: coef · k1(old − ref)
    let pen = kl_reward_penalty(
        &[vec![-1.0, -2.0]],
        &[vec![-1.5, -1.0]],
        0.2,
        KlEstimator::K1,
    )
    .unwrap();
    assert!((pen[0][0] - 0.1).abs() < 1e-6 && (pen[0][1] + 0.2).abs() < 1e-6);
}

#[test]
fn negative_unlikelihood_weighs_sure_wrong_choices_and_skips_forced_tokens() {
    // π = 0.9 with A = −2 (a sure, wrong choice), π = 0.5 with A = 1, a forced token (π = 1)
    // with A = −1; ratios 1.
    let lp = t(&[&[0.9f64.ln(), 0.5f64.ln(), 0.0]]);
    let adv = t(&[&[-2.0, 1.0, -1.0]]);
    let cfg = LossConfig {
        negative_unlikelihood_coef: 0.5,
        ..token_cfg()
    };
    let mask = t(&[&[1.0, 1.0, 1.0]]);
    let zeros = t(&[&[0.0, 0.0, 0.0]]);
    let (loss, m) = policy_loss(&lp, &lp, &adv, &mask, None, &zeros, &cfg).unwrap();
    let unlikelihood = 2.0 * -(0.1f64.ln()) / 3.0;
    close(m.unlikelihood_loss, unlikelihood);
    close(m.pg_loss, (2.0 - 1.0 + 1.0) / 3.0);
    close(scalar(&loss), m.pg_loss + 0.5 * unlikelihood);
    // off by default: the same tokens give no term and the plain surrogate
    let (plain, off) = policy_loss(&lp, &lp, &adv, &mask, None, &zeros, &token_cfg()).unwrap();
    assert_eq!(off.unlikelihood_loss, 0.0);
    close(scalar(&plain), m.pg_loss);
}

#[test]
fn shape_mismatch_is_an_error_naming_the_tensor() {
    let a = t(&[&[0.0, 0.0]]);
    let b = t(&[&[0.0]]);
    let err = policy_loss(&a, &a, &b, &a, None, &a, &LossConfig::default()).unwrap_err();
    assert!(err.to_string().contains("advantages"), "{err}");
}

#[test]
fn value_loss_clipping_and_explained_variance() {
    let cfg = LossConfig {
        value_clip: Some(0.5),
        loss_agg_mode: LossAggMode::TokenMean,
        ..Default::default()
    };
    // row 1: V 2, old 1, R 0 → V_clip 1.5; max(4, 2.25) = 4 (not clipped)
    // row 2: V 1, old 0, R 1 → V_clip 0.5; max(0, 0.25) = 0.25 (clipped term active)
    let (loss, m) = value_loss(
        &t(&[&[2.0], &[1.0]]),
        &t(&[&[1.0], &[0.0]]),
        &t(&[&[0.0], &[1.0]]),
        &t(&[&[1.0], &[1.0]]),
        &cfg,
    )
    .unwrap();
    close(scalar(&loss), 0.5 * (4.0 + 0.25) / 2.0);
    close(m.vf_clipfrac, 0.5);
    // residuals R − V = [−2, 0]: var 2; Var(R) = 0.5 → 1 − 4 = −3
    close(m.vf_explained_var, -3.0);
    // The parts behind that figure, for pooling over batches.
    let parts = VarianceParts::of(&[2.0, 1.0], &[0.0, 1.0]);
    close(parts.returns, 0.5);
    close(parts.residual, 2.0);
    close(parts.explained(), -3.0);
    let flat = VarianceParts::of(&[0.3, 0.7], &[1.0, 1.0]);
    assert_eq!(
        flat.explained(),
        0.0,
        "returns that do not vary explain nothing"
    );
}

// ---------- gradient checks ----------

const VOCAB: usize = 5;
const DIM: usize = 3;
const ROWS: usize = 2;
const LEN: usize = 3;

fn inputs() -> (Tensor, Tensor) {
    let x: Vec<f64> = (0..ROWS * LEN * DIM)
        .map(|i| ((i * 7 % 11) as f64 - 5.0) / 5.0)
        .collect();
    let x = Tensor::from_vec(x, (ROWS * LEN, DIM), &Device::Cpu).unwrap();
    let targets = Tensor::new(&[1u32, 4, 0, 2, 3, 1], &Device::Cpu).unwrap();
    (x, targets)
}

/// Log-probs of the targets and entropies, `[ROWS, LEN]`, from logits = x·Wᵀ.
fn policy_outputs(w: &Tensor) -> (Tensor, Tensor) {
    let (x, targets) = inputs();
    let logits = x.matmul(&w.t().unwrap()).unwrap();
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
    let picked = logp
        .gather(&targets.unsqueeze(1).unwrap(), 1)
        .unwrap()
        .squeeze(1)
        .unwrap();
    let entropy = (logp.exp().unwrap() * &logp)
        .unwrap()
        .sum(1)
        .unwrap()
        .neg()
        .unwrap();
    (
        picked.reshape((ROWS, LEN)).unwrap(),
        entropy.reshape((ROWS, LEN)).unwrap(),
    )
}

fn initial_w() -> Tensor {
    let w: Vec<f64> = (0..VOCAB * DIM)
        .map(|i| ((i * 5 % 13) as f64 - 6.0) / 8.0)
        .collect();
    Tensor::from_vec(w, (VOCAB, DIM), &Device::Cpu).unwrap()
}

/// Central finite differences of `f` at `w` vs the backward gradient.
fn check_gradient(f: impl Fn(&Tensor) -> Tensor) {
    let w0 = initial_w();
    let var = Var::from_tensor(&w0).unwrap();
    let grads = f(var.as_tensor()).backward().unwrap();
    let analytic = grads
        .get(&var)
        .expect("gradient reaches W")
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    let base = w0.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let h = 1e-6;
    for (k, &g) in analytic.iter().enumerate() {
        let at = |delta: f64| {
            let mut w = base.clone();
            w[k] += delta;
            scalar(&f(&Tensor::from_vec(w, (VOCAB, DIM), &Device::Cpu).unwrap()))
        };
        let numeric = (at(h) - at(-h)) / (2.0 * h);
        assert!(
            (numeric - g).abs() < 1e-6 * (1.0 + g.abs()),
            "dW[{k}]: backward {g}, finite difference {numeric}"
        );
    }
    assert!(
        analytic.iter().any(|g| g.abs() > 1e-4),
        "gradient must not vanish"
    );
}

/// Old log-probs = current − offsets: ratios e^{offset}, some outside [0.8, 1.2], none near the bounds.
fn old_logprobs() -> Tensor {
    let (lp, _) = policy_outputs(&initial_w());
    (lp - t(&[&[0.05, -0.3, 0.25], &[0.1, 0.4, -0.05]])).unwrap()
}

#[test]
fn policy_loss_gradient_matches_finite_differences_in_every_mode() {
    let old = old_logprobs();
    let reference = (old.clone() + 0.1).unwrap();
    let adv = t(&[&[1.0, -0.5, 2.0], &[-1.5, 0.7, 0.3]]);
    let mask = t(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
    for mode in [
        LossAggMode::TokenMean,
        LossAggMode::SeqMeanTokenSum,
        LossAggMode::SeqMeanTokenMean,
        LossAggMode::SeqMeanTokenSumNorm,
    ] {
        let cfg = LossConfig {
            loss_agg_mode: mode,
            pg_clip_high: Some(0.28),
            dual_clip_loss: true,
            kl: KlConfig {
                coef: 0.1,
                estimator: KlEstimator::K3,
                mode: KlMode::Loss,
            },
            entropy_loss_coef: 0.01,
            negative_unlikelihood_coef: 0.5,
            ..Default::default()
        };
        check_gradient(|w| {
            let (lp, ent) = policy_outputs(w);
            policy_loss(&lp, &old, &adv, &mask, Some(&reference), &ent, &cfg)
                .unwrap()
                .0
        });
    }
}

#[test]
fn gspo_token_gradient_matches_the_sequence_objective() {
    // With one advantage per row and seq-mean-token-mean, the GSPO-token gradient equals the
    // gradient of the sequence-ratio objective, so finite differences of the loss value agree.
    let old = old_logprobs();
    let adv = t(&[&[1.0, 1.0, 1.0], &[-0.8, -0.8, -0.8]]);
    let mask = t(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
    let cfg = LossConfig {
        ratio_type: RatioType::Segment,
        pg_clip: 0.5,
        ..Default::default()
    };
    check_gradient(|w| {
        let (lp, ent) = policy_outputs(w);
        policy_loss(&lp, &old, &adv, &mask, None, &ent, &cfg)
            .unwrap()
            .0
    });
}

#[test]
fn value_loss_gradient_matches_finite_differences() {
    // values = x · W[0] (a linear value head), clipped around old values
    let values_of = |w: &Tensor| {
        let (x, _) = inputs();
        x.matmul(&w.i(0..1).unwrap().t().unwrap())
            .unwrap()
            .reshape((ROWS, LEN))
            .unwrap()
    };
    let old = (values_of(&initial_w()) + t(&[&[0.3, -0.9, 0.0], &[1.2, 0.2, -0.6]])).unwrap();
    let returns = t(&[&[1.0, -1.0, 0.5], &[0.0, 2.0, 0.3]]);
    let mask = t(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 1.0]]);
    let cfg = LossConfig {
        value_clip: Some(0.5),
        ..Default::default()
    };
    check_gradient(|w| {
        value_loss(&values_of(w), &old, &returns, &mask, &cfg)
            .unwrap()
            .0
    });
}
