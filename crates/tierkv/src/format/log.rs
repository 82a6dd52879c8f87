//! Reading framed logs (write-ahead logs, the MANIFEST) at open: which bad record is a torn
//! tail, which is damage, and what each [`WalRecovery`] mode does with them.
//!
//! A log is a sequence of frames `len u32 | masked crc32c(payload) u32 | payload`
//! ([`super::frame`]). A crash can leave only the remains of the appends it interrupted:
//! a file cut inside the last record (prefix model), or unsynced pages lost and read back
//! as zeros (page model, [`crate::fs::crash_model`]). So a bad record at offset `o` is a
//! **torn tail** when
//! - fewer than 8 bytes remain (the cut hit its header); or
//! - a zero-filled page shows between `o` and the record's end, or the next intact record
//!   if one comes first ([`has_lost_page`]: media
//!   damage does not zero an aligned page; a lost write-back does — and every page after a
//!   lost one is unsynced too, so what follows may be dropped); or
//! - it runs past the end of the file, or fails its checksum and ends exactly at the end,
//!   **and no intact record follows it** ([`intact_record_after`]). This is what makes a
//!   damaged length field mid-log an error: the record claims to run past the end, but the
//!   records after it are still there and verify.
//!
//! Anything else is **damage**. An intact record "follows" at `p > o` when the frame at `p`
//! verifies and either ends exactly at the end of the file or is directly followed by a
//! second frame that verifies. Two chained frames are what a real log holds; a frame-shaped
//! byte string inside a value is almost never followed by a second one.
//!
//! What the rule cannot tell apart (documented, not hidden): damage that looks exactly like
//! a crash — a checksum-failing *last* record, a length field damaged in the last record, a
//! record whose payload holds a whole aligned page of zeros and is damaged elsewhere, and a
//! damaged length in the second-to-last record of a log whose last record is also torn. A
//! torn tail whose cut payload happens to hold two chained valid frames, or one valid frame
//! ending exactly where the cut fell (a value that is itself a tierkv log), is reported as
//! damage, never dropped silently.
//!
//! Which log counts as the newest ([`replay_logs`]'s `whole_older` rule) is the last one
//! that holds any bytes: a new log is created before the previous one's last sync.

use super::{crc, Cursor, FS_PAGE};

/// How a write-ahead log's bad records are treated when a store opens; the choice RocksDB
/// users know as `wal_recovery_mode`. The MANIFEST always uses
/// [`WalRecovery::TolerateTornTail`]: skipping a version edit would leave a wrong set of
/// files (use `tierkv repair` on a store whose MANIFEST is damaged).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum WalRecovery {
    /// Any bad record fails the open with [`crate::Error::Corruption`], a torn tail
    /// included: for stores whose every write is synced, where a torn tail means lost media.
    AbsoluteConsistency,
    /// A torn tail (the remains of the appends a crash interrupted; see the module docs) is
    /// dropped and reported; any other damage fails the open with
    /// [`crate::Error::Corruption`] naming the file and offset. The default.
    #[default]
    TolerateTornTail,
    /// Replay stops at the first bad record, torn or damaged: the logs up to it are
    /// replayed, it and everything after it (later logs too) are dropped and reported. The
    /// store opens in a consistent state as of some point before the damage.
    PointInTime,
    /// Every damaged record is skipped and reported; replay goes on with the next intact
    /// record (later batches are kept even though an earlier one was lost). A torn tail is
    /// dropped.
    SkipDamaged,
}

impl WalRecovery {
    /// Every mode, in the order of the docs.
    pub const ALL: [WalRecovery; 4] = [
        WalRecovery::AbsoluteConsistency,
        WalRecovery::TolerateTornTail,
        WalRecovery::PointInTime,
        WalRecovery::SkipDamaged,
    ];

