-- Rows parked on a paused target (`waiting_on` set, their next attempt
-- days out) kept apart from the rows a claim can take. The claim walked
-- the claim index over every pending row in id order, and each parked row
-- sat before the due ones: a broker outage of ten minutes at 700 events a
-- second over many aggregates parks some 400,000 rows, and every poll read
-- them all (0.5 to 0.7 s a claim). The claim now walks this index with
-- `parked = 0`; the relay that sees a target back, and the sweep for rows
-- whose backoff ran out, find the parked ones through `parked = 1`. The
-- events behind a parked head are set waiting with it (by its ack, and by
-- the relay's sweep for those written later), so claims read past none of
-- them either.
--
-- A virtual column: nothing stored in the table, so adding it rewrites
-- nothing; the index is built online from the table.
ALTER TABLE switchyard_outbox
    ADD COLUMN parked BOOLEAN AS (waiting_on IS NOT NULL) VIRTUAL,
    ADD INDEX switchyard_outbox_due_idx (status, parked, id);
