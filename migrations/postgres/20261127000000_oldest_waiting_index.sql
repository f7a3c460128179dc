-- The oldest-pending age (`/metrics`, `switchyard status`) is the age of
-- the lowest id still waiting. The v2 migration dropped the status index
-- that found it, and the query read the whole table instead, published
-- rows kept for retention included, at every scrape: 83 ms per million
-- rows on two cores, past the scrape's 3 s bound (and the gauge frozen at
-- its last value) well before a week of retention at 1,000 events/s.
--
-- Queues 1 to 3: pending or in flight, parked (the oldest waiting row when
-- its aggregate's head is delayed), held. Not dead letters, which stay
-- until an operator acts. The `published_at IS NULL` is for the planner:
-- no claim statement says it together with a queue, so none can choose
-- this index over its own. An INSERT writes one index entry more (about
-- 6 us); claims stay heap-only, and acks write nothing here. The build
-- reads the table once; writers wait while it runs.
CREATE INDEX switchyard_outbox_waiting_idx
    ON switchyard_outbox (id)
    WHERE published_at IS NULL AND queue IN (1, 2, 3);
