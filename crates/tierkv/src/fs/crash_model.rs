//! What a crash leaves of unsynced file data and unsynced directory entries, for
//! [`super::FaultFs::crash_with`].
//!
//! Two modes ([`CrashMode`]):
//!
//! - [`CrashMode::Prefix`]: the deterministic model: every file is cut back to its synced
//!   length and only names made durable by a directory sync exist. This is the most a
//!   well-behaved file system can lose, and the state most tests want to reason about.
//! - [`CrashMode::Pages`]: a file system that writes back dirty pages in any order and
//!   commits metadata independently of data (ext4 `data=writeback`, XFS, btrfs without
//!   `flushoncommit`, and ext4 `data=ordered` after an `fsync`-less rename-over). Seeded
//!   randomness decides, per crash:
//!   - per file: the length after the crash, anywhere from the synced length to the length
//!     at the crash (the inode size is metadata, journaled separately from the data);
//!   - per 4 KiB page past the synced length: whether the page was written back. A page
//!     that was not reads as zeros from the synced length on (a *hole*: the size was
//!     committed, the block never written), or, for files drawn as "cut", the file ends at
//!     the first such page (the size update for it was never committed either). Bytes below
//!     the synced length are never lost, including those of a partly synced page;
//!   - per group of directory entries changed since the last sync of their directory: the
//!     old or the new entries. A group is a connected set of names and files: a rename
//!     links its source name, its target name, the file moved and the file it replaced, so
//!     a rename survives whole or not at all (never both names, never neither, for one
//!     file: POSIX `rename(2)` promises that the target always names the old or the new
//!     file, and every journaling file system commits a rename as one transaction). A
//!     creation, a removal, and renames of unrelated files are decided independently
//!     of each other, even in the order opposite to the one they were made in: a store
//!     that needs a new file's name to be durable before a later rename refers to it must
//!     sync the directory in between (ext4's journal orders them; btrfs and the POSIX
//!     contract do not).
//!
//! Not modelled: directories themselves are durable when created (tierkv creates them
//! once, before anything needs them); a file `fsync` does not make any directory entry
//! durable (on ext4 it commits the whole journal, so this is stricter); data below the
//! synced length is never damaged (no torn sectors or bit rot: the corruption suites
//! cover those); in-place overwrites do not exist (files are append-only, `create`
//! replaces a file with a new one).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The page size of the modelled page cache.
pub const PAGE: usize = 4096;

/// How [`super::FaultFs::crash_with`] treats data and names that were not made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashMode {
    /// Every file cut back to its synced length; only names made durable by a directory
    /// sync. Deterministic (the seed is ignored).
    Prefix,
    /// Unsynced pages kept or lost one by one (lost ones may read as zeros), file lengths
    /// anywhere from synced to current, each group of unsynced directory changes kept or
    /// lost independently (renames atomically). See the module docs.
    Pages,
}

impl CrashMode {
    /// Parse `prefix` or `pages` (the `TIERKV_FS_CRASH` environment variable).
    pub fn parse(s: &str) -> Option<CrashMode> {
        match s.trim() {
            "prefix" => Some(CrashMode::Prefix),
            "pages" => Some(CrashMode::Pages),
            _ => None,
        }
    }
}

/// One file's bytes after a crash: `data` is its content at the crash, `synced` how much of
/// it a sync made durable.
pub fn crash_file(data: &[u8], synced: usize, mode: CrashMode, rng: &mut SmallRng) -> Vec<u8> {
    let synced = synced.min(data.len());
    let (head, tail) = data.split_at(synced);
    if mode == CrashMode::Prefix || tail.is_empty() {
        return head.to_vec();
    }
    // The committed size: the synced length, the full length, or anything between.
    let len = match rng.random_range(0..4) {
        0 => synced,
        1 | 2 => data.len(),
        _ => rng.random_range(synced..=data.len()),
    };
    let holes = rng.random_bool(0.5);
    let keep = [0.0, 0.5, 0.9][rng.random_range(0..3)];
    let mut out = data.get(..len).unwrap_or(data).to_vec();
    let mut page_start = synced - synced % PAGE;
    while page_start < len {
        let lo = page_start.max(synced);
        let hi = (page_start + PAGE).min(len);
        if !rng.random_bool(keep) {
            if !holes {
                out.truncate(lo);
                break;
            }
            if let Some(b) = out.get_mut(lo..hi) {
                b.fill(0);
            }
        }
        page_start += PAGE;
    }
    out
}

