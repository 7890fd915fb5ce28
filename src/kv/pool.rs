//! The KV slot pool: for every layer, keys and values of `capacity` token slots laid out
//! `[slots, kv_heads, head_dim]`, a free list, and the CPU attention kernel that reads rows by slot
//! index (no gather copy). One slot id addresses the same token in every layer. The pool knows
//! nothing about sequences or prefixes: callers (a per-sequence buffer for `generate`, the radix
//! tree for rollouts) own slot lists and pass them in.

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Tensor};
use multiversion::multiversion;
use rayon::prelude::*;

use super::cascade::{self, CascadePlan, LayerRows};
use super::{dot, KvError, KvShape, PrefillAttention, SeqSlots};

/// Shortest shared run of context positions that cascade attention reads once for its
/// sequences: a shorter run's K/V stays in cache across the per-row tasks anyway, and the extra
/// partial states cost more than they save (the default's 185-token FrozenLake prompts, shared
/// by groups of 4: rollout 0.525 s a step with them, 0.468 s without).
const CASCADE_MIN_SPAN: usize = 256;

/// Where the K/V rows live. CPU rows are plain `f32` vectors so the attention loop reads them in
/// place (they hold bf16 values exactly); CUDA rows are bf16 or f32 device tensors read by our
/// kernels (`super::cuda`).
enum KvStorage {
    Cpu(Vec<CpuLayerKv>),
    #[cfg(feature = "cuda")]
    Cuda(Vec<CudaLayerKv>),
}

/// One layer's keys and values on a CUDA device, `[capacity, kv_heads, head_dim]` each, in the
/// pool's dtype.
#[cfg(feature = "cuda")]
struct CudaLayerKv {
    k: Tensor,
    v: Tensor,
}

/// What one incremental forward needs on every layer, prepared once per call: the sequences'
/// slot lists and, on CUDA, their device copies.
pub struct AttentionPlan<'a> {
    seqs: &'a [SeqSlots<'a>],
    new_slots: Vec<u32>,
    /// The sharing tree a CPU pool runs cascade attention over (none without shared slots, with
    /// cascade off, or on CUDA).
    cascade: Option<CascadePlan<'a>>,
    #[cfg(feature = "cuda")]
    cuda: Option<(super::cuda::DeviceAttention, Tensor)>,
    /// The sharing tree of a decode call on a CUDA pool, as device tables.
    #[cfg(feature = "cuda")]
    device_cascade: Option<super::device_cascade::DeviceCascade>,
}

/// One layer's keys and values, `capacity × row` floats each.
struct CpuLayerKv {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Per-layer K/V storage for a fixed number of token slots, with a free list.
pub struct KvPool {
    storage: KvStorage,
    num_layers: usize,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    /// Free slots, popped from the back (slot 0 first on a fresh pool).
    free: Vec<u32>,
    in_use: Vec<bool>,
    prefill_attention: PrefillAttention,
    /// Whether context slots shared by several sequences are read once per call (a CPU pool's
    /// every call, a CUDA pool's decode calls).
    cascade: bool,
    /// Since last taken: calls planned with cascade attention, and the context positions they
    /// did not read again (per span: its length × its readers beyond the first).
    cascade_counts: [AtomicU64; 2],
}

impl KvPool {
    /// A pool of `num_slots` slots for a model of K/V shape `shape` (a model config converts), on
    /// `device`: f32 rows on the CPU, bf16 rows on a CUDA device (feature `cuda`), the dtype the
    /// rollout computes in by default there.
    pub fn new(
        shape: impl Into<KvShape>,
        num_slots: usize,
        device: &Device,
    ) -> Result<Self, KvError> {
        let dtype = if device.is_cpu() {
            DType::F32
        } else {
            DType::BF16
        };
        Self::with_dtype(shape, num_slots, device, dtype)
    }

