//! The example idempotent consumer applies a redelivered event once, on
//! NATS, Kafka and RabbitMQ.
//!
//! Each run reads until a marker event published last, not until a quiet
//! spell: a broker slow to deliver the first message (a Kafka group still
//! joining, a busy machine) cannot end a run early. A second run, with a
//! new marker, sees nothing before it: what the first acked is not read
//! again.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use consumer::nats::consume;
use consumer::{Delivered, Inbox, Tally};
use switchyard_tests::init_logging;
use switchyard_tests::nats::NatsServer;

/// The events every test publishes, in this order: one twice, as a
/// redelivery, then another.
const EVENTS: [(&str, &str); 3] = [
    ("11111111-1111-4111-8111-111111111111", "OrderCreated"),
    ("11111111-1111-4111-8111-111111111111", "OrderCreated"),
    ("22222222-2222-4222-8222-222222222222", "OrderPaid"),
];

/// The markers closing the first and the second run, on an order of their own.
const FIRST_END: &str = "eeeeeeee-0000-4000-8000-000000000001";
const SECOND_END: &str = "eeeeeeee-0000-4000-8000-000000000002";
const END_TYPE: &str = "RunEnded";
const END_ORDER: &str = "order-end";

/// What a consumer calls after each message it acknowledged.
type Callback = Box<dyn FnMut(&Delivered, bool) + Send>;

/// Bounds only a run whose marker never comes: the consumer stops after
/// this long without a message.
const QUIET_FOR: Duration = Duration::from_secs(60);

/// What the first run must handle: the events, the redelivery skipped,
/// then its marker.
fn first_run() -> Vec<(String, bool)> {
    vec![
        (EVENTS[0].0.to_string(), true),
        (EVENTS[1].0.to_string(), false),
        (EVENTS[2].0.to_string(), true),
        (FIRST_END.to_string(), true),
    ]
}

/// The event id the consumer applies a message under.
fn event_id(delivered: &Delivered) -> String {
    match delivered.header("Switchyard-Event-Id") {
        "" => delivered.header("Message-Id").to_string(),
        id => id.to_string(),
    }
}

/// Runs a consumer, given the callback it calls after each message it
/// acknowledged, until it handled the event `last`: each event it handled
/// by then, in order, with whether it was applied.
async fn handled_until<F, Fut>(last: &str, run: F) -> Vec<(String, bool)>
where
    F: FnOnce(Callback) -> Fut,
    Fut: Future<Output = anyhow::Result<Tally>>,
{
    let handled = Arc::new(Mutex::new(Vec::new()));
    let done = Arc::new(tokio::sync::Notify::new());
    let callback: Callback = {
        let (handled, done, last) = (Arc::clone(&handled), Arc::clone(&done), last.to_string());
        Box::new(move |delivered: &Delivered, applied: bool| {
            let id = event_id(delivered);
            let at_end = id == last;
            handled.lock().unwrap().push((id, applied));
            if at_end {
                done.notify_one();
            }
        })
    };
    tokio::select! {
        ended = run(callback) => panic!(
            "the consumer stopped before {last}: {ended:?}; handled {:?}",
            handled.lock().unwrap()
        ),
        () = done.notified() => {}
    }
    handled.lock().unwrap().clone()
}

