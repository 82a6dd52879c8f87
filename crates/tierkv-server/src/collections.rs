//! Hashes and sorted sets (the commands YCSB's Redis binding uses, and a few more).
//!
//! A hash or sorted set is a type record plus one record per field or member (and per
//! score-index entry), laid out as docs/format/server-keyspace.md says; every command stages
//! all of them in its [`Txn`], so HSET's field count and ZADD's score index are updated
//! atomically with the data. They expire as whole keys (the expiry is in the type record).

use std::collections::{BTreeMap, HashMap};
use std::ops::{Bound, RangeBounds};

use bytes::Bytes;

use crate::cmd::{db_err, eq, format_score, parse_int, parse_score, Keyspace, Session, NOT_FLOAT, NOT_INT, R};
use crate::keys::{self, Kind};
use crate::resp::Reply;
use crate::strings::expect_kind;
use crate::txn::Txn;

/// Parse a ZRANGEBYSCORE bound: (value, exclusive).
fn parse_bound(b: &[u8]) -> Option<(f64, bool)> {
    match b.first() {
        Some(b'(') => parse_score(&b[1..]).map(|v| (v, true)),
        _ => parse_score(b).map(|v| (v, false)),
    }
}

/// A score: a double in RESP3, a bulk string in RESP2 (Redis 7).
fn score_reply(v: f64, proto: u8) -> Reply {
    if proto >= 3 {
        Reply::Double(v)
    } else {
        Reply::Bulk(format_score(v).into_bytes())
    }
}

/// Record `k`'s new field/member count (0 removes the key, and with it any expiry).
fn set_count(t: &mut Txn<'_>, k: &[u8], kind: Kind, was: u64, count: u64) -> Result<(), Reply> {
    if count == 0 {
        if was != 0 {
            t.set_kind(k, None);
            t.set_expiry_of_removed(k);
        }
    } else if count != was {
        t.set_kind(k, Some((kind, count)));
    } else {
        t.touch(k);
    }
    Ok(())
}

impl Keyspace {
    /// Run a hash or sorted-set command.
    pub(crate) fn collection_cmd(&self, s: &mut Session, t: &mut Txn<'_>, name: &str, a: &[Bytes]) -> R {
        match name {
            "hset" | "hmset" => hset(t, name, a),
            "hget" => {
                expect_kind(t, &a[0], Kind::Hash)?;
                Ok(t.get(&keys::hash_field(&a[0], &a[1]))?.map_or(Reply::Nil, Reply::Bulk))
            }
            "hmget" => {
                expect_kind(t, &a[0], Kind::Hash)?;
                let mut out = Vec::with_capacity(a.len() - 1);
                for f in &a[1..] {
                    out.push(t.get(&keys::hash_field(&a[0], f))?.map_or(Reply::Nil, Reply::Bulk));
                }
                Ok(Reply::Array(out))
            }
            "hgetall" => {
                if expect_kind(t, &a[0], Kind::Hash)? == 0 {
                    return Ok(Reply::Map(Vec::new()));
                }
                let p = keys::hash_prefix(&a[0]);
                let mut out = Vec::new();
                for (k, v) in t.scan_prefix(&p)? {
                    out.push((Reply::Bulk(k.get(p.len()..).unwrap_or_default().to_vec()), Reply::Bulk(v)));
                }
                Ok(Reply::Map(out))
            }
            "hdel" => hdel(t, a),
            "hlen" => Ok(Reply::Int(expect_kind(t, &a[0], Kind::Hash)? as i64)),
            "zadd" => zadd(t, a, s.proto),
            "zrem" => zrem(t, a),
            "zrangebyscore" => zrangebyscore(t, a, s.proto),
            "zscore" => {
                expect_kind(t, &a[0], Kind::Zset)?;
                let v = t.get(&keys::zmember(&a[0], &a[1]))?;
                Ok(match v.as_deref().and_then(keys::decode_score) {
                    Some(sc) => score_reply(sc, s.proto),
                    None => Reply::Nil,
                })
            }
            "zcard" => Ok(Reply::Int(expect_kind(t, &a[0], Kind::Zset)? as i64)),
            _ => Err(Reply::err(format!("unknown command '{name}'"))),
        }
    }
}

fn hset(t: &mut Txn<'_>, name: &str, a: &[Bytes]) -> R {
    if !(a.len() - 1).is_multiple_of(2) {
        return Err(Reply::err(format!("wrong number of arguments for '{name}' command")));
    }
    let k = &a[0];
    t.lock_keys([&k[..]])?;
    let count = expect_kind(t, k, Kind::Hash)?;
    let mut fields: BTreeMap<&[u8], &[u8]> = BTreeMap::new();
    for p in a[1..].chunks_exact(2) {
        fields.insert(&p[0], &p[1]);
    }
    let mut added = 0u64;
    for (f, v) in &fields {
        let fk = keys::hash_field(k, f);
        if count == 0 || t.get(&fk)?.is_none() {
            added += 1;
        }
        t.put(fk, v.to_vec());
    }
    set_count(t, k, Kind::Hash, count, count + added)?;
    Ok(if name == "hmset" { Reply::Ok } else { Reply::Int(added as i64) })
}

