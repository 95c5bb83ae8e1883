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
