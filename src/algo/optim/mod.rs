//! AdamW with named, checkpointable moments (candle's AdamW keeps them private), global
//! gradient-norm clipping, and the warmup + constant/cosine learning-rate schedule. Actor and
//! critic each get their own `AdamW` with their own learning rate. Under sharded data
//! parallelism an `AdamW` keeps the moments of its rank's block of the parameters (its part of
//! every unit of their [`ShardLayout`]) only ([`AdamW::sharded`]), updates that block
//! ([`AdamW::step_block`]) and saves it as one of the ranks' block files ([`blocks`]), which any
//! rank count reads back. It does not decide when to step, what moves between ranks, or where
//! checkpoints live.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::algo::config::{OptimizerConfig, Schedule};
use crate::algo::AlgoError;
use kernels as in_place;

mod blocks;
mod kernels;
use crate::dist::shard::{layer_units, Piece, ShardLayout, Sharding};

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
    moments: Moments,
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
            moments: Moments::PerParam {
                exp_avg,
                exp_avg_sq,
            },
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

    /// [`AdamW::new`] keeping the moments of rank `rank` of `ranks`'s block of the parameters
    /// laid end to end in their order, one decoder layer a unit ([`ShardLayout`],
    /// [`layer_units`] of their names), for the ZeRO stage `sharding` (recorded for the trainer,
    /// which moves the gradients accordingly); stepped with [`AdamW::step_block`].
    /// `Sharding::None` is [`AdamW::new`].
    pub fn sharded(
        params: Vec<(String, Var)>,
        cfg: &OptimizerConfig,
        sharding: Sharding,
        (rank, ranks): (usize, usize),
    ) -> Result<Self, AlgoError> {
        if sharding == Sharding::None {
            return Self::new(params, cfg);
        }
        let mut opt = Self::new(params, cfg)?;
        let layout = opt.layer_layout(rank, ranks);
        let (dtype, device) = opt.block_kind();
        let zeros = || Tensor::zeros(layout.block_len(), dtype, &device);
        opt.moments = Moments::Block {
            sharding,
            pieces: layout.pieces(),
            exp_avg: zeros()?,
            exp_avg_sq: zeros()?,
            layout,
        };
        Ok(opt)
    }

    /// Rank `rank` of `ranks`'s block of its parameters, one decoder layer a unit
    /// ([`layer_units`] of their names): the layout a sharded optimizer keeps, and the units in
    /// which a step sums gradients.
    pub fn layer_layout(&self, rank: usize, ranks: usize) -> ShardLayout {
        let units = layer_units(self.params.iter().map(|(n, _)| n.as_str()));
        ShardLayout::new(rank, ranks, &self.param_lens(), &units)
    }

    /// The parameters it steps, in its order.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// Values of each parameter, in its order.
    pub fn param_lens(&self) -> Vec<usize> {
        self.params.iter().map(|(_, v)| v.elem_count()).collect()
    }

    /// The ZeRO stage and this rank's block when the moments are sharded.
    pub fn shard(&self) -> Option<(Sharding, &ShardLayout)> {
        match &self.moments {
            Moments::PerParam { .. } => None,
            Moments::Block {
                sharding, layout, ..
            } => Some((*sharding, layout)),
        }
    }

    /// The device of its parameters (the CPU without any).
    pub fn device(&self) -> candle_core::Device {
        self.block_kind().1
    }

    /// The dtype and device of the flat block: the parameters' (f32 on the CPU without any).
    fn block_kind(&self) -> (DType, candle_core::Device) {
        self.params
            .first()
            .map_or((DType::F32, candle_core::Device::Cpu), |(_, v)| {
                (v.dtype(), v.device().clone())
            })
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
        let Some(coefs) = self.begin_step(grad_norm, lr, max_grad_norm) else {
            return Ok(skipped(grad_norm, lr));
        };
        let Moments::PerParam {
            exp_avg,
            exp_avg_sq,
        } = &mut self.moments
        else {
            return Err(sharded_misuse("step"));
        };
        for (i, (_, var)) in self.params.iter().enumerate() {
            let Some(g) = grads.get(var) else { continue };
            let (p, m, v) = (var.as_tensor(), &exp_avg[i], &exp_avg_sq[i]);
            if in_place && in_place::applies(p, g) {
                in_place::step(p, g, (m, v), &coefs.kernel())?;
                continue;
            }
            let (p, m, v) = coefs.ops_step(p, g, (m, v))?;
            var.set(&p)?;
            (exp_avg[i], exp_avg_sq[i]) = (m, v);
        }
        Ok(coefs.report(grad_norm, lr))
    }

    /// The coefficients of the next update at `grad_norm`, counting it; `None` (nothing counted)
    /// when the norm is not finite.
    fn begin_step(
        &mut self,
        grad_norm: f64,
        lr: f64,
        max_grad_norm: Option<f64>,
    ) -> Option<Update> {
        if !grad_norm.is_finite() {
            return None;
        }
        let clip_scale = match max_grad_norm {
            Some(max) if grad_norm > max => max / (grad_norm + CLIP_EPS),
            _ => 1.0,
        };
        self.step += 1;
        let (b1, b2) = self.betas;
        let t = self.step as i32;
        Some(Update {
            betas: self.betas,
            bias_corrections: (1.0 - b1.powi(t), 1.0 - b2.powi(t)),
            eps: self.eps,
            lr,
            weight_decay: self.weight_decay,
            clip_scale,
        })
    }

    /// One update of this rank's block (a sharded optimizer): `values` and `grad` are the
    /// block's parameter values and summed gradient ([`ShardLayout::held`], end to end);
    /// `has_grad` says which parameters any rank reached (the others are left alone, as
    /// [`AdamW::step`] leaves them); `grad_norm` is the global norm of all ranks' blocks. Returns
    /// the block's new values (`values` itself, updated in place, for f32 on the CPU).
    pub fn step_block(
        &mut self,
        values: Tensor,
        grad: &Tensor,
        has_grad: &[bool],
        grad_norm: f64,
        (lr, max_grad_norm): (f64, Option<f64>),
    ) -> Result<(StepReport, Tensor), AlgoError> {
        let Some(coefs) = self.begin_step(grad_norm, lr, max_grad_norm) else {
            return Ok((skipped(grad_norm, lr), values));
        };
        let Moments::Block {
            pieces,
            exp_avg,
            exp_avg_sq,
            ..
        } = &mut self.moments
        else {
            return Err(sharded_misuse("step_block"));
        };
        if in_place::applies(&values, grad) {
            for piece in pieces.iter().filter(|p| has_grad[p.param]) {
                let at = |t: &Tensor| narrow(t, &piece.in_block);
                let moments = (&at(exp_avg)?, &at(exp_avg_sq)?);
                in_place::step(&at(&values)?, &at(grad)?, moments, &coefs.kernel())?;
            }
            return Ok((coefs.report(grad_norm, lr), values));
        }
        let mut parts = (Vec::new(), Vec::new(), Vec::new());
        for piece in pieces.iter() {
            let at = |t: &Tensor| narrow(t, &piece.in_block);
            let (p, m, v) = (at(&values)?, at(exp_avg)?, at(exp_avg_sq)?);
            let (p, m, v) = if has_grad[piece.param] {
                coefs.ops_step(&p, &at(grad)?, (&m, &v))?
            } else {
                (p, m, v)
            };
            parts.0.push(p);
            parts.1.push(m);
            parts.2.push(v);
        }
        let cat = |ts: &[Tensor], like: &Tensor| match ts {
            [] => Ok(like.clone()),
            _ => Tensor::cat(ts, 0),
        };
        (*exp_avg, *exp_avg_sq) = (cat(&parts.1, exp_avg)?, cat(&parts.2, exp_avg_sq)?);
        Ok((coefs.report(grad_norm, lr), cat(&parts.0, &values)?))
    }

    /// The state as named tensors: `<param>.exp_avg`, `<param>.exp_avg_sq` and the step counter.
    /// A sharded optimizer holds only its block: its ranks save their blocks
    /// ([`AdamW::save_block`]).
    pub fn state(&self) -> Result<HashMap<String, Tensor>, AlgoError> {
        let Moments::PerParam {
            exp_avg,
            exp_avg_sq,
        } = &self.moments
        else {
            return Err(sharded_misuse("state"));
        };
        let mut out = HashMap::new();
        for (i, (name, _)) in self.params.iter().enumerate() {
            out.insert(format!("{name}.exp_avg"), exp_avg[i].clone());
            out.insert(format!("{name}.exp_avg_sq"), exp_avg_sq[i].clone());
        }
        let (_, device) = self.block_kind();
        out.insert(
            STEP_KEY.to_string(),
            Tensor::new(&[self.step as i64], &device)?,
        );
        Ok(out)
    }

    /// Writes the whole state to a safetensors file (an unsharded optimizer).
    pub fn save(&self, path: &Path) -> Result<(), AlgoError> {
        candle_core::safetensors::save(&self.state()?, path)
            .map_err(|e| checkpoint_error(path, e.to_string()))
    }

    /// Restores the state written by [`AdamW::save`] (a file) or by the ranks'
    /// [`AdamW::save_block`] (a directory) for the same parameter names and shapes, whatever the
    /// rank count that wrote it: a sharded optimizer keeps its block of it; a missing, unknown or
    /// misshapen entry is an error naming it.
    pub fn load(&mut self, path: &Path) -> Result<(), AlgoError> {
        if path.is_dir() {
            return self.load_blocks(path);
        }
        // Read on the host: a sharded optimizer moves only its block to the device.
        let mut saved = candle_core::safetensors::load(path, &candle_core::Device::Cpu)
            .map_err(|e| checkpoint_error(path, e.to_string()))?;
        let step = blocks::take_step(&mut saved, path)?;
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
        self.step = step;
        let on_devices = |moments: Vec<Tensor>| -> Result<Vec<Tensor>, AlgoError> {
            let vars = self.params.iter().map(|(_, v)| v);
            Ok(moments
                .iter()
                .zip(vars)
                .map(|(m, v)| m.to_device(v.device()))
                .collect::<Result<_, _>>()?)
        };
        let (_, device) = self.block_kind();
        self.moments = match &self.moments {
            Moments::PerParam { .. } => Moments::PerParam {
                exp_avg: on_devices(exp_avg)?,
                exp_avg_sq: on_devices(exp_avg_sq)?,
            },
            Moments::Block {
                sharding,
                layout,
                pieces,
                ..
            } => {
                let block = |whole: Vec<Tensor>| -> Result<Tensor, AlgoError> {
                    let flat: Vec<Tensor> = whole
                        .iter()
                        .map(Tensor::flatten_all)
                        .collect::<Result<_, _>>()?;
                    // A copy of the block alone: the whole state is freed here.
                    let block = held_part(&Tensor::cat(&flat, 0)?, layout)?;
                    Ok(block.to_device(&device)?)
                };
                Moments::Block {
                    sharding: *sharding,
                    layout: layout.clone(),
                    pieces: pieces.clone(),
                    exp_avg: block(exp_avg)?,
                    exp_avg_sq: block(exp_avg_sq)?,
                }
            }
        };
        Ok(())
    }
}

