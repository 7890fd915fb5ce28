//! Helpers shared by the unit tests of several modules (built with `cfg(test)` only): whether two
//! tensors agree to 1e-5 of the larger's scale, and the gradient of every named parameter of a
//! loss, for the layout-equivalence tests of the training passes (learner and warm start).

use candle_core::{Tensor, Var};

/// Asserts `max |a − b| ≤ 1e-5 · max |b|` (and equal shapes); a zero `b` tests nothing and fails.
pub(crate) fn assert_close(name: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(a.dims(), b.dims(), "{name}: shapes");
    let host = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (a, b) = (host(a), host(b));
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(scale > 0.0, "{name}: a zero tensor tests nothing");
    assert!(
        diff <= 1e-5 * scale,
        "{name}: max |Δ| {diff} against max {scale}"
    );
}

/// [`assert_close`] on per-record rows (each the same length in `a` and `b`).
pub(crate) fn assert_rows_close(name: &str, a: &[Vec<f32>], b: &[Vec<f32>]) {
    let lengths = |x: &[Vec<f32>]| x.iter().map(Vec::len).collect::<Vec<_>>();
    assert_eq!(lengths(a), lengths(b), "{name}: row lengths");
    let flat = |x: &[Vec<f32>]| Tensor::new(x.concat(), &candle_core::Device::Cpu).unwrap();
    assert_close(name, &flat(a), &flat(b));
}

/// The gradient of `loss` for each of `vars` by name; every parameter must have one.
pub(crate) fn gradients(loss: &Tensor, vars: Vec<(String, Var)>) -> Vec<(String, Tensor)> {
    let grads = loss.backward().unwrap();
    vars.into_iter()
        .map(|(name, var)| {
            let g = grads.get(var.as_tensor());
            let g = g.unwrap_or_else(|| panic!("{name} has no gradient"));
            (name, g.clone())
        })
        .collect()
}

/// [`assert_close`] on the loss and on each gradient of `a` against `b`'s.
pub(crate) fn assert_same_step(a: (f32, &[(String, Tensor)]), b: (f32, &[(String, Tensor)])) {
    assert!(
        (a.0 - b.0).abs() <= 1e-5 * b.0.abs(),
        "loss {} vs {}",
        a.0,
        b.0
    );
    assert_eq!(a.1.len(), b.1.len());
    for ((name, x), (_, y)) in a.1.iter().zip(b.1) {
        assert_close(name, x, y);
    }
}
