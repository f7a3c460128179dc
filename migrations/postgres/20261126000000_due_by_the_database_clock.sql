-- A queued row is due from when it was written, by the database's clock.
-- The claim index took that time from created_at, which is the writer's:
-- an application clock running ahead, or local time written where UTC is
-- read (nine hours ahead at UTC+9), delayed the event, and every later
-- event of its aggregate, by as much. next_attempt_at, the relay's column,
-- now defaults to the time of the insert; only not_before delays an event.
--
-- Rows already queued keep next_attempt_at = '-infinity': due at once, and
-- ahead of every row written from now on, as they were written before.
-- The index holds only queued rows, so building it is short on a drained
-- outbox; writers wait while it runs. It has a name of its own: a relay
-- claims through whichever of the two it finds, so relays deployed before
-- this migration runs, or running while it does, never scan the table.

ALTER TABLE switchyard_outbox ALTER COLUMN next_attempt_at SET DEFAULT now();

DROP INDEX switchyard_outbox_due_idx;
CREATE INDEX switchyard_outbox_due_since_insert_idx
    ON switchyard_outbox (GREATEST(next_attempt_at, not_before), id)
    WHERE queue = 1;
