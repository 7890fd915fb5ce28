//! Named parameters: deterministic HF-style initialisation into a `VarMap`, lookup by name, the
//! sorted list the optimiser and checkpoints walk, and the safetensors file named tensors are
//! written to. The RNG is a ChaCha8 stream seeded through
//! [`crate::seed::derive`], one stream per parameter name so adding a head does not shift others.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::{ModelConfig, ModelError, Result};

/// Initial value of parameter `name`: ones for norms, zeros for biases, else normal(0, std).
fn init_tensor(
    name: &str,
    shape: &[usize],
    std: f64,
    seed: u64,
    device: &Device,
) -> Result<Tensor> {
    if name.ends_with("norm.weight") {
        return Ok(Tensor::ones(shape, candle_core::DType::F32, device)?);
    }
    if name.ends_with(".bias") {
        return Ok(Tensor::zeros(shape, candle_core::DType::F32, device)?);
    }
    let mut rng = name_rng(name, seed);
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| (std * standard_normal(&mut rng)) as f32)
        .collect();
    Ok(Tensor::from_vec(values, shape, device)?)
}

/// The random stream of parameter `name` under `seed`: one per name, so adding a parameter does
/// not shift the others.
pub(crate) fn name_rng(name: &str, seed: u64) -> ChaCha8Rng {
    let name_hash = name
        .bytes()
        .fold(0u64, |h, b| crate::seed::splitmix64(h ^ u64::from(b)));
    ChaCha8Rng::seed_from_u64(crate::seed::derive(seed, &[name_hash]))
}

/// One standard normal draw (Box–Muller).
fn standard_normal(rng: &mut impl Rng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A `VarMap` holding a freshly initialised tensor for every `(name, shape)`.
pub(crate) fn init_varmap(
    cfg: &ModelConfig,
    specs: &[(String, Vec<usize>)],
    seed: u64,
    device: &Device,
) -> Result<VarMap> {
    let varmap = VarMap::new();
    insert_init(&varmap, cfg, specs, seed, device)?;
    Ok(varmap)
}

/// Adds freshly initialised vars for `specs` to `varmap`.
pub(crate) fn insert_init(
    varmap: &VarMap,
    cfg: &ModelConfig,
    specs: &[(String, Vec<usize>)],
    seed: u64,
    device: &Device,
) -> Result<()> {
    // Each tensor draws from its own stream, so they are drawn in parallel on the CPU (a 0.5B
    // model's half a billion draws) with the values of a serial draw, then moved to `device`; a
    // thread's worth at a time, so at most that many drawn tensors wait beside the vars.
    for batch in specs.chunks(rayon::current_num_threads().max(1)) {
        let tensors = batch
            .par_iter()
            .map(|(name, shape)| {
                init_tensor(name, shape, cfg.initializer_range, seed, &Device::Cpu)
            })
            .collect::<Result<Vec<_>>>()?;
        for ((name, _), t) in batch.iter().zip(tensors) {
            insert(varmap, name, &t.to_device(device)?)?;
        }
    }
    Ok(())
}

/// Inserts `t` (copied into a new `Var`) under `name`.
pub(crate) fn insert(varmap: &VarMap, name: &str, t: &Tensor) -> Result<()> {
    let var = Var::from_tensor(t)?;
    varmap
        .data()
        .lock()
        .expect("VarMap lock poisoned")
        .insert(name.to_string(), var);
    Ok(())
}

/// The tracked tensor of var `name`.
pub(crate) fn var_tensor(varmap: &VarMap, name: &str) -> Result<Tensor> {
    let data = varmap.data().lock().expect("VarMap lock poisoned");
    data.get(name)
        .map(|v| v.as_tensor().clone())
        .ok_or_else(|| ModelError::MissingTensor {
            name: name.to_string(),
            files: "the VarMap".into(),
        })
}

/// Whether `varmap` has var `name`.
pub(crate) fn has_var(varmap: &VarMap, name: &str) -> bool {
    varmap
        .data()
        .lock()
        .expect("VarMap lock poisoned")
        .contains_key(name)
}

/// All vars, sorted by name.
pub(crate) fn named_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = varmap.data().lock().expect("VarMap lock poisoned");
    let mut vars: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// Writes `tensors` as one safetensors file with `{"format": "pt"}` metadata.
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let metadata = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    let contiguous: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.contiguous()?)))
        .collect::<Result<_>>()?;
    safetensors::tensor::serialize_to_file(contiguous, metadata, path).map_err(|e| {
        ModelError::Safetensors {
            path: path.display().to_string(),
            message: e.to_string(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_is_deterministic_and_has_the_configured_spread() {
        let dev = Device::Cpu;
        let a = init_tensor("w", &[64, 64], 0.02, 3, &dev).unwrap();
        let b = init_tensor("w", &[64, 64], 0.02, 3, &dev).unwrap();
        let c = init_tensor("w", &[64, 64], 0.02, 4, &dev).unwrap();
        let va = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(va, b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        assert_ne!(va, c.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let var = va.iter().map(|x| x * x).sum::<f32>() / va.len() as f32;
        assert!((var.sqrt() - 0.02).abs() < 0.002, "{}", var.sqrt());
    }
}
