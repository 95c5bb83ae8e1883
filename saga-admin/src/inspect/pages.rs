//! The inspector's HTML, rendered on the server. Every value is escaped; elements carry `id` and `data-*`
//! attributes that tests (and scripts) can rely on.

use std::fmt::Write as _;

use super::api::PLAN_FIELD;
use super::api::{GroupView, OperationView, Overview};
use super::security::{CSRF_FIELD, Caller};
use crate::dlq::{DeadLetter, DlqOwner, ReplayReport};
use crate::groups::{FailureGroup, GroupedLetter};
use crate::operations::{Operation, OperationKind, Plan};
use crate::sagas::SagaDetail;
use crate::trace::SagaTrace;

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:2rem;color:#1d2433}\
h1{font-size:1.5rem}h2{font-size:1.1rem;margin-top:2rem;border-bottom:1px solid #d0d7de}\
table{border-collapse:collapse;margin:.5rem 0}td,th{padding:.25rem .75rem;border-bottom:1px solid #eaeef2;\
text-align:left;vertical-align:top}th{background:#f6f8fa}.num{text-align:right}\
.running{color:#0969da}.compensating{color:#bf8700}.completed{color:#1a7f37}.compensated{color:#8250df}\
.empty{color:#57606a}code{font-size:.9em}ol.timeline li{margin:.3rem 0}\
form button,a.button{background:#cf222e;color:#fff;border:0;padding:.4rem .9rem;border-radius:4px;\
text-decoration:none;font-size:.95rem}form.inline{display:inline;margin-right:.5rem}\
button.secondary,a.secondary{background:#57606a}nav a{margin-right:1rem}\
table.lanes td{min-width:14rem}.lane-event{border-left:3px solid #0969da;padding-left:.4rem}\
.lane-event.dead-letter,.lane-event.failed{border-color:#cf222e}.lane-event.replay{border-color:#bf8700}\
.lane-event.emitted{border-color:#1a7f37}.lane-event.transition{border-color:#8250df}small{color:#57606a}\
.warning{color:#9a6700;background:#fff8c5;padding:.4rem .6rem}\
label.reason{color:#57606a;font-size:.9rem;margin-right:.4rem}label.reason input{width:16rem}";

/// The most rows a page lists of one table.
const PAGE_ROWS: usize = 500;

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
         <style>{STYLE}</style></head><body><nav><a href=\"/\">Overview</a><a href=\"/groups\">Failure groups</a>\
         <a href=\"/operations\">Operations</a><a href=\"/trace\">Find a saga</a></nav><h1>{}</h1>{body}</body></html>",
        esc(title),
        esc(title)
    )
}

/// The banner of a page read from a dead-letter index that could not be brought up to date: each topic's
/// staleness, said.
pub(super) fn stale_banner(said: &[String]) -> String {
    let items: String = said
        .iter()
        .map(|s| format!("<li>{}</li>", esc(s)))
        .collect();
    format!(
        "<div id=\"index-stale\" class=\"warning\" role=\"alert\"><b>Shown as indexed, possibly stale:</b>\
         <ul>{items}</ul></div>"
    )
}

/// A page with one message.
pub(super) fn message(title: &str, text: &str) -> String {
    page(title, &format!("<p id=\"message\">{}</p>", esc(text)))
}

/// The answer to a sign-in link that would replace a live session of `current` by one of `presented`:
/// nothing is replaced; a button (a form of this page, with the session's CSRF token) signs out first.
pub(super) fn replace_login(
    current: &str,
    presented: &str,
    logout: &str,
    csrf_field: &str,
    csrf: &str,
) -> String {
    page(
        "Already signed in",
        &format!(
            "<p id=\"message\">You are signed in as <b>{}</b>. The link you followed would sign you in as \
             <b>{}</b> instead, and what you do next would be recorded under that name. Nothing was \
             changed. If you meant to switch, sign out, then open the link again.</p>\
             <form method=\"post\" action=\"{}\"><input type=\"hidden\" name=\"{}\" value=\"{}\">\
             <button type=\"submit\" id=\"sign-out\" class=\"secondary\">Sign out</button></form>",
            esc(current),
            esc(presented),
            esc(logout),
            esc(csrf_field),
            esc(csrf)
        ),
    )
}

/// The page that finishes a sign-in whose link was followed from another site: the name it signs in as,
/// and a form of this page that POSTs `fields` to `action`.
pub(super) fn confirm_login(name: &str, action: &str, fields: &[(&str, &str)]) -> String {
    let hidden: String = fields
        .iter()
        .map(|(n, v)| {
            format!(
                "<input type=\"hidden\" name=\"{}\" value=\"{}\">",
                esc(n),
                esc(v)
            )
        })
        .collect();
    page(
        "Sign in?",
        &format!(
            "<p id=\"message\">A link from elsewhere signs you in as <b>{}</b>: what you do next would be \
             recorded under that name.</p><form method=\"post\" action=\"{}\">{hidden}\
             <button type=\"submit\" id=\"sign-in\">Sign in as {}</button></form>",
            esc(name),
            esc(action),
            esc(name)
        ),
    )
}

/// The field of an action's form that says why, recorded in the audit log.
const REASON_INPUT: &str = "<label class=\"reason\">why <input name=\"reason\" \
     placeholder=\"recorded in the audit log\" maxlength=\"1000\"></label> ";

/// A form that POSTs to `action`, with the session's CSRF token, a reason field and one button.
fn post_form(action: &str, caller: &Caller, button_id: &str, label: &str, class: &str) -> String {
    format!(
        "<form class=\"inline\" method=\"post\" action=\"{}\"><input type=\"hidden\" name=\"{CSRF_FIELD}\" \
         value=\"{}\">{REASON_INPUT}<button type=\"submit\" id=\"{}\" class=\"{}\">{}</button></form>",
        esc(action),
        esc(&caller.csrf),
        esc(button_id),
        esc(class),
        esc(label)
    )
}

/// The form that finds a saga by its key.
fn trace_search(key: &str, tenant: &str) -> String {
    format!(
        "<form method=\"get\" action=\"/trace\" id=\"find-saga\"><label>Client key \
         <input name=\"key\" value=\"{}\" required></label> <label>tenant \
         <input name=\"tenant\" value=\"{}\" placeholder=\"any\"></label> \
         <button type=\"submit\" class=\"secondary\">Find the saga</button></form>",
        esc(key),
        esc(tenant)
    )
}

/// The failure groups table.
fn groups_table(groups: &[FailureGroup]) -> String {
    if groups.is_empty() {
        return "<p class=\"empty\" id=\"failure-groups\">No dead letters.</p>".to_owned();
    }
    let mut body = String::from(
        "<table id=\"failure-groups\"><tr><th>group</th><th>topic</th><th>step</th><th>reason</th><th>cause</th>\
         <th>open</th><th>all</th><th>first seen</th><th>last seen</th><th>held keys</th></tr>",
    );
    for g in groups {
        let _ = write!(
            body,
            "<tr data-group-id=\"{id}\" data-open=\"{}\" data-total=\"{}\" data-held-keys=\"{}\"><td><a href=\"/groups/{id}\">{id}</a></td>\
             <td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td><td class=\"num\">{}</td>\
             <td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            g.open,
            g.total,
            g.held_keys,
            esc(&g.dlq_topic),
            esc(g.step.as_deref().unwrap_or("")),
            esc(&g.reason),
            esc(&g.cause),
            g.open,
            g.total,
            g.first_seen.format("%Y-%m-%d %H:%M:%S"),
            g.last_seen.format("%Y-%m-%d %H:%M:%S"),
            esc(&g.held_summary()),
            id = esc(&g.id)
        );
    }
    body.push_str("</table>");
    body
}

/// Held keys (their later messages parked behind a dead letter, a paused step or a delayed retry) and paused
/// steps.
fn held_table(held: &[crate::holds::HeldKey], paused: &[crate::holds::PausedStep]) -> String {
    let mut body = String::new();
    if held.is_empty() {
        body.push_str("<p class=\"empty\" id=\"held-keys\">No key is held.</p>");
    } else {
        body.push_str(
            "<table id=\"held-keys\"><tr><th>group</th><th>key</th><th>state</th><th>held by</th>\
             <th>parked</th><th>held for</th><th>head letter</th><th></th></tr>",
        );
        for h in held {
            let head = match &h.head {
                Some((topic, partition, offset)) => format!(
                    "<a href=\"/dlq/{}/{partition}/{offset}\">{}/{partition}/{offset}</a>",
                    seg(topic),
                    esc(topic)
                ),
                None => String::new(),
            };
            // The key's exact bytes are what the page acts on: its text only tells keys apart.
            let release = if h.state == "held" {
                format!(
                    "<a class=\"release\" href=\"/keys/{}/{}/release\">release</a>",
                    seg(&h.group),
                    h.key_hex
                )
            } else {
                String::new()
            };
            let _ = write!(
                body,
                "<tr data-key=\"{k}\" data-key-hex=\"{hex}\" data-parked=\"{}\"><td>{}</td><td>{k}</td>\
                 <td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td>{head}</td><td>{release}</td></tr>",
                h.parked,
                esc(&h.group),
                esc(&h.state),
                esc(&h.held_by()),
                h.parked,
                crate::duration::human(std::time::Duration::from_secs(h.age_seconds.max(0) as u64)),
                k = esc(&h.key),
                hex = esc(&h.key_hex),
            );
        }
        body.push_str("</table>");
    }
    if !paused.is_empty() {
        body.push_str(
            "<table id=\"paused-steps\"><tr><th>group</th><th>paused step</th><th>by</th><th>why</th>\
             <th>since</th><th>held keys</th><th>parked</th></tr>",
        );
        for p in paused {
            let _ = write!(
                body,
                "<tr data-step=\"{st}\"><td>{}</td><td>{st}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                esc(&p.group),
                esc(&p.paused_by),
                esc(&p.reason),
                p.paused_at.format("%Y-%m-%d %H:%M:%S"),
                p.held_keys,
                p.parked,
                st = esc(&p.step),
            );
        }
        body.push_str("</table>");
    }
    body
}

/// The operations table.
fn operations_table(ops: &[Operation]) -> String {
    if ops.is_empty() {
        return "<p class=\"empty\" id=\"operations\">No operations.</p>".to_owned();
    }
    let mut body = String::from(
        "<table id=\"operations\"><tr><th>operation</th><th>kind</th><th>by</th><th>status</th><th>selected</th>\
         <th>done</th><th>skipped</th><th>refused</th><th>started</th></tr>",
    );
    for o in ops {
        let _ = write!(
            body,
            "<tr data-operation-id=\"{id}\" data-status=\"{st}\"><td><a href=\"/operations/{id}\">{id}</a></td>\
             <td>{}</td><td>{}</td><td>{st}</td><td class=\"num\">{}</td><td class=\"num\">{} {}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
            o.kind.as_str(),
            esc(&o.operator),
            o.planned,
            o.done,
            o.kind.done_word(),
            o.skipped,
            o.refused,
            o.created_at.format("%Y-%m-%d %H:%M:%S"),
            id = o.id,
            st = esc(&o.status)
        );
    }
    body.push_str("</table>");
    body
}

/// The overview: sagas by status, stuck sagas, failure groups, dead letters, operations, the outbox,
/// consumer lag.
pub(super) fn overview(o: &Overview, _caller: &Caller) -> String {
    let mut body = trace_search("", "");
    body.push_str(&sagas_section(o));

    body.push_str("<h2>Failure groups</h2>");
    body.push_str(&groups_table(&o.failure_groups));

    body.push_str("<h2>Held keys</h2>");
    body.push_str(&held_table(&o.held_keys, &o.paused_steps));

    body.push_str("<h2>Dead letters</h2>");
    body.push_str(
        "<table id=\"dead-letters\"><tr><th>topic</th><th>reason</th><th>letters</th><th>open</th></tr>",
    );
    for t in &o.dead_letters {
        let _ = write!(
            body,
            "<tr data-dlq-topic=\"{tt}\" data-count=\"{total}\" data-open=\"{open}\"><td><a href=\"/dlq/{u}\">{tt}</a></td>\
             <td>all</td><td class=\"num\">{total}</td><td class=\"num\">{open}</td></tr>",
            tt = esc(&t.topic),
            u = seg(&t.topic),
            total = t.total,
            open = t.open
        );
        for (reason, n) in &t.by_reason {
            let _ = write!(
                body,
                "<tr data-dlq-topic=\"{tt}\" data-reason=\"{r}\"><td></td><td>{r}</td><td class=\"num\">{n}</td><td></td></tr>",
                tt = esc(&t.topic),
                r = esc(reason)
            );
        }
    }
    body.push_str("</table>");

    body.push_str("<h2>Recent operations</h2>");
    body.push_str(&operations_table(&o.operations));

    body.push_str("<h2>Outbox</h2>");
    match &o.outbox {
        Ok(ob) => {
            let _ = write!(
                body,
                "<table id=\"outbox\"><tr><th>unpublished</th><th>oldest</th><th>failing</th><th>parked</th></tr>\
                 <tr><td class=\"num\" data-unpublished=\"{}\">{}</td><td>{}</td><td class=\"num\">{}</td>\
                 <td class=\"num\">{}</td></tr></table>",
                ob.unpublished,
                ob.unpublished,
                ob.oldest_age_seconds
                    .map_or_else(|| "-".to_owned(), |a| format!("{a:.1} s")),
                ob.failing,
                ob.parked
            );
        }
        Err(e) => {
            let _ = write!(body, "<p class=\"empty\">{}</p>", esc(e));
        }
    }

    body.push_str(&lag_section(o));
    page("Sagas at a glance", &body)
}

/// The overview's sagas by status and its stuck sagas.
fn sagas_section(o: &Overview) -> String {
    let mut body = String::new();
    body.push_str("<h2>Sagas by status</h2>");
    match &o.sagas_by_status {
        None => body.push_str("<p class=\"empty\">This schema keeps no orchestrated sagas.</p>"),
        Some(counts) if counts.is_empty() => {
            body.push_str("<p class=\"empty\">No saga instances.</p>");
        }
        Some(counts) => {
            body.push_str("<table id=\"sagas-by-status\"><tr><th>status</th><th>sagas</th></tr>");
            for (status, n) in counts {
                let _ = write!(
                    body,
                    "<tr data-status=\"{s}\"><td class=\"{s}\">{s}</td><td class=\"num\">{n}</td></tr>",
                    s = esc(status)
                );
            }
            body.push_str("</table>");
            let _ = write!(
                body,
                "<h2>Stuck sagas (unmoved for {})</h2>",
                esc(&o.stuck_for)
            );
            if o.stuck.is_empty() {
                body.push_str("<p class=\"empty\" id=\"stuck-sagas\">None.</p>");
            } else {
                body.push_str(
                    "<table id=\"stuck-sagas\"><tr><th>saga</th><th>type</th><th>key</th><th>status</th>\
                     <th>last moved</th><th>timer failures</th><th>why stuck</th></tr>",
                );
                for s in &o.stuck {
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
    }
    body
}

/// The overview's consumer lag, a table per consumer group.
fn lag_section(o: &Overview) -> String {
    let mut body = String::new();
    body.push_str("<h2>Consumer lag</h2>");
    if o.lag.is_empty() {
        body.push_str("<p class=\"empty\">No consumer group recorded in this schema.</p>");
    }
    for g in &o.lag {
        if let Some(error) = &g.error {
            let _ = write!(
                body,
                "<p class=\"empty\">group {}: {}</p>",
                esc(&g.group),
                esc(error)
            );
            continue;
        }
        let _ = write!(
            body,
            "<table data-group=\"{gg}\" data-lag=\"{total}\"><tr><th colspan=\"4\">group {gg}: lag {total}</th></tr>\
             <tr><th>topic/partition</th><th>committed</th><th>high watermark</th><th>lag</th></tr>",
            gg = esc(&g.group),
            total = g.total
        );
        for p in &g.partitions {
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
    body
}

/// A saga: its state, its timeline, its keys, its compensations.
pub(super) fn saga(detail: &SagaDetail, caller: &Caller) -> String {
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
    if !caller.read_only && matches!(i.status.as_str(), "running" | "compensating") {
        let _ = write!(
            body,
            "<p><a class=\"button\" id=\"retry\" href=\"/sagas/{}/retry\">Retry the current step…</a>{}</p>",
            i.saga_id,
            i.retry_requested_by
                .as_deref()
                .map_or_else(String::new, |by| format!(
                    " <small id=\"retry-requested\">retry requested by {}</small>",
                    esc(by)
                ))
        );
    }
    body.push_str("<h2>Timeline</h2><ol class=\"timeline\" id=\"timeline\">");
    for t in &detail.timeline {
        let retry = match (&t.retry_of, &t.operator) {
            (Some(of), operator) => format!(
                " <small class=\"retry-of\" data-retry-of=\"{of}\">retry of v{of} by {}</small>",
                esc(operator.as_deref().unwrap_or("unknown"))
            ),
            (None, _) => String::new(),
        };
        let _ = write!(
            body,
            "<li data-version=\"{}\" data-status=\"{to}\" data-cause=\"{cause}\"><time>{}</time> \
             <b class=\"{to}\">{to}</b> {} — {cause}{retry}</li>",
            t.version,
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
    let _ = write!(
        body,
        "<p><a href=\"/trace?key={}&amp;tenant={}\" id=\"trace-link\">This saga across every service</a></p>",
        query(&i.idempotency_key),
        query(&i.tenant)
    );
    page(&format!("Saga {}", i.saga_id), &body)
}

/// The confirmation before retrying a saga's current step.
pub(super) fn confirm_retry(detail: &SagaDetail, caller: &Caller) -> String {
    let i = &detail.instance;
    let body = format!(
        "<p>Send the current command of saga <code>{}</code> ({}, {} at step {}, attempt {}) again, as \
         <b id=\"operator\">{}</b>? The service's orchestrator sends it at its next timer tick with the same \
         step key: a participant that completed the step absorbs it, one that dead-lettered it runs it.</p>{}",
        i.saga_id,
        esc(&i.saga_type),
        esc(&i.status),
        i.step_index,
        i.attempt,
        esc(&caller.operator),
        post_form(
            &format!("/api/sagas/{}/retry", i.saga_id),
            caller,
            "confirm",
            "Confirm retry",
            ""
        )
        // Pinned to the revision shown: a saga that moved on meanwhile is not retried unseen.
        .replacen(
            "<button",
            &format!(
                "<input type=\"hidden\" name=\"version\" value=\"{}\"><button",
                i.version
            ),
            1
        )
    );
    page("Retry a saga?", &body)
}

/// A dead-letter topic's letters (with replay buttons unless `read_only`).
pub(super) fn dlq_topic(
    topic: &str,
    letters: &[GroupedLetter],
    next: Option<(i32, i64)>,
    read_only: bool,
) -> String {
    let mut body = format!(
        "<p id=\"dlq-count\" data-count=\"{}\">{} dead letters{}.</p>",
        letters.len(),
        letters.len(),
        if next.is_some() {
            " on this page (the failure groups count them all)"
        } else {
            ""
        }
    );
    body.push_str(
        "<table id=\"letters\"><tr><th>letter</th><th>original</th><th>step</th><th>reason</th><th>error</th>\
         <th>attempts</th><th>failed at</th><th>key</th><th>tenant</th><th>group</th><th>state</th><th></th></tr>",
    );
    for grouped in letters {
        let l = &grouped.letter;
        let link = format!("/dlq/{}/{}/{}", seg(topic), l.partition, l.offset);
        let _ = write!(
            body,
            "<tr data-partition=\"{p}\" data-offset=\"{o}\"><td><a href=\"{link}\">{p}/{o}</a></td>\
             <td>{}/{}/{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td><a href=\"/groups/{g}\">{g}</a></td><td class=\"state\">{}</td><td>{}</td></tr>",
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
            grouped.state.as_str(),
            if read_only {
                String::new()
            } else {
                format!("<a class=\"button replay\" href=\"{link}/replay\">Replay…</a>")
            },
            p = l.partition,
            o = l.offset,
            g = esc(&grouped.group_id)
        );
    }
    body.push_str("</table>");
    if let Some((partition, offset)) = next {
        let _ = write!(
            body,
            "<p><a id=\"next-page\" href=\"/dlq/{}?after={partition}-{offset}\">The next letters</a></p>",
            seg(topic)
        );
    }
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
         <form method=\"post\" action=\"/api/dlq/{}/{}/{}/replay\">\
         <input type=\"hidden\" name=\"{}\" value=\"{}\">\
         <input type=\"hidden\" name=\"letter\" value=\"{}\">\
         <input type=\"hidden\" name=\"retry_topic\" value=\"{}\">{REASON_INPUT}\
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
        CSRF_FIELD,
        esc(&caller.csrf),
        esc(&letter.identity()),
        esc(&owner.retry_topic)
    );
    page("Replay a dead letter?", &body)
}

/// The confirmation before releasing a held key by hand: a form that POSTs, with the session's CSRF token
/// and the hold it shows (`held_at`).
pub(super) fn confirm_release_key(held: &crate::holds::HeldKey, caller: &Caller) -> String {
    let body = format!(
        "<p>Release key <code id=\"key\">{}</code> (bytes <code id=\"key-hex\">{}</code>) of consumer group \
         <code id=\"group\">{}</code>, held by {}, as <b id=\"operator\">{}</b>? Its {} parked messages run in \
         their order, as if its head letter had been discarded; the letter stays in its topic.</p>\
         <form method=\"post\" action=\"/api/keys/{}/{}/release\">\
         <input type=\"hidden\" name=\"{}\" value=\"{}\">\
         <input type=\"hidden\" name=\"held_at\" value=\"{}\">{REASON_INPUT}\
         <button type=\"submit\" id=\"confirm\">Confirm release</button></form>",
        esc(&held.key),
        esc(&held.key_hex),
        esc(&held.group),
        esc(&held.held_by()),
        esc(&caller.operator),
        held.parked,
        seg(&held.group),
        esc(&held.key_hex),
        CSRF_FIELD,
        esc(&caller.csrf),
        held.held_at
            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
    );
    page("Release a held key?", &body)
}

/// What a release by hand did.
pub(super) fn key_released(held: &crate::holds::HeldKey) -> String {
    let body = format!(
        "<p id=\"released\" data-parked=\"{}\">Key <code>{}</code> of group {} released by {}: its {} parked \
         messages run in order.</p><p><a href=\"/\">Back to the overview</a></p>",
        held.parked,
        esc(&held.key),
        esc(&held.group),
        esc(held.released_by.as_deref().unwrap_or("-")),
        held.parked
    );
    page("Key released", &body)
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

/// Escapes a query parameter's value.
fn query(text: &str) -> String {
    seg(text)
}

/// The failure groups.
pub(super) fn groups(groups: &[FailureGroup]) -> String {
    page("Failure groups", &groups_table(groups))
}

/// A failure group: what it is, its letters, and its replay and discard buttons.
pub(super) fn group(view: &GroupView, caller: &Caller) -> String {
    let g = &view.group;
    let mut body = format!(
        "<table id=\"group\" data-group-id=\"{id}\" data-open=\"{}\"><tr><th>topic</th><td>{}</td></tr>\
         <tr><th>consumer group</th><td>{}</td></tr><tr><th>step</th><td>{}</td></tr>\
         <tr><th>reason</th><td>{}</td></tr><tr><th>cause</th><td><code id=\"cause\">{}</code></td></tr>\
         <tr><th>example</th><td><code>{}</code></td></tr><tr><th>open / all</th><td>{} / {}</td></tr>\
         <tr><th>first / last seen</th><td>{} / {}</td></tr>\
         <tr><th>held keys</th><td id=\"held-keys\">{}</td></tr></table>",
        g.open,
        esc(&g.dlq_topic),
        esc(&g.consumer_group),
        esc(g.step.as_deref().unwrap_or("-")),
        esc(&g.reason),
        esc(&g.cause),
        esc(&crate::table::one_line(&g.example_error, 300)),
        g.open,
        g.total,
        g.first_seen.format("%Y-%m-%d %H:%M:%S"),
        g.last_seen.format("%Y-%m-%d %H:%M:%S"),
        esc(&g.held_summary()),
        id = esc(&g.id)
    );
    if !caller.read_only && g.open > 0 {
        let _ = write!(
            body,
            "<p><a class=\"button\" id=\"replay-group\" href=\"/groups/{id}/plan?action=replay\">Replay the group…</a> \
             <a class=\"button secondary\" id=\"discard-group\" href=\"/groups/{id}/plan?action=discard\">Discard the group…</a></p>",
            id = seg(&g.id)
        );
    }
    body.push_str(
        "<h2>Letters</h2><table id=\"letters\"><tr><th>letter</th><th>state</th><th>error</th><th>attempts</th>\
         <th>failed at</th><th>key</th><th>tenant</th></tr>",
    );
    for grouped in &view.letters {
        let l = &grouped.letter;
        let _ = write!(
            body,
            "<tr data-partition=\"{p}\" data-offset=\"{o}\" data-state=\"{st}\"><td><a href=\"/dlq/{t}/{p}/{o}\">{p}/{o}</a></td>\
             <td>{st}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&crate::table::one_line(&l.error, 120)),
            l.attempts,
            l.failed_at.format("%Y-%m-%d %H:%M:%S"),
            esc(l.idempotency_key.as_deref().unwrap_or("")),
            esc(&l.tenant),
            p = l.partition,
            o = l.offset,
            t = seg(&l.topic),
            st = grouped.state.as_str()
        );
    }
    body.push_str("</table>");
    page(&format!("Failure group {}", g.id), &body)
}

/// The preview of a bulk operation on group `id`, and its confirmation form.
pub(super) fn confirm_plan(plan: &Plan, id: &str, caller: &Caller) -> String {
    let action = match plan.kind {
        OperationKind::Replay => "replay",
        OperationKind::Discard => "discard",
        OperationKind::UndoDiscard => "undo",
    };
    let mut body = format!(
        "<p id=\"plan\" data-action=\"{action}\" data-would-act=\"{}\" data-would-refuse=\"{}\" \
         data-left-alone=\"{}\">{}, as <b id=\"operator\">{}</b>.</p>",
        plan.would_act(),
        plan.would_refuse(),
        plan.left_alone,
        esc(&capitalise(&plan.describe())),
        esc(&caller.operator)
    );
    body.push_str("<table id=\"planned\"><tr><th>letter</th><th>key</th><th>what</th></tr>");
    for l in plan.letters.iter().take(PAGE_ROWS) {
        let _ = write!(
            body,
            "<tr><td>{}/{}/{}</td><td>{}</td><td>{}</td></tr>",
            esc(&l.dlq_topic),
            l.partition,
            l.offset,
            esc(l.idempotency_key.as_deref().unwrap_or("")),
            esc(l.refusal.as_deref().unwrap_or(match plan.kind {
                OperationKind::Replay => "would be sent",
                OperationKind::Discard => "would be discarded",
                OperationKind::UndoDiscard => "would be open again",
            }))
        );
    }
    body.push_str("</table>");
    if plan.letters.len() > PAGE_ROWS {
        let _ = write!(
            body,
            "<p class=\"empty\">and {} more, alike.</p>",
            plan.letters.len() - PAGE_ROWS
        );
    }
    if plan.would_act() > 0 && !caller.read_only {
        // The confirmation carries the preview's pin: it acts on these letters, or on none.
        let target = match plan.kind {
            OperationKind::UndoDiscard => format!("/api/operations/{}/undo", seg(id)),
            _ => format!("/api/groups/{}/{action}", seg(id)),
        };
        let form = post_form(
            &target,
            caller,
            "confirm",
            &format!("Confirm: {action} {}", plan.would_act()),
            "",
        );
        let pin = format!(
            "<input type=\"hidden\" name=\"{PLAN_FIELD}\" value=\"{}\">",
            esc(&super::api::PlanPin::of(plan, &caller.csrf).to_string())
        );
        body.push_str(&form.replacen("<button", &format!("{pin}<button"), 1));
    } else {
        body.push_str("<p class=\"empty\">Nothing to do.</p>");
    }
    page(&format!("{} group {id}?", capitalise(action)), &body)
}

fn capitalise(text: &str) -> String {
    let mut chars = text.chars();
    chars
        .next()
        .map_or_else(String::new, |c| c.to_uppercase().chain(chars).collect())
}

/// The operations.
pub(super) fn operations(ops: &[Operation]) -> String {
    page("Operations", &operations_table(ops))
}

/// One operation: how far it got, its letters, and its cancel or undo button.
pub(super) fn operation(view: &OperationView, caller: &Caller) -> String {
    let o = &view.operation;
    let mut body = format!(
        "<table id=\"operation\" data-operation-id=\"{}\" data-status=\"{st}\" data-done=\"{}\" data-skipped=\"{}\" \
         data-refused=\"{}\"><tr><th>kind</th><td>{}</td></tr><tr><th>by</th><td id=\"operation-operator\">{}</td></tr>\
         <tr><th>selection</th><td><code>{}</code></td></tr><tr><th>status</th><td id=\"operation-status\">{st}{}</td></tr>\
         <tr><th>selected</th><td>{}</td></tr><tr><th>{}</th><td id=\"operation-done\">{}</td></tr>\
         <tr><th>skipped / refused</th><td>{} / {}</td></tr><tr><th>started / ended</th><td>{} / {}</td></tr></table>",
        o.id,
        o.done,
        o.skipped,
        o.refused,
        o.kind.as_str(),
        esc(&o.operator),
        esc(&o.selection.to_string()),
        if o.cancel_requested && o.status == "running" {
            " (cancellation asked for)"
        } else {
            ""
        },
        o.planned,
        o.kind.done_word(),
        o.done,
        o.skipped,
        o.refused,
        o.created_at.format("%Y-%m-%d %H:%M:%S"),
        o.finished_at.map_or_else(
            || "-".to_owned(),
            |f| f.format("%Y-%m-%d %H:%M:%S").to_string()
        ),
        st = esc(&o.status)
    );
    // Who moved it after its start: each run's runner (its sends and discards are recorded under them),
    // and who asked it to stop.
    let _ = write!(
        body,
        "<p id=\"operation-runs\">Runs: {}.{}</p>",
        if o.run_by.is_empty() {
            "none yet".to_owned()
        } else {
            esc(&o.run_by.join(", "))
        },
        o.cancelled_by
            .as_deref()
            .map_or_else(String::new, |by| format!(
                " Cancelled by <span id=\"operation-cancelled-by\">{}</span>.",
                esc(by)
            ))
    );
    if let Some(why) = o.stopped.as_deref().filter(|_| o.status == "running") {
        let _ = write!(
            body,
            "<p class=\"warning\" id=\"operation-stopped\">Its last run stopped before its end: {}. \
             Resume it once the cause is fixed, or cancel it.</p>",
            esc(why)
        );
    }
    if !caller.read_only {
        if o.status == "running" {
            body.push_str(&post_form(
                &format!("/api/operations/{}/cancel", o.id),
                caller,
                "cancel",
                "Cancel",
                "secondary",
            ));
            body.push_str(&post_form(
                &format!("/api/operations/{}/resume", o.id),
                caller,
                "resume",
                "Resume (after a crash)",
                "secondary",
            ));
        }
        if o.kind == OperationKind::Discard && o.status != "running" && o.done > 0 {
            // A preview first: its confirmation is pinned to the letters it shows.
            let _ = write!(
                body,
                "<a class=\"button secondary\" id=\"undo\" href=\"/operations/{}/undo\">Undo this discard…</a>",
                o.id
            );
        }
    }
    body.push_str(
        "<h2>Letters</h2><table id=\"operation-letters\"><tr><th>#</th><th>letter</th><th>outcome</th><th>what happened</th></tr>",
    );
    for l in &view.letters {
        let _ = write!(
            body,
            "<tr data-outcome=\"{out}\"><td class=\"num\">{}</td><td><a href=\"/dlq/{}/{p}/{o}\">{}/{p}/{o}</a></td>\
             <td>{out}</td><td>{}</td></tr>",
            l.seq + 1,
            seg(&l.dlq_topic),
            esc(&l.dlq_topic),
            esc(l.detail.as_deref().unwrap_or("")),
            p = l.partition,
            o = l.offset,
            out = esc(l.outcome.as_deref().unwrap_or("pending"))
        );
    }
    body.push_str("</table>");
    page(&format!("Operation {}", o.id), &body)
}

/// The form to find a saga.
pub(super) fn trace_form() -> String {
    page(
        "Find a saga",
        &format!(
            "<p>Every step, event, dead letter, replay and orchestrated transition of a client's key, across \
             every service schema of the database.</p>{}",
            trace_search("", "")
        ),
    )
}

/// A saga across every service: one lane (column) per service schema, one row per event, by time.
pub(super) fn trace(t: &SagaTrace) -> String {
    let mut body = trace_search(&t.key, t.tenant.as_deref().unwrap_or(""));
    if !t.unread.is_empty() {
        body.push_str("<p class=\"warning\" id=\"trace-unread\">Not read: ");
        body.push_str(&esc(&t.unread.join("; ")));
        body.push_str("</p>");
    }
    if !t.cut.is_empty() {
        body.push_str("<p class=\"warning\" id=\"trace-cut\">Cut: ");
        body.push_str(&esc(&t.cut.join("; ")));
        body.push_str("</p>");
    }
    if !t.unindexed.is_empty() {
        body.push_str("<p class=\"warning\" id=\"trace-unindexed\">Read without an index: ");
        body.push_str(&esc(&t.unindexed.join("; ")));
        body.push_str("</p>");
    }
    if t.events.is_empty() {
        // Said only when everything was read: an empty answer from lists left unread is no answer.
        body.push_str(if t.unread.is_empty() && t.cut.is_empty() {
            "<p class=\"empty\" id=\"trace-empty\">Nothing is stored for this key (any more).</p>"
        } else {
            "<p class=\"empty\" id=\"trace-empty\">Nothing found in what could be read (see above).</p>"
        });
        return page(&format!("Saga {}", t.key), &body);
    }
    let _ = write!(
        body,
        "<p id=\"trace-summary\" data-events=\"{}\" data-lanes=\"{}\">{} events in {} services.</p>\
         <table class=\"lanes\" id=\"trace\"><tr><th>time</th>",
        t.events.len(),
        t.lanes.len(),
        t.events.len(),
        t.lanes.len()
    );
    for lane in &t.lanes {
        let _ = write!(body, "<th data-lane=\"{l}\">{l}</th>", l = esc(lane));
    }
    body.push_str("</tr>");
    for e in &t.events {
        let _ = write!(
            body,
            "<tr data-kind=\"{}\"><td><time>{}</time></td>",
            e.kind.as_str(),
            e.at.format("%H:%M:%S%.3f")
        );
        for lane in &t.lanes {
            if *lane == e.lane {
                let _ = write!(
                    body,
                    "<td><div class=\"lane-event {k} {st}\" data-lane=\"{l}\" data-kind=\"{k}\" data-subject=\"{s}\" \
                     data-status=\"{st}\"><b>{k}</b> {s}: {st}<br><small>{}</small></div></td>",
                    esc(&e.detail),
                    k = e.kind.as_str(),
                    l = esc(lane),
                    s = esc(&e.subject),
                    st = esc(&e.status)
                );
            } else {
                body.push_str("<td></td>");
            }
        }
        body.push_str("</tr>");
    }
    body.push_str("</table>");
    page(&format!("Saga {}", t.key), &body)
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
