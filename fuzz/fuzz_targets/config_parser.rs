//! Arbitrary bytes as a run config: the first NUL-separated piece is YAML text, the others are
//! `--set key=value` arguments applied to it and to the embedded default. Parsing, overriding and
//! validating never panic, overflow the stack or abort: every bad input is a `ConfigError`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stepppo::config::{Config, EMBEDDED_DEFAULT_YAML};

fuzz_target!(|data: &[u8]| {
    let mut pieces = data.split(|&b| b == 0).map(String::from_utf8_lossy);
    let yaml = pieces.next().unwrap_or_default();
    let sets: Vec<String> = pieces.map(|s| s.into_owned()).collect();
    std::hint::black_box(Config::from_yaml_str(&yaml, "fuzz.yaml", &sets).ok());
    std::hint::black_box(Config::from_yaml_str(EMBEDDED_DEFAULT_YAML, "default", &sets).ok());
});
