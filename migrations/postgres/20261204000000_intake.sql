-- A cheaper place for writers to insert: `switchyard_intake`.
--
-- A row in `switchyard_outbox` carries the claim's state and enters four
-- indexes and three CHECKs at insert, inside every writer's transaction:
-- about 1.7x the time of an insert into a table with a primary key only.
-- The intake has the event columns, its primary key and the two key-length
-- CHECKs the outbox has (a writer learns of an over-long key at its own
-- insert, as before). The claim moves committed intake rows into the
-- outbox, oldest first, in the same statement that claims, leasing the ones
-- that head their aggregate at once.
--
-- Writers may insert into either table. The outbox numbers the rows it
-- takes from the intake as they arrive, so an aggregate written through
-- both tables is ordered by when its rows reached the outbox: keep each
-- aggregate type on one of them.
CREATE TABLE switchyard_intake (
    id             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id       UUID        NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type TEXT        NOT NULL
                   CONSTRAINT switchyard_intake_aggregate_type_at_most_255_bytes
                   CHECK (octet_length(aggregate_type) <= 255),
    aggregate_id   TEXT        NOT NULL
                   CONSTRAINT switchyard_intake_aggregate_id_at_most_1024_bytes
                   CHECK (octet_length(aggregate_id) <= 1024),
    event_type     TEXT        NOT NULL,
    payload        JSONB,
    payload_bytes  BYTEA,
    headers        JSONB       NOT NULL DEFAULT '{}'::jsonb,
    tenant         TEXT,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    not_before     TIMESTAMPTZ
);

-- The claim that moves rows inserts into the outbox and must not wake every
-- relay with it: it marks its transaction (`switchyard.moving`), and the
-- outbox's notification passes over such inserts. A writer's insert into
-- either table wakes the relays as before.
CREATE OR REPLACE FUNCTION switchyard_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('switchyard.moving', true) IS DISTINCT FROM 'on' THEN
        PERFORM pg_notify('switchyard_outbox', '');
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER switchyard_intake_notify
    AFTER INSERT ON switchyard_intake
    FOR EACH STATEMENT EXECUTE FUNCTION switchyard_outbox_notify();
