//! Who may see payloads and act in the console: named admin tokens, the
//! sessions a sign-in opens, the checks against cross-site requests, and
//! the rate limit on actions.
//!
//! A person signs in with a token once; the browser then holds a random
//! session id in an `HttpOnly`, `SameSite=Strict` cookie (a cross-site
//! request does not carry it). Every form that changes something also
//! carries the session's own CSRF value, and a request whose `Origin` or
//! `Sec-Fetch-Site` says it came from another site is refused before
//! anything else is looked at. A session remembers a digest of the token
//! it was opened with and checks it against the token's current value at
//! each use: rotating or removing a token ends its sessions. Failed
//! sign-ins are limited per client address, so a guesser holds back only
//! itself; and the console answers only to the host names it is known by.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, header};
use sha2::{Digest, Sha256};

use crate::secret::SecretValue;

/// The session cookie's name.
pub const COOKIE: &str = "switchyard_console";

/// A session ends this long after it opened.
const SESSION_LIFETIME: Duration = Duration::from_secs(8 * 3600);

/// Failed sign-ins accepted per minute from one client (an IPv4 address,
/// an IPv6 /64): a guesser gets 20 tries a minute, not thousands, and
/// nobody else is held back by them.
const FAILED_SIGN_INS_PER_MINUTE: usize = 20;

/// Clients whose failures are remembered at once; past it, the clients
/// without a failure in the last minute are forgotten, and then new ones
/// share one count, so a flood of addresses cannot grow memory.
const CLIENTS_REMEMBERED: usize = 4096;

/// A person signed in: the token's name, and the session's CSRF value.
#[derive(Debug, Clone)]
pub struct Who {
    /// The token's name (what the log says did an action).
    pub name: String,
    /// The value every form of this session must carry.
    pub csrf: String,
}

struct Session {
    name: String,
    digest: [u8; 32],
    csrf: String,
    opened: Instant,
}

/// Tokens, sessions and limits.
pub struct Auth {
    tokens: BTreeMap<String, SecretValue>,
    sessions: Mutex<HashMap<String, Session>>,
    failures: Mutex<HashMap<IpAddr, VecDeque<Instant>>>,
    actions: Mutex<HashMap<String, VecDeque<Instant>>>,
    actions_per_minute: usize,
}

/// Why a request that needs a token is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No token is configured: nothing that needs one is offered.
    #[error("no admin token is configured (admin.tokens), so payloads and actions are off")]
    NoTokens,
    /// The request came from another site.
    #[error("refused: the request came from another site")]
    CrossSite,
    /// No session, or an ended one.
    #[error("sign in with an admin token first")]
    SignedOut,
    /// The form's CSRF value is missing or wrong.
    #[error("refused: the form does not belong to this session (reload the page and try again)")]
    BadForm,
    /// The token is not one of the configured ones.
    #[error("that token is not one of admin.tokens")]
    WrongToken,
    /// Too many tries or actions.
    #[error("too many {0} in the last minute; wait and try again")]
    TooMany(&'static str),
}

impl Auth {
    /// From `[admin] tokens` and `actions_per_minute`.
    pub fn new(tokens: BTreeMap<String, SecretValue>, actions_per_minute: u32) -> Auth {
        Auth {
            tokens,
            sessions: Mutex::default(),
            failures: Mutex::default(),
            actions: Mutex::default(),
            actions_per_minute: usize::try_from(actions_per_minute).unwrap_or(usize::MAX).max(1),
        }
    }

