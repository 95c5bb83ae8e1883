//! The fuzz targets (`fuzz/`, run with `cargo +nightly fuzz run <target>`) in the stable suite: each over
//! its corpus (`fuzz/corpus/<target>`: seeds, and every input a fuzzing run found that crashed a target,
//! kept as a regression), then over mutations of it from a fixed seed. A short run; the fuzzer's are long.

#[allow(dead_code, missing_docs, unreachable_pub)]
#[path = "../../fuzz/src/lib.rs"]
mod targets;

use std::path::PathBuf;

/// A fuzz target's body.
type Target = fn(&[u8]);

/// The targets, by the name of their corpus directory.
const TARGETS: [(&str, Target); 6] = [
    ("envelope", targets::envelope),
    ("traceparent", targets::traceparent),
    ("wal_decode", targets::wal_decode),
    ("http_request", targets::http_request),
    ("admin_input", targets::admin_input),
    ("dead_letter", targets::dead_letter),
];

/// Mutations per target, of corpus entries picked at random.
const MUTATIONS: usize = 20_000;

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut inputs: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            (path, bytes)
        })
        .collect();
    inputs.sort();
    inputs.into_iter().map(|(_, bytes)| bytes).collect()
}

/// A small deterministic generator (xorshift), so that a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// `input` with a few bytes flipped, inserted (separators and ASCII favoured) or removed.
    fn mutate(&mut self, input: &[u8]) -> Vec<u8> {
        let mut out = input.to_vec();
        for _ in 0..=self.below(4) {
            let at = self.below(out.len() + 1);
            match self.below(4) {
                0 if at < out.len() => out[at] ^= 1 << self.below(8),
                1 => out.insert(at, [0xFF, b'-', b'0', b'a', b':', 0][self.below(6)]),
                2 if at < out.len() => {
                    out.remove(at);
                }
                _ => out.insert(at, self.next() as u8),
            }
        }
        out
    }
}

#[test]
fn every_fuzz_target_survives_its_corpus_and_mutations_of_it() {
    let mut rng = Rng(0x5eed_5a6a_0000_0001);
    for (name, target) in TARGETS {
        let inputs = corpus(name);
        assert!(!inputs.is_empty(), "{name} has no corpus");
        for input in &inputs {
            target(input);
        }
        for _ in 0..MUTATIONS {
            let pick = rng.below(inputs.len());
            let mutated = rng.mutate(&inputs[pick]);
            let caught = std::panic::catch_unwind(|| target(&mutated));
            assert!(
                caught.is_ok(),
                "{name} panicked on {mutated:?}: add it to fuzz/corpus/{name}, fix the target's subject"
            );
        }
        println!(
            "{name}: {} corpus entries, {MUTATIONS} mutations",
            inputs.len()
        );
    }
}
