//! bf16 mixed precision (`precision: bf16`) against PyTorch's: one policy-gradient update of the
//! tiny Qwen2 and Qwen3 checkpoints of `tests/fixtures/hf/` on a fixed batch, its loss, the
//! scored tokens' log-probs and the gradient norm over every parameter, as
//! `scripts/make_autocast_fixtures.py` recorded them in f32 and under
//! `torch.autocast(dtype=bfloat16)`. f32 agrees with f32 to float rounding. bf16 agrees with
//! autocast as closely as two bf16 computations that round at their own points can: the mean
//! |Δ log-prob| within 1.5× autocast's own distance to f32 (each token's logits are rounded to
//! bf16 in both), the loss within 1e-3, the gradient norm within 0.5 %; our attention stays f32
//! where autocast's runs in bf16. The master weights and gradients stay f32.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use stepppo::model::{Model, Precision, TrainingOps};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// One update's numbers, ours or PyTorch's.
#[derive(Debug)]
struct Update {
    loss: f64,
    grad_norm: f64,
    logp: Vec<f32>,
}

fn recorded(json: &serde_json::Value, key: &str) -> Update {
    let v = &json[key];
    Update {
        loss: v["loss"].as_f64().unwrap(),
        grad_norm: v["grad_norm"].as_f64().unwrap(),
        logp: floats(&v["logp"]),
    }
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn ints(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The fixture's update with our training path in `precision`.
fn ours(model: &mut Model, json: &serde_json::Value, precision: Precision) -> Update {
    model.set_precision(precision);
    let dev = Device::Cpu;
    let rows: Vec<Vec<u32>> = json["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(ints)
        .collect();
    let masks: Vec<Vec<u32>> = json["attention_mask"]
        .as_array()
        .unwrap()
        .iter()
        .map(ints)
        .collect();
    let (b, t) = (rows.len(), rows[0].len());
    let ids = Tensor::from_vec(rows.concat(), (b, t), &dev).unwrap();
    let mask = Tensor::from_vec(masks.concat(), (b, t), &dev).unwrap();
    let positions = Tensor::new(ints(&json["positions"]).as_slice(), &dev).unwrap();
    let targets = Tensor::new(ints(&json["targets"]).as_slice(), &dev).unwrap();
    let adv = Tensor::new(floats(&json["advantages"]).as_slice(), &dev).unwrap();
    let coef = json["entropy_coef"].as_f64().unwrap();
    let (logp, entropy) = model
        .logprobs_entropy_at(&ids, &mask, &positions, &targets, 1.0, None)
        .unwrap();
    assert_eq!(logp.dtype(), DType::F32);
    let surrogate = (adv * &logp).unwrap().neg().unwrap().mean_all().unwrap();
    let loss = (surrogate - (entropy.mean_all().unwrap() * coef).unwrap()).unwrap();
    let grads = stepppo::model::backward(&loss).unwrap();
    let mut squares = 0f64;
    for (name, var) in model.named_vars() {
        assert_eq!(var.dtype(), DType::F32, "{name}: the master weight is f32");
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        assert_eq!(g.dtype(), DType::F32, "{name}: the gradient is f32");
        squares += g
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
    }
    Update {
        loss: loss.to_dtype(DType::F64).unwrap().to_scalar().unwrap(),
        grad_norm: squares.sqrt(),
        logp: logp.to_vec1().unwrap(),
    }
}

fn mean_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

fn check(name: &str) {
    let dir = fixture(name);
    let text = std::fs::read_to_string(dir.join("autocast.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut model = Model::load(&dir, &Device::Cpu).unwrap();
    for ops in [TrainingOps::Fused, TrainingOps::Composed] {
        model.set_training_ops(ops);
        check_ops(&format!("{name} {ops:?}"), &mut model, &json);
    }
}

/// [`check`] with the model's current training ops (the fused CPU ops, or the composed ones
/// other devices run).
fn check_ops(name: &str, model: &mut Model, json: &serde_json::Value) {
    let (torch_f32, torch_bf16) = (recorded(json, "f32"), recorded(json, "bf16_autocast"));
    let f32_ours = ours(model, json, Precision::F32);
    let bf16_ours = ours(model, json, Precision::Bf16);

    // f32 against f32: float rounding.
    assert!(mean_diff(&f32_ours.logp, &torch_f32.logp) <= 1e-5);
    assert!((f32_ours.loss - torch_f32.loss).abs() <= 1e-5);
    assert!((f32_ours.grad_norm / torch_f32.grad_norm - 1.0).abs() <= 1e-4);

    // bf16 is really on: it moves the log-probs as far from f32 as autocast does.
    let gap = mean_diff(&torch_bf16.logp, &torch_f32.logp);
    assert!(mean_diff(&bf16_ours.logp, &f32_ours.logp) > 0.5 * gap);

    // bf16 against autocast: as close as two bf16 computations with their own rounding points
    // get (the logits alone are rounded to bf16 in both).
    let logp_diff = mean_diff(&bf16_ours.logp, &torch_bf16.logp);
    let loss_diff = (bf16_ours.loss - torch_bf16.loss).abs();
    let norm_diff = (bf16_ours.grad_norm / torch_bf16.grad_norm - 1.0).abs();
    eprintln!(
        "{name}: bf16 against autocast: mean |Δ log-prob| {logp_diff:.2e} (autocast against f32 \
         {gap:.2e}), |Δ loss| {loss_diff:.2e} (autocast against f32 {:.2e}), gradient norm \
         {norm_diff:.2e} relative (autocast against f32 {:.2e})",
        (torch_bf16.loss - torch_f32.loss).abs(),
        (torch_bf16.grad_norm / torch_f32.grad_norm - 1.0).abs(),
    );
    assert!(logp_diff <= 1.5 * gap, "{logp_diff} vs {gap}");
    assert!(loss_diff <= 1e-3, "{loss_diff}");
    assert!(norm_diff <= 5e-3, "{norm_diff}");
}

#[test]
fn qwen2_bf16_update_matches_pytorch_autocast() {
    check("qwen2");
}

#[test]
fn qwen3_bf16_update_matches_pytorch_autocast() {
    check("qwen3");
}
