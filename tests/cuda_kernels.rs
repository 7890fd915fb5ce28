//! GPU tests of our CUDA kernels (feature `cuda`): scatter + paged attention over the radix
//! pool against the CPU pool's f32 attention on the same bf16-rounded inputs, across context
//! lengths, batch sizes, GQA ratios, head dims and both pool dtypes (bf16, f32), in both the
//! prefill and the split-context decode kernels, and cascade decode over a shared prompt; built
//! with `flash-attn`, candle-flash-attn's prefill against the same reference. Without a CUDA
//! device each test prints why it skipped and passes.
#![cfg(feature = "cuda")]

#[path = "common/cuda.rs"]
mod gpu;

use candle_core::{DType, Device, Tensor};
use gpu::cuda;
use half::bf16;
use stepppo::kv::{KvPool, PrefillAttention, SeqSlots};
use stepppo::model::ModelConfig;
use stepppo::seed::splitmix64;

fn shape(q_heads: usize, kv_heads: usize, head_dim: usize) -> ModelConfig {
    let mut cfg = ModelConfig::tiny(64);
    cfg.num_hidden_layers = 1;
    cfg.num_attention_heads = q_heads;
    cfg.num_key_value_heads = kv_heads;
    cfg.hidden_size = q_heads * head_dim;
    cfg
}

/// Deterministic values in [-1, 1), rounded to bf16 (so both devices see the same inputs).
fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let x = (splitmix64(seed ^ i.wrapping_mul(0x9E37)) >> 40) as f32 / (1u64 << 24) as f32;
            bf16::from_f32(2.0 * x - 1.0).to_f32()
        })
        .collect()
}

