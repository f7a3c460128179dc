//! Decodes the `pgoutput` messages replication mode needs: a table's
//! columns (Relation) and its new rows (Insert), values in text form.
//! Everything else (updates, deletes, truncates, types, origins) is skipped.

use std::collections::HashMap;
use std::sync::Arc;

/// Why a message could not be read: the stream is not what `pgoutput`
/// protocol 1 sends.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed pgoutput message: {0}")]
pub struct Malformed(pub String);

/// A new row: its table's columns and its values in their order (`None`:
/// NULL, or a TOASTed value not sent, which an insert never has).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inserted {
    /// The table, as its Relation message described it.
    pub relation: Arc<RelationInfo>,
    /// Text values, one per column.
    pub values: Vec<Option<String>>,
}

impl Inserted {
    /// The value of column `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        let index = self.relation.columns.iter().position(|c| c == name)?;
        self.values.get(index)?.as_deref()
    }

    /// Takes the value of column `name` out of the row.
    pub fn take(&mut self, name: &str) -> Option<String> {
        let index = self.relation.columns.iter().position(|c| c == name)?;
        self.values.get_mut(index)?.take()
    }
}

/// A table as `pgoutput` describes it.
#[derive(Debug, PartialEq, Eq)]
pub struct RelationInfo {
    /// `schema.table`.
    pub table: String,
    /// Its columns, in order.
    pub columns: Vec<String>,
}

/// The tables seen so far in this session: `pgoutput` describes each once,
/// before its first change.
#[derive(Debug, Default)]
pub struct Decoder {
    relations: HashMap<u32, Arc<RelationInfo>>,
}

/// Reads big-endian fields off the front of a message.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed(format!("{what} cut short")));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> Result<u8, Malformed> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, Malformed> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32, Malformed> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn cstring(&mut self, what: &str) -> Result<String, Malformed> {
        let end = self
            .0
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| Malformed(format!("{what} has no terminator")))?;
        let text = String::from_utf8_lossy(&self.0[..end]).into_owned();
        self.0 = &self.0[end + 1..];
        Ok(text)
    }
}

impl Decoder {
    /// Reads one message: `Some` for an insert, `None` for anything else
    /// (a Relation message is remembered).
    ///
    /// # Errors
    /// A message cut short, or an insert into a table never described.
    pub fn decode(&mut self, data: &[u8]) -> Result<Option<Inserted>, Malformed> {
        let mut r = Reader(data);
        match r.u8("message tag")? {
            b'R' => {
                let id = r.u32("relation id")?;
                let schema = r.cstring("namespace")?;
                let name = r.cstring("relation name")?;
                let _replica_identity = r.u8("replica identity")?;
                let count = r.u16("column count")?;
                let mut columns = Vec::with_capacity(usize::from(count));
                for _ in 0..count {
                    let _flags = r.u8("column flags")?;
                    columns.push(r.cstring("column name")?);
                    let _type = r.u32("column type")?;
                    let _modifier = r.u32("type modifier")?;
                }
                self.relations.insert(
                    id,
                    Arc::new(RelationInfo {
                        table: format!("{schema}.{name}"),
                        columns,
                    }),
                );
                Ok(None)
            }
            b'I' => {
                let id = r.u32("relation id")?;
                let relation = self.relations.get(&id).ok_or_else(|| {
                    Malformed(format!("insert into relation {id}, which was never described"))
                })?;
                if r.u8("tuple marker")? != b'N' {
                    return Err(Malformed("insert without a new tuple".into()));
                }
                let count = usize::from(r.u16("tuple column count")?);
                if count != relation.columns.len() {
                    return Err(Malformed(format!(
                        "insert into {} has {count} columns, its relation {}",
                        relation.table,
                        relation.columns.len()
                    )));
                }
                let mut values = Vec::with_capacity(count);
                for column in &relation.columns {
                    values.push(match r.u8("column kind")? {
                        b'n' | b'u' => None,
                        b't' => {
                            let len = r.u32("value length")? as usize;
                            Some(String::from_utf8_lossy(r.take(len, "value")?).into_owned())
                        }
                        other => {
                            return Err(Malformed(format!(
                                "column {column} of {} has kind {:?}; text values were asked for",
                                relation.table,
                                char::from(other)
                            )));
                        }
                    });
                }
                Ok(Some(Inserted {
                    relation: Arc::clone(relation),
                    values,
                }))
            }
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A Relation message for `public.<name>` with these columns.
    pub(crate) fn relation(id: u32, name: &str, columns: &[&str]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend(id.to_be_bytes());
        m.extend(b"public\0");
        m.extend(name.as_bytes());
        m.push(0);
        m.push(b'd');
        m.extend(u16::try_from(columns.len()).unwrap().to_be_bytes());
        for column in columns {
            m.push(0);
            m.extend(column.as_bytes());
            m.push(0);
            m.extend(25u32.to_be_bytes());
            m.extend(u32::MAX.to_be_bytes());
        }
        m
    }

    /// An Insert message with these values (`None`: NULL).
    pub(crate) fn insert(id: u32, values: &[Option<&str>]) -> Vec<u8> {
        let mut m = vec![b'I'];
        m.extend(id.to_be_bytes());
        m.push(b'N');
        m.extend(u16::try_from(values.len()).unwrap().to_be_bytes());
        for value in values {
            match value {
                None => m.push(b'n'),
                Some(v) => {
                    m.push(b't');
                    m.extend(u32::try_from(v.len()).unwrap().to_be_bytes());
                    m.extend(v.as_bytes());
                }
            }
        }
        m
    }

    #[test]
    fn an_insert_is_read_by_the_columns_its_relation_named() {
        let mut decoder = Decoder::default();
        assert_eq!(decoder.decode(&relation(7, "t", &["a", "b"])), Ok(None));
        let mut row = decoder.decode(&insert(7, &[Some("x"), None])).unwrap().unwrap();
        assert_eq!(row.relation.table, "public.t");
        assert_eq!(row.take("a").as_deref(), Some("x"));
        assert_eq!(row.take("b"), None);
        assert_eq!(row.take("c"), None, "no such column");
        // Updates, deletes and the rest are skipped.
        assert_eq!(decoder.decode(b"U\0\0\0\x07"), Ok(None));
    }

    #[test]
    fn what_protocol_1_never_sends_is_an_error_not_a_guess() {
        let mut decoder = Decoder::default();
        let unknown = decoder.decode(&insert(9, &[Some("x")])).unwrap_err();
        assert!(unknown.0.contains("never described"), "{unknown}");
        decoder.decode(&relation(9, "t", &["a", "b"])).unwrap();
        let short = decoder.decode(&insert(9, &[Some("x")])).unwrap_err();
        assert!(short.0.contains("has 1 columns, its relation 2"), "{short}");
        let mut cut = insert(9, &[Some("x"), Some("yz")]);
        cut.truncate(cut.len() - 1);
        assert_eq!(decoder.decode(&cut).unwrap_err().0, "value cut short");
        assert!(decoder.decode(b"").is_err());
    }
}
