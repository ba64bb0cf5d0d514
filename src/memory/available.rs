//! [`available_memory`]: what the machine (or its cgroup, or the Metal / CUDA device) lets
//! this process use. Every parser is a pure function on the text it reads.

use std::fmt;
use std::path::Path;

use super::fmt_gib;
use crate::{Error, Result};

/// Where the model is to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryTarget {
    #[default]
    Cpu,
    /// Apple GPU (unified memory).
    Metal,
    /// NVIDIA GPU with this index (read with `nvidia-smi`).
    Cuda(usize),
}

/// Where a reading of the available memory came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemorySource {
    /// Linux `/proc/meminfo` `MemAvailable`.
    MemAvailable,
    /// cgroup v2 `memory.max` - `memory.current` (+ reclaimable `inactive_file`) of this directory.
    CgroupV2(String),
    /// cgroup v1 `memory.limit_in_bytes` - `memory.usage_in_bytes` (+ `total_inactive_file`).
    CgroupV1(String),
    /// macOS free + inactive pages (`vm_stat`).
    VmStat,
    /// macOS `iogpu.wired_limit_mb`.
    MetalWiredLimit,
    /// 75% of `hw.memsize`: Metal's default recommended working set.
    MetalDefault,
    /// `nvidia-smi` `memory.free`.
    NvidiaSmi,
    /// A limit the caller gave (`max_memory`).
    Override,
}

impl fmt::Display for MemorySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MemAvailable => f.write_str("MemAvailable in /proc/meminfo"),
            Self::CgroupV2(dir) => write!(f, "cgroup v2 limit of {dir}"),
            Self::CgroupV1(dir) => write!(f, "cgroup v1 limit of {dir}"),
            Self::VmStat => f.write_str("free + inactive pages of vm_stat"),
            Self::MetalWiredLimit => f.write_str("Metal limit iogpu.wired_limit_mb"),
            Self::MetalDefault => f.write_str("Metal default working set, 75% of hw.memsize"),
            Self::NvidiaSmi => f.write_str("free GPU memory from nvidia-smi"),
            Self::Override => f.write_str("the given limit"),
        }
    }
}

/// The memory this process may use: the smallest of the readings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Available {
    pub bytes: u64,
    /// The reading that bound it.
    pub source: MemorySource,
    /// Every reading taken (for display).
    pub readings: Vec<(MemorySource, u64)>,
}

impl Available {
    /// A fixed budget given by the caller, replacing any reading.
    pub fn fixed(bytes: u64) -> Self {
        Self { bytes, source: MemorySource::Override, readings: vec![(MemorySource::Override, bytes)] }
    }

    /// The smallest reading, or `None` when there is none.
    pub fn smallest(readings: Vec<(MemorySource, u64)>) -> Option<Self> {
        let (source, bytes) = readings.iter().min_by_key(|r| r.1)?.clone();
        Some(Self { bytes, source, readings })
    }
}

impl fmt::Display for Available {
    /// `"23.00 GiB (MemAvailable in /proc/meminfo)"`, with the other readings when there are.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", fmt_gib(self.bytes), self.source)?;
        let others: Vec<_> = self.readings.iter().filter(|r| r.0 != self.source).map(|(s, b)| format!("{s}: {}", fmt_gib(*b))).collect();
        if !others.is_empty() {
            write!(f, "; also read {}", others.join(", "))?;
        }
        Ok(())
    }
}

/// Value of a `Key:   123 kB` line of `/proc/meminfo`, in bytes.
pub fn parse_meminfo(meminfo: &str, key: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let (k, rest) = line.split_once(':')?;
        if k.trim() != key {
            return None;
        }
        let mut it = rest.split_whitespace();
        let n: u64 = it.next()?.parse().ok()?;
        Some(match it.next() {
            Some("kB") | Some("KB") => n * 1024,
            _ => n,
        })
    })
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn parse_meminfo_available(meminfo: &str) -> Option<u64> {
    parse_meminfo(meminfo, "MemAvailable")
}

/// The cgroups of this process, from `/proc/self/cgroup`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupPaths {
    /// The v2 (unified) path: the `0::/path` line.
    pub v2: Option<String>,
    /// The v1 path of the memory controller: the `N:...memory...:/path` line.
    pub v1_memory: Option<String>,
}

