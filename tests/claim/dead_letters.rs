//! Dead letters as operators handle them (`dlq`, the console), on each
//! backend's SQL.

use super::*;
use switchyard::store::DeadLetterFilter;

on_every_backend!(dead_letters_are_filtered_counted_replayed_and_purged);

/// What `dlq` and the console do with dead letters, through the store on
/// each backend's SQL: every filter (error text in any case, a target with
/// an unacknowledged delivery, an aggregate, a creation time), bounded
/// counts, paging, a replay that puts rows back to pending with their
/// attempts reset (and claimable), and a purge of what a filter matches.
async fn dead_letters_are_filtered_counted_replayed_and_purged(db: TestOutbox) {
    for aggregate in 0..6 {
        db.insert(aggregate, 0, None).await;
    }
    let claim = db.store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(claim.rows.len(), 6);
    let delivery = |target: &str, acked: bool| Delivery {
        target: target.into(),
        topic: "orders".into(),
        acked_at: acked.then(|| "2026-11-30T10:00:00Z".into()),
        error: (!acked).then(|| "refused".into()),
    };
    let outcomes: Vec<RowOutcome> = claim
        .rows
        .iter()
        .enumerate()
        .map(|(n, row)| {
            let (outcome, deliveries) = match n {
                0..3 => (
                    Outcome::Dead {
                        error: "Broker refused: TOPIC missing".into(),
                    },
                    BTreeMap::from([("kafka/orders/0".to_string(), delivery("kafka", false))]),
                ),
                3..5 => (
                    Outcome::Dead {
                        error: "plugin trap in route".into(),
                    },
                    BTreeMap::from([("nats/orders/0".to_string(), delivery("nats", true))]),
                ),
                _ => (Outcome::Published, BTreeMap::new()),
            };
            RowOutcome {
                id: row.id,
                outcome,
                deliveries,
                plugin_version: None,
            }
        })
        .collect();
    assert_eq!(db.store.ack(claim.lease, &outcomes).await.unwrap().len(), 6);

    let stats = db.store.stats().await.unwrap();
    assert_eq!((stats.dead, stats.backlog), (5, 0), "{stats:?}");
    assert_eq!(
        stats.dead_by_event_type,
        BTreeMap::from([("OrderUpdated".to_string(), 5)])
    );
    let filter = |edit: &dyn Fn(&mut DeadLetterFilter)| {
        let mut filter = DeadLetterFilter::default();
        edit(&mut filter);
        filter
    };
    let count = |filter: DeadLetterFilter| {
        let store = db.store.clone();
        async move { store.count_dead_letters(&filter).await.unwrap() }
    };
    assert_eq!(
        count(filter(&|f| f.error_contains = Some("topic MISSING".into()))).await,
        3
    );
    assert_eq!(count(filter(&|f| f.target = Some("kafka".into()))).await, 3);
    assert_eq!(
        count(filter(&|f| f.target = Some("nats".into()))).await,
        0,
        "acknowledged there"
    );
    assert_eq!(
        count(filter(&|f| {
            f.aggregate_type = Some("order".into());
            f.aggregate_id = Some("o-4".into());
        }))
        .await,
        1
    );
    let hour_ago = chrono::Utc::now().timestamp_millis() - 3_600_000;
    assert_eq!(count(filter(&|f| f.created_since_ms = Some(hour_ago))).await, 5);
    assert_eq!(count(filter(&|f| f.created_before_ms = Some(hour_ago))).await, 0);
    assert_eq!(
        db.store
            .count_dead_letters_to(&DeadLetterFilter::default(), 2)
            .await
            .unwrap(),
        2,
        "counted no further than the bound"
    );
    let first_page = db
        .store
        .dead_letters(&DeadLetterFilter::default(), 0, 2)
        .await
        .unwrap();
    let next_page = db
        .store
        .dead_letters(&DeadLetterFilter::default(), first_page[1].id, 10)
        .await
        .unwrap();
    assert_eq!((first_page.len(), next_page.len()), (2, 3));
    assert!(first_page[1].id < next_page[0].id);
    assert_eq!(
        first_page[0].last_error.as_deref(),
        Some("Broker refused: TOPIC missing")
    );
    let entry = db.store.entry(first_page[0].id, false).await.unwrap().unwrap();
    assert!(entry.payload.is_none(), "not read without the payload");
    let event_id = uuid::Uuid::parse_str(&entry.event_id).unwrap();
    assert_eq!(db.store.event(event_id).await.unwrap().unwrap().id, entry.id);

    let replayed = db
        .store
        .replay_dead_letters(&filter(&|f| f.error_contains = Some("trap".into())), 0, 10)
        .await
        .unwrap();
    assert_eq!(replayed.len(), 2);
    let counts = db.store.status_counts(&replayed).await.unwrap();
    assert_eq!(counts, BTreeMap::from([("pending".to_string(), 2)]));
    let again = db.store.claim("b", 10, LEASE).await.unwrap();
    let mut ids: Vec<i64> = again.rows.iter().map(|row| row.id.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, replayed, "replayed rows are claimed again");
    assert!(
        again.rows.iter().all(|row| row.attempts == 1),
        "attempts start over"
    );

    let purged = db
        .store
        .purge_dead_letters(&filter(&|f| f.target = Some("kafka".into())), 10)
        .await
        .unwrap();
    assert_eq!(purged, 3);
    assert_eq!(db.count("dead").await, 0);
}
