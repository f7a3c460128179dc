//! The capture trigger's SQL, generated from a checked mapping, and
//! whether the installed one is it.

use sha2::{Digest, Sha256};
use sqlx::{PgConnection, PgPool};

use super::{Capture, Installed, PayloadKind, ident, literal};

const TRIGGER: &str = "switchyard_capture";
const TRANSITION: &str = "switchyard_captured";

impl Capture {
    /// `schema.table`, quoted.
    pub fn table(&self) -> &str {
        &self.display
    }

    fn function(&self) -> String {
        let digest = Sha256::digest(self.display.as_bytes());
        let suffix: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
        format!("{}.switchyard_capture_{suffix}", ident(&self.outbox_schema))
    }

    fn try_jsonb(&self) -> String {
        format!("{}.switchyard_try_jsonb", ident(&self.outbox_schema))
    }

    /// `INSERT INTO switchyard_outbox ... SELECT ... FROM <from> AS s`: the
    /// copy of each row, as the trigger and the backfill make it.
    fn copy_sql(&self, from: &str, order_by: Option<&str>) -> String {
        let cols = &self.source.columns;
        let col = |name: &str| format!("s.{}", ident(name));
        let limit = |field: &str, name: &str, bytes: usize| {
            format!(
                "WHEN {c} IS NULL THEN {null}\n                        \
                 WHEN octet_length({c}::text) > {bytes} THEN format({long}, octet_length({c}::text))",
                c = col(name),
                null = literal(&format!("{field} (column {}) is NULL", ident(name))),
                // `format` reads `%` in the name as a placeholder.
                long = literal(&format!(
                    "{field} (column {}) is %s bytes; at most {bytes}",
                    ident(name).replace('%', "%%")
                )),
            )
        };
        let problem = format!(
            "CASE {}\n                        {}\n                        WHEN {et} IS NULL THEN {et_null} END",
            limit("aggregate_type", &cols.aggregate_type, 255),
            limit("aggregate_id", &cols.aggregate_id, 1024),
            et = col(&cols.event_type),
            et_null = literal(&format!(
                "event_type (column {}) is NULL",
                ident(&cols.event_type)
            )),
        );
        let (payload, payload_bytes) = match self.payload {
            PayloadKind::Jsonb => (col(&cols.payload), "NULL::bytea".to_string()),
            PayloadKind::Bytea => ("NULL::jsonb".to_string(), col(&cols.payload)),
            // Bytes only when it does not parse (see the outer SELECT).
            PayloadKind::JsonText => (
                format!("{}({}::text)", self.try_jsonb(), col(&cols.payload)),
                format!("convert_to({}::text, 'UTF8')", col(&cols.payload)),
            ),
        };
        let mut headers = match &cols.headers {
            Some(name) => format!("coalesce({}, '{{}}'::jsonb)", col(name)),
            None => "'{}'::jsonb".to_string(),
        };
        if !self.source.header_columns.is_empty() {
            let pairs: Vec<String> = self
                .source
                .header_columns
                .iter()
                .map(|(header, name)| format!("{}, {}::text", literal(header), col(name)))
                .collect();
            headers = format!(
                "{headers} || jsonb_strip_nulls(jsonb_build_object({}))",
                pairs.join(", ")
            );
        }
        let event_id = match &cols.event_id {
            Some(name) => format!("coalesce({}, gen_random_uuid())", col(name)),
            None => "gen_random_uuid()".to_string(),
        };
        let tenant = cols
            .tenant
            .as_deref()
            .map_or("NULL::text".to_string(), |name| format!("{}::text", col(name)));
        let order = order_by.map_or(String::new(), |name| format!("\n     ORDER BY {}", col(name)));
        // A row that cannot be relayed keeps its place as a dead letter
        // (keys cut to fit the outbox's bounds) rather than fail the writer.
        // OFFSET 0 keeps the subquery whole: the parse attempt, a
        // subtransaction, runs once per row, not once per reference. An
        // event id already copied is the same event (a writer that deleted
        // its row and wrote it again, or a second backfill): not copied
        // twice, and the writer's INSERT does not fail on it.
        format!(
            "INSERT INTO {outbox}.switchyard_outbox
        (event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes,
         headers, tenant, status, last_error)
    SELECT c.event_id,
           CASE WHEN c.problem IS NULL THEN c.aggregate_type ELSE left(coalesce(c.aggregate_type, ''), 60) END,
           CASE WHEN c.problem IS NULL THEN c.aggregate_id ELSE left(coalesce(c.aggregate_id, ''), 250) END,
           coalesce(c.event_type, ''), c.payload,
           CASE WHEN c.payload IS NULL THEN c.payload_bytes END, c.headers, c.tenant,
           CASE WHEN c.problem IS NULL THEN 'pending' ELSE 'dead' END,
           {where_from} || c.problem
      FROM (SELECT {event_id} AS event_id,
                   {aggregate_type}::text AS aggregate_type,
                   {aggregate_id}::text AS aggregate_id,
                   {event_type}::text AS event_type,
                   {payload} AS payload,
                   {payload_bytes} AS payload_bytes,
                   {headers} AS headers,
                   {tenant} AS tenant,
                   {problem} AS problem
              FROM {from} AS s{order}
            OFFSET 0) AS c
    ON CONFLICT (event_id) DO NOTHING",
            outbox = ident(&self.outbox_schema),
            where_from = literal(&format!("cannot be relayed from {}: ", self.display)),
            aggregate_type = col(&cols.aggregate_type),
            aggregate_id = col(&cols.aggregate_id),
            event_type = col(&cols.event_type),
        )
    }