/// One update's coefficients, in f64 as the tensor ops take them ([`in_place::Coefs`] holds
/// them in f32 for the kernels).
struct Update {
    betas: (f64, f64),
    bias_corrections: (f64, f64),
    eps: f64,
    lr: f64,
    weight_decay: f64,
    clip_scale: f64,
}

impl Update {
    fn kernel(&self) -> in_place::Coefs {
        let f = |x: f64| x as f32;
        in_place::Coefs {
            betas: (f(self.betas.0), f(self.betas.1)),
            bias_corrections: (f(self.bias_corrections.0), f(self.bias_corrections.1)),
            eps: f(self.eps),
            lr: f(self.lr),
            decay: f(1.0 - self.lr * self.weight_decay),
            clip_scale: f(self.clip_scale),
        }
    }

    /// The new parameter and moments of one parameter `p` (or a slice of it) with gradient `g`,
    /// in tensor ops (any device and dtype).
    fn ops_step(
        &self,
        p: &Tensor,
        g: &Tensor,
        (m, v): (&Tensor, &Tensor),
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let ((b1, b2), (bc1, bc2)) = (self.betas, self.bias_corrections);
        let g = g.affine(self.clip_scale, 0.0)?;
        let m = ((m * b1)? + (&g * (1.0 - b1))?)?;
        let v = ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
        let denom = ((&v / bc2)?.sqrt()? + self.eps)?;
        let update = ((&m / bc1)? / denom)?;
        let decayed = (p * (1.0 - self.lr * self.weight_decay))?;
        Ok(((decayed - (update * self.lr)?)?, m, v))
    }

