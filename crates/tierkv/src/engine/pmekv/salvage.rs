//! Salvage of a `pmekv` store for `tierkv repair` ([`crate::repair`]).
//!
//! A PMEKV store lives entirely in PM (no files besides `OPTIONS`). Its acknowledged state
//! is *the KeyNodes of the newest valid checkpoint (sequence number `S`) plus every committed
//! operation with a sequence number above `S`* — exactly what recovery rebuilds
//! (`recovery.rs`). The walk reads that state read-only, trusting nothing it cannot verify,
//! and hands it to the [`SalvageSink`]:
//!
//! 1. **Pools.** The region is opened through [`crate::engine::open_region`] (which maps the
//!    pools and writes nothing for an existing store). If that fails — a damaged pool
//!    header, a pool of the wrong size, an unknown store id — the pools are copied raw
//!    instead (pool files under the PM path, or the simulator's images) and each pool
//!    header is checked here: a damaged header is reported and the pool read anyway; a pool
//!    whose intact header names another position or store is reported and not read.
//! 2. **Superblock.** When it fails its checks it is reported and the log geometry is taken
//!    from its fields if they are self-consistent, else from the options.
//! 3. **Checkpoint.** The valid slot with the larger generation wins, as at open. A slot
//!    that is not blank yet fails its checksum (torn by a crash, or damaged) is reported:
//!    if it was the newer one, the walk starts from the older checkpoint and replays every
//!    log entry above *its* sequence number, which still yields the newer state wherever
//!    the logs hold it (the flags a newer checkpoint cleared are ignored, see 5.), and every
//!    operation the logs no longer hold shows as a reported gap.
//! 4. **Directory and KeyNodes.** Every entry of every KeyNode the checkpoint's directory
//!    names is reported with order `S`, its value read from the heap and verified (the value
//!    checksum covers the key, so a pointer into reused space never passes). A value that
//!    fails is reported lost *with its key*. A directory or KeyNode that fails its checksum
//!    is reported lost (without a key: its keys are not trustworthy) and then read
//!    leniently: an entry is kept only when its value record verifies with its key — a
//!    (key, value) pair nobody but the writer of that key can have produced. In a damaged
//!    KeyNode every byte position is tried as the start of an entry (a damaged key length
//!    hides nothing after it); for an entry of a damaged directory the KeyNode's own length
//!    field, which its checksum covers, says how much to read. A key found
//!    twice with different values (possible only through a damaged directory) is reported
//!    lost with its key and kept from neither.
//! 5. **Logs.** Both rings are scanned with the scan recovery uses (every 64-byte line,
//!    checksums verified); entries at or below `S` are already in the KeyNodes and are
//!    ignored (they are the stale entries that would resurrect overwritten or deleted keys).
//!    Flag words are not covered by checksums and are ignored too: a sequence number above
//!    `S` is what makes an entry live. Entries are grouped into batches (base = seq − index).
//!    A batch is committed when a key-log entry of it exists (key-log entries are written
//!    only after the commit fence), when all its key-value-log entries are present and
//!    their values verify (the commit rule of recovery), or when it is not the newest batch
//!    (the next write starts only after this one committed). The newest batch, when not
//!    committed, is a write torn by a crash and is dropped silently, as at open. Every
//!    operation of a committed batch is reported with order = its sequence number (deletes
//!    as `None`); a value that fails is reported lost with its key. An older batch found in
//!    the key-value log only is kept but also reported lost with its keys: its key-log
//!    entries are damaged, or (described below) it is an entry whose flag word did not land, which recovery dropped as torn without covering it by a
//!    checkpoint. Sequence numbers run without a gap above `S` in a healthy store, so each
//!    missing run up to the newest batch is reported lost (the keys of those operations are
//!    unknown).
//!
//! Ignoring flag words makes one deliberate difference from open: the newest operation,
//! in flight at a crash, whose key-value-log entries all landed but without their flag
//! words, is kept by salvage and dropped by recovery. Either is a legal outcome of an
//! unacknowledged write; a damaged (uncovered) flag word cannot make salvage drop an
//! acknowledged one. Recovery, on the other hand, moves its next sequence number above
//! such an entry without writing a checkpoint over it, so after more writes and another
//! crash it refuses to open (a "missing" sequence number): salvage reports that entry with
//! its key, as above.
//!
//! **Order.** [`Order`] is the sequence number: `S` for KeyNode entries, the entry's own
//! sequence number (> `S`) for log entries. Sequence numbers are never reused (recovery
//! continues above the largest one it finds in either log), so equal orders carry equal
//! content.
//!
//! **What cannot be recovered.** The keys of a KeyNode entry, directory entry or log entry
//! whose bytes are damaged (reported without a key); a value whose record is damaged
//! (reported with its key; the key comes back with the KeyNodes' version when the damaged
//! value was a logged one, else it disappears: no older version can be found safely);
//! with no valid checkpoint at all, the KeyNodes (reported; only log entries are salvaged,
//! which may include versions the lost checkpoint superseded). Damage confined to the
//! entries of the very last operation cannot be told from a write torn by a crash, as at
//! open: that operation is dropped without a report. Stale records in freed heap space
//! and old log entries are never read as data — except that a damaged directory entry may
//! happen to name a stale KeyNode that still verifies (the directory is then reported
//! lost without a key, which covers any key it brings back).

