//! The operator's console in a real browser (Debian's chromium through
//! chromedriver) over a relay process on PostgreSQL and NATS: the overview
//! follows a target into a pause and out of it; a poison event is found,
//! opened, refused a replay without a token and replayed with one; a
//! filtered purge removes exactly the filtered rows; no secret reaches a
//! page; wrong, missing and cross-site requests are refused. And the plans
//! of the pages' queries read indexes on a table with enough rows to matter.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream;
use switchyard_tests::browser::Browser;
use switchyard_tests::config::{Plugin, Target, TestConfig, strings};
use switchyard_tests::nats::NatsServer;
use switchyard_tests::plugins::plugin;
use switchyard_tests::postgres::{TestDb, count_status, fresh_db};
use switchyard_tests::relay::RelaySection;
use switchyard_tests::{eventually, exclusive, free_port, init_logging, readyz_answers, try_http_get};
use tokio_util::sync::CancellationToken;

const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");

/// The admin token the tests sign in with.
const TOKEN: &str = "console-ops-token-0123456789";

/// Streams in these tests take messages up to this size: a bigger event
/// is the poison one, refused until the stream is widened.
const STREAM_LIMIT: i32 = 4096;

/// A relay process with its console, its log kept in a file.
struct Relay {
    child: Child,
    admin: SocketAddr,
    dir: PathBuf,
}

impl Relay {
    /// Starts the relay process for `config` (the console and its token
    /// added) and waits until it is ready.
    async fn start(config: TestConfig) -> Relay {
        let relay = Relay::spawn(config);
        readyz_answers(relay.admin, 200).await;
        relay
    }

