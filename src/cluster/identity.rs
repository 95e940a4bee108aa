//! Who am I in a cluster job: this process's rank among its peers, read from `--shard K/S` or
//! from the environment variables each launcher sets.
//!
//! This is configuration, so it reads the environment (through a lookup function, so that the
//! tests can hand it a map). Two kinds of answer: an explicit shard (`--shard K/S`: this process
//! does shard K and nothing else), or a rank among `size` processes, which then works its own
//! shards first and takes unclaimed ones after (see [`super::ShardSpec`]).

use crate::error::{Error, Result};

use super::ShardSpec;

/// Parse `K/S` (`--shard`).
pub(crate) fn parse_shard(s: &str) -> Result<(u32, u32)> {
    let bad = || {
        Error::Usage(format!(
            "--shard {s}: expected K/S with 0 ≤ K < S, e.g. --shard 3/16"
        ))
    };
    let (k, n) = s.split_once('/').ok_or_else(bad)?;
    let (k, n): (u32, u32) = (
        k.trim().parse().map_err(|_| bad())?,
        n.trim().parse().map_err(|_| bad())?,
    );
    if n == 0 || k >= n {
        return Err(bad());
    }
    Ok((k, n))
}

/// Decide this process's part from `--shard`, `--shards` and the launcher's variables
/// (`var` looks one up). `None`: an ordinary single-process run.
///
/// Order: `--shard K/S`; `JOB_COMPLETION_INDEX` (Kubernetes Indexed Job, needs `--shards S`:
/// S processes, one shard each to start with); SLURM (`SLURM_PROCID`/`SLURM_NTASKS`, combined
/// with `SLURM_ARRAY_TASK_ID`/`SLURM_ARRAY_TASK_COUNT` in array jobs); Open MPI
/// (`OMPI_COMM_WORLD_RANK`/`_SIZE`); PMI (`PMI_RANK`/`PMI_SIZE`, MPICH, Intel MPI, Cray). A
/// launcher that says one process in all is a single-process run, unless `--shards` asks for
/// shards anyway.
pub(crate) fn detect(
    shard: Option<&str>,
    shards: Option<u32>,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<ShardSpec>> {
    if let Some(s) = shard {
        let (k, n) = parse_shard(s)?;
        return Ok(Some(ShardSpec::One { k, s: n }));
    }
    if shards == Some(0) {
        return Err(Error::Usage("--shards 0: give at least 1 shard".into()));
    }
    let num = |k: &str| -> Result<Option<u32>> {
        match var(k) {
            None => Ok(None),
            Some(v) if v.trim().is_empty() => Ok(None),
            Some(v) => v.trim().parse().map(Some).map_err(|_| {
                Error::Usage(format!(
                    "environment variable {k}={v:?} is not a number; unset it or pass --shard K/S"
                ))
            }),
        }
    };
    let found: Option<(u32, u32, &'static str)> = if let Some(i) = num("JOB_COMPLETION_INDEX")? {
        let Some(s) = shards else {
            return Err(Error::Usage(format!(
                "JOB_COMPLETION_INDEX={i} (a Kubernetes Indexed Job) does not say how many processes there are: pass --shards S with S = the job's completions"
            )));
        };
        Some((i, s, "JOB_COMPLETION_INDEX"))
    } else if let (Some(r), Some(n)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
        match (num("SLURM_ARRAY_TASK_ID")?, num("SLURM_ARRAY_TASK_COUNT")?) {
            (Some(a), Some(c)) => Some((a * n + r, c * n, "SLURM array job")),
            _ => Some((r, n, "SLURM_PROCID/SLURM_NTASKS")),
        }
    } else if let (Some(a), Some(c)) = (num("SLURM_ARRAY_TASK_ID")?, num("SLURM_ARRAY_TASK_COUNT")?)
    {
        Some((a, c, "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT"))
    } else if let (Some(r), Some(n)) = (num("OMPI_COMM_WORLD_RANK")?, num("OMPI_COMM_WORLD_SIZE")?)
    {
        Some((r, n, "OMPI_COMM_WORLD_RANK/SIZE"))
    } else if let (Some(r), Some(n)) = (num("PMI_RANK")?, num("PMI_SIZE")?) {
        Some((r, n, "PMI_RANK/PMI_SIZE"))
    } else {
        None
    };
    match found {
        Some((rank, size, _)) if size <= 1 && shards.is_none() => {
            let _ = rank;
            Ok(None)
        }
        Some((rank, size, source)) => {
            if size == 0 || rank >= size {
                return Err(Error::Usage(format!(
                    "{source}: rank {rank} of {size} processes is impossible; check the launcher's variables or pass --shard K/S"
                )));
            }
            Ok(Some(ShardSpec::Rank {
                rank,
                size,
                shards,
                source,
            }))
        }
        None => Ok(shards.map(|s| ShardSpec::Rank {
            rank: 0,
            size: 1,
            shards: Some(s),
            source: "--shards",
        })),
    }
}

/// The GPU this process should use when a launcher starts several processes per node without
/// setting `CUDA_VISIBLE_DEVICES` for each: `SLURM_LOCALID` (its index on the node). `None`
/// when the launcher already restricted the visible GPUs, or says nothing.
pub(crate) fn local_gpu(var: &dyn Fn(&str) -> Option<String>) -> Option<usize> {
    if var("CUDA_VISIBLE_DEVICES").is_some() {
        return None;
    }
    let per_node: usize = var("SLURM_NTASKS_PER_NODE")
        .or_else(|| var("SLURM_TASKS_PER_NODE"))
        .and_then(|v| v.split(['(', ',']).next()?.trim().parse().ok())?;
    if per_node <= 1 {
        return None;
    }
    var("SLURM_LOCALID")?.trim().parse().ok()
}

/// This host's name (for claim files and messages): the kernel's, else `HOSTNAME`.
pub(crate) fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| env_var("HOSTNAME"))
        .unwrap_or_else(|| "unknown-host".into())
}