    /// The name used by the CLI and the options file: `absolute`, `torn-tail`,
    /// `point-in-time`, `skip`.
    pub fn name(self) -> &'static str {
        match self {
            WalRecovery::AbsoluteConsistency => "absolute",
            WalRecovery::TolerateTornTail => "torn-tail",
            WalRecovery::PointInTime => "point-in-time",
            WalRecovery::SkipDamaged => "skip",
        }
    }
}

impl std::fmt::Display for WalRecovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WalRecovery {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        WalRecovery::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown WAL recovery mode {s:?} (one of absolute, torn-tail, point-in-time, skip)"))
    }
}

/// Why a range of a log was not replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// The remains of appends a crash interrupted.
    TornTail,
    /// A record that fails its checks where a crash leaves none (skipped by
    /// [`WalRecovery::SkipDamaged`], or cut with everything after it by
    /// [`WalRecovery::PointInTime`]).
    Damaged,
    /// Intact records after a point-in-time cut (in the damaged log or a later one).
    AfterCut,
}

/// A byte range of a log dropped at open, reported by [`crate::Db::recovery_report`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// The log file.
    pub file: std::path::PathBuf,
    /// File offset of the first dropped byte.
    pub offset: u64,
    /// Bytes dropped.
    pub len: u64,
    /// Why.
    pub reason: DropReason,
}

/// What [`read_log`] found: the intact records (with their offsets relative to the data
/// passed in), and the ranges it dropped.
#[derive(Debug, Default)]
pub struct LogRead<'a> {
    /// Intact records, in order.
    pub records: Vec<(u64, &'a [u8])>,
    /// Dropped ranges `(offset, len, reason)`.
    pub dropped: Vec<(u64, u64, DropReason)>,
    /// True when a torn tail was dropped.
    pub torn: bool,
    /// True when [`WalRecovery::PointInTime`] cut the log at a bad record: nothing after it,
    /// in this log or a later one, may be replayed.
    pub cut: bool,
}

/// The payload of the frame at `off` and its end, if the frame is whole and verifies.
fn frame_at(data: &[u8], off: usize) -> Option<(&[u8], usize)> {
    let mut c = Cursor::new(data.get(off..)?);
    let (len, stored) = (c.u32()?, c.u32()?);
    let payload = c.bytes(len as usize)?;
    (crc::masked(payload) == stored).then_some((payload, off + 8 + len as usize))
}

/// True when `data` (a file's bytes from file offset `base` on) shows, from `off` on, what a
/// crash leaves of a page that was never written back: some page-aligned range
/// `[max(page, off), min(page + FS_PAGE, end))` starting before `rec_end` is all zeros.
/// (Media damage does not zero a whole page; a crash that loses unsynced pages does.)
pub fn has_lost_page(data: &[u8], base: u64, off: usize, rec_end: usize) -> bool {
    let end = data.len();
    let file_off = base + off as u64;
    let mut page = file_off - file_off % FS_PAGE;
    loop {
        let lo = usize::try_from(page.max(file_off) - base).unwrap_or(usize::MAX);
        if lo >= rec_end.min(end) {
            return false;
        }
        let hi = usize::try_from(page + FS_PAGE - base).unwrap_or(usize::MAX).min(end);
        if data.get(lo..hi).is_some_and(|b| b.iter().all(|&x| x == 0)) {
            return true;
        }
        page += FS_PAGE;
    }
}

/// The first offset `p >= from` where an intact record starts: the frame at `p` verifies
/// and either ends exactly at the end of `data` or is directly followed by a frame that
/// verifies (see the module docs).
pub fn intact_record_after(data: &[u8], from: usize) -> Option<usize> {
    let last = data.len().checked_sub(8)?;
    // The length of the frame at `p` and where it ends, when it fits in the file.
    let end_at = |p: usize| -> Option<usize> {
        let len = u32::from_le_bytes(data.get(p..p + 4)?.try_into().ok()?) as usize;
        p.checked_add(8)?.checked_add(len).filter(|e| *e <= data.len())
    };
    (from..=last).find(|&p| {
        // Cheap header checks first (the frame ends at the end of the file, or the next
        // frame's header fits), so a long torn tail of random bytes is scanned in linear
        // time, not with a checksum per position.
        let Some(end) = end_at(p) else { return false };
        if end != data.len() && end_at(end).is_none() {
            return false;
        }
        match frame_at(data, p) {
            Some((_, end)) => end == data.len() || frame_at(data, end).is_some(),
            None => false,
        }
    })
}

