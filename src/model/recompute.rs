//! Activation checkpointing: a decoder block whose forward keeps nothing for the backward but its
//! input, and whose backward runs the block's forward again to differentiate it.
//!
//! The decoder's checkpointed block (`RecomputedBlock` in [`super::decoder`]) runs the block on
//! detached weights (no graph, so its activations are freed as the forward moves on) and ties the
//! result to the graph through one op, whose inputs are the block's input and one tracked tensor
//! of the block (so the op is in the graph even when the input is not, as under LoRA's frozen
//! embedding). Its backward recomputes the block with tracked weights from a copy of the input,
//! differentiates `Σ y · ∂L/∂y` (whose gradient in `y` is exactly `∂L/∂y`), returns the input's
//! gradient to candle's backward and hands the weights' gradients to [`set_aside`]. This module
//! owns that collector: [`backward`], the backward every training loss goes through, runs
//! candle's and adds the gradients set aside into its store. The gradients are those of the plain
//! forward, to float rounding: the same ops, run again on the same values. The op's forward is a
//! copy of the block's output storage, on the CPU or on CUDA.

use std::cell::RefCell;

use candle_core::backprop::GradStore;
use candle_core::Tensor;

thread_local! {
    /// Weight gradients the recomputed blocks of the running [`backward`] set aside; `None`
    /// outside it.
    static SET_ASIDE: RefCell<Option<Vec<(Tensor, Tensor)>>> = const { RefCell::new(None) };
}

/// The gradients of `loss` in every tracked tensor, the weights of checkpointed blocks included:
/// the backward of every training loss.
pub fn backward(loss: &Tensor) -> candle_core::Result<GradStore> {
    SET_ASIDE.with(|s| *s.borrow_mut() = Some(Vec::new()));
    let result = loss.backward();
    let set_aside = SET_ASIDE
        .with(|s| s.borrow_mut().take())
        .unwrap_or_default();
    let mut grads = result?;
    for (tensor, grad) in set_aside {
        let sum = match grads.remove(&tensor) {
            Some(existing) => (existing + grad)?,
            None => grad,
        };
        grads.insert(&tensor, sum);
    }
    Ok(grads)
}

/// Sets aside the weight gradients a recomputed block found, for the running [`backward`] to add;
/// an error outside it (a plain `Tensor::backward` would drop them).
pub(crate) fn set_aside(found: Vec<(Tensor, Tensor)>) -> candle_core::Result<()> {
    SET_ASIDE.with(|s| match s.borrow_mut().as_mut() {
        Some(set_aside) => {
            set_aside.extend(found);
            Ok(())
        }
        None => Err(candle_core::Error::Msg(
            "a checkpointed block's gradients need stepppo::model::backward, not \
             Tensor::backward"
                .into(),
        )),
    })
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::backward;
    use crate::model::{Adapters, LoraSpec, Model, ModelConfig, PaddedBatch, TrainInput};
    use crate::model::{Segment, TreeBatch};

    /// Every trainable parameter's gradient of a loss on `model`'s hidden states of `input`.
    fn gradients(model: &Model, input: &TrainInput) -> Vec<(String, Vec<f32>)> {
        let h = model.hidden(input).unwrap();
        let loss =
            (h.sqr().unwrap().mean_all().unwrap() + h.sin().unwrap().sum_all().unwrap()).unwrap();
        let grads = backward(&loss).unwrap();
        model
            .trainable_vars()
            .into_iter()
            .map(|(name, var)| {
                let g = grads
                    .get(var.as_tensor())
                    .expect("every parameter gets a gradient");
                (name, g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            })
            .collect()
    }

    fn inputs(dev: &Device) -> [TrainInput; 2] {
        let seqs = vec![vec![3, 7, 9, 11, 2], vec![5, 6, 1]];
        let padded = PaddedBatch::right_padded(&seqs, 0, dev).unwrap();
        let segment = |start, len, root| Segment { start, len, root };
        let tree = TreeBatch::new(
            &[3, 7, 9, 11, 2, 4, 8],
            vec![
                segment(0, 3, None),
                segment(3, 2, Some(0)),
                segment(5, 2, Some(0)),
            ],
            dev,
        )
        .unwrap();
        [TrainInput::Padded(padded), TrainInput::Tree(tree)]
    }

    /// Checkpointed blocks give the gradients of the plain forward on `dev`, padded and tree
    /// inputs, with and without LoRA.
    fn checkpointed_blocks_give_the_plain_gradients_on(dev: &Device) {
        let cfg = ModelConfig::tiny(16);
        for lora in [false, true] {
            let mut model = Model::new(&cfg, 5, dev).unwrap();
            if lora {
                let spec = LoraSpec {
                    rank: 2,
                    alpha: 4.0,
                    dropout: 0.0,
                    target_modules: vec!["all-linear".into()],
                };
                let mut adapters = Adapters::fresh(&cfg, &spec, 9, dev, "test").unwrap();
                // Non-zero B, so the A's get gradients too.
                for (_, var) in adapters.named_vars() {
                    let t = var.as_tensor();
                    var.set(&(t + 0.05).unwrap()).unwrap();
                }
                adapters = adapters.with_base_model("test");
                model.attach_adapters(adapters).unwrap();
            }
            for input in inputs(dev) {
                model.set_activation_checkpointing(false);
                let plain = gradients(&model, &input);
                model.set_activation_checkpointing(true);
                let recomputed = gradients(&model, &input);
                assert_eq!(plain.len(), recomputed.len());
                for ((name, a), (_, b)) in plain.iter().zip(&recomputed) {
                    let scale = a.iter().fold(1e-12f32, |m, x| m.max(x.abs()));
                    let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                    assert!(
                        worst <= 1e-6 * scale,
                        "{name} (lora {lora}): {worst} of {scale}"
                    );
                }
            }
        }
    }

    #[test]
    fn checkpointed_blocks_give_the_gradients_of_the_plain_forward() {
        checkpointed_blocks_give_the_plain_gradients_on(&Device::Cpu);
    }

    /// The same on a GPU (run by scripts/gpu_check.sh); skips where there is none.
    #[cfg(feature = "cuda")]
    #[test]
    fn checkpointed_blocks_give_the_gradients_of_the_plain_forward_on_cuda() {
        match Device::new_cuda(0) {
            Ok(gpu) => checkpointed_blocks_give_the_plain_gradients_on(&gpu),
            Err(e) => eprintln!("skipped: no CUDA device ({e})"),
        }
    }

    #[test]
    fn a_plain_backward_through_a_checkpointed_block_is_an_error() {
        let mut model = Model::new(&ModelConfig::tiny(16), 5, &Device::Cpu).unwrap();
        model.set_activation_checkpointing(true);
        let [input, _] = inputs(&Device::Cpu);
        let loss = model.hidden(&input).unwrap().sum_all().unwrap();
        let err = loss.backward().err().unwrap().to_string();
        assert!(err.contains("stepppo::model::backward"), "{err}");
    }
}