use std::collections::{BTreeMap, BTreeSet};

use super::layout::{self, Checkpoint, LogEntry, LogKind, Op, Superblock, ValueRef, CKPT_SLOT_ADDR, SUPERBLOCK_ADDR};
use super::log::scan_bytes;
use crate::engine::media::{open_media, Media};
use crate::engine::EngineCtx;
use crate::error::Result;
use crate::format::{align_up, Cursor};
use crate::pm::LINE;
use crate::repair::{Lost, Order, SalvageSink};

/// Walk the store read-only and report every intact record and every damaged one.
pub(crate) fn salvage(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Result<()> {
    let media = open_media(ctx, sink)?;
    let mut w = Walk { m: &media, sink };
    let sb = w.superblock(ctx);
    let ckpt = w.checkpoint();
    let base = ckpt.map_or(0, |c| c.seq);
    if let Some(c) = &ckpt {
        w.keynodes(c, &sb);
    }
    w.logs(&sb, base);
    Ok(())
}

/// A log entry found above the checkpoint, with the outcome of its value check.
#[derive(Debug, Clone)]
struct Found {
    e: LogEntry,
    /// Where the entry lies.
    addr: u64,
    /// Found in the key log (written only after its batch committed).
    key_log: bool,
    /// `Ok(None)` for a delete, `Ok(Some(v))` for a verified value, `Err` for a value that
    /// fails.
    value: std::result::Result<Option<Vec<u8>>, String>,
}

/// What to do with the log entries above the checkpoint.
#[derive(Debug, Default, PartialEq, Eq)]
struct LogPlan {
    /// Sequence numbers of committed operations, to report (as records, or as lost when
    /// their value fails).
    committed: Vec<u64>,
    /// Runs of sequence numbers with no intact entry in either log, though an acknowledged
    /// operation had each.
    missing: Vec<(u64, u64)>,
    /// Committed operations found in the key-value log only although later operations
    /// exist (their key-log entries are damaged — or, in a store written by a version
    /// whose recovery dropped a flag-less entry without a checkpoint, never acknowledged):
    /// kept, and reported with their keys.
    kv_only: Vec<u64>,
    /// The newest batch when it is not committed (a write torn by a crash): base, entries
    /// present.
    torn: Option<(u64, usize)>,
}

/// Decide which entries above checkpoint `base` are committed (module docs, step 5).
fn plan(found: &BTreeMap<u64, Found>, base: u64) -> LogPlan {
    struct Batch {
        len: u64,
        seqs: Vec<u64>,
        key_log: bool,
        values_ok: bool,
    }
    let mut batches: BTreeMap<u64, Batch> = BTreeMap::new();
    let mut newest: Option<u64> = None;
    for (&seq, f) in found {
        let Some(b) = seq.checked_sub(u64::from(f.e.batch_index)) else {
            continue;
        };
        newest = Some(b);
        let batch = batches.entry(b).or_insert(Batch {
            len: u64::from(f.e.batch_len),
            seqs: Vec::new(),
            key_log: false,
            values_ok: true,
        });
        batch.len = batch.len.max(u64::from(f.e.batch_len));
        batch.seqs.push(seq);
        batch.key_log |= f.key_log;
        batch.values_ok &= f.value.is_ok();
    }
    let mut out = LogPlan::default();
    let Some(newest) = newest else {
        return out;
    };
    // Every operation up to the one before the newest batch must be present.
    let mut expect_to = newest.saturating_sub(1);
    for (&b, batch) in &batches {
        let complete = batch.seqs.len() as u64 == batch.len && batch.values_ok;
        if batch.key_log || complete || b != newest {
            out.committed.extend(&batch.seqs);
            if !batch.key_log && b != newest {
                out.kv_only.extend(&batch.seqs);
            }
            expect_to = expect_to.max(b.saturating_add(batch.len).saturating_sub(1));
        } else {
            out.torn = Some((b, batch.seqs.len()));
        }
    }
    out.committed.sort_unstable();
    out.kv_only.sort_unstable();
    let mut next = base.saturating_add(1);
    for &s in out.committed.iter().chain(std::iter::once(&expect_to.saturating_add(1))) {
        if s > next {
            out.missing.push((next, s - 1));
        }
        next = next.max(s.saturating_add(1));
    }
    out
}

/// A KeyNode entry on its way to the sink.
#[derive(Debug)]
struct KnEntry {
    v: ValueRef,
    /// The KeyNode holding it.
    kn: u64,
    value: std::result::Result<Vec<u8>, String>,
}

struct Walk<'a> {
    m: &'a Media,
    sink: &'a mut dyn SalvageSink,
}

