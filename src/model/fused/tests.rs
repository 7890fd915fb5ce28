//! Each fused op against its composed reference (values and gradients) and against central
//! finite differences of its own forward.

use candle_core::{DType, Device, Tensor, Var};

use super::*;
use crate::model::attention::tests::{max_diff, random};
use crate::model::decoder::{apply_rope, rms_norm as composed_rms_norm};

/// `Σ out ∘ weights` for fixed pseudo-random weights: a scalar whose gradient reaches every
/// output element with a different factor.
fn weighted_sum(out: &Tensor, seed: u64) -> Tensor {
    let w = random(out.shape(), seed);
    (out * w.as_tensor()).unwrap().sum_all().unwrap()
}

/// The gradients of `loss(inputs)` with respect to each input.
fn grads(inputs: &[&Var], loss: &Tensor) -> Vec<Tensor> {
    let store = loss.backward().unwrap();
    inputs
        .iter()
        .map(|v| store.get(v).unwrap().clone())
        .collect()
}

/// Fails unless `f`'s analytic gradient with respect to every input matches central finite
/// differences (step `h`) of `f` itself within `tol` (absolute, after scaling by max(1, |g|)).
fn check_finite_differences(inputs: &[&Var], f: &dyn Fn() -> Tensor, h: f32, tol: f32) {
    let analytic = grads(inputs, &f());
    for (var, grad) in inputs.iter().zip(&analytic) {
        let base = var.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let grad = grad.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for i in 0..base.len() {
            let at = |delta: f32| {
                let mut x = base.clone();
                x[i] += delta;
                var.set(&Tensor::from_vec(x, var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                f().to_dtype(DType::F64)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap()
            };
            let numeric = ((at(h) - at(-h)) / (2.0 * f64::from(h))) as f32;
            var.set(&Tensor::from_vec(base.clone(), var.shape(), &Device::Cpu).unwrap())
                .unwrap();
            let err = (numeric - grad[i]).abs() / grad[i].abs().max(1.0);
            assert!(
                err < tol,
                "element {i}: analytic {} numeric {numeric}",
                grad[i]
            );
        }
    }
}

/// Fails unless the outputs and input gradients of two implementations agree within `tol`.
fn assert_same(inputs: &[&Var], fused: &Tensor, reference: &Tensor, tol: f32) {
    assert_eq!(fused.dims(), reference.dims());
    let diff = max_diff(fused, reference);
    assert!(diff < tol, "outputs differ by {diff}");
    let (a, b) = (
        grads(inputs, &weighted_sum(fused, 99)),
        grads(inputs, &weighted_sum(reference, 99)),
    );
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        let diff = max_diff(a, b);
        assert!(diff < tol, "gradient of input {i} differs by {diff}");
    }
}

#[test]
fn rms_norm_matches_the_composed_ops_and_finite_differences() {
    // 37 rows: more than one chunk of rows, the last one partial.
    let (x, w) = (random((37, 24), 1), random(24, 2));
    let fused = rms_norm(&x, &w, 1e-6).unwrap();
    let reference = composed_rms_norm(&x, &w, 1e-6).unwrap();
    assert_same(&[&x, &w], &fused, &reference, 1e-5);
    let (x, w) = (random((3, 6), 3), random(6, 4));
    let f = || weighted_sum(&rms_norm(&x, &w, 1e-6).unwrap(), 5);
    check_finite_differences(&[&x, &w], &f, 1e-2, 1e-2);
}

#[test]
fn swiglu_matches_the_composed_ops_and_finite_differences() {
    let (g, u) = (random((5, 1000), 1), random((5, 1000), 2));
    let g4 = (g.as_tensor() * 4.0).unwrap();
    let g = Var::from_tensor(&g4).unwrap();
    let fused = swiglu(&g, &u).unwrap();
    let reference = (candle_nn::ops::silu(&g).unwrap() * u.as_tensor()).unwrap();
    assert_same(&[&g, &u], &fused, &reference, 1e-5);
    let (g, u) = (random((2, 5), 3), random((2, 5), 4));
    let f = || weighted_sum(&swiglu(&g, &u).unwrap(), 5);
    check_finite_differences(&[&g, &u], &f, 1e-2, 1e-2);
}

#[test]
fn rope_heads_match_the_composed_ops_and_finite_differences() {
    let (b, t, n, d) = (2, 5, 3, 8);
    let (cos, sin) = (random((b, 1, t, d), 1), random((b, 1, t, d), 2));
    let (cos, sin) = (cos.as_tensor(), sin.as_tensor());
    let x = random((b, t, n, d), 3);
    let fused = rope_heads(&x, cos, sin).unwrap();
    let heads = x.transpose(1, 2).unwrap().contiguous().unwrap();
    let reference = apply_rope(&heads, cos, sin).unwrap();
    assert_same(&[&x], &fused, &reference, 1e-6);
    let f = || weighted_sum(&rope_heads(&x, cos, sin).unwrap(), 5);
    check_finite_differences(&[&x], &f, 1e-2, 1e-2);
}

/// The composed reference of [`logprobs_entropy`]: logits scaled, biased, then log-softmax.
fn composed_logprobs(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f32,
    bias: Option<&Tensor>,
) -> (Tensor, Tensor) {
    let mut z = (logits / f64::from(temperature)).unwrap();
    if let Some(b) = bias {
        z = (z + b).unwrap();
    }
    crate::model::logprobs_entropy(&z, targets).unwrap()
}

#[test]
fn logprobs_entropy_match_the_composed_ops_with_bias_and_temperature() {
    let (n, v) = (40, 300);
    let logits = Var::from_tensor(&(random((n, v), 1).as_tensor() * 3.0).unwrap()).unwrap();
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 37) % v as u32).collect();
    let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    // Row r forbids every token but its target and the 5 after it (constrained decoding's bias).
    let mut bias = vec![-1e9f32; n * v];
    for (r, row) in bias.chunks_exact_mut(v).enumerate() {
        let t = (r * 37) % v;
        (t..(t + 6).min(v)).for_each(|j| row[j] = 0.0);
    }
    let bias = Tensor::from_vec(bias, (n, v), &Device::Cpu).unwrap();
    for (temperature, bias) in [(1.0, None), (0.7, Some(&bias))] {
        let (lp, ent) = logprobs_entropy(&logits, &targets, temperature, bias).unwrap();
        let (rlp, rent) = composed_logprobs(&logits, &targets, temperature, bias);
        let both = Tensor::cat(&[&lp, &ent], 0).unwrap();
        let reference = Tensor::cat(&[&rlp, &rent], 0).unwrap();
        assert_same(&[&logits], &both, &reference, 2e-5);
    }
}

