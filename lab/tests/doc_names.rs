//! Every name the guide (`docs/guide/*.md`) and `ARCHITECTURE.md` put in backticks exists: a setting is
//! declared by a program (or read by name in the code), a flag is one of a program's, a Rust path resolves
//! to a module, item, method or variant of the workspace, a type name is defined, a file path is a file or
//! directory of the repository (in ARCHITECTURE, a bare file name is one of the crate its section
//! describes). Names of other projects are listed below, each with what it is. A stale word fails this
//! test with the document and the name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command as Process;

use clap::{Args, Command};
use regex::Regex;

/// Crates whose paths the documents may name without this repository defining them.
const EXTERNAL_CRATES: &[&str] = &[
    "std",
    "core",
    "tower",
    "tokio",
    "sqlx",
    "rdkafka",
    "axum",
    "http",
    "serde",
    "serde_json",
    "clap",
    "opentelemetry",
    "opentelemetry_sdk",
    "tracing",
    "tracing_subscriber",
    "prometheus_client",
];

/// Type names of other projects and protocols that the documents name.
const EXTERNAL_NAMES: &[(&str, &str)] = &[
    ("BaseConsumer", "rdkafka's consumer"),
    (
        "TraceContextPropagator",
        "opentelemetry_sdk's W3C propagator",
    ),
    ("Origin", "an HTTP request header"),
    ("Referer", "an HTTP request header"),
    ("Secure", "a cookie attribute"),
    ("Debug", "Rust's formatting trait"),
];

/// Settings that other software reads.
const EXTERNAL_SETTINGS: &[(&str, &str)] = &[
    (
        "TCP_NODELAY",
        "a TCP socket option (the database connections set it)",
    ),
    ("RUST_LOG", "tracing-subscriber's filter"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "the OpenTelemetry SDK"),
    ("OTEL_SDK_DISABLED", "the OpenTelemetry SDK"),
    ("OTEL_SERVICE_NAME", "the OpenTelemetry SDK"),
    ("OTEL_TRACES_SAMPLER", "the OpenTelemetry SDK"),
];

/// Words of other software that the documents name.
const EXTERNAL_WORDS: &[(&str, &str)] = &[(
    "pg_snapshot_xmin",
    "a PostgreSQL function (the ordering scheme ARCHITECTURE says was not chosen)",
)];

/// Variables only tests read, that the documents tell developers of.
const TEST_SWITCHES: &[&str] = &["SAGA_UPDATE_DOCS"];