    /// Starts the relay process for `config`, the console and its token added.
    fn spawn(config: TestConfig) -> Relay {
        let dir = std::env::temp_dir().join(format!("sy-console-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        // The token from a file, as a Kubernetes secret hands it over.
        std::fs::write(dir.join("ops-token"), format!("{TOKEN}\n")).unwrap();
        let port = free_port();
        let config = config
            .set("admin", "listen", format!("127.0.0.1:{port}"))
            .set("admin", "console", true)
            .set("admin", "mask_fields", strings(&["card"]))
            .set(
                "admin.tokens.ops",
                "file",
                dir.join("ops-token").display().to_string(),
            )
            .set("plugin_runtime", "cache", false);
        let path = dir.join("relay.toml");
        std::fs::write(&path, config.toml()).unwrap();
        let log = std::fs::File::create(dir.join("relay.log")).unwrap();
        let child = Command::new(SWITCHYARD)
            .args(["run", "--config"])
            .arg(&path)
            .env("SWITCHYARD_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn relay process");
        let admin = SocketAddr::from(([127, 0, 0, 1], port));
        Relay { child, admin, dir }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("relay.log")).unwrap_or_default()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The relay's config: route-by-type to NATS target `events`, topics
/// `orders.<event type>`, two attempts before a row is dead.
fn config(db: &TestDb, nats: &NatsServer) -> TestConfig {
    TestConfig::new(&db.url)
        .tuning(RelaySection::quick().set("max_attempts", "2"))
        .plugin(
            Plugin::new("router", &plugin("route_by_type"))
                .config("target", "events")
                .config("topic", "orders.{event_type}"),
        )
        .target("events", Target::nats(&nats.url()))
}

/// Makes the `ORDERS` stream with a message size limit of `limit`.
async fn stream(nats: &NatsServer, limit: i32) {
    jetstream::new(nats.client().await.unwrap())
        .create_stream(jetstream::stream::Config {
            name: "ORDERS".into(),
            subjects: vec!["orders.>".into()],
            max_message_size: limit,
            duplicate_window: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .expect("create stream");
}

/// Widens the `ORDERS` stream so the poison events fit.
async fn widen(nats: &NatsServer) {
    let js = jetstream::new(nats.client().await.unwrap());
    let mut info = js
        .get_stream("ORDERS")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    info.max_message_size = -1;
    js.update_stream(info).await.expect("update stream");
}

/// Writes one event; returns its event id.
async fn write_event(
    db: &TestDb,
    event_type: &str,
    aggregate: &str,
    payload: serde_json::Value,
    headers: serde_json::Value,
) -> String {
    sqlx::query_scalar(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('order', $1, $2, $3, $4) RETURNING event_id::text",
    )
    .bind(aggregate)
    .bind(event_type)
    .bind(payload)
    .bind(headers)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// A payload over the stream's limit, with text meant to break a page.
fn poison_payload(marker: &str) -> serde_json::Value {
    serde_json::json!({
        "marker": marker,
        "html": "</pre><script>window.__pwned = 1</script><img src=x onerror=\"window.__pwned=2\">",
        "quotes": "\"'`",
        "control": "esc\u{1b}[31m bell\u{7}",
        "card": {"number": "4111111111111111"},
        "padding": "x".repeat(STREAM_LIMIT as usize),
    })
}

/// Dead letters of `db` of `event_type`.
async fn dead_of_type(db: &TestDb, event_type: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status = 'dead' AND event_type = $1")
        .bind(event_type)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// One raw HTTP/1.1 request: status, headers and body.
async fn http(
    admin: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    http_from(
        admin,
        [127, 0, 0, 1],
        &admin.to_string(),
        method,
        path,
        headers,
        body,
    )
    .await
}

/// [`http`] from another loopback address (`127.0.0.0/8` is all loopback:
/// another client, as the relay sees it), naming `host` in `Host`.
async fn http_from(
    admin: SocketAddr,
    source: [u8; 4],
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind((std::net::Ipv4Addr::from(source), 0).into()).unwrap();
    let mut stream = socket.connect(admin).await.unwrap();
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    if method == "POST" {
        request.push_str("Content-Type: application/x-www-form-urlencoded\r\n");
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (status, head.to_string(), body.to_string())
}

/// Signs in over plain HTTP; returns the cookie header to send.
async fn sign_in(admin: SocketAddr, token: &str) -> Option<String> {
    let (status, head, _) = http(admin, "POST", "/sign-in", &[], &format!("token={token}")).await;
    if status != 303 {
        return None;
    }
    let cookie = head
        .lines()
        .find_map(|line| line.strip_prefix("set-cookie: "))?
        .split(';')
        .next()?
        .to_string();
    Some(cookie)
}

/// The CSRF value in a page's forms.
fn csrf_of(page: &str) -> String {
    let at = page
        .find("name=\"csrf\" value=\"")
        .expect("a form with a csrf field")
        + 19;
    page[at..].split('"').next().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_a_target_paused_when_its_broker_stops_and_up_after_it_returns() {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let mut nats = NatsServer::start().await;
    stream(&nats, -1).await;
    let relay = Relay::start(config(&db, &nats)).await;

    // A service writing an event every 20 ms through the whole test.
    let writing = CancellationToken::new();
    let writer = {
        let (pool, writing) = (db.pool.clone(), writing.clone());
        tokio::spawn(async move {
            let mut written = 0_i64;
            while !writing.is_cancelled() {
                sqlx::query("INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', $1, 'OrderCreated', '{}')")
                    .bind(format!("o-{}", written % 50))
                    .execute(&pool)
                    .await
                    .unwrap();
                written += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            written
        })
    };

    let browser = Browser::start().await;
    browser.open(&relay.url("/")).await;
    let state = "tr[data-target='events'] td.state";
    browser
        .wait_text(state, Duration::from_secs(30), |text| text == "up")
        .await;
    // The charts fill as samples come in (one every 2 s).
    browser
        .wait_text(".chart figcaption strong", Duration::from_secs(30), |text| {
            text.ends_with("/s") && text != "0/s"
        })
        .await;
    // A few more samples, so the screenshot's charts have lines.
    if std::env::var_os("SWITCHYARD_SCREENSHOTS").is_some() {
        tokio::time::sleep(Duration::from_secs(8)).await;
    }
    browser.screenshot("console-overview").await;

    let stopped_at = chrono::Utc::now();
    nats.stop();
    // The wait bounds only a hang; the page refreshing itself is shown by
    // the pause it names, which began after the stop.
    let (_, took) = browser
        .wait_text(state, Duration::from_secs(30), |text| text == "paused")
        .await;
    eprintln!("the overview showed the target paused {took:?} after the broker stopped");
    let why = browser
        .text("tr[data-target='events'] td:last-child")
        .await
        .unwrap();
    let since = why
        .split_once("default: since ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|since| chrono::DateTime::parse_from_rfc3339(since).ok())
        .unwrap_or_else(|| panic!("the pause's start: {why}"));
    // In whole seconds, as the page shows it.
    assert!(
        since.timestamp() >= stopped_at.timestamp(),
        "paused since {since}, before the broker stopped at {stopped_at}: {why}"
    );
    browser.screenshot("console-overview-paused").await;

    nats.resume().await;
    let (_, back) = browser
        .wait_text(state, Duration::from_secs(60), |text| text == "up")
        .await;
    eprintln!("up again {back:?} after the broker returned");

    writing.cancel();
    let written = writer.await.unwrap();
    eventually("every event published", Duration::from_secs(60), || async {
        (count_status(&db.pool, "published").await == written).then_some(())
    })
    .await;
    assert_eq!(
        count_status(&db.pool, "dead").await,
        0,
        "an outage spends no attempt"
    );
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_is_opened_refused_a_replay_without_a_token_and_replayed_with_one() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    stream(&nats, STREAM_LIMIT).await;
    let relay = Relay::start(config(&db, &nats)).await;

    for i in 0..5 {
        write_event(
            &db,
            "OrderCreated",
            &format!("fine-{i}"),
            serde_json::json!({"n": i}),
            serde_json::json!({}),
        )
        .await;
    }
    let headers = serde_json::json!({
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "x-note": "<script>window.__pwned = 3</script>",
    });
    let poison = write_event(
        &db,
        "OrderPaid",
        "poison-1",
        poison_payload("POISON-MARKER"),
        headers,
    )
    .await;
    eventually("the poison event dead", Duration::from_secs(60), || async {
        (count_status(&db.pool, "dead").await == 1 && count_status(&db.pool, "published").await == 5)
            .then_some(())
    })
    .await;

    let browser = Browser::start().await;
    browser.open(&relay.url("/dead-letters")).await;
    assert_eq!(browser.count("tr[data-row]").await, 1);
    let error = browser.text("td.error-text").await.unwrap();
    assert!(
        error.contains("orders.OrderPaid"),
        "the last error names the topic: {error}"
    );
    browser.screenshot("console-dead-letters").await;

    // Signed out, the row asks for a sign-in: no payload, aggregate or
    // trace context, and no action offered.
    browser.click("tr[data-row] a").await;
    let page = browser.source().await;
    assert!(
        page.contains("Sign in with an admin token to open an event."),
        "{page}"
    );
    assert!(!page.contains("POISON-MARKER"), "no payload without a token");
    assert!(
        !page.contains("0af7651916cd43dd8448eb211c80319c"),
        "no trace context"
    );
    assert_eq!(browser.count("a.button").await, 0, "no action offered signed out");
    browser.open(&relay.url(&format!("/events?id={poison}"))).await;
    assert!(
        !browser
            .source()
            .await
            .contains("0af7651916cd43dd8448eb211c80319c")
    );

    // A replay without a token: the confirmation and the action are refused.
    browser
        .open(&relay.url("/actions/confirm?action=replay&database=default"))
        .await;
    assert!(
        browser
            .source()
            .await
            .contains("sign in with an admin token first")
    );
    let (status, _, _) = http(
        relay.admin,
        "POST",
        "/actions",
        &[],
        "action=replay&database=default&expected=1&csrf=x",
    )
    .await;
    assert_eq!(status, 403, "a replay without a token is refused");
    assert_eq!(count_status(&db.pool, "dead").await, 1);

    // Signed in, the payload opens: escaped, masked, nothing run.
    browser.open(&relay.url("/sign-in")).await;
    browser.type_into("input[name=token]", TOKEN).await;
    browser.click("form.sign-in button").await;
    browser
        .wait_text("header .who strong", Duration::from_secs(10), |name| {
            name == "ops"
        })
        .await;
    browser.open(&relay.url("/dead-letters")).await;
    browser.click("tr[data-row] a").await;
    let payload = browser.text("pre.payload").await.expect("the payload, signed in");
    assert!(payload.contains("POISON-MARKER"), "{payload}");
    assert!(
        browser
            .source()
            .await
            .contains("0af7651916cd43dd8448eb211c80319c"),
        "the trace context, signed in"
    );
    assert!(
        payload.contains("</pre><script>window.__pwned = 1</script>"),
        "shown as text"
    );
    assert!(
        payload.contains("\\u001b[31m bell\\u0007"),
        "control characters as escapes: {payload}"
    );
    assert!(
        !browser.source().await.contains('\u{1b}'),
        "no raw escape character on the page"
    );
    assert!(!payload.contains("4111111111111111"), "card is masked");
    let headers = browser.text("pre.headers").await.unwrap();
    assert!(
        headers.contains("<script>window.__pwned = 3</script>"),
        "{headers}"
    );
    let pwned = browser
        .client
        .execute("return window.__pwned === undefined", vec![])
        .await
        .unwrap();
    assert_eq!(
        pwned,
        serde_json::Value::Bool(true),
        "no script from the event ran"
    );
    browser.screenshot("console-event").await;

    // The stream is widened (the fix); the replay republishes the event once.
    widen(&nats).await;
    browser.click("a.button[href*='action=replay']").await;
    assert_eq!(browser.text("strong.count").await.as_deref(), Some("1"));
    browser.screenshot("console-confirm").await;
    browser.click("form.confirm button").await;
    browser
        .wait_text("p.message.done", Duration::from_secs(10), |text| {
            text == "Replayed 1 dead letter(s)."
        })
        .await;
    eventually(
        "the replayed event published",
        Duration::from_secs(30),
        || async { (count_status(&db.pool, "published").await == 6).then_some(()) },
    )
    .await;
    browser.open(&relay.url("/dead-letters")).await;
    assert_eq!(browser.count("tr[data-row]").await, 0, "the list is empty");
    let published = nats.read_stream("ORDERS").await;
    let replayed: Vec<_> = published
        .iter()
        .filter(|m| m.header("Switchyard-Event-Id") == Some(poison.as_str()))
        .collect();
    assert_eq!(replayed.len(), 1, "published once");
    assert!(
        relay.log().contains("token=ops"),
        "the action is logged with the token's name"
    );
    assert!(
        relay.log().contains("Console: dead letters replayed"),
        "{}",
        relay.log()
    );
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filtered_purge_removes_exactly_the_filtered_rows() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    stream(&nats, STREAM_LIMIT).await;
    let relay = Relay::start(config(&db, &nats)).await;
    for i in 0..6 {
        write_event(
            &db,
            "OrderPaid",
            &format!("paid-{i}"),
            poison_payload("P"),
            serde_json::json!({}),
        )
        .await;
    }
    for i in 0..4 {
        write_event(
            &db,
            "OrderShipped",
            &format!("shipped-{i}"),
            poison_payload("S"),
            serde_json::json!({}),
        )
        .await;
    }
    for i in 0..3 {
        write_event(
            &db,
            "OrderPaid",
            &format!("fine-{i}"),
            serde_json::json!({"n": i}),
            serde_json::json!({}),
        )
        .await;
    }
    eventually("10 dead, 3 published", Duration::from_secs(60), || async {
        (count_status(&db.pool, "dead").await == 10 && count_status(&db.pool, "published").await == 3)
            .then_some(())
    })
    .await;

    let browser = Browser::start().await;
    browser.open(&relay.url("/sign-in")).await;
    browser.type_into("input[name=token]", TOKEN).await;
    browser.click("form.sign-in button").await;
    browser
        .wait_text("header .who strong", Duration::from_secs(10), |name| {
            name == "ops"
        })
        .await;
    browser.open(&relay.url("/dead-letters")).await;
    browser.type_into("input[name=event_type]", "OrderPaid").await;
    browser.click("form.filter button").await;
    browser
        .wait_text("p.matching", Duration::from_secs(10), |text| text == "6 matching")
        .await;
    assert_eq!(browser.count("tr[data-row]").await, 6);
    browser.click("a.button.danger").await;
    assert_eq!(browser.text("strong.count").await.as_deref(), Some("6"));
    browser.click("form.confirm button").await;
    browser
        .wait_text("p.message.done", Duration::from_secs(10), |text| {
            text == "Purged 6 dead letter(s)."
        })
        .await;
    assert_eq!(
        browser.count("tr[data-row]").await,
        0,
        "the filtered list is empty"
    );
    assert_eq!(dead_of_type(&db, "OrderPaid").await, 0);
    assert_eq!(
        dead_of_type(&db, "OrderShipped").await,
        4,
        "rows outside the filter stay"
    );
    assert_eq!(
        count_status(&db.pool, "published").await,
        3,
        "published rows are not touched"
    );

    // A set that changed between the confirmation and the click is asked again.
    browser
        .open(&relay.url("/actions/confirm?action=purge&database=default&event_type=OrderShipped"))
        .await;
    assert_eq!(browser.text("strong.count").await.as_deref(), Some("4"));
    write_event(
        &db,
        "OrderShipped",
        "shipped-late",
        poison_payload("S"),
        serde_json::json!({}),
    )
    .await;
    eventually("the late one dead", Duration::from_secs(60), || async {
        (dead_of_type(&db, "OrderShipped").await == 5).then_some(())
    })
    .await;
    browser.click("form.confirm button").await;
    browser
        .wait_text("p.message.notice", Duration::from_secs(10), |text| {
            text.contains("it was 4, it is 5 now")
        })
        .await;
    assert_eq!(
        dead_of_type(&db, "OrderShipped").await,
        5,
        "nothing purged on a stale count"
    );
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_a_page_and_wrong_missing_and_cross_site_requests_are_refused() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    stream(&nats, STREAM_LIMIT).await;
    // Secrets the servers here do not check, so the relay runs with them:
    // a database password and NATS credentials.
    let db_secret = "db-password-SECRET-4242";
    let nats_secret = "nats-password-SECRET-4343";
    let url = db.url.replacen("postgres@", &format!("postgres:{db_secret}@"), 1);
    assert_ne!(url, db.url, "the URL takes a password: {}", db.url);
    let down_port = free_port();
    let config = config_for_fleet(&url, down_port, &nats)
        .target_set("events", "user", "relay")
        .target_set("events", "password", nats_secret);
    let relay = Relay::start_fleet(config).await;

    write_event(
        &db,
        "OrderPaid",
        "poison-1",
        poison_payload("MARK"),
        serde_json::json!({}),
    )
    .await;
    eventually("the poison event dead", Duration::from_secs(60), || async {
        (count_status(&db.pool, "dead").await == 1).then_some(())
    })
    .await;

    // Wrong and missing tokens.
    assert!(sign_in(relay.admin, "not-the-token-000000000").await.is_none());
    let (status, _, _) = http(relay.admin, "POST", "/sign-in", &[], "").await;
    assert_eq!(status, 403, "no token");
    // A guesser at another address uses up its own minute, even for the
    // right token; the operator's address still signs in.
    let at = relay.admin.to_string();
    let guess = |token: String| {
        let at = at.clone();
        async move { http_from(relay.admin, [127, 0, 0, 2], &at, "POST", "/sign-in", &[], &token).await }
    };
    for _ in 0..20 {
        assert_eq!(guess("token=guess-guess-guess-00".into()).await.0, 403);
    }
    let (status, _, body) = guess(format!("token={TOKEN}")).await;
    assert_eq!(status, 429, "{body}");
    let cookie = sign_in(relay.admin, TOKEN)
        .await
        .expect("the right token signs in");
    let signed_in = [("Cookie", cookie.as_str())];
    // DNS rebinding: another site's name pointed at the relay's address.
    let (status, _, body) = http_from(
        relay.admin,
        [127, 0, 0, 1],
        "evil.example",
        "GET",
        "/",
        &signed_in,
        "",
    )
    .await;
    assert_eq!(status, 421, "{body}");
    assert!(!body.contains("database"), "nothing read: {body}");
    let (status, _, _) = http_from(
        relay.admin,
        [127, 0, 0, 1],
        &format!("localhost:{}", relay.admin.port()),
        "GET",
        "/",
        &[],
        "",
    )
    .await;
    assert_eq!(status, 200, "localhost is the console's own name");
    // An event by row id needs the session.
    let (status, _, body) = http(relay.admin, "GET", "/dead-letters/1?database=a", &[], "").await;
    assert_eq!(status, 403, "{body}");
    assert!(!body.contains("poison-1"), "no aggregate id signed out: {body}");
    let (status, _, confirm) = http(
        relay.admin,
        "GET",
        "/actions/confirm?action=purge&database=a",
        &signed_in,
        "",
    )
    .await;
    assert_eq!(status, 200, "{confirm}");
    let csrf = csrf_of(&confirm);
    let purge = format!("action=purge&database=a&expected=1&csrf={csrf}");
    // Cross-site: the browser says where the form came from.
    for cross in [
        vec![("Cookie", cookie.as_str()), ("Origin", "http://evil.example")],
        vec![("Cookie", cookie.as_str()), ("Sec-Fetch-Site", "cross-site")],
    ] {
        let (status, _, body) = http(relay.admin, "POST", "/actions", &cross, &purge).await;
        assert_eq!(status, 403, "{body}");
        assert!(body.contains("came from another site"), "{body}");
    }
    // The form's own value is needed, and the session's.
    let (status, _, _) = http(
        relay.admin,
        "POST",
        "/actions",
        &signed_in,
        "action=purge&database=a&expected=1&csrf=guess",
    )
    .await;
    assert_eq!(status, 403);
    let (status, _, _) = http(relay.admin, "POST", "/actions", &[], &purge).await;
    assert_eq!(status, 403);
    assert_eq!(
        count_status(&db.pool, "dead").await,
        1,
        "nothing refused changed anything"
    );

    // A real browser, signed in, led by another site's page to post the form.
    let browser = Browser::start().await;
    browser.open(&relay.url("/sign-in")).await;
    browser.type_into("input[name=token]", TOKEN).await;
    browser.click("form.sign-in button").await;
    browser
        .wait_text("header .who strong", Duration::from_secs(10), |name| {
            name == "ops"
        })
        .await;
    let evil = EvilSite::serve(relay.admin, &purge).await;
    browser.open(&evil.url()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        count_status(&db.pool, "dead").await,
        1,
        "a cross-site post changed nothing"
    );

    // Every page, signed in, with a database down: no secret in the HTML.
    let pages = [
        "/".to_string(),
        "/db/a".to_string(),
        "/db/b".to_string(),
        "/dead-letters?database=a".to_string(),
        "/dead-letters?database=b".to_string(),
        "/dead-letters/1?database=a".to_string(),
        "/actions/confirm?action=replay&database=a".to_string(),
        "/events?id=00000000-0000-0000-0000-000000000000".to_string(),
        "/sign-in".to_string(),
    ];
    for page in &pages {
        browser.open(&relay.url(page)).await;
        let html = browser.source().await;
        for secret in [db_secret, nats_secret, TOKEN] {
            assert!(!html.contains(secret), "{page} shows a secret");
        }
    }
    // The database that is down says so; the other is served.
    browser.open(&relay.url("/")).await;
    let b = browser.text("tr[data-database='b']").await.unwrap();
    assert!(b.contains("not served yet"), "{b}");
    let a = browser.text("tr[data-database='a']").await.unwrap();
    assert!(a.contains("served here"), "{a}");
    browser.screenshot("console-fleet").await;
    browser.open(&relay.url("/dead-letters?database=b")).await;
    assert!(browser.source().await.contains("Database b is not served yet"));
    for secret in [db_secret, nats_secret, TOKEN] {
        assert!(!relay.log().contains(secret), "the log shows a secret");
    }
    browser.close().await;
    drop(evil);
}

/// A fleet of two: `a` on `url`, `b` on a port nothing listens on.
fn config_for_fleet(url: &str, down_port: u16, nats: &NatsServer) -> TestConfig {
    let down = format!("postgres://postgres@127.0.0.1:{down_port}/nothing");
    TestConfig::fleet()
        .member("a", url, &[])
        .member("b", &down, &[])
        .tuning(RelaySection::quick().set("max_attempts", "2"))
        .plugin(
            Plugin::new("router", &plugin("route_by_type"))
                .config("target", "events")
                .config("topic", "orders.{event_type}"),
        )
        .target("events", Target::nats(&nats.url()))
}

impl Relay {
    /// [`Relay::start`] for a fleet: ready means serving `a`, whatever `b` does.
    async fn start_fleet(config: TestConfig) -> Relay {
        let relay = Relay::spawn(config);
        let admin = relay.admin;
        eventually("database a served", Duration::from_secs(60), || async {
            let (_, body) = try_http_get(admin, "/readyz").await?;
            body.contains("\"a\":{\"ready\":true").then_some(())
        })
        .await;
        relay
    }
}

/// Another site (`localhost`, where the console is on `127.0.0.1`) whose
/// page posts a purge form to the console as soon as it loads.
struct EvilSite {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl EvilSite {
    async fn serve(console: SocketAddr, form: &str) -> EvilSite {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let fields: String = form
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .map(|(name, value)| format!("<input type=hidden name={name} value=\"{value}\">"))
            .collect();
        let page = format!(
            "<!doctype html><form id=f method=post action=\"http://{console}/actions\">{fields}</form>\
             <script>document.getElementById('f').submit()</script>"
        );
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut buffer = [0u8; 4096];
                let _ = stream.read(&mut buffer).await;
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                    page.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            }
        });
        EvilSite { port, task }
    }

    fn url(&self) -> String {
        format!("http://localhost:{}/", self.port)
    }
}

impl Drop for EvilSite {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_queries_read_indexes_on_a_large_outbox() {
    init_logging();
    let db = fresh_db().await;
    // 200,000 published rows, 20,000 dead letters and 5,000 waiting: the
    // planner reads an index only when it pays, which needs rows.
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at, attempts)
         SELECT 'order', 'o-' || (i % 5000), 'OrderCreated', '{}', 'published', now(), 1 FROM generate_series(1, 200000) i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, attempts, last_error, deliveries)
         SELECT 'order', 'd-' || i, CASE WHEN i % 2 = 0 THEN 'OrderPaid' ELSE 'OrderShipped' END, '{}', 'dead', 2,
                'target \"events\" topic \"orders.x\": refused ' || i,
                jsonb_build_object('events/orders.x', jsonb_build_object('target', 'events', 'topic', 'orders.x', 'error', 'refused'))
           FROM generate_series(1, 20000) i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'w-' || i, 'OrderCreated', '{}' FROM generate_series(1, 5000) i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE switchyard_outbox")
        .execute(&db.pool)
        .await
        .unwrap();

    let store = switchyard::store::OutboxStore::connect(&db.url, 2).await.unwrap();
    let pg = store.postgres().unwrap();
    let filters = [
        ("no filter", switchyard::store::DeadLetterFilter::default()),
        (
            "event type",
            switchyard::store::DeadLetterFilter {
                event_type: Some("OrderPaid".into()),
                ..Default::default()
            },
        ),
        (
            "aggregate",
            switchyard::store::DeadLetterFilter {
                aggregate_type: Some("order".into()),
                aggregate_id: Some("d-7".into()),
                ..Default::default()
            },
        ),
        (
            "target",
            switchyard::store::DeadLetterFilter {
                target: Some("events".into()),
                ..Default::default()
            },
        ),
        (
            "error text and time",
            switchyard::store::DeadLetterFilter {
                error_contains: Some("refused 1".into()),
                created_since_ms: Some(0),
                ..Default::default()
            },
        ),
    ];
    for (name, filter) in &filters {
        for (query, plan) in pg.explain_console_queries(filter).await.unwrap() {
            assert!(
                !plan.contains("Seq Scan on switchyard_outbox"),
                "{query} with {name} scans the table:\n{plan}"
            );
            assert!(
                plan.contains("Index"),
                "{query} with {name} reads no index:\n{plan}"
            );
        }
    }
    // The target filter takes any name, quotes and backslashes included.
    let for_target = |name: &str| switchyard::store::DeadLetterFilter {
        target: Some(name.into()),
        ..Default::default()
    };
    assert_eq!(
        store.count_dead_letters(&for_target("events")).await.unwrap(),
        20_000
    );
    assert_eq!(
        store.count_dead_letters(&for_target("ev\"ents\\")).await.unwrap(),
        0
    );
    // The bounded counts say "at least" rather than reading every row.
    assert!(store.backlog_to(1000).await.unwrap() >= 1000);
    assert_eq!(
        store
            .count_dead_letters_to(&switchyard::store::DeadLetterFilter::default(), 100_000)
            .await
            .unwrap(),
        20_000
    );
}

#[tokio::test]
async fn the_dead_letter_filters_of_the_console_work_on_sqlite() {
    let dir = std::env::temp_dir().join(format!("sy-console-sqlite-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("outbox.db").display());
    let store = switchyard::store::OutboxStore::connect(url.as_str(), 2)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    for (i, target, acked) in [(1, "events", false), (2, "audit", false), (3, "events", true)] {
        let deliveries = serde_json::json!({
            format!("{target}/t"): {"target": target, "topic": "t", "acked_at": acked.then_some("2026-11-28T00:00:00Z")}
        })
        .to_string();
        sqlx::query(
            "INSERT INTO switchyard_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, status, last_error, deliveries)
             VALUES (?, 'order', ?, 'OrderPaid', '{}', 'dead', ?, ?)",
        )
        .bind(uuid::Uuid::new_v4().to_string())
        .bind(format!("o-{i}"))
        .bind(format!("Refused BY broker {i}"))
        .bind(deliveries)
        .execute(&pool)
        .await
        .unwrap();
    }
    let filter = |target: Option<&str>, error: Option<&str>| switchyard::store::DeadLetterFilter {
        target: target.map(str::to_string),
        error_contains: error.map(str::to_string),
        ..Default::default()
    };
    assert_eq!(
        store
            .count_dead_letters(&filter(Some("events"), None))
            .await
            .unwrap(),
        1,
        "an acknowledged delivery does not count"
    );
    assert_eq!(
        store
            .count_dead_letters(&filter(Some("audit"), None))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        store
            .count_dead_letters(&filter(None, Some("by broker 2")))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        store.count_dead_letters_to(&filter(None, None), 2).await.unwrap(),
        2,
        "bounded"
    );
    assert!(store.backlog_to(10).await.unwrap() == 0);
    let listed = store.dead_letters(&filter(None, None), 0, 50).await.unwrap();
    let id = uuid::Uuid::parse_str(&listed[0].event_id).unwrap();
    assert_eq!(store.event(id).await.unwrap().unwrap().id, listed[0].id);
    // A page that does not show the payload does not read it.
    let whole = store.entry(listed[0].id, true).await.unwrap().unwrap();
    let without = store.entry(listed[0].id, false).await.unwrap().unwrap();
    assert!(whole.payload.is_some(), "{whole:?}");
    assert_eq!(without.payload, None);
    assert_eq!(
        (without.headers, without.event_id),
        (whole.headers, whole.event_id)
    );
    store.close().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_replication_mode_the_overview_shows_the_slot_its_reader_and_the_wal_kept() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    stream(&nats, -1).await;
    let config = config(&db, &nats)
        .tuning(RelaySection::quick().set("mode", "\"replication\""))
        .set("replication", "slot", db.name.as_str())
        .set("replication", "publication", "switchyard_outbox");
    let path = std::env::temp_dir().join(format!(
        "sy-console-migrate-{}.toml",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::write(&path, config.toml()).unwrap();
    let (code, out, err) =
        switchyard_tests::cli(SWITCHYARD, &["migrate", "--config", path.to_str().unwrap()], &[]).await;
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "migrate: {out}{err}");
    let relay = Relay::start(config).await;
    for i in 0..20 {
        write_event(
            &db,
            "OrderCreated",
            &format!("r-{i}"),
            serde_json::json!({"n": i}),
            serde_json::json!({}),
        )
        .await;
    }
    let page = eventually(
        "the slot read by this relay, on the overview",
        Duration::from_secs(60),
        || async {
            let (status, page) = try_http_get(relay.admin, "/").await?;
            (status == 200 && page.contains("(this relay)")).then_some(page)
        },
    )
    .await;
    assert!(page.contains("Replication slot"), "{page}");
    assert!(
        page.contains(&format!("<dd>{}</dd>", db.name)),
        "the slot's name: {page}"
    );
    assert!(page.contains("Retained WAL"), "{page}");
    assert!(page.contains("<dt>Check</dt><dd>ok</dd>"), "{page}");
    assert!(
        page.contains("<dt>Behind the server</dt><dd class=\"lag\">"),
        "{page}"
    );
    eventually("the 20 events published", Duration::from_secs(60), || async {
        (nats.stream_len("ORDERS").await == 20).then_some(())
    })
    .await;
}

/// The hidden fields of the page's confirm form, as the browser posts them.
fn confirm_fields(page: &str) -> String {
    let form = page
        .split("<form class=\"confirm\"")
        .nth(1)
        .and_then(|rest| rest.split("</form>").next())
        .expect("a confirm form");
    form.split("<input type=\"hidden\" ")
        .skip(1)
        .filter_map(|input| {
            let name = input.split("name=\"").nth(1)?.split('"').next()?;
            let value = input.split("value=\"").nth(1)?.split('"').next()?;
            Some(format!(
                "{name}={}",
                url::form_urlencoded::byte_serialize(value.as_bytes()).collect::<String>()
            ))
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// The console over a relay process on MariaDB, through its pages as a
/// browser requests them: poison events dead-lettered by the stream's size
/// limit are listed and filtered, one opens, and once the stream is widened
/// a replay through the confirm form publishes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mariadb_dead_letters_are_listed_opened_and_replayed_from_the_console() {
    init_logging();
    let db = switchyard_tests::outbox::TestOutbox::mariadb().await;
    let nats = NatsServer::start().await;
    stream(&nats, STREAM_LIMIT).await;
    let config = TestConfig::new(&db.url)
        .tuning(RelaySection::quick().set("max_attempts", "2"))
        .plugin(
            Plugin::new("router", &plugin("route_by_type"))
                .config("target", "events")
                .config("topic", "orders.{event_type}"),
        )
        .target("events", Target::nats(&nats.url()));
    let relay = Relay::start(config).await;
    let pool = db.mysql_pool();
    for (aggregate, payload) in [
        ("poison-1", poison_payload("M1")),
        ("poison-2", poison_payload("M2")),
        ("fine-1", serde_json::json!({"n": 1})),
    ] {
        sqlx::query(
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', ?, 'OrderPaid', ?)",
        )
        .bind(aggregate)
        .bind(payload.to_string())
        .execute(&pool)
        .await
        .unwrap();
    }
    eventually("2 dead, 1 published", Duration::from_secs(60), || async {
        (db.count("dead").await == 2 && db.count("published").await == 1).then_some(())
    })
    .await;

    let cookie = sign_in(relay.admin, TOKEN).await.expect("signed in");
    let get = |path: String| {
        let cookie = cookie.clone();
        let admin = relay.admin;
        async move { http(admin, "GET", &path, &[("Cookie", cookie.as_str())], "").await }
    };
    let (status, _, overview) = get("/".into()).await;
    assert_eq!(status, 200, "{overview}");
    let (status, _, list) = get("/dead-letters".into()).await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list.matches("<tr data-row").count(), 2, "{list}");
    let (_, _, filtered) = get("/dead-letters?aggregate_type=order&aggregate_id=poison-2".into()).await;
    assert_eq!(filtered.matches("<tr data-row").count(), 1, "{filtered}");
    let (_, _, by_target) = get("/dead-letters?target=events".into()).await;
    assert_eq!(by_target.matches("<tr data-row").count(), 2, "{by_target}");
    let id = db
        .scalar("SELECT min(id) FROM switchyard_outbox WHERE status = 'dead'")
        .await;
    let (status, _, event) = get(format!("/dead-letters/{id}")).await;
    assert_eq!(status, 200, "{event}");
    assert!(event.contains("M1"), "the payload, signed in");
    assert!(!event.contains("4111111111111111"), "card is masked");

    widen(&nats).await;
    let (status, _, confirm) = get("/actions/confirm?action=replay".into()).await;
    assert_eq!(status, 200, "{confirm}");
    let (status, head, _) = http(
        relay.admin,
        "POST",
        "/actions",
        &[("Cookie", cookie.as_str())],
        &confirm_fields(&confirm),
    )
    .await;
    assert_eq!(status, 303, "{head}");
    eventually(
        "the replayed events published",
        Duration::from_secs(30),
        || async { (db.count("published").await == 3).then_some(()) },
    )
    .await;
    let published = nats.read_stream("ORDERS").await;
    assert_eq!(published.len(), 3, "each published once");
}