/// The names after a crash, from the `durable` names (as of each directory's last sync) and
/// the `current` ones. See the module docs for the grouping of changes.
pub fn crash_names(
    durable: &BTreeMap<PathBuf, u64>,
    current: &BTreeMap<PathBuf, u64>,
    mode: CrashMode,
    rng: &mut SmallRng,
) -> BTreeMap<PathBuf, u64> {
    if mode == CrashMode::Prefix {
        return durable.clone();
    }
    // Union-find over changed names and the files they name(d).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    enum Node<'a> {
        Name(&'a PathBuf),
        File(u64),
    }
    let mut parent: HashMap<Node<'_>, Node<'_>> = HashMap::new();
    fn root<'a>(parent: &mut HashMap<Node<'a>, Node<'a>>, mut n: Node<'a>) -> Node<'a> {
        while let Some(&p) = parent.get(&n) {
            if p == n {
                break;
            }
            n = p;
        }
        n
    }
    fn union<'a>(parent: &mut HashMap<Node<'a>, Node<'a>>, a: Node<'a>, b: Node<'a>) {
        let (ra, rb) = (root(parent, a), root(parent, b));
        if ra != rb {
            parent.insert(ra.max(rb), ra.min(rb));
        }
    }
    let changed: Vec<&PathBuf> =
        durable.keys().chain(current.keys()).filter(|p| durable.get(*p) != current.get(*p)).collect();
    for &p in &changed {
        let n = Node::Name(p);
        parent.entry(n).or_insert(n);
        for id in [durable.get(p), current.get(p)].into_iter().flatten() {
            let f = Node::File(*id);
            parent.entry(f).or_insert(f);
            union(&mut parent, n, f);
        }
    }
    let mut out = durable.clone();
    let mut decided: HashMap<Node<'_>, bool> = HashMap::new();
    let mut changed = changed;
    changed.sort();
    changed.dedup();
    for p in changed {
        let r = root(&mut parent, Node::Name(p));
        let new = *decided.entry(r).or_insert_with(|| rng.random_bool(0.5));
        if new {
            match current.get(p) {
                Some(id) => out.insert(p.clone(), *id),
                None => out.remove(p),
            };
        }
    }
    out
}

/// A generator for one crash.
pub fn rng(seed: u64) -> SmallRng {
    SmallRng::seed_from_u64(seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[(&str, u64)]) -> BTreeMap<PathBuf, u64> {
        v.iter().map(|(p, i)| (PathBuf::from(p), *i)).collect()
    }

    #[test]
    fn synced_bytes_survive_and_the_rest_is_a_prefix_with_holes() {
        let data: Vec<u8> = (0..5 * PAGE + 100).map(|i| (i % 251) as u8 + 1).collect();
        let mut seen_hole = false;
        let mut seen_cut = false;
        let mut seen_full = false;
        for seed in 0..400 {
            let synced = (seed as usize * 977) % data.len();
            let out = crash_file(&data, synced, CrashMode::Pages, &mut rng(seed));
            assert!(out.len() >= synced && out.len() <= data.len(), "seed {seed}");
            assert_eq!(&out[..synced], &data[..synced], "seed {seed}: synced bytes lost");
            for (i, (&a, &b)) in out.iter().zip(&data).enumerate().skip(synced) {
                assert!(a == b || a == 0, "seed {seed}: byte {i} is garbage");
                seen_hole |= a == 0;
            }
            // A lost page is lost whole (from the synced length on).
            for p in out.chunks(PAGE).enumerate().skip(synced.div_ceil(PAGE)) {
                let zeros = p.1.iter().filter(|&&b| b == 0).count();
                assert!(zeros == 0 || zeros == p.1.len(), "seed {seed}: page {} partly lost", p.0);
            }
            seen_cut |= out.len() < data.len() && out.len() > synced;
            seen_full |= out == data && synced < data.len();
        }
        assert!(seen_hole && seen_cut && seen_full);
        let out = crash_file(&data, 10, CrashMode::Prefix, &mut rng(1));
        assert_eq!(out, &data[..10]);
    }

    #[test]
    fn a_rename_survives_whole_or_not_at_all() {
        // tmp (file 2) renamed over CURRENT (file 1); MANIFEST-2 (file 3) created; LOG (4)
        // removed.
        let durable = names(&[("/d/CURRENT", 1), ("/d/LOG", 4)]);
        let current = names(&[("/d/CURRENT", 2), ("/d/MANIFEST-2", 3)]);
        let mut outcomes = std::collections::BTreeSet::new();
        for seed in 0..200 {
            let out = crash_names(&durable, &current, CrashMode::Pages, &mut rng(seed));
            let cur = out.get(&PathBuf::from("/d/CURRENT")).copied();
            assert!(cur == Some(1) || cur == Some(2), "seed {seed}: CURRENT {cur:?}");
            assert!(!out.contains_key(&PathBuf::from("/d/tmp")));
            outcomes.insert((
                cur,
                out.contains_key(&PathBuf::from("/d/MANIFEST-2")),
                out.contains_key(&PathBuf::from("/d/LOG")),
            ));
        }
        assert_eq!(outcomes.len(), 8, "each group is decided independently: {outcomes:?}");
        assert_eq!(crash_names(&durable, &current, CrashMode::Prefix, &mut rng(0)), durable);
    }

    #[test]
    fn a_moved_file_has_exactly_one_name() {
        let durable = names(&[("/d/a", 7)]);
        let current = names(&[("/d/b", 7)]);
        for seed in 0..50 {
            let out = crash_names(&durable, &current, CrashMode::Pages, &mut rng(seed));
            assert_eq!(out.values().filter(|&&i| i == 7).count(), 1, "seed {seed}: {out:?}");
        }
    }
}