impl Walk<'_> {
    fn lost(&mut self, addr: u64, key: Option<&[u8]>, detail: impl Into<String>) {
        let (file, offset) = self.m.locate(addr);
        self.sink.lost(Lost { file, offset, key: key.map(<[u8]>::to_vec), detail: detail.into() });
    }

    /// The value record `v` of `key`, verified.
    fn value(&self, key: &[u8], v: ValueRef) -> std::result::Result<Vec<u8>, String> {
        let rec =
            usize::try_from(layout::VALUE_HEADER + u64::from(v.len))
                .ok()
                .and_then(|n| self.m.slice(v.addr, n))
                .ok_or_else(|| format!("value record of {} bytes at {:#x} lies outside the PM pools", v.len, v.addr))?;
        layout::value_verify(rec, key, v.len).map(<[u8]>::to_vec)
    }

    /// The superblock, or (reported) a best guess at the geometry.
    fn superblock(&mut self, ctx: &EngineCtx) -> Superblock {
        let raw = self.m.slice(SUPERBLOCK_ADDR, 64);
        let why = match raw.map(Superblock::decode) {
            Some(Ok(sb)) => return sb,
            Some(Err(d)) => d,
            None => "superblock lies outside pool 0".into(),
        };
        let (sb, from) = match raw.and_then(unverified_geometry) {
            Some(sb) => (sb, "its own (self-consistent) fields"),
            None => {
                let o = &ctx.opts.pmekv;
                (Superblock::new(o.kv_log_size, o.key_log_size), "the options")
            }
        };
        self.lost(
            SUPERBLOCK_ADDR,
            None,
            format!(
                "{why}; log geometry taken from {from}: key-value log {} bytes, key log {} bytes",
                sb.kv_log.1, sb.key_log.1
            ),
        );
        sb
    }

    /// The valid checkpoint with the larger generation; damaged slots are reported.
    fn checkpoint(&mut self) -> Option<Checkpoint> {
        let mut best: Option<Checkpoint> = None;
        let mut bad: Vec<(u64, &str)> = Vec::new();
        for addr in CKPT_SLOT_ADDR {
            match self.m.slice(addr, 64) {
                None => bad.push((addr, "lies outside pool 0")),
                Some(raw) => match Checkpoint::decode(raw) {
                    Some(c) => {
                        if best.is_none_or(|b| c.generation > b.generation) {
                            best = Some(c);
                        }
                    }
                    None if raw.iter().all(|b| *b == 0) => {}
                    None => bad.push((addr, "fails its checks (torn by a crash, or damaged)")),
                },
            }
        }
        let using = match &best {
            Some(c) => format!(
                "salvage starts from checkpoint generation {} (seq {}) and replays every log entry above it; \
                 operations the logs no longer hold are reported",
                c.generation, c.seq
            ),
            None => "no valid checkpoint remains".into(),
        };
        for (addr, why) in bad {
            self.lost(addr, None, format!("checkpoint slot {why}; {using}"));
        }
        if best.is_none() {
            self.lost(
                CKPT_SLOT_ADDR[0],
                None,
                "no valid checkpoint record: the KeyNodes (the bulk of the data) cannot be found; only log \
                 entries are salvaged, and they may include versions the lost checkpoint superseded",
            );
        }
        best
    }

    /// Report every entry of the checkpoint's KeyNodes (module docs, step 4).
    fn keynodes(&mut self, c: &Checkpoint, sb: &Superblock) {
        let order = Order::from(c.seq);
        let Some(raw) = usize::try_from(c.dir_bytes).ok().and_then(|n| self.m.slice(c.dir_addr, n)) else {
            self.lost(
                c.dir_addr,
                None,
                format!("KeyNode directory of {} bytes lies outside the PM pools: every KeyNode is lost", c.dir_bytes),
            );
            return;
        };
        let (kns, dir_ok) = match layout::dir_decode(raw, c.kn_count) {
            Ok(kns) => (kns, true),
            Err(d) => {
                let kns = dir_lenient(raw, c.kn_count);
                self.lost(
                    c.dir_addr,
                    None,
                    format!(
                        "KeyNode directory: {d}; its {} entries are used only where the KeyNode they name \
                         verifies, and a KeyNode entry only where its value verifies with its key",
                        kns.len()
                    ),
                );
                (kns, false)
            }
        };
        let mut all_ok = dir_ok;
        let mut entries: BTreeMap<Vec<u8>, Vec<KnEntry>> = BTreeMap::new();
        let mut total = 0u64;
        for (i, (addr, bytes)) in kns.into_iter().enumerate() {
            if !(dir_ok || addr.is_multiple_of(LINE) && addr >= sb.heap_start) {
                continue; // a damaged directory entry (the directory is reported)
            }
            let bytes = if dir_ok {
                u64::from(bytes)
            } else {
                // An unverified size: the KeyNode's own length field (under its checksum)
                // decides how much to read.
                addr.checked_add(12)
                    .and_then(|a| self.m.slice(a, 4))
                    .and_then(|b| Cursor::new(b).u32())
                    .map(|t| align_up(u64::from(t), LINE))
                    .filter(|n| *n >= LINE)
                    .unwrap_or(u64::from(bytes))
            };
            let Some(raw) = usize::try_from(bytes).ok().and_then(|n| self.m.slice(addr, n)) else {
                all_ok = false;
                self.lost(addr, None, format!("KeyNode {i} of {bytes} bytes lies outside the PM pools"));
                continue;
            };
            match layout::keynode_decode(raw) {
                Ok(list) => {
                    if list.is_empty() {
                        all_ok = false;
                        self.lost(addr, None, format!("KeyNode {i} is empty (checkpoints write no empty KeyNode)"));
                    }
                    total += list.len() as u64;
                    for (k, v) in list {
                        let value = self.value(&k, v);
                        entries.entry(k.into_vec()).or_default().push(KnEntry { v, kn: addr, value });
                    }
                }
                Err(d) => {
                    all_ok = false;
                    let heap_start = sb.heap_start;
                    let kept = keynode_scan(raw, |k, v| {
                        (v.addr.is_multiple_of(LINE) && v.addr >= heap_start).then(|| self.value(k, v).ok()).flatten()
                    });
                    let kept_keys: BTreeSet<Vec<u8>> = kept.iter().map(|(k, _, _)| k.clone()).collect();
                    let dropped: Vec<String> = keynode_lenient(raw)
                        .into_iter()
                        .filter(|(k, _)| !kept_keys.contains(k))
                        .map(|(k, _)| crate::escape(&k))
                        .collect();
                    let n = kept.len();
                    for (k, v, val) in kept {
                        entries.entry(k).or_default().push(KnEntry { v, kn: addr, value: Ok(val) });
                    }
                    let shown = dropped.iter().take(8).cloned().collect::<Vec<_>>().join(", ");
                    let more =
                        if dropped.len() > 8 { format!(" and {} more", dropped.len() - 8) } else { String::new() };
                    self.lost(
                        addr,
                        None,
                        format!(
                            "KeyNode {i}: {d}; kept the {n} entries whose values verify with their keys; dropped the \
                             others (keys as read, unverified: [{shown}]{more})"
                        ),
                    );
                }
            }
        }
        if all_ok && total != c.key_count {
            self.lost(c.dir_addr, None, format!("KeyNodes hold {total} keys, the checkpoint says {}", c.key_count));
        }
        for (k, list) in entries {
            let distinct: BTreeSet<(u64, u32)> = list.iter().map(|e| (e.v.addr, e.v.len)).collect();
            if distinct.len() > 1 {
                let kns: Vec<String> = list.iter().map(|e| format!("{:#x}", e.kn)).collect();
                self.lost(
                    list.first().map_or(c.dir_addr, |e| e.kn),
                    Some(&k),
                    format!(
                        "key is listed by several KeyNodes ({}) with different values; kept from none",
                        kns.join(", ")
                    ),
                );
                continue;
            }
            let Some(e) = list.into_iter().next() else {
                continue;
            };
            match e.value {
                Ok(v) => self.sink.record(&k, Some(&v), order),
                Err(d) => self.lost(e.v.addr, Some(&k), format!("value record (KeyNode at {:#x}): {d}", e.kn)),
            }
        }
    }

    /// Report every committed operation above checkpoint `base` (module docs, step 5).
    fn logs(&mut self, sb: &Superblock, base: u64) {
        let mut found: BTreeMap<u64, Found> = BTreeMap::new();
        for (kind, (start, len)) in [(LogKind::Key, sb.key_log), (LogKind::KeyValue, sb.kv_log)] {
            let Some(ring) = usize::try_from(len).ok().and_then(|n| self.m.slice(start, n)) else {
                self.lost(start, None, format!("{kind:?} log ring of {len} bytes lies outside pool 0: not read"));
                continue;
            };
            for (e, _flag, addr) in scan_bytes(kind, start, ring) {
                if e.seq <= base || e.batch_len == 0 || e.batch_index >= e.batch_len || found.contains_key(&e.seq) {
                    continue;
                }
                let value = match e.op {
                    Op::Delete => Ok(None),
                    Op::Insert | Op::Update => {
                        self.value(&e.key, ValueRef { addr: e.value_addr, len: e.value_len }).map(Some)
                    }
                };
                found.insert(e.seq, Found { key_log: kind == LogKind::Key, addr, e, value });
            }
        }
        let p = plan(&found, base);
        for seq in &p.committed {
            let Some(f) = found.get(seq) else {
                continue;
            };
            match &f.value {
                Ok(v) => self.sink.record(&f.e.key, v.as_deref(), Order::from(*seq)),
                Err(d) => {
                    let detail = format!("value of logged operation {seq} (entry at {:#x}): {d}", f.addr);
                    self.lost(f.e.value_addr, Some(&f.e.key), detail);
                }
            }
        }
        for seq in &p.kv_only {
            let Some(f) = found.get(seq) else {
                continue;
            };
            let detail = format!(
                "operation {seq} (entry at {:#x}) is in the key-value log only, though later operations exist: \
                 its key-log entry is damaged (then it was acknowledged), or an earlier recovery dropped it as a \
                 torn write without a checkpoint covering it (then it was not); it is kept",
                f.addr
            );
            self.lost(f.addr, Some(&f.e.key), detail);
        }
        for (a, b) in p.missing {
            self.lost(
                sb.key_log.0,
                None,
                format!(
                    "operations {a}..={b} (above checkpoint seq {base}) have no intact entry in either log: \
                     damaged entries of acknowledged writes; their keys are unknown"
                ),
            );
        }
    }
}

