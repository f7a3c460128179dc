//! The SNS target (`type = "sns"`): the plugin's topic names an SNS topic
//! (a name in the account and region, or its ARN); messages go in batches
//! of up to 10 through `PublishBatch`, each entry's answer its message's
//! outcome. On a FIFO topic (a name ending `.fifo`) the message group and
//! the deduplication id are set as on an SQS FIFO queue.

use crate::sinks::aws::config::{GroupId, aws_kind, aws_target};

aws_target! {
    /// `[targets.NAME]` with `type = "sns"`.
    SnsSinkConfig {
        /// On FIFO topics, each message's group.
        #[serde(default)]
        pub message_group: GroupId,
        /// Topics to check at start and in `switchyard validate` (names or
        /// ARNs).
        #[serde(default)]
        pub topics: Vec<String>,
    }
}

/// Why SNS would refuse `topic` as a name or ARN.
pub(crate) fn topic_problem(topic: &str) -> Option<String> {
    if topic.starts_with("arn:") {
        return (topic.split(':').count() != 6)
            .then(|| format!("SNS topic ARN {topic:?} is not arn:PARTITION:sns:REGION:ACCOUNT:NAME"));
    }
    let problem = if topic.is_empty() || topic.len() > 256 {
        "must be 1 to 256 characters long"
    } else if !topic
        .trim_end_matches(".fifo")
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        "may hold only letters, digits, - and _ (and end in .fifo for a FIFO topic)"
    } else {
        return None;
    };
    Some(format!("SNS topic name {topic:?} {problem}"))
}

aws_kind!(
    SnsSinkConfig,
    "sns",
    SnsSink,
    topics,
    topic_problem,
    sns_extra,
    true
);

/// What else is wrong with the settings: the fixed group.
fn sns_extra(config: &SnsSinkConfig) -> Vec<String> {
    crate::sinks::aws::config::group_problems(&config.message_group)
}

#[cfg(feature = "aws")]
mod sink {
    use std::collections::HashSet;
    use std::time::Duration;

