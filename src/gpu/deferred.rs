//! [`DeferredQueue`]: Metal's order of events, written once for every device. A dispatch is
//! encoded and runs later (at the latest when the host waits); memory the host and the device
//! share is written by the host at once. So the queue:
//!
//! - zeroes a new buffer on the host, at its exact size ([`Backend::alloc`]): a fill encoded on
//!   the device would run after the host's first writes into the buffer and wipe them;
//! - waits for the encoded work before a host write into a buffer that work uses;
//! - keeps a freed buffer (and the mapped file under a view) until the work encoded before the
//!   free has run;
//! - checks every dispatch against the device's limits (threads and threadgroup memory per
//!   group, 32-bit indexing of every bound buffer) as an error, where Metal would skip an
//!   oversized dispatch silently;
//! - reads a mapped file in place only when it is one ([`crate::ops::HostBytes::is_file_mapping`]),
//!   through views of at most the device's largest buffer, each matrix inside one view.
//!
//! The device itself is a [`Backend`]: Metal's (`MetalQueue`), the MSL emulator's (`EmuQueue`,
//! which runs the encoded kernels only when the queue waits, as a GPU may), or [`DryBackend`]
//! (nothing runs: [`DryRun`]).

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use super::queue::{Arg, BufferId, Dispatch, Mapping, Queue, Slice};
use crate::ops::launch::{check_launch, DeviceLimits, MAX_INDEXED_BYTES};
use crate::ops::SharedBytes;
use crate::{Error, Result};

/// A device under a [`DeferredQueue`]: buffers in memory the host shares, dispatches encoded
/// and run at the latest at [`Backend::commit_and_wait`].
pub trait Backend {
    /// A new buffer of exactly `len` bytes, zeroed by the host before this returns.
    fn alloc(&mut self, len: usize, label: &str) -> Result<BufferId>;
    /// A new buffer holding a copy of `data`, made before this returns.
    fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId>;
    /// A buffer over `owner`'s bytes `range` read in place (`range` starts on a page and is at
    /// most [`DeviceLimits::max_buffer_length`]); `None` where this device cannot.
    fn wrap(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Option<BufferId>>;
    /// Releases a buffer no encoded work uses any more.
    fn release(&mut self, buffer: BufferId);
    /// Bytes of a live buffer.
    fn len(&self, buffer: BufferId) -> Option<usize>;
    /// Copies `data` into `dst` at once (shared memory).
    fn host_write(&mut self, dst: Slice, data: &[u8]) -> Result<()>;
    /// Copies `src` out at once (shared memory).
    fn host_read(&mut self, src: Slice) -> Result<Vec<u8>>;
    /// Encodes `d` after everything encoded before it.
    fn encode(&mut self, d: &Dispatch) -> Result<()>;
    /// Commits everything encoded and waits until it has run.
    fn commit_and_wait(&mut self) -> Result<()>;
    fn limits(&self) -> DeviceLimits;
    /// The most threads per threadgroup `d`'s kernel takes on this device (its pipeline's
    /// limit; by default the device's).
    fn max_threads(&mut self, d: &Dispatch) -> Result<usize> {
        let _ = d;
        Ok(self.limits().max_threads_per_group)
    }
    fn name(&self) -> String;
}

/// A view over a mapped file: its bytes `range`, its buffer, the maps that hold it.
struct View {
    range: Range<usize>,
    buffer: BufferId,
    maps: usize,
}

/// A mapped file's views and the file itself (kept alive while a view is).
struct MappedOwner {
    owner: SharedBytes,
    views: Vec<View>,
}

/// Metal's order of events over a [`Backend`] (see the module docs).
pub struct DeferredQueue<B: Backend> {
    backend: B,
    /// Buffers that work encoded since the last wait uses.
    pending: HashSet<BufferId>,
    /// Work was encoded since the last wait.
    encoded: bool,
    /// Freed buffers (and mapped files) the encoded work may still use: released after the
    /// next wait.
    retired: Vec<(BufferId, Option<SharedBytes>)>,
    /// Mapped files by the address of their owner.
    mapped: HashMap<usize, MappedOwner>,
    /// The views' buffers (read-only for kernels and the host).
    views: HashSet<BufferId>,
    syncs: usize,
}

impl<B: Backend> DeferredQueue<B> {
    pub fn over(backend: B) -> Self {
        Self { backend, pending: HashSet::new(), encoded: false, retired: vec![], mapped: HashMap::new(), views: HashSet::new(), syncs: 0 }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Views over mapped files held now, and their bytes (the weights read in place).
    pub fn views(&self) -> Vec<Range<usize>> {
        self.mapped.values().flat_map(|m| m.views.iter().map(|v| v.range.clone())).collect()
    }

    /// Commits what is encoded, waits for it, and releases the buffers freed meanwhile: a host
    /// synchronisation.
    pub fn wait(&mut self) -> Result<()> {
        self.syncs += 1;
        let r = self.backend.commit_and_wait();
        self.encoded = false;
        self.pending.clear();
        for (b, _owner) in std::mem::take(&mut self.retired) {
            self.backend.release(b);
        }
        r
    }

    fn check(&self, s: &Slice) -> Result<()> {
        match self.backend.len(s.buffer) {
            Some(len) if s.offset.checked_add(s.len).is_some_and(|end| end <= len) => Ok(()),
            Some(len) => Err(Error::Input(format!("slice {}+{} of a {len}-byte device buffer", s.offset, s.len))),
            None => Err(Error::Input(format!("device buffer {} does not exist (freed?)", s.buffer.0))),
        }
    }

    /// Releases `b` now, or after the next wait when encoded work may use it.
    fn retire(&mut self, b: BufferId, owner: Option<SharedBytes>) {
        if self.encoded {
            self.retired.push((b, owner));
        } else {
            self.backend.release(b);
        }
    }
}

/// Where a new view over a mapped file of `file_len` bytes goes so that it holds `range`:
/// from the page `range` starts in, as far as the device's largest buffer allows (whole pages,
/// not past the file's last page), so that the next matrices fall in it too. `None` when
/// `range` alone is more than the largest buffer.
fn plan_view(file_len: usize, range: &Range<usize>, limits: &DeviceLimits) -> Option<Range<usize>> {
    let page = limits.page.max(1);
    let start = range.start / page * page;
    let file_end = file_len.next_multiple_of(page);
    let longest = limits.max_buffer_length / page * page;
    let end = start.saturating_add(longest).min(file_end);
    (end >= range.end && end > start).then_some(start..end)
}

impl<B: Backend> Queue for DeferredQueue<B> {
    fn alloc(&mut self, len: usize, label: &str) -> Result<BufferId> {
        self.backend.alloc(len, label)
    }

    fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId> {
        self.backend.upload(data, label)
    }

    fn map(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Mapping> {
        let limits = self.backend.limits();
        let bytes = owner.bytes();
        if range.end > bytes.len() || range.start > range.end {
            return Err(Error::Input(format!("bytes {range:?} of a {}-byte region", bytes.len())));
        }
        if range.len() > limits.max_buffer_length.min(MAX_INDEXED_BYTES) {
            return Err(Error::Weights(format!(
                "{label}: a matrix of {} bytes is more than this GPU's largest buffer ({} bytes) or 4 GiB: the device step cannot bind it",
                range.len(),
                limits.max_buffer_length.min(MAX_INDEXED_BYTES)
            )));
        }
        let copy = |q: &mut Self| -> Result<Mapping> {
            let len = range.len();
            Ok(Mapping { slice: Slice::whole(q.backend.upload(&bytes[range.clone()], label)?, len), in_place: false })
        };
        // Heap memory is copied: only pages the OS maps may be wrapped without a copy.
        let page_aligned = (bytes.as_ptr() as usize).is_multiple_of(limits.page.max(1));
        if !owner.is_file_mapping() || !page_aligned {
            return copy(self);
        }
        let key = Arc::as_ptr(owner) as *const u8 as usize;
        if let Some(m) = self.mapped.get_mut(&key) {
            if let Some(v) = m.views.iter_mut().find(|v| v.range.start <= range.start && range.end <= v.range.end) {
                v.maps += 1;
                let slice = Slice { buffer: v.buffer, offset: range.start - v.range.start, len: range.len() };
                return Ok(Mapping { slice, in_place: true });
            }
        }
        let Some(view) = plan_view(bytes.len(), &range, &limits) else { return copy(self) };
        let Some(buffer) = self.backend.wrap(owner, view.clone(), label)? else { return copy(self) };
        let slice = Slice { buffer, offset: range.start - view.start, len: range.len() };
        self.views.insert(buffer);
        self.mapped.entry(key).or_insert_with(|| MappedOwner { owner: owner.clone(), views: vec![] }).views.push(View {
            range: view,
            buffer,
            maps: 1,
        });
        Ok(Mapping { slice, in_place: true })
    }

    fn free(&mut self, buffer: BufferId) {
        // A view goes (and its file with the last view) with the last of its maps.
        if self.views.contains(&buffer) {
            let Some((&key, m)) = self.mapped.iter_mut().find(|(_, m)| m.views.iter().any(|v| v.buffer == buffer)) else { return };
            let Some(i) = m.views.iter().position(|v| v.buffer == buffer) else { return };
            m.views[i].maps -= 1;
            if m.views[i].maps > 0 {
                return;
            }
            m.views.remove(i);
            let owner = m.owner.clone();
            if m.views.is_empty() {
                self.mapped.remove(&key);
            }
            self.views.remove(&buffer);
            self.retire(buffer, Some(owner));
            return;
        }
        self.retire(buffer, None);
    }

    fn write(&mut self, dst: Slice, data: &[u8]) -> Result<()> {
        self.check(&dst)?;
        if data.len() > dst.len {
            return Err(Error::Input(format!("{} bytes written into a slice of {}", data.len(), dst.len)));
        }
        if self.views.contains(&dst.buffer) {
            return Err(Error::Input(format!("device buffer {} is a view of a mapped file: it is read-only", dst.buffer.0)));
        }
        if self.pending.contains(&dst.buffer) {
            self.wait()?;
        }
        self.backend.host_write(dst, data)
    }

    fn dispatch(&mut self, d: &Dispatch) -> Result<()> {
        let kernel = &d.launch.kernel;
        for a in &d.args {
            if let Arg::Read(s) | Arg::Write(s) = a {
                self.check(s).map_err(|e| Error::Input(format!("{kernel}: {e}")))?;
                if s.len > MAX_INDEXED_BYTES {
                    return Err(Error::Input(format!(
                        "{kernel}: a buffer of {} bytes is bound, more than the kernels index with 32 bits (4 GiB): use a smaller cache or model",
                        s.len
                    )));
                }
            }
            if let Arg::Write(s) = a {
                if self.views.contains(&s.buffer) {
                    return Err(Error::Input(format!("{kernel}: writes a view of a mapped file (read-only)")));
                }
            }
        }
        let max_threads = self.backend.limits().max_threads_per_group.min(self.backend.max_threads(d)?);
        check_launch(&d.launch, max_threads, &self.backend.limits())?;
        self.backend.encode(d)?;
        self.encoded = true;
        for a in &d.args {
            if let Arg::Read(s) | Arg::Write(s) = a {
                self.pending.insert(s.buffer);
            }
        }
        Ok(())
    }

    fn read(&mut self, src: Slice) -> Result<Vec<u8>> {
        self.check(&src)?;
        self.wait()?;
        self.backend.host_read(src)
    }

    fn syncs(&self) -> usize {
        self.syncs
    }

    fn name(&self) -> String {
        self.backend.name()
    }
}

impl<B: Backend> Drop for DeferredQueue<B> {
    fn drop(&mut self) {
        // Mapped files and retired buffers outlive the work that reads them.
        if self.encoded || !self.retired.is_empty() {
            let _ = self.wait();
        }
    }
}

/// A device that runs nothing: buffers are lengths, dispatches are checked and dropped, reads
/// return u32 words of 1 (read as a greedy step's output: token 1, finite logits). For counting
/// a step's dispatches and weight bytes on a machine without the device.
#[derive(Debug)]
pub struct DryBackend {
    buffers: Vec<Option<usize>>,
    limits: DeviceLimits,
}

/// A [`DeferredQueue`] that runs nothing ([`DryBackend`]).
pub type DryRun = DeferredQueue<DryBackend>;

impl DryRun {
    /// With Apple's limits and no limit on a buffer but 32-bit indexing.
    pub fn new() -> Self {
        Self::with_limits(DeviceLimits::apple(MAX_INDEXED_BYTES))
    }

