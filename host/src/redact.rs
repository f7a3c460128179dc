//! Keeps secrets out of logs, errors and `status`: credentials inside URLs
//! (`nats://user:PASSWORD@host`, `postgres://user:PASSWORD@host/db`,
//! `?password=...`) are masked wherever a URL is shown.

/// What a masked secret reads as.
const MASK: &str = "***";

/// `text` with the credentials of every URL in it masked: the password of
/// `user:password@`, a bare token in `token@`, and `password=` / `token=`
/// query values. Works on free text too (an error message quoting a URL).
pub fn url(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| c.is_whitespace() || matches!(c, '/' | '"' | '\'' | ',' | '?' | '#' | ')'))
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(sign) => {
                let userinfo = &authority[..sign];
                match userinfo.split_once(':') {
                    Some((user, _password)) => {
                        out.push_str(user);
                        out.push(':');
                        out.push_str(MASK);
                    }
                    None => out.push_str(MASK),
                }
                out.push_str(&authority[sign..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    query_secrets(&out)
}

/// Masks `password=`, `passwd=`, `token=` and `secret=` values (query strings,
/// key-value connection strings).
fn query_secrets(text: &str) -> String {
    const KEYS: [&str; 4] = ["password=", "passwd=", "token=", "secret="];
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let lower = rest.to_ascii_lowercase();
        let found = KEYS
            .iter()
            .filter_map(|key| lower.find(key).map(|at| (at, key.len())))
            .filter(|(at, _)| *at == 0 || !lower.as_bytes()[*at - 1].is_ascii_alphanumeric())
            .min();
        let Some((at, len)) = found else {
            out.push_str(rest);
            return out;
        };
        out.push_str(&rest[..at + len]);
        let value = &rest[at + len..];
        let end = value
            .find(|c: char| c.is_whitespace() || matches!(c, '&' | '"' | '\'' | ',' | ';' | ')'))
            .unwrap_or(value.len());
        if end > 0 {
            out.push_str(MASK);
        }
        rest = &value[end..];
    }
}

#[cfg(test)]
mod tests {
    use super::url;

    #[test]
    fn masks_passwords_and_tokens_in_urls() {
        assert_eq!(
            url("nats://relay:s3cret@10.0.0.1:4222"),
            "nats://relay:***@10.0.0.1:4222"
        );
        assert_eq!(url("nats://t0ken@host:4222"), "nats://***@host:4222");
        assert_eq!(
            url("postgres://app:p%40ss@db:5432/orders?sslmode=require"),
            "postgres://app:***@db:5432/orders?sslmode=require"
        );
        assert_eq!(
            url("nats://a:x@h1:4222, nats://b:y@h2:4222"),
            "nats://a:***@h1:4222, nats://b:***@h2:4222"
        );
        assert_eq!(
            url("cannot connect to NATS at nats://relay:PASSWORD@127.0.0.1:1: refused"),
            "cannot connect to NATS at nats://relay:***@127.0.0.1:1: refused"
        );
        assert_eq!(
            url("postgres://db/orders?user=app&password=hunter2&sslmode=disable"),
            "postgres://db/orders?user=app&password=***&sslmode=disable"
        );
        assert_eq!(
            url("host=db password=hunter2 user=app"),
            "host=db password=*** user=app"
        );
    }

    #[test]
    fn leaves_urls_without_credentials_alone() {
        for plain in [
            "nats://127.0.0.1:4222",
            "sqlite:///tmp/outbox.db",
            "postgres://db:5432/orders",
            "10.0.0.1:9092,10.0.0.2:9092",
            "no url at all",
            "",
        ] {
            assert_eq!(url(plain), plain);
        }
    }
}