    /// A pool whose rows hold K/V computed in `dtype` (bf16 or f32): on the CPU the rows are f32
    /// either way (bf16 values widen exactly); on CUDA they are stored in `dtype`, which the
    /// model's K/V, queries and the kernels then share.
    pub fn with_dtype(
        shape: impl Into<KvShape>,
        num_slots: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, KvError> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(KvError::UnsupportedDevice {
                device: format!("{device:?}"),
                reason: format!("K/V in {dtype:?}: the pool holds bf16 or f32"),
            });
        }
        let cfg = shape.into();
        let row = cfg.kv_heads * cfg.head_dim;
        let storage = if device.is_cpu() {
            KvStorage::Cpu(
                (0..cfg.num_layers)
                    .map(|_| CpuLayerKv {
                        k: vec![0.0; num_slots * row],
                        v: vec![0.0; num_slots * row],
                    })
                    .collect(),
            )
        } else {
            Self::device_storage(&cfg, num_slots, device, dtype)?
        };
        Ok(Self {
            storage,
            num_layers: cfg.num_layers,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            capacity: num_slots,
            free: (0..num_slots as u32).rev().collect(),
            in_use: vec![false; num_slots],
            prefill_attention: PrefillAttention::Paged,
            cascade: true,
            cascade_counts: Default::default(),
        })
    }

    /// Turns cascade attention on or off (on by default): with it, a CPU pool reads the context
    /// slots that several sequences of a call share once for all their new tokens
    /// ([`super::cascade`]); without it, once per token and head. A CUDA pool does so in its
    /// decode calls, as matrix products ([`super::device_cascade`]); its prefill calls keep the
    /// paged prefill kernel.
    pub fn set_cascade(&mut self, on: bool) {
        self.cascade = on;
    }

    /// Calls planned with cascade attention and the context positions they read once instead
    /// of once per sequence (summed over shared spans), since the last call; resets both.
    pub fn take_cascade_counts(&self) -> (u64, u64) {
        let [calls, saved] = &self.cascade_counts;
        (
            calls.swap(0, Ordering::Relaxed),
            saved.swap(0, Ordering::Relaxed),
        )
    }

    /// Chooses the kernel of this pool's prefill calls. [`PrefillAttention::Flash`] needs a
    /// build with the `flash-attn` feature and a CUDA pool holding bf16.
    pub fn set_prefill_attention(&mut self, kernel: PrefillAttention) -> Result<(), KvError> {
        if kernel == PrefillAttention::Flash {
            let refuse = |reason: String| {
                Err(KvError::UnsupportedDevice {
                    device: self.device_name(),
                    reason,
                })
            };
            if !kernel.compiled() {
                return refuse(
                    "flash prefill attention: stepppo was built without the `flash-attn` feature"
                        .into(),
                );
            }
            match self.device_dtype() {
                None => return refuse("flash prefill attention runs on CUDA pools only".into()),
                Some(DType::BF16) => {}
                Some(other) => {
                    return refuse(format!(
                        "flash prefill attention runs on bf16 pools only; this one holds {other:?}"
                    ))
                }
            }
        }
        self.prefill_attention = kernel;
        Ok(())
    }

    /// The dtype of a device pool's rows; `None` for a CPU pool.
    fn device_dtype(&self) -> Option<DType> {
        match &self.storage {
            KvStorage::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            KvStorage::Cuda(layers) => Some(layers[0].k.dtype()),
        }
    }

    fn device_name(&self) -> String {
        match &self.storage {
            KvStorage::Cpu(_) => "Cpu".into(),
            #[cfg(feature = "cuda")]
            KvStorage::Cuda(layers) => format!("{:?}", layers[0].k.device()),
        }
    }