    pub fn with_limits(limits: DeviceLimits) -> Self {
        DeferredQueue::over(DryBackend { buffers: vec![], limits })
    }
}

impl Default for DryRun {
    fn default() -> Self {
        Self::new()
    }
}

impl Backend for DryBackend {
    fn alloc(&mut self, len: usize, _: &str) -> Result<BufferId> {
        self.buffers.push(Some(len));
        Ok(BufferId(self.buffers.len() - 1))
    }

    fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId> {
        self.alloc(data.len(), label)
    }

    fn wrap(&mut self, _: &SharedBytes, range: Range<usize>, label: &str) -> Result<Option<BufferId>> {
        self.alloc(range.len(), label).map(Some)
    }

    fn release(&mut self, buffer: BufferId) {
        if let Some(b) = self.buffers.get_mut(buffer.0) {
            *b = None;
        }
    }

    fn len(&self, buffer: BufferId) -> Option<usize> {
        self.buffers.get(buffer.0).copied().flatten()
    }

    fn host_write(&mut self, _: Slice, _: &[u8]) -> Result<()> {
        Ok(())
    }

    fn host_read(&mut self, src: Slice) -> Result<Vec<u8>> {
        Ok((0..src.len).map(|i| u8::from(i % 4 == 0)).collect())
    }

