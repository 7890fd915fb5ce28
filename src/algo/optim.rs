//! AdamW with named, checkpointable moments (candle's AdamW keeps them private), global
//! gradient-norm clipping, and the warmup + constant/cosine learning-rate schedule. Actor and
//! critic each get their own `AdamW` with their own learning rate. It does not decide when to
//! step or where checkpoints live.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::config::{OptimizerConfig, Schedule};
use super::optim_kernels as in_place;
use super::AlgoError;

/// Name of the step counter in a saved optimizer state.
const STEP_KEY: &str = "__adamw_step";
/// ε added to the norm when scaling gradients down (ROLL/torch `clip_grad_norm_`).
const CLIP_EPS: f64 = 1e-6;

/// What one `AdamW::step` did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
    /// Factor the gradients were multiplied by (1 when not clipped).
    pub clip_scale: f64,
    /// True when a gradient was non-finite: parameters, moments and step count are unchanged.
    pub skipped: bool,
    /// Learning rate the update was taken at.
    pub lr: f64,
}

/// Decoupled-weight-decay Adam (torch semantics) over named parameters.
pub struct AdamW {
    params: Vec<(String, Var)>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    step: u64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
}

impl AdamW {
    /// An optimizer over `params` (names must be unique) with zero moments.
    pub fn new(params: Vec<(String, Var)>, cfg: &OptimizerConfig) -> Result<Self, AlgoError> {
        cfg.validate()?;
        let mut seen = HashSet::new();
        if let Some((name, _)) = params.iter().find(|(n, _)| !seen.insert(n.clone())) {
            return Err(AlgoError::InvalidConfig {
                key: name.clone(),
                reason: "parameter name given twice".into(),
            });
        }
        let zeros = |v: &Var| v.as_tensor().zeros_like();
        let exp_avg = params
            .iter()
            .map(|(_, v)| zeros(v))
            .collect::<Result<_, _>>()?;
        let exp_avg_sq = params
            .iter()
            .map(|(_, v)| zeros(v))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            params,
            exp_avg,
            exp_avg_sq,
            step: 0,
            betas: cfg.betas,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        })
    }

    /// An optimizer over every variable of `varmap`, in name order.
    pub fn from_varmap(
        varmap: &candle_nn::VarMap,
        cfg: &OptimizerConfig,
    ) -> Result<Self, AlgoError> {
        let mut params: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .map_err(|_| AlgoError::InvalidConfig {
                key: "varmap".into(),
                reason: "lock poisoned".into(),
            })?
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        Self::new(params, cfg)
    }

    /// The parameters it steps, in its order.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// Number of updates applied so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// One update at learning rate `lr`: gradients are scaled by max/(norm + 1e-6) when the
    /// global norm exceeds `max_grad_norm`; parameters without a gradient are left alone; a
    /// non-finite gradient skips the update entirely.
    pub fn step(
        &mut self,
        grads: &GradStore,
        lr: f64,
        max_grad_norm: Option<f64>,
    ) -> Result<StepReport, AlgoError> {
        self.step_with(grads, lr, max_grad_norm, true)
    }

    /// [`AdamW::step`]; with `in_place`, f32 CPU parameters and moments are updated in place by
    /// [`in_place`]'s kernels, the others with tensor ops.
    fn step_with(
        &mut self,
        grads: &GradStore,
        lr: f64,
        max_grad_norm: Option<f64>,
        in_place: bool,
    ) -> Result<StepReport, AlgoError> {
        let grad_norm = global_grad_norm(self.params.iter().map(|(_, v)| v), grads)?;
        if !grad_norm.is_finite() {
            return Ok(StepReport {
                grad_norm,
                clip_scale: 1.0,
                skipped: true,
                lr,
            });
        }
        let clip_scale = match max_grad_norm {
            Some(max) if grad_norm > max => max / (grad_norm + CLIP_EPS),
            _ => 1.0,
        };
        self.step += 1;
        let (b1, b2) = self.betas;
        let t = self.step as i32;
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let coefs = in_place::Coefs {
            betas: (b1 as f32, b2 as f32),
            bias_corrections: (bc1 as f32, bc2 as f32),
            eps: self.eps as f32,
            lr: lr as f32,
            decay: (1.0 - lr * self.weight_decay) as f32,
            clip_scale: clip_scale as f32,
        };
        for (i, (_, var)) in self.params.iter().enumerate() {
            let Some(g) = grads.get(var) else { continue };
            if in_place && in_place::applies(var, g) {
                let moments = (&self.exp_avg[i], &self.exp_avg_sq[i]);
                in_place::step(var, g, moments, &coefs)?;
                continue;
            }
            let g = g.affine(clip_scale, 0.0)?;
            let m = ((&self.exp_avg[i] * b1)? + (&g * (1.0 - b1))?)?;
            let v = ((&self.exp_avg_sq[i] * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let denom = ((&v / bc2)?.sqrt()? + self.eps)?;
            let update = ((&m / bc1)? / denom)?;
            let decayed = (var.as_tensor() * (1.0 - lr * self.weight_decay))?;
            var.set(&(decayed - (update * lr)?)?)?;
            self.exp_avg[i] = m;
            self.exp_avg_sq[i] = v;
        }
        Ok(StepReport {
            grad_norm,
            clip_scale,
            skipped: false,
            lr,
        })
    }

    /// The state as named tensors: `<param>.exp_avg`, `<param>.exp_avg_sq` and the step counter.
    pub fn state(&self) -> Result<HashMap<String, Tensor>, AlgoError> {
        let mut out = HashMap::new();
        for (i, (name, _)) in self.params.iter().enumerate() {
            out.insert(format!("{name}.exp_avg"), self.exp_avg[i].clone());
            out.insert(format!("{name}.exp_avg_sq"), self.exp_avg_sq[i].clone());
        }
        let device = self
            .params
            .first()
            .map_or(candle_core::Device::Cpu, |(_, v)| v.device().clone());
        out.insert(
            STEP_KEY.to_string(),
            Tensor::new(&[self.step as i64], &device)?,
        );
        Ok(out)
    }

    /// Writes the state to a safetensors file.
    pub fn save(&self, path: &Path) -> Result<(), AlgoError> {
        candle_core::safetensors::save(&self.state()?, path)
            .map_err(|e| checkpoint_error(path, e.to_string()))
    }

    /// Restores the state written by [`AdamW::save`] for the same parameter names and shapes;
    /// a missing, unknown or misshapen entry is an error naming it.
    pub fn load(&mut self, path: &Path) -> Result<(), AlgoError> {
        let device = self
            .params
            .first()
            .map_or(candle_core::Device::Cpu, |(_, v)| v.device().clone());
        let mut saved = candle_core::safetensors::load(path, &device)
            .map_err(|e| checkpoint_error(path, e.to_string()))?;
        let step = saved
            .remove(STEP_KEY)
            .ok_or_else(|| checkpoint_error(path, format!("missing `{STEP_KEY}`")))?;
        let step = step.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
        let [step] = step.as_slice() else {
            return Err(checkpoint_error(
                path,
                format!("`{STEP_KEY}` must hold one value"),
            ));
        };
        let mut exp_avg = Vec::with_capacity(self.params.len());
        let mut exp_avg_sq = Vec::with_capacity(self.params.len());
        for (name, var) in &self.params {
            exp_avg.push(take_moment(
                &mut saved,
                path,
                &format!("{name}.exp_avg"),
                var,
            )?);
            exp_avg_sq.push(take_moment(
                &mut saved,
                path,
                &format!("{name}.exp_avg_sq"),
                var,
            )?);
        }
        if let Some(extra) = saved.keys().min() {
            return Err(checkpoint_error(path, format!("unknown entry `{extra}`")));
        }
        self.step = u64::try_from(*step)
            .map_err(|_| checkpoint_error(path, format!("negative `{STEP_KEY}`")))?;
        self.exp_avg = exp_avg;
        self.exp_avg_sq = exp_avg_sq;
        Ok(())
    }
}

fn take_moment(
    saved: &mut HashMap<String, Tensor>,
    path: &Path,
    key: &str,
    var: &Var,
) -> Result<Tensor, AlgoError> {
    let t = saved
        .remove(key)
        .ok_or_else(|| checkpoint_error(path, format!("missing `{key}`")))?;
    if t.dims() != var.dims() {
        return Err(checkpoint_error(
            path,
            format!(
                "`{key}` has shape {:?}, parameter has {:?}",
                t.dims(),
                var.dims()
            ),
        ));
    }
    Ok(t.to_dtype(var.dtype())?)
}

fn checkpoint_error(path: &Path, reason: String) -> AlgoError {
    AlgoError::Checkpoint {
        path: path.display().to_string(),
        reason,
    }
}

/// sqrt(Σ g²) over the gradients of `vars` present in `grads` (summed on the device, one
/// scalar read back).
pub fn global_grad_norm<'a>(
    vars: impl IntoIterator<Item = &'a Var>,
    grads: &GradStore,
) -> Result<f64, AlgoError> {
    let mut total: Option<Tensor> = None;
    let mut host = 0.0f64;
    for var in vars {
        let Some(g) = grads.get(var) else { continue };
        if let Some(sq) = in_place::sum_of_squares(g)? {
            host += sq;
            continue;
        }
        let sq = g.to_dtype(DType::F64)?.sqr()?.sum_all()?;
        total = Some(match total {
            Some(t) => (t + sq)?,
            None => sq,
        });
    }
    let device_sum = match total {
        Some(t) => t.to_scalar::<f64>()?,
        None => 0.0,
    };
    Ok((host + device_sum).sqrt())
}

