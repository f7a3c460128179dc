-- Row ids order each aggregate's events. PostgreSQL's identity column
-- refuses an id from the writer; SQLite took one, and an id below the last
-- one put the event ahead of earlier events of its aggregate (a very high
-- one would exhaust the counter). In a BEFORE INSERT trigger an id left to
-- SQLite reads -1; an explicit -1 is caught once stored.
CREATE TRIGGER switchyard_outbox_id_is_assigned
BEFORE INSERT ON switchyard_outbox
WHEN NEW.id <> -1
BEGIN
    SELECT RAISE(ABORT, 'switchyard_outbox.id is assigned by the outbox: leave it out of the INSERT');
END;

CREATE TRIGGER switchyard_outbox_id_is_assigned_not_negative
AFTER INSERT ON switchyard_outbox
WHEN NEW.id < 1
BEGIN
    SELECT RAISE(ABORT, 'switchyard_outbox.id is assigned by the outbox: leave it out of the INSERT');
END;

CREATE TRIGGER switchyard_outbox_id_is_fixed
BEFORE UPDATE OF id ON switchyard_outbox
WHEN NEW.id IS NOT OLD.id
BEGIN
    SELECT RAISE(ABORT, 'switchyard_outbox.id is assigned by the outbox and cannot change');
END;
