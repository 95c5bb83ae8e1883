//! The inspector's HTML, rendered on the server. Every value is escaped; elements carry `id` and `data-*`
//! attributes that tests (and scripts) can rely on.

use std::fmt::Write as _;

use saga_runtime::kafka::KafkaConfig;
use sqlx::PgPool;

use super::InspectOptions;
use super::security::Caller;
use crate::dlq::{DeadLetter, DlqOwner, ReplayReport};
use crate::duration::human;
use crate::error::AdminError;
use crate::sagas::SagaDetail;

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:2rem;color:#1d2433}\
h1{font-size:1.5rem}h2{font-size:1.1rem;margin-top:2rem;border-bottom:1px solid #d0d7de}\
table{border-collapse:collapse;margin:.5rem 0}td,th{padding:.25rem .75rem;border-bottom:1px solid #eaeef2;\
text-align:left;vertical-align:top}th{background:#f6f8fa}.num{text-align:right}\
.running{color:#0969da}.compensating{color:#bf8700}.completed{color:#1a7f37}.compensated{color:#8250df}\
.empty{color:#57606a}code{font-size:.9em}ol.timeline li{margin:.3rem 0}\
form button,a.button{background:#cf222e;color:#fff;border:0;padding:.4rem .9rem;border-radius:4px;\
text-decoration:none;font-size:.95rem}nav a{margin-right:1rem}";

/// Escapes text for HTML.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Escapes a path segment.
fn seg(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn page(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{} · saga inspector</title>\
         <style>{STYLE}</style></head><body><nav><a href=\"/\">Overview</a></nav><h1>{}</h1>{body}</body></html>",
        esc(title),
        esc(title)
    )
}

/// A page with one message.
pub(super) fn message(title: &str, text: &str) -> String {
    page(title, &format!("<p id=\"message\">{}</p>", esc(text)))
}

/// The overview: sagas by status, stuck sagas, dead letters, the outbox, consumer lag.
pub(super) async fn overview(
    kafka: &KafkaConfig,
    pool: &PgPool,
    options: &InspectOptions,
) -> Result<String, AdminError> {
    let mut body = String::new();

    body.push_str("<h2>Sagas by status</h2>");
    match crate::sagas::counts(pool).await {
        Ok(counts) if counts.is_empty() => {
            body.push_str("<p class=\"empty\">No saga instances.</p>")
        }
        Ok(counts) => {
            body.push_str("<table id=\"sagas-by-status\"><tr><th>status</th><th>sagas</th></tr>");
            for (status, n) in &counts {
                let _ = write!(
                    body,
                    "<tr data-status=\"{s}\"><td class=\"{s}\">{s}</td><td class=\"num\">{n}</td></tr>",
                    s = esc(status)
                );
            }
            body.push_str("</table>");
            body.push_str(&format!(
                "<h2>Stuck sagas (unmoved for {})</h2>",
                esc(&human(options.stuck_for))
            ));
            let stuck = crate::sagas::list(pool, None, Some(options.stuck_for), 50).await?;
            if stuck.is_empty() {
                body.push_str("<p class=\"empty\" id=\"stuck-sagas\">None.</p>");
            } else {
                body.push_str(
                    "<table id=\"stuck-sagas\"><tr><th>saga</th><th>type</th><th>key</th><th>status</th>\
                     <th>last moved</th><th>timer failures</th><th>why stuck</th></tr>",
                );
                for s in &stuck {
                    let _ = write!(
                        body,
                        "<tr><td><a href=\"/sagas/{id}\">{id}</a></td><td>{}</td><td>{}</td>\
                         <td class=\"{st}\">{st}</td><td>{}</td><td class=\"num\">{}</td>\
                         <td class=\"stuck-reason\">{}</td></tr>",
                        esc(&s.saga_type),
                        esc(&s.idempotency_key),
                        s.updated_at.format("%Y-%m-%d %H:%M:%S"),
                        s.timer_failures,
                        esc(s.stuck_reason.as_deref().unwrap_or("unmoved")),
                        id = s.saga_id,
                        st = esc(&s.status)
                    );
                }
                body.push_str("</table>");
            }
        }
        Err(AdminError::BadInput(_)) => {
            body.push_str("<p class=\"empty\">This schema keeps no orchestrated sagas.</p>");
        }
        Err(e) => return Err(e),
    }

    body.push_str("<h2>Dead letters</h2>");
    let topics = if options.dlq_topics.is_empty() {
        crate::dlq::discover_topics(kafka).await?
    } else {
        options.dlq_topics.clone()
    };
    let counts = crate::dlq::counts(kafka, &topics).await?;
    body.push_str(
        "<table id=\"dead-letters\"><tr><th>topic</th><th>reason</th><th>letters</th></tr>",
    );
    for topic in &topics {
        let of_topic: Vec<_> = counts.iter().filter(|((t, _), _)| t == topic).collect();
        let total: usize = of_topic.iter().map(|(_, n)| **n).sum();
        let _ = write!(
            body,
            "<tr data-dlq-topic=\"{t}\" data-count=\"{total}\"><td><a href=\"/dlq/{u}\">{t}</a></td><td>all</td>\
             <td class=\"num\">{total}</td></tr>",
            t = esc(topic),
            u = seg(topic)
        );
        for ((_, reason), n) in of_topic {
            let _ = write!(
                body,
                "<tr data-dlq-topic=\"{t}\" data-reason=\"{r}\"><td></td><td>{r}</td><td class=\"num\">{n}</td></tr>",
                t = esc(topic),
                r = esc(reason)
            );
        }
    }
    body.push_str("</table>");

    body.push_str("<h2>Outbox</h2>");
    match crate::outbox::status(pool).await {
        Ok(o) => {
            let _ = write!(
                body,
                "<table id=\"outbox\"><tr><th>unpublished</th><th>oldest</th><th>failing</th><th>parked</th></tr>\
                 <tr><td class=\"num\" data-unpublished=\"{}\">{}</td><td>{}</td><td class=\"num\">{}</td>\
                 <td class=\"num\">{}</td></tr></table>",
                o.unpublished,
                o.unpublished,
                o.oldest_age_seconds
                    .map_or_else(|| "-".to_owned(), |a| format!("{a:.1} s")),
                o.failing,
                o.parked
            );
        }
        Err(e) => {
            let _ = write!(body, "<p class=\"empty\">{}</p>", esc(&e.to_string()));
        }
    }

    body.push_str("<h2>Consumer lag</h2>");
    let groups = if options.groups.is_empty() {
        crate::lag::known_groups(pool).await?
    } else {
        options.groups.clone()
    };
    if groups.is_empty() {
        body.push_str("<p class=\"empty\">No consumer group recorded in this schema.</p>");
    }
    for group in &groups {
        let topics = crate::lag::known_topics(pool, group).await?;
        match crate::lag::lag(kafka, group, &topics).await {
            Ok(parts) => {
                let total: i64 = parts.iter().map(|p| p.lag).sum();
                let _ = write!(
                    body,
                    "<table data-group=\"{g}\" data-lag=\"{total}\"><tr><th colspan=\"4\">group {g}: lag {total}</th></tr>\
                     <tr><th>topic/partition</th><th>committed</th><th>high watermark</th><th>lag</th></tr>",
                    g = esc(group)
                );
                for p in &parts {
                    let _ = write!(
                        body,
                        "<tr><td>{}/{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                        esc(&p.topic),
                        p.partition,
                        p.committed
                            .map_or_else(|| "-".to_owned(), |c| c.to_string()),
                        p.high_watermark,
                        p.lag
                    );
                }
                body.push_str("</table>");
            }
            Err(e) => {
                let _ = write!(
                    body,
                    "<p class=\"empty\">group {}: {}</p>",
                    esc(group),
                    esc(&e.to_string())
                );
            }
        }
    }
    Ok(page("Sagas at a glance", &body))
}

/// A saga: its state, its timeline, its keys, its compensations.
pub(super) fn saga(detail: &SagaDetail) -> String {
    let i = &detail.instance;
    let mut body = format!(
        "<table id=\"saga\" data-saga-id=\"{id}\" data-status=\"{st}\">\
         <tr><th>saga</th><td id=\"saga-id\">{id}</td></tr><tr><th>type</th><td>{}</td></tr>\
         <tr><th>tenant / key</th><td>{} / <code>{}</code></td></tr>\
         <tr><th>status</th><td class=\"{st}\">{st}</td></tr><tr><th>step</th><td>{}</td></tr>\
         <tr><th>version</th><td>{}</td></tr><tr><th>failure</th><td>{}</td></tr>\
         <tr><th>deadline</th><td>{}</td></tr><tr><th>timer failures</th><td>{}</td></tr>\
         <tr><th>stuck</th><td id=\"stuck-reason\">{}</td></tr></table>",
        esc(&i.saga_type),
        esc(&i.tenant),
        esc(&i.idempotency_key),
        i.step_index,
        i.version,
        esc(i.failure.as_deref().unwrap_or("-")),
        i.deadline.map_or_else(
            || "-".to_owned(),
            |d| d.format("%Y-%m-%d %H:%M:%S").to_string()
        ),
        i.timer_failures,
        esc(i.stuck_reason.as_deref().unwrap_or("-")),
        id = i.saga_id,
        st = esc(&i.status)
    );
    body.push_str("<h2>Timeline</h2><ol class=\"timeline\" id=\"timeline\">");
    for t in &detail.timeline {
        let _ = write!(
            body,
            "<li data-status=\"{to}\" data-cause=\"{cause}\"><time>{}</time> <b class=\"{to}\">{to}</b> \
             {} — {cause}</li>",
            t.at.format("%Y-%m-%d %H:%M:%S%.3f"),
            esc(t
                .step
                .as_deref()
                .map_or(String::new(), |s| format!("step {s}"))
                .as_str()),
            to = esc(&t.to_status),
            cause = esc(&t.cause)
        );
    }
    body.push_str("</ol>");
    body.push_str(
        "<h2>Step keys</h2><table id=\"step-keys\"><tr><th>step</th><th>step key</th></tr>",
    );
    if let Some(map) = i.step_keys.as_object() {
        for (step, key) in map {
            let _ = write!(
                body,
                "<tr><td>{}</td><td><code>{}</code></td></tr>",
                esc(step),
                esc(key.as_str().unwrap_or_default())
            );
        }
    }
    body.push_str("</table>");
    let compensations: Vec<_> = detail
        .timeline
        .iter()
        .filter(|t| t.to_status == "compensating" || t.to_status == "compensated")
        .collect();
    body.push_str("<h2>Compensations</h2>");
    if compensations.is_empty() {
        body.push_str("<p class=\"empty\" id=\"compensations\">None.</p>");
    } else {
        body.push_str("<ul id=\"compensations\">");
        for t in compensations {
            let _ = write!(
                body,
                "<li>{} → {} ({})</li>",
                esc(t.step.as_deref().unwrap_or("-")),
                esc(&t.to_status),
                esc(&t.cause)
            );
        }
        body.push_str("</ul>");
    }
    body.push_str("<h2>Keys in this schema</h2><table id=\"keys\"><tr><th>step key</th><th>status</th><th>attempts</th><th>updated</th></tr>");
    for k in &detail.keys {
        let _ = write!(
            body,
            "<tr><td><code>{}</code></td><td>{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
            esc(&k.step_key),
            esc(&k.status),
            k.attempts,
            k.updated_at.format("%Y-%m-%d %H:%M:%S")
        );
    }
    body.push_str("</table>");
    page(&format!("Saga {}", i.saga_id), &body)
}

/// A dead-letter topic's letters (with replay buttons unless `read_only`).
pub(super) fn dlq_topic(topic: &str, letters: &[DeadLetter], read_only: bool) -> String {
    let mut body = format!(
        "<p id=\"dlq-count\" data-count=\"{}\">{} dead letters.</p>",
        letters.len(),
        letters.len()
    );
    body.push_str(
        "<table id=\"letters\"><tr><th>letter</th><th>original</th><th>step</th><th>reason</th><th>error</th>\
         <th>attempts</th><th>failed at</th><th>key</th><th>tenant</th><th></th></tr>",
    );
    for l in letters {
        let link = format!("/dlq/{}/{}/{}", seg(topic), l.partition, l.offset);
        let _ = write!(
            body,
            "<tr data-partition=\"{p}\" data-offset=\"{o}\"><td><a href=\"{link}\">{p}/{o}</a></td>\
             <td>{}/{}/{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td></tr>",
            esc(&l.original_topic),
            l.original_partition,
            l.original_offset,
            esc(l.step.as_deref().unwrap_or("")),
            esc(&l.reason),
            esc(&crate::table::one_line(&l.error, 120)),
            l.attempts,
            l.failed_at.format("%Y-%m-%d %H:%M:%S"),
            esc(l.idempotency_key.as_deref().unwrap_or("")),
            esc(&l.tenant),
            if read_only {
                String::new()
            } else {
                format!("<a class=\"button replay\" href=\"{link}/replay\">Replay…</a>")
            },
            p = l.partition,
            o = l.offset
        );
    }
    body.push_str("</table>");
    page(&format!("Dead letters of {topic}"), &body)
}

/// One dead letter, its headers and payload, and the replay button (unless `read_only`).
pub(super) fn dlq_letter(letter: &DeadLetter, read_only: bool) -> String {
    let mut body = format!(
        "<p>From <code>{}/{}/{}</code>, {} after {} attempts: {}</p><h2>Headers</h2><table id=\"headers\">",
        esc(&letter.original_topic),
        letter.original_partition,
        letter.original_offset,
        esc(&letter.reason),
        letter.attempts,
        esc(&letter.error)
    );
    for (name, value) in &letter.record.headers {
        let _ = write!(
            body,
            "<tr><th>{}</th><td><code>{}</code></td></tr>",
            esc(name),
            esc(&value
                .as_deref()
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default())
        );
    }
    let payload = letter
        .record
        .payload
        .as_deref()
        .map_or_else(String::new, |p| {
            serde_json::from_slice::<serde_json::Value>(p)
                .ok()
                .and_then(|v| serde_json::to_string_pretty(&v).ok())
                .unwrap_or_else(|| String::from_utf8_lossy(p).into_owned())
        });
    let _ = write!(
        body,
        "</table><h2>Payload</h2><pre id=\"payload\">{}</pre>",
        esc(&payload)
    );
    if !read_only {
        let _ = write!(
            body,
            "<p><a class=\"button replay\" id=\"replay\" href=\"/dlq/{}/{}/{}/replay\">Replay…</a></p>",
            seg(&letter.topic),
            letter.partition,
            letter.offset
        );
    }
    page(
        &format!(
            "Dead letter {}/{}/{}",
            letter.topic, letter.partition, letter.offset
        ),
        &body,
    )
}

/// The confirmation before a replay: a form that POSTs, with the session's CSRF token.
pub(super) fn confirm_replay(letter: &DeadLetter, owner: &DlqOwner, caller: &Caller) -> String {
    let body = format!(
        "<p>Replay this message (from <code>{}</code> partition {}, key <code>{}</code>) to the retry topic \
         <code id=\"retry-topic\">{}</code> of consumer group <code id=\"group\">{}</code>, as \
         <b id=\"operator\">{}</b>? Only that group sees it; its step runs again unless its step key is done \
         already. A dead letter is replayed once.</p>\
         <form method=\"post\" action=\"/dlq/{}/{}/{}/replay\">\
         <input type=\"hidden\" name=\"{}\" value=\"{}\">\
         <button type=\"submit\" id=\"confirm\">Confirm replay</button></form>",
        esc(&letter.original_topic),
        letter.original_partition,
        esc(letter.idempotency_key.as_deref().unwrap_or("-")),
        esc(&owner.retry_topic),
        esc(&owner.group),
        esc(&caller.operator),
        seg(&letter.topic),
        letter.partition,
        letter.offset,
        super::security::CSRF_FIELD,
        esc(&caller.csrf)
    );
    page("Replay a dead letter?", &body)
}

/// What a replay did.
pub(super) fn replayed(topic: &str, report: &ReplayReport) -> String {
    let mut body = format!(
        "<p id=\"replayed\" data-sent=\"{}\">{} sent to {} (group {}) by {}.</p><ul>",
        report.sent(),
        report.sent(),
        esc(&report.retry_topic),
        esc(&report.group),
        esc(&report.operator)
    );
    for l in &report.letters {
        let _ = write!(
            body,
            "<li>{}/{}: {}</li>",
            l.partition,
            l.offset,
            esc(&l.outcome.describe())
        );
    }
    let _ = write!(
        body,
        "</ul><p><a href=\"/dlq/{}\">Back to the dead letters</a></p>",
        seg(topic)
    );
    page("Replay", &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_path_segments_are_escaped() {
        assert_eq!(
            esc("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
        assert_eq!(seg("orders.dlq"), "orders.dlq");
        assert_eq!(seg("a/b c"), "a%2Fb%20c");
    }
}
