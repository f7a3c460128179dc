//! The operator's console (`[admin] console = true`): server-rendered
//! pages on the admin endpoint. The overview (databases, targets, plugins,
//! the replication slot, recent throughput and latency), the dead letters
//! (filtered, paged, each opening to its deliveries and, for a signed-in
//! person, its payload; replay and purge with a count to confirm), and one
//! event found by its id.
//!
//! The pages that only show state follow the endpoint's exposure; payloads
//! and actions need a named admin token ([`auth`]). Every action is logged
//! with the token's name, what it did and to how many rows.

pub mod auth;
pub mod charts;
pub mod pages;
pub mod view;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Form, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use maud::{Markup, html};
use tokio_util::sync::CancellationToken;

use self::auth::{Auth, Refusal};
use self::charts::Charts;
use self::pages::{FilterForm, Viewer};
use self::view::{DatabaseLine, FigureCache, QUERY_TIMEOUT, Served, TargetChecks};
use crate::config::AdminConfig;
use crate::fleet::{DatabaseState, Fleet};
use crate::store::{DeadLetterFilter, OutboxEntry};

/// Rows on a page of dead letters.
const PAGE_SIZE: u32 = 50;

/// Rows one replay or purge statement changes.
const ACTION_BATCH: u32 = 1000;

/// The console's state, shared by its handlers.
#[derive(Clone)]
struct Console {
    inner: Arc<Inner>,
}

struct Inner {
    fleet: Fleet,
    auth: Auth,
    charts: Charts,
    figures: FigureCache,
    checks: TargetChecks,
    masks: Vec<String>,
}

/// The console's routes over `fleet`, with its charts sampled until
/// `shutdown`.
pub fn router(fleet: Fleet, admin: &AdminConfig, shutdown: CancellationToken) -> Router {
    let console = Console {
        inner: Arc::new(Inner {
            fleet,
            auth: Auth::new(admin.tokens.clone(), admin.actions_per_minute),
            charts: Charts::default(),
            figures: FigureCache::default(),
            checks: TargetChecks::default(),
            masks: admin.mask_fields.clone(),
        }),
    };
    tokio::spawn(sample(console.clone(), shutdown));
    let hosts: Arc<[String]> = admin.console_hosts.clone().into();
    Router::new()
        .route("/", get(overview))
        .route("/db/{name}", get(database_page))
        .route("/dead-letters", get(dead_letters))
        .route("/dead-letters/{id}", get(dead_letter))
        .route("/events", get(find_event))
        .route("/actions/confirm", get(confirm))
        .route("/actions", post(act))
        .route("/sign-in", get(sign_in_page).post(sign_in))
        .route("/sign-out", post(sign_out))
        .route(
            "/console.css",
            get(|| async { ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], pages::CSS) }),
        )
        .route(
            "/console.js",
            get(|| async {
                (
                    [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
                    pages::SCRIPT,
                )
            }),
        )
        .layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let hosts = hosts.clone();
                async move {
                    if auth::known_host(request.headers(), &hosts) {
                        next.run(request).await
                    } else {
                        let host = request
                            .headers()
                            .get(header::HOST)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("");
                        tracing::warn!(host, "Console: a request for an unknown host name was refused.");
                        (
                            StatusCode::MISDIRECTED_REQUEST,
                            "This console answers to localhost, IP addresses and admin.console_hosts only.\n",
                        )
                            .into_response()
                    }
                }
            },
        ))
        .layer(axum::middleware::map_response(protect))
        .with_state(console)
}

