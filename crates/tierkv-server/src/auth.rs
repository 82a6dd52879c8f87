//! AUTH and protected mode, as Redis does them for its `default` user.
//!
//! - The password comes from a file (`--requirepass-file`) or the `TIERKV_REQUIREPASS`
//!   environment variable, never from the command line (which every user sees in `ps`).
//!   Only its SHA-256 digest is kept; an attempt is hashed and the two digests compared in
//!   constant time ([`subtle`]), as Redis's `time_independent_strcmp` does, so neither the
//!   content nor the length of the password leaks through timing.
//! - With a password set, every command but AUTH, HELLO and QUIT gets `-NOAUTH
//!   Authentication required.` until the connection authenticates (`AUTH pass`, `AUTH
//!   default pass` or `HELLO 3 AUTH default pass`); a bad password gets `-WRONGPASS invalid
//!   username-password pair or user is disabled.`, and is logged on stderr with the client's
//!   address (Redis records these in its ACL log instead; tierkv has no ACLs).
//! - Protected mode (on by default): with no password set, a client whose address is not a
//!   loopback address (127.0.0.0/8, ::1, or IPv4-mapped 127.x) gets the `-DENIED` error and
//!   is disconnected, whatever `--bind` says. Redis compares against "127.0.0.1" and "::1"
//!   only; the whole loopback range is loopback all the same.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use subtle::ConstantTimeEq;

use crate::cmd::{eq, Keyspace, Session, R};
use crate::resp::Reply;

/// The environment variable holding the password (when no file is given).
pub const PASSWORD_ENV: &str = "TIERKV_REQUIREPASS";

/// A password, kept only as its SHA-256 digest.
#[derive(Clone)]
pub struct Password {
    digest: [u8; 32],
}

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Password(<redacted>)")
    }
}

fn sha256(b: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, b);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

impl Password {
    /// A password from its bytes (`None` if empty: Redis treats an empty requirepass as none).
    pub fn new(p: &[u8]) -> Option<Password> {
        (!p.is_empty()).then(|| Password { digest: sha256(p) })
    }

    /// Read the password from the first line of `path` (a trailing `\n` or `\r\n` is not
    /// part of it). An empty file is an error, not "no password".
    pub fn from_file(path: &std::path::Path) -> Result<Password, String> {
        let raw = std::fs::read(path).map_err(|e| format!("cannot read the password file {}: {e}", path.display()))?;
        let mut p = &raw[..];
        if let Some(nl) = p.iter().position(|&c| c == b'\n') {
            p = &p[..nl];
        }
        if p.last() == Some(&b'\r') {
            p = &p[..p.len() - 1];
        }
        Password::new(p).ok_or_else(|| format!("the password file {} is empty", path.display()))
    }

    /// Whether `attempt` is this password (constant time).
    pub fn matches(&self, attempt: &[u8]) -> bool {
        bool::from(sha256(attempt).ct_eq(&self.digest))
    }
}

/// The `-DENIED` error of protected mode, in Redis's words, with tierkv's remedies.
pub const DENIED: &str = "DENIED Redis is running in protected mode because protected mode is enabled and no password is set for the default user. In this mode connections are only accepted from the loopback interface. If you want to connect from external computers to tierkv you may adopt one of the following solutions: 1) Restart the server with the '--protected-mode no' option, however MAKE SURE it is not publicly accessible from internet if you do so. 2) Set up an authentication password for the default user: start the server with '--requirepass-file FILE' or with the password in the TIERKV_REQUIREPASS environment variable. NOTE: You only need to do one of the above things in order for the server to start accepting connections from the outside.";

/// Whether protected mode refuses a client from `peer`.
pub fn denied(ks: &Keyspace, peer: &SocketAddr) -> bool {
    ks.settings.protected_mode && ks.settings.requirepass.is_none() && !peer.ip().to_canonical().is_loopback()
}

impl Keyspace {
    /// AUTH \[username\] password.
    pub(crate) fn auth(&self, s: &mut Session, a: &[Bytes]) -> R {
        match a.len() {
            1 => self.authenticate(s, None, &a[0]).map(|()| Reply::Ok),
            2 => self.authenticate(s, Some(&a[0]), &a[1]).map(|()| Reply::Ok),
            _ => Err(Reply::err("syntax error")),
        }
    }

    /// Check a username (only `default` exists) and password; on success the session is
    /// authenticated, on failure it keeps whatever state it had (as Redis).
    pub(crate) fn authenticate(&self, s: &mut Session, user: Option<&Bytes>, pass: &[u8]) -> Result<(), Reply> {
        let Some(pw) = &self.settings.requirepass else {
            if user.is_none() {
                return Err(Reply::err("AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?"));
            }
            // No password: the default user accepts any password (Redis's `nopass`).
            if user.is_some_and(|u| eq(u, "default")) {
                s.authed = true;
                return Ok(());
            }
            return Err(self.auth_failed(s, user));
        };
        let user_ok = user.is_none_or(|u| u.as_ref() == b"default");
        // Always compare, so a wrong user name takes as long as a wrong password.
        let pass_ok = pw.matches(pass);
        if user_ok && pass_ok {
            s.authed = true;
            Ok(())
        } else {
            Err(self.auth_failed(s, user))
        }
    }

    fn auth_failed(&self, s: &Session, user: Option<&Bytes>) -> Reply {
        self.counters.auth_failures.fetch_add(1, Ordering::Relaxed);
        let who = s.peer.map_or_else(|| "?".to_string(), |p| p.to_string());
        let user = user.map_or_else(|| "default".to_string(), |u| String::from_utf8_lossy(u).into_owned());
        eprintln!("tierkv serve: failed AUTH for user '{}' from {who} (client id {})", user.escape_debug(), s.id);
        Reply::Error("WRONGPASS invalid username-password pair or user is disabled.".into())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn passwords_compare_by_digest() {
        let p = Password::new(b"s3cret").unwrap();
        assert!(p.matches(b"s3cret"));
        assert!(!p.matches(b"s3cre"));
        assert!(!p.matches(b"s3cret "));
        assert!(!p.matches(b""));
        assert!(Password::new(b"").is_none());
        assert_eq!(format!("{p:?}"), "Password(<redacted>)");
    }

    #[test]
    fn password_file_takes_the_first_line() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("pw");
        std::fs::write(&f, b"pa ss\r\nignored\n").unwrap();
        assert!(Password::from_file(&f).unwrap().matches(b"pa ss"));
        std::fs::write(&f, b"\n").unwrap();
        assert!(Password::from_file(&f).unwrap_err().contains("empty"));
        assert!(Password::from_file(&d.path().join("none")).is_err());
    }

    #[test]
    fn protected_mode_knows_loopback() {
        for (a, lo) in [
            ("127.0.0.1:1", true),
            ("127.9.0.1:1", true),
            ("[::1]:1", true),
            ("[::ffff:127.0.0.1]:1", true),
            ("192.0.2.1:1", false),
            ("[::ffff:192.0.2.1]:1", false),
            ("[2001:db8::1]:1", false),
        ] {
            let p: SocketAddr = a.parse().unwrap();
            assert_eq!(p.ip().to_canonical().is_loopback(), lo, "{a}");
        }
    }
}
