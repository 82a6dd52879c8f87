//! Opening a PMEKV store: creation, and recovery from KeyNodes plus the two-tier log.
//!
//! Recovery (§4.5 of the paper, made precise):
//! 1. read the superblock and the valid checkpoint slot with the highest generation;
//! 2. load its directory and KeyNodes (every checksum verified) and rebuild the key index
//!    tree with one LeadNode per KeyNode (so those leaves start clean);
//! 3. scan both log rings; keep entries with a non-zero flag and a sequence number above the
//!    checkpoint's. Key-value log entries count only if their whole batch is present and
//!    every value of the batch verifies (otherwise the batch was never committed);
//! 4. replay the kept entries in sequence order (idempotent);
//! 5. rebuild the heap: everything not referenced by the tree, the KeyNodes, the directory
//!    or a replayed log entry is free. Overlapping references are corruption;
//! 6. if anything was replayed or a torn batch was seen, write a checkpoint at once, so the
//!    logs start empty and stale entries can never be replayed again.
//!
//! Falling back to the older checkpoint slot is right when the newer record was torn by a
//! crash (nothing it replaced has been freed yet). When the newer record was damaged later,
//! the fallback is caught: its KeyNodes fail their checksums once reused, a key-log entry
//! with KFlag 0 above its sequence number proves a newer checkpoint existed, and values are
//! checksummed together with their key, so reused space never passes for a value.
//!
//! A damaged log entry in the middle of the log is detected (sequence numbers must run
//! without a gap) and reported as corruption. Damage to the entries of the very last
//! operation cannot be told apart from a write torn by the crash, exactly like a torn tail
//! of LevelDB's log: that operation is then treated as not having happened.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::AtomicU64;

use parking_lot::{Condvar, Mutex, RwLock};

use super::layout::{self, Checkpoint, LogEntry, LogKind, Op, Superblock, ValueRef, CKPT_SLOT_ADDR, SUPERBLOCK_ADDR};
use super::log::Ring;
use super::{apply, Inner, LeafInfo, State, Tree};
use crate::engine::EngineCtx;
use crate::error::{Error, Result};
use crate::pm::heap::Heap;
use crate::pm::{Region, POOL_HEADER_LEN};

type Leaves = Vec<(Vec<(Box<[u8]>, ValueRef)>, (u64, u32))>;

/// Open or create the store described by `ctx`.
pub(super) fn open(ctx: &EngineCtx) -> Result<Inner> {
    let o = &ctx.opts;
    let region = crate::engine::open_region(ctx)?;
    let sb = if ctx.fresh {
        create(&region, o.pmekv.kv_log_size, o.pmekv.key_log_size)?
    } else {
        let raw = region.slice_checked(SUPERBLOCK_ADDR, 64, "superblock")?;
        Superblock::decode(raw).map_err(|d| region.corruption(SUPERBLOCK_ADDR, d))?
    };
    if sb.heap_start + 4096 > region.pool_size() {
        return Err(region.corruption(SUPERBLOCK_ADDR, "superblock places the heap beyond pool 0"));
    }
    recover(region, sb, o.pmekv.node_capacity, o.pmekv.writeback_interval_ms > 0)
}