    /// Whether any token is configured (else payloads and actions are off).
    pub fn enabled(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Opens a session for `presented` when it is one of the tokens; returns
    /// the session id for the cookie and who it is.
    ///
    /// # Errors
    /// [`Refusal::NoTokens`], [`Refusal::TooMany`] past the failed sign-in
    /// limit, [`Refusal::WrongToken`].
    pub async fn sign_in(&self, presented: &str, client: IpAddr) -> Result<(String, Who), Refusal> {
        if !self.enabled() {
            return Err(Refusal::NoTokens);
        }
        let client = client_key(client);
        if !self.failures_within(client, false) {
            return Err(Refusal::TooMany("failed sign-ins"));
        }
        let presented = digest(presented);
        let mut matched = None;
        for (name, token) in &self.tokens {
            match token.read().await {
                Ok(value) if same(&digest(value.expose()), &presented) => matched = Some(name.clone()),
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(token = %name, error = %error, "Console: an admin token cannot be read.")
                }
            }
        }
        let Some(name) = matched else {
            self.failures_within(client, true);
            tracing::warn!(%client, "Console: a sign-in with a wrong token was refused.");
            return Err(Refusal::WrongToken);
        };
        let id = random();
        let who = Who {
            name: name.clone(),
            csrf: random(),
        };
        let mut sessions = lock(&self.sessions);
        sessions.retain(|_, session| session.opened.elapsed() < SESSION_LIFETIME);
        sessions.insert(
            id.clone(),
            Session {
                name: name.clone(),
                digest: presented,
                csrf: who.csrf.clone(),
                opened: Instant::now(),
            },
        );
        tracing::info!(token = %name, "Console: signed in.");
        Ok((id, who))
    }

    /// Whether `client` may fail one more sign-in this minute; `record`
    /// counts a failure.
    fn failures_within(&self, client: IpAddr, record: bool) -> bool {
        // One place is kept for the count the newcomers share.
        let room = |failures: &HashMap<IpAddr, VecDeque<Instant>>| failures.len() < CLIENTS_REMEMBERED - 1;
        let mut failures = lock(&self.failures);
        let known = failures.contains_key(&client);
        if !known && !room(&failures) {
            failures.retain(|_, recent| {
                within(recent, FAILED_SIGN_INS_PER_MINUTE, false);
                !recent.is_empty()
            });
        }
        let client = if known || room(&failures) {
            client
        } else {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        };
        within(
            failures.entry(client).or_default(),
            FAILED_SIGN_INS_PER_MINUTE,
            record,
        )
    }

    /// Ends the session in `headers`' cookie.
    pub fn sign_out(&self, headers: &HeaderMap) {
        if let Some(id) = cookie(headers)
            && let Some(session) = lock(&self.sessions).remove(&id)
        {
            tracing::info!(token = %session.name, "Console: signed out.");
        }
    }

    /// Who the request's session is, while its token still has the value
    /// it was opened with.
    pub async fn who(&self, headers: &HeaderMap) -> Option<Who> {
        let id = cookie(headers)?;
        let (name, opened_with) = {
            let sessions = lock(&self.sessions);
            let session = sessions.get(&id)?;
            (session.name.clone(), session.digest)
        };
        let current = match self.tokens.get(&name)?.read().await {
            Ok(value) => digest(value.expose()),
            Err(_) => [0; 32],
        };
        let mut sessions = lock(&self.sessions);
        let session = sessions.get(&id)?;
        if session.opened.elapsed() >= SESSION_LIFETIME || !same(&current, &opened_with) {
            sessions.remove(&id);
            return None;
        }
        Some(Who {
            name: session.name.clone(),
            csrf: session.csrf.clone(),
        })
    }

    /// Checks a request that changes something: from this site, with a
    /// session, carrying that session's CSRF value.
    ///
    /// # Errors
    /// The [`Refusal`].
    pub async fn check_form(&self, headers: &HeaderMap, csrf: &str) -> Result<Who, Refusal> {
        if !self.enabled() {
            return Err(Refusal::NoTokens);
        }
        same_site(headers)?;
        let who = self.who(headers).await.ok_or(Refusal::SignedOut)?;
        if csrf.is_empty() || !same(&digest(csrf), &digest(&who.csrf)) {
            return Err(Refusal::BadForm);
        }
        Ok(who)
    }

    /// Counts an action of `who` against the per-minute limit.
    ///
    /// # Errors
    /// [`Refusal::TooMany`] past it.
    pub fn take_action(&self, who: &Who) -> Result<(), Refusal> {
        let mut actions = lock(&self.actions);
        let recent = actions.entry(who.name.clone()).or_default();
        if within(recent, self.actions_per_minute, true) {
            Ok(())
        } else {
            Err(Refusal::TooMany("actions"))
        }
    }
}

