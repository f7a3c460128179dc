-- Rows waiting for a target that is down (a JSON array of target names):
-- the row keeps its attempt and is set due at once when the target is
-- back. See the PostgreSQL migration of the same name.
ALTER TABLE switchyard_outbox ADD COLUMN waiting_on TEXT;

CREATE INDEX switchyard_outbox_waiting_on_idx
    ON switchyard_outbox (id)
    WHERE waiting_on IS NOT NULL;
