//! The admin endpoint's connections: HTTP/1 through hyper with a bound on
//! how long a request's header may take to arrive, on how many connections
//! are served at once, and on how many of them one client address may hold,
//! so that whoever reaches the port cannot hold it (a client sending its
//! header a byte at a time, or thousands of idle connections) and starve
//! the kubelet's probes and Prometheus, which come from addresses of their
//! own.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Connections served at once. One more waits in the kernel's backlog
/// until a connection ends.
pub const MAX_CONNECTIONS: usize = 256;

/// Connections one client address may hold at once; one more is closed as
/// soon as it is accepted. Probes, Prometheus and a console user need a
/// few each.
pub const MAX_PER_CLIENT: usize = 16;

/// A request's header must arrive whole within this (and an idle
/// keep-alive connection is closed after it).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long shutdown waits for requests in flight.
const DRAIN: Duration = Duration::from_secs(5);

/// Accepts and serves connections until `shutdown`, then lets the
/// requests in flight finish (for up to 5 s). Each request carries the
/// peer's address as [`ConnectInfo`].
pub async fn run(listener: TcpListener, app: Router, shutdown: CancellationToken, header_timeout: Duration) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let per_client = Arc::new(Mutex::new(HashMap::<IpAddr, usize>::new()));
    let mut connections = JoinSet::new();
    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: wait, do not spin.
                    tracing::debug!(%error, "Admin endpoint: accept failed.");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(held) = ClientSlot::take(&per_client, peer.ip()) else {
            tracing::debug!(%peer, "Admin endpoint: a client holds {MAX_PER_CLIENT} connections already; closed.");
            drop(stream);
            continue;
        };
        let shutdown = shutdown.clone();
        let app = app.clone();
        connections.spawn(async move {
            let (_permit, _held) = (permit, held);
            serve_connection(stream, peer, app, shutdown, header_timeout).await;
        });
        while connections.try_join_next().is_some() {}
    }
    let _ = tokio::time::timeout(DRAIN, async { while connections.join_next().await.is_some() {} }).await;
}

/// One of a client address's connections; given back when dropped.
struct ClientSlot {
    clients: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl ClientSlot {
    fn take(clients: &Arc<Mutex<HashMap<IpAddr, usize>>>, ip: IpAddr) -> Option<ClientSlot> {
        let mut held = clients.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = held.entry(ip).or_insert(0);
        if *count >= MAX_PER_CLIENT {
            return None;
        }
        *count += 1;
        Some(ClientSlot {
            clients: clients.clone(),
            ip,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut held = self
            .clients
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

async fn serve_connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    app: Router,
    shutdown: CancellationToken,
    header_timeout: Duration,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    // The peer's address on each request, for the handlers; the router is
    // shared, not built again per connection.
    let service = hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
        request.extensions_mut().insert(ConnectInfo(peer));
        app.clone().oneshot(request)
    });
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = result {
        tracing::debug!(%peer, %error, "Admin endpoint: a connection ended with an error.");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: SocketAddr) -> String {
        get_from([127, 0, 0, 1], addr).await
    }

    /// Connects from the loopback address `from` (all of 127/8 is loopback).
    async fn connect_from(from: [u8; 4], addr: SocketAddr) -> tokio::net::TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::from((from, 0))).unwrap();
        socket.connect(addr).await.unwrap()
    }

    /// The answer to a GET, empty when the server closed the connection.
    async fn get_from(from: [u8; 4], addr: SocketAddr) -> String {
        let mut stream = connect_from(from, addr).await;
        let mut answer = String::new();
        if stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .is_ok()
        {
            let _ = stream.read_to_string(&mut answer).await;
        }
        answer
    }

    #[tokio::test]
    async fn a_header_sent_a_byte_at_a_time_is_cut_off_and_others_are_served_meanwhile() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route(
            "/healthz",
            axum::routing::get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move {
                format!("ok from {}", peer.ip())
            }),
        );
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(run(listener, app, shutdown.clone(), Duration::from_millis(500)));

        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        let started = std::time::Instant::now();
        let mut closed = false;
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: yes\r\n".iter() {
            if slow.write_all(&[*byte]).await.is_err() {
                closed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            if started.elapsed() > Duration::from_secs(3) {
                break;
            }
        }
        if !closed {
            let mut rest = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(3), slow.read_to_end(&mut rest)).await;
            closed = matches!(read, Ok(Ok(_)) | Ok(Err(_)));
        }
        assert!(closed, "the slow client was cut off");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(
            get(addr).await.ends_with("ok from 127.0.0.1"),
            "served, with the peer's address"
        );

        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn one_client_holding_connections_leaves_the_others_served() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let shutdown = CancellationToken::new();
        // Idle connections are cut only after a minute: a probe that had to
        // wait for them would not be answered within the bound below.
        let server = tokio::spawn(run(listener, app, shutdown.clone(), Duration::from_secs(60)));
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS + 50 {
            idle.push(connect_from([127, 0, 0, 9], addr).await);
        }
        let answer = tokio::time::timeout(Duration::from_secs(20), get_from([127, 0, 0, 2], addr))
            .await
            .expect("a probe from another address is served at once");
        assert!(answer.ends_with("ok"), "{answer}");
        // The client past its share has its next connection closed unanswered.
        let answer = tokio::time::timeout(Duration::from_secs(20), get_from([127, 0, 0, 9], addr))
            .await
            .expect("closed, not left waiting");
        assert!(answer.is_empty(), "{answer}");
        drop(idle);
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn connections_past_the_limit_wait_for_one_to_end() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(run(listener, app, shutdown.clone(), Duration::from_secs(2)));
        // Idle connections up to the limit, from as many addresses as their
        // share needs: each holds a permit until the header timeout closes it.
        let mut idle = Vec::new();
        for n in 0..MAX_CONNECTIONS {
            let from = [127, 0, 1, u8::try_from(n / MAX_PER_CLIENT + 1).unwrap()];
            idle.push(connect_from(from, addr).await);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = std::time::Instant::now();
        let answer = get(addr).await;
        assert!(answer.ends_with("ok"), "{answer}");
        assert!(
            started.elapsed() >= Duration::from_millis(1000),
            "served only once the idle ones timed out: {:?}",
            started.elapsed()
        );
        drop(idle);
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .unwrap()
            .unwrap();
    }
}
