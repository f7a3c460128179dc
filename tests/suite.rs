//! The integration tests, one binary: each file of `tests/` is a module of
//! it, named as the file is (`replication::...`, `claim::order::...`), and
//! `cargo nextest run` (or `cargo test --test suite MODULE::`) picks them.
//! What each file covers is in the book's tests page.

mod binlog;
#[path = "claim/main.rs"]
mod claim;
mod claim_cost;
mod config;
mod console;
mod consumer;
mod container;
mod demo;
mod existing_table;
mod faults;
mod grants;
mod many_databases;
mod operations;
mod plugin_languages;
mod plugin_registry;
mod plugin_runtime;
mod relay_aws;
mod relay_http;
mod relay_kafka;
mod relay_nats;
mod relay_pubsub;
mod relay_rabbitmq;
mod relay_redis;
mod relay_sqlite;
mod replication;
mod secrets;
mod tls;
