//! `--dram-budget`: an engine's whole workload list runs in a child process (the hidden
//! `bench-job` subcommand) confined to a memory cgroup ([`crate::cgroup`]); the parent
//! sends the [`Job`] as JSON on the child's stdin and reads [`Event`]s back, one JSON line
//! each on its stdout, as they happen — so a child the OOM killer stops still reports the
//! workloads it finished.
//!
//! Two phases per engine, run one after the other in the same group:
//! 1. [`Phase::Workloads`]: open, join the group, run every workload, then time a clean
//!    close + reopen. tierkv presets and `limit` open (every PM pool preallocated and
//!    faulted) *before* joining, so PM pages stay charged outside the DRAM budget; the
//!    peers join first, so everything they touch is charged.
//! 2. [`Phase::Recovery`], after the first child exited (its heap is gone, its page cache
//!    stays charged to the group): join, run the crash writer ([`crate::child`]) — which
//!    inherits the group — SIGKILL it, then reopen and verify in this process: the
//!    recovery is timed under the same budget.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Instant;

use crate::engine::{self, EngineSpec};
use crate::run::{self, Loaded, Outcome, Params, Workload};

/// The hidden `tierkv` subcommand the job child runs (the job comes on stdin).
pub const JOB_CMD: &str = "bench-job";

/// Which phase a job child runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Every workload, then (when `reopen`) a clean close + reopen.
    Workloads {
        /// Time a clean close + reopen after the workloads.
        reopen: bool,
    },
    /// Recovery after a crash of a writer process.
    Recovery,
}

/// What a job child does.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Job {
    /// The engine and where its files live.
    pub spec: EngineSpec,
    /// Workload parameters.
    pub params: Params,
    /// The workloads, in order ([`Phase::Workloads`]).
    pub workloads: Vec<Workload>,
    /// The `cgroup.procs` file of the group to join; `None` runs unconfined (tests).
    pub procs: Option<PathBuf>,
    /// The phase.
    pub phase: Phase,
    /// The executable of the crash writer ([`Phase::Recovery`]).
    pub crash_exe: Option<PathBuf>,
}

/// One line of a job child's stdout.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Event {
    /// The child joined the group (tierkv: after open).
    Joined,
    /// A workload finished.
    Outcome(Box<Outcome>),
    /// A workload was not applicable to the engine (`limit` and scans).
    Skipped(Workload),
    /// Seconds of a clean close + reopen after the workloads, and of the open alone (to its
    /// first served read).
    Reopen(f64, f64),
    /// Recovery after a crash was measured.
    Crash(crate::child::CrashRecovery),
    /// Recovery after a crash could not be measured (the reason).
    CrashNotMeasured(String),
    /// Acknowledged writes were lost by the crash: the run fails.
    Lost(String),
    /// The job failed.
    Error(String),
}

fn emit(ev: &Event) -> Result<(), String> {
    let line = serde_json::to_string(ev).map_err(|e| e.to_string())? + "\n";
    let mut out = std::io::stdout().lock();
    out.write_all(line.as_bytes()).and_then(|_| out.flush()).map_err(|e| format!("job child stdout: {e}"))
}

/// The job child's work: read the [`Job`] from stdin, run it, report [`Event`]s on stdout.
/// An error is also reported as [`Event::Error`].
pub fn job_main() -> Result<(), String> {
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::stdin(), &mut text).map_err(|e| format!("job: stdin: {e}"))?;
    let job: Job = serde_json::from_str(&text).map_err(|e| format!("job: bad job JSON: {e}"))?;
    let r = run_job(&job);
    if let Err(e) = &r {
        let _ = emit(&Event::Error(e.clone()));
    }
    r
}

fn join(job: &Job) -> Result<(), String> {
    if let Some(p) = &job.procs {
        crate::cgroup::join(p).map_err(|e| format!("joining the memory cgroup: {e}"))?;
    }
    emit(&Event::Joined)
}

