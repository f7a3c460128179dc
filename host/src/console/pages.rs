//! The console's HTML. Every value from event data, configs or errors goes
//! through maud's escaping, and control characters are shown as `\u{..}`
//! escapes, so nothing an event carries becomes markup on a page.

use maud::{DOCTYPE, Markup, PreEscaped, html};

use super::auth::Who;
use super::charts::{Point, Unit, sparkline};
use super::view::{
    COUNT_BOUND, DatabaseLine, Figures, MATCHING_BOUND, Served, SlotLine, TargetLine, TargetState,
};
use crate::admin::PluginStatus;
use crate::store::OutboxEntry;

/// Payloads longer than this (as shown) are cut, with how much was left out.
pub const PREVIEW_BYTES: usize = 64 * 1024;

/// Longest last error shown in a list.
const ERROR_IN_LIST: usize = 200;

/// Who is looking: signed in, signed out, or no tokens at all.
#[derive(Debug, Clone)]
pub enum Viewer {
    /// No token is configured: payloads and actions are not offered.
    NoTokens,
    /// Tokens exist; this browser has not signed in.
    SignedOut,
    /// Signed in.
    SignedIn(Who),
}

impl Viewer {
    /// The session, when signed in.
    pub fn who(&self) -> Option<&Who> {
        match self {
            Viewer::SignedIn(who) => Some(who),
            Viewer::NoTokens | Viewer::SignedOut => None,
        }
    }
}

/// A whole page: the header with its links, `body` in `<main>`. A `live`
/// page's main part is refreshed every second by `/console.js`.
pub fn layout(title: &str, viewer: &Viewer, live: bool, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · Switchyard" }
                link rel="stylesheet" href="/console.css";
                script src="/console.js" defer {}
            }
            body {
                header {
                    a.brand href="/" { "Switchyard" }
                    nav {
                        a href="/" { "Overview" }
                        a href="/dead-letters" { "Dead letters" }
                        a href="/events" { "Find an event" }
                    }
                    div.who {
                        @match viewer {
                            Viewer::NoTokens => span.muted { "read-only (no admin token configured)" },
                            Viewer::SignedOut => a href="/sign-in" { "Sign in" },
                            Viewer::SignedIn(who) => {
                                span { "signed in as " strong { (who.name) } }
                                form method="post" action="/sign-out" {
                                    input type="hidden" name="csrf" value=(who.csrf);
                                    button type="submit" { "Sign out" }
                                }
                            }
                        }
                    }
                }
                main data-live[live] { (body) }
            }
        }
    }
}

/// A message box: `kind` is `error`, `notice` or `done`.
pub fn message(kind: &str, text: &str) -> Markup {
    html! { p class={"message " (kind)} { (visible(text)) } }
}

/// The overview of a fleet: one line per database, then targets and plugins.
pub fn fleet_overview(
    databases: &[DatabaseLine],
    points: &dyn Fn(&str) -> Vec<Point>,
    targets: &[TargetLine],
    plugins: &[PluginStatus],
) -> Markup {
    html! {
        h1 { "Overview" }
        h2 { "Databases (" (databases.len()) ")" }
        table.databases {
            thead { tr { th { "Database" } th { "Served" } th { "Backlog" } th { "Oldest waiting" } th { "Events/s" } th { "p99" } th { "Dead letters" } } }
            tbody {
                @for line in databases {
                    @let latest = points(&line.name).last().copied();
                    tr data-database=(line.name) {
                        td { a href={"/db/" (line.name)} { (line.name) } }
                        td { (served(&line.served)) }
                        @match &line.figures {
                            Some(Ok(figures)) => {
                                td.number { (count(figures.backlog)) }
                                td.number { (figures.oldest_seconds.map_or_else(|| "none".into(), duration)) }
                                td.number { (latest.map_or_else(|| "-".into(), |p| format!("{:.0}", p.rate))) }
                                td.number { (latest.and_then(|p| p.p99).map_or_else(|| "-".into(), duration)) }
                                td.number { a href={"/dead-letters?database=" (line.name)} { (count(figures.dead)) } }
                            }
                            Some(Err(error)) => td.error colspan="5" { "does not answer: " (visible(error)) },
                            None => td colspan="5" {},
                        }
                    }
                }
            }
        }
        (targets_table(targets))
        (plugins_table(plugins))
    }
}

