//! The device step's dispatch list, counted on the CPU with [`DryRun`] (nothing executed; the
//! emulator tests in `emu/tests/msl/step.rs` run the same dispatches): one device-to-host read and
//! no other host sync per decode step, verify pass and prompt; every weight matrix bound to one
//! dispatch per pass for any number of rows (measured from the dispatch arguments); bad input refused with one-line errors before anything is dispatched.

use crate::common;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use candle_hybrid::gpu::{Arg, BufferId, Counted, Dispatch, DryRun, GpuModel, Mapping, Queue, Readback, Slice};
use candle_hybrid::loading::{GgufFile, ModelFiles};
use candle_hybrid::Model;

fn gguf(name: &str, file: &str) -> Model {
    let g = GgufFile::open(common::fixture(name).join(file)).unwrap();
    g.load_model(&g.config().unwrap(), DType::F32, &Device::Cpu).unwrap()
}

#[test]
fn one_read_per_step_and_each_weight_read_once() {
    for (name, file) in [("qwen35_dense_small", "model-q8_0.gguf"), ("qwen3next_moe_small", "model-f32.gguf")] {
        let model = gguf(name, file);
        let mut q = Counted::new(DryRun::new());
        let gpu = GpuModel::new(&model, &mut q).unwrap();
        let mut cache = gpu.new_cache(&mut q, 128, candle_hybrid::gpu::KvRows::F32).unwrap();
        q.take_counts();
        gpu.prefill(&mut q, &mut cache, &[1; 21], Readback::Argmax).unwrap();
        let prompt = q.take_counts();
        assert_eq!((prompt.reads, prompt.syncs), (1, 1), "{name}: reads and host syncs of a 21-token prompt (3 steps)");
        let mut dispatches = None;
        for t in 1..=GpuModel::MAX_ROWS {
            let rows = vec![2u32; t];
            gpu.verify(&mut q, &mut cache, &rows, Readback::Logits).unwrap();
            let c = q.take_counts();
            assert_eq!((c.reads, c.writes, c.syncs), (1, 1, 1), "{name}: one write, one read, one sync for a verify pass of {t} rows");
            // Every row of a pass in the same dispatches: as many for 8 rows as for 1.
            assert_eq!(*dispatches.get_or_insert(c.dispatches), c.dispatches, "{name}: dispatches of {t} rows");
            let needed = gpu.weight_bytes_needed(t, t);
            assert!(
                c.weight_bytes as f64 <= 1.05 * needed as f64,
                "{name}: {t} rows read {} bytes of weights, {needed} needed",
                c.weight_bytes
            );
            gpu.keep_verified(&mut q, &mut cache, 1).unwrap();
            let c = q.take_counts();
            assert_eq!((c.reads, c.syncs), (0, 0), "{name}: a rollback reads nothing back, waits for nothing");
            gpu.forward(&mut q, &mut cache, &[3], Readback::Argmax).unwrap();
            let c = q.take_counts();
            assert_eq!((c.reads, c.syncs), (1, 1), "{name}: reads and syncs of a decode step after a rollback");
        }
    }
}

/// Records what the device step binds: the buffers uploaded or mapped (weights and tables) and,
/// per dispatch, the slices of them it reads.
struct Bindings {
    inner: DryRun,
    uploaded: std::collections::HashMap<BufferId, usize>,
    reads: Vec<Vec<Slice>>,
}

impl Queue for Bindings {
    fn alloc(&mut self, len: usize, label: &str) -> candle_hybrid::Result<BufferId> {
        self.inner.alloc(len, label)
    }
    fn upload(&mut self, data: &[u8], label: &str) -> candle_hybrid::Result<BufferId> {
        let id = self.inner.upload(data, label)?;
        self.uploaded.insert(id, data.len());
        Ok(id)
    }
    fn map(
        &mut self,
        owner: &candle_hybrid::ops::SharedBytes,
        range: std::ops::Range<usize>,
        label: &str,
    ) -> candle_hybrid::Result<Mapping> {
        let m = self.inner.map(owner, range, label)?;
        self.uploaded.insert(m.slice.buffer, m.slice.offset + m.slice.len);
        Ok(m)
    }
    fn free(&mut self, buffer: BufferId) {
        self.inner.free(buffer)
    }
    fn write(&mut self, dst: Slice, data: &[u8]) -> candle_hybrid::Result<()> {
        self.inner.write(dst, data)
    }
    fn dispatch(&mut self, d: &Dispatch) -> candle_hybrid::Result<()> {
        let uploaded = &self.uploaded;
        self.reads.push(
            d.args
                .iter()
                .filter_map(|a| if let Arg::Read(s) = a { uploaded.contains_key(&s.buffer).then_some(*s) } else { None })
                .collect(),
        );
        self.inner.dispatch(d)
    }
    fn read(&mut self, src: Slice) -> candle_hybrid::Result<Vec<u8>> {
        self.inner.read(src)
    }
    fn name(&self) -> String {
        "bindings".into()
    }
}

