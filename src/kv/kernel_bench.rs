//! Timing the pool's attention kernels on random K/V (`stepppo bench kernels`, and the GPU
//! check script through it). Decode: the bytes of K and V a call must read, over its time, beside
//! the bandwidth of a plain device-to-device copy of as many bytes. Prefill: our paged kernel and
//! flash-attention (where built) on the same pool and queries, their times, causal-attention
//! FLOP/s and their largest difference. It measures; it does not choose a kernel.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use super::{KvError, KvPool, KvShape, PrefillAttention, SeqSlots};

/// The attention call measured: `batch` sequences of `context` tokens each.
#[derive(Clone, Debug)]
pub struct KernelShape {
    /// Sequences per call.
    pub batch: usize,
    /// Tokens of each sequence, all held in the pool.
    pub context: usize,
    /// Query heads.
    pub q_heads: usize,
    /// K/V heads.
    pub kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// The pool's dtype (`bf16` or `f32`).
    pub dtype: DType,
    /// Timed calls after one warm-up call.
    pub iters: usize,
}

/// A decode measurement: every sequence brings one token.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeReport {
    /// Mean milliseconds per decode call.
    pub decode_ms: f64,
    /// K and V bytes read per call over the call's time.
    pub decode_gb_s: f64,
    /// A device copy's bandwidth (bytes read and written) on as many bytes.
    pub copy_gb_s: f64,
    /// `decode_gb_s` over `copy_gb_s`.
    pub fraction_of_copy: f64,
}

/// One prefill kernel's measurement.
#[derive(Clone, Debug, Serialize)]
pub struct KernelTiming {
    /// `paged` or `flash`.
    pub kernel: &'static str,
    /// Mean milliseconds per call.
    pub ms: f64,
    /// Causal-attention TFLOP/s (score and weighted-sum FLOPs).
    pub tflop_s: f64,
    /// Largest |difference| from the paged kernel's output (0 for the paged kernel itself).
    pub max_abs_diff_vs_paged: f64,
}

/// A prefill measurement: each sequence's last `new` tokens attend over its whole context, by
/// every kernel this build has (flash-attention needs the `flash-attn` feature and bf16).
#[derive(Clone, Debug, Serialize)]
pub struct PrefillReport {
    /// New tokens per sequence.
    pub new: usize,
    /// One timing per kernel this build can run, paged first.
    pub kernels: Vec<KernelTiming>,
}

/// Times decode attention at `shape` on `device`.
pub fn decode(shape: &KernelShape, device: &Device) -> Result<DecodeReport, KvError> {
    let (pool, all) = filled_pool(shape, device)?;
    let seqs: Vec<SeqSlots> = all
        .chunks(shape.context)
        .map(|slots| SeqSlots { slots, num_new: 1 })
        .collect();
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let plan = pool.plan(&seqs, scale)?;
    let q = random(
        (shape.batch, shape.q_heads, shape.head_dim),
        shape.dtype,
        device,
    )?;
    let decode_s = time(device, shape.iters, || {
        pool.attend_rows(0, &q, &plan, shape.q_heads, scale)
    })?;
    // What decode must read: every K and V row once.
    let kv_bytes =
        2.0 * (all.len() * shape.kv_heads * shape.head_dim * shape.dtype.size_in_bytes()) as f64;
    let copy_elems = all.len() * shape.kv_heads * shape.head_dim * 2;
    let decode_gb_s = kv_bytes / decode_s / 1e9;
    let copy_gb_s = copy_rate(device, copy_elems, shape.iters)? / 1e9;
    Ok(DecodeReport {
        decode_ms: decode_s * 1e3,
        decode_gb_s,
        copy_gb_s,
        fraction_of_copy: decode_gb_s / copy_gb_s,
    })
}

/// Bytes a plain device-to-device copy of 256 MiB moves per second on `device` (read and
/// written): the memory bandwidth a device's traffic limits assume.
pub fn copy_bandwidth(device: &Device) -> Result<f64, KvError> {
    copy_rate(device, 128 << 20, 10)
}

/// Bytes per second (read and written) of a device copy of `elems` bf16 values, over `iters`
/// timed copies.
fn copy_rate(device: &Device, elems: usize, iters: usize) -> Result<f64, KvError> {
    let src = Tensor::zeros(elems, DType::BF16, device)?;
    let copy_s = time(device, iters, || Ok(src.copy()?))?;
    Ok(2.0 * (elems * 2) as f64 / copy_s)
}

