-- Replication mode: a row that the relay reads from the WAL is never
-- updated on its way out. It is written `streamed` (the column default
-- `switchyard migrate` sets in that mode): `queue` is NULL for it, so no
-- claim, head-of-line probe or dead-letter index sees it, and it reaches
-- the claim path only when the relay hands it over (a failed delivery, a
-- delayed event, an aggregate already waiting in the table), as `pending`.
-- NOT VALID: a superset of the old rule, no need to scan the table.
ALTER TABLE switchyard_outbox DROP CONSTRAINT switchyard_outbox_status_check;
ALTER TABLE switchyard_outbox ADD CONSTRAINT switchyard_outbox_status_check
    CHECK (status IN ('pending', 'parked', 'held', 'in_flight', 'published', 'dead', 'streamed')) NOT VALID;