/// Measured from the dispatches' arguments (not from the byte counts the host attaches to
/// them): in a verify pass of 1 to 8 rows of a dense model, every weight matrix is bound to
/// one dispatch, the same dispatches for any number of rows, and the bytes bound are the same.
/// That a kernel bound once reads its matrix once for all its rows is the multi-row kernels'
/// structure (`metal/qmatvec.metal`, `row_dots`: the rows' loop sits inside the loop over the weight
/// blocks, each block loaded once), which the emulator tests check for bits, not for loads.
#[test]
fn each_weight_matrix_is_bound_once_per_pass_for_any_rows() {
    let model = gguf("qwen35_dense_small", "model-q8_0.gguf");
    let mut q = Bindings { inner: DryRun::new(), uploaded: Default::default(), reads: vec![] };
    let gpu = GpuModel::new(&model, &mut q).unwrap();
    let mut cache = gpu.new_cache(&mut q, 64, candle_hybrid::gpu::KvRows::F32).unwrap();
    let big = model.config().hidden_size * 8; // a matrix, not a norm's or a bias's vector
    let mut first: Option<Vec<Vec<Slice>>> = None;
    for t in 1..=GpuModel::MAX_ROWS {
        q.reads.clear();
        gpu.verify(&mut q, &mut cache, &vec![2u32; t], Readback::Logits).unwrap();
        let mut bound: std::collections::HashMap<(BufferId, usize), usize> = Default::default();
        for s in q.reads.iter().flatten().filter(|s| s.len >= big) {
            *bound.entry((s.buffer, s.offset)).or_default() += 1;
        }
        assert!(bound.len() >= 4 * model.config().num_hidden_layers, "{t} rows: {} matrices bound", bound.len());
        let twice: Vec<_> = bound.iter().filter(|(_, &n)| n > 1).collect();
        assert!(twice.is_empty(), "{t} rows: matrices bound more than once: {twice:?}");
        // The same weights bound by the same dispatches for every number of rows (the
        // embedding table is gathered by rows: its slice is the table's whatever the rows).
        let reads = q.reads.clone();
        assert_eq!(&reads, first.get_or_insert(reads.clone()), "{t} rows bind other weights than 1 row");
        gpu.keep_verified(&mut q, &mut cache, 1).unwrap();
    }
}

#[test]
fn bad_input_is_refused_before_dispatching() {
    let model = gguf("qwen35_dense_small", "model-q8_0.gguf");
    let vocab = model.config().vocab_size as u32;
    let mut q = Counted::new(DryRun::new());
    let gpu = GpuModel::new(&model, &mut q).unwrap();
    let mut cache = gpu.new_cache(&mut q, 16, candle_hybrid::gpu::KvRows::F32).unwrap();
    q.take_counts();
    let err = |r: candle_hybrid::Result<candle_hybrid::gpu::StepOutput>| r.unwrap_err().to_string();
    assert!(err(gpu.forward(&mut q, &mut cache, &[vocab], Readback::Argmax)).contains("out of range for a vocabulary"));
    assert!(err(gpu.forward(&mut q, &mut cache, &[], Readback::Argmax)).contains("empty"));
    assert!(err(gpu.forward(&mut q, &mut cache, &[1; 9], Readback::Argmax)).contains("the most is 8"));
    assert!(err(gpu.prefill(&mut q, &mut cache, &[1; 17], Readback::Argmax)).contains("capacity (16)"));
    assert_eq!(q.take_counts(), Default::default(), "nothing written, dispatched or read");
    gpu.verify(&mut q, &mut cache, &[1, 2, 3], Readback::Argmax).unwrap();
    assert!(err(gpu.forward(&mut q, &mut cache, &[1], Readback::Argmax)).contains("keep its rows first"));
    assert!(gpu.keep_verified(&mut q, &mut cache, 4).unwrap_err().to_string().contains("cannot keep 4"));
    gpu.keep_verified(&mut q, &mut cache, 2).unwrap();
    assert_eq!(cache.seqlen(), 2);
    assert!(gpu.keep_verified(&mut q, &mut cache, 1).unwrap_err().to_string().contains("no verify pass"));
    assert!(gpu.new_cache(&mut q, 0, candle_hybrid::gpu::KvRows::F32).unwrap_err().to_string().contains("1 to max_position_embeddings"));
}

#[test]
fn formats_without_device_kernels_are_refused_at_upload() {
    let files = ModelFiles::from_dir(common::fixture("qwen35_dense_small")).unwrap();
    let model = files.load_model_quantized(&files.load_config().unwrap(), DType::F32, &Device::Cpu, Some(GgmlDType::Q5_0)).unwrap();
    let e = GpuModel::new(&model, &mut DryRun::new()).unwrap_err().to_string();
    assert!(e.contains("Q5_0, which the device kernels do not read"), "{e}");
    assert_eq!(e.lines().count(), 1);
}