/// Lay out a new store: superblock, zeroed logs, an empty checkpoint.
fn create(region: &Region, kv_len: u64, key_len: u64) -> Result<Superblock> {
    let sb = Superblock::new(kv_len, key_len);
    if sb.heap_start + (64 << 10) > region.pool_size() {
        return Err(Error::InvalidArgument(format!(
            "pm_pool_size {} is too small for logs of {kv_len} + {key_len} bytes",
            region.pool_size()
        )));
    }
    let zeros = vec![0u8; 1 << 20];
    let mut off = sb.kv_log.0;
    let end = sb.key_log.0 + sb.key_log.1;
    while off < end {
        let n = (end - off).min(zeros.len() as u64) as usize;
        // SAFETY: the store is being created; nothing else uses the region yet.
        unsafe { region.write(off, zeros.get(..n).unwrap_or(&[]))? };
        region.flush(off, n as u64);
        off += n as u64;
    }
    // An empty directory at the start of the heap, and checkpoint 1 pointing at it.
    let dir = layout::dir_encode(&[]);
    // SAFETY: as above.
    unsafe { region.write(sb.heap_start, &dir)? };
    region.flush(sb.heap_start, dir.len() as u64);
    let ckpt = Checkpoint {
        generation: 1,
        seq: 0,
        dir_addr: sb.heap_start,
        dir_bytes: dir.len() as u64,
        kn_count: 0,
        key_count: 0,
    };
    // SAFETY: as above.
    unsafe {
        region.write(CKPT_SLOT_ADDR[0], &ckpt.encode())?;
        region.write(CKPT_SLOT_ADDR[1], &[0u8; 64])?;
    }
    region.flush(CKPT_SLOT_ADDR[0], 128);
    region.fence();
    // The superblock last: a store whose superblock is valid is fully laid out.
    // SAFETY: as above.
    unsafe { region.write(SUPERBLOCK_ADDR, &sb.encode())? };
    region.persist(SUPERBLOCK_ADDR, 64);
    region.sync_all()?;
    Ok(sb)
}

/// The valid checkpoint with the highest generation, and its slot.
fn pick_checkpoint(region: &Region) -> Result<(Checkpoint, usize)> {
    let mut best: Option<(Checkpoint, usize)> = None;
    for (slot, addr) in CKPT_SLOT_ADDR.iter().enumerate() {
        let raw = region.slice_checked(*addr, 64, "checkpoint slot")?;
        if let Some(c) = Checkpoint::decode(raw) {
            if best.is_none_or(|(b, _)| c.generation > b.generation) {
                best = Some((c, slot));
            }
        }
    }
    best.ok_or_else(|| region.corruption(CKPT_SLOT_ADDR[0], "no valid checkpoint record in either slot"))
}

/// Decode the directory and KeyNodes of `ckpt`, verifying every checksum.
pub(super) fn load_checkpoint(region: &Region, ckpt: &Checkpoint) -> Result<Leaves> {
    let dir_len = usize::try_from(ckpt.dir_bytes).map_err(|_| region.corruption(ckpt.dir_addr, "directory size"))?;
    if layout::dir_alloc_size(usize::try_from(ckpt.kn_count).unwrap_or(usize::MAX / 32)) != ckpt.dir_bytes {
        return Err(region.corruption(ckpt.dir_addr, "checkpoint's directory size does not match its KeyNode count"));
    }
    let raw = region.slice_checked(ckpt.dir_addr, dir_len, "KeyNode directory")?;
    let kns = layout::dir_decode(raw, ckpt.kn_count).map_err(|d| region.corruption(ckpt.dir_addr, d))?;
    let mut leaves = Vec::with_capacity(kns.len());
    for (addr, bytes) in kns {
        let raw = region.slice_checked(addr, bytes as usize, "KeyNode")?;
        let entries = layout::keynode_decode(raw).map_err(|d| region.corruption(addr, d))?;
        if entries.is_empty() {
            return Err(region.corruption(addr, "empty KeyNode"));
        }
        leaves.push((entries, (addr, bytes)));
    }
    Ok(leaves)
}