async fn publish(js: &jetstream::Context, event_id: &str, event_type: &str, order: &str) {
    let mut headers = HeaderMap::new();
    headers.insert("Switchyard-Event-Id", event_id);
    headers.insert("Switchyard-Event-Type", event_type);
    headers.insert("Switchyard-Aggregate-Id", order);
    // No Nats-Msg-Id: a redelivery outside JetStream's dedup window looks like this.
    js.publish_with_headers("orders.x", headers, "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_event_is_applied_once() {
    init_logging();
    let nats = NatsServer::start().await;
    nats.create_stream("ORDERS", &["orders.>"]).await;
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    for (id, event_type) in EVENTS {
        publish(&js, id, event_type, "order-1").await;
    }
    publish(&js, FIRST_END, END_TYPE, END_ORDER).await;

    let path = std::env::temp_dir().join(format!("sy-inbox-{}.db", uuid::Uuid::new_v4().simple()));
    let inbox = Inbox::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let run = |print: Callback| consume(&js, "ORDERS", "view", &inbox, QUIET_FOR, print);
    assert_eq!(handled_until(FIRST_END, run).await, first_run());
    assert_eq!(
        inbox.events_applied("order-1").await.unwrap(),
        2,
        "the duplicate changed nothing"
    );

    // A second run resumes after the acked messages: nothing is applied again.
    publish(&js, SECOND_END, END_TYPE, END_ORDER).await;
    assert_eq!(
        handled_until(SECOND_END, run).await,
        vec![(SECOND_END.to_string(), true)]
    );
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_kafka_event_is_applied_once() {
    use rdkafka::ClientConfig;
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    use switchyard_tests::kafka::KafkaServer;

    init_logging();
    let kafka = KafkaServer::start().await;
    kafka.create_topic("orders", 1).await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap())
        .create()
        .unwrap();
    let send = async |id: &str, event_type: &str, order: &str| {
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "Switchyard-Event-Id",
                value: Some(id),
            })
            .insert(Header {
                key: "Switchyard-Event-Type",
                value: Some(event_type),
            })
            .insert(Header {
                key: "Switchyard-Aggregate-Id",
                value: Some(order),
            });
        let record = FutureRecord::to("orders")
            .key(order)
            .payload("{}")
            .headers(headers);
        producer.send(record, Duration::from_secs(10)).await.unwrap();
    };
    for (id, event_type) in EVENTS {
        send(id, event_type, "order-1").await;
    }
    send(FIRST_END, END_TYPE, END_ORDER).await;

    let path = std::env::temp_dir().join(format!("sy-inbox-{}.db", uuid::Uuid::new_v4().simple()));
    let inbox = Inbox::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let bootstrap = kafka.bootstrap();
    let run =
        |print: Callback| consumer::kafka::consume(&bootstrap, "orders", "view", &inbox, QUIET_FOR, print);
    assert_eq!(handled_until(FIRST_END, run).await, first_run());
    assert_eq!(
        inbox.events_applied("order-1").await.unwrap(),
        2,
        "the duplicate changed nothing"
    );
    // The group's committed offsets: a second run reads only what is new.
    send(SECOND_END, END_TYPE, END_ORDER).await;
    assert_eq!(
        handled_until(SECOND_END, run).await,
        vec![(SECOND_END.to_string(), true)]
    );
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_rabbitmq_event_is_applied_once() {
    use lapin::BasicProperties;
    use lapin::options::BasicPublishOptions;
    use lapin::types::{AMQPValue, FieldTable, LongString};
    use switchyard_tests::rabbitmq::RabbitMq;

    init_logging();
    let rabbit = RabbitMq::shared();
    let name = format!("consumer-{}", uuid::Uuid::new_v4().simple());
    rabbit.declare(&name, &name, "#").await;
    let send = async |events: &[(&str, &str, &str)]| {
        let (connection, channel) = rabbit.channel().await;
        for (id, event_type, order) in events {
            // As the relay sends them: the event id as message id, and headers.
            let mut headers = FieldTable::default();
            for (name, value) in [
                ("Switchyard-Event-Type", event_type),
                ("Switchyard-Aggregate-Id", order),
            ] {
                headers.insert(name.into(), AMQPValue::LongString(LongString::from(*value)));
            }
            let properties = BasicProperties::default()
                .with_message_id((*id).into())
                .with_headers(headers);
            channel
                .basic_publish(
                    name.as_str().into(),
                    "orders.x".into(),
                    BasicPublishOptions::default(),
                    b"{}",
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
        drop(connection);
    };
    let mut first: Vec<(&str, &str, &str)> =
        EVENTS.iter().map(|(id, kind)| (*id, *kind, "order-1")).collect();
    first.push((FIRST_END, END_TYPE, END_ORDER));
    send(&first).await;

    let path = std::env::temp_dir().join(format!("sy-inbox-{}.db", uuid::Uuid::new_v4().simple()));
    let inbox = Inbox::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let run = |print: Callback| consumer::rabbitmq::consume(rabbit.url(), &name, &inbox, QUIET_FOR, print);
    assert_eq!(handled_until(FIRST_END, run).await, first_run());
    assert_eq!(
        inbox.events_applied("order-1").await.unwrap(),
        2,
        "the duplicate changed nothing"
    );
    // Acked messages left the queue: a second run reads only what is new.
    send(&[(SECOND_END, END_TYPE, END_ORDER)]).await;
    assert_eq!(
        handled_until(SECOND_END, run).await,
        vec![(SECOND_END.to_string(), true)]
    );
    let _ = std::fs::remove_file(path);
}
