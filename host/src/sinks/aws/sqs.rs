//! The SQS target (`type = "sqs"`): the plugin's topic names a queue (a
//! name in the account and region, or its URL); messages go in batches of
//! up to 10 through `SendMessageBatch`, each entry's answer its message's
//! outcome. On a FIFO queue (a name ending `.fifo`) the message group is
//! the aggregate id by default and the deduplication id is the event id,
//! so a retry within SQS's 5-minute window is dropped.

use crate::sinks::aws::config::{GroupId, aws_kind, aws_target};

aws_target! {
    /// `[targets.NAME]` with `type = "sqs"`.
    SqsSinkConfig {
        /// On FIFO queues, each message's group.
        #[serde(default)]
        pub message_group: GroupId,
        /// Queues to check at start and in `switchyard validate` (names or
        /// URLs). Queues the plugins name beyond these are found missing at
        /// their first publish.
        #[serde(default)]
        pub queues: Vec<String>,
        /// The account that owns the queues the plugins name, when it is not
        /// the relay's own.
        #[serde(default)]
        pub queue_owner_account_id: Option<String>,
    }
}

/// Why SQS would refuse `queue` as a name or URL.
pub(crate) fn queue_problem(queue: &str) -> Option<String> {
    if queue.starts_with("https://") || queue.starts_with("http://") {
        return None;
    }
    let problem = if queue.is_empty() || queue.len() > 80 {
        "must be 1 to 80 characters long"
    } else if !queue
        .trim_end_matches(".fifo")
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        "may hold only letters, digits, - and _ (and end in .fifo for a FIFO queue)"
    } else {
        return None;
    };
    Some(format!("SQS queue name {queue:?} {problem}"))
}

aws_kind!(
    SqsSinkConfig,
    "sqs",
    SqsSink,
    queues,
    queue_problem,
    sqs_extra,
    true
);

/// What else is wrong with the settings: the fixed group.
fn sqs_extra(config: &SqsSinkConfig) -> Vec<String> {
    crate::sinks::aws::config::group_problems(&config.message_group)
}

#[cfg(feature = "aws")]
mod sink {
    use std::collections::{HashMap, HashSet};
    use std::time::Duration;

    use aws_sdk_sqs::Client;
    use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
    use futures::future::BoxFuture;

    use super::SqsSinkConfig;
    use crate::sinks::aws::attributes::{self, MAX_MESSAGE_BYTES, Prepared};
    use crate::sinks::aws::client::{Connection, only_denied};
    use crate::sinks::aws::{EntryFailure, entry_outcomes, in_order, per_topic};
    use crate::sinks::{FailureKind, OutgoingMessage, Sink, SinkError};

    /// Entries of one `SendMessageBatch`.
    const BATCH: usize = 10;

    /// Queue URLs known by name; past this many the map starts again.
    const KNOWN_QUEUES: usize = 1_000;

    /// SQS queues as a target.
    pub struct SqsSink {
        name: String,
        config: SqsSinkConfig,
        connection: Connection,
        client: Client,
        urls: std::sync::Mutex<HashMap<String, String>>,
    }

    impl SqsSink {
        /// A sink for `config`; a call takes at most `timeout`.
        pub async fn connect(name: &str, config: &SqsSinkConfig, timeout: Duration) -> SqsSink {
            let connection = Connection::new(&config.connection(), timeout).await;
            let client = Client::new(&connection.sdk);
            SqsSink {
                name: name.to_string(),
                config: config.clone(),
                connection,
                client,
                urls: std::sync::Mutex::new(HashMap::new()),
            }
        }

        /// The URL of `queue` (a name, or its URL already).
        async fn url(&self, queue: &str) -> Result<String, SinkError> {
            if queue.starts_with("https://") || queue.starts_with("http://") {
                return Ok(queue.to_string());
            }
            if let Some(url) = self.lock_urls().get(queue) {
                return Ok(url.clone());
            }
            let found = self
                .client
                .get_queue_url()
                .queue_name(queue)
                .set_queue_owner_aws_account_id(self.config.queue_owner_account_id.clone())
                .send()
                .await
                .map_err(|e| self.connection.classify(&e, "SQS", &format!("queue {queue}")))?;
            let url = found.queue_url().unwrap_or_default().to_string();
            let mut urls = self.lock_urls();
            if urls.len() >= KNOWN_QUEUES {
                urls.clear();
            }
            urls.insert(queue.to_string(), url.clone());
            Ok(url)
        }

        fn lock_urls(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
            self.urls
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }

        /// Each listed queue that does not exist or may not be read.
        ///
        /// # Errors
        /// SQS could not be asked.
        pub async fn listed_problems(&self) -> Result<Vec<String>, SinkError> {
            let mut problems = Vec::new();
            for queue in &self.config.queues {
                let checked = match self.url(queue).await {
                    Ok(url) => self
                        .client
                        .get_queue_attributes()
                        .queue_url(&url)
                        .attribute_names(aws_sdk_sqs::types::QueueAttributeName::QueueArn)
                        .send()
                        .await
                        .map(|_| ())
                        .map_err(|e| self.connection.classify(&e, "SQS", &format!("queue {queue}"))),
                    Err(e) => Err(e),
                };
                match checked {
                    Ok(()) => {}
                    Err(e) if matches!(e.kind, FailureKind::UnknownTopic | FailureKind::Unauthorized) => {
                        problems.push(e.message);
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(problems)
        }

        /// Sends one queue's messages, in order, batch after batch.
        async fn send_queue(
            &self,
            queue: &str,
            messages: Vec<(usize, &OutgoingMessage)>,
        ) -> Vec<(usize, Result<(), SinkError>)> {
            // A name the service would refuse fails its messages now: asked
            // for, it could read as a missing queue, which waits for ever.
            if let Some(problem) = super::queue_problem(queue) {
                let error = SinkError::permanent(problem);
                return messages
                    .into_iter()
                    .map(|(index, _)| (index, Err(error.clone())))
                    .collect();
            }
            let url = match self.url(queue).await {
                Ok(url) => url,
                Err(e) => {
                    return messages
                        .into_iter()
                        .map(|(index, _)| (index, Err(e.clone())))
                        .collect();
                }
            };
            let fifo = url.ends_with(".fifo");
            let mut results = Vec::with_capacity(messages.len());
            let mut ready = Vec::with_capacity(messages.len());
            for (index, message) in messages {
                match attributes::prepare(message, "SQS", fifo, &self.config.message_group) {
                    Ok(prepared) => ready.push((index, prepared)),
                    Err(e) => results.push((index, Err(e))),
                }
            }
            // A FIFO group's messages go one per call, in order.
            let url = &url;
            let keyed = ready
                .into_iter()
                .map(|(index, r)| (index, r.group.clone(), r))
                .collect();
            results.extend(
                in_order(keyed, |round: Vec<(usize, Prepared)>| async move {
                    let sizes: Vec<usize> = round.iter().map(|(_, r)| r.size).collect();
                    let mut sent = Vec::with_capacity(round.len());
                    let mut round = round.into_iter();
                    for run in attributes::batches(&sizes, BATCH, MAX_MESSAGE_BYTES) {
                        let batch: Vec<(usize, Prepared)> = round.by_ref().take(run.len()).collect();
                        sent.extend(self.send_batch(url, queue, batch).await);
                    }
                    sent
                })
                .await,
            );
            results
        }

        async fn send_batch(
            &self,
            url: &str,
            queue: &str,
            batch: Vec<(usize, Prepared)>,
        ) -> Vec<(usize, Result<(), SinkError>)> {
            // The prepared strings move into the request: a batch is ten
            // bodies of up to 256 KiB, not worth copying again.
            let (indexes, prepared): (Vec<usize>, Vec<Prepared>) = batch.into_iter().unzip();
            let mut entries = Vec::with_capacity(prepared.len());
            for (at, ready) in prepared.into_iter().enumerate() {
                let mut entry = SendMessageBatchRequestEntry::builder()
                    .id(at.to_string())
                    .message_body(ready.body);
                for (name, value) in ready.attributes {
                    let value = MessageAttributeValue::builder()
                        .data_type("String")
                        .string_value(value)
                        .build();
                    if let Ok(value) = value {
                        entry = entry.message_attributes(name, value);
                    }
                }
                if !ready.group.is_empty() {
                    entry = entry
                        .message_group_id(ready.group)
                        .message_deduplication_id(ready.dedup);
                }
                match entry.build() {
                    Ok(entry) => entries.push(entry),
                    Err(e) => {
                        return indexes
                            .into_iter()
                            .map(|index| (index, Err(SinkError::permanent(format!("SQS entry: {e}")))))
                            .collect();
                    }
                }
            }
            let answer = self
                .client
                .send_message_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
                .await;
            let output = match answer {
                Ok(output) => output,
                Err(e) => {
                    let error = self.connection.classify(&e, "SQS", &format!("queue {queue}"));
                    return indexes
                        .into_iter()
                        .map(|index| (index, Err(error.clone())))
                        .collect();
                }
            };
            let failed: Vec<EntryFailure<'_>> = output
                .failed()
                .iter()
                .map(|f| EntryFailure {
                    id: f.id().to_string(),
                    code: f.code(),
                    sender_fault: Some(f.sender_fault()),
                    message: f.message(),
                })
                .collect();
            let succeeded: HashSet<String> = output.successful().iter().map(|s| s.id().to_string()).collect();
            entry_outcomes(
                &self.connection,
                indexes,
                &failed,
                &succeeded,
                "SQS",
                &format!("queue {queue}"),
            )
        }
    }

    impl Sink for SqsSink {
        fn kind(&self) -> &'static str {
            "sqs"
        }

        fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
            Box::pin(async move { per_topic(&messages, |topic, list| self.send_queue(topic, list)).await })
        }

        /// SQS answers and takes the credentials: the first listed queue's
        /// attributes are read, or with none listed, a one-queue list. A refused read
        /// permission still shows both (the relay's identity may only send).
        fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
            Box::pin(async move {
                let checked = match self.config.queues.first() {
                    // A call each time: the URL may be cached, the queue's
                    // attributes are read from SQS.
                    Some(queue) => match self.url(queue).await {
                        Ok(url) => self
                            .client
                            .get_queue_attributes()
                            .queue_url(&url)
                            .attribute_names(aws_sdk_sqs::types::QueueAttributeName::QueueArn)
                            .send()
                            .await
                            .map(|_| ())
                            .map_err(|e| self.connection.classify(&e, "SQS", &format!("queue {queue}"))),
                        Err(e) => Err(e),
                    },
                    None => self
                        .client
                        .list_queues()
                        .max_results(1)
                        .send()
                        .await
                        .map(|_| ())
                        .map_err(|e| self.connection.classify(&e, "SQS", "the account's queues")),
                };
                match checked {
                    Err(e) if only_denied(&e) => {
                        tracing::debug!(sink.name = %self.name, error = %e, "SQS health check: a read the identity may not do; it signed in.");
                        Ok(())
                    }
                    other => other,
                }
            })
        }

        fn deduplicates_by_id(&self) -> bool {
            true
        }
    }
}