fn hdel(t: &mut Txn<'_>, a: &[Bytes]) -> R {
    let k = &a[0];
    t.lock_keys([&k[..]])?;
    let count = expect_kind(t, k, Kind::Hash)?;
    if count == 0 {
        return Ok(Reply::Int(0));
    }
    let mut fs: Vec<&[u8]> = a[1..].iter().map(|f| &f[..]).collect();
    fs.sort_unstable();
    fs.dedup();
    let mut removed = 0u64;
    for f in fs {
        let fk = keys::hash_field(k, f);
        if t.get(&fk)?.is_some() {
            t.delete(fk);
            removed += 1;
        }
    }
    set_count(t, k, Kind::Hash, count, count.saturating_sub(removed))?;
    Ok(Reply::Int(removed as i64))
}

fn zadd(t: &mut Txn<'_>, a: &[Bytes], proto: u8) -> R {
    let k = &a[0];
    let (mut nx, mut xx, mut gt, mut lt, mut ch, mut incr) = (false, false, false, false, false, false);
    let mut i = 1;
    while i < a.len() {
        let o = &a[i];
        if eq(o, "nx") {
            nx = true;
        } else if eq(o, "xx") {
            xx = true;
        } else if eq(o, "gt") {
            gt = true;
        } else if eq(o, "lt") {
            lt = true;
        } else if eq(o, "ch") {
            ch = true;
        } else if eq(o, "incr") {
            incr = true;
        } else {
            break;
        }
        i += 1;
    }
    let pairs = &a[i..];
    if pairs.is_empty() || !pairs.len().is_multiple_of(2) {
        return Err(Reply::err("syntax error"));
    }
    if nx && xx {
        return Err(Reply::err("XX and NX options at the same time are not compatible"));
    }
    if (nx && (gt || lt)) || (gt && lt) {
        return Err(Reply::err("GT, LT, and/or NX options at the same time are not compatible"));
    }
    if incr && pairs.len() > 2 {
        return Err(Reply::err("INCR option supports a single increment-element pair"));
    }
    let mut scored = Vec::with_capacity(pairs.len() / 2);
    for p in pairs.chunks_exact(2) {
        scored.push((parse_score(&p[0]).ok_or_else(|| Reply::err(NOT_FLOAT))?, &p[1][..]));
    }
    t.lock_keys([&k[..]])?;
    let count = expect_kind(t, k, Kind::Zset)?;
    // Current score of each member touched, as this command changes them.
    let mut now: HashMap<&[u8], Option<f64>> = HashMap::new();
    let mut first: HashMap<&[u8], Option<f64>> = HashMap::new();
    let (mut added, mut changed) = (0i64, 0i64);
    let mut incr_result = None;
    for (score, m) in scored {
        let cur = match now.get(m) {
            Some(c) => *c,
            None => {
                let c = if count == 0 {
                    None
                } else {
                    t.get(&keys::zmember(k, m))?.as_deref().and_then(keys::decode_score)
                };
                first.insert(m, c);
                c
            }
        };
        let new = match cur {
            Some(c) => {
                if nx {
                    now.insert(m, cur);
                    continue;
                }
                let new = if incr { c + score } else { score };
                if new.is_nan() {
                    return Err(Reply::err("resulting score is not a number (NaN)"));
                }
                if (gt && new <= c) || (lt && new >= c) {
                    now.insert(m, cur);
                    continue;
                }
                if new != c {
                    changed += 1;
                }
                new
            }
            None => {
                if xx {
                    now.insert(m, cur);
                    continue;
                }
                added += 1;
                changed += 1;
                score
            }
        };
        incr_result = Some(new);
        now.insert(m, Some(new));
    }
    for (m, new) in &now {
        let old = first.get(m).copied().flatten();
        match (old, *new) {
            (Some(o), Some(n)) if o == n => {}
            (old, Some(n)) => {
                if let Some(o) = old {
                    t.delete(keys::zscore(k, o, m));
                }
                t.put(keys::zscore(k, n, m), []);
                t.put(keys::zmember(k, m), n.to_bits().to_le_bytes());
            }
            (_, None) => {}
        }
    }
    set_count(t, k, Kind::Zset, count, count + added as u64)?;
    if incr {
        return Ok(incr_result.map_or(Reply::Nil, |v| score_reply(v, proto)));
    }
    Ok(Reply::Int(if ch { changed } else { added }))
}

