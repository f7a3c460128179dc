//! Switchyard is a transactional-outbox relay. Services write an event row into
//! an outbox table in the same transaction as their business data; Switchyard
//! claims those rows, asks a WebAssembly routing plugin what to publish, sends
//! it to NATS (and other targets), and records the outcome per row and target.
//!
//! # Layout
//! - [`config`]: the TOML config, environment overrides and validation.
//! - [`store`]: the outbox (PostgreSQL or SQLite): migrations, claims under a
//!   lease, acks, and the operator queries behind `status` and `dlq`.
//! - [`plugin`]: the wasmtime component runtime for routing plugins.
//! - [`router`]: pure checks and message assembly around the plugin call
//!   (part of the relay's route stage).
//! - [`redact`]: masking credentials wherever a URL is shown.
//! - [`secret`]: passwords read from files or commands, again as they rotate.
//! - [`tls`]: the one crypto provider, certificate checks, TLS failures explained.
//! - [`sinks`]: publishing to brokers, with retryable/permanent errors.
//! - [`relay`]: the worker loop tying the above together.
//! - [`fleet`]: many outbox databases behind one process (`[[databases]]`,
//!   `[catalog]`), and relays sharing them out (`[ownership]`).
//! - [`retention`]: removing published rows past their age.
//! - [`store::capture`]: relaying an outbox table the services already write (`[source]`).
//! - [`trace`]: continuing the writer's W3C `traceparent` through the relay.
//! - [`admin`], [`metrics`]: the HTTP endpoint, Prometheus metrics, status.
//! - [`demo`]: `switchyard demo`, the embedded default end to end.
//! - [`app`], [`cli`], [`telemetry`]: process wiring.

#![warn(missing_docs, clippy::all)]
// The relay's own functions stay under 100 lines (clippy's count: code
// only), checked by the one workspace clippy run of scripts/lint.sh.
#![warn(clippy::too_many_lines)]
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod backoff;
pub mod cli;
pub mod config;
pub mod console;
pub mod demo;
pub mod endpoint;
pub mod features;
pub mod fleet;
pub mod mask;
pub mod metrics;
pub mod plugin;
pub mod redact;
pub mod relay;
pub mod retention;
pub mod runtime;
pub mod secret;
pub mod sinks;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod trace;

pub use config::Config;
pub use relay::{BatchReport, Relay, RelayBuilder, router};
pub use store::OutboxStore;

/// The allocator of the shipped binary: mimalloc with the default `mimalloc`
/// feature, else the system's. Every binary that runs the relay (the
/// `switchyard` binary, the test suite's relay processes, the benchmarks)
/// installs this one, so what the tests and fault runs measure is what ships:
/// `#[global_allocator] static A: switchyard::Allocator = switchyard::ALLOCATOR;`
#[cfg(feature = "mimalloc")]
pub type Allocator = switchyard_alloc::Allocator;
/// The allocator of the shipped binary (see the `mimalloc` feature).
#[cfg(not(feature = "mimalloc"))]
pub type Allocator = std::alloc::System;
/// The value to install as the global allocator.
#[cfg(feature = "mimalloc")]
pub const ALLOCATOR: Allocator = switchyard_alloc::ALLOCATOR;

/// The shipped allocator's settings (see `switchyard_alloc::tune`), applied
/// by every binary that installs [`ALLOCATOR`], first thing in `main`.
pub fn tune_allocator() {
    #[cfg(feature = "mimalloc")]
    switchyard_alloc::tune();
}
/// The value to install as the global allocator.
#[cfg(not(feature = "mimalloc"))]
pub const ALLOCATOR: Allocator = std::alloc::System;
