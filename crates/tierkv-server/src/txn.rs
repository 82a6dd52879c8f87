//! Staged changes: every command, every `EXEC` and every script writes through a [`Txn`].
//!
//! A `Txn` collects a command's writes (stored keys → new value or deletion) and its changes
//! to the two DRAM directories (types of hashes and sorted sets; expiry times) without
//! touching the store, and reads through them, so a later read of the same command — or of a
//! later command of the same `EXEC` — sees them. [`Txn::commit`] turns them into one
//! [`tierkv::WriteBatch`] (all or nothing after a crash, durable when it returns), then
//! mirrors the directory changes and bumps the `WATCH` versions of the keys touched, all
//! while the command still holds its key locks. A command that fails leaves nothing behind:
//! its `Txn` is dropped unapplied.
//!
//! # Locks
//! A single command locks the stripes of the keys it writes ([`Txn::lock_keys`], once, in
//! stripe order) under the global lock taken shared; `EXEC`, scripts and `FLUSHDB` take the
//! global lock exclusively and need no stripes (`exclusive`). Locking a key also reaps it if
//! it has expired (Redis's `expireIfNeeded`), so a writer never sees an expired key.
//!
//! # Readers of expiring strings
//! A string without expiry is read without a lock (one store read, as before expiry
//! existed). A string with one lives under another stored key, and moving it between the two
//! places (EXPIRE, PERSIST, SET) is one batch followed by the directory update; a reader
//! that finds no plain record, or finds an expiry, therefore re-reads under the key's stripe
//! lock, where store and directory agree.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::MutexGuard;
use tierkv::WriteBatch;

use crate::cmd::{db_err, Keyspace};
use crate::keys::{self, Kind};
use crate::resp::Reply;

/// A stored (key, value) pair.
pub type Entry = (Vec<u8>, Vec<u8>);

/// Stored records staged by a transaction, in key order (`None`: deleted).
pub type Overlay = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

/// Wall-clock time in Unix milliseconds (expiry times are absolute, as Redis's).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The expiry directory: every key with an expiry, by key and by time (for the sweep).
#[derive(Debug, Default)]
pub struct Expires {
    by_key: HashMap<Vec<u8>, u64>,
    by_time: BTreeSet<(u64, Vec<u8>)>,
}

impl Expires {
    /// The expiry time of `k` (Unix ms).
    pub fn get(&self, k: &[u8]) -> Option<u64> {
        self.by_key.get(k).copied()
    }

    /// Set or clear the expiry time of `k`.
    pub fn set(&mut self, k: &[u8], at: Option<u64>) {
        if let Some(old) = self.by_key.remove(k) {
            self.by_time.remove(&(old, k.to_vec()));
        }
        if let Some(t) = at {
            self.by_key.insert(k.to_vec(), t);
            self.by_time.insert((t, k.to_vec()));
        }
    }

    /// Up to `max` keys whose time is at or before `now`, earliest first.
    pub fn due(&self, now: u64, max: usize) -> Vec<Vec<u8>> {
        self.by_time.iter().take_while(|(t, _)| *t <= now).take(max).map(|(_, k)| k.clone()).collect()
    }

    /// Keys with an expiry, and the mean remaining time (ms) of those not yet due.
    pub fn stats(&self, now: u64) -> (usize, u64) {
        let live: Vec<u64> = self.by_time.iter().filter(|(t, _)| *t > now).map(|(t, _)| t - now).collect();
        let avg = if live.is_empty() { 0 } else { live.iter().sum::<u64>() / live.len() as u64 };
        (self.by_key.len(), avg)
    }

    /// Forget everything (FLUSHDB).
    pub fn clear(&mut self) {
        self.by_key.clear();
        self.by_time.clear();
    }
}

/// Changes staged by a command or a transaction.
#[derive(Debug, Default)]
pub struct Changes {
    /// Stored key → new value (`None`: deleted).
    pub writes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    /// Logical key → new type entry (`None`: no longer a hash or sorted set).
    pub types: HashMap<Vec<u8>, Option<(Kind, u64)>>,
    /// Logical key → new expiry (`None`: none).
    pub expires: HashMap<Vec<u8>, Option<u64>>,
    /// Logical keys modified (for WATCH).
    pub touched: Vec<Vec<u8>>,
    /// Expired keys deleted (INFO's `expired_keys`).
    pub reaped: u64,
}

