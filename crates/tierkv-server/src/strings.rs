//! String commands, keyspace commands (DEL, EXISTS, TYPE, KEYS, SCAN, DBSIZE) and expiry
//! (SET EX/PX/EXAT/PXAT/KEEPTTL, SETEX, PSETEX, GETEX, EXPIRE and friends, TTL, PERSIST).
//!
//! # Expiry
//! Times are absolute Unix milliseconds, stored with the value (docs/format/server-keyspace.md)
//! so they survive restarts and crashes. An expired key is never returned: every read checks
//! the time (Redis's lazy expiry), KEYS/SCAN/DBSIZE skip expired records, and a writer that
//! locks an expired key deletes it first. A background sweep ([`Keyspace::sweep`], ten times a
//! second) deletes expired keys so their space is reclaimed by the presets' own compaction.

use std::ops::Bound;

use bytes::Bytes;

use crate::cmd::{eq, parse_int, Keyspace, ScanPos, Session, NOT_INT, R, WRONGTYPE};
use crate::keys::{self, Kind};
use crate::resp::Reply;
use crate::txn::{Overlay, Ttl, Txn};

/// An absolute expiry time (Unix ms, may lie in the past) from a command argument.
fn expire_arg(v: &[u8], ms: bool, absolute: bool, now: u64, cmd: &str) -> Result<i64, Reply> {
    let n = parse_int(v).ok_or_else(|| Reply::err(NOT_INT))?;
    let invalid = || Reply::err(format!("invalid expire time in '{cmd}' command"));
    let n_ms = if ms { n } else { n.checked_mul(1000).ok_or_else(invalid)? };
    if absolute {
        Ok(n_ms)
    } else {
        n_ms.checked_add(now as i64).ok_or_else(invalid)
    }
}

/// SET/GETEX's expiry option at `a[i]` (EX, PX, EXAT, PXAT): `Some((at, positive))`.
fn expiry_option(o: &[u8]) -> Option<(bool, bool)> {
    if eq(o, "ex") {
        Some((false, false))
    } else if eq(o, "px") {
        Some((true, false))
    } else if eq(o, "exat") {
        Some((false, true))
    } else if eq(o, "pxat") {
        Some((true, true))
    } else {
        None
    }
}

fn positive_expiry(v: &[u8], ms: bool, absolute: bool, now: u64, cmd: &str) -> Result<i64, Reply> {
    match parse_int(v) {
        Some(n) if n <= 0 => Err(Reply::err(format!("invalid expire time in '{cmd}' command"))),
        Some(_) => expire_arg(v, ms, absolute, now, cmd),
        None => Err(Reply::err(NOT_INT)),
    }
}