/// Scales the gradients of `vars` in place by max/(norm + 1e-6) when their global norm
/// exceeds `max_norm`; returns the norm before clipping.
pub fn clip_grad_norm(
    vars: &[Var],
    grads: &mut GradStore,
    max_norm: f64,
) -> Result<f64, AlgoError> {
    let norm = global_grad_norm(vars, grads)?;
    if norm.is_finite() && norm > max_norm {
        let scale = max_norm / (norm + CLIP_EPS);
        for var in vars {
            if let Some(g) = grads.remove(var) {
                grads.insert(var, g.affine(scale, 0.0)?);
            }
        }
    }
    Ok(norm)
}

/// Learning rate per update: linear warmup lr·(k+1)/warmup for the first `warmup_steps`
/// updates (k = 0-based update index), then constant or cosine decay to 0 at `total_steps`.
#[derive(Clone, Debug, PartialEq)]
pub struct LrSchedule {
    /// Learning rate reached at the end of warmup.
    pub base_lr: f64,
    /// Number of updates of linear warmup (0 for none).
    pub warmup_steps: usize,
    /// Total number of updates; cosine decay reaches 0 here.
    pub total_steps: usize,
    /// Shape after warmup: constant or cosine decay.
    pub schedule: Schedule,
}

impl LrSchedule {
    /// The actor's schedule (`lr`) from the optimizer config.
    pub fn actor(cfg: &OptimizerConfig, total_steps: usize) -> Self {
        Self {
            base_lr: cfg.lr,
            warmup_steps: cfg.warmup_steps,
            total_steps,
            schedule: cfg.schedule,
        }
    }

