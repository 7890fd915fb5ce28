//! GPU tests of our CUDA kernels (feature `cuda`): scatter + paged attention over the radix
//! pool against the CPU pool's f32 attention on the same bf16-rounded inputs, across context
//! lengths, batch sizes, GQA ratios and head dims, in both the prefill and the split-context
//! decode kernels. Without a CUDA device each test prints why it skipped and passes.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use half::bf16;
use stepppo::kv::{KvPool, SeqSlots};
use stepppo::model::ModelConfig;
use stepppo::seed::splitmix64;

fn cuda() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

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
    heads: (usize, usize, usize),
    lens: &[usize],
    news: &[usize],
    shared: usize,
    seed: u64,
) -> f32 {
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

    let mut gpu = KvPool::new(&cfg, pool_slots, dev).unwrap();
    let everything = [SeqSlots {
        slots: &all,
        num_new: all.len(),
    }];
    let fill = gpu.plan(&everything, scale).unwrap();
    let kt = Tensor::from_vec(k, (pool_slots, kvh, hd), dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let vt = Tensor::from_vec(v, (pool_slots, kvh, hd), dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    gpu.write_rows(0, &fill, &kt, &vt).unwrap();
    let plan = gpu.plan(&seqs, scale).unwrap();
    let qt = Tensor::from_vec(q, (n_new, qh, hd), dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let got = gpu.attend_rows(0, &qt, &plan, qh, scale).unwrap();
    let got: Vec<f32> = got
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    relative_error(&got, &want)
}

const HEADS: [(usize, usize, usize); 4] = [(4, 2, 32), (14, 2, 64), (8, 8, 128), (16, 4, 64)];

#[test]
fn decode_kernel_matches_reference_attention() {
    let Some(dev) = cuda() else { return };
    for (i, heads) in HEADS.iter().enumerate() {
        for lens in [
            vec![1],
            vec![31, 32, 33],
            vec![257, 1000, 5],
            vec![4096; 4],
            vec![70; 33],
        ] {
            let news = vec![1; lens.len()];
            let err = case(&dev, *heads, &lens, &news, 0, i as u64);
            assert!(
                err < 1e-2,
                "decode {heads:?} lens {lens:?}: relative error {err}"
            );
            let err = case(
                &dev,
                *heads,
                &lens,
                &news,
                lens.iter().min().unwrap() / 2,
                7 + i as u64,
            );
            assert!(
                err < 1e-2,
                "decode shared-prefix {heads:?} lens {lens:?}: relative error {err}"
            );
        }
    }
}

#[test]
fn prefill_kernel_matches_reference_attention() {
    let Some(dev) = cuda() else { return };
    for (i, heads) in HEADS.iter().enumerate() {
        for (lens, news) in [
            (vec![17], vec![17]),
            (vec![100, 40, 65], vec![3, 40, 64]),
            (vec![1500, 300], vec![129, 1]),
        ] {
            let err = case(&dev, *heads, &lens, &news, 0, 11 + i as u64);
            assert!(
                err < 1e-2,
                "prefill {heads:?} lens {lens:?} new {news:?}: relative error {err}"
            );
        }
    }
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