    use aws_sdk_sns::Client;
    use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};
    use futures::future::BoxFuture;

    use super::SnsSinkConfig;
    use crate::sinks::aws::attributes::{self, MAX_MESSAGE_BYTES, Prepared};
    use crate::sinks::aws::client::{Connection, only_denied};
    use crate::sinks::aws::{EntryFailure, entry_outcomes, in_order, per_topic};
    use crate::sinks::{FailureKind, OutgoingMessage, Sink, SinkError};

    /// Entries of one `PublishBatch`.
    const BATCH: usize = 10;

    /// SNS topics as a target.
    pub struct SnsSink {
        name: String,
        config: SnsSinkConfig,
        connection: Connection,
        client: Client,
        /// `arn:PARTITION:sns:REGION:ACCOUNT:`, found once.
        prefix: tokio::sync::OnceCell<String>,
    }

    impl SnsSink {
        /// A sink for `config`; a call takes at most `timeout`.
        pub async fn connect(name: &str, config: &SnsSinkConfig, timeout: Duration) -> SnsSink {
            let connection = Connection::new(&config.connection(), timeout).await;
            let client = Client::new(&connection.sdk);
            SnsSink {
                name: name.to_string(),
                config: config.clone(),
                connection,
                client,
                prefix: tokio::sync::OnceCell::new(),
            }
        }

        /// The ARN of `topic` (a name in the relay's account and region,
        /// or its ARN already).
        async fn arn(&self, topic: &str) -> Result<String, SinkError> {
            if topic.starts_with("arn:") {
                return Ok(topic.to_string());
            }
            let prefix = self
                .prefix
                .get_or_try_init(|| async {
                    let sts = aws_sdk_sts::Client::new(&self.connection.sts);
                    let identity = sts
                        .get_caller_identity()
                        .send()
                        .await
                        .map_err(|e| self.connection.classify(&e, "STS", "the relay's identity"))?;
                    let account = identity.account().unwrap_or_default();
                    // The partition of the identity's own ARN (aws, aws-cn, aws-us-gov).
                    let partition = identity
                        .arn()
                        .and_then(|arn| arn.split(':').nth(1))
                        .unwrap_or("aws");
                    let region = self
                        .connection
                        .sdk
                        .region()
                        .map(ToString::to_string)
                        .unwrap_or_default();
                    Ok::<_, SinkError>(format!("arn:{partition}:sns:{region}:{account}:"))
                })
                .await?;
            Ok(format!("{prefix}{topic}"))
        }

        /// Each listed topic that does not exist or may not be read.
        ///
        /// # Errors
        /// SNS could not be asked.
        pub async fn listed_problems(&self) -> Result<Vec<String>, SinkError> {
            let mut problems = Vec::new();
            for topic in &self.config.topics {
                let checked = match self.arn(topic).await {
                    Ok(arn) => self
                        .client
                        .get_topic_attributes()
                        .topic_arn(&arn)
                        .send()
                        .await
                        .map(|_| ())
                        .map_err(|e| self.connection.classify(&e, "SNS", &format!("topic {topic}"))),
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

        /// Sends one topic's messages, in order, batch after batch.
        async fn send_topic(
            &self,
            topic: &str,
            messages: Vec<(usize, &OutgoingMessage)>,
        ) -> Vec<(usize, Result<(), SinkError>)> {
            // A name the service would refuse fails its messages now: asked
            // for, it could read as a missing topic, which waits for ever.
            if let Some(problem) = super::topic_problem(topic) {
                let error = SinkError::permanent(problem);
                return messages
                    .into_iter()
                    .map(|(index, _)| (index, Err(error.clone())))
                    .collect();
            }
            let arn = match self.arn(topic).await {
                Ok(arn) => arn,
                Err(e) => {
                    return messages
                        .into_iter()
                        .map(|(index, _)| (index, Err(e.clone())))
                        .collect();
                }
            };
            let fifo = arn.ends_with(".fifo");
            let mut results = Vec::with_capacity(messages.len());
            let mut ready = Vec::with_capacity(messages.len());
            for (index, message) in messages {
                match attributes::prepare(message, "SNS", fifo, &self.config.message_group) {
                    Ok(prepared) => ready.push((index, prepared)),
                    Err(e) => results.push((index, Err(e))),
                }
            }
            // A FIFO group's messages go one per call, in order.
            let arn = &arn;
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
                        sent.extend(self.send_batch(arn, topic, batch).await);
                    }
                    sent
                })
                .await,
            );
            results
        }

        async fn send_batch(
            &self,
            arn: &str,
            topic: &str,
            batch: Vec<(usize, Prepared)>,
        ) -> Vec<(usize, Result<(), SinkError>)> {
            let mut entries = Vec::with_capacity(batch.len());
            for (at, (_, ready)) in batch.iter().enumerate() {
                let mut entry = PublishBatchRequestEntry::builder()
                    .id(at.to_string())
                    .message(&ready.body);
                for (name, value) in &ready.attributes {
                    if let Ok(value) = MessageAttributeValue::builder()
                        .data_type("String")
                        .string_value(value)
                        .build()
                    {
                        entry = entry.message_attributes(name, value);
                    }
                }
                if !ready.group.is_empty() {
                    entry = entry
                        .message_group_id(&ready.group)
                        .message_deduplication_id(&ready.dedup);
                }
                match entry.build() {
                    Ok(entry) => entries.push(entry),
                    Err(e) => {
                        return batch
                            .into_iter()
                            .map(|(index, _)| (index, Err(SinkError::permanent(format!("SNS entry: {e}")))))
                            .collect();
                    }
                }
            }
            let answer = self
                .client
                .publish_batch()
                .topic_arn(arn)
                .set_publish_batch_request_entries(Some(entries))
                .send()
                .await;
            let output = match answer {
                Ok(output) => output,
                Err(e) => {
                    let error = self.connection.classify(&e, "SNS", &format!("topic {topic}"));
                    return batch
                        .into_iter()
                        .map(|(index, _)| (index, Err(error.clone())))
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
            let succeeded: HashSet<String> = output
                .successful()
                .iter()
                .filter_map(|s| s.id().map(ToString::to_string))
                .collect();
            let indexes = batch.into_iter().map(|(index, _)| index).collect();
            entry_outcomes(
                &self.connection,
                indexes,
                &failed,
                &succeeded,
                "SNS",
                &format!("topic {topic}"),
            )
        }
    }

    impl Sink for SnsSink {
        fn kind(&self) -> &'static str {
            "sns"
        }

        fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
            Box::pin(async move { per_topic(&messages, |topic, list| self.send_topic(topic, list)).await })
        }

        /// SNS answers and takes the credentials: the first listed topic
        /// exists, or with none listed, a one-page topic list. A refused read
        /// permission still shows both.
        fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
            Box::pin(async move {
                let checked = match self.config.topics.first() {
                    Some(topic) => match self.arn(topic).await {
                        Ok(arn) => self
                            .client
                            .get_topic_attributes()
                            .topic_arn(&arn)
                            .send()
                            .await
                            .map(|_| ())
                            .map_err(|e| self.connection.classify(&e, "SNS", &format!("topic {topic}"))),
                        Err(e) => Err(e),
                    },
                    None => self
                        .client
                        .list_topics()
                        .send()
                        .await
                        .map(|_| ())
                        .map_err(|e| self.connection.classify(&e, "SNS", "the account's topics")),
                };
                match checked {
                    Err(e) if only_denied(&e) => {
                        tracing::debug!(sink.name = %self.name, error = %e, "SNS health check: a read the identity may not do; it signed in.");
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
