//! Consuming a Pub/Sub subscription (ordering on, so each order's events
//! come in order), acknowledging each message only after the inbox commit.

use std::time::Duration;

use google_cloud_auth::credentials::{Credentials, anonymous};
use google_cloud_pubsub::client::{Subscriber, SubscriptionAdmin, TopicAdmin};

use crate::{Delivered, Inbox, Tally};

/// Where the subscription is: the emulator at `emulator_host`, or the real
/// service with Application Default Credentials.
pub struct Place<'a> {
    /// `host:port` of an emulator, if it is one.
    pub emulator_host: Option<&'a str>,
    /// The project.
    pub project: &'a str,
}

impl Place<'_> {
    fn endpoint(&self) -> Option<String> {
        self.emulator_host.map(|host| format!("http://{host}"))
    }

    fn credentials(&self) -> anyhow::Result<Credentials> {
        Ok(match self.emulator_host {
            Some(_) => anonymous::Builder::new().build(),
            None => google_cloud_auth::credentials::Builder::default().build()?,
        })
    }
}

/// Makes `topic` and an ordering-enabled `subscription` on it unless they
/// exist: a subscription gets only what is published after it was made.
///
/// # Errors
/// Pub/Sub refused (anything but "already exists").
pub async fn create(place: &Place<'_>, topic: &str, subscription: &str) -> anyhow::Result<()> {
    let mut topics = TopicAdmin::builder().with_credentials(place.credentials()?);
    let mut subscriptions = SubscriptionAdmin::builder().with_credentials(place.credentials()?);
    if let Some(endpoint) = place.endpoint() {
        topics = topics.with_endpoint(&endpoint);
        subscriptions = subscriptions.with_endpoint(&endpoint);
    }
    let topic = format!("projects/{}/topics/{topic}", place.project);
    let exists = |e: &google_cloud_pubsub::Error| {
        e.status()
            .is_some_and(|s| s.code == google_cloud_gax::error::rpc::Code::AlreadyExists)
    };
    match topics.build().await?.create_topic().set_name(&topic).send().await {
        Err(e) if !exists(&e) => return Err(e.into()),
        _ => {}
    }
    let created = subscriptions
        .build()
        .await?
        .create_subscription()
        .set_name(format!("projects/{}/subscriptions/{subscription}", place.project))
        .set_topic(&topic)
        .set_enable_message_ordering(true)
        .send()
        .await;
    match created {
        Err(e) if !exists(&e) => Err(e.into()),
        _ => Ok(()),
    }
}

/// Reads `subscription`, applying each message via `inbox` and
/// acknowledging it after the commit, until nothing came for `idle`.
/// `print` sees each message and whether it was applied.
///
/// # Errors
/// Pub/Sub or database errors (an unacknowledged message comes again).
pub async fn consume(
    place: &Place<'_>,
    subscription: &str,
    inbox: &Inbox,
    idle: Duration,
    mut print: impl FnMut(&Delivered, bool),
) -> anyhow::Result<Tally> {
    let mut builder = Subscriber::builder().with_credentials(place.credentials()?);
    if let Some(endpoint) = place.endpoint() {
        builder = builder.with_endpoint(&endpoint);
    }
    let mut stream = builder
        .build()
        .await?
        .subscribe(format!("projects/{}/subscriptions/{subscription}", place.project))
        .build();
    let mut tally = Tally::default();
    while let Ok(Some(next)) = tokio::time::timeout(idle, stream.next()).await {
        let (message, handler) = next?;
        let headers: std::collections::HashMap<String, String> = message.attributes.into_iter().collect();
        let delivered = Delivered {
            source: format!("{subscription} (ordering key {})", message.ordering_key),
            key: headers.get("Switchyard-Key").cloned(),
            headers,
            payload: message.data.to_vec(),
        };
        let applied = delivered.apply(inbox).await?;
        handler.ack();
        print(&delivered, applied);
        tally.count(applied);
    }
    Ok(tally)
}