/// Classify the bad record at `off`: true for a torn tail (module docs). `next` is
/// [`intact_record_after`]`(data, off + 1)`, computed once by the caller.
fn is_torn_tail(data: &[u8], base: u64, off: usize, next: Option<usize>) -> bool {
    let mut c = Cursor::new(data.get(off..).unwrap_or(&[]));
    let (Some(len), Some(_)) = (c.u32(), c.u32()) else {
        return true; // fewer than 8 bytes: the cut hit the header
    };
    let rec_end = off.saturating_add(8).saturating_add(len as usize);
    // Zeros count as a lost page only before the next intact record: a damaged length can
    // claim to run over later records, and zeros inside those say nothing about this one.
    if has_lost_page(data, base, off, next.map_or(rec_end, |n| n.min(rec_end))) {
        return true;
    }
    rec_end >= data.len() && next.is_none()
}

/// Read a framed log: `data` is a file's bytes from file offset `base` on (`base` matters
/// only for page alignment; offsets in the result are relative to `data`). The error is
/// `(offset, detail)` of the record that fails the open under `mode`.
pub fn read_log(data: &[u8], base: u64, mode: WalRecovery) -> Result<LogRead<'_>, (u64, String)> {
    let mut out = LogRead::default();
    let mut off = 0usize;
    while off < data.len() {
        if let Some((payload, end)) = frame_at(data, off) {
            out.records.push((off as u64, payload));
            off = end;
            continue;
        }
        let next = intact_record_after(data, off + 1);
        let torn = is_torn_tail(data, base, off, next);
        let rest = (data.len() - off) as u64;
        let o = off as u64;
        match (mode, torn) {
            (WalRecovery::AbsoluteConsistency, true) => {
                return Err((o, format!("torn record ({rest} bytes to the end of the log)")))
            }
            (WalRecovery::AbsoluteConsistency | WalRecovery::TolerateTornTail, false) => {
                return Err((o, damage_detail(data, off)))
            }
            (_, true) => {
                out.dropped.push((o, rest, DropReason::TornTail));
                out.torn = true;
                out.cut = mode == WalRecovery::PointInTime;
                break;
            }
            (WalRecovery::PointInTime, false) => {
                out.dropped.push((o, rest, DropReason::Damaged));
                out.cut = true;
                break;
            }
            (WalRecovery::SkipDamaged, false) => {
                let next = next.unwrap_or(data.len());
                out.dropped.push((o, (next - off) as u64, DropReason::Damaged));
                off = next;
            }
        }
    }
    Ok(out)
}

/// Where a store's open records the log ranges it dropped ([`crate::Db::recovery_report`]).
pub type RecoveryLog = std::sync::Arc<parking_lot::Mutex<Vec<Dropped>>>;

