-- Rows waiting for a target that is down. A delivery that fails because
-- its target cannot be reached is not the event's fault: the row keeps its
-- attempt, records the targets it waits for here, and stays pending with a
-- late next_attempt_at. The relay that sees a target come back sets those
-- rows due at once, so a long outage drains at full speed when it ends
-- instead of at the pace of each row's backoff.
--
-- A nullable column without a default: no table rewrite. The index holds
-- only waiting rows (none outside an outage), so writers and claims never
-- touch it.
ALTER TABLE switchyard_outbox ADD COLUMN waiting_on text[];

CREATE INDEX switchyard_outbox_waiting_on_idx
    ON switchyard_outbox (id)
    WHERE waiting_on IS NOT NULL;