    #[cfg(feature = "cuda")]
    fn device_storage(
        cfg: &KvShape,
        num_slots: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<KvStorage, KvError> {
        if !device.is_cuda() {
            return Err(KvError::UnsupportedDevice {
                device: format!("{device:?}"),
                reason: "only CPU and CUDA storage are built".into(),
            });
        }
        if !super::cuda::SUPPORTED_HEAD_DIMS.contains(&cfg.head_dim) {
            return Err(KvError::UnsupportedDevice {
                device: format!("{device:?}"),
                reason: format!(
                    "the CUDA kernels are built for head_dim {:?}, the model has {}",
                    super::cuda::SUPPORTED_HEAD_DIMS,
                    cfg.head_dim
                ),
            });
        }
        let shape = (num_slots, cfg.kv_heads, cfg.head_dim);
        let layer = || -> Result<CudaLayerKv, KvError> {
            Ok(CudaLayerKv {
                k: Tensor::zeros(shape, dtype, device)?,
                v: Tensor::zeros(shape, dtype, device)?,
            })
        };
        Ok(KvStorage::Cuda(
            (0..cfg.num_layers)
                .map(|_| layer())
                .collect::<Result<_, _>>()?,
        ))
    }

    #[cfg(not(feature = "cuda"))]
    fn device_storage(
        _: &KvShape,
        _: usize,
        device: &Device,
        _: DType,
    ) -> Result<KvStorage, KvError> {
        Err(KvError::UnsupportedDevice {
            device: format!("{device:?}"),
            reason: "stepppo was built without the `cuda` feature".into(),
        })
    }

    /// Takes `n` free slots, or `None` (taking nothing) when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let slots = self.free.split_off(self.free.len() - n);
        let slots: Vec<u32> = slots.into_iter().rev().collect();
        for &s in &slots {
            self.in_use[s as usize] = true;
        }
        Some(slots)
    }

    /// Returns slots to the free list; slots out of range or already free are ignored.
    pub fn free(&mut self, slots: &[u32]) {
        for &s in slots {
            if let Some(used) = self.in_use.get_mut(s as usize) {
                if *used {
                    *used = false;
                    self.free.push(s);
                }
            }
        }
    }

    /// Slots currently free.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Total slots.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Fails unless every slot of `seqs` is inside the pool and each has `num_new ≤ slots.len()`.
    pub fn check(&self, seqs: &[SeqSlots]) -> Result<(), KvError> {
        for (seq, s) in seqs.iter().enumerate() {
            if s.num_new > s.slots.len() {
                return Err(KvError::BadSequence {
                    seq,
                    message: format!("{} new tokens but only {} slots", s.num_new, s.slots.len()),
                });
            }
            if let Some(&slot) = s.slots.iter().find(|&&slot| slot as usize >= self.capacity) {
                return Err(KvError::SlotOutOfRange {
                    slot,
                    capacity: self.capacity,
                });
            }
        }
        Ok(())
    }

    /// Fails unless the pool was built for `shape`'s layer count and K/V row shape.
    pub fn check_shape(&self, shape: impl Into<KvShape>) -> Result<(), KvError> {
        let have = (self.num_layers, self.kv_heads, self.head_dim);
        let want = shape.into();
        let want = (want.num_layers, want.kv_heads, want.head_dim);
        if have == want {
            return Ok(());
        }
        let show = |(l, kv, hd): (usize, usize, usize)| {
            format!("{l} layers × {kv} kv heads × head_dim {hd}")
        };
        Err(KvError::ShapeMismatch {
            pool: show(have),
            wanted: show(want),
        })
    }

    fn check_rows(&self, layer: usize, rows: usize, floats: &[usize]) -> Result<(), KvError> {
        let row = self.row();
        if layer >= self.num_layers || floats.iter().any(|&f| f != rows * row) {
            return Err(KvError::ShapeMismatch {
                pool: format!("{} layers of rows of {row} floats", self.num_layers),
                wanted: format!("layer {layer}, {rows} rows, buffers of {floats:?} floats"),
            });
        }
        Ok(())
    }

    /// Writes K and V rows (`[n, kv_heads, head_dim]` each) of `layer` into `slots`.
    pub fn write(
        &mut self,
        layer: usize,
        slots: &[u32],
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        let row = self.row();
        self.check(&[SeqSlots { slots, num_new: 0 }])?;
        self.check_rows(layer, slots.len(), &[k.len(), v.len()])?;
        let dst = match &mut self.storage {
            KvStorage::Cpu(layers) => &mut layers[layer],
            #[cfg(feature = "cuda")]
            KvStorage::Cuda(_) => {
                return Err(KvError::WrongStorage {
                    op: "write(f32 rows)",
                })
            }
        };
        for (i, &slot) in slots.iter().enumerate() {
            let at = slot as usize * row;
            dst.k[at..at + row].copy_from_slice(&k[i * row..(i + 1) * row]);
            dst.v[at..at + row].copy_from_slice(&v[i * row..(i + 1) * row]);
        }
        Ok(())
    }