/// Sequences as slot lists over a shuffled pool, sharing a prefix (as radix forks do).
fn sequences(lens: &[usize], shared: usize, pool_slots: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut order: Vec<u32> = (0..pool_slots as u32).collect();
    for i in (1..order.len()).rev() {
        let j = (splitmix64(seed + i as u64) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let prefix: Vec<u32> = order[..shared].to_vec();
    let mut next = shared;
    lens.iter()
        .map(|&len| {
            let own = len.saturating_sub(shared.min(len));
            let mut slots: Vec<u32> = prefix[..shared.min(len)].to_vec();
            slots.extend_from_slice(&order[next..next + own]);
            next += own;
            slots
        })
        .collect()
}

fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    let diff: f32 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let norm: f32 = want.iter().map(|b| b * b).sum();
    (diff / norm.max(1e-12)).sqrt()
}

/// Runs one case on both devices and returns the relative error of the GPU output.
fn case(
    dev: &Device,
    dtype: DType,
    heads: (usize, usize, usize),
    lens: &[usize],
    news: &[usize],
    shared: usize,
    seed: u64,
) -> f32 {
    case_with(
        dev,
        (dtype, PrefillAttention::Paged, true),
        heads,
        lens,
        news,
        shared,
        seed,
    )
    .0
}

/// [`case`] with the GPU pool's prefill kernel chosen, and cascade attention on or off; also
/// how many of the GPU pool's calls ran cascade attention.
fn case_with(
    dev: &Device,
    (dtype, prefill, cascade): (DType, PrefillAttention, bool),
    heads: (usize, usize, usize),
    lens: &[usize],
    news: &[usize],
    shared: usize,
    seed: u64,
) -> (f32, u64) {
    let (qh, kvh, hd) = heads;
    let cfg = shape(qh, kvh, hd);
    let pool_slots = lens.iter().sum::<usize>() + shared;
    let seq_slots = sequences(lens, shared, pool_slots, seed);
    let seqs: Vec<SeqSlots> = seq_slots
        .iter()
        .zip(news)
        .map(|(s, &n)| SeqSlots {
            slots: s,
            num_new: n,
        })
        .collect();
    let all: Vec<u32> = (0..pool_slots as u32).collect();
    let row = kvh * hd;
    let (k, v) = (
        values(pool_slots * row, seed ^ 1),
        values(pool_slots * row, seed ^ 2),
    );
    let n_new: usize = news.iter().sum();
    let q = values(n_new * qh * hd, seed ^ 3);
    let scale = 1.0 / (hd as f32).sqrt();

    let mut cpu = KvPool::new(&cfg, pool_slots, &Device::Cpu).unwrap();
    cpu.write(0, &all, &k, &v).unwrap();
    let want = cpu.attend(0, &q, &seqs, qh, scale).unwrap();

    let mut gpu = KvPool::with_dtype(&cfg, pool_slots, dev, dtype).unwrap();
    gpu.set_prefill_attention(prefill).unwrap();
    gpu.set_cascade(cascade);
    let everything = [SeqSlots {
        slots: &all,
        num_new: all.len(),
    }];
    let fill = gpu.plan(&everything, scale).unwrap();
    let kt = Tensor::from_vec(k, (pool_slots, kvh, hd), dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let vt = Tensor::from_vec(v, (pool_slots, kvh, hd), dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    gpu.write_rows(0, &fill, &kt, &vt).unwrap();
    let plan = gpu.plan(&seqs, scale).unwrap();
    let qt = Tensor::from_vec(q, (n_new, qh, hd), dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let got = gpu.attend_rows(0, &qt, &plan, qh, scale).unwrap();
    let got: Vec<f32> = got
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    (relative_error(&got, &want), gpu.take_cascade_counts().0)
}

/// (query heads, KV heads, head_dim): GQA groups of 2, 7, 1, 4 and 16 (a decode block serves
/// up to 8 query heads, so 16 takes two blocks per KV head).
const HEADS: [(usize, usize, usize); 6] = [
    (4, 2, 32),
    (14, 2, 64),
    (8, 8, 128),
    (16, 4, 64),
    (28, 4, 128),
    (32, 2, 64),
];

/// Pool dtypes and the relative error each is held to: bf16 rounds the output; f32 differs
/// from the CPU only in summation order.
const DTYPES: [(DType, f32); 2] = [(DType::BF16, 1e-2), (DType::F32, 1e-5)];

#[test]
fn decode_kernel_matches_reference_attention() {
    let Some(dev) = cuda() else { return };
    for (dtype, bound) in DTYPES {
        for (i, heads) in HEADS.iter().enumerate() {
            for lens in [
                vec![1],
                vec![31, 32, 33],
                vec![257, 1000, 5],
                vec![4096; 4],
                vec![70; 33],
            ] {
                let news = vec![1; lens.len()];
                let err = case(&dev, dtype, *heads, &lens, &news, 0, i as u64);
                assert!(
                    err < bound,
                    "decode {dtype:?} {heads:?} lens {lens:?}: relative error {err}"
                );
                let shared = lens.iter().min().unwrap() / 2;
                let err = case(&dev, dtype, *heads, &lens, &news, shared, 7 + i as u64);
                assert!(
                    err < bound,
                    "decode {dtype:?} shared-prefix {heads:?} lens {lens:?}: relative error {err}"
                );
            }
        }
    }
}

/// Decode calls whose sequences share a prompt of at least 256 positions and own tails of
/// similar lengths (so the call is planned as cascade): cascade attention (the shared prompt as
/// one matrix product over the whole group, merged with each sequence's own positions) and the
/// paged decode kernel alone, each against the reference.
#[test]
fn cascade_decode_matches_reference_attention_and_the_paged_kernel() {
    let Some(dev) = cuda() else { return };
    for (dtype, bound) in DTYPES {
        for (i, heads) in HEADS.iter().enumerate() {
            for (lens, shared) in [
                (vec![1100; 16], 1024),
                (vec![600, 900, 700], 500),
                (vec![4096; 8], 4000),
            ] {
                let news = vec![1; lens.len()];
                for cascade in [true, false] {
                    let (err, cascade_calls) = case_with(
                        &dev,
                        (dtype, PrefillAttention::Paged, cascade),
                        *heads,
                        &lens,
                        &news,
                        shared,
                        41 + i as u64,
                    );
                    assert!(
                        err < bound,
                        "decode (cascade {cascade}) {dtype:?} {heads:?} lens {lens:?} shared \
                         {shared}: relative error {err}"
                    );
                    assert_eq!(cascade_calls, u64::from(cascade), "lens {lens:?}");
                }
            }
        }
    }
}

#[test]
fn prefill_kernel_matches_reference_attention() {
    let Some(dev) = cuda() else { return };
    for (dtype, bound) in DTYPES {
        for (i, heads) in HEADS.iter().enumerate() {
            for (lens, news) in [
                (vec![17], vec![17]),
                (vec![100, 40, 65], vec![3, 40, 64]),
                (vec![1500, 300], vec![129, 1]),
            ] {
                let err = case(&dev, dtype, *heads, &lens, &news, 0, 11 + i as u64);
                assert!(
                    err < bound,
                    "prefill {dtype:?} {heads:?} lens {lens:?} new {news:?}: relative error {err}"
                );
            }
        }
    }
}

/// candle-flash-attn's prefill (bf16 pools) over the context gathered from the pool, against the
/// same reference: with and without a cached prefix, mixed with decoding sequences.
#[cfg(feature = "flash-attn")]
#[test]
fn flash_prefill_matches_reference_attention() {
    let Some(dev) = cuda() else { return };
    let bf16_bound = DTYPES[0].1;
    for (i, heads) in HEADS.iter().enumerate() {
        for (lens, news, shared) in [
            (vec![17], vec![17], 0),
            (vec![100, 40, 65], vec![3, 40, 64], 0),
            (vec![1500, 300], vec![129, 1], 0),
            (vec![600, 600, 600, 600], vec![64, 64, 64, 64], 512),
        ] {
            let (err, _) = case_with(
                &dev,
                (DType::BF16, PrefillAttention::Flash, true),
                *heads,
                &lens,
                &news,
                shared,
                23 + i as u64,
            );
            assert!(
                err < bf16_bound,
                "flash prefill {heads:?} lens {lens:?} new {news:?} shared {shared}: relative error {err}"
            );
        }
    }
}

/// An f32 pool refuses the flash prefill (flash-attention has no f32 kernels) and keeps ours.
#[test]
fn flash_prefill_on_an_f32_pool_is_an_error() {
    let Some(dev) = cuda() else { return };
    let mut pool = KvPool::with_dtype(&shape(4, 2, 64), 8, &dev, DType::F32).unwrap();
    let err = pool
        .set_prefill_attention(PrefillAttention::Flash)
        .unwrap_err()
        .to_string();
    let want = if cfg!(feature = "flash-attn") {
        "bf16 pools only"
    } else {
        "without the `flash-attn` feature"
    };
    assert!(err.contains(want), "{err}");
}

/// A pool refuses queries in another dtype than its own (no silent cast).
#[test]
fn a_query_in_another_dtype_than_the_pool_is_an_error() {
    let Some(dev) = cuda() else { return };
    let cfg = shape(4, 2, 32);
    let pool = KvPool::new(&cfg, 4, &dev).unwrap();
    let all: Vec<u32> = (0..4).collect();
    let seqs = [SeqSlots {
        slots: &all,
        num_new: 4,
    }];
    let plan = pool.plan(&seqs, 0.1).unwrap();
    let q = Tensor::zeros((4, 4, 32), DType::F32, &dev).unwrap();
    let err = pool
        .attend_rows(0, &q, &plan, 4, 0.1)
        .expect_err("f32 q on a bf16 pool");
    assert!(err.to_string().contains("BF16"), "{err}");
}

#[test]
fn unsupported_head_dim_is_a_clear_error() {
    let Some(dev) = cuda() else { return };
    let err = KvPool::new(&shape(4, 2, 8), 16, &dev)
        .err()
        .expect("head_dim 8 is not built")
        .to_string();
    assert!(err.contains("head_dim"), "{err}");
}