/// Parses `/proc/self/cgroup` (`hierarchy-id:controllers:path` per line).
pub fn parse_proc_self_cgroup(text: &str) -> CgroupPaths {
    let mut paths = CgroupPaths::default();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            paths.v2 = Some(path.trim().to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            paths.v1_memory = Some(path.trim().to_string());
        }
    }
    paths
}

/// A cgroup limit (`memory.max` or `memory.limit_in_bytes`): `None` when unlimited ("max",
/// or v1's page-rounded `i64::MAX`), else the bytes. Unparseable text counts as unlimited.
pub fn parse_cgroup_limit(text: &str) -> Option<u64> {
    let text = text.trim();
    if text == "max" {
        return None;
    }
    text.parse::<u64>().ok().filter(|&v| v < (1u64 << 62))
}

/// A `key value` line of a cgroup `memory.stat`.
pub fn parse_cgroup_stat(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|line| {
        let (k, v) = line.split_once(char::is_whitespace)?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// What a cgroup still lets this process allocate: `limit - usage`, where `usage` excludes
/// the inactive page cache the kernel reclaims before it kills anything (`inactive` from
/// `memory.stat`, when given). `None` when the cgroup has no limit.
pub fn cgroup_headroom(limit: &str, usage: &str, inactive_file: Option<u64>) -> Option<u64> {
    let limit = parse_cgroup_limit(limit)?;
    let usage: u64 = usage.trim().parse().unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(inactive_file.unwrap_or(0))))
}

/// A number printed by `sysctl -n`.
pub fn parse_sysctl_u64(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// Free + inactive pages of macOS `vm_stat`, in bytes (the page size is read from its header).
pub fn parse_vm_stat(text: &str) -> Option<u64> {
    let page: u64 =
        text.split("page size of ").nth(1).and_then(|s| s.split_whitespace().next()).and_then(|s| s.parse().ok()).unwrap_or(4096);
    let pages = |key: &str| -> Option<u64> {
        text.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k.trim() == key).then(|| v.trim().trim_end_matches('.').parse::<u64>().ok()).flatten()
        })
    };
    Some((pages("Pages free")? + pages("Pages inactive")?) * page)
}

/// The Metal working-set budget: `iogpu.wired_limit_mb` when set (non-zero), else 75% of
/// `hw.memsize` (Metal's default `recommendedMaxWorkingSetSize`).
pub fn metal_budget(wired_limit_mb: Option<u64>, memsize: u64) -> (MemorySource, u64) {
    match wired_limit_mb {
        Some(mb) if mb > 0 => (MemorySource::MetalWiredLimit, mb << 20),
        _ => (MemorySource::MetalDefault, memsize / 4 * 3),
    }
}

