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
        let mut authority = &tail[..end];
        let mut end = end;
        // A password typed without percent-encoding may hold `/ ? # ,`,
        // which end the authority above before its `@`: then the
        // credentials run to the last `@` of the whole URL (up to a space,
        // a quote or the next URL), and all of them are masked.
        if !authority.contains('@') && authority.contains(':') {
            let token_end = tail
                .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | ')' | '>'))
                .unwrap_or(tail.len());
            let token = &tail[..tail[..token_end].find("://").unwrap_or(token_end)];
            if let Some(sign) = token.rfind('@') {
                authority = &tail[..sign
                    + token[sign..]
                        .find(['/', '?', '#', ','])
                        .unwrap_or(token.len() - sign)];
                end = authority.len();
            }
        }
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
    fn masks_passwords_holding_unencoded_url_delimiters() {
        for (typed, shown) in [
            ("postgres://u:pa/ss@h/app", "postgres://u:***@h/app"),
            ("postgres://u:pa?ss@h:5432/app", "postgres://u:***@h:5432/app"),
            ("postgres://u:pa#ss@h", "postgres://u:***@h"),
            ("nats://u:a,b@h:4222", "nats://u:***@h:4222"),
            ("amqp://u:a/b@c@h/%2f", "amqp://u:***@h/%2f"),
            (
                "invalid URL \"postgres://u:p/w@db/app\": bad port",
                "invalid URL \"postgres://u:***@db/app\": bad port",
            ),
            (
                "postgres://u:p/w@db/app and nats://n:x@h",
                "postgres://u:***@db/app and nats://n:***@h",
            ),
        ] {
            assert_eq!(url(typed), shown, "{typed}");
        }
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
