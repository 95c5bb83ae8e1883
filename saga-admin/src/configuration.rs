//! The configuration page (`docs/guide/configuration.md`), generated from the settings' declarations: every
//! setting of a service, of the relay and of the `saga` command appears once, with its flag, default, the
//! programs that read it, and its doc. A test fails when the page and the declarations differ.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use clap::{Args, Command};
use outbox_relay::{DatabaseArgs, KafkaArgs, OutboxArgs, RelayArgs, RetentionArgs, SchemaArgs};
use saga_consumer::settings::{ConsumerArgs, FastPathArgs, ServiceArgs};
use saga_runtime::settings::Documented;
use saga_runtime::settings::documented;
use saga_runtime::settings::documented_group;

/// The environment variables every argument of `command` (and of its subcommands) reads.
fn variables(command: &Command) -> BTreeSet<String> {
    let mut found: BTreeSet<String> = documented(command).into_iter().map(|d| d.env).collect();
    for sub in command.get_subcommands() {
        found.extend(variables(sub));
    }
    found
}

/// The page, in Markdown.
pub fn page() -> String {
    let service = variables(&ServiceArgs::augment_args(Command::new("service")));
    let relay = variables(&outbox_relay::command());
    let saga = variables(&crate::command());
    let applies = |env: &str| {
        let mut to = Vec::new();
        if service.contains(env) {
            to.push("service");
        }
        if relay.contains(env) {
            to.push("relay");
        }
        if saga.contains(env) {
            to.push("`saga`");
        }
        to.join(", ")
    };
    let mut page = String::from(
        "# Configuration\n\n\
         Every setting is an environment variable, and a flag of the programs that read it (`--help`); a \
         missing required setting is an error naming the variable, with exit code 2: there are no silent \
         defaults for what must be chosen. *Applies to*: **service**, a `SagaService` (from \
         `SagaServiceBuilder::from_env`, or a binary that flattens `saga_consumer::settings::ServiceArgs`); \
         **relay**, the `outbox-relay` binary; **`saga`**, the operators' command.\n\n\
         This page is generated from the settings' declarations (`saga_consumer::settings`, \
         `outbox_relay`'s settings groups, the `saga` command); `cargo test -p saga-admin --test \
         configuration_page` fails when they differ, and with `SAGA_UPDATE_DOCS=1` writes it.\n",
    );
    for (title, note, docs) in &sections() {
        let _ = write!(page, "\n## {title}\n\n");
        if !note.is_empty() {
            let _ = write!(page, "{note}\n\n");
        }
        page.push_str(
            "| variable | flag | default | applies to | meaning |\n|---|---|---|---|---|\n",
        );
        for d in docs {
            let _ = writeln!(page, "{}", row(d, &applies(&d.env)));
        }
    }
    page.push_str(
        "\n## Tracing (feature `otel`)\n\n\
         `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER`, `OTEL_SDK_DISABLED`: \
         OpenTelemetry's own variables (see [Tracing](tracing.md)). `RUST_LOG` filters log lines.\n",
    );
    page
}

/// One setting's row of the page, `applies` naming the programs that read it.
fn row(d: &Documented, applies: &str) -> String {
    format!(
        "| `{}` | {} | {} | {} | {} |",
        d.env,
        if d.flag.is_empty() {
            "— (environment only)".to_owned()
        } else {
            format!("`{}`", d.flag)
        },
        if d.default == "—" {
            "—".to_owned()
        } else {
            format!("`{}`", d.default)
        },
        applies,
        d.doc.replace('|', "\\|")
    )
}

/// A section of the page: its title, a note, its settings.
type Section = (&'static str, &'static str, Vec<Documented>);

/// The page's sections, in order: each group's settings once, where they belong.
fn sections() -> Vec<Section> {
    let envs =
        |docs: &[Documented]| -> BTreeSet<String> { docs.iter().map(|d| d.env.clone()).collect() };
    let retention = documented_group::<RetentionArgs>();
    let relay_own: Vec<Documented> = {
        let retained = envs(&retention);
        documented_group::<RelayArgs>()
            .into_iter()
            .filter(|d| !retained.contains(&d.env))
            .collect()
    };
    let mut shown: Vec<Section> = vec![
        (
            "The database and the broker",
            "TLS and SASL to the broker are settings of their own ([connecting to your clusters](connecting.md) \
             has worked examples); any other librdkafka property is set with `KAFKA_PROPERTY_{NAME}` \
             (`KAFKA_PROPERTY_SSL_ENDPOINT_IDENTIFICATION_ALGORITHM=none` sets \
             `ssl.endpoint.identification.algorithm`), applied after them.",
            [
                documented_group::<DatabaseArgs>(),
                documented_group::<SchemaArgs>(),
                documented_group::<KafkaArgs>(),
            ]
            .concat(),
        ),
        ("The consumer", "", documented_group::<ConsumerArgs>()),
        (
            "The outbox",
            "Every process of a schema (its services and its relays) has the same.",
            documented_group::<OutboxArgs>(),
        ),
        (
            "The relay (embedded in a service, or `outbox-relay run`)",
            "A service's embedded relay and `outbox-relay run` read the same settings.",
            relay_own,
        ),
        (
            "Retention (the relay, embedded or not, and `outbox-relay gc`)",
            "",
            retention,
        ),
        (
            "The Redis fast path (feature `redis`)",
            "",
            documented_group::<FastPathArgs>(),
        ),
    ];
    let grouped: BTreeSet<String> = shown.iter().flat_map(|(_, _, d)| envs(d)).collect();
    let service_own: Vec<Documented> = documented_group::<ServiceArgs>()
        .into_iter()
        .filter(|d| !grouped.contains(&d.env))
        .collect();
    shown.insert(5, ("A service", "", service_own));
    let grouped: BTreeSet<String> = shown.iter().flat_map(|(_, _, d)| envs(d)).collect();
    let mut saga_own: Vec<Documented> = Vec::new();
    collect_unlisted(&crate::command(), &grouped, &mut saga_own);
    shown.push(("The `saga` command and its inspector", "", saga_own));
    shown
}

fn collect_unlisted(command: &Command, listed: &BTreeSet<String>, into: &mut Vec<Documented>) {
    for d in documented(command) {
        if !listed.contains(&d.env) && !into.iter().any(|seen| seen.env == d.env) {
            into.push(d);
        }
    }
    for sub in command.get_subcommands() {
        collect_unlisted(sub, listed, into);
    }
}