fn recover(region: Region, sb: Superblock, capacity: usize, background: bool) -> Result<Inner> {
    let (ckpt, slot) = pick_checkpoint(&region)?;
    let leaves = load_checkpoint(&region, &ckpt)?;
    let mut used: Vec<(u64, u64)> = Vec::new();
    used.push((ckpt.dir_addr, ckpt.dir_bytes));
    let mut kn_set = Vec::with_capacity(leaves.len());
    let mut tree_leaves = Vec::with_capacity(leaves.len());
    let mut key_count = 0u64;
    for (entries, kn) in leaves {
        used.push((kn.0, kn.1 as u64));
        kn_set.push(kn);
        key_count += entries.len() as u64;
        tree_leaves.push((entries, LeafInfo { kn: Some(kn), dirty: false }));
    }
    if key_count != ckpt.key_count {
        return Err(region
            .corruption(ckpt.dir_addr, format!("KeyNodes hold {key_count} keys, checkpoint says {}", ckpt.key_count)));
    }
    let cap = tree_leaves.iter().map(|l| l.0.len()).max().unwrap_or(0).max(capacity);
    let tree: Tree = Tree::from_leaves(cap, tree_leaves)
        .ok_or_else(|| region.corruption(ckpt.dir_addr, "KeyNodes are not in strictly increasing key order"))?;

    // Log entries to replay.
    let key_log = Ring::new(LogKind::Key, sb.key_log.0, sb.key_log.1);
    let kv_log = Ring::new(LogKind::KeyValue, sb.kv_log.0, sb.kv_log.1);
    let mut max_seq = ckpt.seq;
    let mut saw_live = false;
    let mut replay: Vec<LogEntry> = Vec::new();
    let key_entries = key_log.scan(&region);
    let kv_entries = kv_log.scan(&region);
    // The first sequence number of the newest operation (a batch takes one per entry; its
    // key-value log entries say where it starts).
    let newest_kv = kv_entries.iter().map(|(e, _, _)| e).max_by_key(|e| e.seq);
    let newest_key = key_entries.iter().map(|(e, _, _)| e.seq).max().unwrap_or(0);
    let newest_op = match newest_kv {
        Some(e) if e.seq >= newest_key => e.seq.saturating_sub(e.batch_index as u64),
        _ => newest_key,
    };
    for (e, flag, addr) in key_entries {
        max_seq = max_seq.max(e.seq);
        if e.seq > ckpt.seq {
            if flag == 0 {
                if e.seq >= newest_op {
                    // The flag word is not under the checksum (a checkpoint clears it in
                    // place), and a log append is not failure-atomic beyond 8 bytes: the
                    // newest operation's entry may have landed without its flag word. Its
                    // write was never acknowledged; the checkpoint written after recovery
                    // covers its sequence number, so the entry is never looked at again.
                    saw_live = true;
                    continue;
                }
                // KFlags are cleared only for entries a checkpoint covers: a newer
                // checkpoint than the one we found existed, so its record is damaged.
                return Err(region.corruption(
                    addr,
                    format!(
                        "key-log entry {} was written back by a checkpoint newer than the newest valid one ({}): \
                         the newest checkpoint record is damaged",
                        e.seq, ckpt.seq
                    ),
                ));
            }
            saw_live = true;
            replay.push(e);
        }
    }
    let mut batches: BTreeMap<u64, Vec<LogEntry>> = BTreeMap::new();
    for (e, flag, _) in kv_entries {
        max_seq = max_seq.max(e.seq);
        // Any entry above the checkpoint, live or not, is covered by a checkpoint at the end
        // of recovery. An entry torn without its flag word (never acknowledged) used to be
        // skipped without one: its sequence number was reused-past but the entry stayed, and
        // after later writes and a second crash the logs held it below newer operations —
        // "log entry with sequence N is missing or damaged" (found by the salvage walk).
        if e.seq > ckpt.seq {
            saw_live = true;
        }
        if flag != 0 && e.seq > ckpt.seq && e.batch_index < e.batch_len {
            saw_live = true;
            batches.entry(e.seq - e.batch_index as u64).or_default().push(e);
        }
    }
    for (_, mut b) in batches {
        b.sort_by_key(|e| e.batch_index);
        b.dedup_by_key(|e| e.batch_index);
        let complete = b.first().is_some_and(|f| b.len() == f.batch_len as usize)
            && b.iter().enumerate().all(|(i, e)| e.batch_index as usize == i && e.batch_len as usize == b.len());
        let values_ok = b.iter().all(|e| {
            e.op == Op::Delete
                || region
                    .slice(e.value_addr, (layout::VALUE_HEADER + e.value_len as u64) as usize)
                    .is_some_and(|rec| layout::value_verify(rec, &e.key, e.value_len).is_ok())
        });
        if complete && values_ok {
            replay.extend(b);
        }
    }
    replay.sort_by_key(|e| e.seq);
    replay.dedup_by_key(|e| e.seq);
    // Every operation since the checkpoint has a key-log entry, and only the newest batch can
    // be missing from it (then it is in the key-value log). So the replayed sequence numbers
    // must run without a gap from the checkpoint's: a gap means an acknowledged write's log
    // entry was damaged, which is corruption, not a torn write.
    for (i, e) in replay.iter().enumerate() {
        let want = ckpt.seq + 1 + i as u64;
        if e.seq != want {
            return Err(region.corruption(
                sb.key_log.0,
                format!("log entry with sequence {want} is missing or damaged (found {} after it)", e.seq),
            ));
        }
    }

    let mut st = State {
        tree,
        kv_log,
        key_log,
        next_seq: max_seq + 1,
        ckpt,
        ckpt_slot: slot,
        kn_set,
        deferred: Vec::new(),
        key_log_entries: Vec::new(),
    };
    // Values referenced by replayed entries stay allocated until the post-recovery
    // checkpoint: a crash during it must find them intact.
    let mut log_values: HashSet<(u64, u64)> = HashSet::new();
    for e in &replay {
        let v = (e.op != Op::Delete).then_some(ValueRef { addr: e.value_addr, len: e.value_len });
        if let Some(v) = v {
            log_values.insert((v.addr, layout::value_alloc_size(v.len as usize)));
        }
        apply(&mut st, &e.key, e.op, v);
    }
    let mut tree_values: HashSet<(u64, u64)> = HashSet::with_capacity(st.tree.len());
    for (_, v) in st.tree.range_from(std::ops::Bound::Unbounded) {
        tree_values.insert((v.addr, layout::value_alloc_size(v.len as usize)));
    }
    // Deferred frees recorded while replaying refer to the checkpoint's or the log's values;
    // keep exactly the ones no longer referenced.
    st.deferred = log_values
        .iter()
        .chain(st.deferred.iter())
        .filter(|x| !tree_values.contains(x))
        .copied()
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    used.extend(tree_values.iter().copied());
    used.extend(st.deferred.iter().copied());
    used.sort_unstable();
    used.dedup();

    let heap = build_heap(&region, &sb, &used)?;
    let inner = Inner {
        region,
        sb,
        heap: Mutex::new(heap),
        arenas: (0..super::ARENAS).map(|_| Mutex::new(super::Arena::default())).collect(),
        state: RwLock::new(st),
        user_bytes: Default::default(),
        checkpoints: AtomicU64::new(0),
        poisoned: crate::poison::Poison::default(),
        bg_stop: Mutex::new(false),
        bg_cv: Condvar::new(),
        background,
        pins: Mutex::new(crate::pm::pins::Pins::default()),
        commits: crate::group::Queue::default(),
        group_commits: AtomicU64::new(0),
        grouped_batches: AtomicU64::new(0),
        #[cfg(test)]
        fail_next_log: Default::default(),
    };
    if saw_live {
        let mut st = inner.state.write();
        inner.checkpoint_exclusive(&mut st)?;
    }
    Ok(inner)
}

/// Free space = every heap byte not in `used` (sorted by address).
fn build_heap(region: &Region, sb: &Superblock, used: &[(u64, u64)]) -> Result<Heap> {
    let mut heap = Heap::new();
    let ps = region.pool_size();
    for i in 0..region.pool_count() {
        let start = if i == 0 { sb.heap_start } else { region.addr(i, POOL_HEADER_LEN) };
        let end = region.addr(i + 1, 0);
        let lo = used.partition_point(|u| u.0 < region.addr(i, 0));
        let hi = used.partition_point(|u| u.0 < end);
        let in_pool = used.get(lo..hi).unwrap_or(&[]);
        heap.add_space(start, end, in_pool).map_err(|(a, l)| {
            region.corruption(
                a,
                format!("record of {l} bytes overlaps another or lies outside the heap (pool size {ps})"),
            )
        })?;
    }
    if let Some(&(a, l)) = used.iter().find(|u| u.0 >= region.addr(region.pool_count(), 0)) {
        return Err(region.corruption(a, format!("record of {l} bytes lies beyond the last PM pool")));
    }
    Ok(heap)
}
