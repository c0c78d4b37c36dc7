//! A bounds-checked cursor over untrusted bytes, for the storage and wire
//! forms.

/// A cursor over untrusted bytes; every read is bounds-checked.
pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, tail) = self.0.split_first_chunk::<N>()?;
        self.0 = tail;
        Some(*head)
    }
    pub(super) fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    pub(super) fn i64_le(&mut self) -> Option<i64> {
        self.take().map(i64::from_le_bytes)
    }
    pub(super) fn i32_le(&mut self) -> Option<i32> {
        self.take().map(i32::from_le_bytes)
    }
    pub(super) fn i64_be(&mut self) -> Option<i64> {
        self.take().map(i64::from_be_bytes)
    }
    pub(super) fn i32_be(&mut self) -> Option<i32> {
        self.take().map(i32::from_be_bytes)
    }
    pub(super) fn u32_be(&mut self) -> Option<u32> {
        self.take().map(u32::from_be_bytes)
    }
}
