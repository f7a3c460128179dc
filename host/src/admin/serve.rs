//! The admin endpoint's connections: HTTP/1 through hyper with a bound on
//! how long a request's header may take to arrive and on how many
//! connections are served at once, so that whoever reaches the port cannot
//! hold it (a client sending its header a byte at a time, or thousands of
//! idle connections) and starve the kubelet's probes and Prometheus.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Connections served at once. One more waits in the kernel's backlog
/// until a connection ends.
pub const MAX_CONNECTIONS: usize = 256;

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
        let service = TowerToHyperService::new(app.clone().layer(axum::Extension(ConnectInfo(peer))));
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let _permit = permit;
            serve_connection(stream, peer, service, shutdown, header_timeout).await;
        });
        while connections.try_join_next().is_some() {}
    }
    let _ = tokio::time::timeout(DRAIN, async { while connections.join_next().await.is_some() {} }).await;
}

async fn serve_connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    service: TowerToHyperService<Router>,
    shutdown: CancellationToken,
    header_timeout: Duration,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
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
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
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
    async fn connections_past_the_limit_wait_for_one_to_end() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(run(listener, app, shutdown.clone(), Duration::from_secs(2)));
        // Idle connections up to the limit: each holds a permit until the
        // header timeout closes it.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
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