/// Every console answer: no inline script or style may run (what escaping
/// missed cannot execute), no framing, no caching of pages with payloads.
async fn protect(mut response: Response) -> Response {
    let headers = response.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; \
             form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        // Not `no-referrer`: that makes a browser send `Origin: null` on its own forms.
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// Samples every served database's tally for the charts, and starts a
/// round of target health checks.
async fn sample(console: Console, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(charts::SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        let now = console
            .inner
            .fleet
            .databases()
            .into_iter()
            .filter_map(|(name, state)| match state {
                DatabaseState::Running(relay) => Some((name, relay.metrics().recent().sample())),
                DatabaseState::Starting { .. } | DatabaseState::Standby { .. } => None,
            })
            .collect();
        console.inner.charts.record(now);
        console.inner.checks.refresh(&console.inner.fleet);
    }
}

impl Console {
    async fn viewer(&self, headers: &HeaderMap) -> Viewer {
        if !self.inner.auth.enabled() {
            return Viewer::NoTokens;
        }
        match self.inner.auth.who(headers).await {
            Some(who) => Viewer::SignedIn(who),
            None => Viewer::SignedOut,
        }
    }

    fn page(&self, title: &str, viewer: &Viewer, live: bool, body: Markup) -> Response {
        html_page(StatusCode::OK, pages::layout(title, viewer, live, body))
    }

    fn database_names(&self) -> Vec<String> {
        self.inner.fleet.databases().into_keys().collect()
    }

    /// The database a request names, or the first one when it names none.
    fn database(&self, asked: &str) -> Result<(String, crate::relay::Relay), String> {
        let databases = self.inner.fleet.databases();
        let name = if asked.is_empty() {
            databases.keys().next().cloned().unwrap_or_default()
        } else {
            asked.to_string()
        };
        match databases.get(&name).cloned().map(Served::from) {
            Some(Served::Here(relay)) => Ok((name, relay)),
            Some(Served::Elsewhere(owner)) => Err(format!(
                "Database {name} is served by {}, not by this relay: its console shows it.",
                owner.as_deref().unwrap_or("no relay yet")
            )),
            Some(Served::Starting { last_error, .. }) => Err(format!(
                "Database {name} is not served yet: {}",
                last_error.as_deref().unwrap_or("connecting")
            )),
            None if databases.is_empty() => Err("This relay serves no database yet.".to_string()),
            None => Err(format!("No database {name:?} here.")),
        }
    }
}

fn html_page(status: StatusCode, markup: Markup) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        markup.into_string(),
    )
        .into_response()
}

async fn overview(State(console): State<Console>, headers: HeaderMap) -> Response {
    let viewer = console.viewer(&headers).await;
    let fleet = &console.inner.fleet;
    let databases = view::databases(fleet, &console.inner.figures).await;
    let targets = view::targets(fleet, &console.inner.checks);
    let plugins = view::plugins(fleet);
    if fleet.alone()
        && let Some(line) = databases.first()
    {
        let body = database_body(&console, line, Some((&targets, &plugins))).await;
        return console.page("Overview", &viewer, true, body);
    }
    let points = |name: &str| console.inner.charts.points(name);
    let body = pages::fleet_overview(&databases, &points, &targets, &plugins);
    console.page("Overview", &viewer, true, body)
}

async fn database_body(
    console: &Console,
    line: &DatabaseLine,
    shared: Option<(&[view::TargetLine], &[crate::admin::PluginStatus])>,
) -> Markup {
    let slot = match &line.served {
        Served::Here(relay) => view::slot(relay).await,
        Served::Elsewhere(_) | Served::Starting { .. } => None,
    };
    let points = console.inner.charts.points(&line.name);
    pages::database_overview(line, &points, slot.as_ref(), shared)
}

async fn database_page(
    State(console): State<Console>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let viewer = console.viewer(&headers).await;
    let Some(state) = console.inner.fleet.databases().remove(&name) else {
        let body = pages::message("error", &format!("No database {name:?} here."));
        return html_page(
            StatusCode::NOT_FOUND,
            pages::layout("Not found", &viewer, false, body),
        );
    };
    let served = Served::from(state);
    let figures = match &served {
        Served::Here(relay) => Some(console.inner.figures.figures(&name, relay).await),
        Served::Elsewhere(_) | Served::Starting { .. } => None,
    };
    let line = DatabaseLine {
        name,
        served,
        figures,
    };
    let body = database_body(&console, &line, None).await;
    console.page(&line.name, &viewer, true, body)
}

/// `?after=` and `?done=` beside a filter.
#[derive(Debug, Default, serde::Deserialize)]
struct ListQuery {
    #[serde(default)]
    after: String,
    #[serde(default)]
    done: String,
}