#[test]
fn logprobs_entropy_match_finite_differences() {
    let logits = random((3, 7), 1);
    let targets = Tensor::new(&[0u32, 6, 3], &Device::Cpu).unwrap();
    let f = || {
        let (lp, ent) = logprobs_entropy(&logits, &targets, 0.8, None).unwrap();
        (weighted_sum(&lp, 2) + weighted_sum(&ent, 3)).unwrap()
    };
    check_finite_differences(&[&logits], &f, 1e-2, 1e-2);
}

#[test]
fn a_target_outside_the_vocabulary_is_an_error() {
    let logits = random((2, 4), 1);
    let targets = Tensor::new(&[0u32, 4], &Device::Cpu).unwrap();
    let err = logprobs_entropy(&logits, &targets, 1.0, None).unwrap_err();
    assert!(err.to_string().contains("vocabulary"), "{err}");
}

/// The PPO loss of a Qwen2 or Qwen3 `tiny` model over a right-padded batch (log-probs and
/// entropies at response positions, a temperature and a constrained-decoding bias) with the given
/// ops, and every parameter's gradient by name.
fn ppo_loss_and_gradients(model_type: &str, ops: TrainingOps) -> (f32, Vec<(String, Tensor)>) {
    use crate::algo::{config::LossConfig, policy_loss};
    use crate::model::{Model, ModelConfig, PaddedBatch};
    let dev = Device::Cpu;
    let mut cfg = ModelConfig::tiny(48);
    cfg.model_type = model_type.into();
    let mut model = Model::new(&cfg, 7, &dev).unwrap();
    model.set_training_ops(ops);
    let seqs: Vec<Vec<u32>> = [9usize, 6]
        .iter()
        .map(|&len| {
            (0..len as u32)
                .map(|i| (i * 13 + len as u32) % 48)
                .collect()
        })
        .collect();
    let batch = PaddedBatch::right_padded(&seqs, 0, &dev).unwrap();
    // Three response tokens per row: positions 4..7 of row 0 and 2..5 of row 1.
    let positions = Tensor::new(&[4u32, 5, 6, 11, 12, 13], &dev).unwrap();
    let targets: Vec<u32> = [(0, 5), (0, 6), (0, 7), (1, 3), (1, 4), (1, 5)]
        .iter()
        .map(|&(r, t)| seqs[r][t])
        .collect();
    let mut bias = vec![0f32; 6 * 48];
    bias[48..96].iter_mut().for_each(|b| *b = -1e9);
    bias[48 + targets[1] as usize] = 0.0;
    let bias = Tensor::from_vec(bias, (6, 48), &dev).unwrap();
    let targets = Tensor::new(targets.as_slice(), &dev).unwrap();
    let ids = (&batch.input_ids, &batch.attention_mask);
    let (logp, entropy) = model
        .logprobs_entropy_at(ids.0, ids.1, &positions, &targets, 0.9, Some(&bias))
        .unwrap();
    let (logp, entropy) = (
        logp.reshape((2, 3)).unwrap(),
        entropy.reshape((2, 3)).unwrap(),
    );
    let old = Tensor::new(&[[-3.7f32, -3.9, -4.0], [-3.8, -3.6, -4.1]], &dev).unwrap();
    let adv = Tensor::new(&[[1.0f32; 3], [-0.5; 3]], &dev).unwrap();
    let cfg = LossConfig {
        entropy_loss_coef: 0.01,
        ..LossConfig::default()
    };
    let mask = old.ones_like().unwrap();
    let (loss, _) = policy_loss(&logp, &old, &adv, &mask, None, &entropy, &cfg).unwrap();
    let store = loss.backward().unwrap();
    let grads = model
        .named_vars()
        .into_iter()
        .map(|(name, v)| (name, store.get(&v).unwrap().clone()))
        .collect();
    (loss.to_scalar::<f32>().unwrap(), grads)
}

