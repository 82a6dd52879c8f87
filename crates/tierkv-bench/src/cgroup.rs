//! Memory cgroups for `tierkv bench --dram-budget`: a group per engine, created under the
//! harness's own memory cgroup, limited to the DRAM budget (page cache included), and
//! removed when the [`MemCgroup`] guard drops — after a failed job or a panic too.
//!
//! - cgroup v2 (preferred when the unified hierarchy has the `memory` controller): a
//!   directory under the harness's group with `memory.max`; the parent's
//!   `cgroup.subtree_control` must enable `memory` (the harness tries `+memory`). Peak:
//!   `memory.peak` (kernels ≥ 5.19).
//! - cgroup v1: a directory in the `memory` hierarchy with `memory.limit_in_bytes`. Peak:
//!   `memory.max_usage_in_bytes` (resettable, so the recovery phase gets its own peak).
//!
//! A missing controller or a hierarchy the harness may not write is an error naming what is
//! missing: `--dram-budget` never runs unconfined.
//!
//! Charges: a page is charged to the group of the task that first faults it in, and stays
//! there when the task moves (v1 `memory.move_charge_at_immigrate` is left at 0; v2 never
//! moves charges). The job child uses that to keep PM pool pages (tmpfs, which cannot be
//! reclaimed without swap) out of the budget: it opens the store — every pool preallocated
//! and faulted — and only then joins the group ([`join`]).
//!
//! Not reported: v1 `memory.failcnt`, which on the kernels this was written on stays 0
//! while reclaim at the limit runs. Reclaim pressure shows in the peak (at the limit), the
//! major faults of `memory.stat` and the disk bytes each workload read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Name prefix of the groups the harness creates (`tierkv-bench-<pid>-<n>`).
pub const PREFIX: &str = "tierkv-bench-";

/// Which cgroup interface a group uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Version {
    /// The legacy per-controller hierarchy (`memory.limit_in_bytes`).
    V1,
    /// The unified hierarchy (`memory.max`).
    V2,
}

/// A memory cgroup the harness created; removed on drop.
#[derive(Debug)]
pub struct MemCgroup {
    path: PathBuf,
    version: Version,
    limit: u64,
}

/// One mount of `/proc/self/mountinfo`: (root within the hierarchy, mount point, fs type,
/// super options).
fn mounts() -> Vec<(String, PathBuf, String, String)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let pre: Vec<&str> = pre.split(' ').collect();
            let post: Vec<&str> = post.split(' ').collect();
            Some((
                pre.get(3)?.to_string(),
                PathBuf::from(pre.get(4)?),
                post.first()?.to_string(),
                post.get(2).map(|s| s.to_string()).unwrap_or_default(),
            ))
        })
        .collect()
}

/// Path of this process's group in a hierarchy mounted at `mount` with root `root`.
fn own_group(mount: &Path, root: &str, path: &str) -> PathBuf {
    let rel = path.strip_prefix(root).unwrap_or(path).trim_start_matches('/');
    if rel.is_empty() {
        mount.to_path_buf()
    } else {
        mount.join(rel)
    }
}

/// The directory under which the harness creates its groups, and the interface.
pub fn parent() -> Result<(PathBuf, Version), String> {
    let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
    let mounts = mounts();
    // v2 first, when the unified hierarchy offers the memory controller to our group.
    if let Some(path) = own.lines().find_map(|l| l.strip_prefix("0::")) {
        for (root, mount, _, _) in mounts.iter().filter(|m| m.2 == "cgroup2") {
            let dir = own_group(mount, root, path);
            let controllers = std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
            if controllers.split_whitespace().any(|c| c == "memory") {
                return Ok((dir, Version::V2));
            }
        }
    }
    let v1 = own.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctl, path) = (f.next()?, f.next()?, f.next()?);
        ctl.split(',').any(|c| c == "memory").then(|| path.to_string())
    });
    if let Some(path) = v1 {
        if let Some((root, mount, _, _)) =
            mounts.iter().find(|m| m.2 == "cgroup" && m.3.split(',').any(|o| o == "memory"))
        {
            return Ok((own_group(mount, root, &path), Version::V1));
        }
    }
    Err("--dram-budget needs the kernel's memory cgroup controller, and this system has none available \
         to this process: no cgroup v2 hierarchy offering `memory` in cgroup.controllers and no cgroup v1 \
         `memory` hierarchy mounted (see /proc/self/cgroup and /proc/self/mountinfo)"
        .into())
}

/// Remove `tierkv-bench-<pid>-<n>` groups under `dir` whose harness process is gone.
pub fn remove_stale(dir: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(PREFIX) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(e.path());
        }
    }
}

fn write(path: &Path, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("writing `{value}` to {}: {e}", path.display()))
}

impl MemCgroup {
    /// Create a group limited to `limit` bytes under this process's own memory cgroup.
    pub fn create(limit: u64) -> Result<MemCgroup, String> {
        let (dir, version) = parent()?;
        Self::create_in(&dir, version, limit)
    }

