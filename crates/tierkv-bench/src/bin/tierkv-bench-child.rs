//! The crash child of [`tierkv_bench::child`] as its own executable, for the bench crate's
//! tests (the `tierkv` binary runs the same code as its hidden `bench-crash-child`
//! subcommand). Arguments: `bench-crash-child --engine E --dir D --pm-dir P --num N
//! --key-size K --value-size V [--max-writes W] [--durable] [--pm-budget BYTES] [--pm-profile P]`, or
//! `bench-job` (the job child of [`tierkv_bench::job`], its job on stdin).

use std::path::PathBuf;
use std::process::ExitCode;

use tierkv_bench::child::{child_main, CHILD_CMD, CHILD_MAX_WRITES};
use tierkv_bench::engine::EngineSpec;
use tierkv_bench::job::{job_main, JOB_CMD};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(JOB_CMD) {
        return match job_main() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tierkv-bench-child: {e}");
                ExitCode::from(2)
            }
        };
    }
    match parse(&args) {
        Ok((spec, num, key_size, value_size, max_writes)) => {
            match child_main(&spec, num, key_size, value_size, max_writes) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("tierkv-bench-child: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Err(e) => {
            eprintln!("tierkv-bench-child: {e}");
            ExitCode::from(2)
        }
    }
}

fn parse(args: &[String]) -> Result<(EngineSpec, u64, usize, usize, u64), String> {
    if args.first().map(String::as_str) != Some(CHILD_CMD) {
        return Err(format!("usage: tierkv-bench-child {CHILD_CMD} --engine E --dir D ..."));
    }
    let mut spec = EngineSpec::default();
    let (mut num, mut key_size, mut value_size) = (0u64, 16usize, 100usize);
    let mut max_writes = CHILD_MAX_WRITES;
    let mut it = args.iter().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--durable" {
            spec.durable = true;
            continue;
        }
        let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |_| format!("bad value for {flag}: {v}");
        match flag.as_str() {
            "--engine" => spec.name = v.clone(),
            "--dir" => spec.dir = PathBuf::from(v),
            "--pm-dir" => spec.pm_dir = PathBuf::from(v),
            "--num" => num = v.parse().map_err(bad)?,
            "--key-size" => key_size = v.parse().map_err(bad)?,
            "--value-size" => value_size = v.parse().map_err(bad)?,
            "--max-writes" => max_writes = v.parse().map_err(bad)?,
            "--pm-budget" => spec.pm_budget = Some(v.parse().map_err(bad)?),
            "--pm-profile" => spec.pm_profile = Some(v.clone()),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok((spec, num, key_size, value_size, max_writes))
}
