//! The example idempotent consumer applies a redelivered event once, on
//! NATS, Kafka and RabbitMQ.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use consumer::Inbox;
use consumer::nats::consume;
use switchyard_tests::init_logging;
use switchyard_tests::nats::NatsServer;

async fn publish(js: &jetstream::Context, event_id: &str, event_type: &str) {
    let mut headers = HeaderMap::new();
    headers.insert("Switchyard-Event-Id", event_id);
    headers.insert("Switchyard-Event-Type", event_type);
    headers.insert("Switchyard-Aggregate-Id", "order-1");
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
    publish(&js, "11111111-1111-4111-8111-111111111111", "OrderCreated").await;
    publish(&js, "11111111-1111-4111-8111-111111111111", "OrderCreated").await;
    publish(&js, "22222222-2222-4222-8222-222222222222", "OrderPaid").await;

    let path = std::env::temp_dir().join(format!("sy-inbox-{}.db", uuid::Uuid::new_v4().simple()));
    let inbox = Inbox::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let mut verdicts = Vec::new();
    let tally = consume(
        &js,
        "ORDERS",
        "view",
        &inbox,
        Duration::from_millis(500),
        |_, applied| verdicts.push(applied),
    )
    .await
    .unwrap();
    assert_eq!(verdicts, vec![true, false, true]);
    assert_eq!((tally.applied, tally.skipped), (2, 1));
    assert_eq!(
        inbox.events_applied("order-1").await.unwrap(),
        2,
        "the duplicate changed nothing"
    );

    // A second run resumes after the acked messages: nothing is applied again.
    let again = consume(
        &js,
        "ORDERS",
        "view",
        &inbox,
        Duration::from_millis(300),
        |_, _| {},
    )
    .await
    .unwrap();
    assert_eq!((again.applied, again.skipped), (0, 0));
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
    for (id, event_type) in [
        ("11111111-1111-4111-8111-111111111111", "OrderCreated"),
        ("11111111-1111-4111-8111-111111111111", "OrderCreated"),
        ("22222222-2222-4222-8222-222222222222", "OrderPaid"),
    ] {
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
                value: Some("order-1"),
            });
        let record = FutureRecord::to("orders")
            .key("order-1")
            .payload("{}")
            .headers(headers);
        producer.send(record, Duration::from_secs(10)).await.unwrap();
    }

    let path = std::env::temp_dir().join(format!("sy-inbox-{}.db", uuid::Uuid::new_v4().simple()));
    let inbox = Inbox::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let bootstrap = kafka.bootstrap();
    let consume = |idle| consumer::kafka::consume(&bootstrap, "orders", "view", &inbox, idle, |_, _| {});
    let tally = consume(Duration::from_secs(3)).await.unwrap();
    assert_eq!((tally.applied, tally.skipped), (2, 1));
    assert_eq!(
        inbox.events_applied("order-1").await.unwrap(),
        2,
        "the duplicate changed nothing"
    );
    // The group's committed offsets: a second run finds nothing new.
    let again = consume(Duration::from_secs(3)).await.unwrap();
    assert_eq!((again.applied, again.skipped), (0, 0));
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
    let (connection, channel) = rabbit.channel().await;
    for (id, event_type) in [
        ("11111111-1111-4111-8111-111111111111", "OrderCreated"),
        ("11111111-1111-4111-8111-111111111111", "OrderCreated"),
        ("22222222-2222-4222-8222-222222222222", "OrderPaid"),
    ] {
        // As the relay sends them: the event id as message id, and headers.
        let mut headers = FieldTable::default();
        for (name, value) in [
            ("Switchyard-Event-Type", event_type),
            ("Switchyard-Aggregate-Id", "order-1"),
        ] {
            headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
        }
        let properties = BasicProperties::default()
            .with_message_id(id.into())
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

    let path = std::env::temp_dir().join(format!("sy-inbox-{}.db", uuid::Uuid::new_v4().simple()));
    let inbox = Inbox::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let consume = |idle| consumer::rabbitmq::consume(rabbit.url(), &name, &inbox, idle, |_, _| {});
    let tally = consume(Duration::from_secs(2)).await.unwrap();
    assert_eq!((tally.applied, tally.skipped), (2, 1));
    assert_eq!(
        inbox.events_applied("order-1").await.unwrap(),
        2,
        "the duplicate changed nothing"
    );
    // Acked messages left the queue: a second run finds nothing.
    let again = consume(Duration::from_secs(1)).await.unwrap();
    assert_eq!((again.applied, again.skipped), (0, 0));
    let _ = std::fs::remove_file(path);
}