/// Refuses a request a browser says came from another site: `Sec-Fetch-Site`
/// (sent by every current browser) or else `Origin` against `Host`.
///
/// # Errors
/// [`Refusal::CrossSite`].
pub fn same_site(headers: &HeaderMap) -> Result<(), Refusal> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    // A browser that says where the request came from is believed.
    if let Some(site) = text("sec-fetch-site") {
        return if matches!(site, "same-origin" | "none") {
            Ok(())
        } else {
            Err(Refusal::CrossSite)
        };
    }
    if let Some(origin) = text(header::ORIGIN.as_str()) {
        let host = text(header::HOST.as_str()).unwrap_or("");
        let origin_host = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .unwrap_or("");
        if origin_host.is_empty() || origin_host != host {
            return Err(Refusal::CrossSite);
        }
    }
    Ok(())
}

/// Whose failed sign-ins `ip` counts as: the address itself, or for IPv6
/// its /64 (one host usually holds a whole /64).
fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX))),
        },
        v4 @ IpAddr::V4(_) => v4,
    }
}

/// Whether the request's `Host` is one the console answers to: `localhost`,
/// an IP address, or one of `names` (`admin.console_hosts`). A page on
/// another site that points its own name at this address (DNS rebinding)
/// sends that name, and is refused before anything is read.
pub fn known_host(headers: &HeaderMap, names: &[String]) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(bracketed) => bracketed.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                name
            } else {
                host
            }
        }),
    };
    name.parse::<IpAddr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || names.iter().any(|allowed| allowed.eq_ignore_ascii_case(name))
}

/// The `Set-Cookie` value that holds a session `id`.
pub fn session_cookie(id: &str) -> String {
    format!(
        "{COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}",
        SESSION_LIFETIME.as_secs()
    )
}

/// The `Set-Cookie` value that drops the session cookie.
pub fn cleared_cookie() -> String {
    format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0")
}

fn cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .find_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE && !value.is_empty()).then(|| value.to_string())
        })
}

/// Whether one more event fits in `limit` per minute; `record` counts it.
fn within(recent: &mut VecDeque<Instant>, limit: usize, record: bool) -> bool {
    while recent
        .front()
        .is_some_and(|at| at.elapsed() >= Duration::from_secs(60))
    {
        recent.pop_front();
    }
    let fits = recent.len() < limit;
    if fits && record {
        recent.push_back(Instant::now());
    }
    fits
}

