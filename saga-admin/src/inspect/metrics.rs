//! `/metrics`: the numbers to alert on, in Prometheus' text format, read from the schema (and its
//! dead-letter index) when scraped.
//!
//! - `saga_dlq_open_letters{dlq_topic, failure_group, consumer_group, step, reason}`: dead letters of a
//!   failure group neither replayed nor discarded (since the last replay or discard of the group, the
//!   letters that came after it).
//! - `saga_sagas_stuck{saga_type}`: orchestrated sagas marked stuck, or unfinished and unmoved for the
//!   inspector's `--stuck-for`.
//! - `saga_outbox_oldest_unpublished_age_seconds`, `saga_outbox_unpublished_rows`,
//!   `saga_outbox_parked_rows`: the relay's backlog.

use std::fmt::Write as _;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::App;
use crate::error::AdminError;
use crate::groups;

/// A label value escaped for the text format.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn gauge(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
}

/// The metrics of `app`'s schema and dead-letter topics.
pub(super) async fn render(app: &App) -> Result<String, AdminError> {
    let mut out = String::new();
    let topics = app.dlq_topics().await?;
    let groups = groups::groups(&app.kafka, &app.pool, &topics).await?;
    gauge(
        &mut out,
        "saga_dlq_open_letters",
        "Dead letters neither replayed nor discarded, by failure group.",
    );
    for g in groups {
        let _ = writeln!(
            out,
            "saga_dlq_open_letters{{dlq_topic=\"{}\",failure_group=\"{}\",consumer_group=\"{}\",step=\"{}\",reason=\"{}\"}} {}",
            label(&g.dlq_topic),
            label(&g.id),
            label(&g.consumer_group),
            label(g.step.as_deref().unwrap_or("")),
            label(&g.reason),
            g.open
        );
    }
    gauge(
        &mut out,
        "saga_sagas_stuck",
        "Orchestrated sagas marked stuck, or unfinished and unmoved for the inspector's stuck-for.",
    );
    for (saga_type, n) in crate::sagas::stuck_by_type(&app.pool, app.options.stuck_for).await? {
        let _ = writeln!(
            out,
            "saga_sagas_stuck{{saga_type=\"{}\"}} {n}",
            label(&saga_type)
        );
    }
    if let Ok(o) = crate::outbox::status(&app.pool).await {
        gauge(
            &mut out,
            "saga_outbox_oldest_unpublished_age_seconds",
            "Age of the oldest outbox row not published yet (0: none waits).",
        );
        let _ = writeln!(
            out,
            "saga_outbox_oldest_unpublished_age_seconds {}",
            o.oldest_age_seconds.unwrap_or(0.0)
        );
        gauge(
            &mut out,
            "saga_outbox_unpublished_rows",
            "Outbox rows waiting to be published.",
        );
        let _ = writeln!(out, "saga_outbox_unpublished_rows {}", o.unpublished);
        gauge(
            &mut out,
            "saga_outbox_parked_rows",
            "Outbox rows the broker refuses for good, set aside.",
        );
        let _ = writeln!(out, "saga_outbox_parked_rows {}", o.parked);
        if let Some(w) = &o.wal {
            gauge(
                &mut out,
                "saga_outbox_wal_lag_bytes",
                "WAL outbox: write-ahead log the relay has not confirmed.",
            );
            let _ = writeln!(out, "saga_outbox_wal_lag_bytes {}", w.lag_bytes);
            gauge(
                &mut out,
                "saga_outbox_wal_slot_read",
                "WAL outbox: 1 while a relay reads the slot, 0 while none does.",
            );
            let _ = writeln!(out, "saga_outbox_wal_slot_read {}", u8::from(w.reading));
            gauge(
                &mut out,
                "saga_outbox_wal_parked_events",
                "WAL outbox: events the broker refuses for good, set aside.",
            );
            let _ = writeln!(out, "saga_outbox_wal_parked_events {}", w.parked);
        }
    }
    Ok(out)
}

pub(super) async fn metrics(State(app): State<App>) -> Response {
    match render(&app).await {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::BAD_GATEWAY, format!("# error: {e}\n")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