/// Flags of other programs (cargo) that the documents show.
const EXTERNAL_FLAGS: &[&str] = &[
    "--bin",
    "--doc",
    "--test",
    "--workspace",
    "--locked",
    "--check",
    "--path",
    "--profile",
];

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The repository's files (relative paths, `/`-separated), the build directory and git's left out.
fn files(root: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            // A vendored crate's names are not this project's.
            if name == "target" || name == "vendor" || name.starts_with('.') {
                continue;
            }
            let relative = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            if path.is_dir() {
                out.push(format!("{relative}/"));
                walk(root, &path, out);
            } else {
                out.push(relative);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out
}

/// What the workspace's Rust source defines, read with patterns (a lint, not a compiler).
struct Source {
    /// `(relative path, text)` of every `.rs` file.
    files: Vec<(String, String)>,
    /// Every name a file defines (item, module, variant, re-export, derive) or reads as a string literal.
    defined: BTreeSet<String>,
    /// Every string literal of the form `NAME_NAME`: variables the code reads by name.
    literals: BTreeSet<String>,
    /// Every string literal of the form `NAME_`: prefixes of variables the code reads (`KAFKA_PROPERTY_`).
    prefixes: BTreeSet<String>,
    /// The variables the tests read by name (switches such as `SAGA_UPDATE_DOCS`).
    test_literals: BTreeSet<String>,
}

impl Source {
    fn read(root: &Path, all: &[String]) -> Self {
        let item = Regex::new(
            r"\b(?:struct|enum|trait|type|fn|union|mod|const|static|macro_rules!)\s+([A-Za-z_][A-Za-z0-9_]*)",
        )
        .unwrap();
        let variant = Regex::new(r"(?m)^\s*([A-Z][A-Za-z0-9]*)\s*(?:\(|\{|,|=|$)").unwrap();
        let alias = Regex::new(r"\bas\s+([A-Za-z_][A-Za-z0-9_]*)").unwrap();
        let derive = Regex::new(r"proc_macro_derive\(\s*([A-Za-z_][A-Za-z0-9_]*)").unwrap();
        let literal = Regex::new(r#""([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)""#).unwrap();
        let prefix = Regex::new(r#""([A-Z][A-Z0-9_]*_)""#).unwrap();
        let mut prefixes = BTreeSet::new();
        let mut test_literals = BTreeSet::new();
        let mut files = Vec::new();
        let mut defined = BTreeSet::new();
        let mut literals = BTreeSet::new();
        for path in all.iter().filter(|p| p.ends_with(".rs")) {
            let text = std::fs::read_to_string(root.join(path)).unwrap();
            for pattern in [&item, &variant, &alias, &derive] {
                defined.extend(pattern.captures_iter(&text).map(|c| c[1].to_owned()));
            }
            // What the code reads, apart from what a test names.
            if path.contains("/tests/") {
                test_literals.extend(literal.captures_iter(&text).map(|c| c[1].to_owned()));
            } else {
                literals.extend(literal.captures_iter(&text).map(|c| c[1].to_owned()));
                prefixes.extend(prefix.captures_iter(&text).map(|c| c[1].to_owned()));
            }
            files.push((path.clone(), text));
        }
        Source {
            files,
            defined,
            literals,
            prefixes,
            test_literals,
        }
    }

    /// The files of the crate named `name` (`saga_consumer`), if it is one of the workspace's.
    fn crate_dir(name: &str) -> Option<&'static str> {
        Some(match name {
            "saga_core" => "saga-core/",
            "saga_config" => "saga-config/",
            "saga_macros" => "saga-macros/",
            "saga_consumer" => "saga-consumer/",
            "saga_runtime" => "saga-runtime/",
            "saga_orchestrator" => "saga-orchestrator/",
            "saga_admin" => "saga-admin/",
            "saga_test_support" => "saga-test-support/",
            "saga_testing" => "saga-testing/",
            "outbox_relay" => "outbox-relay/",
            "saga_examples" => "examples/",
            "saga_lab" => "lab/",
            _ => return None,
        })
    }

    /// The directories of the crate named `name`, and of the crates it re-exports whole
    /// (`pub use saga_core::*`): where its items are. Empty for a name that is no crate of the workspace.
    fn crate_dirs(&self, name: &str) -> Vec<&'static str> {
        let Some(dir) = Self::crate_dir(name) else {
            return Vec::new();
        };
        let glob = Regex::new(r"pub use ([a-z_]+)::\*;").unwrap();
        let mut dirs = vec![dir];
        dirs.extend(
            self.files
                .iter()
                .filter(|(p, _)| p.starts_with(dir))
                .flat_map(|(_, text)| {
                    glob.captures_iter(text)
                        .map(|c| c[1].to_owned())
                        .collect::<Vec<_>>()
                })
                .filter_map(|other| Self::crate_dir(&other)),
        );
        dirs
    }

    /// The files that make up module `name` (`store` is `…/store.rs` and `…/store/*`) within the crate
    /// directories `within` (anywhere when empty), or the whole crate for a crate's name.
    fn module_files(&self, name: &str, within: &[&str]) -> Vec<&(String, String)> {
        let dirs = self.crate_dirs(name);
        if !dirs.is_empty() {
            return self
                .files
                .iter()
                .filter(|(p, _)| dirs.iter().any(|d| p.starts_with(d)))
                .collect();
        }
        let file = format!("/{name}.rs");
        let dir = format!("/{name}/");
        let inline = Regex::new(&format!(r"\bmod\s+{name}\s*\{{")).unwrap();
        self.files
            .iter()
            .filter(|(p, _)| within.is_empty() || within.iter().any(|d| p.starts_with(d)))
            .filter(|(p, text)| p.ends_with(&file) || p.contains(&dir) || inline.is_match(text))
            .collect()
    }

    /// Whether `member` is defined, declared or re-exported (`pub use`) among `files`.
    fn has_member(files: &[&(String, String)], member: &str) -> bool {
        let pattern = Regex::new(&format!(
            r"(?m)\b(?:struct|enum|trait|type|fn|union|mod|const|static)\s+{member}\b|\bpub(?:\([a-z]+\))?\s+use\s[^;]*\b{member}\b|^\s*{member}\s*(?:\(|\{{|,|=|$)"
        ))
        .unwrap();
        files.iter().any(|(_, text)| pattern.is_match(text))
    }

    /// Whether type or trait `name` has `member`: a method, associated item, variant or field in its
    /// definition or one of its `impl` blocks.
    fn type_has(&self, name: &str, member: &str) -> Option<bool> {
        let header = Regex::new(&format!(
            r"\b(?:struct|enum|trait|union)\s+{name}\b[^{{;]*\{{|\bimpl\b[^{{;]*\b{name}\b[^{{;]*\{{"
        ))
        .unwrap();
        let inside = Regex::new(&format!(
            r"(?m)\b(?:fn|const|type)\s+{member}\b|^\s*(?:pub(?:\([a-z]+\))?\s+)?{member}\s*(?::|\(|\{{|,|=|$)"
        ))
        .unwrap();
        let mut any = false;
        for (_, text) in &self.files {
            for found in header.find_iter(text) {
                any = true;
                if inside.is_match(block(text, found.end() - 1)) {
                    return Some(true);
                }
            }
        }
        any.then_some(false)
    }

    /// Why the path `a::b::c` does not resolve, if it does not.
    fn unresolved(&self, path: &str) -> Option<String> {
        let segments: Vec<&str> = path.split("::").collect();
        if EXTERNAL_CRATES.contains(&segments[0]) {
            return None;
        }
        if !self.defined.contains(segments[0]) && Self::crate_dir(segments[0]).is_none() {
            return Some(format!("`{}` is not defined", segments[0]));
        }
        // A path that starts with a crate's name stays in that crate (and what it re-exports whole).
        let within = self.crate_dirs(segments[0]);
        for pair in segments.windows(2) {
            let (outer, member) = (pair[0], pair[1]);
            if outer.starts_with(char::is_uppercase) {
                match self.type_has(outer, member) {
                    None => return Some(format!("`{outer}` is not defined")),
                    Some(false) => return Some(format!("`{outer}` has no `{member}`")),
                    Some(true) => continue,
                }
            }
            let scope = self.module_files(outer, &within);
            if scope.is_empty() {
                return Some(format!("`{outer}` is neither a module nor a type"));
            }
            let submodule = scope.iter().any(|(p, _)| {
                p.ends_with(&format!("/{outer}/{member}.rs"))
                    || p.contains(&format!("/{outer}/{member}/"))
            });
            if !submodule && !Self::has_member(&scope, member) {
                return Some(format!("`{outer}` has no `{member}`"));
            }
        }
        None
    }
}

/// Every long flag and environment variable of `command` and its subcommands.
fn declared(command: &Command, flags: &mut BTreeSet<String>, vars: &mut BTreeSet<String>) {
    for arg in command.get_arguments() {
        if let Some(long) = arg.get_long() {
            flags.insert(format!("--{long}"));
        }
        if let Some(env) = arg.get_env() {
            vars.insert(env.to_string_lossy().into_owned());
        }
    }
    for sub in command.get_subcommands() {
        declared(sub, flags, vars);
    }
}

/// The programs' flags and variables: the `saga` command, `outbox-relay`, a service (the framework's and the
/// example's settings) and the lab's programs (from their `--help`).
fn programs() -> (BTreeSet<String>, BTreeSet<String>) {
    let mut flags = BTreeSet::from(["--help".to_owned(), "--version".to_owned()]);
    let mut vars = BTreeSet::new();
    for command in [
        saga_admin::command(),
        outbox_relay::command(),
        saga_examples::service::ServiceArgs::augment_args(Command::new("example-service")),
    ] {
        declared(&command, &mut flags, &mut vars);
    }
    let flag = Regex::new(r"--[a-z][a-z0-9-]*").unwrap();
    let env = Regex::new(r"\[env: ([A-Z0-9_]+)=").unwrap();
    for program in [
        env!("CARGO_BIN_EXE_saga-bench"),
        env!("CARGO_BIN_EXE_saga-demo"),
        env!("CARGO_BIN_EXE_chaos"),
    ] {
        let help = Process::new(program).arg("--help").output().unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        flags.extend(flag.find_iter(&help).map(|m| m.as_str().to_owned()));
        vars.extend(env.captures_iter(&help).map(|c| c[1].to_owned()));
    }
    (flags, vars)
}

/// The spans a document puts in backticks outside its fenced blocks, each with its offset, and the text of
/// its YAML blocks (alert rules: the names they define).
fn spans(text: &str) -> (Vec<(usize, String)>, String, String) {
    // The fenced blocks blanked out (offsets kept), and kept aside.
    let mut prose = String::with_capacity(text.len());
    let mut fenced = String::new();
    let mut in_fence = false;
    let mut yaml = false;
    let mut sh = false;
    let mut shell = String::new();
    for line in text.split_inclusive('\n') {
        let fence = line.trim_start().starts_with("```");
        if fence && !in_fence {
            yaml = line.trim_start().starts_with("```yaml");
            sh = line.trim_start().starts_with("```sh");
        }
        if fence || in_fence {
            if !fence && yaml {
                fenced.push_str(line);
            }
            if !fence && sh {
                shell.push_str(line);
            }
            prose.extend(line.chars().map(|c| if c == '\n' { c } else { ' ' }));
            prose.extend(std::iter::repeat_n(' ', line.len() - line.chars().count()));
        } else {
            prose.push_str(line);
        }
        if fence {
            in_fence = !in_fence;
        }
    }
    // A span may wrap onto the next line.
    let span = Regex::new(r"`([^`]+)`").unwrap();
    let spans = span
        .captures_iter(&prose)
        .map(|c| (c.get(0).unwrap().start(), c[1].replace('\n', " ")))
        .collect();
    (spans, fenced, shell)
}

/// The crate directory each ARCHITECTURE section describes (`### \`saga-consumer\`: …`), by the offset it
/// starts at; `None` for a section about no one crate.
fn section_dirs(text: &str) -> Vec<(usize, Option<String>)> {
    let heading = Regex::new(r"(?m)^#{2,} (?:`([a-z-]+)`)?").unwrap();
    heading
        .captures_iter(text)
        .map(|c| {
            let dir = c.get(1).map(|name| match name.as_str() {
                "examples" => "examples/".to_owned(),
                "lab" => "lab/".to_owned(),
                other => format!("{other}/"),
            });
            (c.get(0).unwrap().start(), dir)
        })
        .collect()
}

#[test]
fn every_name_the_guide_and_architecture_put_in_backticks_exists() {
    let root = root();
    let all = files(&root);
    let source = Source::read(&root, &all);
    let (flags, vars) = programs();

    let setting = Regex::new(r"^([A-Z][A-Z0-9]*(?:_[A-Z0-9{}]+)+)(?:=.*)?$").unwrap();
    let flag = Regex::new(r"(?:^|[\s\[(])(--[a-z][a-z0-9-]*)").unwrap();
    let assignment = Regex::new(r"(?:^|\s)([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)=").unwrap();
    let path = Regex::new(r"[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)+").unwrap();
    let type_name = Regex::new(r"^([A-Z][a-z][A-Za-z0-9]*)(?:<[^>]*>)?(?:\(.*\))?$").unwrap();
    // Generic arguments and turbofish are not path segments.
    let generics = Regex::new(r"::<[^>]*>|<[^>]*>").unwrap();
    let word = Regex::new(r"^\.?([a-z_][a-z0-9_]*)(\(.*\))?$").unwrap();
    let words = code_words(&root, &all);
    let metric_prefixes: Vec<String> = Regex::new(r#"sub_registry_with_prefix\("([a-z_]+)"\)"#)
        .unwrap()
        .captures_iter(
            &source
                .files
                .iter()
                .map(|(_, t)| t.as_str())
                .collect::<String>(),
        )
        .map(|c| c[1].to_owned())
        .collect();
    assert!(!metric_prefixes.is_empty());
    let file = Regex::new(r"^[\w./-]*(?:/|\.(?:rs|md|sql|toml|sh|json|ya?ml|png))$").unwrap();

    let mut documents: Vec<String> = all
        .iter()
        .filter(|p| p.starts_with("docs/guide/") && p.ends_with(".md"))
        .cloned()
        .collect();
    documents.push("ARCHITECTURE.md".to_owned());
    documents.push("README.md".to_owned());
    // A vendored crate's README speaks of that crate, not of this project.
    documents.extend(
        all.iter()
            .filter(|p| {
                p.ends_with("/README.md") && !p.starts_with("docs/") && !p.starts_with("vendor/")
            })
            .cloned(),
    );
    let mut checked = 0;
    let mut wrong = Vec::new();
    for document in &documents {
        let text = std::fs::read_to_string(root.join(document)).unwrap();
        let (spans, fenced, shell) = spans(&text);
        // The commands of shell blocks: their flags (after `--`, for `cargo run`) and the variables they set.
        for line in shell.lines() {
            let command = line.split_once(" -- ").map_or(line, |(_, ours)| ours);
            let command = if line.contains("cargo ") && !line.contains(" -- ") {
                ""
            } else {
                command
            };
            for c in flag.captures_iter(command) {
                checked += 1;
                let name = &c[1];
                if !flags.contains(name) && !EXTERNAL_FLAGS.contains(&name) {
                    wrong.push(format!(
                        "{document}: `{line}`: no program has the flag {name}"
                    ));
                }
            }
            for c in assignment.captures_iter(line) {
                checked += 1;
                let name = &c[1];
                if !vars.contains(name)
                    && !source.literals.contains(name)
                    && !EXTERNAL_SETTINGS.iter().any(|(n, _)| *n == name)
                    && !source
                        .prefixes
                        .iter()
                        .any(|prefix| name.starts_with(prefix.as_str()))
                {
                    wrong.push(format!(
                        "{document}: `{line}`: no program declares or reads {name}"
                    ));
                }
            }
        }
        let sections = section_dirs(&text);
        for (offset, span) in &spans {
            let span = span.trim();
            let mut problem = |what: String| wrong.push(format!("{document}: `{span}`: {what}"));
            if let Some(c) = setting.captures(span) {
                checked += 1;
                let name = &c[1];
                let known = vars.contains(name)
                    || source.literals.contains(name)
                    || EXTERNAL_SETTINGS.iter().any(|(n, _)| *n == name)
                    || (TEST_SWITCHES.contains(&name) && source.test_literals.contains(name))
                    || source
                        .prefixes
                        .iter()
                        .any(|prefix| name.starts_with(prefix.as_str()));
                if !known {
                    problem(format!("no program declares or reads {name}"));
                }
                continue;
            }
            for c in flag.captures_iter(span) {
                checked += 1;
                let name = &c[1];
                if !flags.contains(name) && !EXTERNAL_FLAGS.contains(&name) {
                    problem(format!("no program has the flag {name}"));
                }
            }
            let bare = generics.replace_all(span, "");
            let expanded = expand_groups(&bare);
            for candidate in expanded.iter().flat_map(|s| {
                path.find_iter(s)
                    .map(|m| m.as_str().to_owned())
                    .collect::<Vec<_>>()
            }) {
                checked += 1;
                if let Some(why) = source.unresolved(&candidate) {
                    problem(format!("{candidate}: {why}"));
                }
            }
            if let Some(c) = type_name.captures(span) {
                checked += 1;
                let name = &c[1];
                let known = source.defined.contains(name)
                    || fenced.contains(name)
                    || EXTERNAL_NAMES.iter().any(|(n, _)| *n == name);
                if !known {
                    problem(format!("{name} is not defined"));
                }
            }
            if let Some(c) = word.captures(span)
                && (c[1].contains('_') || c.get(2).is_some())
            {
                checked += 1;
                let name = &c[1];
                let metric = metric_prefixes.iter().any(|prefix| {
                    name.strip_prefix(prefix.as_str())
                        .and_then(|rest| rest.strip_prefix('_'))
                        .map(|rest| {
                            ["_total", "_bucket", "_count", "_sum"]
                                .iter()
                                .fold(rest, |r, suffix| r.strip_suffix(suffix).unwrap_or(r))
                        })
                        .is_some_and(|rest| words.contains(rest))
                });
                if !words.contains(name)
                    && !metric
                    && !EXTERNAL_WORDS.iter().any(|(n, _)| *n == name)
                {
                    problem(format!(
                        "{name} appears nowhere in the code, the SQL or the scripts"
                    ));
                }
            }
            if file.is_match(span) {
                checked += 1;
                let found = if span.contains('/') {
                    let dir = span.trim_end_matches('/');
                    all.iter().any(|p| {
                        p == span
                            || p.trim_end_matches('/') == dir
                            || p.trim_end_matches('/').ends_with(&format!("/{dir}"))
                    })
                } else {
                    // In ARCHITECTURE, a bare file name is one of the section's crate.
                    let within = sections
                        .iter()
                        .rfind(|(start, _)| start <= offset)
                        .and_then(|(_, dir)| dir.as_deref())
                        .filter(|_| document == "ARCHITECTURE.md");
                    all.iter().any(|p| {
                        (p == span || p.ends_with(&format!("/{span}")))
                            && within.is_none_or(|dir| p.starts_with(dir))
                    })
                };
                if !found {
                    problem("no such file or directory".to_owned());
                }
            }
        }
    }
    assert!(
        checked > 300,
        "only {checked} names checked: is the pattern right?"
    );
    assert!(wrong.is_empty(), "stale names:\n{}", wrong.join("\n"));
}

/// The text of the block whose `{` is at `open`, up to its matching `}` (braces in strings and comments
/// counted too: a lint's approximation).
fn block(text: &str, open: usize) -> &str {
    let mut depth = 0usize;
    for (i, c) in text[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return &text[open..open + i];
                }
            }
            _ => {}
        }
    }
    &text[open..]
}

