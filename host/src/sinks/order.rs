//! How the sinks that answer per message send a batch: topic by topic at
//! once, and within a topic in rounds holding at most one message per
//! ordering key, so that a service answering each message on its own can
//! never store an aggregate's later message while failing its earlier one.
//! Also the envelope the sinks without headers of their own carry a
//! message's headers in.

use crate::sinks::{OutgoingMessage, SinkError};

/// Publishes `messages` topic by topic (queue, topic, stream, bus), the
/// topics at once and each topic's messages in order through `send`, which
/// answers for each message it was given by its index.
pub(crate) async fn per_topic<'m, F, Fut>(
    messages: &'m [OutgoingMessage],
    send: F,
) -> Vec<Result<(), SinkError>>
where
    F: Fn(&'m str, Vec<(usize, &'m OutgoingMessage)>) -> Fut,
    Fut: std::future::Future<Output = Vec<(usize, Result<(), SinkError>)>>,
{
    let mut by_topic: Vec<(&str, Vec<(usize, &OutgoingMessage)>)> = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        match by_topic.iter_mut().find(|(topic, _)| *topic == message.topic) {
            Some((_, list)) => list.push((index, message)),
            None => by_topic.push((message.topic.as_str(), vec![(index, message)])),
        }
    }
    let sent = futures::future::join_all(by_topic.into_iter().map(|(topic, list)| send(topic, list))).await;
    let mut results: Vec<Result<(), SinkError>> = (0..messages.len()).map(|_| Ok(())).collect();
    for (index, result) in sent.into_iter().flatten() {
        results[index] = result;
    }
    results
}

/// Sends `items` (index, order key, message) through `send` in rounds: a
/// round holds at most one message per key (an empty key is unordered: all
/// go in the first round), so a service that answers each entry on its own
/// cannot store an aggregate's later message while failing its earlier one;
/// after a failure that may pass, the key's later messages fail with it,
/// unsent.
pub(crate) async fn in_order<T, F, Fut>(
    items: Vec<(usize, String, T)>,
    mut send: F,
) -> Vec<(usize, Result<(), SinkError>)>
where
    F: FnMut(Vec<(usize, T)>) -> Fut,
    Fut: std::future::Future<Output = Vec<(usize, Result<(), SinkError>)>>,
{
    let mut rounds: Vec<Vec<(usize, String, T)>> = Vec::new();
    let mut seen: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for (index, key, item) in items {
        let round = if key.is_empty() {
            0
        } else {
            let count = seen.entry(key.clone()).or_insert(0);
            *count += 1;
            *count - 1
        };
        if rounds.len() <= round {
            rounds.resize_with(round + 1, Vec::new);
        }
        rounds[round].push((index, key, item));
    }
    let mut results = Vec::new();
    let mut failed: std::collections::HashMap<String, SinkError> = std::collections::HashMap::new();
    for round in rounds {
        let mut keys = std::collections::HashMap::new();
        let mut sending = Vec::with_capacity(round.len());
        for (index, key, item) in round {
            match failed.get(&key) {
                Some(error) => results.push((index, Err(error.clone()))),
                None => {
                    keys.insert(index, key);
                    sending.push((index, item));
                }
            }
        }
        if sending.is_empty() {
            continue;
        }
        for (index, result) in send(sending).await {
            // A message refused for good holds nothing back: the service keeps
            // no gap for it, and the ones behind it may be another aggregate's
            // (a fixed group, a chosen key).
            if let (Err(error), Some(key)) = (&result, keys.get(&index))
                && !key.is_empty()
                && error.retryable_kind()
            {
                failed.entry(key.clone()).or_insert_with(|| error.clone());
            }
            results.push((index, result));
        }
    }
    results
}

/// `{"headers": {...}, "payload": ...}`: the message's headers (and its
/// key as `Switchyard-Key`), and its payload as JSON when it is JSON, else
/// as base64 text with `"payload_base64": true`.
pub(crate) fn envelope(message: &OutgoingMessage) -> serde_json::Value {
    let mut headers: serde_json::Map<String, serde_json::Value> = message
        .headers
        .iter()
        .map(|(name, value)| (name.clone(), serde_json::Value::String(value.clone())))
        .collect();
    if let Some(key) = &message.key {
        headers.insert(
            crate::sinks::KEY_HEADER.to_string(),
            serde_json::Value::String(key.clone()),
        );
    }
    let mut envelope = serde_json::Map::new();
    envelope.insert("headers".into(), serde_json::Value::Object(headers));
    match serde_json::from_slice::<serde_json::Value>(&message.payload) {
        Ok(json) => {
            envelope.insert("payload".into(), json);
        }
        Err(_) => {
            use base64::Engine as _;
            let text = base64::engine::general_purpose::STANDARD.encode(&message.payload);
            envelope.insert("payload".into(), serde_json::Value::String(text));
            envelope.insert("payload_base64".into(), serde_json::Value::Bool(true));
        }
    }
    serde_json::Value::Object(envelope)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_keys_later_messages_go_in_later_rounds_and_fail_with_its_first_failure() {
        let items = vec![
            (0, "a".to_string(), 0),
            (1, "a".to_string(), 1),
            (2, "b".to_string(), 2),
            (3, String::new(), 3),
            (4, "a".to_string(), 4),
        ];
        let mut rounds = Vec::new();
        let results = in_order(items, |round: Vec<(usize, i32)>| {
            rounds.push(round.iter().map(|(i, _)| *i).collect::<Vec<_>>());
            async move {
                round
                    .into_iter()
                    .map(|(index, _)| {
                        let result = if index == 1 {
                            Err(SinkError::unavailable("down"))
                        } else {
                            Ok(())
                        };
                        (index, result)
                    })
                    .collect()
            }
        })
        .await;
        assert_eq!(rounds, [vec![0, 2, 3], vec![1]]);
        let failed: Vec<usize> = results
            .iter()
            .filter(|(_, r)| r.is_err())
            .map(|(i, _)| *i)
            .collect();
        assert_eq!(failed, [1, 4], "a's third message fails with its second, unsent");
        // A refusal holds nothing back.
        let items = vec![(0, "a".to_string(), 0), (1, "a".to_string(), 1)];
        let results = in_order(items, |round: Vec<(usize, i32)>| async move {
            round
                .into_iter()
                .map(|(index, _)| {
                    (
                        index,
                        if index == 0 {
                            Err(SinkError::permanent("bad"))
                        } else {
                            Ok(())
                        },
                    )
                })
                .collect()
        })
        .await;
        assert!(results.iter().any(|(i, r)| *i == 1 && r.is_ok()), "{results:?}");
    }
}