/// The store's filter for a form, or what is wrong with it.
fn store_filter(form: &FilterForm) -> Result<DeadLetterFilter, String> {
    let text = |value: &String| (!value.trim().is_empty()).then(|| value.trim().to_string());
    let time = |value: &String, name: &str| {
        text(value)
            .map(|value| DeadLetterFilter::time_ms(&value).map_err(|e| format!("{name}: {e}")))
            .transpose()
    };
    let ids = match text(&form.id) {
        Some(id) => vec![
            id.parse::<i64>()
                .map_err(|_| format!("row {id:?} is not a row id"))?,
        ],
        None => Vec::new(),
    };
    Ok(DeadLetterFilter {
        ids,
        event_type: text(&form.event_type),
        aggregate_type: text(&form.aggregate_type),
        aggregate_id: text(&form.aggregate_id),
        created_since_ms: time(&form.since, "since")?,
        created_before_ms: time(&form.until, "until")?,
        error_contains: text(&form.error),
        target: text(&form.target),
    })
}

async fn dead_letters(
    State(console): State<Console>,
    Query(mut form): Query<FilterForm>,
    Query(list): Query<ListQuery>,
    headers: HeaderMap,
) -> Response {
    let viewer = console.viewer(&headers).await;
    let databases = console.database_names();
    let targets: Vec<String> = console.inner.fleet.sinks().names().map(str::to_string).collect();
    let picked = console.database(&form.database);
    if let Ok((name, _)) = &picked {
        form.database.clone_from(name);
    }
    let after = list.after.parse::<i64>().unwrap_or(0);
    let (rows, matching, next) = match (picked, store_filter(&form)) {
        (Err(error), _) | (_, Err(error)) => (Err(error), None, None),
        (Ok((_, relay)), Ok(filter)) => {
            let store = relay.store();
            let read = async {
                futures::try_join!(
                    store.dead_letters(&filter, after, PAGE_SIZE + 1),
                    store.count_dead_letters_to(&filter, view::MATCHING_BOUND)
                )
            };
            match tokio::time::timeout(QUERY_TIMEOUT, read).await {
                Ok(Ok((mut rows, matching))) => {
                    let next = (rows.len() > PAGE_SIZE as usize).then(|| {
                        rows.truncate(PAGE_SIZE as usize);
                        let last = rows.last().map_or(after, |row| row.id);
                        format!("/dead-letters?{}&after={last}", form.query())
                    });
                    (Ok(rows), Some(matching), next)
                }
                Ok(Err(error)) => (Err(database_error(&form.database, &error)), None, None),
                Err(_) => (Err(no_answer(&form.database)), None, None),
            }
        }
    };
    let done = (!list.done.is_empty()).then_some(list.done);
    let body = pages::dead_letters(&pages::DeadLetterList {
        databases: &databases,
        targets: &targets,
        filter: &form,
        rows,
        matching,
        next,
        viewer: &viewer,
        done,
    });
    console.page("Dead letters", &viewer, false, body)
}

fn database_error(database: &str, error: &crate::store::Error) -> String {
    format!(
        "Database {database} does not answer: {}",
        crate::redact::url(&error.to_string())
    )
}

fn no_answer(database: &str) -> String {
    format!(
        "Database {database} gave no answer within {} s.",
        QUERY_TIMEOUT.as_secs()
    )
}

/// `?database=` alone.
#[derive(Debug, Default, serde::Deserialize)]
struct DatabaseQuery {
    #[serde(default)]
    database: String,
}

async fn dead_letter(
    State(console): State<Console>,
    Path(id): Path<i64>,
    Query(query): Query<DatabaseQuery>,
    headers: HeaderMap,
) -> Response {
    let viewer = console.viewer(&headers).await;
    if let Some(refusal) = signed_out(&viewer) {
        return refusal;
    }
    let (name, relay) = match console.database(&query.database) {
        Ok(found) => found,
        Err(error) => return not_found(&console, &viewer, &error),
    };
    match tokio::time::timeout(
        QUERY_TIMEOUT,
        relay.store().entry(id, matches!(viewer, Viewer::SignedIn(_))),
    )
    .await
    {
        Ok(Ok(Some(entry))) => {
            let body = pages::entry(&name, &entry, &viewer, &console.inner.masks);
            console.page(&format!("Row {id}"), &viewer, false, body)
        }
        Ok(Ok(None)) => not_found(&console, &viewer, &format!("Database {name} has no row {id}.")),
        Ok(Err(error)) => unavailable(&viewer, &database_error(&name, &error)),
        Err(_) => unavailable(&viewer, &no_answer(&name)),
    }
}

