#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| saga_fuzz::admin_input(data));