fn run_job(job: &Job) -> Result<(), String> {
    let name = &job.spec.name;
    match job.phase {
        Phase::Workloads { reopen } => {
            let peer = engine::is_peer(name);
            if peer {
                join(job)?;
            }
            let mut e = engine::open(&job.spec)?;
            if !peer {
                join(job)?;
            }
            let mut loaded = Loaded::default();
            for &w in &job.workloads {
                let bar = crate::cli::progress_bar(&job.params, w, name, "");
                let o = run::run_with_progress(e.as_ref(), w, &job.params, &mut loaded, &bar);
                bar.finish_and_clear();
                match o? {
                    Some(o) => emit(&Event::Outcome(Box::new(o)))?,
                    None => emit(&Event::Skipped(w))?,
                }
            }
            if reopen && e.recovers() {
                let t = Instant::now();
                let open = crate::cli::reopen_to_first_read(e.as_mut(), job.params.key_size)
                    .map_err(|err| format!("{name}: reopen after the workloads failed: {err}"))?;
                emit(&Event::Reopen(t.elapsed().as_secs_f64(), open))?;
            }
            Ok(())
        }
        Phase::Recovery => {
            join(job)?;
            let exe = job.crash_exe.as_deref().ok_or("recovery job without the crash writer's executable")?;
            let p = &job.params;
            let ev = match crate::child::measure(exe, &job.spec, p.num, p.key_size, p.value_size, p.crash_writes) {
                Ok(r) => Event::Crash(r),
                Err(crate::child::CrashError::Lost(m)) => Event::Lost(m),
                Err(crate::child::CrashError::NotMeasured(m)) => Event::CrashNotMeasured(m),
            };
            emit(&ev)
        }
    }
}

/// What the parent saw of a job child.
#[derive(Debug)]
pub struct JobRun {
    /// The events, in order.
    pub events: Vec<Event>,
    /// How the child ended.
    pub status: ExitStatus,
}

impl JobRun {
    /// Why the child failed, if it did: its reported error, or how it died.
    pub fn failure(&self) -> Option<String> {
        use std::os::unix::process::ExitStatusExt;
        if let Some(m) = self.events.iter().find_map(|e| if let Event::Error(m) = e { Some(m) } else { None }) {
            return Some(m.clone());
        }
        match (self.status.success(), self.status.signal()) {
            (true, _) => None,
            (false, Some(sig)) => Some(format!("killed by signal {sig}")),
            (false, None) => Some(format!("exited with {}", self.status)),
        }
    }
}

/// Run `job` in a child (`exe bench-job`), collecting its events until it exits.
pub fn spawn(exe: &Path, job: &Job) -> Result<JobRun, String> {
    let json = serde_json::to_string(job).map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .arg(JOB_CMD)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting the job child {}: {e}", exe.display()))?;
    let written = child.stdin.take().map(|mut i| i.write_all(json.as_bytes()));
    let out = child.stdout.take();
    let mut events = Vec::new();
    if let Some(out) = out {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            match serde_json::from_str::<Event>(&line) {
                Ok(ev) => {
                    // A line per finished workload: long confined runs show where they are
                    // even when stderr is a log file (no progress bar is drawn there).
                    if let Event::Outcome(o) = &ev {
                        eprintln!(
                            "{} {} B {}: {:.0} ops/s, {} ops in {:.1} s{}",
                            o.engine,
                            o.value_size,
                            o.workload.name(),
                            o.ops_per_sec,
                            o.ops,
                            o.seconds,
                            if o.capped { " (capped)" } else { "" }
                        );
                    }
                    events.push(ev)
                }
                // Whatever else an engine printed goes to stderr, not into the results.
                Err(_) => eprintln!("{line}"),
            }
        }
    }
    let status = child.wait().map_err(|e| format!("waiting for the job child: {e}"))?;
    if let Some(Err(e)) = written {
        if events.is_empty() {
            return Err(format!("sending the job to the child: {e}"));
        }
    }
    Ok(JobRun { events, status })
}