/// With tokens configured, an event page needs a session: rows open by
/// sequential id, and even without its payload an event shows its
/// aggregate, its last error and its trace context. (With none, the pages
/// are as open as the endpoint, which is the operator's choice.)
fn signed_out(viewer: &Viewer) -> Option<Response> {
    matches!(viewer, Viewer::SignedOut).then(|| {
        html_page(
            StatusCode::FORBIDDEN,
            pages::layout(
                "Sign in",
                viewer,
                false,
                pages::message("error", "Sign in with an admin token to open an event."),
            ),
        )
    })
}

fn not_found(console: &Console, viewer: &Viewer, why: &str) -> Response {
    let _ = console;
    html_page(
        StatusCode::NOT_FOUND,
        pages::layout("Not found", viewer, false, pages::message("error", why)),
    )
}

fn unavailable(viewer: &Viewer, why: &str) -> Response {
    html_page(
        StatusCode::SERVICE_UNAVAILABLE,
        pages::layout("Not available", viewer, false, pages::message("error", why)),
    )
}

/// `?id=&database=` of the event search.
#[derive(Debug, Default, serde::Deserialize)]
struct EventQuery {
    #[serde(default)]
    id: String,
    #[serde(default)]
    database: String,
}

async fn find_event(
    State(console): State<Console>,
    Query(query): Query<EventQuery>,
    headers: HeaderMap,
) -> Response {
    let viewer = console.viewer(&headers).await;
    let asked = query.id.trim();
    if asked.is_empty() {
        return console.page("Find an event", &viewer, false, pages::find_event("", None));
    }
    if let Some(refusal) = signed_out(&viewer) {
        return refusal;
    }
    let Ok(event_id) = uuid::Uuid::parse_str(asked) else {
        let found = pages::message("error", &format!("{asked:?} is not an event id (a UUID)."));
        return console.page(
            "Find an event",
            &viewer,
            false,
            pages::find_event(asked, Some(found)),
        );
    };
    // Each database served here, by the unique index on event_id; a fleet's
    // databases a bounded number at a time.
    let databases: Vec<(String, crate::relay::Relay)> = console
        .inner
        .fleet
        .databases()
        .into_iter()
        .filter(|(name, _)| query.database.is_empty() || *name == query.database)
        .filter_map(|(name, state)| match state {
            DatabaseState::Running(relay) => Some((name, relay)),
            DatabaseState::Starting { .. } | DatabaseState::Standby { .. } => None,
        })
        .collect();
    let results: Vec<(String, Result<Option<OutboxEntry>, String>)> = futures::stream::iter(databases)
        .map(|(name, relay)| async move {
            let found = match tokio::time::timeout(QUERY_TIMEOUT, relay.store().event(event_id)).await {
                Ok(Ok(found)) => Ok(found),
                Ok(Err(error)) => Err(database_error(&name, &error)),
                Err(_) => Err(no_answer(&name)),
            };
            (name, found)
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let mut failures = Vec::new();
    let mut found = None;
    for (name, result) in results {
        match result {
            Ok(Some(entry)) => found = Some((name, entry)),
            Ok(None) => {}
            Err(error) => failures.push(error),
        }
    }
    let shown = html! {
        @for failure in &failures { (pages::message("error", failure)) }
        @match &found {
            Some((name, entry)) => (pages::entry(name, entry, &viewer, &console.inner.masks)),
            None => (pages::message("notice", "No database served here has that event: it was never written, is still in the intake waiting for a relay, or retention removed it after it was published.")),
        }
    };
    console.page("Event", &viewer, false, pages::find_event(asked, Some(shown)))
}

/// `?action=` beside a filter.
#[derive(Debug, Default, serde::Deserialize)]
struct ActionQuery {
    #[serde(default)]
    action: String,
}

fn action_name(action: &str) -> Option<&'static str> {
    match action {
        "replay" => Some("replay"),
        "purge" => Some("purge"),
        _ => None,
    }
}

async fn confirm(
    State(console): State<Console>,
    Query(mut form): Query<FilterForm>,
    Query(query): Query<ActionQuery>,
    headers: HeaderMap,
) -> Response {
    let viewer = console.viewer(&headers).await;
    let Some(who) = viewer.who().cloned() else {
        return refused(&viewer, &refusal_of(&viewer));
    };
    let Some(action) = action_name(&query.action) else {
        return refused(&viewer, "no such action: replay or purge");
    };
    let (name, relay) = match console.database(&form.database) {
        Ok(found) => found,
        Err(error) => return not_found(&console, &viewer, &error),
    };
    form.database = name;
    let filter = match store_filter(&form) {
        Ok(filter) => filter,
        Err(error) => return refused(&viewer, &error),
    };
    match tokio::time::timeout(QUERY_TIMEOUT, relay.store().count_dead_letters(&filter)).await {
        Ok(Ok(matching)) => console.page(
            "Confirm",
            &viewer,
            false,
            pages::confirm(action, &form, matching, &who, None),
        ),
        Ok(Err(error)) => unavailable(&viewer, &database_error(&form.database, &error)),
        Err(_) => unavailable(&viewer, &no_answer(&form.database)),
    }
}

fn refusal_of(viewer: &Viewer) -> String {
    match viewer {
        Viewer::NoTokens => Refusal::NoTokens.to_string(),
        Viewer::SignedOut | Viewer::SignedIn(_) => Refusal::SignedOut.to_string(),
    }
}

fn refused(viewer: &Viewer, why: &str) -> Response {
    html_page(
        StatusCode::FORBIDDEN,
        pages::layout("Refused", viewer, false, pages::message("error", why)),
    )
}

/// The confirmed action's form.
#[derive(Debug, Default, serde::Deserialize)]
struct ActionForm {
    #[serde(default)]
    action: String,
    #[serde(default)]
    expected: String,
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    database: String,
    #[serde(default)]
    target: String,
    #[serde(default)]
    event_type: String,
    #[serde(default)]
    aggregate_type: String,
    #[serde(default)]
    aggregate_id: String,
    #[serde(default)]
    since: String,
    #[serde(default)]
    until: String,
    #[serde(default)]
    error: String,
    #[serde(default)]
    id: String,
}

impl ActionForm {
    fn filter(&self) -> FilterForm {
        FilterForm {
            database: self.database.clone(),
            target: self.target.clone(),
            event_type: self.event_type.clone(),
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            since: self.since.clone(),
            until: self.until.clone(),
            error: self.error.clone(),
            id: self.id.clone(),
        }
    }
}

async fn act(State(console): State<Console>, headers: HeaderMap, Form(form): Form<ActionForm>) -> Response {
    let auth = &console.inner.auth;
    let who = match auth.check_form(&headers, &form.csrf).await {
        Ok(who) => who,
        Err(refusal) => {
            tracing::warn!(reason = %refusal, "Console: an action was refused.");
            let viewer = console.viewer(&headers).await;
            return refused(&viewer, &refusal.to_string());
        }
    };
    let viewer = Viewer::SignedIn(who.clone());
    let Some(action) = action_name(&form.action) else {
        return refused(&viewer, "no such action: replay or purge");
    };
    let filter_form = form.filter();
    let (name, relay) = match console.database(&filter_form.database) {
        Ok(found) => found,
        Err(error) => return not_found(&console, &viewer, &error),
    };
    let filter = match store_filter(&filter_form) {
        Ok(filter) => filter,
        Err(error) => return refused(&viewer, &error),
    };
    let Ok(expected) = form.expected.parse::<i64>() else {
        return refused(&viewer, "the form does not say how many rows it confirms");
    };
    if let Err(refusal) = auth.take_action(&who) {
        tracing::warn!(token = %who.name, action, database = %name, "Console: an action was refused: too many in the last minute.");
        return html_page(
            StatusCode::TOO_MANY_REQUESTS,
            pages::layout(
                "Refused",
                &viewer,
                false,
                pages::message("error", &refusal.to_string()),
            ),
        );
    }
    let store = relay.store();
    // The set confirmed must be the set changed: a count that moved since
    // the confirmation asks again.
    let matching = match tokio::time::timeout(QUERY_TIMEOUT, store.count_dead_letters(&filter)).await {
        Ok(Ok(matching)) => matching,
        Ok(Err(error)) => return unavailable(&viewer, &database_error(&name, &error)),
        Err(_) => return unavailable(&viewer, &no_answer(&name)),
    };
    if matching != expected {
        let body = pages::confirm(action, &filter_form, matching, &who, Some(expected));
        return html_page(
            StatusCode::CONFLICT,
            pages::layout("Confirm", &viewer, false, body),
        );
    }
    let changed = match change(store, action, &filter, expected).await {
        Ok(changed) => changed,
        Err((changed, error)) => {
            tracing::warn!(token = %who.name, action, database = %name, rows = changed, filter = ?filter, error = %error, "Console: an action stopped partway.");
            return unavailable(
                &viewer,
                &format!(
                    "{changed} row(s) done, then: {}",
                    crate::redact::url(&error.to_string())
                ),
            );
        }
    };
    tracing::info!(token = %who.name, action, database = %name, rows = changed, filter = ?filter, "Console: dead letters {}.", if action == "purge" { "purged" } else { "replayed" });
    let done = format!(
        "{} {changed} dead letter(s).",
        if action == "purge" { "Purged" } else { "Replayed" }
    );
    let back = FilterForm {
        id: String::new(),
        ..filter_form
    };
    let location = format!(
        "/dead-letters?{}&done={}",
        back.query(),
        percent_encoding::utf8_percent_encode(&done, percent_encoding::NON_ALPHANUMERIC)
    );
    Redirect::to(&location).into_response()
}

/// Replays or purges at most `limit` rows matching `filter`, in batches;
/// how many, or how many before an error.
async fn change(
    store: &crate::store::OutboxStore,
    action: &str,
    filter: &DeadLetterFilter,
    limit: i64,
) -> Result<i64, (i64, crate::store::Error)> {
    let mut changed = 0_i64;
    let mut after = 0;
    while changed < limit {
        let batch = u32::try_from((limit - changed).min(i64::from(ACTION_BATCH))).unwrap_or(ACTION_BATCH);
        let done = if action == "purge" {
            store
                .purge_dead_letters(filter, batch)
                .await
                .map(|n| i64::try_from(n).unwrap_or(i64::MAX))
        } else {
            store.replay_dead_letters(filter, after, batch).await.map(|ids| {
                after = ids.last().copied().unwrap_or(after);
                i64::try_from(ids.len()).unwrap_or(i64::MAX)
            })
        }
        .map_err(|error| (changed, error))?;
        changed += done;
        if done == 0 {
            break;
        }
    }
    Ok(changed)
}

async fn sign_in_page(State(console): State<Console>, headers: HeaderMap) -> Response {
    let viewer = console.viewer(&headers).await;
    if matches!(viewer, Viewer::NoTokens) {
        return refused(&viewer, &Refusal::NoTokens.to_string());
    }
    console.page("Sign in", &viewer, false, pages::sign_in(None))
}

/// The sign-in form.
#[derive(Debug, Default, serde::Deserialize)]
struct SignInForm {
    #[serde(default)]
    token: String,
}

async fn sign_in(
    State(console): State<Console>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<std::net::SocketAddr>,
    headers: HeaderMap,
    Form(form): Form<SignInForm>,
) -> Response {
    let auth = &console.inner.auth;
    let viewer = console.viewer(&headers).await;
    if let Err(refusal) = auth::same_site(&headers) {
        return refused(&viewer, &refusal.to_string());
    }
    match auth.sign_in(form.token.trim(), peer.ip()).await {
        Ok((id, _)) => {
            let mut response = Redirect::to("/").into_response();
            if let Ok(cookie) = HeaderValue::from_str(&auth::session_cookie(&id)) {
                response.headers_mut().insert(header::SET_COOKIE, cookie);
            }
            response
        }
        Err(refusal) => {
            let status = match refusal {
                Refusal::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
                _ => StatusCode::FORBIDDEN,
            };
            html_page(
                status,
                pages::layout(
                    "Sign in",
                    &viewer,
                    false,
                    pages::sign_in(Some(&refusal.to_string())),
                ),
            )
        }
    }
}

/// The sign-out form.
#[derive(Debug, Default, serde::Deserialize)]
struct SignOutForm {
    #[serde(default)]
    csrf: String,
}

async fn sign_out(
    State(console): State<Console>,
    headers: HeaderMap,
    Form(form): Form<SignOutForm>,
) -> Response {
    if let Err(refusal) = console.inner.auth.check_form(&headers, &form.csrf).await {
        let viewer = console.viewer(&headers).await;
        return refused(&viewer, &refusal.to_string());
    }
    console.inner.auth.sign_out(&headers);
    let mut response = Redirect::to("/").into_response();
    if let Ok(cookie) = HeaderValue::from_str(&auth::cleared_cookie()) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}
