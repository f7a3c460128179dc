-- Claim path v2: claims that cost O(batch) whatever the statistics or the
-- backlog, and half the index writes per event.
--
-- * `queue` is computed from `status`: 1 pending or in flight, 2 parked
--   behind an earlier unfinished event of its aggregate, 3 held behind a
--   dead letter (`dead_letter_blocks_aggregate`), 4 dead, NULL published.
--   Indexes select rows by `queue`, never by `status`, so a claim (pending
--   to in flight: `queue` stays 1) is a heap-only update that writes no
--   index entry. Being computed, it cannot disagree with `status`, whoever
--   writes the row (a service, an operator's UPDATE by hand).
-- * A parked row is out of the claim index: a claim never walks the rows
--   waiting behind an aggregate whose head is in flight or in backoff. The
--   ack that finishes a head moves the next parked row of its aggregate back.
-- * Rows are claimed in the order they became due (a retry when its backoff
--   ends, a delayed event at `not_before`, others at `created_at`), so rows
--   in backoff are never walked either.
--
-- Adding a computed column rewrites the table once: on a large outbox, run
-- this migration while relays are stopped, after retention has trimmed it.

ALTER TABLE switchyard_outbox DROP CONSTRAINT switchyard_outbox_status_check;
-- NOT VALID: a superset of the old rule, no need to scan the table.
ALTER TABLE switchyard_outbox ADD CONSTRAINT switchyard_outbox_status_check
    CHECK (status IN ('pending', 'parked', 'held', 'in_flight', 'published', 'dead')) NOT VALID;

ALTER TABLE switchyard_outbox ADD COLUMN queue SMALLINT GENERATED ALWAYS AS (
    CASE status
        WHEN 'pending' THEN 1
        WHEN 'in_flight' THEN 1
        WHEN 'parked' THEN 2
        WHEN 'held' THEN 3
        WHEN 'dead' THEN 4
    END) STORED;

-- Half of each page kept free: room for every row's claim version, which a
-- heap-only update must place on the same page (at 70, 4 claims in 10 were
-- heap-only; at 50, 9 in 10). Applies to pages written from now on.
ALTER TABLE switchyard_outbox SET (fillfactor = 50);

-- Claim scan: queued rows by the time they became due.
CREATE INDEX switchyard_outbox_due_idx
    ON switchyard_outbox (GREATEST(next_attempt_at, not_before, created_at), id)
    WHERE queue = 1;

-- Head-of-line probe: "the nearest earlier unfinished row of this aggregate".
-- Dead rows stay in it so that `hold` mode can keep an aggregate waiting.
-- By `published_at`, not `queue IS NOT NULL`: a predicate that `queue = 1`
-- implies would let the planner read it for the claim scan (and sort).
CREATE INDEX switchyard_outbox_unfinished_idx
    ON switchyard_outbox (aggregate_type, aggregate_id, id)
    WHERE published_at IS NULL;

-- The next parked row of an aggregate, when its head finishes; and rows
-- held behind a dead letter, claimable again at once when relays run with
-- dead_letter_blocks_aggregate = false. Two indexes, not one over both
-- values: a query for either finds only the index made for it.
CREATE INDEX switchyard_outbox_parked_idx
    ON switchyard_outbox (aggregate_type, aggregate_id, id)
    WHERE queue = 2;
CREATE INDEX switchyard_outbox_held_idx
    ON switchyard_outbox (aggregate_type, aggregate_id, id)
    WHERE queue = 3;

-- Dead letters.
CREATE INDEX switchyard_outbox_dead_v2_idx
    ON switchyard_outbox (id)
    WHERE queue = 4;
CREATE INDEX switchyard_outbox_dead_type_v2_idx
    ON switchyard_outbox (event_type, id)
    WHERE queue = 4;

-- Every index whose predicate names `status` would make claims write index
-- entries. Retention walks the primary key instead of a published_at index
-- that every ack had to extend.
DROP INDEX switchyard_outbox_claim_idx;
DROP INDEX switchyard_outbox_aggregate_idx;
DROP INDEX switchyard_outbox_dead_idx;
DROP INDEX switchyard_outbox_dead_type_idx;
DROP INDEX switchyard_outbox_published_idx;
