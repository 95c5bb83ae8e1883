#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| saga_fuzz::dead_letter(data));
