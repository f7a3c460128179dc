//! A registry plugin's source in a build without the registry client
//! (cargo feature `oci` off, as in the demo's build): `validate` and a
//! relay's start refuse `oci://` plugins ([`OciError::Unbuilt`]), so no source
//! is ever made.

use std::time::Duration;

use super::{OciCache, OciError, Pulled};
use crate::config::RegistryConfig;

/// A registry plugin's source, of which this build can make none.
#[derive(Debug, Clone)]
pub struct OciSource {
    never: std::convert::Infallible,
}

impl OciSource {
    /// Refuses: this build has no registry client.
    ///
    /// # Errors
    /// Always, [`OciError::Unbuilt`].
    pub fn new(reference: &str, _settings: &RegistryConfig) -> Result<OciSource, OciError> {
        Err(OciError::Unbuilt {
            reference: format!("{}{reference}", crate::config::registry::OCI_SCHEME),
        })
    }

    /// Never called: no source is made.
    pub fn display(&self) -> String {
        match self.never {}
    }

    /// Never called: no source is made.
    pub fn pinned(&self) -> bool {
        match self.never {}
    }

    /// Never called: no source is made.
    pub fn refresh(&self) -> Duration {
        match self.never {}
    }

    /// Never called: no source is made.
    ///
    /// # Errors
    /// None.
    pub async fn head(&self) -> Result<String, OciError> {
        match self.never {}
    }

    /// Never called: no source is made.
    ///
    /// # Errors
    /// None.
    pub async fn pull(&self, _cache: &OciCache) -> Result<Pulled, OciError> {
        match self.never {}
    }

    /// Never called: no source is made.
    ///
    /// # Errors
    /// None.
    pub async fn push(
        &self,
        _component: Vec<u8>,
        _exports: &[String],
        _imports: &[String],
    ) -> Result<String, OciError> {
        match self.never {}
    }
}
