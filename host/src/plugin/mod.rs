//! The WebAssembly plugin runtime: one wasmtime `Engine`, each plugin version
//! compiled and pre-instantiated once, instances pooled and reused until one
//! traps, and every call bounded in time (epoch deadline) and memory.
//!
//! | module | holds |
//! |---|---|
//! | [`engine`] | engines, compilation, `inspect` |
//! | [`version`] | one compiled version, its instance pool, calls |
//! | [`registry`] | the configured plugins and the version serving each |
//! | [`reload`] | hot reload: re-reading a file, baseline then optimised build |
//! | [`watch`] | the directory watcher that triggers reloads |
//! | [`oci`] | plugins pulled from an OCI registry, cached by digest, followed by tag |
//! | [`error`] | load and call failures, trap descriptions |

mod bindings;
pub mod engine;
pub mod error;
mod host;
pub mod oci;
mod output;
pub mod registry;
mod reload;
mod scrape;
pub mod version;
pub mod watch;

pub use bindings::switchyard::plugin::types::{Event, Message, PayloadFormat, Refusal};
pub use engine::{Inspection, PluginEngine, Tier, content_hash};
pub use error::{CallFailure, LoadError};
pub use registry::{OciState, PluginSlot, Plugins, ReloadResult};
pub use version::{Instance, PluginVersion};