/// Times prefill attention of the last `new` tokens of each sequence at `shape` on `device`.
pub fn prefill(shape: &KernelShape, new: usize, device: &Device) -> Result<PrefillReport, KvError> {
    let (mut pool, all) = filled_pool(shape, device)?;
    let seqs: Vec<SeqSlots> = all
        .chunks(shape.context)
        .map(|slots| SeqSlots {
            slots,
            num_new: new,
        })
        .collect();
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let q = random(
        (shape.batch * new, shape.q_heads, shape.head_dim),
        shape.dtype,
        device,
    )?;
    // Score and weighted-sum FLOPs of the causal part each new token sees.
    let keys_seen: usize = (0..new).map(|i| shape.context - new + i + 1).sum();
    let flops = 4.0 * (shape.batch * keys_seen * shape.q_heads * shape.head_dim) as f64;
    let mut kernels = Vec::new();
    let mut paged_out: Option<Tensor> = None;
    for kernel in [PrefillAttention::Paged, PrefillAttention::Flash] {
        if !kernel.compiled() || (kernel == PrefillAttention::Flash && shape.dtype != DType::BF16) {
            continue;
        }
        pool.set_prefill_attention(kernel)?;
        let plan = pool.plan(&seqs, scale)?;
        let out = pool.attend_rows(0, &q, &plan, shape.q_heads, scale)?;
        let s = time(device, shape.iters, || {
            pool.attend_rows(0, &q, &plan, shape.q_heads, scale)
        })?;
        let max_abs_diff_vs_paged = match &paged_out {
            None => 0.0,
            Some(paged) => f64::from(
                (out.to_dtype(DType::F32)? - paged.to_dtype(DType::F32)?)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?,
            ),
        };
        kernels.push(KernelTiming {
            kernel: kernel.name(),
            ms: s * 1e3,
            tflop_s: flops / s / 1e12,
            max_abs_diff_vs_paged,
        });
        paged_out.get_or_insert(out);
    }
    Ok(PrefillReport { new, kernels })
}

/// A one-layer pool of `shape` with random K/V in every slot (written through the scatter
/// kernel), and those slots in order.
fn filled_pool(shape: &KernelShape, device: &Device) -> Result<(KvPool, Vec<u32>), KvError> {
    let kv = KvShape {
        num_layers: 1,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
    };
    let total = shape.batch * shape.context;
    let mut pool = KvPool::with_dtype(kv, total, device, shape.dtype)?;
    let all = pool.alloc(total).ok_or_else(|| KvError::ShapeMismatch {
        pool: format!("{} free slots", pool.num_free()),
        wanted: format!("{total} slots"),
    })?;
    for chunk in all.chunks(1 << 16) {
        let seq = [SeqSlots {
            slots: chunk,
            num_new: chunk.len(),
        }];
        let plan = pool.plan(&seq, 1.0)?;
        let rows = (chunk.len(), shape.kv_heads, shape.head_dim);
        let k = random(rows, shape.dtype, device)?;
        let v = random(rows, shape.dtype, device)?;
        pool.write_rows(0, &plan, &k, &v)?;
    }
    Ok((pool, all))
}

fn random(dims: (usize, usize, usize), dtype: DType, device: &Device) -> Result<Tensor, KvError> {
    Ok(Tensor::randn(0f32, 1.0, dims, device)?.to_dtype(dtype)?)
}

/// Mean seconds per call after a warm-up call, with the device synchronised around the loop.
fn time(
    device: &Device,
    iters: usize,
    mut f: impl FnMut() -> Result<Tensor, KvError>,
) -> Result<f64, KvError> {
    f()?;
    device.synchronize()?;
    let start = Instant::now();
    for _ in 0..iters.max(1) {
        f()?;
    }
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / iters.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> KernelShape {
        KernelShape {
            batch: 2,
            context: 16,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 8,
            dtype: DType::F32,
            iters: 2,
        }
    }

    #[test]
    fn decode_and_prefill_report_finite_positive_timings_on_the_cpu() {
        let d = decode(&shape(), &Device::Cpu).unwrap();
        for x in [d.decode_ms, d.decode_gb_s, d.copy_gb_s, d.fraction_of_copy] {
            assert!(x.is_finite() && x > 0.0, "{d:?}");
        }
        let p = prefill(&shape(), 4, &Device::Cpu).unwrap();
        assert_eq!(
            p.kernels.len(),
            1,
            "the paged kernel alone without flash-attn: {p:?}"
        );
        let paged = &p.kernels[0];
        assert_eq!(paged.kernel, "paged");
        assert!(paged.ms > 0.0 && paged.tflop_s > 0.0 && paged.max_abs_diff_vs_paged == 0.0);
    }
}