#[test]
fn the_fused_training_path_has_the_composed_paths_loss_and_gradients() {
    for model_type in ["qwen2", "qwen3"] {
        let (loss, fused) = ppo_loss_and_gradients(model_type, TrainingOps::Fused);
        let (reference_loss, composed) = ppo_loss_and_gradients(model_type, TrainingOps::Composed);
        assert!(
            (loss - reference_loss).abs() < 1e-6,
            "{loss} vs {reference_loss}"
        );
        assert_eq!(fused.len(), composed.len());
        for ((name, a), (_, b)) in fused.iter().zip(&composed) {
            let scale = b
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let diff = max_diff(a, b);
            assert!(
                diff <= 1e-5 * scale.max(1e-3),
                "{model_type} {name}: {diff} of {scale}"
            );
        }
    }
}

#[test]
fn linear_matches_the_composed_ops_and_finite_differences() {
    let (x, w, b) = (random((3, 7, 10), 1), random((6, 10), 2), random(6, 3));
    let layer = |bias: Option<&Tensor>| {
        crate::model::decoder::Linear::plain(w.as_tensor().clone(), bias.cloned())
    };
    for bias in [None, Some(b.as_tensor())] {
        let fused = linear(&x, &w, bias).unwrap();
        let reference = layer(bias).forward_with(&x, TrainingOps::Composed).unwrap();
        let mut inputs = vec![&x, &w];
        inputs.extend(bias.map(|_| &b));
        assert_same(&inputs, &fused, &reference, 1e-5);
    }
    let (x, w, b) = (random((2, 3), 4), random((4, 3), 5), random(4, 6));
    let f = || weighted_sum(&linear(&x, &w, Some(&b)).unwrap(), 7);
    check_finite_differences(&[&x, &w, &b], &f, 1e-2, 1e-2);
}
