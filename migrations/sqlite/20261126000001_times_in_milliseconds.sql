-- created_at and not_before hold milliseconds since the Unix epoch, and the
-- usual mistake with integer times is the unit: a not_before in seconds
-- let a delayed event go at once; in microseconds it delayed the event,
-- and every later event of its aggregate, for thousands of years. Values
-- outside 10^11 .. 10^14 ms (the years 1973 to 5138) are refused at the
-- INSERT, naming the likely cause.
CREATE TRIGGER switchyard_outbox_times_in_ms
BEFORE INSERT ON switchyard_outbox
WHEN (typeof(NEW.created_at) = 'integer' AND NEW.created_at NOT BETWEEN 100000000000 AND 99999999999999)
  OR (typeof(NEW.not_before) = 'integer' AND NEW.not_before NOT BETWEEN 100000000000 AND 99999999999999)
BEGIN
    SELECT RAISE(ABORT, 'switchyard_outbox.created_at and not_before must be milliseconds since the Unix epoch (years 1973 to 5138): this looks like seconds or microseconds');
END;