impl Changes {
    /// Add `later`'s changes on top of these.
    pub fn merge(&mut self, later: Changes) {
        self.writes.extend(later.writes);
        self.types.extend(later.types);
        self.expires.extend(later.expires);
        self.touched.extend(later.touched);
        self.reaped += later.reaped;
    }
}

/// How a string write treats the key's expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ttl {
    /// Keep the current one (KEEPTTL, INCR, APPEND).
    Keep,
    /// Remove it (plain SET, GETSET, MSET).
    Clear,
    /// Set this absolute time (Unix ms).
    At(u64),
}

/// A command's (or transaction's) view: the store plus staged changes.
pub struct Txn<'a> {
    ks: &'a Keyspace,
    base: Option<&'a Changes>,
    c: Changes,
    exclusive: bool,
    guards: Vec<MutexGuard<'a, ()>>,
    held: Vec<usize>,
    /// The command's time (Unix ms): one clock reading for a whole command or transaction.
    pub now: u64,
}

impl std::fmt::Debug for Txn<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Txn").field("exclusive", &self.exclusive).field("writes", &self.c.writes.len()).finish()
    }
}

fn corrupt(what: &str, k: &[u8]) -> Reply {
    Reply::err(format!("corrupt stored {what} for key '{}'", tierkv::escape(k)))
}

impl<'a> Txn<'a> {
    /// A command's `Txn` (global lock shared: takes stripe locks).
    pub fn new(ks: &'a Keyspace, now: u64) -> Txn<'a> {
        Txn { ks, base: None, c: Changes::default(), exclusive: false, guards: Vec::new(), held: Vec::new(), now }
    }

    /// A `Txn` over `base` (staged by earlier commands of the same transaction) while the
    /// global lock is held exclusively.
    pub fn layered(ks: &'a Keyspace, base: &'a Changes, now: u64) -> Txn<'a> {
        Txn { ks, base: Some(base), c: Changes::default(), exclusive: true, guards: Vec::new(), held: Vec::new(), now }
    }

    /// A `Txn` holding `c` (a whole transaction), to commit it.
    pub fn exclusive(ks: &'a Keyspace, c: Changes, now: u64) -> Txn<'a> {
        Txn { ks, base: None, c, exclusive: true, guards: Vec::new(), held: Vec::new(), now }
    }

    /// Expired keys this `Txn` deleted so far.
    pub fn reaped(&self) -> u64 {
        self.c.reaped
    }

    /// The staged changes, unapplied.
    pub fn into_changes(self) -> Changes {
        self.c
    }

    /// Lock the stripes of `ks` (once per command) and reap those that have expired.
    pub fn lock_keys<'k>(&mut self, keys: impl IntoIterator<Item = &'k [u8]>) -> Result<(), Reply> {
        let keys: Vec<&[u8]> = keys.into_iter().collect();
        if !self.exclusive {
            let mut idx: Vec<usize> = keys.iter().map(|k| Keyspace::stripe(k)).collect();
            idx.sort_unstable();
            idx.dedup();
            for &i in &idx {
                self.guards.push(self.ks.stripe_lock_at(i));
            }
            self.held = idx;
        }
        for k in keys {
            self.reap(k)?;
        }
        Ok(())
    }

    fn holds(&self, k: &[u8]) -> bool {
        self.exclusive || self.held.contains(&Keyspace::stripe(k))
    }

    /// Delete `k` if it has expired. Not a change for WATCH (as in Redis 7): a key live
    /// when watched fails EXEC by its deadline already, and one already expired then was
    /// absent then and stays absent.
    pub fn reap(&mut self, k: &[u8]) -> Result<bool, Reply> {
        if !self.expired(k) {
            return Ok(false);
        }
        self.remove_key(k, false)?;
        self.c.reaped += 1;
        Ok(true)
    }