    /// Causal attention of the new tokens of each sequence over its slots in `layer`.
    ///
    /// `q` holds the queries of all new tokens in batch order, `[n, num_heads, head_dim]`; new token
    /// i of a sequence sees positions `0..=context_len + i`. Query head h reads kv head
    /// `h / (num_heads / kv_heads)` (GQA). Returns `[n, num_heads, head_dim]`. One online-softmax
    /// pass per (token, head), reading K/V rows in place.
    pub fn attend(
        &self,
        layer: usize,
        q: &[f32],
        seqs: &[SeqSlots],
        num_heads: usize,
        scale: f32,
    ) -> Result<Vec<f32>, KvError> {
        self.check(seqs)?;
        self.check_heads(layer, seqs, num_heads, q.len())?;
        let (hd, row) = (self.head_dim, self.row());
        let rep = num_heads / self.kv_heads;
        let kv = match &self.storage {
            KvStorage::Cpu(layers) => &layers[layer],
            #[cfg(feature = "cuda")]
            KvStorage::Cuda(_) => {
                return Err(KvError::WrongStorage {
                    op: "attend(f32 rows)",
                })
            }
        };
        let visible = SeqSlots::visible(seqs);
        let mut out = vec![0.0f32; q.len()];
        // One (token, head) row per task: the rows are independent, so the result does not
        // depend on the thread count.
        out.par_chunks_mut(hd)
            .enumerate()
            .for_each(|(at, out_row)| {
                let (token, h) = (at / num_heads, at % num_heads);
                let rows = RowsOf {
                    slots: visible[token],
                    row,
                    offset: (h / rep) * hd,
                };
                let q_row = &q[at * hd..(at + 1) * hd];
                attention_row(q_row, (&kv.k, &kv.v), rows, scale, out_row);
            });
        Ok(out)
    }

    /// Checks that `num_heads` query heads group over the pool's KV heads and that `q_len`
    /// floats are the queries of every new token of `seqs` in `layer`.
    fn check_heads(
        &self,
        layer: usize,
        seqs: &[SeqSlots],
        num_heads: usize,
        q_len: usize,
    ) -> Result<(), KvError> {
        if !num_heads.is_multiple_of(self.kv_heads) {
            return Err(KvError::ShapeMismatch {
                pool: format!("{} kv heads", self.kv_heads),
                wanted: format!("{num_heads} query heads"),
            });
        }
        let new_tokens: usize = seqs.iter().map(|s| s.num_new).sum();
        self.check_rows(layer, new_tokens * num_heads / self.kv_heads, &[q_len])
    }

