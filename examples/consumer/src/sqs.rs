//! Consuming an SQS queue (a FIFO queue hands out each message group's next
//! message only once the one before was deleted, so each order's events
//! come in order), deleting each message only after the inbox commit.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};

use crate::{Delivered, Inbox, Tally};

/// Where the queue is: the region's endpoint, or `endpoint_url` (moto, a
/// VPC endpoint). Credentials come from AWS's default chain (the
/// environment, a profile, a role of the pod or instance).
pub struct Place<'a> {
    /// The service's address, if not the region's.
    pub endpoint_url: Option<&'a str>,
    /// The region, if not the environment's or the profile's.
    pub region: Option<&'a str>,
}

impl Place<'_> {
    /// The SDK's config: its HTTP client on rustls with ring, as the relay's.
    async fn sdk(&self) -> SdkConfig {
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let mut loader = aws_config::defaults(BehaviorVersion::latest()).http_client(http);
        if let Some(region) = self.region {
            loader = loader.region(Region::new(region.to_string()));
        }
        if let Some(url) = self.endpoint_url {
            loader = loader.endpoint_url(url);
        }
        loader.load().await
    }

    async fn client(&self) -> Client {
        Client::new(&self.sdk().await)
    }
}

/// The URL of `queue` (a name, or its URL already).
async fn url(client: &Client, queue: &str) -> anyhow::Result<String> {
    if queue.starts_with("https://") || queue.starts_with("http://") {
        return Ok(queue.to_string());
    }
    let found = client.get_queue_url().queue_name(queue).send().await?;
    Ok(found.queue_url().unwrap_or_default().to_string())
}

/// Makes `queue` unless it exists (a FIFO queue when its name ends in
/// `.fifo`), and returns its URL.
///
/// # Errors
/// SQS refused (a queue of that name with other attributes, say).
pub async fn create(place: &Place<'_>, queue: &str) -> anyhow::Result<String> {
    let client = place.client().await;
    let mut request = client.create_queue().queue_name(queue);
    if queue.ends_with(".fifo") {
        request = request.attributes(QueueAttributeName::FifoQueue, "true");
    }
    Ok(request.send().await?.queue_url().unwrap_or_default().to_string())
}

/// The consumer's view of a message: its attributes as headers (unpacked
/// from `Switchyard-Headers` when they travelled together), its body as the
/// payload, `queue (group G)` as the source.
pub fn delivered(queue: &str, message: &Message) -> Delivered {
    let mut headers: HashMap<String, String> = message
        .message_attributes()
        .map(|attributes| {
            attributes
                .iter()
                .filter_map(|(name, value)| Some((name.clone(), value.string_value()?.to_string())))
                .collect()
        })
        .unwrap_or_default();
    // More headers than SQS's ten attributes, or a name SQS refuses: all of
    // them in one JSON object, beside Switchyard-Event-Id and traceparent.
    if let Some(packed) = headers.remove("Switchyard-Headers")
        && let Ok(serde_json::Value::Object(all)) = serde_json::from_str(&packed)
    {
        for (name, value) in all {
            if let serde_json::Value::String(value) = value {
                headers.insert(name, value);
            }
        }
    }
    let group = message
        .attributes()
        .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId));
    Delivered {
        source: match group {
            Some(group) => format!("{queue} (group {group})"),
            None => queue.to_string(),
        },
        key: headers.get("Switchyard-Key").cloned(),
        headers,
        payload: message.body().unwrap_or_default().as_bytes().to_vec(),
    }
}

/// Receives from `queue` (a name or URL), applying each message via
/// `inbox` and deleting it after the commit, until nothing came for
/// `idle`. `print` sees each message and whether it was applied.
///
/// # Errors
/// SQS or database errors (an undeleted message comes again once its
/// visibility timeout passes).
pub async fn consume(
    place: &Place<'_>,
    queue: &str,
    inbox: &Inbox,
    idle: Duration,
    mut print: impl FnMut(&Delivered, bool),
) -> anyhow::Result<Tally> {
    let client = place.client().await;
    let url = url(&client, queue).await?;
    let mut tally = Tally::default();
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < idle {
        let answer = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .send()
            .await?;
        for message in answer.messages() {
            quiet_since = Instant::now();
            let delivered = delivered(queue, message);
            let applied = delivered.apply(inbox).await?;
            if let Some(handle) = message.receipt_handle() {
                client
                    .delete_message()
                    .queue_url(&url)
                    .receipt_handle(handle)
                    .send()
                    .await?;
            }
            print(&delivered, applied);
            tally.count(applied);
        }
    }
    Ok(tally)
}