/// Look a variable up in this process's environment.
pub(crate) fn env_var(k: &str) -> Option<String> {
    std::env::var(k).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn rank(spec: Option<ShardSpec>) -> (u32, u32, u32) {
        match spec {
            Some(ShardSpec::Rank {
                rank, size, shards, ..
            }) => (rank, size, shards.unwrap_or(0)),
            other => panic!("expected a rank, got {other:?}"),
        }
    }

    #[test]
    fn each_launcher_is_recognised() {
        let slurm = with(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "4")]);
        assert_eq!(
            rank(detect(None, None, &slurm).unwrap()),
            (2, 4, 0),
            "0: chosen per step"
        );
        let array = with(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_ARRAY_TASK_ID", "5"),
            ("SLURM_ARRAY_TASK_COUNT", "8"),
        ]);
        assert_eq!(rank(detect(None, Some(8), &array).unwrap()), (5, 8, 8));
        let k8s = with(&[("JOB_COMPLETION_INDEX", "3")]);
        assert_eq!(rank(detect(None, Some(6), &k8s).unwrap()), (3, 6, 6));
        assert!(detect(None, None, &k8s).is_err(), "needs --shards");
        let ompi = with(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "3")]);
        assert_eq!(rank(detect(None, None, &ompi).unwrap()), (1, 3, 0));
        let pmi = with(&[("PMI_RANK", "0"), ("PMI_SIZE", "2")]);
        assert_eq!(rank(detect(None, Some(5), &pmi).unwrap()), (0, 2, 5));
    }

    #[test]
    fn explicit_shard_wins_and_single_process_stays_single() {
        let slurm = with(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "4")]);
        assert!(matches!(
            detect(Some("1/3"), None, &slurm).unwrap(),
            Some(ShardSpec::One { k: 1, s: 3 })
        ));
        let one = with(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]);
        assert!(detect(None, None, &one).unwrap().is_none());
        assert!(detect(None, None, &with(&[])).unwrap().is_none());
        for bad in ["3/3", "x/2", "1", "0/0"] {
            assert!(detect(Some(bad), None, &with(&[])).is_err(), "{bad}");
        }
        let broken = with(&[("SLURM_PROCID", "x"), ("SLURM_NTASKS", "4")]);
        assert!(detect(None, None, &broken).is_err());
    }

    #[test]
    fn local_gpu_from_slurm_localid() {
        let v = with(&[("SLURM_LOCALID", "3"), ("SLURM_NTASKS_PER_NODE", "8")]);
        assert_eq!(local_gpu(&v), Some(3));
        let v = with(&[
            ("SLURM_LOCALID", "3"),
            ("SLURM_NTASKS_PER_NODE", "8"),
            ("CUDA_VISIBLE_DEVICES", "3"),
        ]);
        assert_eq!(local_gpu(&v), None);
        let v = with(&[("SLURM_LOCALID", "0"), ("SLURM_TASKS_PER_NODE", "1(x2)")]);
        assert_eq!(local_gpu(&v), None);
    }
}
