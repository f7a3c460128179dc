-- The event id is every broker's dedup id: an id that is not a UUID would
-- be refused by the relay (dead-lettered), so refuse it at the writer's
-- INSERT instead, where the service can still fix it. PostgreSQL's uuid
-- column does this by its type.
CREATE TRIGGER switchyard_outbox_event_id_is_uuid
BEFORE INSERT ON switchyard_outbox
WHEN NEW.event_id NOT GLOB '[0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]-[0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]-[0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]-[0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]-[0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F][0-9a-fA-F]'
BEGIN
    SELECT RAISE(ABORT, 'switchyard_outbox.event_id must be a UUID (8-4-4-4-12 hex digits)');
END;