/// Replay a sequence of log files (`paths`, oldest first) under `mode`: `each` gets every
/// intact record's file, offset and payload, in order; dropped ranges go to `report`.
///
/// `whole_older`: the design syncs a log whole before starting the next one, so a torn tail
/// in any but the newest is damage, not a crash ([`WalRecovery::PointInTime`] cuts there,
/// [`WalRecovery::SkipDamaged`] drops it and goes on). After a point-in-time cut, later
/// files are dropped whole ([`DropReason::AfterCut`]).
///
/// A file that had anything dropped is rewritten (write-temp, fsync, rename, fsync-dir) to
/// exactly the records replayed from it, before `each` sees them: the log on disk then
/// says what recovery decided. Otherwise a torn tail that recovery dropped would sit in a
/// log that is no longer the newest once the store writes a new one, and a second crash
/// before that log is flushed would find damage where there is none; and a later open
/// under another mode would replay records a point-in-time recovery had cut.
pub fn replay_logs(
    fs: &dyn crate::fs::Fs,
    paths: &[std::path::PathBuf],
    mode: WalRecovery,
    whole_older: bool,
    report: &RecoveryLog,
    mut each: impl FnMut(&std::path::Path, u64, &[u8]) -> crate::Result<()>,
) -> crate::Result<()> {
    let io = |path: &std::path::Path, what: &str| {
        let p = path.display().to_string();
        let what = what.to_string();
        move |e: std::io::Error| crate::Error::Io(std::io::Error::new(e.kind(), format!("{what}{p}: {e}")))
    };
    let datas = paths.iter().map(|p| fs.read_all(p).map_err(io(p, ""))).collect::<crate::Result<Vec<_>>>()?;
    // Pass 1: decide, failing before anything is changed.
    let mut reads = Vec::with_capacity(paths.len());
    let mut cut = false;
    // A log is the newest that was written to when every later one is empty: a new log is
    // created before the previous one's last sync, and a crash can keep the creation.
    let newest = datas.iter().rposition(|d| !d.is_empty()).unwrap_or(0);
    for (i, (path, data)) in paths.iter().zip(&datas).enumerate() {
        if cut {
            reads.push(None);
            continue;
        }
        let last = i >= newest;
        let r = read_log(data, 0, mode).map_err(|(o, d)| crate::Error::corruption(path, o, format!("WAL {d}")))?;
        if let (true, false, WalRecovery::TolerateTornTail, Some(&(o, _, DropReason::TornTail))) =
            (whole_older, last, mode, r.dropped.last())
        {
            return Err(crate::Error::corruption(
                path,
                o,
                "a WAL that was synced whole before the next one started has a damaged last record",
            ));
        }
        cut = r.cut;
        reads.push(Some(r));
    }
    // Pass 2: replay every record (a record that fails to decode aborts the open before
    // anything is changed), then rewrite what had anything dropped, newest log first, so a
    // crash in between never leaves a cut log followed by an intact later one.
    for (path, r) in paths.iter().zip(&reads) {
        for &(o, p) in r.iter().flat_map(|r| &r.records) {
            each(path, o, p)?;
        }
    }
    for (i, ((path, data), r)) in paths.iter().zip(&datas).zip(&reads).enumerate().rev() {
        let last = i >= newest;
        let drop = |offset: u64, len: u64, reason| {
            report.lock().push(Dropped { file: path.clone(), offset, len, reason });
        };
        let Some(r) = r else {
            if !data.is_empty() {
                fs.write_atomic(path, &[]).map_err(io(path, "rewriting "))?;
                drop(0, data.len() as u64, DropReason::AfterCut);
            }
            continue;
        };
        if !r.dropped.is_empty() {
            let mut kept = Vec::with_capacity(data.len());
            for &(o, p) in &r.records {
                let o = o as usize;
                kept.extend_from_slice(data.get(o..o + 8 + p.len()).unwrap_or_default());
            }
            fs.write_atomic(path, &kept).map_err(io(path, "rewriting "))?;
        }
        for &(o, len, reason) in &r.dropped {
            let reason =
                if whole_older && !last && reason == DropReason::TornTail { DropReason::Damaged } else { reason };
            drop(o, len, reason);
        }
    }
    report.lock().sort_by(|a, b| (&a.file, a.offset).cmp(&(&b.file, b.offset)));
    Ok(())
}

/// What is wrong with the bad, non-torn record at `off`.
fn damage_detail(data: &[u8], off: usize) -> String {
    let mut c = Cursor::new(data.get(off..).unwrap_or(&[]));
    let len = c.u32().unwrap_or(0) as u64;
    let end = off as u64 + 8 + len;
    if end > data.len() as u64 {
        format!("record length {len} runs past the end of the log, but intact records follow it")
    } else {
        "record checksum mismatch".into()
    }
}

#[cfg(test)]
mod tests {
    use super::super::frame;
    use super::*;