    fn report(&self, grad_norm: f64, lr: f64) -> StepReport {
        StepReport {
            grad_norm,
            clip_scale: self.clip_scale,
            skipped: false,
            lr,
        }
    }
}

/// AdamW's first and second moments: one pair of tensors per parameter, or (sharded) one flat
/// pair over the rank's block of the parameters (its part of every unit, end to end).
enum Moments {
    PerParam {
        exp_avg: Vec<Tensor>,
        exp_avg_sq: Vec<Tensor>,
    },
    Block {
        sharding: Sharding,
        layout: ShardLayout,
        /// The parameters' slices in the block, in order; they cover it.
        pieces: Vec<Piece>,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
    },
}

/// The positions of flat tensor `flat` that `layout`'s block holds, end to end, as a new tensor.
fn held_part(flat: &Tensor, layout: &ShardLayout) -> candle_core::Result<Tensor> {
    let parts: Vec<Tensor> = layout
        .held()
        .iter()
        .map(|(range, _)| narrow(flat, range))
        .collect::<candle_core::Result<_>>()?;
    match parts.as_slice() {
        [] => Tensor::zeros(0, flat.dtype(), flat.device()),
        [one] => one.copy(),
        _ => Tensor::cat(&parts, 0),
    }
}

/// The positions `range` of a flat tensor.
fn narrow(t: &Tensor, range: &std::ops::Range<usize>) -> candle_core::Result<Tensor> {
    t.narrow(0, range.start, range.len())
}

