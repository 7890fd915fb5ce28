//! Token id arrays of a stored record: written at the narrowest width (1 to 4 little-endian
//! bytes per id) that holds the array's largest id, and read in place through [`TokenIds`], a
//! fixed-width random-access view over the mapped bytes (no sequential decoding, no copy).

use std::fmt;

/// Bytes per id needed to store every id of `ids` (1 for an empty array).
pub fn width_for(ids: &[u32]) -> usize {
    match ids.iter().fold(0, |max, &id| max.max(id)) {
        0..=0xFF => 1,
        0x100..=0xFFFF => 2,
        0x1_0000..=0xFF_FFFF => 3,
        _ => 4,
    }
}

/// Appends `ids`, `width` little-endian bytes each (`width` from [`width_for`]), to `out`.
pub fn extend_packed(out: &mut Vec<u8>, ids: &[u32], width: usize) {
    let start = out.len();
    out.resize(start + width * ids.len(), 0);
    let slots = &mut out[start..];
    match width {
        1 => pack::<1>(slots, ids),
        2 => pack::<2>(slots, ids),
        3 => pack_3(slots, ids),
        _ => pack::<4>(slots, ids),
    }
}

fn pack<const W: usize>(slots: &mut [u8], ids: &[u32]) {
    for (slot, id) in slots.chunks_exact_mut(W).zip(ids) {
        slot.copy_from_slice(&id.to_le_bytes()[..W]);
    }
}

/// 3-byte ids, four at a time as three little-endian words.
fn pack_3(slots: &mut [u8], ids: &[u32]) {
    let quads = ids.len() / 4;
    for (slot, q) in slots.chunks_exact_mut(12).zip(ids.chunks_exact(4)) {
        let words = [
            q[0] & 0xFF_FFFF | q[1] << 24,
            (q[1] >> 8) & 0xFFFF | q[2] << 16,
            (q[2] >> 16) & 0xFF | q[3] << 8,
        ];
        for (dst, w) in slot.chunks_exact_mut(4).zip(words) {
            dst.copy_from_slice(&w.to_le_bytes());
        }
    }
    pack::<3>(&mut slots[12 * quads..], &ids[4 * quads..]);
}

/// 3-byte ids, four at a time from three little-endian words.
fn fold_3<B>(bytes: &[u8], init: B, mut f: impl FnMut(B, u32) -> B) -> B {
    let word = |c: &[u8]| u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    let quads = bytes.chunks_exact(12);
    let tail = quads.remainder();
    let acc = quads.fold(init, |acc, c| {
        let [a, b, d] = [word(&c[0..4]), word(&c[4..8]), word(&c[8..12])];
        let acc = f(acc, a & 0xFF_FFFF);
        let acc = f(acc, a >> 24 | (b & 0xFFFF) << 8);
        let acc = f(acc, b >> 16 | (d & 0xFF) << 16);
        f(acc, d >> 8)
    });
    tail.chunks_exact(3)
        .fold(acc, |acc, c| f(acc, read::<3>(c)))
}

/// The id stored in the first `W` bytes of `bytes`.
#[inline(always)]
fn read<const W: usize>(bytes: &[u8]) -> u32 {
    let mut le = [0u8; 4];
    le[..W].copy_from_slice(&bytes[..W]);
    u32::from_le_bytes(le)
}

/// A token id array viewed in place: `width` little-endian bytes per id.
#[derive(Clone, Copy)]
pub struct TokenIds<'a> {
    bytes: &'a [u8],
    width: usize,
}

impl Default for TokenIds<'_> {
    /// No ids.
    fn default() -> Self {
        Self {
            bytes: &[],
            width: 1,
        }
    }
}

impl<'a> TokenIds<'a> {
    /// Views `bytes` as ids of `width` bytes (1..=4); `None` when the length does not divide.
    pub fn new(bytes: &'a [u8], width: usize) -> Option<Self> {
        ((1..=4).contains(&width) && bytes.len().is_multiple_of(width))
            .then_some(Self { bytes, width })
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.width
    }

    /// Whether there are no ids.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Bytes per stored id.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The id at position `i`.
    pub fn get(&self, i: usize) -> Option<u32> {
        let at = i.checked_mul(self.width)?;
        let bytes = self.bytes.get(at..at.checked_add(self.width)?)?;
        Some(match self.width {
            1 => read::<1>(bytes),
            2 => read::<2>(bytes),
            3 => read::<3>(bytes),
            _ => read::<4>(bytes),
        })
    }

    /// The first id; `None` when empty.
    pub fn first(&self) -> Option<u32> {
        self.get(0)
    }

    /// The last id; `None` when empty.
    pub fn last(&self) -> Option<u32> {
        self.len().checked_sub(1).and_then(|i| self.get(i))
    }