/// Every word of the code, the SQL, the scripts and the manifests: where a function, a column, a header or
/// a metric named in the documents must appear.
fn code_words(root: &Path, all: &[String]) -> BTreeSet<String> {
    let word = Regex::new(r"[A-Za-z_][A-Za-z0-9_]*").unwrap();
    let mut words = BTreeSet::new();
    for path in all.iter().filter(|p| {
        p.ends_with(".rs")
            || p.ends_with(".sql")
            || p.ends_with(".toml")
            || p.starts_with("scripts/")
            || p.starts_with(".ci/")
    }) {
        // A file's name is a word too (a test binary is named by its file).
        if let Some(stem) = Path::new(path).file_stem() {
            words.insert(stem.to_string_lossy().into_owned());
        }
        let Ok(text) = std::fs::read_to_string(root.join(path)) else {
            continue;
        };
        words.extend(word.find_iter(&text).map(|m| m.as_str().to_owned()));
    }
    words
}

/// `a::{b, c}` as `a::b` and `a::c`.
fn expand_groups(text: &str) -> Vec<String> {
    let group = Regex::new(r"([A-Za-z0-9_:]*)::\{([^}]*)\}").unwrap();
    let mut out = vec![group.replace_all(text, "").into_owned()];
    for c in group.captures_iter(text) {
        for member in c[2].split(',') {
            let member = member.trim();
            if !member.is_empty() && member != "self" {
                out.push(format!("{}::{member}", &c[1]));
            }
        }
    }
    out
}

#[test]
fn the_checker_finds_a_stale_path_a_stale_flag_and_a_missing_file() {
    let root = root();
    let all = files(&root);
    let source = Source::read(&root, &all);
    assert!(source.unresolved("Command::of").is_some());
    assert!(source.unresolved("Command::to").is_none());
    assert!(
        source
            .unresolved("saga_consumer::setup::use_outbox")
            .is_none()
    );
    assert!(source.unresolved("saga_consumer::setup::emit_to").is_some());
    assert!(source.unresolved("store::idempotency::keys_of").is_none());
    assert!(source.unresolved("StepItem::step_key").is_some());
    // The right names through the wrong crate.
    assert!(
        source
            .unresolved("saga_consumer::settings::RetentionArgs")
            .is_none()
    );
    assert!(
        source
            .unresolved("saga_admin::settings::RetentionArgs")
            .is_some()
    );
    assert!(source.unresolved("saga_consumer::testing").is_none());
    let (flags, vars) = programs();
    assert!(flags.contains("--relay-batch-size") && !flags.contains("--mode"));
    assert!(vars.contains("SAGA_KEY_RETENTION_HOURS") && vars.contains("SAGA_ACCEPT_KEY_EXPIRY"));
}
