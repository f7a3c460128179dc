//! A plugin's stdout and stderr: captured per call, bounded, and handed to
//! the relay's log afterwards (and a panic message to `last_error`).
//!
//! WASI's default streams write through tokio and block on the runtime,
//! which panics ("Cannot start a runtime from within a runtime") when a
//! plugin prints on a runtime thread; a `println!`, a Rust panic or an
//! uncaught exception in any guest language would take the relay down.
//! These streams are plain memory: always ready, never blocking.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// Bytes kept per stream and call; the rest is counted and dropped, so a
/// chatty plugin can neither flood the log nor grow the relay's memory.
pub const MAX_OUTPUT_PER_CALL: usize = 4096;

/// One captured stream (stdout or stderr) of one plugin instance.
#[derive(Clone, Default)]
pub struct Capture(Arc<Mutex<Captured>>);

#[derive(Default)]
struct Captured {
    bytes: Vec<u8>,
    dropped: usize,
}

/// What a stream held after a call.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Taken {
    /// The text kept (lossy UTF-8, trailing whitespace trimmed).
    pub text: String,
    /// Bytes beyond [`MAX_OUTPUT_PER_CALL`] that were dropped.
    pub dropped: usize,
}

impl Capture {
    fn push(&self, data: &[u8]) {
        let mut captured = match self.0.lock() {
            Ok(captured) => captured,
            Err(poisoned) => poisoned.into_inner(),
        };
        let room = MAX_OUTPUT_PER_CALL.saturating_sub(captured.bytes.len());
        let kept = data.len().min(room);
        captured.bytes.extend_from_slice(&data[..kept]);
        captured.dropped += data.len() - kept;
    }

    /// Empties the stream, returning what it held.
    pub fn take(&self) -> Taken {
        let mut captured = match self.0.lock() {
            Ok(captured) => captured,
            Err(poisoned) => poisoned.into_inner(),
        };
        let bytes = std::mem::take(&mut captured.bytes);
        let dropped = std::mem::take(&mut captured.dropped);
        Taken {
            text: String::from_utf8_lossy(&bytes).trim_end().to_string(),
            dropped,
        }
    }
}

impl IsTerminal for Capture {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for Capture {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl OutputStream for Capture {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        // Always accepts (and drops past the bound): a write error would
        // make Rust's `println!` panic inside the plugin.
        Ok(64 * 1024)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for Capture {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for Capture {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_a_bounded_prefix_and_counts_the_rest() {
        let mut capture = Capture::default();
        OutputStream::write(&mut capture, Bytes::from_static(b"hello\n")).unwrap();
        assert_eq!(
            capture.take(),
            Taken {
                text: "hello".into(),
                dropped: 0
            }
        );
        assert_eq!(capture.take(), Taken::default(), "take empties the stream");

        OutputStream::write(&mut capture, Bytes::from(vec![b'x'; MAX_OUTPUT_PER_CALL + 10])).unwrap();
        let taken = capture.take();
        assert_eq!(taken.text.len(), MAX_OUTPUT_PER_CALL);
        assert_eq!(taken.dropped, 10);
        assert!(capture.check_write().unwrap() > 0, "never refuses a write");
    }
}
