//! Build script: compiles our CUDA kernels (`kernels/*.cu`) to PTX, only when the `cuda`
//! feature is on. CPU builds need no CUDA toolkit and do nothing here.
//!
//! nvcc is taken from `$CUDA_ROOT/bin` (or PATH); the target architecture from
//! `CUDA_COMPUTE_CAP` (e.g. `90` becomes `sm_90a` on Hopper), default 90.
//! `kernels/toolchain.sh` installs a toolkit from PyPI wheels and prints these variables.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: &[&str] = &["attention"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_ROOT");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let arch = gpu_arch();
    for name in KERNELS {
        let source = format!("kernels/{name}.cu");
        println!("cargo:rerun-if-changed={source}");
        let ptx = out_dir.join(format!("{name}.ptx"));
        let status = Command::new(nvcc())
            .args(["--ptx", "-O3", "-std=c++17", &format!("-arch={arch}"), "-o"])
            .arg(&ptx)
            .arg(&source)
            .status()
            .unwrap_or_else(|e| panic!("cannot run nvcc for {source} ({e}); run `source <(bash kernels/toolchain.sh)` first"));
        assert!(status.success(), "nvcc failed on {source}");
    }
}

fn nvcc() -> PathBuf {
    match std::env::var_os("CUDA_ROOT") {
        Some(root) => PathBuf::from(root).join("bin").join("nvcc"),
        None => PathBuf::from("nvcc"),
    }
}

fn gpu_arch() -> String {
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let digits: String = cap.chars().filter(|c| c.is_ascii_digit()).collect();
    let number: u32 = digits.parse().unwrap_or(90);
    if number >= 90 {
        format!("sm_{number}a")
    } else {
        format!("sm_{number}")
    }
}
