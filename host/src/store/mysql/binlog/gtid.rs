//! MariaDB's GTID position (one `domain-server-sequence` per replication
//! domain) and the transaction boundaries of its binary log, as pure values:
//! where a reader is, and when a transaction it reads is complete.

use std::collections::BTreeMap;
use std::fmt;

/// A GTID position as MariaDB writes it (`@@gtid_binlog_pos`,
/// `@slave_connect_state`): the last transaction of each domain.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct GtidPos {
    domains: BTreeMap<u32, (u32, u64)>,
}

impl GtidPos {
    /// Reads `0-1-100,1-2-7` (empty: before the first transaction).
    ///
    /// # Errors
    /// The part that is not `domain-server-sequence`.
    pub(crate) fn parse(text: &str) -> Result<GtidPos, String> {
        let mut domains = BTreeMap::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let mut fields = part.split('-');
            let (Some(d), Some(s), Some(n), None) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                return Err(format!("{part:?} is not a MariaDB GTID (domain-server-sequence)"));
            };
            let parsed = (d.parse::<u32>(), s.parse::<u32>(), n.parse::<u64>());
            let (Ok(d), Ok(s), Ok(n)) = parsed else {
                return Err(format!("{part:?} is not a MariaDB GTID (domain-server-sequence)"));
            };
            domains.insert(d, (s, n));
        }
        Ok(GtidPos { domains })
    }

    /// Past `gtid`: its domain's last transaction.
    pub(crate) fn advance(&mut self, gtid: &Gtid) {
        self.domains.insert(gtid.domain, (gtid.server, gtid.sequence));
    }
}

impl fmt::Display for GtidPos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (domain, (server, sequence)) in &self.domains {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            write!(f, "{domain}-{server}-{sequence}")?;
        }
        Ok(())
    }
}

/// A transaction's GTID, from MariaDB's GTID event (type 162).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Gtid {
    pub(crate) domain: u32,
    pub(crate) server: u32,
    pub(crate) sequence: u64,
    /// A statement with no commit of its own (DDL): it ends with its one
    /// query event.
    pub(crate) standalone: bool,
}

/// MariaDB's GTID event type.
pub(crate) const MARIADB_GTID_EVENT: u8 = 162;

/// The GTID event's flag for a transaction of one statement, no XID.
const FL_STANDALONE: u8 = 1;

/// Reads a MariaDB GTID event's body (sequence, domain, flags; the server
/// is the event header's).
pub(crate) fn gtid_event(body: &[u8], server: u32) -> Option<Gtid> {
    let sequence = u64::from_le_bytes(body.get(0..8)?.try_into().ok()?);
    let domain = u32::from_le_bytes(body.get(8..12)?.try_into().ok()?);
    let flags = *body.get(12)?;
    Some(Gtid {
        domain,
        server,
        sequence,
        standalone: flags & FL_STANDALONE != 0,
    })
}

/// What ends the transaction a reader is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Boundary {
    /// A GTID event: a transaction begins.
    Begins(Gtid),
    /// An XID event: an InnoDB transaction commits.
    Xid,
    /// A query event, with whether its text is `COMMIT`.
    Query { commit: bool },
}

/// Follows transactions through the binary log.
#[derive(Debug, Default)]
pub(crate) struct Transactions {
    open: Option<Gtid>,
}

impl Transactions {
    /// The transaction an event belongs to, if one is open.
    pub(crate) fn open(&self) -> Option<Gtid> {
        self.open
    }

    /// Takes an event that may begin or end a transaction; returns the
    /// GTID of one that is complete with it (its rows may be relayed, and
    /// the position moved past it).
    pub(crate) fn event(&mut self, event: Boundary) -> Option<Gtid> {
        match event {
            // A transaction left open (a log cut short) never committed.
            Boundary::Begins(gtid) => {
                self.open = Some(gtid);
                None
            }
            Boundary::Xid => self.open.take(),
            Boundary::Query { commit } => match self.open {
                Some(gtid) if commit || gtid.standalone => self.open.take(),
                _ => None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gtid(domain: u32, sequence: u64, standalone: bool) -> Gtid {
        Gtid {
            domain,
            server: 1,
            sequence,
            standalone,
        }
    }

    #[test]
    fn positions_read_and_write_mariadb_text() {
        let mut pos = GtidPos::parse("0-1-100, 2-5-7").unwrap();
        assert_eq!(pos.to_string(), "0-1-100,2-5-7");
        pos.advance(&gtid(0, 101, false));
        pos.advance(&gtid(1, 3, false));
        assert_eq!(pos.to_string(), "0-1-101,1-1-3,2-5-7");
        assert_eq!(GtidPos::parse("").unwrap().to_string(), "");
        let refused = GtidPos::parse("0-1").unwrap_err();
        assert!(refused.contains("\"0-1\""), "{refused}");
        assert!(GtidPos::parse("0-1-x").is_err());
    }

    #[test]
    fn gtid_events_are_read_from_their_body() {
        let mut body = 42u64.to_le_bytes().to_vec();
        body.extend(3u32.to_le_bytes());
        body.push(FL_STANDALONE);
        assert_eq!(
            gtid_event(&body, 9),
            Some(Gtid {
                domain: 3,
                server: 9,
                sequence: 42,
                standalone: true
            })
        );
        assert_eq!(gtid_event(&body[..12], 9), None);
    }

    #[test]
    fn a_transaction_is_complete_at_its_commit() {
        let mut txns = Transactions::default();
        assert_eq!(
            txns.event(Boundary::Query { commit: false }),
            None,
            "nothing open"
        );
        txns.event(Boundary::Begins(gtid(0, 1, false)));
        assert_eq!(txns.event(Boundary::Query { commit: false }), None, "BEGIN");
        assert_eq!(txns.open(), Some(gtid(0, 1, false)));
        assert_eq!(txns.event(Boundary::Xid), Some(gtid(0, 1, false)));
        assert_eq!(txns.event(Boundary::Xid), None);
        txns.event(Boundary::Begins(gtid(0, 2, true)));
        assert_eq!(
            txns.event(Boundary::Query { commit: false }),
            Some(gtid(0, 2, true)),
            "DDL"
        );
        txns.event(Boundary::Begins(gtid(0, 3, false)));
        assert_eq!(
            txns.event(Boundary::Query { commit: true }),
            Some(gtid(0, 3, false)),
            "MyISAM"
        );
        txns.event(Boundary::Begins(gtid(0, 4, false)));
        txns.event(Boundary::Begins(gtid(0, 5, false)));
        assert_eq!(
            txns.event(Boundary::Xid),
            Some(gtid(0, 5, false)),
            "an unfinished one never committed"
        );
    }
}
