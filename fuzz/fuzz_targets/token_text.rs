//! Arbitrary bytes; when they are UTF-8, parsed as both token kinds. See
//! `streampos_fuzz::checks::check_text_input`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    streampos_fuzz::checks::check_text_input(data);
});