    /// Prepares an incremental forward over `seqs` (on CUDA: uploads the slot tables once).
    pub fn plan<'a>(
        &self,
        seqs: &'a [SeqSlots<'a>],
        scale: f32,
    ) -> Result<AttentionPlan<'a>, KvError> {
        self.check(seqs)?;
        let new_slots: Vec<u32> = seqs
            .iter()
            .flat_map(|s| s.slots[s.context_len()..].iter().copied())
            .collect();
        #[cfg(feature = "cuda")]
        let cuda = match &self.storage {
            KvStorage::Cuda(layers) => {
                let dev = layers[0].k.device();
                let slots = Tensor::new(new_slots.as_slice(), dev)?;
                let attention =
                    super::cuda::DeviceAttention::new(seqs, scale, self.prefill_attention, dev)?;
                Some((attention, slots))
            }
            KvStorage::Cpu(_) => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = scale;
        let cpu = matches!(self.storage, KvStorage::Cpu(_));
        // A CUDA pool runs cascade attention in decode calls only.
        let decode = seqs.iter().all(|s| s.num_new <= 1);
        let shared = (self.cascade && (cpu || decode))
            .then(|| CascadePlan::new(seqs, CASCADE_MIN_SPAN))
            .flatten();
        #[cfg(feature = "cuda")]
        let device_cascade = match (&self.storage, &shared) {
            (KvStorage::Cuda(layers), Some(p)) => {
                super::device_cascade::DeviceCascade::new(p, seqs, layers[0].k.device())?
            }
            _ => None,
        };
        #[cfg(feature = "cuda")]
        let on_device = device_cascade.is_some();
        #[cfg(not(feature = "cuda"))]
        let on_device = false;
        if let Some(p) = shared.as_ref().filter(|_| cpu || on_device) {
            let [calls, saved] = &self.cascade_counts;
            calls.fetch_add(1, Ordering::Relaxed);
            saved.fetch_add(p.positions_saved(seqs), Ordering::Relaxed);
        }
        let cascade = shared.filter(|_| cpu);
        Ok(AttentionPlan {
            seqs,
            new_slots,
            cascade,
            #[cfg(feature = "cuda")]
            cuda,
            #[cfg(feature = "cuda")]
            device_cascade,
        })
    }

    /// Writes the new tokens' K and V rows (`[n, kv_heads, head_dim]` tensors) of `layer`.
    pub fn write_rows(
        &mut self,
        layer: usize,
        plan: &AttentionPlan,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(), KvError> {
        match &self.storage {
            KvStorage::Cpu(_) => {
                let (k, v) = (flat_f32(k)?, flat_f32(v)?);
                self.write(layer, &plan.new_slots, &k, &v)
            }
            #[cfg(feature = "cuda")]
            KvStorage::Cuda(layers) => {
                let (_, slots) = plan.cuda.as_ref().ok_or(KvError::WrongStorage {
                    op: "write_rows(cpu plan)",
                })?;
                let kv = layers.get(layer).ok_or(KvError::ShapeMismatch {
                    pool: format!("{} layers", self.num_layers),
                    wanted: format!("layer {layer}"),
                })?;
                check_dtype(&kv.k, k, "write_rows(k)")?;
                check_dtype(&kv.v, v, "write_rows(v)")?;
                super::cuda::scatter_rows(&kv.k, k, slots)?;
                super::cuda::scatter_rows(&kv.v, v, slots)?;
                Ok(())
            }
        }
    }

    /// Causal attention of the plan's new tokens over their slots in `layer`; `q` is
    /// `[n, num_heads, head_dim]`, the result has the same shape, dtype and device.
    pub fn attend_rows(
        &self,
        layer: usize,
        q: &Tensor,
        plan: &AttentionPlan,
        num_heads: usize,
        scale: f32,
    ) -> Result<Tensor, KvError> {
        match &self.storage {
            KvStorage::Cpu(layers) if plan.cascade.is_some() => {
                let q_rows = flat_f32(q)?;
                self.check_heads(layer, plan.seqs, num_heads, q_rows.len())?;
                let kv = LayerRows {
                    k: &layers[layer].k,
                    v: &layers[layer].v,
                    row: self.row(),
                    head_dim: self.head_dim,
                };
                let rep = num_heads / self.kv_heads;
                let cascade = plan.cascade.as_ref().expect("matched");
                let out = cascade::attend(cascade, plan.seqs, &q_rows, kv, (num_heads, rep), scale);
                Ok(Tensor::from_vec(out, q.shape(), q.device())?.to_dtype(q.dtype())?)
            }
            KvStorage::Cpu(_) => {
                let out = self.attend(layer, &flat_f32(q)?, plan.seqs, num_heads, scale)?;
                Ok(Tensor::from_vec(out, q.shape(), q.device())?.to_dtype(q.dtype())?)
            }
            #[cfg(feature = "cuda")]
            KvStorage::Cuda(layers) => {
                let (op, _) = plan.cuda.as_ref().ok_or(KvError::WrongStorage {
                    op: "attend_rows(cpu plan)",
                })?;
                let kv = &layers[layer];
                check_dtype(&kv.k, q, "attend_rows(q)")?;
                match &plan.device_cascade {
                    Some(cascade) => cascade.attend(q, &kv.k, &kv.v, scale),
                    None => Ok(op.apply(q, &kv.k, &kv.v)?),
                }
            }
        }
    }
}

