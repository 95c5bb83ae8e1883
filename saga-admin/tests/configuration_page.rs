//! The configuration page is generated from the settings' declarations, and every program's command line
//! is valid.

#[test]
fn the_configuration_page_is_generated_from_the_settings_declarations() {
    let page = saga_admin::configuration::page();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/guide/configuration.md"
    );
    if std::env::var_os("SAGA_UPDATE_DOCS").is_some() {
        std::fs::write(path, &page).unwrap();
    }
    let on_disk = std::fs::read_to_string(path).unwrap();
    assert!(
        on_disk == page,
        "docs/guide/configuration.md differs from the settings' declarations: \
         SAGA_UPDATE_DOCS=1 cargo test -p saga-admin --test configuration_page"
    );
    // Every setting of every program appears, once.
    for var in [
        "SAGA_KEY_RETENTION_HOURS",
        "RELAY_PUBLISHED_RETENTION_HOURS",
        "RELAY_GC_BATCH_SIZE",
        "SAGA_ABANDONED_LEASE_HOURS",
        "REDIS_URL",
        "SAGA_CREATE_TOPICS",
        "SAGA_ACCEPT_KEY_EXPIRY",
        "SAGA_ADMIN_TOKENS",
    ] {
        assert_eq!(
            page.matches(&format!("| `{var}` |")).count(),
            1,
            "{var} once in the page"
        );
    }
    // Retention applies to services (their embedded relay) and to the relay binary alike.
    let line = page
        .lines()
        .find(|l| l.starts_with("| `SAGA_KEY_RETENTION_HOURS` |"))
        .unwrap();
    assert!(line.contains("service, relay"), "{line}");
}

#[test]
fn every_programs_command_line_is_valid() {
    outbox_relay::command().debug_assert();
    saga_admin::command().debug_assert();
    <saga_consumer::settings::ServiceArgs as clap::Args>::augment_args(clap::Command::new(
        "service",
    ))
    .debug_assert();
}

/// The code of `crates` (directories beside this crate): comments, test modules and the functions that only
/// check settings (`fn problems`) left out. Reading a setting to refuse a bad value, naming it in a doc or
/// reading it in a test is not using it.
fn code(crates: &[&str]) -> String {
    fn walk(dir: &std::path::Path, into: &mut String) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, into);
            } else if path.extension().is_some_and(|e| e == "rs") {
                into.push_str(&code_of(&std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    let mut all = String::new();
    for name in crates {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(name)
            .join("src");
        walk(&dir, &mut all);
    }
    all
}

/// `text` without comments, its test items (`#[cfg(test)]` on its own line at the left margin, and the
/// item it marks, up to the closing brace at the margin) and the bodies of its `fn problems` and `fn fmt` (a `Debug` that shows every field),
/// up to the closing brace at the function's indentation.
fn code_of(text: &str) -> String {
    let mut kept = String::new();
    let mut skipping: Option<String> = None;
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line == "#[cfg(test)]" {
            // The item it marks: a module's body up to its closing brace, or one line.
            if lines
                .next()
                .is_some_and(|item| item.trim_end().ends_with('{'))
            {
                skipping = Some("}".to_owned());
            }
            continue;
        }
        if let Some(end) = &skipping {
            if line == end {
                skipping = None;
            }
            continue;
        }
        if line.trim_start().starts_with("//") {
            continue;
        }
        if let Some(at) = line.find("fn problems(").or_else(|| line.find("fn fmt("))
            && line.trim_end().ends_with('{')
        {
            let indent: String = line[..at]
                .chars()
                .take_while(|c| c.is_whitespace())
                .collect();
            skipping = Some(format!("{indent}}}"));
            continue;
        }
        kept.push_str(line);
        kept.push('\n');
    }
    kept
}

/// The names the code gives a settings group where it reads one (a variable, a field, a flattened group).
const SETTINGS_RECEIVERS: &[&str] = &[
    "settings",
    "args",
    "consumer",
    "retry",
    "relay",
    "retention",
    "outbox",
    "fast_path",
    "redis",
    "kafka",
    "database",
    "saga",
    "service",
];

/// Whether `code` reads field `field`: `.field` not followed by more of a name, a call or an assignment;
/// with `from`, only of a receiver so named (`settings.field`, `self.args.field`).
fn reads(code: &str, field: &str, from: Option<&[&str]>) -> bool {
    let needle = format!(".{field}");
    code.match_indices(&needle).any(|(at, _)| {
        if let Some(names) = from {
            let receiver: String = code[..at]
                .chars()
                .rev()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            if !names.contains(&receiver.as_str()) {
                return false;
            }
        }
        let rest = &code[at + needle.len()..];
        if rest
            .chars()
            .next()
            .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '(')
        {
            return false;
        }
        let rest = rest.trim_start();
        !rest.starts_with('=') || rest.starts_with("==")
    })
}

