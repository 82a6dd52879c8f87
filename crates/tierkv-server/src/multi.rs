//! MULTI / EXEC / DISCARD / WATCH / UNWATCH, with Redis's semantics and one atomic batch.
//!
//! - After MULTI, commands are checked (name, arity, authentication) and queued
//!   (`+QUEUED`); one refused while queuing makes EXEC reply `-EXECABORT` and run nothing.
//!   FLUSHDB, EVAL/EVALSHA and SCRIPT are refused inside MULTI (tierkv runs each of them under
//!   its own exclusive lock); Redis would queue them.
//! - EXEC takes the global lock exclusively, so no other client's command runs in between
//!   (Redis's isolation), then runs the queued commands in order against one [`Changes`]
//!   overlay, each seeing the effects of the earlier ones. A command that fails at run time
//!   (WRONGTYPE, not an integer...) gets its error in EXEC's reply and changes nothing; the
//!   others go on (Redis has no rollback either). The writes of all of them are committed
//!   as ONE [`tierkv::WriteBatch`]: after a crash the whole transaction is there or none of it
//!   (stronger than Redis's AOF, which can leave a partial transaction that redis-check-aof
//!   must cut). Every read sees the transaction's own earlier writes, KEYS, SCAN and DBSIZE
//!   too (they merge its staged records into their walk of the store).
//! - WATCH is optimistic: every key watched by anyone has a version in a server map, bumped
//!   by every committed write to that key (including deletions by the expiry sweep and
//!   FLUSHDB). EXEC compares the versions recorded at WATCH time and replies nil (RESP2
//!   `*-1`, RESP3 `_`) if any changed — or if a key that was live at WATCH time has expired
//!   since (Redis 7). Deleting an expired key is not a change (Redis 7): a key live at WATCH
//!   time fails EXEC by its deadline anyway, and one already expired then stays absent. The
//!   map holds only watched keys: writes pay one atomic load when nobody watches.

use std::sync::atomic::Ordering;

use bytes::Bytes;

use crate::cmd::{Keyspace, Session, Watched, R};
use crate::resp::Reply;
use crate::txn::{now_ms, Changes, Txn};

impl Keyspace {
    pub(crate) fn multi_cmd(&self, s: &mut Session, name: &str, a: &[Bytes]) -> R {
        match name {
            "multi" => {
                if s.multi.is_some() {
                    return Err(Reply::err("MULTI calls can not be nested"));
                }
                s.multi = Some(Vec::new());
                s.multi_dirty = false;
                s.multi_bytes = 0;
                Ok(Reply::Ok)
            }
            "discard" => {
                if s.multi.take().is_none() {
                    return Err(Reply::err("DISCARD without MULTI"));
                }
                s.multi_dirty = false;
                self.unwatch_all(s);
                Ok(Reply::Ok)
            }
            "watch" => {
                if s.multi.is_some() {
                    return Err(Reply::err("WATCH inside MULTI is not allowed"));
                }
                self.watch(s, a)?;
                Ok(Reply::Ok)
            }
            "unwatch" => {
                self.unwatch_all(s);
                Ok(Reply::Ok)
            }
            _ => self.exec_multi(s),
        }
    }

    fn watch(&self, s: &mut Session, keys: &[Bytes]) -> Result<(), Reply> {
        let _g = self.global.read();
        let t = Txn::new(self, now_ms());
        for k in keys {
            if s.watched.iter().any(|w| w.key == k[..]) {
                continue;
            }
            let version = {
                let mut w = self.watches.lock();
                let e = w.entry(k.to_vec()).or_insert((0, 0));
                e.1 += 1;
                self.watching.fetch_add(1, Ordering::SeqCst);
                e.0
            };
            let deadline = if t.exists(k)? { t.deadline(k) } else { None };
            s.watched.push(Watched { key: k.to_vec(), version, deadline });
        }
        Ok(())
    }

    /// Forget every key `s` watches (EXEC, DISCARD, UNWATCH, disconnect).
    pub fn unwatch_all(&self, s: &mut Session) {
        if s.watched.is_empty() {
            return;
        }
        let mut w = self.watches.lock();
        for x in s.watched.drain(..) {
            if let Some(e) = w.get_mut(&x.key) {
                e.1 -= 1;
                if e.1 == 0 {
                    w.remove(&x.key);
                }
            }
            self.watching.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn exec_multi(&self, s: &mut Session) -> R {
        let Some(queue) = s.multi.take() else {
            return Err(Reply::err("EXEC without MULTI"));
        };
        if std::mem::take(&mut s.multi_dirty) {
            self.unwatch_all(s);
            return Err(Reply::Error("EXECABORT Transaction discarded because of previous errors.".into()));
        }
        let g = self.global.write();
        let now = now_ms();
        let changed = {
            let w = self.watches.lock();
            s.watched
                .iter()
                .any(|x| w.get(&x.key).map(|e| e.0) != Some(x.version) || x.deadline.is_some_and(|d| d <= now))
        };
        if changed {
            drop(g);
            self.unwatch_all(s);
            return Ok(Reply::NilArray);
        }
        let mut acc = Changes::default();
        let mut replies = Vec::with_capacity(queue.len());
        for cmd in &queue {
            replies.push(self.exec_in(s, &mut acc, now, cmd));
        }
        let committed = Txn::exclusive(self, acc, now).commit();
        drop(g);
        self.unwatch_all(s);
        committed?;
        Ok(Reply::Array(replies))
    }
}