    /// The critic's schedule (`critic_lr`).
    pub fn critic(cfg: &OptimizerConfig, total_steps: usize) -> Self {
        Self {
            base_lr: cfg.critic_lr,
            ..Self::actor(cfg, total_steps)
        }
    }

    /// Learning rate of the update with 0-based index `update`.
    pub fn lr_at(&self, update: usize) -> f64 {
        if update < self.warmup_steps {
            return self.base_lr * (update + 1) as f64 / self.warmup_steps as f64;
        }
        match self.schedule {
            Schedule::Constant => self.base_lr,
            Schedule::Cosine => {
                let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
                let progress = ((update - self.warmup_steps) as f64 / span).min(1.0);
                self.base_lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn cfg() -> OptimizerConfig {
        OptimizerConfig {
            weight_decay: 0.1,
            max_grad_norm: None,
            ..Default::default()
        }
    }

    /// Gradients of loss = Σ c_i·w_i are c.
    fn grads_of(var: &Var, coeffs: &[f64]) -> GradStore {
        let c = Tensor::new(coeffs, &Device::Cpu).unwrap();
        (var.as_tensor() * c)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap()
    }

    #[test]
    fn first_step_matches_hand_computation() {
        let w = Var::new(&[1.0f64, -2.0], &Device::Cpu).unwrap();
        let mut opt = AdamW::new(vec![("w".into(), w.clone())], &cfg()).unwrap();
        let report = opt.step(&grads_of(&w, &[0.5, -3.0]), 0.1, None).unwrap();
        // step 1: m̂ = g, v̂ = g², update = g/(|g| + 1e-8) ≈ sign(g); w ← w(1 − 0.1·0.1) − 0.1·sign(g)
        let got = w.as_tensor().to_vec1::<f64>().unwrap();
        let expect = [
            1.0 * 0.99 - 0.1 * 0.5 / (0.5 + 1e-8),
            -2.0 * 0.99 + 0.1 * 3.0 / (3.0 + 1e-8),
        ];
        assert!(
            (got[0] - expect[0]).abs() < 1e-12 && (got[1] - expect[1]).abs() < 1e-12,
            "{got:?}"
        );
        assert!((report.grad_norm - (0.25f64 + 9.0).sqrt()).abs() < 1e-12);
    }

    #[test]
    fn clipping_scales_to_the_bound_and_reports_the_pre_clip_norm() {
        let w = Var::new(&[0.0f64, 0.0], &Device::Cpu).unwrap();
        let mut grads = grads_of(&w, &[3.0, 4.0]);
        let norm = clip_grad_norm(std::slice::from_ref(&w), &mut grads, 1.0).unwrap();
        assert_eq!(norm, 5.0);
        let g = grads.get(&w).unwrap().to_vec1::<f64>().unwrap();
        let s = 1.0 / (5.0 + 1e-6);
        assert!((g[0] - 3.0 * s).abs() < 1e-12 && (g[1] - 4.0 * s).abs() < 1e-12);
    }

    #[test]
    fn non_finite_gradient_skips_the_update() {
        let w = Var::new(&[1.0f64, 1.0], &Device::Cpu).unwrap();
        let mut opt = AdamW::new(vec![("w".into(), w.clone())], &cfg()).unwrap();
        let report = opt
            .step(&grads_of(&w, &[f64::NAN, 1.0]), 0.1, Some(1.0))
            .unwrap();
        assert!(report.skipped);
        assert_eq!(opt.step_count(), 0);
        assert_eq!(w.as_tensor().to_vec1::<f64>().unwrap(), vec![1.0, 1.0]);
    }

    #[test]
    fn saved_state_resumes_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optim.safetensors");
        let run = |resume: bool| -> Vec<f32> {
            let w = Var::new(&[0.3f32, -0.7, 1.1], &Device::Cpu).unwrap();
            let mut opt = AdamW::new(vec![("layer.w".into(), w.clone())], &cfg()).unwrap();
            for k in 0..3 {
                if resume && k == 1 {
                    opt.save(&path).unwrap();
                    let w2 = Var::from_tensor(w.as_tensor()).unwrap();
                    let mut fresh =
                        AdamW::new(vec![("layer.w".into(), w2.clone())], &cfg()).unwrap();
                    fresh.load(&path).unwrap();
                    assert_eq!(fresh.step_count(), 1);
                    opt = fresh;
                    return continue_run(opt, w2, k);
                }
                let g = (w.as_tensor().sqr().unwrap() * 1.5)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                opt.step(&g, 0.01, Some(0.5)).unwrap();
            }
            w.as_tensor().to_vec1().unwrap()
        };
        fn continue_run(mut opt: AdamW, w: Var, from: usize) -> Vec<f32> {
            for _ in from..3 {
                let g = (w.as_tensor().sqr().unwrap() * 1.5)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                opt.step(&g, 0.01, Some(0.5)).unwrap();
            }
            w.as_tensor().to_vec1().unwrap()
        }
        assert_eq!(run(false), run(true));
    }

    #[test]
    fn load_names_a_missing_entry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optim.safetensors");
        let a = Var::new(&[1.0f32], &Device::Cpu).unwrap();
        AdamW::new(vec![("a".into(), a.clone())], &cfg())
            .unwrap()
            .save(&path)
            .unwrap();
        let b = Var::new(&[1.0f32], &Device::Cpu).unwrap();
        let mut other = AdamW::new(vec![("b".into(), b)], &cfg()).unwrap();
        let err = other.load(&path).unwrap_err().to_string();
        assert!(err.contains("b.exp_avg"), "{err}");
    }

    #[test]
    fn schedule_warmup_then_cosine() {
        let s = LrSchedule {
            base_lr: 1.0,
            warmup_steps: 2,
            total_steps: 6,
            schedule: Schedule::Cosine,
        };
        assert_eq!(s.lr_at(0), 0.5);
        assert_eq!(s.lr_at(1), 1.0);
        assert_eq!(s.lr_at(2), 1.0);
        assert!((s.lr_at(4) - 0.5).abs() < 1e-12); // halfway through the 4 decay updates
        assert!(s.lr_at(6).abs() < 1e-12);
        let c = LrSchedule {
            schedule: Schedule::Constant,
            ..s
        };
        assert_eq!(c.lr_at(100), 1.0);
    }

    /// Parameters after three clipped steps of f32 weights, in place or with tensor ops.
    fn three_steps(in_place: bool) -> Vec<Vec<f32>> {
        let init = |n: usize, salt: f32| -> Vec<f32> {
            (0..n).map(|i| ((i as f32 + salt) * 0.37).sin()).collect()
        };
        let vars: Vec<Var> = [(40_000, 1.0), (7, 2.0)]
            .iter()
            .map(|&(n, salt)| Var::from_vec(init(n, salt), n, &Device::Cpu).unwrap())
            .collect();
        let named = vec![("a".into(), vars[0].clone()), ("b".into(), vars[1].clone())];
        let mut opt = AdamW::new(named, &cfg()).unwrap();
        for step in 0..3 {
            let coeffs: Vec<Tensor> = vars
                .iter()
                .map(|v| {
                    let c = init(v.elem_count(), 10.0 + step as f32);
                    Tensor::new(c, &Device::Cpu).unwrap()
                })
                .collect();
            let loss = vars
                .iter()
                .zip(&coeffs)
                .map(|(v, c)| (v.as_tensor() * c).unwrap().sum_all().unwrap())
                .reduce(|a, b| (a + b).unwrap())
                .unwrap();
            let grads = loss.backward().unwrap();
            let report = opt.step_with(&grads, 0.01, Some(5.0), in_place).unwrap();
            assert!(report.clip_scale < 1.0, "the test clips");
        }
        assert_ne!(vars[1].as_tensor().to_vec1::<f32>().unwrap(), init(7, 2.0));
        vars.iter()
            .map(|v| v.as_tensor().to_vec1::<f32>().unwrap())
            .collect()
    }

    #[test]
    fn the_in_place_update_matches_the_tensor_ops() {
        let (fast, reference) = (three_steps(true), three_steps(false));
        for (a, b) in fast.iter().zip(&reference) {
            let diff = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(diff < 1e-6, "{diff}");
        }
    }
}
