//! `[connections] per_server`: the sessions this relay's databases hold on
//! one PostgreSQL server, shared out equally among the databases it serves
//! there. A database gets at most its share when its relay starts; one that
//! finds none left makes those above their share start over smaller.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio_util::sync::CancellationToken;

/// The budgets of every server, cheap to clone.
#[derive(Clone, Default)]
pub(super) struct Budget {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    per_server: Option<u32>,
    next_id: AtomicU64,
    servers: Mutex<HashMap<String, Server>>,
}

#[derive(Default)]
struct Server {
    /// Databases being served or waiting to be, by id.
    wanting: Vec<u64>,
    /// Connections each holds, and the token that restarts its relay.
    grants: HashMap<u64, (u32, CancellationToken)>,
}

/// One database's place in its server's budget, for as long as it is
/// served; dropping it gives the place up.
pub(super) struct Want {
    budget: Budget,
    server: Option<String>,
    id: u64,
}

/// Connections a database's relay may open, until dropped.
pub(super) struct Grant {
    budget: Budget,
    server: Option<String>,
    id: u64,
    /// How many.
    pub connections: u32,
}

impl Budget {
    /// `per_server` connections per server, or none for no cap.
    pub(super) fn new(per_server: Option<u32>) -> Budget {
        Budget {
            inner: Arc::new(Inner {
                per_server,
                ..Inner::default()
            }),
        }
    }

    /// Takes a place for the database at `url` (SQLite files and a budget
    /// without a cap count nothing).
    pub(super) fn want(&self, url: &str) -> Want {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let server = self.inner.per_server.and_then(|_| server_of(url));
        if let Some(server) = &server {
            self.servers().entry(server.clone()).or_default().wanting.push(id);
        }
        Want {
            budget: self.clone(),
            server,
            id,
        }
    }

    fn servers(&self) -> std::sync::MutexGuard<'_, HashMap<String, Server>> {
        self.inner.servers.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Want {
    /// Up to `wants` connections: its share of the server at most, and
    /// what is free. None free: the databases above their share are told
    /// to start over smaller (`round` is this one's), and the error says so.
    pub(super) fn grant(&self, wants: u32, round: CancellationToken) -> Result<Grant, String> {
        let grant = |connections| Grant {
            budget: self.budget.clone(),
            server: self.server.clone(),
            id: self.id,
            connections,
        };
        let (Some(server_name), Some(per_server)) = (&self.server, self.budget.inner.per_server) else {
            return Ok(grant(wants));
        };
        let mut servers = self.budget.servers();
        let server = servers.entry(server_name.clone()).or_default();
        let databases = u32::try_from(server.wanting.len()).unwrap_or(u32::MAX).max(1);
        let share = (per_server / databases).max(1);
        let held: u32 = server.grants.values().map(|(held, _)| held).sum();
        let give = wants.min(share).min(per_server.saturating_sub(held));
        if give < wants.min(share) {
            for (held, others) in server.grants.values() {
                if *held > share {
                    others.cancel();
                }
            }
        }
        if give == 0 {
            return Err(format!(
                "no connection left to {server_name}: [connections] per_server = {per_server} are all held \
                 by the other {} database(s) this relay serves there (share: {share} each); waiting for one",
                server.grants.len()
            ));
        }
        server.grants.insert(self.id, (give, round));
        Ok(grant(give))
    }
}

impl Drop for Want {
    fn drop(&mut self) {
        if let Some(server) = &self.server
            && let Some(entry) = self.budget.servers().get_mut(server)
        {
            entry.wanting.retain(|id| *id != self.id);
        }
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if let Some(server) = &self.server
            && let Some(entry) = self.budget.servers().get_mut(server)
        {
            entry.grants.remove(&self.id);
        }
    }
}

/// `host:port` of a PostgreSQL URL; `None` for SQLite or a URL that does
/// not parse (which fails to connect anyway).
fn server_of(url: &str) -> Option<String> {
    if url.starts_with("sqlite:") {
        return None;
    }
    if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let options = crate::endpoint::Endpoint::from(url)
            .mysql_options_with(None)
            .ok()?;
        return Some(format!("{}:{}", options.get_host(), options.get_port()));
    }
    let options = sqlx::postgres::PgConnectOptions::from_str(url).ok()?;
    Some(format!("{}:{}", options.get_host(), options.get_port()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "postgres://u@db1:5432/a";
    const B: &str = "postgres://u@db1:5432/b";
    const C: &str = "postgres://u@db1:5432/c";
    const OTHER: &str = "postgres://u@db2:5432/a";

    #[test]
    fn each_database_gets_at_most_its_share_and_never_more_than_the_cap() {
        let budget = Budget::new(Some(5));
        let (a, b) = (budget.want(A), budget.want(B));
        let ga = a.grant(4, CancellationToken::new()).unwrap();
        let gb = b.grant(4, CancellationToken::new()).unwrap();
        assert_eq!((ga.connections, gb.connections), (2, 2));
        // Another server has a budget of its own.
        let other = budget.want(OTHER);
        assert_eq!(other.grant(4, CancellationToken::new()).unwrap().connections, 4);
    }

    #[test]
    fn a_database_left_without_makes_the_ones_above_their_share_start_over() {
        let budget = Budget::new(Some(4));
        let a = budget.want(A);
        let round_a = CancellationToken::new();
        let ga = a.grant(4, round_a.clone()).unwrap();
        assert_eq!(ga.connections, 4);
        let (b, c) = (budget.want(B), budget.want(C));
        let error = b.grant(4, CancellationToken::new()).err().unwrap();
        assert!(error.contains("per_server = 4"), "{error}");
        assert!(round_a.is_cancelled(), "the database above its share starts over");
        drop(ga);
        // Started over: a third each (one), and the others find room.
        let ga = a.grant(4, CancellationToken::new()).unwrap();
        let gb = b.grant(4, CancellationToken::new()).unwrap();
        let gc = c.grant(4, CancellationToken::new()).unwrap();
        assert_eq!((ga.connections, gb.connections, gc.connections), (1, 1, 1));
    }

    #[test]
    fn without_a_cap_or_for_sqlite_a_database_gets_what_it_asks() {
        let open = Budget::new(None);
        assert_eq!(
            open.want(A)
                .grant(9, CancellationToken::new())
                .unwrap()
                .connections,
            9
        );
        let capped = Budget::new(Some(1));
        let file = capped.want("sqlite:/tmp/x.db");
        assert_eq!(file.grant(9, CancellationToken::new()).unwrap().connections, 9);
    }

    #[test]
    fn more_databases_than_connections_serves_as_many_as_fit() {
        let budget = Budget::new(Some(2));
        let wants: Vec<Want> = [A, B, C].iter().map(|url| budget.want(url)).collect();
        let grants: Vec<Result<Grant, String>> = wants
            .iter()
            .map(|want| want.grant(3, CancellationToken::new()))
            .collect();
        let served = grants.iter().filter(|grant| grant.is_ok()).count();
        assert_eq!(served, 2);
        drop(grants);
        drop(wants);
        assert!(
            budget
                .servers()
                .values()
                .all(|s| s.grants.is_empty() && s.wanting.is_empty())
        );
    }
}