impl Keyspace {
    /// Run a string or keyspace command (`None`: not one).
    pub(crate) fn string_cmd(&self, _s: &mut Session, t: &mut Txn<'_>, name: &str, a: &[Bytes]) -> Option<R> {
        Some(match name {
            "dbsize" => self.dbsize(t.now, &t.overlay()).map(|n| Reply::Int(n as i64)),
            "type" => type_of(t, &a[0]),
            "get" => get(t, &a[0]),
            "set" => set(t, a),
            "setnx" => set_string(t, &a[0], &a[1], Cond::Nx, false, Ttl::Clear).map(|(w, _)| Reply::Int(i64::from(w))),
            "setex" | "psetex" => (|| {
                let at = positive_expiry(&a[1], name == "psetex", false, t.now, name)?;
                set_string(t, &a[0], &a[2], Cond::Always, false, Ttl::At(at as u64))?;
                Ok(Reply::Ok)
            })(),
            "getset" => set_string(t, &a[0], &a[1], Cond::Always, true, Ttl::Clear)
                .map(|(_, old)| old.map_or(Reply::Nil, Reply::Bulk)),
            "getex" => getex(t, a),
            "getdel" => (|| {
                t.lock_keys([&a[0][..]])?;
                let v = get(t, &a[0])?;
                if v != Reply::Nil {
                    t.delete_key(&a[0])?;
                }
                Ok(v)
            })(),
            "mget" => (|| {
                let mut out = Vec::with_capacity(a.len());
                for k in a {
                    out.push(match t.kind(k) {
                        Some(_) => Reply::Nil,
                        None => t.read_string(k)?.map_or(Reply::Nil, Reply::Bulk),
                    });
                }
                Ok(Reply::Array(out))
            })(),
            "mset" => mset(t, a),
            "del" | "unlink" => del(t, a),
            "exists" => (|| {
                let mut n = 0;
                for k in a {
                    if t.exists(k)? {
                        n += 1;
                    }
                }
                Ok(Reply::Int(n))
            })(),
            "incr" => incr_by(t, &a[0], 1),
            "decr" => incr_by(t, &a[0], -1),
            "incrby" => match parse_int(&a[1]) {
                Some(by) => incr_by(t, &a[0], by),
                None => Err(Reply::err(NOT_INT)),
            },
            "decrby" => match parse_int(&a[1]).and_then(i64::checked_neg) {
                Some(by) => incr_by(t, &a[0], by),
                None => Err(Reply::err(NOT_INT)),
            },
            "append" => append(t, &a[0], &a[1]),
            "strlen" => (|| {
                if t.kind(&a[0]).is_some() {
                    return Err(Reply::Error(WRONGTYPE.into()));
                }
                Ok(Reply::Int(t.read_string(&a[0])?.map_or(0, |v| v.len() as i64)))
            })(),
            "expire" | "pexpire" | "expireat" | "pexpireat" => expire(t, name, a),
            "ttl" | "pttl" | "expiretime" | "pexpiretime" => (|| {
                let k = &a[0];
                if !t.exists(k)? {
                    return Ok(Reply::Int(-2));
                }
                let Some(at) = t.deadline(k) else { return Ok(Reply::Int(-1)) };
                let v = match name {
                    "ttl" => (at.saturating_sub(t.now) + 500) / 1000,
                    "pttl" => at.saturating_sub(t.now),
                    "expiretime" => (at + 500) / 1000,
                    _ => at,
                };
                Ok(Reply::Int(v as i64))
            })(),
            "persist" => (|| {
                t.lock_keys([&a[0][..]])?;
                if !t.exists(&a[0])? || t.deadline(&a[0]).is_none() {
                    return Ok(Reply::Int(0));
                }
                t.set_expiry(&a[0], None)?;
                Ok(Reply::Int(1))
            })(),
            "keys" => (|| {
                let mut out = Vec::new();
                self.walk(ScanPos { phase: 0, after: None }, usize::MAX, t.now, &t.overlay(), |_, k| {
                    if crate::glob::matches(&a[0], k) {
                        out.push(Reply::Bulk(k.to_vec()));
                    }
                })?;
                Ok(Reply::Array(out))
            })(),
            "scan" => self.scan(t, a),
            _ => return None,
        })
    }

    /// Logical keys, in the order SCAN visits them: strings (raw keys below `0xFF`), then
    /// hashes and sorted sets (type records), then strings stored escaped, then strings with
    /// an expiry.
    fn phase_range(phase: u8) -> Option<(Vec<u8>, Vec<u8>)> {
        match phase {
            0 => Some((Vec::new(), vec![keys::META])),
            1 => Some(keys::type_range()),
            2 => Some(keys::escaped_range()),
            3 => Some(keys::expiring_range()),
            _ => None,
        }
    }

    /// Walk live logical keys from `pos`, calling `f` for each, examining at most `budget`
    /// records (`usize::MAX`: all). Returns where to resume (`None`: done). `overlay` holds
    /// the records a transaction has staged (see [`Txn::overlay`]): they are read on top of
    /// the store, so KEYS, SCAN and DBSIZE inside EXEC or a script see its own writes.
    pub(crate) fn walk(
        &self,
        mut pos: ScanPos,
        budget: usize,
        now: u64,
        overlay: &Overlay,
        mut f: impl FnMut(u8, &[u8]),
    ) -> Result<Option<ScanPos>, Reply> {
        let mut seen = 0usize;
        let db_err = crate::cmd::db_err;
        while let Some((lo, hi)) = Keyspace::phase_range(pos.phase) {
            let start = match &pos.after {
                Some(a) => Bound::Excluded(&a[..]),
                None => Bound::Included(&lo[..]),
            };
            let range = (start, Bound::Excluded(&hi[..]));
            let mut stored = self.db().scan::<(Bound<&[u8]>, Bound<&[u8]>)>(range).map_err(db_err)?;
            let mut staged = overlay.range::<[u8], _>(range).peekable();
            let mut next_stored = stored.next().transpose().map_err(db_err)?;
            loop {
                // The two sorted sources merged; a staged record replaces a stored one.
                let from_staged = match (&next_stored, staged.peek()) {
                    (None, None) => break,
                    (Some((sk, _)), Some((k, _))) => k.as_slice() <= sk.as_slice(),
                    (stored_one, _) => stored_one.is_none(),
                };
                let (k, v) = if from_staged {
                    let Some((k, v)) = staged.next() else { break };
                    if next_stored.as_ref().is_some_and(|(sk, _)| sk == k) {
                        next_stored = stored.next().transpose().map_err(db_err)?;
                    }
                    match v {
                        Some(v) => (k.clone(), v.clone()),
                        None => continue,
                    }
                } else {
                    let Some(e) = next_stored.take() else { break };
                    next_stored = stored.next().transpose().map_err(db_err)?;
                    e
                };
                let name = if pos.phase == 0 { &k[..] } else { k.get(2..).unwrap_or_default() };
                let corrupt = || Reply::err(format!("corrupt stored record for key '{}'", tierkv::escape(name)));
                let expiry = match pos.phase {
                    1 => keys::decode_type(&v).ok_or_else(corrupt)?.2,
                    3 => Some(keys::decode_expiring(&v).ok_or_else(corrupt)?.0),
                    _ => None,
                };
                if expiry.is_none_or(|at| at > now) {
                    f(pos.phase, name);
                }
                seen += 1;
                if seen >= budget {
                    return Ok(Some(ScanPos { phase: pos.phase, after: Some(k) }));
                }
            }
            pos = ScanPos { phase: pos.phase + 1, after: None };
        }
        Ok(None)
    }

