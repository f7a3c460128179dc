//! A TCP proxy whose open connections can be stalled: they stay open and
//! take what is sent, but nothing goes through any more, either way, as on
//! a link that drops every packet without a reset. Connections opened after
//! a stall go through, unless the proxy was made a black hole. The server's
//! answers can also be held back a while, as from a server short of CPU.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// Forwards a local port to `upstream`; stops all forwarding on drop.
pub struct StallingProxy {
    addr: SocketAddr,
    switches: Arc<Switches>,
    accept: JoinHandle<()>,
}

/// What the test sets and the proxy's pumps read.
#[derive(Default)]
struct Switches {
    /// Bumped by a stall: a connection born in an earlier epoch is stalled.
    epoch: AtomicU64,
    /// New connections are stalled from birth.
    black_hole: AtomicBool,
    /// Stall everything once the next answer from the server is through.
    after_next_answer: AtomicBool,
    /// How long each of the server's answers is held back, in ms.
    answer_delay_ms: AtomicU64,
}

impl StallingProxy {
    /// Listens on a free loopback port, forwarding to the server of `url`
    /// (a `postgres://user@host:port/database` URL).
    ///
    /// # Panics
    /// When `url` names no `host:port` or no port can be bound.
    pub async fn in_front_of(url: &str) -> StallingProxy {
        let upstream = tokio::net::lookup_host(host_port(url))
            .await
            .ok()
            .and_then(|mut addrs| addrs.next())
            .expect("the server's address");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let switches = Arc::new(Switches::default());
        let accept = tokio::spawn(accept(listener, upstream, switches.clone()));
        StallingProxy {
            addr,
            switches,
            accept,
        }
    }

    /// `url` with its host and port replaced by the proxy's.
    pub fn url(&self, url: &str) -> String {
        url.replacen(host_port(url), &self.addr.to_string(), 1)
    }

    /// Stalls every connection open now, for good.
    pub fn stall_open_connections(&self) {
        self.switches.epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// Stalls every connection, and every one opened later, as soon as the
    /// server's next answer has gone through: the client then answers
    /// it into a link that has gone (sqlx's ping of a session on its way
    /// back to the pool, right after its statement's answer).
    pub fn black_hole_after_the_next_answer(&self) {
        self.switches.after_next_answer.store(true, Ordering::SeqCst);
    }

    /// Holds each answer of the server back for `delay` before passing it
    /// on (zero: at once again); nothing is lost or stalled.
    pub fn delay_answers(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.switches.answer_delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Stalls every connection open now and every one opened from now on:
    /// a server cut off by the network, where even a new session never
    /// gets its first answer.
    pub fn black_hole(&self) {
        self.switches.black_hole.store(true, Ordering::SeqCst);
        self.stall_open_connections();
    }
}

/// Awaits `statement`, sent on a session that has just stalled: the store
/// must give up on it with [`switchyard::store::Error::Unanswered`] within
/// 10 s, not wait for the kernel.
///
/// # Panics
/// When it answers, fails otherwise, or takes longer.
pub async fn gives_up_unanswered<T: std::fmt::Debug>(
    what: &str,
    statement: impl Future<Output = Result<T, switchyard::store::Error>>,
) {
    let started = std::time::Instant::now();
    let error = tokio::time::timeout(Duration::from_secs(30), statement)
        .await
        .unwrap_or_else(|_| panic!("{what} gives up"))
        .expect_err(what);
    assert!(
        matches!(error, switchyard::store::Error::Unanswered { .. }),
        "{what}: {error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{what}: {:?}",
        started.elapsed()
    );
}

impl Drop for StallingProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// The `host:port` of a `scheme://user@host:port/database` URL.
fn host_port(url: &str) -> &str {
    let rest = url.split_once('@').map_or(url, |(_, rest)| rest);
    rest.split('/').next().unwrap_or(rest)
}

async fn accept(listener: TcpListener, upstream: SocketAddr, switches: Arc<Switches>) {
    // Dropped with this task: every connection's pumps end with it.
    let mut connections = JoinSet::new();
    while let Ok((client, _)) = listener.accept().await {
        let Ok(server) = TcpStream::connect(upstream).await else {
            continue;
        };
        // Born stalled in a black hole: no epoch is ever u64::MAX.
        let born = if switches.black_hole.load(Ordering::SeqCst) {
            u64::MAX
        } else {
            switches.epoch.load(Ordering::SeqCst)
        };
        let (client_read, client_write) = client.into_split();
        let (server_read, server_write) = server.into_split();
        connections.spawn(pump(client_read, server_write, switches.clone(), born, false));
        connections.spawn(pump(server_read, client_write, switches.clone(), born, true));
    }
}

/// Copies `from` to `to` until the connection's epoch passes; then holds
/// both ends open and reads on, forwarding nothing. `answers`: this copies
/// the server's side.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    switches: Arc<Switches>,
    born: u64,
    answers: bool,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    let mut stalled = false;
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        stalled = stalled || switches.epoch.load(Ordering::SeqCst) != born;
        // The last answer through: everything is stalled before the client
        // has it, so nothing it sends on reading it gets through.
        let last = !stalled && answers && switches.after_next_answer.swap(false, Ordering::SeqCst);
        if last {
            switches.black_hole.store(true, Ordering::SeqCst);
            switches.epoch.fetch_add(1, Ordering::SeqCst);
        }
        let delay = switches.answer_delay_ms.load(Ordering::SeqCst);
        if answers && delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if !stalled && to.write_all(&buffer[..n]).await.is_err() {
            break;
        }
        stalled = stalled || last;
    }
    if stalled {
        // The far side hung up; this side must not learn of it either.
        std::future::pending::<()>().await;
    }
}
