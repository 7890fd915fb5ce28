//! Choosing the compute device from a user string (`cpu`, `cuda`, `cuda:N`). Asking for CUDA in
//! a build without the `cuda` feature is an error that says how to rebuild, never a silent CPU
//! fallback.

use candle_core::Device;

/// Errors of device selection.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device {0:?}: expected cpu, cuda or cuda:N")]
    Unknown(String),
    #[error("device {0:?} needs a CUDA build: rebuild with `cargo build --release --features cuda` (see README, \"CUDA\")")]
    NotBuilt(String),
    #[error("device {name:?}: {source}")]
    Unavailable {
        name: String,
        #[source]
        source: candle_core::Error,
    },
}

/// The device named by `name`.
pub fn parse_device(name: &str) -> Result<Device, DeviceError> {
    let lower = name.trim().to_ascii_lowercase();
    if lower == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = match lower.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| DeviceError::Unknown(name.into()))?,
        None => return Err(DeviceError::Unknown(name.into())),
    };
    cuda_device(name, ordinal)
}

#[cfg(feature = "cuda")]
fn cuda_device(name: &str, ordinal: usize) -> Result<Device, DeviceError> {
    Device::new_cuda(ordinal).map_err(|source| DeviceError::Unavailable {
        name: name.into(),
        source,
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(name: &str, _ordinal: usize) -> Result<Device, DeviceError> {
    Err(DeviceError::NotBuilt(name.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_parses_and_garbage_is_named() {
        assert!(parse_device("cpu").unwrap().is_cpu());
        assert!(parse_device(" CPU ").unwrap().is_cpu());
        let err = parse_device("tpu").unwrap_err().to_string();
        assert!(err.contains("\"tpu\""), "{err}");
        assert!(parse_device("cuda:x").is_err());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_rebuild() {
        let err = parse_device("cuda").unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
    }
}