/// One database's page: its figures and charts, slot, and (for a fleet of
/// one) the targets and plugins.
pub fn database_overview(
    line: &DatabaseLine,
    points: &[Point],
    slot: Option<&SlotLine>,
    shared: Option<(&[TargetLine], &[PluginStatus])>,
) -> Markup {
    html! {
        h1 { "Database " (line.name) }
        p { (served(&line.served)) }
        @match &line.figures {
            Some(Ok(figures)) => (figures_list(&line.name, figures)),
            Some(Err(error)) => (message("error", &format!("The database does not answer: {error}"))),
            None => {},
        }
        section.charts {
            (sparkline("Events published per second", &points.iter().map(|p| Some(p.rate)).collect::<Vec<_>>(), Unit::PerSecond))
            (sparkline("Commit to publish, p50", &points.iter().map(|p| p.p50).collect::<Vec<_>>(), Unit::Seconds))
            (sparkline("Commit to publish, p99", &points.iter().map(|p| p.p99).collect::<Vec<_>>(), Unit::Seconds))
        }
        @if let Some(slot) = slot {
            h2 { "Replication slot" }
            dl.slot {
                dt { "Slot" } dd { (slot.slot) }
                dt { "Reader" } dd { (slot.reader.as_deref().unwrap_or("none")) @if slot.reading_here { " (this relay)" } }
                dt { "Retained WAL" } dd { (slot.retained_wal_bytes.map_or_else(|| "unknown".into(), bytes)) }
                dt { "Confirmed up to" } dd { (slot.confirmed_flush_lsn.as_deref().unwrap_or("nothing yet")) }
                dt { "Behind the server" } dd.lag { (slot.confirmed_lag_bytes.map_or_else(|| "unknown".into(), bytes)) }
                dt { "Check" } dd { (visible(&slot.check.to_string())) }
            }
        }
        @if let Some((targets, plugins)) = shared {
            (targets_table(targets))
            (plugins_table(plugins))
        }
    }
}

fn figures_list(database: &str, figures: &Figures) -> Markup {
    html! {
        dl.figures {
            dt { "Backlog" } dd.backlog { (count(figures.backlog)) }
            dt { "Oldest waiting" } dd { (figures.oldest_seconds.map_or_else(|| "none".into(), duration)) }
            dt { "Dead letters" } dd.dead { a href={"/dead-letters?database=" (database)} { (count(figures.dead)) } }
        }
    }
}

