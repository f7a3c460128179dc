-- A wake-up says which table a commit wrote: 'outbox' or 'intake'. A
-- claim that also moves intake rows starts twice the plan of one that does
-- not (the DELETE from the intake and the INSERT into the outbox with all
-- their indexes, even when the intake is empty): about a third of a
-- one-row claim's time on the server. A relay that hears only 'outbox'
-- claims without the move; 'intake', or any other payload (an older
-- relay's schema, the ack's wake-up for a row it freed), makes its next
-- claim move.
CREATE OR REPLACE FUNCTION switchyard_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('switchyard.moving', true) IS DISTINCT FROM 'on' THEN
        PERFORM pg_notify('switchyard_outbox',
                          CASE WHEN TG_TABLE_NAME = 'switchyard_intake' THEN 'intake' ELSE 'outbox' END);
    END IF;
    RETURN NULL;
END;
$$;
