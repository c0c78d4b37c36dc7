//! Arbitrary bytes read as the wire form (`recv`) and the storage form
//! (`decode`) of both token kinds. See
//! `streampos_fuzz::checks::check_binary_input`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    streampos_fuzz::checks::check_binary_input(data);
});