/// The names of the fields of `code`'s structs other than the settings groups (`…Args`, `RetryPolicy`): a
/// setting whose field shares a name with one of them could be "read" by a read of that other struct's field.
fn other_fields(code: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut inside: Option<String> = None;
    for line in code.lines() {
        if let Some(end) = &inside {
            if line == end {
                inside = None;
            } else if let Some(name) = field_declared(line) {
                names.insert(name.to_owned());
            }
            continue;
        }
        let trimmed = line.trim_start();
        let Some(at) = trimmed.find("struct ") else {
            continue;
        };
        let name: String = trimmed[at + 7..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let settings = name.ends_with("Args") || name == "RetryPolicy";
        if trimmed[..at]
            .split_whitespace()
            .all(|w| w.starts_with("pub"))
            && trimmed.trim_end().ends_with('{')
            && !settings
        {
            let indent = &line[..line.len() - trimmed.len()];
            inside = Some(format!("{indent}}}"));
        }
    }
    names
}

/// The field a line of a struct's body declares (`pub(crate) name: Type,`), if it declares one.
fn field_declared(line: &str) -> Option<&str> {
    let line = line.trim_start();
    let line = match line.strip_prefix("pub") {
        Some(rest) if rest.starts_with('(') => rest.split_once(')')?.1.trim_start(),
        Some(rest) if rest.starts_with(' ') => rest.trim_start(),
        _ => line,
    };
    let (name, _) = line.split_once(':')?;
    (!name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_')).then_some(name)
}

/// The fields `command`'s settings are declared by (an id said apart, `relay_batch_size`, is the field
/// `batch_size` of the relay's group), with their variables.
fn fields(command: &clap::Command) -> Vec<(String, String)> {
    command
        .get_arguments()
        .filter_map(|arg| {
            let env = arg.get_env()?.to_string_lossy().into_owned();
            let id = arg.get_id().as_str();
            Some((env, id.strip_prefix("relay_").unwrap_or(id).to_owned()))
        })
        .collect()
}

/// Every declared setting is read by the code of the crate that uses it: a setting declared and read
/// nowhere (a forgotten use, which a default would have hidden) fails here, naming it. The settings are
/// the fields of their groups, so a use is a read of the field (`.batch_size`): a service's own settings
/// (`ConsumerArgs`, `RetryPolicy`, `ServiceArgs`'s) in `saga-consumer`, the relay's (its command's, which
/// a service flattens too) in `outbox-relay` and `saga-runtime`. A setting whose field name another struct
/// of that code also has (`revoke_timeout`, also the poll loop's `Dispatcher`'s) counts only a read from a
/// settings group by its usual name (`settings.revoke_timeout`), or its group's accessor called: a read of the
/// other struct's field does not pass for it.
#[test]
fn every_declared_setting_is_read_where_it_is_used() {
    use clap::Args;
    let relay = outbox_relay::command();
    let mut relays = fields(&relay);
    for sub in relay.get_subcommands() {
        relays.extend(fields(sub));
    }
    let service = fields(&saga_consumer::settings::ServiceArgs::augment_args(
        clap::Command::new("service"),
    ));
    let own: Vec<_> = service
        .into_iter()
        .filter(|(env, _)| !relays.iter().any(|(e, _)| e == env))
        .collect();
    let consumer_code = code(&["saga-consumer"]);
    let relay_code = code(&["outbox-relay", "saga-runtime"]);
    let mut unread: Vec<String> = Vec::new();
    for (settings, code) in [(&own, &consumer_code), (&relays, &relay_code)] {
        let others = other_fields(code);
        for (env, field) in settings {
            // A field another struct also has counts only when read from a settings group by its usual
            // name (`settings.revoke_timeout`, not `self.dispatcher.revoke_timeout`).
            // Or read by the group's accessor of the same name (`fn dlq_topic(&self)`), which is called.
            let from = others.contains(field).then_some(SETTINGS_RECEIVERS);
            let accessor = code.contains(&format!("fn {field}(&self)"))
                && reads(code, field, Some(&["self"]))
                && code.contains(&format!(".{field}()"));
            if !reads(code, field, from) && !accessor {
                unread.push(format!("{env} ({field})"));
            }
        }
    }
    assert!(
        own.len() > 25 && relays.len() > 20,
        "the settings were found: {} and {}",
        own.len(),
        relays.len()
    );
    assert!(unread.is_empty(), "declared and read nowhere: {unread:?}");
    let structs = "pub(crate) struct Dispatcher {\n    revoke_timeout: Duration,\n    pub(crate) lanes: u8,\n}\n\
                   pub struct ConsumerArgs {\n    pub batch_size: usize,\n}\n";
    assert_eq!(
        other_fields(structs).into_iter().collect::<Vec<_>>(),
        ["lanes", "revoke_timeout"]
    );
    // What is not a use: a declaration, a write, a call of a method of the same name, a doc, a check, a test.
    let not_used = "pub batch_size: usize,\nself.args.batch_size = 1;\nb.batch_size(3);\n\
                    /// `x.batch_size`\n    fn problems(&self) -> bool {\n        self.batch_size > 0\n    }\n\
                    #[cfg(test)]\nmod tests {\n    fn t() { let _ = a.batch_size; }\n}\n";
    assert!(!reads(&code_of(not_used), "batch_size", None));
    assert!(reads(
        &code_of("if self.args.batch_size == 1 {}"),
        "batch_size",
        None
    ));
    let dispatcher = code_of("let wait = self.dispatcher.revoke_timeout;");
    assert!(reads(&dispatcher, "revoke_timeout", None));
    assert!(!reads(
        &dispatcher,
        "revoke_timeout",
        Some(SETTINGS_RECEIVERS)
    ));
    assert!(reads(
        &code_of("let wait = settings.revoke_timeout;"),
        "revoke_timeout",
        Some(SETTINGS_RECEIVERS)
    ));
}