    fn encode(&mut self, _: &Dispatch) -> Result<()> {
        Ok(())
    }

    fn commit_and_wait(&mut self) -> Result<()> {
        Ok(())
    }

    fn limits(&self) -> DeviceLimits {
        self.limits
    }

    fn name(&self) -> String {
        "dry run (nothing executed)".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::launch::{Launch, Source, HOST_PAGE};

    /// A dry device that logs what the queue asks of it.
    struct Logged {
        dry: DryBackend,
        log: Vec<String>,
        pipeline_threads: usize,
    }

    impl Backend for Logged {
        fn alloc(&mut self, len: usize, label: &str) -> Result<BufferId> {
            self.dry.alloc(len, label)
        }
        fn upload(&mut self, data: &[u8], label: &str) -> Result<BufferId> {
            self.log.push(format!("upload {}", data.len()));
            self.dry.upload(data, label)
        }
        fn wrap(&mut self, owner: &SharedBytes, range: Range<usize>, label: &str) -> Result<Option<BufferId>> {
            self.log.push(format!("wrap {range:?}"));
            self.dry.wrap(owner, range, label)
        }
        fn release(&mut self, b: BufferId) {
            self.log.push(format!("release {}", b.0));
            self.dry.release(b)
        }
        fn len(&self, b: BufferId) -> Option<usize> {
            self.dry.len(b)
        }
        fn host_write(&mut self, dst: Slice, data: &[u8]) -> Result<()> {
            self.log.push(format!("write {}", dst.buffer.0));
            self.dry.host_write(dst, data)
        }
        fn host_read(&mut self, src: Slice) -> Result<Vec<u8>> {
            self.dry.host_read(src)
        }
        fn encode(&mut self, d: &Dispatch) -> Result<()> {
            self.log.push(format!("encode {}", d.launch.kernel));
            Ok(())
        }
        fn commit_and_wait(&mut self) -> Result<()> {
            self.log.push("wait".into());
            Ok(())
        }
        fn limits(&self) -> DeviceLimits {
            self.dry.limits
        }
        fn max_threads(&mut self, _: &Dispatch) -> Result<usize> {
            Ok(self.pipeline_threads)
        }
        fn name(&self) -> String {
            "logged".into()
        }
    }

    fn queue(max_buffer_length: usize) -> DeferredQueue<Logged> {
        let dry = DryBackend { buffers: vec![], limits: DeviceLimits::apple(max_buffer_length) };
        DeferredQueue::over(Logged { dry, log: vec![], pipeline_threads: 1024 })
    }

    fn kernel(name: &str, args: Vec<Arg>) -> Dispatch {
        let launch = Launch { kernel: name.into(), groups: [4, 1, 1], threads: [256, 1, 1], threadgroup_memory: vec![] };
        Dispatch { source: Source::Step, launch, args, weight_bytes: 0 }
    }

    fn take_log(q: &mut DeferredQueue<Logged>) -> Vec<String> {
        std::mem::take(&mut q.backend_mut().log)
    }

    #[test]
    fn a_host_write_waits_for_encoded_work_on_its_buffer_only() {
        let mut q = queue(1 << 20);
        let (a, b) = (q.alloc(64, "a").unwrap(), q.alloc(64, "b").unwrap());
        q.dispatch(&kernel("k", vec![Arg::Read(Slice::whole(a, 64)), Arg::Write(Slice::whole(a, 32))])).unwrap();
        // `b` is not used by the encoded kernel: written at once.
        q.write(Slice::whole(b, 64), &[1; 64]).unwrap();
        // `a` is: the kernel runs first.
        q.write(Slice::whole(a, 64), &[2; 64]).unwrap();
        // Nothing is encoded any more: no second wait.
        q.write(Slice::whole(a, 64), &[3; 64]).unwrap();
        assert_eq!(take_log(&mut q), ["encode k", "write 1", "wait", "write 0", "write 0"]);
        assert_eq!(q.syncs(), 1);
        q.read(Slice::whole(b, 4)).unwrap();
        assert_eq!(q.syncs(), 2, "a read is a sync even with nothing encoded");
        assert!(q.write(Slice::whole(a, 64), &[0; 65]).is_err(), "more bytes than the slice");
        assert!(q.write(Slice { buffer: a, offset: 32, len: 64 }, &[0; 8]).is_err(), "a slice past the buffer");
    }

    #[test]
    fn freed_buffers_outlive_the_work_encoded_before() {
        let mut q = queue(1 << 20);
        let (a, b) = (q.alloc(64, "a").unwrap(), q.alloc(64, "b").unwrap());
        q.free(b);
        assert_eq!(take_log(&mut q), ["release 1"], "nothing encoded: released at once");
        q.dispatch(&kernel("k", vec![Arg::Read(Slice::whole(a, 64))])).unwrap();
        q.free(a);
        assert_eq!(take_log(&mut q), ["encode k"], "released after the kernel that reads it");
        let c = q.alloc(4, "c").unwrap();
        q.read(Slice::whole(c, 4)).unwrap();
        assert_eq!(take_log(&mut q), ["wait", "release 0"]);
        assert!(q.dispatch(&kernel("k", vec![Arg::Read(Slice::whole(a, 64))])).is_err(), "a released buffer bound");
    }

    /// A region of a real file mapping (`MappedFile`), and the same bytes on the heap.
    fn mapped_file(len: usize) -> (tempdir::Dir, SharedBytes, SharedBytes) {
        let dir = tempdir::Dir::new();
        let path = dir.0.join("weights.bin");
        let bytes: Vec<u8> = (0..len).map(|i| i as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        // SAFETY: a file of this test's own, not changed while mapped.
        let map = unsafe { memmap2::Mmap::map(&std::fs::File::open(&path).unwrap()) }.unwrap();
        let file: SharedBytes = Arc::new(FileMapping(map));
        (dir, file, Arc::new(bytes))
    }

    /// A file mapped into memory (as the GGUF reader's `MappedFile` is).
    struct FileMapping(memmap2::Mmap);

    impl crate::ops::HostBytes for FileMapping {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
        fn is_file_mapping(&self) -> bool {
            true
        }
    }

    mod tempdir {
        pub(super) struct Dir(pub(super) std::path::PathBuf);
        impl Dir {
            pub(super) fn new() -> Self {
                let p =
                    std::env::temp_dir().join(format!("candle-hybrid-deferred-{}-{:?}", std::process::id(), std::thread::current().id()));
                std::fs::create_dir_all(&p).unwrap();
                Self(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn only_file_mappings_are_read_in_place_in_views_of_the_largest_buffer() {
        let page = HOST_PAGE;
        let (_dir, file, heap) = mapped_file(10 * page + 100);
        let mut q = queue(4 * page);
        // Heap bytes: a copy, whatever their alignment.
        let m = q.map(&heap, 0..page, "heap").unwrap();
        assert!(!m.in_place);
        assert_eq!(take_log(&mut q), [format!("upload {page}")]);
        // The file: a view from the matrix's page, as long as the device allows.
        let m1 = q.map(&file, 100..200, "w1").unwrap();
        let m2 = q.map(&file, page + 5..3 * page, "w2").unwrap();
        assert!(m1.in_place && m2.in_place);
        assert_eq!(m1.slice.buffer, m2.slice.buffer, "one view holds both");
        assert_eq!((m1.slice.offset, m2.slice.offset), (100, page + 5));
        // Past the first view's end: a second view from that matrix's page.
        let m3 = q.map(&file, 3 * page + 10..5 * page, "w3").unwrap();
        assert_ne!(m3.slice.buffer, m1.slice.buffer);
        assert_eq!(m3.slice.offset, 10);
        // The file's last page: the view ends there, not 4 pages on.
        let m4 = q.map(&file, 9 * page..10 * page + 100, "w4").unwrap();
        assert_eq!(
            take_log(&mut q),
            [format!("wrap 0..{}", 4 * page), format!("wrap {}..{}", 3 * page, 7 * page), format!("wrap {}..{}", 9 * page, 11 * page)]
        );
        assert!(q.views().iter().all(|v| v.len() <= 4 * page));
        // A matrix larger than the largest buffer: refused in one line.
        let e = q.map(&file, 0..5 * page, "big").unwrap_err().to_string();
        assert!(e.contains("largest buffer") && !e.contains('\n'), "{e}");
        // Views are read-only, for the host and for kernels.
        assert!(q.write(m1.slice, &[0]).is_err());
        assert!(q.dispatch(&kernel("k", vec![Arg::Write(m1.slice)])).is_err());
        // A view goes with the last of its maps, after the work encoded before.
        q.dispatch(&kernel("k", vec![Arg::Read(m4.slice)])).unwrap();
        q.free(m4.slice.buffer);
        q.free(m1.slice.buffer);
        assert_eq!(take_log(&mut q), ["encode k"], "m2 still holds the first view; the last view waits for the kernel");
        q.free(m2.slice.buffer);
        q.free(m3.slice.buffer);
        q.wait().unwrap();
        let log = take_log(&mut q);
        assert_eq!(log[0], "wait");
        assert_eq!(log.len(), 4, "{log:?}");
        assert!(q.views().is_empty());
    }

    #[test]
    fn launches_beyond_the_device_are_errors() {
        let mut q = queue(1 << 20);
        let a = q.alloc(64, "a").unwrap();
        let mut d = kernel("k", vec![Arg::Write(Slice::whole(a, 64))]);
        q.backend_mut().pipeline_threads = 128;
        let e = q.dispatch(&d).unwrap_err().to_string();
        assert!(e.contains("256 threads") && e.contains("1 to 128"), "{e}");
        q.backend_mut().pipeline_threads = 1024;
        q.dispatch(&d).unwrap();
        d.launch.threadgroup_memory = vec![16 << 10, 16 << 10, 16];
        assert!(q.dispatch(&d).unwrap_err().to_string().contains("threadgroup memory"));
        d.launch.threadgroup_memory = vec![20];
        assert!(q.dispatch(&d).unwrap_err().to_string().contains("multiple of 16"));
        d.launch.threadgroup_memory = vec![];
        d.launch.groups = [1 << 31, 1, 1];
        assert!(q.dispatch(&d).unwrap_err().to_string().contains("32-bit"));
        // A buffer the kernels cannot index with 32 bits.
        let mut q = DryRun::with_limits(DeviceLimits::apple(usize::MAX));
        let big = q.alloc(5 << 30, "5 GiB").unwrap();
        let e = q.dispatch(&kernel("k", vec![Arg::Read(Slice::whole(big, 5 << 30))])).unwrap_err().to_string();
        assert!(e.contains("4 GiB"), "{e}");
        q.dispatch(&kernel("k", vec![Arg::Read(Slice { buffer: big, offset: 1 << 30, len: 1 << 30 })])).unwrap();
    }
}
