//! Arbitrary bytes as a segment file: the scan and every view over it never panic and never
//! read out of bounds (libFuzzer runs this under AddressSanitizer).
#![no_main]

use libfuzzer_sys::fuzz_target;
use stepppo::store::scan_segment;

fuzz_target!(|data: &[u8]| {
    let scan = scan_segment(data);
    for frame in &scan.frames {
        let view = scan.view(data, frame);
        let tokens: u64 = view
            .obs_ids
            .iter()
            .chain(view.response_ids.iter())
            .map(|t| t as u64)
            .sum();
        std::hint::black_box((tokens, view.response_logprobs.len(), view.meta_view().ok()));
        std::hint::black_box(view.to_record().ok());
    }
    if let Some(footer) = scan.footer {
        std::hint::black_box(footer.entries(data).count());
        std::hint::black_box(footer.lookup(data, 0));
    }
});
