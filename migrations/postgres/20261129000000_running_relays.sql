-- The relays running against this outbox, so that operators' tools find
-- them: each relay writes its row when it starts, with its admin endpoint's
-- address (a port the system chose, with `listen = "...:0"`), refreshes
-- `seen_at` while it runs, and deletes the row when it stops. A relay that
-- died leaves a row whose `seen_at` stops moving; readers skip stale ones.
CREATE TABLE IF NOT EXISTS switchyard_relays (
    instance_id   text PRIMARY KEY,
    admin_address text,
    started_at    timestamptz NOT NULL DEFAULT now(),
    seen_at       timestamptz NOT NULL DEFAULT now()
);
