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
//! - `saga_inspector_scrape_errors{part}`: 1 for a part of the scrape that could not be read (`dead_letters`
//!   while the broker cannot be reached, `outbox`), its gauges then left out and the log saying why; 0
//!   otherwise: a missing gauge is never silent.
//!
//! The series are bounded: at most [`MAX_GROUP_SERIES`] failure groups are series of their own (the most
//! open letters first); the rest of each topic's open letters are one series with `failure_group="other"`,
//! and `saga_dlq_failure_groups_folded` counts the groups folded there. Letters a consumer did not write
//! (`reason="unreadable"`) carry no consumer group or step label: their headers are whatever a hand wrote.

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
    // A broker that cannot be reached (to find the dead-letter topics, or to bring their index up to date)
    // leaves the dead letters' gauges out (a stale index must not pass for them), not the rest: the
    // outbox's age matters most while Kafka is down.
    let groups = match app.dlq_topics().await {
        Ok(topics) => groups::groups(&app.kafka, &app.pool, &topics).await,
        Err(e) => Err(e),
    };
    let dead_letters_failed = match groups {
        Ok(groups) => {
            open_letters(&mut out, &groups, MAX_GROUP_SERIES);
            false
        }
        // The broker, or an index that could not be brought up to date (a read-only database user that
        // found letters missing, another sync that does not end, a schema without the index).
        Err(
            e @ (AdminError::Kafka(_)
            | AdminError::Stale(_)
            | AdminError::Busy(_)
            | AdminError::Config(_)),
        ) => {
            tracing::warn!(error = %e, "the dead-letter topics could not be read: their gauges are left out of this scrape");
            true
        }
        Err(e) => return Err(e),
    };
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
    let mut outbox_failed = false;
    let outbox = match crate::outbox::status(&app.pool).await {
        Ok(o) => Some(o),
        // A schema without an outbox (a service that only consumes) has no outbox gauges.
        Err(AdminError::Database(sqlx::Error::Database(e)))
            if e.code().as_deref() == Some("42P01") =>
        {
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "the outbox's backlog could not be read: its gauges are left out of this scrape");
            outbox_failed = true;
            None
        }
    };
    if let Some(o) = outbox {
        outbox_gauges(&mut out, &o);
    }
    gauge(
        &mut out,
        "saga_inspector_scrape_errors",
        "1 for a part of this scrape that could not be read (its gauges are left out; the log says why).",
    );
    for (part, failed) in [
        ("dead_letters", dead_letters_failed),
        ("outbox", outbox_failed),
    ] {
        let _ = writeln!(
            out,
            "saga_inspector_scrape_errors{{part=\"{part}\"}} {}",
            u8::from(failed)
        );
    }
    Ok(out)
}

/// The relay's backlog gauges.
fn outbox_gauges(out: &mut String, o: &crate::outbox::OutboxStatus) {
    gauge(
        out,
        "saga_outbox_oldest_unpublished_age_seconds",
        "Age of the oldest outbox row not published yet (0: none waits).",
    );
    let _ = writeln!(
        out,
        "saga_outbox_oldest_unpublished_age_seconds {}",
        o.oldest_age_seconds.unwrap_or(0.0)
    );
    gauge(
        out,
        "saga_outbox_unpublished_rows",
        "Outbox rows waiting to be published.",
    );
    let _ = writeln!(out, "saga_outbox_unpublished_rows {}", o.unpublished);
    gauge(
        out,
        "saga_outbox_parked_rows",
        "Outbox rows the broker refuses for good, set aside.",
    );
    let _ = writeln!(out, "saga_outbox_parked_rows {}", o.parked);
    if let Some(w) = &o.wal {
        gauge(
            out,
            "saga_outbox_wal_lag_bytes",
            "WAL outbox: write-ahead log the relay has not confirmed.",
        );
        let _ = writeln!(out, "saga_outbox_wal_lag_bytes {}", w.lag_bytes);
        gauge(
            out,
            "saga_outbox_wal_slot_read",
            "WAL outbox: 1 while a relay reads the slot, 0 while none does.",
        );
        let _ = writeln!(out, "saga_outbox_wal_slot_read {}", u8::from(w.reading));
        gauge(
            out,
            "saga_outbox_wal_parked_events",
            "WAL outbox: events the broker refuses for good, set aside.",
        );
        let _ = writeln!(out, "saga_outbox_wal_parked_events {}", w.parked);
    }
}