fn targets_table(targets: &[TargetLine]) -> Markup {
    html! {
        h2 { "Targets" }
        table.targets {
            thead { tr { th { "Target" } th { "Kind" } th { "State" } th { "Why" } } }
            tbody {
                @for target in targets {
                    tr data-target=(target.name) {
                        td { (target.name) }
                        td { (target.kind) }
                        @match &target.state {
                            TargetState::Up => { td.state.up { "up" } td {} }
                            TargetState::Down(why) => { td.state.down { "down" } td { (visible(why)) } }
                            TargetState::Paused(databases) => {
                                td.state.paused { "paused" }
                                td {
                                    @for (database, paused) in databases {
                                        div {
                                            (database) ": since " (paused.since) " (" (paused.seconds) " s): " (visible(&paused.reason))
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `sha256:` and the first 12 hex digits, as registries show digests.
fn short_digest(digest: &str) -> &str {
    &digest[..digest.len().min("sha256:".len() + 12)]
}

fn plugins_table(plugins: &[PluginStatus]) -> Markup {
    html! {
        h2 { "Plugins" }
        table.plugins {
            thead { tr { th { "Plugin" } th { "Version" } th { "Reloads" } th { "Last load" } } }
            tbody {
                @for plugin in plugins {
                    tr {
                        td {
                            (plugin.name)
                            @if let Some(registry) = &plugin.registry {
                                br; span.mono { (registry.reference) }
                            }
                        }
                        td.mono {
                            (plugin.version.as_deref().map_or("not loaded", |v| &v[..v.len().min(12)]))
                            @if let Some(registry) = &plugin.registry {
                                @if let Some(digest) = &registry.digest { br; (short_digest(digest)) }
                                @if registry.from_cache { br; "from the cache" }
                                @if let Some(error) = &registry.error { br; "registry: " (visible(error)) }
                            }
                        }
                        td.number { (plugin.reloads) @if plugin.rejected > 0 { " (" (plugin.rejected) " refused)" } }
                        td {
                            (plugin.last_reload.result) " at " (plugin.last_reload.at)
                            @if let Some(reason) = &plugin.last_reload.reason { ": " (visible(reason)) }
                        }
                    }
                }
            }
        }
    }
}

fn served(served: &Served) -> Markup {
    html! {
        @match served {
            Served::Here(_) => span.state.up { "served here" },
            Served::Elsewhere(owner) => span.state { "served by " (owner.as_deref().unwrap_or("no relay yet")) },
            Served::Starting { seconds, attempts, last_error } => span.state.down {
                "not served yet (" (seconds) " s, " (attempts) " tries): " (visible(last_error.as_deref().unwrap_or("connecting")))
            },
        }
    }
}

/// The filter form's values, as the page was asked for.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
pub struct FilterForm {
    /// Database name (a fleet's).
    #[serde(default)]
    pub database: String,
    /// Target name.
    #[serde(default)]
    pub target: String,
    /// Event type.
    #[serde(default)]
    pub event_type: String,
    /// Aggregate type.
    #[serde(default)]
    pub aggregate_type: String,
    /// Aggregate id.
    #[serde(default)]
    pub aggregate_id: String,
    /// Created at or after (RFC 3339 or a duration ago).
    #[serde(default)]
    pub since: String,
    /// Created before.
    #[serde(default)]
    pub until: String,
    /// Text in the last error.
    #[serde(default)]
    pub error: String,
    /// One row id (from a row's page).
    #[serde(default)]
    pub id: String,
}

impl FilterForm {
    /// The query string that asks for the same filter.
    pub fn query(&self) -> String {
        serde_urlencoded_pairs(&[
            ("database", &self.database),
            ("target", &self.target),
            ("event_type", &self.event_type),
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("since", &self.since),
            ("until", &self.until),
            ("error", &self.error),
            ("id", &self.id),
        ])
    }

    /// The hidden fields that carry the filter in a form.
    pub fn hidden(&self) -> Markup {
        html! {
            @for (name, value) in [("database", &self.database), ("target", &self.target), ("event_type", &self.event_type), ("aggregate_type", &self.aggregate_type), ("aggregate_id", &self.aggregate_id), ("since", &self.since), ("until", &self.until), ("error", &self.error), ("id", &self.id)] {
                @if !value.is_empty() { input type="hidden" name=(name) value=(value); }
            }
        }
    }
}

fn serde_urlencoded_pairs(pairs: &[(&str, &String)]) -> String {
    pairs
        .iter()
        .filter(|(_, value)| !value.is_empty())
        .map(|(name, value)| {
            format!(
                "{name}={}",
                percent_encoding::utf8_percent_encode(value, percent_encoding::NON_ALPHANUMERIC)
            )
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// The dead-letter list: the filter form, a page of rows, the next page's
/// link, and (signed in) replay and purge of the filtered set.
pub struct DeadLetterList<'a> {
    /// Database names to choose from.
    pub databases: &'a [String],
    /// Target names to choose from.
    pub targets: &'a [String],
    /// The filter asked for.
    pub filter: &'a FilterForm,
    /// The rows of this page, or why there are none.
    pub rows: Result<Vec<OutboxEntry>, String>,
    /// How many match, up to [`COUNT_BOUND`].
    pub matching: Option<i64>,
    /// The link to the next page, if there is one.
    pub next: Option<String>,
    /// Who looks.
    pub viewer: &'a Viewer,
    /// A message from the last action.
    pub done: Option<String>,
}

/// The dead-letter page.
pub fn dead_letters(list: &DeadLetterList<'_>) -> Markup {
    let filter = list.filter;
    html! {
        h1 { "Dead letters" }
        @if let Some(done) = &list.done { (message("done", done)) }
        form.filter method="get" action="/dead-letters" {
            label { "Database " select name="database" {
                @for name in list.databases { option value=(name) selected[*name == filter.database] { (name) } }
            } }
            label { "Target " select name="target" {
                option value="" { "any" }
                @for name in list.targets { option value=(name) selected[*name == filter.target] { (name) } }
            } }
            label { "Event type " input name="event_type" value=(filter.event_type); }
            label { "Aggregate type " input name="aggregate_type" value=(filter.aggregate_type); }
            label { "Aggregate id " input name="aggregate_id" value=(filter.aggregate_id); }
            label { "Since " input name="since" placeholder="2h or 2026-11-22T10:00:00Z" value=(filter.since); }
            label { "Until " input name="until" value=(filter.until); }
            label { "Error contains " input name="error" value=(filter.error); }
            button type="submit" { "Filter" }
        }
        @match &list.rows {
            Err(error) => (message("error", error)),
            Ok(rows) => {
                p.matching {
                    @match list.matching {
                        Some(n) if n >= MATCHING_BOUND => { (count(n).trim_end_matches(" or more")) " or more matching" }
                        Some(n) => { (count(n)) " matching" }
                        None => "",
                    }
                }
                @if list.viewer.who().is_some() && !rows.is_empty() {
                    p.actions {
                        a.button href={"/actions/confirm?action=replay&" (filter.query())} { "Replay the filtered set" }
                        " "
                        a.button.danger href={"/actions/confirm?action=purge&" (filter.query())} { "Purge the filtered set" }
                    }
                }
                table.dead-letters {
                    thead { tr { th { "Row" } th { "Event type" } th { "Aggregate" } th { "Created" } th { "Attempts" } th { "Last error" } } }
                    tbody {
                        @for row in rows {
                            tr data-row=(row.id) {
                                td { a href={"/dead-letters/" (row.id) "?database=" (filter.database)} { (row.id) } }
                                td { (visible(&row.event_type)) }
                                td { (visible(&row.aggregate_type)) "/" (visible(&row.aggregate_id)) }
                                td { (row.created_at) }
                                td.number { (row.attempts) }
                                td.error-text { (visible(&cut(row.last_error.as_deref().unwrap_or(""), ERROR_IN_LIST))) }
                            }
                        }
                    }
                }
                @if rows.is_empty() { p.empty { "No dead letters match." } }
                @if let Some(next) = &list.next { p { a.next href=(next) { "Next page" } } }
            }
        }
    }
}

/// One row, whole: where it is, per-target deliveries, and (signed in)
/// its payload and headers, replay and purge.
pub fn entry(database: &str, entry: &OutboxEntry, viewer: &Viewer, masks: &[String]) -> Markup {
    let trace: Vec<(&str, String)> = ["traceparent", "tracestate"]
        .into_iter()
        .filter_map(|name| {
            let value = entry.headers.get(name)?;
            Some((
                name,
                value.as_str().map_or_else(|| value.to_string(), str::to_string),
            ))
        })
        .collect();
    html! {
        h1 { "Event " (entry.event_id) }
        dl.event {
            dt { "Database" } dd { (database) }
            dt { "Row" } dd { (entry.id) }
            dt { "Status" } dd.status { (entry.status) }
            dt { "Event type" } dd { (visible(&entry.event_type)) }
            dt { "Aggregate" } dd { (visible(&entry.aggregate_type)) "/" (visible(&entry.aggregate_id)) }
            dt { "Created" } dd { (entry.created_at) }
            dt { "Attempts" } dd { (entry.attempts) }
            dt { "Last error" } dd.last-error { (visible(entry.last_error.as_deref().unwrap_or("none"))) }
            dt { "Plugin version" } dd.mono { (entry.plugin_version.as_deref().unwrap_or("none")) }
            dt { "Trace context" } dd.mono {
                @if trace.is_empty() { "none" }
                @for (name, value) in &trace { div { (name) ": " (visible(value)) } }
            }
        }
        h2 { "Deliveries" }
        @if entry.deliveries.is_empty() {
            p { "None: no target was tried (the plugin routed it nowhere, or it failed before publishing)." }
        } @else {
            table.deliveries {
                thead { tr { th { "Target" } th { "Topic" } th { "State" } } }
                tbody {
                    @for delivery in entry.deliveries.values() {
                        tr {
                            td { (visible(&delivery.target)) }
                            td { (visible(&delivery.topic)) }
                            td {
                                @match (&delivery.acked_at, &delivery.error) {
                                    (Some(at), _) => { "published at " (at) }
                                    (None, Some(error)) => { span.state.down { "failed" } ": " (visible(error)) }
                                    (None, None) => "not yet",
                                }
                            }
                        }
                    }
                }
            }
        }
        h2 { "Payload and headers" }
        @match viewer {
            Viewer::NoTokens => p.muted { "Payloads are not shown: no admin token is configured (admin.tokens)." },
            Viewer::SignedOut => p { a href="/sign-in" { "Sign in" } " with an admin token to see the payload and headers." },
            Viewer::SignedIn(_) => {
                pre.payload { (payload_text(entry, masks)) }
                h3 { "Headers" }
                pre.headers { (visible(&cut(&pretty(&entry.headers, masks), PREVIEW_BYTES))) }
            }
        }
        @if viewer.who().is_some() && entry.status == "dead" {
            @let one = FilterForm { database: database.to_string(), id: entry.id.to_string(), ..FilterForm::default() };
            p.actions {
                a.button href={"/actions/confirm?action=replay&" (one.query())} { "Replay this event" }
                " "
                a.button.danger href={"/actions/confirm?action=purge&" (one.query())} { "Purge this event" }
            }
        }
    }
}

fn payload_text(entry: &OutboxEntry, masks: &[String]) -> String {
    match (&entry.payload, entry.payload_bytes_len) {
        (Some(payload), _) => visible(&cut(&pretty(payload, masks), PREVIEW_BYTES)),
        (None, Some(len)) => format!("A binary payload of {len} bytes (not shown)."),
        (None, None) => "No payload.".to_string(),
    }
}

fn pretty(value: &serde_json::Value, masks: &[String]) -> String {
    let mut value = value.clone();
    crate::mask::mask(&mut value, masks);
    serde_json::to_string_pretty(&value).unwrap_or_default()
}

/// The event search form, and what it found.
pub fn find_event(id: &str, found: Option<Markup>) -> Markup {
    html! {
        h1 { "Find an event" }
        form method="get" action="/events" {
            label { "Event id " input name="id" size="40" value=(id) placeholder="00000000-0000-0000-0000-000000000000"; }
            button type="submit" { "Find" }
        }
        @if let Some(found) = found { (found) }
    }
}

/// Asks to confirm an action on `matching` rows.
pub fn confirm(action: &str, filter: &FilterForm, matching: i64, who: &Who, changed: Option<i64>) -> Markup {
    let verb = if action == "purge" {
        "Purge (delete for good)"
    } else {
        "Replay (publish again)"
    };
    html! {
        h1 { "Confirm" }
        @if let Some(before) = changed {
            (message("notice", &format!("The filtered set changed since you asked: it was {before}, it is {matching} now. Confirm again.")))
        }
        p.confirm { (verb) " " strong.count { (matching) } " dead letter(s) of database " strong { (filter.database) } "?" }
        (filter_summary(filter))
        @if matching > 0 {
            form.confirm method="post" action="/actions" {
                (filter.hidden())
                input type="hidden" name="action" value=(action);
                input type="hidden" name="expected" value=(matching);
                input type="hidden" name="csrf" value=(who.csrf);
                button.danger[action == "purge"] type="submit" { (verb) " " (matching) }
            }
        }
        p { a href={"/dead-letters?" (filter.query())} { "Back to the list" } }
    }
}

fn filter_summary(filter: &FilterForm) -> Markup {
    html! {
        ul.filter-summary {
            @for (name, value) in [("row", &filter.id), ("target", &filter.target), ("event type", &filter.event_type), ("aggregate type", &filter.aggregate_type), ("aggregate id", &filter.aggregate_id), ("since", &filter.since), ("until", &filter.until), ("error contains", &filter.error)] {
                @if !value.is_empty() { li { (name) ": " (visible(value)) } }
            }
        }
    }
}

/// The sign-in form.
pub fn sign_in(error: Option<&str>) -> Markup {
    html! {
        h1 { "Sign in" }
        @if let Some(error) = error { (message("error", error)) }
        form.sign-in method="post" action="/sign-in" {
            label { "Admin token " input type="password" name="token" autocomplete="off" autofocus; }
            button type="submit" { "Sign in" }
        }
        p.muted { "A token of the relay's admin.tokens lets you see payloads and replay or purge dead letters. Your actions are logged with its name." }
    }
}

/// A count, with "or more" once it reached the bound it was counted to.
pub fn count(n: i64) -> String {
    let digits = n.to_string();
    let mut grouped = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) && c != '-' {
            grouped.push(',');
        }
        grouped.push(c);
    }
    if n >= COUNT_BOUND {
        format!("{grouped} or more")
    } else {
        grouped
    }
}

/// Seconds as a person reads them.
pub fn duration(seconds: f64) -> String {
    if seconds < 1.0 {
        format!("{:.0} ms", seconds * 1000.0)
    } else if seconds < 120.0 {
        format!("{seconds:.1} s")
    } else if seconds < 7200.0 {
        format!("{:.0} min", seconds / 60.0)
    } else {
        format!("{:.1} h", seconds / 3600.0)
    }
}

fn bytes(n: i64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if n < 1024 * 1024 {
        format!("{n} bytes")
    } else {
        format!("{:.1} MiB", n as f64 / MIB)
    }
}

/// `text` with control characters (but newlines and tabs) written as
/// `\u{..}` escapes: a NUL or an escape sequence in an event shows as text.
pub fn visible(text: &str) -> String {
    if !text.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return text.to_string();
    }
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\n' && c != '\t' {
                format!("\\u{{{:04x}}}", u32::from(c))
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// At most `limit` bytes of `text`, cut at a character, saying how much
/// was left out.
pub fn cut(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_string();
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} more bytes)", &text[..end], text.len() - end)
}

/// The stylesheet.
pub const CSS: &str = include_str!("console.css");

/// The script that refreshes a live page's main part every second.
pub const SCRIPT: &str = include_str!("console.js");

/// Markup from a trusted constant.
pub fn trusted(text: &'static str) -> Markup {
    PreEscaped(text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registry_plugin_shows_its_reference_digest_and_registry_state() {
        let digest = format!("sha256:{}", "ab".repeat(32));
        let plugin = PluginStatus {
            name: "router".into(),
            path: "oci://localhost:5000/team/router:live".into(),
            version: Some("0123456789ab".into()),
            reloads: 2,
            rejected: 0,
            last_reload: crate::admin::LastReload {
                at: "2026-11-29T10:00:00.000Z".into(),
                result: "loaded".into(),
                version: Some("0123456789ab".into()),
                reason: None,
            },
            registry: Some(crate::admin::RegistrySource {
                reference: "oci://localhost:5000/team/router:live".into(),
                digest: Some(digest.clone()),
                from_cache: true,
                error: Some("<b>connection refused</b>".into()),
                checked_at: None,
                pulls: 1,
                cache_hits: 0,
                last_pull_ms: Some(12),
            }),
        };
        let html = plugins_table(&[plugin]).into_string();
        for shown in [
            "oci://localhost:5000/team/router:live",
            &digest[..19],
            "from the cache",
            "registry: &lt;b&gt;connection refused&lt;/b&gt;",
        ] {
            assert!(html.contains(shown), "{shown} missing from {html}");
        }
        assert!(!html.contains(&digest), "the digest is shortened: {html}");
    }

    #[test]
    fn hostile_text_stays_text() {
        let row = OutboxEntry {
            id: 7,
            event_id: "e".into(),
            event_type: "<script>alert(1)</script>".into(),
            aggregate_type: "\"'><img src=x onerror=alert(2)>".into(),
            aggregate_id: "a\u{0}b\u{1b}[31m".into(),
            status: "dead".into(),
            last_error: Some("</td><script>alert(3)</script>".into()),
            headers: serde_json::json!({"traceparent": "<b>x</b>"}),
            payload: Some(serde_json::json!({"html": "<script>alert(4)</script>"})),
            ..OutboxEntry::default()
        };
        let who = Viewer::SignedIn(Who {
            name: "ops".into(),
            csrf: "c".into(),
        });
        let page = layout("t", &who, false, entry("db", &row, &who, &[])).into_string();
        assert!(!page.contains("<script>alert"), "{page}");
        assert!(!page.contains("<img"), "{page}");
        assert!(!page.contains("<b>x"), "{page}");
        assert!(page.contains("&lt;script&gt;alert(1)"), "{page}");
        assert!(page.contains("a\\u{0000}b\\u{001b}[31m"), "{page}");
        assert!(!page.contains('\u{0}'), "no raw NUL");
    }

    #[test]
    fn counts_say_when_they_stopped() {
        assert_eq!(count(0), "0");
        assert_eq!(count(1234567), "1,234,567 or more");
        assert_eq!(count(99_999), "99,999");
        assert_eq!(cut("ééé", 3), "é… (4 more bytes)");
    }
}