    /// Create a group limited to `limit` bytes under `dir`.
    pub fn create_in(dir: &Path, version: Version, limit: u64) -> Result<MemCgroup, String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        remove_stale(dir);
        if version == Version::V2 {
            let sub = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
            if !sub.split_whitespace().any(|c| c == "memory") {
                write(&dir.join("cgroup.subtree_control"), "+memory").map_err(|e| {
                    format!(
                        "--dram-budget: cgroup v2 group {} does not delegate the memory controller to \
                         its children and enabling it failed ({e}); run the harness in a group whose \
                         cgroup.subtree_control has `memory`",
                        dir.display()
                    )
                })?;
            }
        }
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{PREFIX}{}-{n}", std::process::id()));
        std::fs::create_dir(&path).map_err(|e| {
            format!(
                "--dram-budget: cannot create the memory cgroup {} ({e}); the harness needs write access \
                 to the memory cgroup hierarchy (run as root, or in a delegated group)",
                path.display()
            )
        })?;
        // From here on the guard removes the group, whatever fails next.
        let g = MemCgroup { path, version, limit };
        let file = match version {
            Version::V1 => "memory.limit_in_bytes",
            Version::V2 => "memory.max",
        };
        write(&g.path.join(file), &limit.to_string()).map_err(|e| format!("--dram-budget: {e}"))?;
        if version == Version::V2 {
            // No swap for the budget either (ignored when swap accounting is off).
            let _ = write(&g.path.join("memory.swap.max"), "0");
        }
        Ok(g)
    }

    /// The group's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The interface.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The file a process writes its pid into to join.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    fn read_u64(&self, file: &str) -> Option<u64> {
        std::fs::read_to_string(self.path.join(file)).ok()?.trim().parse().ok()
    }

    /// Bytes charged now.
    pub fn usage(&self) -> Option<u64> {
        self.read_u64(match self.version {
            Version::V1 => "memory.usage_in_bytes",
            Version::V2 => "memory.current",
        })
    }

    /// Highest charge since creation or the last [`MemCgroup::reset_peak`]; `None` when the
    /// kernel does not record it (v2 before 5.19).
    pub fn peak(&self) -> Option<u64> {
        self.read_u64(match self.version {
            Version::V1 => "memory.max_usage_in_bytes",
            Version::V2 => "memory.peak",
        })
    }

    /// Restart the peak at the current charge (v1; v2 kernels ≥ 6.12 accept the same write,
    /// older ones keep the lifetime peak). Returns whether the kernel accepted it.
    pub fn reset_peak(&self) -> bool {
        match self.version {
            Version::V1 => write(&self.path.join("memory.max_usage_in_bytes"), "0").is_ok(),
            Version::V2 => write(&self.path.join("memory.peak"), "reset").is_ok(),
        }
    }

    /// `memory.stat` as numbers.
    pub fn stat(&self) -> BTreeMap<String, u64> {
        parse_kv(&std::fs::read_to_string(self.path.join("memory.stat")).unwrap_or_default())
    }

    /// Major page faults of the group's tasks so far (reads from disk that missed the page
    /// cache, mapped files included).
    pub fn major_faults(&self) -> Option<u64> {
        let s = self.stat();
        match self.version {
            Version::V1 => s.get("total_pgmajfault").or_else(|| s.get("pgmajfault")).copied(),
            Version::V2 => s.get("pgmajfault").copied(),
        }
    }

    /// Processes the OOM killer killed in the group (v1 `memory.oom_control`, v2
    /// `memory.events`).
    pub fn oom_kills(&self) -> Option<u64> {
        let file = match self.version {
            Version::V1 => "memory.oom_control",
            Version::V2 => "memory.events",
        };
        parse_kv(&std::fs::read_to_string(self.path.join(file)).ok()?).get("oom_kill").copied()
    }
}

fn parse_kv(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        // A group can be removed once it has no tasks; a killed child may take a moment to
        // be torn down, so retry briefly. Charges left (page cache) move to the parent.
        for _ in 0..200 {
            match std::fs::remove_dir(&self.path) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
        eprintln!("warning: could not remove the memory cgroup {}", self.path.display());
    }
}

/// Move the calling process (every thread) into the group whose `cgroup.procs` is `procs`.
pub fn join(procs: &Path) -> Result<(), String> {
    write(procs, &std::process::id().to_string())
}

/// Bytes this process caused to be read from storage so far (`read_bytes` of
/// `/proc/self/io`: page-cache misses, mapped files and readahead included).
pub fn process_read_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("read_bytes:").and_then(|v| v.trim().parse().ok())))
        .unwrap_or(0)
}

/// CPU time (user + system) of every thread of this process so far, in seconds
/// (`getrusage(RUSAGE_SELF)`); 0 if the call fails. Its change over a workload divided by the
/// workload's wall time is how many cores the engine kept busy: client threads and the
/// engine's background threads alike.
pub fn process_cpu_seconds() -> f64 {
    // SAFETY: `ru` is a plain C struct the call fills in; it outlives the call.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is a valid `who`.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

/// Whether `path` is on tmpfs (`statfs` type `TMPFS_MAGIC`): pages there are DRAM, and
/// `msync` has no medium to write to.
pub fn is_tmpfs(path: &Path) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: `c` is a NUL-terminated path; `st` is a plain C struct the call fills in.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `st` outlives the call.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    rc == 0 && st.f_type as i64 == TMPFS_MAGIC
}

/// Allocated bytes (blocks, not lengths) of the files under `dir`, recursively.
pub fn allocated_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => allocated_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}