/// The most failure groups that are series of their own.
pub(super) const MAX_GROUP_SERIES: usize = 500;

/// `saga_dlq_open_letters`, a series per group up to `cap` (the most open first, as `groups` are sorted),
/// the rest of each topic's open letters in one series, and `saga_dlq_failure_groups_folded`.
fn open_letters(out: &mut String, groups: &[groups::FailureGroup], cap: usize) {
    gauge(
        out,
        "saga_dlq_open_letters",
        "Dead letters neither replayed nor discarded, by failure group.",
    );
    let mut folded: std::collections::BTreeMap<&str, (usize, usize)> =
        std::collections::BTreeMap::new();
    for (i, g) in groups.iter().enumerate() {
        if i >= cap {
            let f = folded.entry(g.dlq_topic.as_str()).or_default();
            f.0 += 1;
            f.1 += g.open;
            continue;
        }
        // A hand-written letter's group and step headers are not the framework's: no series of their own.
        let unreadable = g.reason == saga_consumer::admin::letters::UNREADABLE;
        let (consumer_group, step) = if unreadable {
            ("", "")
        } else {
            (g.consumer_group.as_str(), g.step.as_deref().unwrap_or(""))
        };
        let _ = writeln!(
            out,
            "saga_dlq_open_letters{{dlq_topic=\"{}\",failure_group=\"{}\",consumer_group=\"{}\",step=\"{}\",reason=\"{}\"}} {}",
            label(&g.dlq_topic),
            label(&g.id),
            label(consumer_group),
            label(step),
            label(&g.reason),
            g.open
        );
    }
    for (topic, (_, open)) in &folded {
        let _ = writeln!(
            out,
            "saga_dlq_open_letters{{dlq_topic=\"{}\",failure_group=\"other\",consumer_group=\"\",step=\"\",reason=\"\"}} {open}",
            label(topic)
        );
    }
    gauge(
        out,
        "saga_dlq_failure_groups_folded",
        "Failure groups past the inspector's series cap, counted in failure_group=\"other\".",
    );
    let _ = writeln!(
        out,
        "saga_dlq_failure_groups_folded {}",
        folded.values().map(|(n, _)| n).sum::<usize>()
    );
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
    fn group(topic: &str, id: &str, reason: &str, open: usize) -> groups::FailureGroup {
        groups::FailureGroup {
            id: id.to_owned(),
            dlq_topic: topic.to_owned(),
            consumer_group: "hand-written-group".to_owned(),
            step: Some("hand-written-step".to_owned()),
            reason: reason.to_owned(),
            cause: String::new(),
            open,
            total: open,
            first_seen: chrono::DateTime::default(),
            last_seen: chrono::DateTime::default(),
            example_error: String::new(),
            example_position: (0, 0),
            held_keys: 0,
            parked: 0,
            oldest_held_seconds: None,
        }
    }

    #[test]
    fn groups_past_the_cap_are_one_series_per_topic_and_counted() {
        let groups = vec![
            group("a.dlq", "g-1", "handler-failed", 9),
            group("a.dlq", "g-2", "unreadable", 5),
            group("a.dlq", "g-3", "handler-failed", 3),
            group("b.dlq", "g-4", "handler-failed", 2),
            group("a.dlq", "g-5", "handler-failed", 1),
        ];
        let mut out = String::new();
        open_letters(&mut out, &groups, 2);
        let series: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            series,
            [
                "saga_dlq_open_letters{dlq_topic=\"a.dlq\",failure_group=\"g-1\",consumer_group=\"hand-written-group\",step=\"hand-written-step\",reason=\"handler-failed\"} 9",
                // An unreadable letter's group and step are a hand's: not labels.
                "saga_dlq_open_letters{dlq_topic=\"a.dlq\",failure_group=\"g-2\",consumer_group=\"\",step=\"\",reason=\"unreadable\"} 5",
                "saga_dlq_open_letters{dlq_topic=\"a.dlq\",failure_group=\"other\",consumer_group=\"\",step=\"\",reason=\"\"} 4",
                "saga_dlq_open_letters{dlq_topic=\"b.dlq\",failure_group=\"other\",consumer_group=\"\",step=\"\",reason=\"\"} 2",
                "saga_dlq_failure_groups_folded 3",
            ]
        );
    }
}
