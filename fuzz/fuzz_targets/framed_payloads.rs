//! Arbitrary payloads inside valid frames: the first input byte picks the format version (2 or 3),
//! the rest is split into payloads (each chunk's length is its first byte × 4), each framed with a
//! correct crc in one segment, so that decoding (payload counts, id widths, text entries, backward
//! text references, bincode or hand-decoded fields) is reached without the crc gate stopping the
//! fuzzer. Nothing may panic or read out of bounds while decoding any
//! record (that no wrong data comes back is what the proptests of tests/store_format.rs check).
#![no_main]

use libfuzzer_sys::fuzz_target;
use stepppo::store::{scan_segment, SEGMENT_MAGIC};

fn segment(data: &[u8]) -> Vec<u8> {
    let (version, mut rest) = match data.split_first() {
        Some((&pick, rest)) => (2 + u32::from(pick & 1), rest),
        None => (2, data),
    };
    let mut out = SEGMENT_MAGIC.to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    while let Some((&len, tail)) = rest.split_first() {
        let take = (len as usize * 4).min(tail.len() / 4 * 4);
        let (payload, next) = tail.split_at(take);
        let len_field = (payload.len() as u32).to_le_bytes();
        let mut crc = crc32fast::Hasher::new();
        crc.update(&len_field);
        crc.update(payload);
        out.extend_from_slice(b"STPF");
        out.extend_from_slice(&len_field);
        out.extend_from_slice(&crc.finalize().to_le_bytes());
        out.extend_from_slice(payload);
        rest = if take == 0 { &[] } else { next };
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let bytes = segment(data);
    let scan = scan_segment(&bytes);
    for frame in &scan.frames {
        if let Ok(record) = scan.view(&bytes, frame).to_record() {
            std::hint::black_box(record);
        }
    }
});