fn zrem(t: &mut Txn<'_>, a: &[Bytes]) -> R {
    let k = &a[0];
    t.lock_keys([&k[..]])?;
    let count = expect_kind(t, k, Kind::Zset)?;
    if count == 0 {
        return Ok(Reply::Int(0));
    }
    let mut ms: Vec<&[u8]> = a[1..].iter().map(|m| &m[..]).collect();
    ms.sort_unstable();
    ms.dedup();
    let mut removed = 0u64;
    for m in ms {
        let mk = keys::zmember(k, m);
        if let Some(v) = t.get(&mk)? {
            let sc = keys::decode_score(&v).ok_or_else(|| Reply::err("corrupt sorted-set member record"))?;
            t.delete(mk);
            t.delete(keys::zscore(k, sc, m));
            removed += 1;
        }
    }
    set_count(t, k, Kind::Zset, count, count.saturating_sub(removed))?;
    Ok(Reply::Int(removed as i64))
}

fn zrangebyscore(t: &Txn<'_>, a: &[Bytes], proto: u8) -> R {
    let k = &a[0];
    let (min, minx) = parse_bound(&a[1]).ok_or_else(|| Reply::err("min or max is not a float"))?;
    let (max, maxx) = parse_bound(&a[2]).ok_or_else(|| Reply::err("min or max is not a float"))?;
    let (mut withscores, mut offset, mut limit) = (false, 0i64, -1i64);
    let mut i = 3;
    while i < a.len() {
        if eq(&a[i], "withscores") {
            withscores = true;
            i += 1;
        } else if eq(&a[i], "limit") && i + 2 < a.len() {
            offset = parse_int(&a[i + 1]).ok_or_else(|| Reply::err(NOT_INT))?;
            limit = parse_int(&a[i + 2]).ok_or_else(|| Reply::err(NOT_INT))?;
            i += 3;
        } else {
            return Err(Reply::err("syntax error"));
        }
    }
    if expect_kind(t, k, Kind::Zset)? == 0 || offset < 0 || limit == 0 {
        return Ok(Reply::Array(Vec::new()));
    }
    let p = keys::zscore_prefix(k);
    let lo_s = keys::sortable(min);
    let hi_s = keys::sortable(max);
    if lo_s > hi_s || (lo_s == hi_s && (minx || maxx)) {
        return Ok(Reply::Array(Vec::new()));
    }
    let mut lo = p.clone();
    lo.extend_from_slice(&(if minx { lo_s + 1 } else { lo_s }).to_be_bytes());
    let mut hi = p.clone();
    let hi_bound = if maxx { Some(hi_s) } else { hi_s.checked_add(1) };
    let upper = match hi_bound {
        Some(h) => {
            hi.extend_from_slice(&h.to_be_bytes());
            Bound::Excluded(&hi[..])
        }
        None => Bound::Unbounded,
    };
    // Inside a transaction that already changed this sorted set, read through its changes.
    let index: Vec<Vec<u8>> = if t.staged_under(&p) {
        let (lo_b, hi_b) = (Bound::Included(&lo[..]), upper);
        t.scan_prefix(&p)?
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| RangeBounds::<[u8]>::contains(&(lo_b, hi_b), &k[..]))
            .collect()
    } else {
        let mut v = Vec::new();
        for e in t.ks_db().scan::<(Bound<&[u8]>, Bound<&[u8]>)>((Bound::Included(&lo[..]), upper)).map_err(db_err)? {
            let (ik, _) = e.map_err(db_err)?;
            if !ik.starts_with(&p) {
                break;
            }
            v.push(ik);
            if limit > 0 && v.len() as i64 >= offset.saturating_add(limit) {
                break;
            }
        }
        v
    };
    let mut out = Vec::new();
    for ik in index.iter().skip(usize::try_from(offset).unwrap_or(usize::MAX)) {
        let (Some(sb), Some(m)) = (ik.get(p.len()..p.len() + 8), ik.get(p.len() + 8..)) else {
            return Err(Reply::err("corrupt sorted-set index record"));
        };
        let mut b = [0u8; 8];
        b.copy_from_slice(sb);
        let score = keys::unsortable(u64::from_be_bytes(b));
        let m = Reply::Bulk(m.to_vec());
        match (withscores, proto >= 3) {
            (false, _) => out.push(m),
            (true, true) => out.push(Reply::Array(vec![m, Reply::Double(score)])),
            (true, false) => {
                out.push(m);
                out.push(Reply::Bulk(format_score(score).into_bytes()));
            }
        }
        if limit > 0 && out.len() as i64 >= limit * if withscores && proto < 3 { 2 } else { 1 } {
            break;
        }
    }
    Ok(Reply::Array(out))
}