    /// The trigger and its functions, without the version comment.
    pub(super) fn definition(&self) -> String {
        let outbox = ident(&self.outbox_schema);
        // A subtransaction per row, only for payloads that may not parse.
        let try_jsonb = if self.payload == PayloadKind::JsonText {
            format!(
                "-- JSON text that jsonb refuses (malformed, or \\u0000) is carried as bytes.
CREATE OR REPLACE FUNCTION {}(value text) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $switchyard$
BEGIN
    RETURN value::jsonb;
EXCEPTION WHEN others THEN
    RETURN NULL;
END;
$switchyard$;

",
                self.try_jsonb()
            )
        } else {
            String::new()
        };
        format!(
            "-- Capture: every row inserted into {table} is copied into
-- {outbox}.switchyard_outbox in the same transaction, once per statement.
-- SECURITY DEFINER: writers need no privilege on the relay's table.
{try_jsonb}CREATE OR REPLACE FUNCTION {function}() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $switchyard$
BEGIN
    {copy};
    RETURN NULL;
END;
$switchyard$;

DROP TRIGGER IF EXISTS {TRIGGER} ON {table};
CREATE TRIGGER {TRIGGER} AFTER INSERT ON {table}
    REFERENCING NEW TABLE AS {TRANSITION}
    FOR EACH STATEMENT EXECUTE FUNCTION {function}();
",
            table = self.display,
            function = self.function(),
            copy = self.copy_sql(TRANSITION, None),
        )
    }

    /// Identifies the installed trigger's mapping: a hash of its SQL.
    pub(super) fn version(&self) -> String {
        let digest = Sha256::digest(self.definition().as_bytes());
        digest[..8].iter().map(|b| format!("{b:02x}")).collect()
    }

    fn comment(&self) -> String {
        format!("switchyard capture {}", self.version())
    }

    /// The statements `migrate` runs, in one transaction: lock out writers
    /// for the instant of the swap, so no row is copied twice or missed
    /// between the trigger and a backfill; then the trigger; then, with
    /// `backfill`, a copy of the rows already there.
    pub fn install_sql(&self, backfill: bool) -> Vec<String> {
        let mut statements = vec![
            format!(
                "-- Writers wait for this transaction (a moment), so the backfill and the\n\
                 -- trigger see every row exactly once.\n\
                 LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE",
                self.display
            ),
            self.definition(),
            format!(
                "COMMENT ON TRIGGER {TRIGGER} ON {} IS {}",
                self.display,
                literal(&self.comment())
            ),
        ];
        if backfill {
            statements.push(format!(
                "-- Backfill: the rows already in {}.\n{}",
                self.display,
                self.copy_sql(&self.display, self.source.order_by.as_deref())
            ));
        }
        statements
    }

    /// Whether the trigger this mapping makes is the one installed.
    ///
    /// # Errors
    /// The database's.
    pub(crate) async fn installed(&self, session: &mut PgConnection) -> Result<Installed, sqlx::Error> {
        let trigger: Option<(Option<String>, bool)> = sqlx::query_as(
            "SELECT obj_description(t.oid, 'pg_trigger'), t.tgenabled <> 'D' FROM pg_trigger t
              WHERE t.tgrelid = to_regclass($1) AND t.tgname = $2",
        )
        .bind(&self.display)
        .bind(TRIGGER)
        .fetch_optional(session)
        .await?;
        Ok(match trigger {
            None => Installed::Missing,
            Some((_, false)) => Installed::Disabled,
            Some((Some(comment), true)) if comment == self.comment() => Installed::Current,
            Some(_) => Installed::Outdated,
        })
    }

    /// What is wrong with the `installed` trigger, said for an operator
    /// (`None`: nothing). Rows written meanwhile stay in the services' table
    /// and are not relayed.
    pub(crate) fn problem(&self, installed: Installed) -> Option<String> {
        let fix = "review `switchyard migrate --dry-run --config FILE`, then run `switchyard migrate --config FILE`";
        let table = &self.display;
        match installed {
            Installed::Current => None,
            Installed::Missing => Some(format!(
                "{table} has no capture trigger, so no row written there is relayed: {fix}"
            )),
            Installed::Outdated => Some(format!(
                "the capture trigger on {table} was made from another [source] mapping: {fix}"
            )),
            Installed::Disabled => Some(format!(
                "the capture trigger on {table} is disabled, so no row written there is relayed: \
                 ALTER TABLE {table} ENABLE TRIGGER {TRIGGER}, then copy what was written \
                 meanwhile (rows inserted while it was off are not in switchyard_outbox)"
            )),
        }
    }

    /// Installs (or replaces) the trigger, with an optional backfill, in one
    /// transaction. Returns the rows backfilled.
    ///
    /// # Errors
    /// The database's (e.g. the role does not own the table).
    pub(crate) async fn install(&self, pool: &PgPool, backfill: bool) -> Result<u64, sqlx::Error> {
        let mut tx = pool.begin().await?;
        // Not "trigger ... does not exist, skipping" on every first install.
        sqlx::query("SET LOCAL client_min_messages = warning")
            .execute(&mut *tx)
            .await?;
        let mut copied = 0;
        for (index, statement) in self.install_sql(backfill).iter().enumerate() {
            // The definition is several statements: the simple protocol.
            let done = sqlx::raw_sql(statement).execute(&mut *tx).await?;
            if backfill && index == 3 {
                copied = done.rows_affected();
            }
        }
        tx.commit().await?;
        Ok(copied)
    }
}