/// The geometry in a superblock that fails its checks, when its fields are exactly what a
/// store creates (`Superblock::new` of its two ring lengths).
fn unverified_geometry(raw: &[u8]) -> Option<Superblock> {
    let mut c = Cursor::new(raw.get(16..56)?);
    let kv = (c.u64()?, c.u64()?);
    let key = (c.u64()?, c.u64()?);
    let heap_start = c.u64()?;
    // Lengths no PM region can hold are damage (and would overflow the layout arithmetic).
    if kv.1 > 1 << 48 || key.1 > 1 << 48 {
        return None;
    }
    let sb = Superblock::new(kv.1, key.1);
    let ok = sb.kv_log == kv
        && sb.key_log == key
        && sb.heap_start == heap_start
        && kv.1 > 0
        && key.1 > 0
        && kv.1.is_multiple_of(LINE)
        && key.1.is_multiple_of(LINE);
    ok.then_some(sb)
}

/// The entries of a directory that fails its checks: `count` (from the verified
/// checkpoint) `address ‖ size ‖ 0` triples after the 16-byte header, as far as the bytes go.
fn dir_lenient(b: &[u8], count: u64) -> Vec<(u64, u32)> {
    let mut c = Cursor::new(b.get(16..).unwrap_or(&[]));
    let mut out = Vec::new();
    for _ in 0..count {
        let Some(e) = (|| {
            let addr = c.u64()?;
            let size = c.u32()?;
            c.skip(4)?;
            Some((addr, size))
        })() else {
            break;
        };
        out.push(e);
    }
    out
}

