use candle_core::{Device, Tensor, D};
use std::time::Instant;
fn main() {
    let size = std::env::args().nth(1).unwrap_or("small".into());
    let b: usize = std::env::args()
        .nth(2)
        .map(|s| s.parse().unwrap())
        .unwrap_or(16);
    let t: usize = std::env::args()
        .nth(3)
        .map(|s| s.parse().unwrap())
        .unwrap_or(560);
    let tok = stepppo::tokenizer::Tokenizer::builtin();
    let mc = stepppo::model::ModelConfig::named(&size, &tok).unwrap();
    let dev = Device::Cpu;
    let m = stepppo::model::Model::new(&mc, 1, &dev).unwrap();
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % 1000) as u32).collect();
    let ids = Tensor::from_vec(ids, (b, t), &dev).unwrap();
    let mask = Tensor::ones((b, t), candle_core::DType::U32, &dev).unwrap();
    for _ in 0..2 {
        let t0 = Instant::now();
        let (lp, ent) = m.token_logprobs_entropy(&ids, &mask, &ids, 1.0).unwrap();
        let t1 = t0.elapsed().as_secs_f64();
        let loss = (lp.sum_all().unwrap() + ent.sum_all().unwrap()).unwrap();
        let g = loss.backward().unwrap();
        println!(
            "full: fwd {:.2}s total {:.2}s",
            t1,
            t0.elapsed().as_secs_f64()
        );
        drop(g);
        let t0 = Instant::now();
        let h = m.hidden_train(&ids, &mask).unwrap();
        let idx: Vec<u32> = (0..b * 64).map(|i| (i * 5 % (b * t)) as u32).collect();
        let idx = Tensor::new(idx.as_slice(), &dev).unwrap();
        let hs = h
            .reshape((b * t, mc.hidden_size))
            .unwrap()
            .index_select(&idx, 0)
            .unwrap();
        let w = m
            .named_vars()
            .into_iter()
            .find(|(n, _)| n == "model.embed_tokens.weight")
            .unwrap()
            .1;
        let logits = hs.matmul(&w.as_tensor().t().unwrap()).unwrap();
        let lsm = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
        let t1 = t0.elapsed().as_secs_f64();
        let loss = lsm.sum_all().unwrap();
        let g = loss.backward().unwrap();
        println!(
            "gathered: fwd {:.2}s total {:.2}s",
            t1,
            t0.elapsed().as_secs_f64()
        );
        drop(g);
    }
}
