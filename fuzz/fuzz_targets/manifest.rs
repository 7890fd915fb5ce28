//! Arbitrary bytes as `manifest.json`: loading never panics; a damaged manifest is always
//! reported (never taken as sound) unless it parses as a manifest; what parses round-trips
//! through the written text.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use stepppo::store::{Manifest, MANIFEST_FILE};

/// A directory of this process for the manifest file.
fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir =
            std::env::temp_dir().join(format!("stepppo-fuzz-manifest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    std::fs::write(dir().join(MANIFEST_FILE), data).unwrap();
    let loaded = Manifest::load(dir()).unwrap();
    let parsed = std::str::from_utf8(data).ok().map(Manifest::parse);
    match parsed {
        Some(Ok(manifest)) => {
            assert!(loaded.damage.is_none());
            assert_eq!(loaded.manifest, manifest);
            let text = manifest.to_text().unwrap();
            assert_eq!(Manifest::parse(&text).unwrap(), manifest);
        }
        _ => assert!(loaded.damage.is_some() && loaded.manifest.segments.is_empty()),
    }
});