    /// The ids in order, decoded one by one.
    pub fn iter(&self) -> TokenIter<'a> {
        TokenIter { ids: *self }
    }

    /// The ids copied into a vector.
    pub fn to_vec(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len());
        out.extend(self.iter());
        out
    }

    /// The ids as a `&[u32]` over the same bytes, when stored 4 bytes wide, aligned, on a
    /// little-endian host.
    pub fn as_u32(&self) -> Option<&'a [u32]> {
        (self.width == 4 && cfg!(target_endian = "little"))
            .then(|| bytemuck::try_cast_slice(self.bytes).ok())
            .flatten()
    }

    /// The ids as a `&[u16]` over the same bytes, when stored 2 bytes wide, aligned, on a
    /// little-endian host.
    pub fn as_u16(&self) -> Option<&'a [u16]> {
        (self.width == 2 && cfg!(target_endian = "little"))
            .then(|| bytemuck::try_cast_slice(self.bytes).ok())
            .flatten()
    }
}

impl fmt::Debug for TokenIds<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl PartialEq for TokenIds<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl PartialEq<[u32]> for TokenIds<'_> {
    fn eq(&self, other: &[u32]) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter().copied())
    }
}

impl PartialEq<Vec<u32>> for TokenIds<'_> {
    fn eq(&self, other: &Vec<u32>) -> bool {
        *self == **other
    }
}

impl<'a> IntoIterator for TokenIds<'a> {
    type Item = u32;
    type IntoIter = TokenIter<'a>;

    fn into_iter(self) -> TokenIter<'a> {
        self.iter()
    }
}

impl<'a> IntoIterator for &TokenIds<'a> {
    type Item = u32;
    type IntoIter = TokenIter<'a>;

    fn into_iter(self) -> TokenIter<'a> {
        self.iter()
    }
}

/// The ids of a [`TokenIds`] in order, by value.
#[derive(Clone, Debug)]
pub struct TokenIter<'a> {
    ids: TokenIds<'a>,
}

impl TokenIter<'_> {
    fn fold_width<const W: usize, B>(self, init: B, f: impl FnMut(B, u32) -> B) -> B {
        let mut f = f;
        (self.ids.bytes.chunks_exact(W)).fold(init, |acc, c| f(acc, read::<W>(c)))
    }
}

impl Iterator for TokenIter<'_> {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        let id = self.ids.first()?;
        self.ids.bytes = &self.ids.bytes[self.ids.width..];
        Some(id)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.ids.len(), Some(self.ids.len()))
    }

    fn fold<B, F: FnMut(B, u32) -> B>(self, init: B, f: F) -> B {
        match self.ids.width {
            1 => self.fold_width::<1, B>(init, f),
            2 => self.fold_width::<2, B>(init, f),
            3 => fold_3(self.ids.bytes, init, f),
            _ => self.fold_width::<4, B>(init, f),
        }
    }
}

impl ExactSizeIterator for TokenIter<'_> {}

impl DoubleEndedIterator for TokenIter<'_> {
    fn next_back(&mut self) -> Option<u32> {
        let id = self.ids.last()?;
        self.ids.bytes = &self.ids.bytes[..self.ids.bytes.len() - self.ids.width];
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_width_round_trips_and_is_the_narrowest() {
        let cases: [(&[u32], usize); 6] = [
            (&[], 1),
            (&[0, 255], 1),
            (&[7, 65_535], 2),
            (&[151_643, 0, 9], 3),
            (&[1, 0xFF_FFFF, 0x12_3456, 4, 0xAB_CDEF, 6, 7, 8, 9], 3),
            (&[u32::MAX, 1], 4),
        ];
        for (ids, width) in cases {
            assert_eq!(width_for(ids), width, "{ids:?}");
            let mut bytes = Vec::new();
            extend_packed(&mut bytes, ids, width);
            assert_eq!(bytes.len(), ids.len() * width);
            let view = TokenIds::new(&bytes, width).unwrap();
            assert_eq!(view.to_vec(), ids);
            assert_eq!(view, *ids);
            assert_eq!(view.iter().rev().collect::<Vec<_>>().len(), ids.len());
            assert_eq!(view.last(), ids.last().copied());
            assert_eq!(view.get(ids.len()), None);
            let by_index: Vec<u32> = (0..view.len()).filter_map(|i| view.get(i)).collect();
            assert_eq!(by_index, ids);
        }
    }

    #[test]
    fn aligned_arrays_are_viewed_as_slices() {
        let words: Vec<u32> = vec![0x0102_0304, 5];
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        assert_eq!(TokenIds::new(bytes, 4).unwrap().as_u32(), Some(&words[..]));
        assert_eq!(TokenIds::new(bytes, 2).unwrap().as_u16().unwrap().len(), 4);
        assert!(TokenIds::new(bytes, 3).is_none());
        assert!(TokenIds::new(&bytes[..6], 3).unwrap().as_u32().is_none());
    }
}
