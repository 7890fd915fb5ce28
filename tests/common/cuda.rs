//! The GPU the CUDA tests run on: device 0, or `None` (with a line saying why) where the machine
//! has none, so each GPU test skips and passes there.

use candle_core::Device;

pub fn cuda() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}