    /// Live keys (a walk over the store: O(n)), with `overlay` on top (see [`Keyspace::walk`]).
    pub(crate) fn dbsize(&self, now: u64, overlay: &Overlay) -> Result<u64, Reply> {
        let mut n = 0u64;
        self.walk(ScanPos { phase: 0, after: None }, usize::MAX, now, overlay, |_, _| n += 1)?;
        Ok(n)
    }

    fn scan(&self, t: &Txn<'_>, a: &[Bytes]) -> R {
        let cursor: u64 =
            std::str::from_utf8(&a[0]).ok().and_then(|s| s.parse().ok()).ok_or_else(|| Reply::err("invalid cursor"))?;
        let (mut pattern, mut count, mut typ) = (None, 10usize, None);
        let mut i = 1;
        while i < a.len() {
            if i + 1 >= a.len() {
                return Err(Reply::err("syntax error"));
            }
            if eq(&a[i], "match") {
                pattern = Some(&a[i + 1][..]);
            } else if eq(&a[i], "count") {
                count = match parse_int(&a[i + 1]) {
                    Some(c) if c >= 1 => c as usize,
                    Some(_) => return Err(Reply::err("syntax error")),
                    None => return Err(Reply::err(NOT_INT)),
                };
            } else if eq(&a[i], "type") {
                typ = Some(String::from_utf8_lossy(&a[i + 1]).to_ascii_lowercase());
            } else {
                return Err(Reply::err("syntax error"));
            }
            i += 2;
        }
        let pos = if cursor == 0 {
            ScanPos { phase: 0, after: None }
        } else {
            self.cursors.lock().map.get(&cursor).cloned().ok_or_else(|| Reply::err("invalid cursor"))?
        };
        let mut keys_out = Vec::new();
        let next = self.walk(pos, count, t.now, &t.overlay(), |phase, k| {
            if pattern.is_some_and(|p| !crate::glob::matches(p, k)) {
                return;
            }
            if let Some(want) = &typ {
                let kind = match phase {
                    1 => t.kind_raw(k).map_or("none", |(kind, _)| kind.name()),
                    _ => "string",
                };
                if kind != want {
                    return;
                }
            }
            keys_out.push(Reply::Bulk(k.to_vec()));
        })?;
        let next_cursor = match next {
            None => 0,
            Some(p) => {
                let mut c = self.cursors.lock();
                let id = loop {
                    let id = rand::random::<u64>() >> 1;
                    if id != 0 && !c.map.contains_key(&id) {
                        break id;
                    }
                };
                c.map.insert(id, p);
                c.order.push_back(id);
                while c.order.len() > crate::cmd::MAX_CURSORS {
                    if let Some(old) = c.order.pop_front() {
                        c.map.remove(&old);
                    }
                }
                id
            }
        };
        Ok(Reply::Array(vec![Reply::Bulk(next_cursor.to_string().into_bytes()), Reply::Array(keys_out)]))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cond {
    Always,
    Nx,
    Xx,
}

fn type_of(t: &Txn<'_>, k: &[u8]) -> R {
    let name = match t.kind(k) {
        Some((kind, _)) => kind.name(),
        None if t.read_string(k)?.is_some() => "string",
        None => "none",
    };
    Ok(Reply::Status(name.into()))
}

fn get(t: &Txn<'_>, k: &[u8]) -> R {
    if t.kind(k).is_some() {
        return Err(Reply::Error(WRONGTYPE.into()));
    }
    Ok(t.read_string(k)?.map_or(Reply::Nil, Reply::Bulk))
}

fn set(t: &mut Txn<'_>, a: &[Bytes]) -> R {
    let (mut nx, mut xx, mut get, mut keepttl) = (false, false, false, false);
    let mut expiry: Option<i64> = None;
    let mut i = 2;
    while i < a.len() {
        let o = &a[i];
        if eq(o, "nx") && !xx {
            nx = true;
        } else if eq(o, "xx") && !nx {
            xx = true;
        } else if eq(o, "get") {
            get = true;
        } else if eq(o, "keepttl") && expiry.is_none() {
            keepttl = true;
        } else if let (Some((ms, abs)), Some(v), false, None) = (expiry_option(o), a.get(i + 1), keepttl, expiry) {
            expiry = Some(positive_expiry(v, ms, abs, t.now, "set")?);
            i += 1;
        } else {
            return Err(Reply::err("syntax error"));
        }
        i += 1;
    }
    let cond = if nx {
        Cond::Nx
    } else if xx {
        Cond::Xx
    } else {
        Cond::Always
    };
    let ttl = match expiry {
        Some(at) => Ttl::At(at as u64),
        None if keepttl => Ttl::Keep,
        None => Ttl::Clear,
    };
    let (written, old) = set_string(t, &a[0], &a[1], cond, get, ttl)?;
    Ok(match (get, written) {
        // With GET the reply is the old value, whether or not the condition let it write.
        (true, _) => old.map_or(Reply::Nil, Reply::Bulk),
        (false, true) => Reply::Ok,
        (false, false) => Reply::Nil,
    })
}

/// SET core: (whether it wrote, the old value if `want_old`). An absolute expiry already in
/// the past deletes the key instead (Redis's `checkAlreadyExpired`).
fn set_string(
    t: &mut Txn<'_>,
    k: &[u8],
    v: &[u8],
    cond: Cond,
    want_old: bool,
    ttl: Ttl,
) -> Result<(bool, Option<Vec<u8>>), Reply> {
    t.lock_keys([k])?;
    let kind = t.kind(k);
    if kind.is_some() && want_old {
        return Err(Reply::Error(WRONGTYPE.into()));
    }
    // A plain SET reads nothing: it needs neither the old value nor whether there was one.
    let old = if kind.is_none() && (want_old || cond != Cond::Always) { t.read_string(k)? } else { None };
    let exists = kind.is_some() || old.is_some();
    if (cond == Cond::Nx && exists) || (cond == Cond::Xx && !exists) {
        return Ok((false, old));
    }
    match ttl {
        Ttl::At(at) if at <= t.now => {
            t.delete_key(k)?;
        }
        _ => t.write_string(k, v, ttl)?,
    }
    Ok((true, old))
}

fn getex(t: &mut Txn<'_>, a: &[Bytes]) -> R {
    let k = &a[0];
    let mut change: Option<Option<i64>> = None;
    let mut i = 1;
    while i < a.len() {
        if let (Some((ms, abs)), Some(v), None) = (expiry_option(&a[i]), a.get(i + 1), change) {
            change = Some(Some(positive_expiry(v, ms, abs, t.now, "getex")?));
            i += 2;
        } else if eq(&a[i], "persist") && change.is_none() {
            change = Some(None);
            i += 1;
        } else {
            return Err(Reply::err("syntax error"));
        }
    }
    t.lock_keys([&k[..]])?;
    let v = get(t, k)?;
    if v == Reply::Nil {
        return Ok(v);
    }
    match change {
        Some(Some(at)) if at as u64 <= t.now => {
            t.delete_key(k)?;
        }
        Some(Some(at)) => t.set_expiry(k, Some(at as u64))?,
        Some(None) if t.deadline(k).is_some() => t.set_expiry(k, None)?,
        _ => {}
    }
    Ok(v)
}

fn expire(t: &mut Txn<'_>, name: &str, a: &[Bytes]) -> R {
    let k = &a[0];
    let at = expire_arg(&a[1], name.starts_with('p'), name.ends_with("at"), t.now, name)?;
    let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
    for o in &a[2..] {
        if eq(o, "nx") {
            nx = true;
        } else if eq(o, "xx") {
            xx = true;
        } else if eq(o, "gt") {
            gt = true;
        } else if eq(o, "lt") {
            lt = true;
        } else {
            return Err(Reply::err(format!("Unsupported option {}", String::from_utf8_lossy(o))));
        }
    }
    if nx && (xx || gt || lt) {
        return Err(Reply::err("NX and XX, GT or LT options at the same time are not compatible"));
    }
    if gt && lt {
        return Err(Reply::err("GT and LT options at the same time are not compatible"));
    }
    t.lock_keys([&k[..]])?;
    if !t.exists(k)? {
        return Ok(Reply::Int(0));
    }
    let cur = t.deadline(k);
    let refused = match cur {
        // No expiry counts as an infinite one.
        None => xx || gt,
        Some(c) => nx || (gt && at <= c as i64) || (lt && at >= c as i64),
    };
    if refused {
        return Ok(Reply::Int(0));
    }
    if at <= t.now as i64 {
        t.delete_key(k)?;
    } else {
        t.set_expiry(k, Some(at as u64))?;
    }
    Ok(Reply::Int(1))
}

fn mset(t: &mut Txn<'_>, a: &[Bytes]) -> R {
    if !a.len().is_multiple_of(2) {
        return Err(Reply::err("wrong number of arguments for 'mset' command"));
    }
    t.lock_keys(a.chunks_exact(2).map(|p| &p[0][..]))?;
    for p in a.chunks_exact(2) {
        t.write_string(&p[0], &p[1], Ttl::Clear)?;
    }
    Ok(Reply::Ok)
}

fn del(t: &mut Txn<'_>, a: &[Bytes]) -> R {
    let mut ks: Vec<&[u8]> = a.iter().map(|k| &k[..]).collect();
    ks.sort_unstable();
    ks.dedup();
    t.lock_keys(ks.iter().copied())?;
    let mut n = 0;
    for k in ks {
        if t.delete_key(k)? {
            n += 1;
        }
    }
    Ok(Reply::Int(n))
}

fn incr_by(t: &mut Txn<'_>, k: &[u8], by: i64) -> R {
    t.lock_keys([k])?;
    if t.kind(k).is_some() {
        return Err(Reply::Error(WRONGTYPE.into()));
    }
    let cur = match t.read_string(k)? {
        Some(v) => parse_int(&v).ok_or_else(|| Reply::err(NOT_INT))?,
        None => 0,
    };
    let new = cur.checked_add(by).ok_or_else(|| Reply::err("increment or decrement would overflow"))?;
    t.write_string(k, new.to_string().as_bytes(), Ttl::Keep)?;
    Ok(Reply::Int(new))
}

fn append(t: &mut Txn<'_>, k: &[u8], v: &[u8]) -> R {
    t.lock_keys([k])?;
    if t.kind(k).is_some() {
        return Err(Reply::Error(WRONGTYPE.into()));
    }
    let mut cur = t.read_string(k)?.unwrap_or_default();
    cur.extend_from_slice(v);
    t.write_string(k, &cur, Ttl::Keep)?;
    Ok(Reply::Int(cur.len() as i64))
}

/// Whether `k` is a `want` (its count; 0 if absent) or `Err(WRONGTYPE)`.
pub(crate) fn expect_kind(t: &Txn<'_>, k: &[u8], want: Kind) -> Result<u64, Reply> {
    match t.kind(k) {
        Some((kind, n)) if kind == want => Ok(n),
        Some(_) => Err(Reply::Error(WRONGTYPE.into())),
        None => match t.read_string(k)? {
            Some(_) => Err(Reply::Error(WRONGTYPE.into())),
            None => Ok(0),
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn expiry_arguments_as_redis() {
        assert_eq!(expire_arg(b"10", false, false, 1_000, "expire").unwrap(), 11_000);
        assert_eq!(expire_arg(b"10", true, false, 1_000, "pexpire").unwrap(), 1_010);
        assert_eq!(expire_arg(b"7", false, true, 1_000, "expireat").unwrap(), 7_000);
        assert_eq!(expire_arg(b"-5", false, false, 1_000, "expire").unwrap(), -4_000);
        let e = expire_arg(b"9223372036854775807", false, false, 0, "expire").unwrap_err();
        assert_eq!(e, Reply::err("invalid expire time in 'expire' command"));
        assert_eq!(expire_arg(b"x", false, false, 0, "expire").unwrap_err(), Reply::err(NOT_INT));
        assert_eq!(
            positive_expiry(b"0", false, false, 0, "set").unwrap_err(),
            Reply::err("invalid expire time in 'set' command")
        );
        assert_eq!(
            positive_expiry(b"-1", true, true, 0, "getex").unwrap_err(),
            Reply::err("invalid expire time in 'getex' command")
        );
        assert_eq!(positive_expiry(b"2", true, true, 0, "set").unwrap(), 2);
    }
}
