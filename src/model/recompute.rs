//! Activation checkpointing: a decoder block whose forward keeps nothing for the backward but its
//! input, and whose backward runs the block's forward again to differentiate it.
//!
//! [`block`] runs the block on detached weights (no graph, so its activations are freed as the
//! forward moves on) and ties the result to the graph through one op, [`RecomputedBlock`], whose
//! inputs are the block's input and one tracked tensor of the block (so the op is in the graph
//! even when the input is not, as under LoRA's frozen embedding). Its backward recomputes the
//! block with tracked weights from a copy of the input, differentiates `Σ y · ∂L/∂y` (whose
//! gradient in `y` is exactly `∂L/∂y`), returns the input's gradient to candle's backward and
//! sets the weights' gradients aside. [`backward`] is the backward every training loss goes
//! through: it runs candle's and adds the gradients set aside into its store. The gradients are
//! those of the plain forward, to float rounding: the same ops, run again on the same values.
//!
//! CPU only so far (the op's forward is a copy of f32 CPU storage).

use std::cell::RefCell;

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor, Var};

use super::decoder::{Attend, Trunk};
use super::Result;

thread_local! {
    /// Weight gradients the recomputed blocks of the running [`backward`] set aside; `None`
    /// outside it.
    static SET_ASIDE: RefCell<Option<Vec<(Tensor, Tensor)>>> = const { RefCell::new(None) };
}

/// Block `layer` of `trunk` over `x`, keeping only `x` for the backward.
pub(crate) fn block(
    trunk: &Trunk,
    layer: usize,
    x: &Tensor,
    rope: (&Tensor, &Tensor),
    attend: &Attend,
) -> Result<Tensor> {
    let tracked = trunk.block_tracked_tensors(layer);
    let anchor = match (x.track_op(), tracked.first()) {
        (true, _) => x.clone(),
        (false, Some(t)) => t.clone(),
        // Nothing in or before the block trains: no graph to keep.
        (false, None) => return trunk.block_forward(layer, x, rope, attend),
    };
    if !x.device().is_cpu() {
        return Err(super::ModelError::Input(
            "activation checkpointing runs on the CPU only so far".into(),
        ));
    }
    let y = trunk
        .with_block_detached(layer)?
        .block_forward(layer, &x.detach(), rope, attend)?;
    let op = RecomputedBlock {
        trunk: trunk.clone(),
        layer,
        rope: (rope.0.clone(), rope.1.clone()),
        attend: attend.clone(),
        tracked,
    };
    Ok(x.contiguous()?.apply_op3(&y.contiguous()?, &anchor, op)?)
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

/// The op that ties a checkpointed block's output to its input: forward, the output computed on
/// detached weights (copied through); backward, the block recomputed and differentiated.
struct RecomputedBlock {
    trunk: Trunk,
    layer: usize,
    rope: (Tensor, Tensor),
    attend: Attend,
    /// The block's tracked tensors, whose gradients are set aside.
    tracked: Vec<Tensor>,
}

impl CustomOp3 for RecomputedBlock {
    fn name(&self) -> &'static str {
        "recomputed-block"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _x_layout: &Layout,
        y: &CpuStorage,
        y_layout: &Layout,
        _anchor: &CpuStorage,
        _anchor_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let data = super::attention::f32_slice(y, y_layout)?;
        Ok((CpuStorage::F32(data.to_vec()), y_layout.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _y: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let input = Var::from_tensor(&x.detach())?;
        let rope = (&self.rope.0, &self.rope.1);
        let y = self
            .trunk
            .block_forward(self.layer, input.as_tensor(), rope, &self.attend)
            .map_err(candle_core::Error::wrap)?;
        let grads = (y * grad.detach())?.sum_all()?.backward()?;
        let found: Vec<(Tensor, Tensor)> = self
            .tracked
            .iter()
            .filter_map(|t| grads.get(t).map(|g| (t.clone(), g.clone())))
            .collect();
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
        })?;
        let grad_x = x.track_op().then(|| grads.get(input.as_tensor()).cloned());
        Ok((grad_x.flatten(), None, None))
    }
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

    fn inputs() -> [TrainInput; 2] {
        let dev = Device::Cpu;
        let seqs = vec![vec![3, 7, 9, 11, 2], vec![5, 6, 1]];
        let padded = PaddedBatch::right_padded(&seqs, 0, &dev).unwrap();
        let segment = |start, len, root| Segment { start, len, root };
        let tree = TreeBatch::new(
            &[3, 7, 9, 11, 2, 4, 8],
            vec![
                segment(0, 3, None),
                segment(3, 2, Some(0)),
                segment(5, 2, Some(0)),
            ],
            &dev,
        )
        .unwrap();
        [TrainInput::Padded(padded), TrainInput::Tree(tree)]
    }

    #[test]
    fn checkpointed_blocks_give_the_gradients_of_the_plain_forward() {
        let cfg = ModelConfig::tiny(16);
        for lora in [false, true] {
            let mut model = Model::new(&cfg, 5, &Device::Cpu).unwrap();
            if lora {
                let spec = LoraSpec {
                    rank: 2,
                    alpha: 4.0,
                    dropout: 0.0,
                    target_modules: vec!["all-linear".into()],
                };
                let mut adapters = Adapters::fresh(&cfg, &spec, 9, &Device::Cpu, "test").unwrap();
                // Non-zero B, so the A's get gradients too.
                for (_, var) in adapters.named_vars() {
                    let t = var.as_tensor();
                    var.set(&(t + 0.05).unwrap()).unwrap();
                }
                adapters = adapters.with_base_model("test");
                model.attach_adapters(adapters).unwrap();
            }
            for input in inputs() {
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
    fn a_plain_backward_through_a_checkpointed_block_is_an_error() {
        let mut model = Model::new(&ModelConfig::tiny(16), 5, &Device::Cpu).unwrap();
        model.set_activation_checkpointing(true);
        let [input, _] = inputs();
        let loss = model.hidden(&input).unwrap().sum_all().unwrap();
        let err = loss.backward().err().unwrap().to_string();
        assert!(err.contains("stepppo::model::backward"), "{err}");
    }
}
