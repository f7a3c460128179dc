//! The HTTP webhook target (`type = "http"`): each event a request to an
//! address the config names (a path under `base_url`, or an endpoint by
//! name: a plugin chooses among them, never a host of its own), signed as
//! the Standard Webhooks specification says, with a bearer token, basic
//! login or a client certificate. 2xx is delivered; 408, 429, 5xx, a
//! refused connection and a timeout pause the target (honouring
//! `Retry-After`); 401 and 403 wait, named; 410 Gone waits as a removed
//! endpoint; any other 4xx fails that event, with the status and the first
//! bytes of the answer.

mod config;
mod signing;
#[cfg(feature = "http")]
mod sink;

pub use config::{BatchFormat, HttpMethod, HttpSinkConfig};
pub use signing::{Signer, sign};
