//! `e^x` for f32 slices in a form the compiler vectorises (libm's `expf` is a call per element):
//! Cephes' `expf` — `x = n ln 2 + r` with `|r| ≤ ln 2 / 2`, a degree-6 polynomial for `e^r` and
//! `2^n` put into the exponent bits — with branch-free rounding. Relative error below 2e-7
//! (libm's: 1 ulp, 6e-8); results below `e^-87` flush to 0, above `e^88` saturate. Also the
//! maximum and sum of a slice in eight lanes (what a softmax needs around its exp), which the
//! compiler vectorises where a strict left-to-right fold cannot be.

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two so `n · LN2_HI` is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 · 2²³: adding it rounds to the nearest integer, kept in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;
const LOWEST: f32 = -87.0;
const HIGHEST: f32 = 88.0;

/// `e^x`, inlined into the loops that call it.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let clamped = x.clamp(LOWEST, HIGHEST);
    let shifted = clamped * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let z = r * r;
    let poly = (((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * z
        + r
        + 1.0;
    // The rounded n sits in the low bits of `shifted`: 2ⁿ = (n + 127) << 23.
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    if x < LOWEST {
        0.0
    } else {
        poly * scale
    }
}

/// `x ← e^x` over a slice.
#[inline(always)]
pub(crate) fn exp_in_place(xs: &mut [f32]) {
    for x in xs {
        *x = exp(*x);
    }
}

/// Lanes of [`max_of`] and [`sum_of`].
const LANES: usize = 8;

/// The largest value (−∞ for an empty slice; NaN-free input).
#[inline(always)]
pub(crate) fn max_of(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = l.max(x);
        }
    }
    tail.iter()
        .chain(&lanes)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// The sum, accumulated in eight lanes then added up.
#[inline(always)]
pub(crate) fn sum_of(xs: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += x;
        }
    }
    lanes.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_2e7_of_libm_and_flushes_far_below() {
        let mut worst = 0.0f32;
        for i in -870_000..=880_000 {
            let x = i as f32 * 1e-4;
            let (ours, libm) = (exp(x), x.exp());
            worst = worst.max((ours - libm).abs() / libm);
        }
        assert!(worst < 2e-7, "relative error {worst}");
        assert_eq!(exp(-1e9), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn lane_max_and_sum_see_every_element() {
        let xs: Vec<f32> = (0..21).map(|i| ((i * 7) % 11) as f32).collect();
        assert_eq!(max_of(&xs), 10.0);
        assert_eq!(sum_of(&xs), xs.iter().sum::<f32>());
        assert_eq!(max_of(&xs[..3]), 7.0);
        assert_eq!(max_of(&[]), f32::NEG_INFINITY);
    }
}