/// The entries of a KeyNode that fails its checks whose value records verify with their
/// keys (`value` returns the verified value): every byte position after the header is tried
/// as the start of an entry, so an entry whose length field is damaged does not hide the
/// ones after it. An entry is accepted only when its value verifies — a (key, value) pair
/// only the writer of that key can have produced — and the scan then resumes after it.
fn keynode_scan(b: &[u8], value: impl Fn(&[u8], ValueRef) -> Option<Vec<u8>>) -> Vec<(Vec<u8>, ValueRef, Vec<u8>)> {
    let mut out = Vec::new();
    let mut p = 16usize;
    while p < b.len() {
        let mut c = Cursor::new(b.get(p..).unwrap_or(&[]));
        let hit = (|| {
            let kl = c.u16()? as usize;
            let key = c.bytes(kl)?;
            let v = ValueRef { addr: c.u64()?, len: c.u32()? };
            let val = value(key, v)?;
            Some((key.to_vec(), v, val))
        })();
        match hit {
            Some(e) => {
                out.push(e);
                p += c.pos();
            }
            None => p += 1,
        }
    }
    out
}

/// The entries of a KeyNode that fails its checks, read without trusting it: as many as
/// its count says (when the bytes can hold that many) and its length allows (when
/// plausible), stopping at the first that does not parse. Nothing here is used unless
/// the entry's value record verifies with the entry's key.
fn keynode_lenient(b: &[u8]) -> Vec<(Vec<u8>, ValueRef)> {
    let field = |at: usize| b.get(at..at + 4).and_then(|x| Cursor::new(x).u32()).map_or(0, |v| v as usize);
    let (count, total) = (field(8), field(12));
    let count = if count <= b.len() / 14 { count } else { usize::MAX };
    let end = if (16..=b.len()).contains(&total) { total } else { b.len() };
    let mut c = Cursor::new(b.get(16..end).unwrap_or(&[]));
    let mut out = Vec::new();
    while out.len() < count && c.remaining() > 0 {
        let Some(e) = (|| {
            let kl = c.u16()? as usize;
            let key = c.bytes(kl)?.to_vec();
            let addr = c.u64()?;
            let len = c.u32()?;
            Some((key, ValueRef { addr, len }))
        })() else {
            break;
        };
        out.push(e);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;
    use crate::fs::FaultFs;
    use crate::options::{Options, Preset};
    use crate::pm::sim::SimDevice;
    use crate::repair::Salvaged;
    use crate::testing::sim_options;
    use crate::{Db, WriteBatch};

    type Model = BTreeMap<Vec<u8>, Vec<u8>>;

    fn opts(dev: &SimDevice, fs: &FaultFs) -> Options {
        sim_options(Preset::Pmekv, dev, fs)
    }

    fn run(dev: &SimDevice, fs: &FaultFs) -> Salvaged {
        crate::repair::salvage(Path::new("/db"), &opts(dev, fs), false).unwrap()
    }

    fn live(s: &Salvaged) -> Model {
        s.live().map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
    }

    fn model(pairs: &[(&str, &str)]) -> Model {
        pairs.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec())).collect()
    }

    /// Where `needle` lies in pool 0's durable image (the first occurrence).
    fn find(dev: &SimDevice, needle: &[u8]) -> usize {
        let img = dev.durable_image(0).unwrap();
        img.windows(needle.len()).position(|w| w == needle).unwrap()
    }

    fn flip(dev: &SimDevice, off: usize) {
        let img = dev.durable_image(0).unwrap();
        assert!(dev.poke(0, off, &[img[off] ^ 0x5a]));
    }

    fn open(dev: &SimDevice, fs: &FaultFs) -> Db {
        Db::open("/db", Options { create_if_missing: true, ..opts(dev, fs) }).unwrap()
    }

    /// A closed store: a checkpoint, then overwrites and deletes, then the closing one.
    fn closed_store() -> (SimDevice, FaultFs, Model) {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = open(&dev, &fs);
        db.put("apple", "red-1").unwrap();
        db.put("banana", "yellow-1").unwrap();
        db.put("cherry", "dark-1").unwrap();
        db.flush().unwrap();
        db.delete("apple").unwrap();
        db.put("banana", "yellow-2").unwrap();
        let mut b = WriteBatch::new();
        b.put("date", "brown-1");
        b.delete("cherry");
        b.put("elder", "black-1");
        db.write(b).unwrap();
        db.close().unwrap();
        (dev, fs, model(&[("banana", "yellow-2"), ("date", "brown-1"), ("elder", "black-1")]))
    }

    #[test]
    fn an_undamaged_store_salvages_exactly() {
        let (dev, fs, m) = closed_store();
        let s = run(&dev, &fs);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), m);
    }

    #[test]
    fn stale_log_entries_do_not_resurrect_deleted_or_overwritten_keys() {
        // The rings still hold `apple`'s insert, `banana`'s first value and `cherry`'s
        // insert; the checkpoint covers them, so they must not come back.
        let (dev, fs, m) = closed_store();
        let s = run(&dev, &fs);
        assert!(!s.newest.contains_key(b"apple".as_slice()));
        assert!(!s.newest.contains_key(b"cherry".as_slice()));
        assert_eq!(live(&s), m);
    }

    #[test]
    fn live_log_entries_above_the_checkpoint_win_over_the_keynodes() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = open(&dev, &fs);
        db.put("apple", "red-1").unwrap();
        db.put("banana", "yellow-1").unwrap();
        db.flush().unwrap();
        db.delete("apple").unwrap();
        db.put("banana", "yellow-2").unwrap();
        db.put("cherry", "dark-1").unwrap();
        // A power failure now: the last three writes live only in the logs.
        let (dev2, fs2) = (dev.simulate_crash(1, 0.0), fs.crash());
        let s = run(&dev2, &fs2);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), model(&[("banana", "yellow-2"), ("cherry", "dark-1")]));
        assert_eq!(s.newest.get(b"apple".as_slice()).map(|x| x.1.is_none()), Some(true), "the delete is reported");
        drop(db);
    }

    #[test]
    fn a_damaged_value_is_reported_with_its_key() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = open(&dev, &fs);
        db.put("victim", "VICTIM-VALUE-0123456789").unwrap();
        db.put("bystander", "fine").unwrap();
        db.close().unwrap();
        drop(db);
        flip(&dev, find(&dev, b"VICTIM-VALUE") + 3);
        let s = run(&dev, &fs);
        assert_eq!(s.lost.len(), 1, "{:?}", s.lost);
        assert_eq!(s.lost[0].key.as_deref(), Some(b"victim".as_slice()));
        assert!(s.lost[0].file.ends_with("pool-000000"));
        assert_eq!(live(&s), model(&[("bystander", "fine")]));
    }

    #[test]
    fn a_damaged_value_of_a_live_log_entry_is_reported_with_its_key() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = open(&dev, &fs);
        db.put("victim", "old").unwrap();
        db.flush().unwrap();
        db.put("victim", "LOGGED-VALUE-0123456789").unwrap();
        db.put("later", "x").unwrap();
        let (dev2, fs2) = (dev.simulate_crash(1, 0.0), fs.crash());
        drop(db);
        flip(&dev2, find(&dev2, b"LOGGED-VALUE") + 1);
        let s = run(&dev2, &fs2);
        assert_eq!(s.lost.len(), 1, "{:?}", s.lost);
        assert_eq!(s.lost[0].key.as_deref(), Some(b"victim".as_slice()));
        // The checkpoint's older value is what remains of the key: the newest one is lost.
        assert_eq!(live(&s), model(&[("later", "x"), ("victim", "old")]));
    }

    /// The checkpoint slot holding the larger generation.
    fn newest_slot(dev: &SimDevice) -> (u64, Checkpoint) {
        let img = dev.durable_image(0).unwrap();
        CKPT_SLOT_ADDR
            .iter()
            .filter_map(|&a| Checkpoint::decode(&img[a as usize..a as usize + 64]).map(|c| (a, c)))
            .max_by_key(|(_, c)| c.generation)
            .unwrap()
    }

    #[test]
    fn a_damaged_newest_checkpoint_falls_back_and_replays_the_logs() {
        let (dev, fs, m) = closed_store();
        let (slot, _) = newest_slot(&dev);
        flip(&dev, slot as usize + 20);
        let s = run(&dev, &fs);
        assert!(s.lost.iter().any(|l| l.offset == slot && l.key.is_none()), "{:?}", s.lost);
        // The older checkpoint's structures were freed but not reused, and the key log
        // still holds every operation since: the state comes back whole.
        assert_eq!(live(&s), m);
    }

    /// The address of the newest checkpoint's first KeyNode.
    fn first_keynode(dev: &SimDevice) -> u64 {
        let (_, c) = newest_slot(dev);
        let img = dev.durable_image(0).unwrap();
        let dir =
            layout::dir_decode(&img[c.dir_addr as usize..(c.dir_addr + c.dir_bytes) as usize], c.kn_count).unwrap();
        dir[0].0
    }

    #[test]
    fn a_damaged_keynode_keeps_the_entries_whose_values_verify() {
        let (dev, fs, m) = closed_store();
        let kn = first_keynode(&dev);
        flip(&dev, kn as usize + 1); // the magic
        let s = run(&dev, &fs);
        assert_eq!(s.lost.len(), 1, "{:?}", s.lost);
        assert_eq!((s.lost[0].offset, s.lost[0].key.clone()), (kn, None));
        assert_eq!(live(&s), m);
        // A damaged key: its entry is dropped (its value no longer verifies), the rest kept.
        let (dev, fs, m) = closed_store();
        let kn = first_keynode(&dev);
        flip(&dev, kn as usize + 16 + 2); // first key byte of the first entry
        let s = run(&dev, &fs);
        assert_eq!(s.lost.len(), 1, "{:?}", s.lost);
        let first = m.keys().next().unwrap().clone();
        let mut want = m.clone();
        want.remove(&first);
        assert_eq!(live(&s), want);
    }

    #[test]
    fn a_damaged_pool_header_or_superblock_is_reported_and_read_past() {
        for off in [0usize, 20, 64, 64 + 20] {
            let (dev, fs, m) = closed_store();
            flip(&dev, off);
            let s = run(&dev, &fs);
            assert_eq!(s.lost.len(), 1, "offset {off}: {:?}", s.lost);
            assert!(s.lost[0].key.is_none() && s.lost[0].file.ends_with("pool-000000"));
            assert_eq!(live(&s), m, "offset {off}");
        }
    }

    #[test]
    fn an_unknown_store_id_is_taken_from_pool_0() {
        // A damaged OPTIONS record: repair is told the preset, the store id is unknown (0).
        let (dev, fs, m) = closed_store();
        let opts_file = Path::new("/db/OPTIONS");
        let raw = crate::fs::Fs::read_all(&fs, opts_file).unwrap();
        fs.poke(opts_file, raw.len() / 2, &[raw[raw.len() / 2] ^ 0x5a]).unwrap();
        let s = crate::repair::salvage(Path::new("/db"), &opts(&dev, &fs), true).unwrap();
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), m);
    }

    #[test]
    fn pool_files_with_a_damaged_header_are_read_raw() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("db");
        let o = Options::new().preset(Preset::Pmekv).pm_pool_size(1 << 20).pmekv(crate::options::PmekvOptions {
            node_capacity: 8,
            kv_log_size: 256 << 10,
            key_log_size: 256 << 10,
            writeback_interval_ms: 0,
        });
        let db = Db::open(&dir, Options { create_if_missing: true, ..o.clone() }).unwrap();
        db.put("one", "1").unwrap();
        db.flush().unwrap();
        db.put("two", "2").unwrap();
        db.delete("one").unwrap();
        db.close().unwrap();
        drop(db);
        let pool = dir.join("pm").join("pool-000000");
        let mut img = std::fs::read(&pool).unwrap();
        img[5] ^= 0x5a;
        std::fs::write(&pool, &img).unwrap();
        let s = crate::repair::salvage(&dir, &o, false).unwrap();
        assert_eq!(s.lost.len(), 1, "{:?}", s.lost);
        assert_eq!((s.lost[0].file.clone(), s.lost[0].offset), (pool, 0));
        assert_eq!(live(&s), model(&[("two", "2")]));
    }

    #[test]
    fn a_torn_flagless_entry_is_checkpointed_over_and_never_seen_again() {
        // Regression (recovery.rs): a crash left the delete of `a` (seq 2) in the key-value
        // log without its flag word; recovery dropped it as torn but wrote no checkpoint
        // over it, so after a later write (seq 3) and another crash the logs held 2 (key-value
        // log only) below 3 and the store no longer opened. Recovery now checkpoints over it:
        // the second crash state opens, and salvage finds nothing lost.
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = open(&dev, &fs);
        db.put("a", "1").unwrap();
        db.flush().unwrap();
        db.close().unwrap();
        drop(db);
        let img = dev.durable_image(0).unwrap();
        let sb = Superblock::decode(&img[64..128]).unwrap();
        let e = LogEntry {
            seq: 2,
            op: Op::Delete,
            value_addr: 0,
            value_len: 0,
            batch_len: 1,
            batch_index: 0,
            key: b"a".to_vec(),
        };
        let mut bytes = e.encode(LogKind::KeyValue);
        bytes[0] = 0;
        assert!(dev.poke(0, (sb.kv_log.0 + 0x10000) as usize, &bytes));
        let db = open(&dev, &fs);
        assert_eq!(db.get("a").unwrap(), Some(b"1".to_vec()), "recovery dropped the delete");
        db.put("b", "2").unwrap();
        let (dev2, fs2) = (dev.simulate_crash(1, 0.0), fs.crash());
        drop(db);
        let s = run(&dev2, &fs2);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), model(&[("a", "1"), ("b", "2")]));
        let db = open(&dev2, &fs2);
        assert_eq!(db.get("a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(db.get("b").unwrap(), Some(b"2".to_vec()));
        assert!(db.check().unwrap().is_empty());
    }

    fn entry(seq: u64, index: u32, len: u32, key_log: bool, value_ok: bool) -> (u64, Found) {
        let e = LogEntry {
            seq,
            op: Op::Update,
            value_addr: 4096,
            value_len: 1,
            batch_len: len,
            batch_index: index,
            key: format!("k{seq}").into_bytes(),
        };
        let value = if value_ok { Ok(Some(vec![1])) } else { Err("bad".into()) };
        (seq, Found { e, addr: 0, key_log, value })
    }

    #[test]
    fn plan_keeps_committed_batches_and_drops_a_torn_newest_one() {
        // Checkpoint 10; ops 11, 12 (batch of 2) in both logs; 13..15 a batch of 3 of which
        // only 13 and 14 reached the key-value log: torn.
        let f: BTreeMap<u64, Found> = [
            entry(11, 0, 2, true, true),
            entry(12, 1, 2, true, true),
            entry(13, 0, 3, false, true),
            entry(14, 1, 3, false, true),
        ]
        .into_iter()
        .collect();
        let lp = |committed: Vec<u64>, missing: Vec<(u64, u64)>, kv_only: Vec<u64>, torn| LogPlan {
            committed,
            missing,
            kv_only,
            torn,
        };
        assert_eq!(plan(&f, 10), lp(vec![11, 12], vec![], vec![], Some((13, 2))));
        // A complete newest batch whose values verify is committed without key-log entries.
        let mut g = f.clone();
        g.extend([entry(15, 2, 3, false, true)]);
        assert_eq!(plan(&g, 10), lp(vec![11, 12, 13, 14, 15], vec![], vec![], None));
        // ... but not when one of its values fails (a write torn before its commit fence).
        g.extend([entry(15, 2, 3, false, false)]);
        assert_eq!(plan(&g, 10).torn, Some((13, 3)));
        // A key-log entry proves the newest batch committed: its absent entry is missing.
        let mut h = f.clone();
        h.extend([entry(14, 1, 3, true, true)]);
        assert_eq!(plan(&h, 10), lp(vec![11, 12, 13, 14], vec![(15, 15)], vec![], None));
    }

    #[test]
    fn plan_reports_operations_missing_from_both_logs() {
        // 11 lost from both logs, 12 present; 14 lost before a torn newest batch at 15.
        let f: BTreeMap<u64, Found> =
            [entry(12, 0, 1, true, true), entry(13, 0, 1, true, false), entry(15, 0, 2, false, true)]
                .into_iter()
                .collect();
        let lp = |committed: Vec<u64>, missing: Vec<(u64, u64)>, kv_only: Vec<u64>, torn| LogPlan {
            committed,
            missing,
            kv_only,
            torn,
        };
        assert_eq!(plan(&f, 10), lp(vec![12, 13], vec![(11, 11), (14, 14)], vec![], Some((15, 1))));
        // An older batch that lacks an entry is committed (a later write exists): 21 missing,
        // and 20, found in the key-value log only, is kept but reported.
        let g: BTreeMap<u64, Found> =
            [entry(20, 0, 2, false, true), entry(22, 0, 1, false, true)].into_iter().collect();
        assert_eq!(plan(&g, 19), lp(vec![20, 22], vec![(21, 21)], vec![20], None));
        assert_eq!(plan(&BTreeMap::new(), 5), LogPlan::default());
    }

    #[test]
    fn lenient_decoders_read_past_a_damaged_header() {
        let kn = layout::keynode_encode(
            [
                (b"a".as_slice(), ValueRef { addr: 0x2000, len: 3 }),
                (b"bc".as_slice(), ValueRef { addr: 0x2040, len: 0 }),
            ]
            .into_iter(),
            2,
        );
        let want = vec![
            (b"a".to_vec(), ValueRef { addr: 0x2000, len: 3 }),
            (b"bc".to_vec(), ValueRef { addr: 0x2040, len: 0 }),
        ];
        for at in [0usize, 5, 8, 13] {
            let mut d = kn.clone();
            d[at] ^= 0x5a;
            assert_eq!(keynode_lenient(&d), want, "byte {at}");
        }
        // A damaged key length hides nothing after it from the scan.
        let mut d = kn.clone();
        d[16] ^= 0x5a;
        let ok = |k: &[u8], v: ValueRef| want.contains(&(k.to_vec(), v)).then(Vec::new);
        assert_eq!(keynode_scan(&d, ok), vec![(b"bc".to_vec(), want[1].1, vec![])]);
        assert_eq!(keynode_scan(&kn, ok).len(), 2);
        let dir = layout::dir_encode(&[(0x3000, 64), (0x3040, 128)]);
        let mut d = dir.clone();
        d[9] ^= 0x5a;
        assert_eq!(dir_lenient(&d, 2), vec![(0x3000, 64), (0x3040, 128)]);
        assert_eq!(dir_lenient(&d[..20], 2), vec![], "cut short");
    }
}
