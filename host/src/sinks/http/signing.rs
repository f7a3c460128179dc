//! Request signatures as the Standard Webhooks specification has them:
//! `webhook-id`, `webhook-timestamp` and `webhook-signature`, the last a
//! space-separated list of `v1,` + base64 HMAC-SHA256 over
//! `id.timestamp.body`, one per configured secret, so that a receiver
//! rotating its secret accepts requests signed with either.

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::secret::{Held, SecretValue};

/// The key of a secret as the specification writes it: `whsec_` and the
/// key in base64 (a secret without the prefix is taken as base64 too).
///
/// # Errors
/// A secret that is not base64, named by its position, never shown.
pub fn secret_key(secret: &str, position: usize) -> Result<Vec<u8>, String> {
    let encoded = secret.trim().strip_prefix("whsec_").unwrap_or(secret.trim());
    base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| format!("signing secret {position} is not whsec_ followed by base64"))
}

/// The signature of `body` sent as `id` at `timestamp` (Unix seconds).
pub fn sign(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    // HMAC takes a key of any length.
    let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    )
}

/// A target's signing secrets, each read again as it rotates.
#[derive(Debug)]
pub struct Signer {
    secrets: Vec<Held>,
}

impl Signer {
    /// Signs with each of `secrets`.
    pub fn new(secrets: &[SecretValue]) -> Signer {
        Signer {
            secrets: secrets.iter().cloned().map(Held::new).collect(),
        }
    }

    /// Whether there is a secret to sign with.
    pub fn signs(&self) -> bool {
        !self.secrets.is_empty()
    }

    /// The `webhook-signature` header's value for `body` sent as `id` at
    /// `timestamp`: one signature per secret.
    ///
    /// # Errors
    /// A secret that cannot be read or decoded, named by position.
    pub async fn signature(&self, id: &str, timestamp: i64, body: &[u8]) -> Result<String, String> {
        let mut signatures = Vec::with_capacity(self.secrets.len());
        for (position, secret) in self.secrets.iter().enumerate() {
            let secret = secret
                .get()
                .await
                .map_err(|e| format!("signing secret {}: {e}", position + 1))?;
            let key = secret_key(secret.expose(), position + 1)?;
            signatures.push(sign(&key, id, timestamp, body));
        }
        Ok(signatures.join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The specification's own example: secret, id, timestamp, payload and
    /// the signature it gives.
    #[test]
    fn the_specifications_example_signs_as_published() {
        let key = secret_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", 1).unwrap();
        let signature = sign(
            &key,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn a_secret_that_is_not_base64_is_named_by_position_and_not_shown() {
        let error = secret_key("whsec_not base64!", 2).unwrap_err();
        assert!(
            error.contains("signing secret 2") && !error.contains("not base64!"),
            "{error}"
        );
    }
}