fn digest(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

/// Equal digests, compared without stopping at the first difference.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

fn random() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, value.parse().unwrap());
        }
        map
    }

    fn auth() -> Auth {
        let tokens = [(
            "ops".to_string(),
            SecretValue::Value("a-long-ops-token-1234".into()),
        )]
        .into();
        Auth::new(tokens, 2)
    }

    #[tokio::test]
    async fn a_session_needs_the_right_token_and_its_own_form_value() {
        let auth = auth();
        assert_eq!(auth.sign_in("guess", ME).await.unwrap_err(), Refusal::WrongToken);
        let (id, who) = auth.sign_in("a-long-ops-token-1234", ME).await.unwrap();
        assert_eq!(who.name, "ops");
        let cookie = format!("other=1; {COOKIE}={id}");
        let signed_in = headers(&[("cookie", &cookie), ("host", "127.0.0.1:9187")]);
        assert_eq!(auth.check_form(&signed_in, &who.csrf).await.unwrap().name, "ops");
        assert_eq!(
            auth.check_form(&signed_in, "").await.unwrap_err(),
            Refusal::BadForm
        );
        assert_eq!(
            auth.check_form(&signed_in, "x").await.unwrap_err(),
            Refusal::BadForm
        );
        let no_cookie = headers(&[("host", "127.0.0.1:9187")]);
        assert_eq!(
            auth.check_form(&no_cookie, &who.csrf).await.unwrap_err(),
            Refusal::SignedOut
        );
        let cross = headers(&[
            ("cookie", &cookie),
            ("host", "127.0.0.1:9187"),
            ("origin", "http://evil.example"),
        ]);
        assert_eq!(
            auth.check_form(&cross, &who.csrf).await.unwrap_err(),
            Refusal::CrossSite
        );
        let fetch = headers(&[("cookie", &cookie), ("sec-fetch-site", "cross-site")]);
        assert_eq!(
            auth.check_form(&fetch, &who.csrf).await.unwrap_err(),
            Refusal::CrossSite
        );
        auth.sign_out(&signed_in);
        assert_eq!(
            auth.check_form(&signed_in, &who.csrf).await.unwrap_err(),
            Refusal::SignedOut
        );
    }

    #[tokio::test]
    async fn a_rotated_token_ends_its_sessions() {
        let dir = std::env::temp_dir().join(format!("switchyard-console-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ops");
        std::fs::write(&file, "first-token-value-0001\n").unwrap();
        let tokens = [(
            "ops".to_string(),
            SecretValue::From(crate::secret::SecretConfig::from_file(file.clone())),
        )]
        .into();
        let auth = Auth::new(tokens, 10);
        let (id, _) = auth.sign_in("first-token-value-0001", ME).await.unwrap();
        let signed_in = headers(&[("cookie", &format!("{COOKIE}={id}"))]);
        assert!(auth.who(&signed_in).await.is_some());
        std::fs::write(&file, "second-token-value-002\n").unwrap();
        assert!(
            auth.who(&signed_in).await.is_none(),
            "the old token's session ended"
        );
        assert_eq!(
            auth.sign_in("first-token-value-0001", ME).await.unwrap_err(),
            Refusal::WrongToken
        );
        assert!(auth.sign_in("second-token-value-002", ME).await.is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn actions_and_failed_sign_ins_are_limited_per_minute() {
        let auth = auth();
        let (_, who) = auth.sign_in("a-long-ops-token-1234", ME).await.unwrap();
        assert!(auth.take_action(&who).is_ok());
        assert!(auth.take_action(&who).is_ok());
        assert_eq!(auth.take_action(&who).unwrap_err(), Refusal::TooMany("actions"));
        for _ in 0..FAILED_SIGN_INS_PER_MINUTE {
            assert_eq!(auth.sign_in("wrong", ME).await.unwrap_err(), Refusal::WrongToken);
        }
        // The guesser's address waits, even with the right token...
        assert_eq!(
            auth.sign_in("a-long-ops-token-1234", ME).await.unwrap_err(),
            Refusal::TooMany("failed sign-ins")
        );
        // ...and so does the rest of its IPv6 /64, but nobody else.
        let guesser: IpAddr = "2001:db8::1".parse().unwrap();
        for _ in 0..FAILED_SIGN_INS_PER_MINUTE {
            assert_eq!(
                auth.sign_in("wrong", guesser).await.unwrap_err(),
                Refusal::WrongToken
            );
        }
        let neighbour: IpAddr = "2001:db8::ffff:2".parse().unwrap();
        assert_eq!(
            auth.sign_in("a-long-ops-token-1234", neighbour)
                .await
                .unwrap_err(),
            Refusal::TooMany("failed sign-ins")
        );
        let operator: IpAddr = "192.0.2.7".parse().unwrap();
        assert!(auth.sign_in("a-long-ops-token-1234", operator).await.is_ok());
        assert!(
            auth.sign_in("a-long-ops-token-1234", "2001:db8:0:1::1".parse().unwrap())
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn a_flood_of_addresses_neither_grows_memory_nor_locks_out_a_known_client() {
        let auth = auth();
        let operator: IpAddr = "192.0.2.7".parse().unwrap();
        assert_eq!(
            auth.sign_in("typo", operator).await.unwrap_err(),
            Refusal::WrongToken
        );
        for n in 0..(CLIENTS_REMEMBERED as u32 * 2) {
            let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + n));
            let _ = auth.sign_in("wrong", ip).await;
        }
        assert!(lock(&auth.failures).len() <= CLIENTS_REMEMBERED);
        assert!(auth.sign_in("a-long-ops-token-1234", operator).await.is_ok());
    }

    #[test]
    fn the_console_answers_only_to_its_own_host_names() {
        let names = vec!["relays.example.internal".to_string()];
        for host in [
            "localhost:9187",
            "LOCALHOST",
            "127.0.0.1:9187",
            "10.1.2.3",
            "[::1]:9187",
            "relays.example.internal:9187",
            "Relays.Example.Internal",
        ] {
            assert!(known_host(&headers(&[("host", host)]), &names), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:9187",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "",
        ] {
            assert!(!known_host(&headers(&[("host", host)]), &names), "{host}");
        }
        assert!(!known_host(&HeaderMap::new(), &names), "no Host at all");
    }
}