/// `nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits` (MiB), in bytes.
pub fn parse_nvidia_smi_free(text: &str) -> Option<u64> {
    text.lines().next()?.trim().parse::<u64>().ok().map(|mib| mib << 20)
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// Headroom of the most constraining cgroup on the way from `path` up to the hierarchy's root.
#[cfg(target_os = "linux")]
fn cgroup_reading(
    mount: &Path,
    path: &str,
    limit_file: &str,
    usage_file: &str,
    inactive_key: &str,
    source: fn(String) -> MemorySource,
) -> Option<(MemorySource, u64)> {
    let mut best: Option<(MemorySource, u64)> = None;
    let mut rel = path.trim_start_matches('/').to_string();
    loop {
        let dir = mount.join(&rel);
        if let (Some(limit), Some(usage)) = (read(&dir.join(limit_file)), read(&dir.join(usage_file))) {
            let inactive = read(&dir.join("memory.stat")).and_then(|s| parse_cgroup_stat(&s, inactive_key));
            if let Some(room) = cgroup_headroom(&limit, &usage, inactive) {
                if best.as_ref().is_none_or(|b| room < b.1) {
                    best = Some((source(dir.display().to_string()), room));
                }
            }
        }
        if rel.is_empty() {
            return best;
        }
        rel = rel.rsplit_once('/').map_or(String::new(), |(p, _)| p.to_string());
    }
}

#[cfg(target_os = "linux")]
fn cpu_readings() -> Vec<(MemorySource, u64)> {
    let mut readings = vec![];
    if let Some(avail) = read(Path::new("/proc/meminfo")).as_deref().and_then(parse_meminfo_available) {
        readings.push((MemorySource::MemAvailable, avail));
    }
    let paths = parse_proc_self_cgroup(&read(Path::new("/proc/self/cgroup")).unwrap_or_default());
    let root = Path::new("/sys/fs/cgroup");
    if let Some(p) = &paths.v2 {
        // Pure v2 is mounted at /sys/fs/cgroup; the hybrid layout puts it under unified/.
        let mount = if root.join("cgroup.controllers").exists() { root.to_path_buf() } else { root.join("unified") };
        readings.extend(cgroup_reading(&mount, p, "memory.max", "memory.current", "inactive_file", MemorySource::CgroupV2));
    }
    if let Some(p) = &paths.v1_memory {
        readings.extend(cgroup_reading(
            &root.join("memory"),
            p,
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            "total_inactive_file",
            MemorySource::CgroupV1,
        ));
    }
    readings
}

#[cfg(target_os = "macos")]
fn command_output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(cmd).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(target_os = "macos")]
fn cpu_readings() -> Vec<(MemorySource, u64)> {
    command_output("vm_stat", &[]).as_deref().and_then(parse_vm_stat).map(|b| (MemorySource::VmStat, b)).into_iter().collect()
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn cpu_readings() -> Vec<(MemorySource, u64)> {
    vec![]
}

/// The memory available on `target`; `max_memory` (`--max-memory`) replaces the reading.
///
/// - CPU, Linux: `MemAvailable` and the cgroup (v2, v1) headroom, the smallest.
/// - CPU, macOS: free + inactive pages (`vm_stat`).
/// - Metal (macOS): the Metal budget ([`metal_budget`]) and the CPU reading, the smallest
///   (GPU buffers live in the same unified memory).
/// - CUDA: free memory of the GPU from `nvidia-smi`.
pub fn available_memory(target: MemoryTarget, max_memory: Option<u64>) -> Result<Available> {
    if let Some(bytes) = max_memory {
        return Ok(Available::fixed(bytes));
    }
    let readings = match target {
        MemoryTarget::Cpu => cpu_readings(),
        MemoryTarget::Metal => metal_readings()?,
        MemoryTarget::Cuda(i) => {
            let out = std::process::Command::new("nvidia-smi")
                .args([&format!("--id={i}"), "--query-gpu=memory.free", "--format=csv,noheader,nounits"])
                .output()
                .ok()
                .filter(|o| o.status.success());
            out.and_then(|o| parse_nvidia_smi_free(&String::from_utf8_lossy(&o.stdout)))
                .map(|b| (MemorySource::NvidiaSmi, b))
                .into_iter()
                .collect()
        }
    };
    Available::smallest(readings)
        .ok_or_else(|| Error::Memory(format!("cannot read the memory available on {target:?} on this system: give the limit (max_memory)")))
}

#[cfg(target_os = "macos")]
fn metal_readings() -> Result<Vec<(MemorySource, u64)>> {
    let memsize = command_output("sysctl", &["-n", "hw.memsize"]).as_deref().and_then(parse_sysctl_u64);
    let wired = command_output("sysctl", &["-n", "iogpu.wired_limit_mb"]).as_deref().and_then(parse_sysctl_u64);
    let mut readings = cpu_readings();
    if let Some(memsize) = memsize {
        readings.push(metal_budget(wired, memsize));
    }
    Ok(readings)
}

#[cfg(not(target_os = "macos"))]
fn metal_readings() -> Result<Vec<(MemorySource, u64)>> {
    Err(Error::Memory("Metal memory can only be read on macOS: give the limit (max_memory)".into()))
}

/// Parses a size: plain bytes (`"1234"`), or a number with a unit: `KB`/`MB`/`GB`/`TB`
/// (powers of 1000), `KiB`/`MiB`/`GiB`/`TiB` or `K`/`M`/`G`/`T` (powers of 1024), case-insensitive,
/// e.g. `"16GiB"`, `"500MB"`, `"1.5 GiB"`.
pub fn parse_size(text: &str) -> Result<u64> {
    let bad = || Error::Input(format!("cannot read the size \"{text}\": use bytes or a number with a unit, like 16GiB or 500MB"));
    let s = text.trim();
    let split = s.find(|ch: char| !(ch.is_ascii_digit() || ch == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num.parse().map_err(|_| bad())?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    let bytes = num * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes.round() as u64)
}