/// The report of an update skipped for a gradient norm that is not finite.
fn skipped(grad_norm: f64, lr: f64) -> StepReport {
    StepReport {
        grad_norm,
        clip_scale: 1.0,
        skipped: true,
        lr,
    }
}

/// The error of calling an unsharded optimizer's method on a sharded one, or the reverse.
fn sharded_misuse(method: &str) -> AlgoError {
    AlgoError::InvalidConfig {
        key: "sharding".into(),
        reason: format!(
            "AdamW::{method} does not apply to this optimizer's moments (sharded or not)"
        ),
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

/// Σ g² over `tensors` in f64: f32 CPU tensors summed on the host one after another (each by
/// its chunks, in order), the others on their device, one scalar read back.
pub fn sum_of_squares<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<f64, AlgoError> {
    sum_of_squares_after(0.0, tensors)
}

/// `start` plus [`sum_of_squares`] of `tensors`, added on the host one tensor after another from
/// `start` (so a sum split over calls adds in the order of one call), with one device read.
pub fn sum_of_squares_after<'a>(
    start: f64,
    tensors: impl IntoIterator<Item = &'a Tensor>,
) -> Result<f64, AlgoError> {
    let mut total: Option<Tensor> = None;
    let mut host = start;
    for g in tensors {
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
    Ok(host + device_sum)
}

/// sqrt(Σ g²) over the gradients of `vars` present in `grads` ([`sum_of_squares`]).
pub fn global_grad_norm<'a>(
    vars: impl IntoIterator<Item = &'a Var>,
    grads: &GradStore,
) -> Result<f64, AlgoError> {
    Ok(sum_of_squares(vars.into_iter().filter_map(|v| grads.get(v)))?.sqrt())
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

    /// Tensors by name, as flat f32 values.
    type NamedValues = Vec<(String, Vec<f32>)>;

    /// Three steps of an unsharded AdamW (`ranks` 0) or of `ranks` sharded ones (one world, each
    /// updating its block of the same gradients, the blocks then written back as an all-gather
    /// would); `b` never gets a gradient. Returns the weights and the whole optimizer state. In
    /// f32 the in-place kernels update; in f64 the tensor ops.
    fn three_steps_sharded(ranks: usize, dtype: DType) -> (Vec<Vec<f32>>, NamedValues) {
        let device = &Device::Cpu;
        let f32s = |t: &Tensor| {
            t.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let init = |n: usize, salt: f32| -> Vec<f32> {
            (0..n).map(|i| ((i as f32 + salt) * 0.37).sin()).collect()
        };
        let lens = [5, 3, 4];
        let vars: Vec<Var> = lens
            .iter()
            .map(|&n| {
                let t = Tensor::new(init(n, n as f32), device).unwrap();
                Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
            })
            .collect();
        // Two units: layer 0's `a` and `b`, layer 1's `c`.
        let named: Vec<(String, Var)> = ["layers.0.a", "layers.0.b", "layers.1.c"]
            .iter()
            .map(|n| n.to_string())
            .zip(vars.clone())
            .collect();
        let mut opts: Vec<AdamW> = (0..ranks)
            .map(|r| {
                AdamW::sharded(named.clone(), &cfg(), Sharding::Gradients, (r, ranks)).unwrap()
            })
            .collect();
        let mut whole = AdamW::new(named.clone(), &cfg()).unwrap();
        let reached = [true, false, true];
        for step in 0..3 {
            let grads: Vec<Tensor> = lens
                .iter()
                .map(|&n| {
                    let t = Tensor::new(init(n, 10.0 + step as f32), device).unwrap();
                    t.to_dtype(dtype).unwrap()
                })
                .collect();
            if ranks == 0 {
                let mut store = GradStore::default();
                for i in [0, 2] {
                    store.insert(vars[i].as_tensor(), grads[i].clone());
                }
                whole.step(&store, 0.01, Some(0.5)).unwrap();
                continue;
            }
            let flat_grad = Tensor::cat(&grads, 0).unwrap();
            let flat_grad = flat_grad
                .mul(
                    &Tensor::new(&[1f32, 1., 1., 1., 1., 0., 0., 0., 1., 1., 1., 1.], device)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap(),
                )
                .unwrap();
            let reached_grads = [
                flat_grad.narrow(0, 0, 5).unwrap(),
                flat_grad.narrow(0, 8, 4).unwrap(),
            ];
            let norm = sum_of_squares(&reached_grads).unwrap().sqrt();
            let values = Tensor::cat(
                &vars
                    .iter()
                    .map(|v| v.as_tensor().clone())
                    .collect::<Vec<_>>(),
                0,
            )
            .unwrap();
            let mut blocks = Vec::new();
            for opt in &mut opts {
                let layout = opt.shard().unwrap().1.clone();
                let at = |t: &Tensor| held_part(t, &layout).unwrap();
                let (_, block) = opt
                    .step_block(
                        at(&values),
                        &at(&flat_grad),
                        &reached,
                        norm,
                        (0.01, Some(0.5)),
                    )
                    .unwrap();
                blocks.push(block);
            }
            // Every rank's block written back where its layout holds it.
            let mut all = vec![0f64; lens.iter().sum()];
            for (opt, block) in opts.iter().zip(&blocks) {
                let block: Vec<f64> = block.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
                for (range, at) in opt.shard().unwrap().1.held() {
                    all[range.clone()].copy_from_slice(&block[at..at + range.len()]);
                }
            }
            let all = Tensor::new(all, device).unwrap().to_dtype(dtype).unwrap();
            let mut offset = 0;
            for (v, &n) in vars.iter().zip(&lens) {
                v.set(&all.narrow(0, offset, n).unwrap()).unwrap();
                offset += n;
            }
        }
        let state = if ranks == 0 {
            whole.state().unwrap()
        } else {
            // The ranks' blocks, read back whole.
            let dir = tempfile::tempdir().unwrap();
            for opt in &opts {
                opt.save_block(dir.path()).unwrap();
            }
            let mut reader = AdamW::new(named.clone(), &cfg()).unwrap();
            reader.load(dir.path()).unwrap();
            reader.state().unwrap()
        };
        let mut state: Vec<_> = state
            .into_iter()
            .filter(|(k, _)| k != STEP_KEY)
            .map(|(k, t)| (k, f32s(&t)))
            .collect();
        state.sort_by(|a, b| a.0.cmp(&b.0));
        let weights = vars.iter().map(|v| f32s(v.as_tensor())).collect();
        (weights, state)
    }

    #[test]
    fn sharded_blocks_step_exactly_as_the_whole_optimizer() {
        for dtype in [DType::F32, DType::F64] {
            let reference = three_steps_sharded(0, dtype);
            for ranks in [1, 2, 3, 5] {
                let sharded = three_steps_sharded(ranks, dtype);
                assert_eq!(sharded, reference, "{ranks} ranks, {dtype:?}");
            }
        }
    }

    #[test]
    fn a_state_saved_whole_or_as_blocks_is_read_back_at_any_rank_count() {
        let dir = tempfile::tempdir().unwrap();
        let w = Var::from_vec(vec![1f32, 2., 3., 4., 5.], 5, &Device::Cpu).unwrap();
        let named = vec![("w".to_string(), w.clone())];
        let mut whole = AdamW::new(named.clone(), &cfg()).unwrap();
        let mut store = GradStore::default();
        store.insert(
            w.as_tensor(),
            Tensor::new(&[1f32, -1., 2., -2., 3.], &Device::Cpu).unwrap(),
        );
        whole.step(&store, 0.1, None).unwrap();
        let file = dir.path().join("whole.safetensors");
        whole.save(&file).unwrap();
        let values = |state: HashMap<String, Tensor>| {
            let mut v: Vec<(String, Vec<f32>)> = state
                .into_iter()
                .map(|(k, t)| {
                    (
                        k,
                        t.to_dtype(DType::F32)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1()
                            .unwrap(),
                    )
                })
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        let saved = values(whole.state().unwrap());
        // Two ranks read their blocks of the whole file and save them; three ranks read those
        // blocks and save theirs (a block all padding among them at 7 ranks); a whole optimizer
        // reads the last blocks back as they were.
        let mut source = file;
        for (round, ranks) in [2usize, 3, 7].into_iter().enumerate() {
            let blocks = dir.path().join(format!("blocks-{round}"));
            for rank in 0..ranks {
                let mut opt =
                    AdamW::sharded(named.clone(), &cfg(), Sharding::Gradients, (rank, ranks))
                        .unwrap();
                opt.load(&source).unwrap();
                assert_eq!(opt.step_count(), 1);
                assert!(opt.state().is_err(), "a block is not the whole state");
                opt.save_block(&blocks).unwrap();
            }
            source = blocks;
        }
        let mut reader = AdamW::new(named.clone(), &cfg()).unwrap();
        reader.load(&source).unwrap();
        assert_eq!(values(reader.state().unwrap()), saved);
        // The first format (`params`, one unit of every parameter; one unit here too) reads the
        // same; a layout with both forms, or neither, is refused naming the file.
        let layout_path = source.join("layout.json");
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&layout_path).unwrap()).unwrap();
        let units = written["units"].as_array().unwrap().clone();
        assert_eq!(units.len(), 1, "one parameter, one unit");
        let first = serde_json::json!({"ranks": written["ranks"], "params": units[0]});
        std::fs::write(&layout_path, first.to_string()).unwrap();
        let mut reader = AdamW::new(named.clone(), &cfg()).unwrap();
        reader.load(&source).unwrap();
        assert_eq!(values(reader.state().unwrap()), saved);
        for (bad, says) in [
            (
                serde_json::json!({"ranks": 7, "params": units[0], "units": units}),
                "both",
            ),
            (serde_json::json!({"ranks": 7}), "neither"),
        ] {
            std::fs::write(&layout_path, bad.to_string()).unwrap();
            let err = AdamW::new(named.clone(), &cfg())
                .unwrap()
                .load(&source)
                .unwrap_err();
            assert!(err.to_string().contains(says), "{err}");
        }
        std::fs::write(&layout_path, written.to_string()).unwrap();
        // Blocks of other parameters are refused, naming the layout.
        let other = vec![("v".to_string(), w.clone())];
        let err = AdamW::new(other, &cfg())
            .unwrap()
            .load(&source)
            .unwrap_err();
        assert!(err.to_string().contains("layout.json"), "{err}");
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