    fn log(n: usize) -> (Vec<u8>, Vec<usize>) {
        let mut data = Vec::new();
        let mut offs = Vec::new();
        for i in 0..n {
            offs.push(data.len());
            data.extend_from_slice(&frame(format!("record {i} {}", "x".repeat(i * 7)).as_bytes()));
        }
        (data, offs)
    }

    #[test]
    fn intact_logs_read_whole_in_every_mode() {
        let (data, offs) = log(5);
        for m in WalRecovery::ALL {
            let r = read_log(&data, 0, m).map_err(|e| e.1).unwrap_or_default();
            assert_eq!(r.records.iter().map(|r| r.0 as usize).collect::<Vec<_>>(), offs, "{m}");
            assert!(r.dropped.is_empty() && !r.torn && !r.cut);
        }
    }

    #[test]
    fn a_cut_last_record_is_torn_and_a_damaged_length_mid_log_is_not() {
        let (data, offs) = log(6);
        for cut in 1..(data.len() - offs[5]) {
            let d = &data[..data.len() - cut];
            let r = read_log(d, 0, WalRecovery::TolerateTornTail).map_err(|e| e.1).unwrap_or_default();
            assert_eq!((r.records.len(), r.torn), (5, true), "cut {cut}");
            assert!(read_log(d, 0, WalRecovery::AbsoluteConsistency).is_err());
        }
        // The length of record 2 grown past the end: records 3..5 still verify after it.
        for byte in 0..4 {
            let mut d = data.clone();
            d[offs[2] + byte] ^= 0x80;
            let e = read_log(&d, 0, WalRecovery::TolerateTornTail).err();
            assert_eq!(e.as_ref().map(|e| e.0), Some(offs[2] as u64), "length byte {byte}: {e:?}");
            // Skipping resumes at record 3.
            let r = read_log(&d, 0, WalRecovery::SkipDamaged).map_err(|e| e.1).unwrap_or_default();
            assert_eq!(r.records.len(), 5);
            assert_eq!(r.dropped, vec![(offs[2] as u64, (offs[3] - offs[2]) as u64, DropReason::Damaged)]);
            let r = read_log(&d, 0, WalRecovery::PointInTime).map_err(|e| e.1).unwrap_or_default();
            assert_eq!((r.records.len(), r.cut), (2, true));
        }
    }

    #[test]
    fn a_value_holding_one_frame_does_not_make_a_torn_tail_damage() {
        let mut data = frame(b"first");
        let inner = frame(b"embedded frame inside a value");
        let mut value = b"prefix".to_vec();
        value.extend_from_slice(&inner);
        value.extend_from_slice(&[0xa5; 300]);
        let whole = frame(&value);
        data.extend_from_slice(&whole[..whole.len() - 100]); // cut inside the value's tail
        let r = read_log(&data, 0, WalRecovery::TolerateTornTail).map_err(|e| e.1).unwrap_or_default();
        assert_eq!((r.records.len(), r.torn), (1, true));
    }