    /// A stored record, as staged.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, Reply> {
        if let Some(v) = self.c.writes.get(key) {
            return Ok(v.clone());
        }
        if let Some(v) = self.base.and_then(|b| b.writes.get(key)) {
            return Ok(v.clone());
        }
        self.ks.db().get(key).map_err(db_err)
    }

    /// Stage a put.
    pub fn put(&mut self, key: impl Into<Vec<u8>>, v: impl Into<Vec<u8>>) {
        self.c.writes.insert(key.into(), Some(v.into()));
    }

    /// Stage a delete.
    pub fn delete(&mut self, key: impl Into<Vec<u8>>) {
        self.c.writes.insert(key.into(), None);
    }

    /// Every stored record whose key starts with `prefix`, as staged, in key order.
    pub fn scan_prefix(&self, prefix: &[u8]) -> Result<Vec<Entry>, Reply> {
        let end = keys::prefix_end(prefix);
        let hi = end.as_deref().map_or(Bound::Unbounded, Bound::Excluded);
        let mut out: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        for e in self.ks.db().scan::<(Bound<&[u8]>, Bound<&[u8]>)>((Bound::Included(prefix), hi)).map_err(db_err)? {
            let (k, v) = e.map_err(db_err)?;
            out.insert(k, v);
        }
        for layer in [self.base.map(|b| &b.writes), Some(&self.c.writes)].into_iter().flatten() {
            for (k, v) in layer.range::<[u8], _>((Bound::Included(prefix), hi)) {
                match v {
                    Some(v) => out.insert(k.clone(), v.clone()),
                    None => out.remove(k),
                };
            }
        }
        Ok(out.into_iter().collect())
    }

    /// Whether this `Txn` (or its base) staged a write under `prefix`.
    pub fn staged_under(&self, prefix: &[u8]) -> bool {
        let end = keys::prefix_end(prefix);
        let hi = end.as_deref().map_or(Bound::Unbounded, Bound::Excluded);
        [self.base.map(|b| &b.writes), Some(&self.c.writes)]
            .into_iter()
            .flatten()
            .any(|w| w.range::<[u8], _>((Bound::Included(prefix), hi)).next().is_some())
    }

    /// Every stored record this `Txn` and its base would write, type records included as
    /// commit writes them: what KEYS, SCAN and DBSIZE read on top of the store inside EXEC
    /// or a script. Empty for a command on its own (it has staged nothing when it reads).
    pub fn overlay(&self) -> Overlay {
        let layers = [self.base, Some(&self.c)];
        let mut o = Overlay::new();
        let mut names = BTreeSet::new();
        for l in layers.into_iter().flatten() {
            o.extend(l.writes.iter().map(|(k, v)| (k.clone(), v.clone())));
            names.extend(l.types.keys().chain(l.expires.keys()));
        }
        for k in names {
            match self.kind_raw(k) {
                Some((kind, count)) => {
                    o.insert(keys::type_key(k), Some(keys::encode_type(kind, count, self.deadline(k))));
                }
                None if layers.into_iter().flatten().any(|l| l.types.contains_key(k)) => {
                    o.insert(keys::type_key(k), None);
                }
                None => {}
            }
        }
        o
    }

    /// The store (for range scans that need no staged view).
    pub fn ks_db(&self) -> &tierkv::Db {
        self.ks.db()
    }

    /// A hash or sorted set emptied by this command loses its expiry with it.
    pub fn set_expiry_of_removed(&mut self, k: &[u8]) {
        if self.deadline(k).is_some() {
            self.set_deadline(k, None);
        }
    }

    /// The type entry of `k`, expired or not.
    pub fn kind_raw(&self, k: &[u8]) -> Option<(Kind, u64)> {
        if let Some(t) = self.c.types.get(k) {
            return *t;
        }
        if let Some(t) = self.base.and_then(|b| b.types.get(k)) {
            return *t;
        }
        self.ks.types.read().get(k).copied()
    }

    /// The type entry of `k` if it is a live hash or sorted set.
    pub fn kind(&self, k: &[u8]) -> Option<(Kind, u64)> {
        if self.expired(k) {
            return None;
        }
        self.kind_raw(k)
    }

    /// The expiry time of `k` (Unix ms), expired or not.
    pub fn deadline(&self, k: &[u8]) -> Option<u64> {
        if let Some(t) = self.c.expires.get(k) {
            return *t;
        }
        if let Some(t) = self.base.and_then(|b| b.expires.get(k)) {
            return *t;
        }
        self.ks.expires.read().get(k)
    }

    /// Whether `k` has an expiry that has passed.
    pub fn expired(&self, k: &[u8]) -> bool {
        self.deadline(k).is_some_and(|d| d <= self.now)
    }

    /// Record `k`'s new type entry (the type record is written at commit).
    pub fn set_kind(&mut self, k: &[u8], v: Option<(Kind, u64)>) {
        self.c.types.insert(k.to_vec(), v);
        self.touch(k);
    }

    /// Record that `k` was modified (WATCH).
    pub fn touch(&mut self, k: &[u8]) {
        self.c.touched.push(k.to_vec());
    }

    /// The value of string `k` if it is a live string (`None` also for other types).
    pub fn read_string(&self, k: &[u8]) -> Result<Option<Vec<u8>>, Reply> {
        if self.holds(k) {
            return self.read_string_locked(k);
        }
        if self.deadline(k).is_none() {
            if let Some(v) = self.get(&keys::string_key(k))? {
                return Ok(Some(v));
            }
        }
        let _g = self.ks.stripe_lock_at(Keyspace::stripe(k));
        self.read_string_locked(k)
    }

    fn read_string_locked(&self, k: &[u8]) -> Result<Option<Vec<u8>>, Reply> {
        match self.deadline(k) {
            Some(d) if d <= self.now => Ok(None),
            Some(_) => match self.get(&keys::expiring_key(k))? {
                Some(rec) => {
                    Ok(Some(keys::decode_expiring(&rec).ok_or_else(|| corrupt("expiring string", k))?.1.to_vec()))
                }
                None => Ok(None),
            },
            None => self.get(&keys::string_key(k)),
        }
    }

    /// Whether `k` is a live key of any type.
    pub fn exists(&self, k: &[u8]) -> Result<bool, Reply> {
        Ok(self.kind(k).is_some() || self.read_string(k)?.is_some())
    }

    /// Stage the deletion of hash or sorted set `k` and all its records.
    fn delete_collection(&mut self, k: &[u8], kind: Kind) -> Result<(), Reply> {
        let prefixes = match kind {
            Kind::Hash => vec![keys::hash_prefix(k)],
            Kind::Zset => vec![keys::zmember_prefix(k), keys::zscore_prefix(k)],
        };
        for p in prefixes {
            for (key, _) in self.scan_prefix(&p)? {
                self.delete(key);
            }
        }
        // Not `set_kind`: the caller says whether this is a change for WATCH.
        self.c.types.insert(k.to_vec(), None);
        Ok(())
    }

    /// Stage the deletion of `k`, whatever it is (expired or not); `false` if there was
    /// nothing.
    pub fn delete_key(&mut self, k: &[u8]) -> Result<bool, Reply> {
        self.remove_key(k, true)
    }

    fn remove_key(&mut self, k: &[u8], touch: bool) -> Result<bool, Reply> {
        let found = if let Some((kind, _)) = self.kind_raw(k) {
            self.delete_collection(k, kind)?;
            true
        } else if self.deadline(k).is_some() {
            self.delete(keys::expiring_key(k));
            true
        } else {
            let sk = keys::string_key(k);
            let found = self.get(&sk)?.is_some();
            if found {
                self.delete(sk.into_owned());
            }
            found
        };
        self.set_deadline(k, None);
        if found && touch {
            self.touch(k);
        }
        Ok(found)
    }

    /// Stage string `k` = `v` (replacing any other type), with its expiry as `ttl` says.
    pub fn write_string(&mut self, k: &[u8], v: &[u8], ttl: Ttl) -> Result<(), Reply> {
        if let Some((kind, _)) = self.kind_raw(k) {
            self.delete_collection(k, kind)?;
            self.set_deadline(k, None);
        }
        let cur = self.deadline(k);
        let new = match ttl {
            Ttl::Keep => cur,
            Ttl::Clear => None,
            Ttl::At(t) => Some(t),
        };
        match (cur, new) {
            (None, Some(t)) => {
                let sk = keys::string_key(k);
                if self.get(&sk)?.is_some() {
                    self.delete(sk.into_owned());
                }
                self.put(keys::expiring_key(k), keys::encode_expiring(t, v));
            }
            (Some(_), Some(t)) => self.put(keys::expiring_key(k), keys::encode_expiring(t, v)),
            (Some(_), None) => {
                self.delete(keys::expiring_key(k));
                self.put(keys::string_key(k).into_owned(), v);
            }
            (None, None) => self.put(keys::string_key(k).into_owned(), v),
        }
        if new != cur {
            self.set_deadline(k, new);
        }
        self.touch(k);
        Ok(())
    }

    /// Set or clear the expiry of live key `k` (a string moves between its two places; a
    /// hash or sorted set gets its type record rewritten at commit).
    pub fn set_expiry(&mut self, k: &[u8], at: Option<u64>) -> Result<(), Reply> {
        if self.kind_raw(k).is_some() {
            self.set_deadline(k, at);
            self.touch(k);
            return Ok(());
        }
        if let Some(v) = self.read_string_locked(k)? {
            self.write_string(k, &v, at.map_or(Ttl::Clear, Ttl::At))?;
        }
        Ok(())
    }

    fn set_deadline(&mut self, k: &[u8], at: Option<u64>) {
        self.c.expires.insert(k.to_vec(), at);
    }

    /// Write the type records of hashes and sorted sets whose count or expiry changed.
    fn finalize(&mut self) {
        let mut ks: Vec<Vec<u8>> = self.c.types.keys().cloned().collect();
        ks.extend(self.c.expires.keys().filter(|k| !self.c.types.contains_key(*k)).cloned());
        for k in ks {
            match self.kind_raw(&k) {
                Some((kind, count)) => {
                    let v = keys::encode_type(kind, count, self.deadline(&k));
                    self.put(keys::type_key(&k), v);
                }
                None if self.c.types.contains_key(&k) => self.delete(keys::type_key(&k)),
                None => {}
            }
        }
    }

    /// Apply everything staged: one atomic, durable write, then the directories and WATCH
    /// versions; the key locks are released afterwards.
    pub fn commit(mut self) -> Result<(), Reply> {
        self.finalize();
        let Txn { ks, c, guards, .. } = self;
        ks.apply(c)?;
        drop(guards);
        Ok(())
    }

    /// Turn staged writes into a batch (used by [`Keyspace::apply`]).
    pub fn batch(writes: BTreeMap<Vec<u8>, Option<Vec<u8>>>) -> WriteBatch {
        let mut b = WriteBatch::new();
        for (k, v) in writes {
            match v {
                Some(v) => b.put(k, v),
                None => b.delete(k),
            };
        }
        b
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn expiry_directory_orders_by_time_and_replaces() {
        let mut e = Expires::default();
        e.set(b"a", Some(30));
        e.set(b"b", Some(10));
        e.set(b"c", Some(20));
        e.set(b"a", Some(5)); // replaces 30
        e.set(b"c", None);
        assert_eq!(e.get(b"a"), Some(5));
        assert_eq!(e.get(b"c"), None);
        assert_eq!(e.due(10, 10), vec![b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(e.due(10, 1), vec![b"a".to_vec()]);
        assert_eq!(e.due(4, 10), Vec::<Vec<u8>>::new());
        assert_eq!(e.stats(0), (2, 7));
        e.clear();
        assert_eq!(e.due(u64::MAX, 10).len(), 0);
    }

    #[test]
    fn later_changes_win_when_merged() {
        let mut a = Changes::default();
        a.writes.insert(b"k".to_vec(), Some(b"1".to_vec()));
        a.expires.insert(b"k".to_vec(), Some(9));
        a.reaped = 1;
        let mut b = Changes::default();
        b.writes.insert(b"k".to_vec(), None);
        b.expires.insert(b"k".to_vec(), None);
        b.touched.push(b"k".to_vec());
        b.reaped = 2;
        a.merge(b);
        assert_eq!(a.writes.get(&b"k"[..]), Some(&None));
        assert_eq!(a.expires.get(&b"k"[..]), Some(&None));
        assert_eq!((a.touched.len(), a.reaped), (1, 3));
        let batch = Txn::batch(a.writes);
        assert_eq!(batch.len(), 1);
    }
}