/// A tensor the CUDA pool reads or writes must have the pool's dtype: casting it here would
/// compute in a precision other than the model's without saying so.
#[cfg(feature = "cuda")]
fn check_dtype(pool: &Tensor, t: &Tensor, op: &str) -> Result<(), KvError> {
    if t.dtype() == pool.dtype() {
        return Ok(());
    }
    Err(KvError::ShapeMismatch {
        pool: format!("{:?} K/V", pool.dtype()),
        wanted: format!(
            "{op} in {:?} (make the pool with KvPool::with_dtype in the model's rollout dtype)",
            t.dtype()
        ),
    })
}

fn flat_f32(t: &Tensor) -> Result<Vec<f32>, KvError> {
    Ok(t.to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// Where one head's K/V rows lie in a layer's storage: the slot's row start plus the head's offset.
#[derive(Clone, Copy)]
struct RowsOf<'a> {
    slots: &'a [u32],
    /// Floats a slot's row holds (every KV head).
    row: usize,
    /// Where the head's part starts in a row.
    offset: usize,
}

impl<'a> RowsOf<'a> {
    fn starts(self) -> impl Iterator<Item = usize> + 'a {
        self.slots
            .iter()
            .map(move |&s| s as usize * self.row + self.offset)
    }
}

/// `out = Σ_j softmax_j(scale · q·k_j) v_j` over `rows`: every score first, then one weighted
/// sum of the values (vectorised for the CPU it runs on).
#[multiversion(targets = "simd")]
fn attention_row(q: &[f32], (k, v): (&[f32], &[f32]), rows: RowsOf, scale: f32, out: &mut [f32]) {
    let hd = q.len();
    let mut weights: Vec<f32> = rows
        .starts()
        .map(|start| scale * dot(q, &k[start..start + hd]))
        .collect();
    let max = weights.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut denom = 0.0f32;
    for w in &mut weights {
        *w = (*w - max).exp();
        denom += *w;
    }
    out.fill(0.0);
    for (start, &w) in rows.starts().zip(&weights) {
        for (o, x) in out.iter_mut().zip(&v[start..start + hd]) {
            *o += w * x;
        }
    }
    if denom > 0.0 {
        out.iter_mut().for_each(|o| *o /= denom);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(slots: usize) -> KvPool {
        KvPool::new(&crate::model::ModelConfig::tiny(16), slots, &Device::Cpu).unwrap()
    }

    #[test]
    fn a_cpu_pool_refuses_flash_prefill_and_keeps_its_kernel() {
        let mut p = pool(4);
        p.set_prefill_attention(PrefillAttention::Paged).unwrap();
        let err = p
            .set_prefill_attention(PrefillAttention::Flash)
            .unwrap_err()
            .to_string();
        let want = if cfg!(feature = "flash-attn") {
            "CUDA pools only"
        } else {
            "without the `flash-attn` feature"
        };
        assert!(err.contains(want), "{err}");
        assert_eq!(p.prefill_attention, PrefillAttention::Paged);
    }

    #[test]
    fn alloc_and_free_track_the_free_list() {
        let mut p = pool(8);
        let a = p.alloc(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(p.num_free(), 5);
        assert!(p.alloc(6).is_none());
        assert_eq!(p.num_free(), 5);
        p.free(&a);
        p.free(&a);
        p.free(&[99]);
        assert_eq!(p.num_free(), 8);
        assert_eq!(p.capacity(), 8);
    }

    #[test]
    fn cascade_attention_matches_the_per_row_kernel_on_nested_sharing() {
        // tiny: kv_heads 2, head_dim 8, heads 4. Four sequences share a 600-slot prompt (three
        // key blocks); the first two also share a 300-slot turn; the last brings 3 new tokens.
        let mut p = pool(1600);
        let row = 16;
        let fill = |n: usize, f: f32| (0..n * row).map(|i| (i as f32 * f).sin()).collect();
        let all: Vec<u32> = (0..1600).collect();
        let (k, v): (Vec<f32>, Vec<f32>) = (fill(1600, 0.37), fill(1600, 0.53));
        p.write(0, &all, &k, &v).unwrap();
        let prompt: Vec<u32> = (0..600).collect();
        let turn: Vec<u32> = (600..900).collect();
        let own = |from: u32, n: u32| (from..from + n).collect::<Vec<u32>>();
        let lists = [
            [&prompt[..], &turn, &own(1100, 9)].concat(),
            [&prompt[..], &turn, &own(1200, 20)].concat(),
            [&prompt[..], &own(1300, 30)].concat(),
            [&prompt[..], &own(1400, 3)].concat(),
        ];
        let news = [1, 1, 1, 3];
        let seqs: Vec<SeqSlots> = (lists.iter().zip(news))
            .map(|(slots, num_new)| SeqSlots { slots, num_new })
            .collect();
        let q = Tensor::from_vec(fill(12, 0.29), (6, 4, 8), &Device::Cpu).unwrap();
        let run = |p: &KvPool| {
            let plan = p.plan(&seqs, 0.3).unwrap();
            let out = p.attend_rows(0, &q, &plan, 4, 0.3).unwrap();
            (plan.cascade.is_some(), flat_f32(&out).unwrap())
        };
        let (planned, cascade) = run(&p);
        let plan = CascadePlan::new(&seqs, CASCADE_MIN_SPAN).expect("shared runs");
        assert_eq!(plan.spans.len(), 2, "the prompt, then the turn inside it");
        p.set_cascade(false);
        let (unplanned, per_row) = run(&p);
        assert!(planned && !unplanned);
        let diff = (cascade.iter().zip(&per_row)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let scale = per_row.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(diff <= 1e-6 * scale.max(1.0), "max |Δ| {diff}");
    }

    #[test]
    fn attention_matches_a_direct_softmax() {
        // tiny: kv_heads 2, head_dim 8, heads 4 (two query heads per kv head).
        let mut p = pool(4);
        let row = 16;
        let k: Vec<f32> = (0..3 * row)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1)
            .collect();
        let v: Vec<f32> = (0..3 * row)
            .map(|i| ((i * 5 % 13) as f32 - 6.0) * 0.1)
            .collect();
        let slots = [3u32, 0, 2];
        p.write(1, &slots, &k, &v).unwrap();
        let q: Vec<f32> = (0..4 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
        let seq = SeqSlots {
            slots: &slots,
            num_new: 1,
        };
        let out = p.attend(1, &q, &[seq], 4, 0.5).unwrap();
        for h in 0..4 {
            let kvh = h / 2;
            let scores: Vec<f32> = (0..3)
                .map(|j| {
                    0.5 * (0..8)
                        .map(|d| q[h * 8 + d] * k[j * row + kvh * 8 + d])
                        .sum::<f32>()
                })
                .collect();
            let z: f32 = scores.iter().map(|s| s.exp()).sum();
            for d in 0..8 {
                let want: f32 = (0..3)
                    .map(|j| scores[j].exp() / z * v[j * row + kvh * 8 + d])
                    .sum();
                assert!((out[h * 8 + d] - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn bad_slots_are_errors() {
        let p = pool(4);
        let err = p.attend(
            0,
            &[0.0; 32],
            &[SeqSlots {
                slots: &[7],
                num_new: 1,
            }],
            4,
            1.0,
        );
        assert!(matches!(err, Err(KvError::SlotOutOfRange { slot: 7, .. })));
        let err = p.check(&[SeqSlots {
            slots: &[0],
            num_new: 2,
        }]);
        assert!(matches!(err, Err(KvError::BadSequence { seq: 0, .. })));
    }
}