    #[test]
    fn replay_cuts_later_logs_at_a_point_in_time_and_refuses_a_torn_older_log() {
        use crate::fs::{FaultFs, Fs};
        let fs = FaultFs::new();
        let dir = std::path::Path::new("/logs");
        fs.create_dir_all(dir).unwrap_or_default();
        let (older, offs) = log(4);
        let newer = log(3).0;
        let paths = [dir.join("a.log"), dir.join("b.log")];
        let run = |older: &[u8], mode, whole_older| {
            fs.write_atomic(&paths[0], older).unwrap_or_default();
            fs.write_atomic(&paths[1], &newer).unwrap_or_default();
            let report = RecoveryLog::default();
            let mut seen = Vec::new();
            let r = replay_logs(&fs, &paths, mode, whole_older, &report, |p, o, _| {
                seen.push((p == paths[1].as_path(), o));
                Ok(())
            });
            let dropped = report.lock().iter().map(|d| (d.file == paths[1], d.offset, d.reason)).collect::<Vec<_>>();
            (r.is_ok(), seen.len(), dropped)
        };
        // Damage in the older log's second record.
        let mut damaged = older.clone();
        damaged[offs[1] + 9] ^= 1;
        let (ok, n, dropped) = run(&damaged, WalRecovery::PointInTime, true);
        assert!(ok);
        assert_eq!(n, 1, "only the record before the damage");
        assert_eq!(dropped, vec![(false, offs[1] as u64, DropReason::Damaged), (true, 0, DropReason::AfterCut)]);
        // The logs were rewritten to what was replayed: a later open in the default mode
        // replays the same point in time and finds nothing to drop.
        let report = RecoveryLog::default();
        let mut again = 0;
        replay_logs(&fs, &paths, WalRecovery::TolerateTornTail, true, &report, |_, _, _| {
            again += 1;
            Ok(())
        })
        .map_err(|e| e.to_string())
        .unwrap_or_default();
        assert_eq!((again, report.lock().len()), (1, 0));
        let (ok, n, dropped) = run(&damaged, WalRecovery::SkipDamaged, true);
        assert!(ok && n == 6, "every other record of both logs");
        assert_eq!(dropped, vec![(false, offs[1] as u64, DropReason::Damaged)]);
        assert!(!run(&damaged, WalRecovery::TolerateTornTail, true).0);
        // The older log cut inside its last record: a torn tail where the design synced the
        // log whole is damage; where it did not, it is an ordinary torn tail.
        let cut = &older[..older.len() - 3];
        assert!(!run(cut, WalRecovery::TolerateTornTail, true).0);
        let (ok, n, dropped) = run(cut, WalRecovery::TolerateTornTail, false);
        assert!(ok && n == 6);
        assert_eq!(dropped, vec![(false, offs[3] as u64, DropReason::TornTail)]);
        let (ok, n, dropped) = run(cut, WalRecovery::SkipDamaged, true);
        assert!(ok && n == 6);
        assert_eq!(dropped, vec![(false, offs[3] as u64, DropReason::Damaged)]);
        let (ok, n, _) = run(cut, WalRecovery::PointInTime, true);
        assert!(ok && n == 3);
    }

    /// Review finding: zeros inside *later* records made a damaged length field look like a
    /// lost page, and the rest of the log was dropped as a torn tail.
    #[test]
    fn zeros_in_later_records_do_not_excuse_a_damaged_length() {
        let mut data = frame(b"first record");
        let second = data.len();
        data.extend_from_slice(&frame(b"second record"));
        data.extend_from_slice(&frame(&vec![0u8; 3 * 4096]));
        data.extend_from_slice(&frame(b"last record"));
        data[second + 3] ^= 0x40; // the length now runs past the end
        let e = read_log(&data, 0, WalRecovery::TolerateTornTail).err();
        assert_eq!(e.map(|e| e.0), Some(second as u64));
    }

    /// Review finding: a new log is created before the previous one's last sync; a crash can
    /// keep the (empty) new log and lose the old one's tail, which is then still the newest
    /// log written to.
    #[test]
    fn a_torn_log_followed_only_by_empty_logs_is_the_newest() {
        use crate::fs::{FaultFs, Fs};
        let fs = FaultFs::new();
        let dir = std::path::Path::new("/logs");
        fs.create_dir_all(dir).unwrap_or_default();
        let (data, _) = log(3);
        let paths = [dir.join("a.log"), dir.join("b.log")];
        fs.write_atomic(&paths[0], &data[..data.len() - 2]).unwrap_or_default();
        fs.write_atomic(&paths[1], &[]).unwrap_or_default();
        let report = RecoveryLog::default();
        let mut n = 0;
        let r = replay_logs(&fs, &paths, WalRecovery::TolerateTornTail, true, &report, |_, _, _| {
            n += 1;
            Ok(())
        });
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(n, 2);
        assert_eq!(report.lock().first().map(|d| d.reason), Some(DropReason::TornTail));
    }
}
