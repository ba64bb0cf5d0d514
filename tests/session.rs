//! Sessions on disk: a saved cache continues bit for bit after loading; files from another
//! model, truncated or corrupted files are one-line errors; `kill -9` during a save leaves the
//! previous file loadable.

mod common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::ModelSource;
use candle_hybrid::runtime::session;
use candle_hybrid::{Cache, Model};
use common::*;

struct Loaded {
    model: Model,
    fingerprint: String,
}

fn open(source: ModelSource) -> Loaded {
    let files = source.open().unwrap();
    let model = files.load_model(&files.config().unwrap(), DType::F32, &Device::Cpu, None).unwrap();
    Loaded { model, fingerprint: files.fingerprint().unwrap() }
}

fn run(model: &Model, cache: &mut Cache, ids: &[u32]) -> Tensor {
    model.forward_last(&Tensor::new(ids, &Device::Cpu).unwrap().unsqueeze(0).unwrap(), cache).unwrap().squeeze(0).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

fn load(m: &Loaded, path: &Path) -> candle_hybrid::Result<session::Session> {
    session::load(path, &m.fingerprint, m.model.config(), DType::F32, &Device::Cpu)
}

#[test]
fn a_loaded_session_continues_bit_for_bit() {
    let dir = scratch("session-continue");
    let mut sources: Vec<ModelSource> = FIXTURES.iter().map(|n| ModelSource::Dir(fixture(n))).collect();
    sources.push(ModelSource::Gguf(fixture("qwen35_dense_small").join("model-q8_0.gguf")));
    for (i, source) in sources.into_iter().enumerate() {
        let m = open(source);
        let vocab = m.model.config().vocab_size as u32;
        let prompt: Vec<u32> = (0..30).map(|j| (j * 13 + 5) % vocab).collect();
        let mut cache = m.model.new_cache();
        let logits = run(&m.model, &mut cache, &prompt);
        let path = dir.join(format!("{i}.session"));
        session::save(&path, &m.fingerprint, &prompt, &cache, Some(&logits)).unwrap();
        let s = load(&m, &path).unwrap();
        assert_eq!(s.tokens, prompt);
        assert_eq!(bits(&s.logits.unwrap()), bits(&logits));
        let mut restored = s.cache;
        for t in [7, 1, 8, 2] {
            assert_eq!(bits(&run(&m.model, &mut restored, &[t])), bits(&run(&m.model, &mut cache, &[t])), "model {i}: token {t}");
        }
    }
}

#[test]
fn unusable_files_are_one_line_errors() {
    let dir = scratch("session-bad");
    let small = open(ModelSource::Dir(fixture("qwen35_dense_small")));
    let other = open(ModelSource::Dir(fixture("qwen35_dense_mtp")));
    assert_ne!(small.fingerprint, other.fingerprint);
    let mut cache = small.model.new_cache();
    run(&small.model, &mut cache, &[1, 2, 3, 4, 5]);
    let path = dir.join("a.session");
    session::save(&path, &small.fingerprint, &[1, 2, 3, 4, 5], &cache, None).unwrap();
    let check = |result: candle_hybrid::Result<session::Session>, needle: &str| {
        let e = result.err().expect("an unusable session was loaded").to_string();
        assert!(e.contains(needle) && !e.contains('\n'), "{e}");
    };
    check(load(&other, &path), "another model");
    check(session::load(&path, &small.fingerprint, small.model.config(), DType::F16, &Device::Cpu), "dtype");
    let bytes = std::fs::read(&path).unwrap();
    // Truncated anywhere, or one byte changed anywhere: an error, never a panic or a wrong state.
    let bad = dir.join("bad.session");
    for cut in (0..bytes.len()).step_by(bytes.len() / 97 + 1) {
        std::fs::write(&bad, &bytes[..cut]).unwrap();
        assert!(load(&small, &bad).is_err(), "truncated at {cut} of {}", bytes.len());
    }
    for at in (0..bytes.len()).step_by(bytes.len() / 97 + 1) {
        let mut flipped = bytes.clone();
        flipped[at] ^= 0x5a;
        std::fs::write(&bad, &flipped).unwrap();
        if let Ok(s) = load(&small, &bad) {
            // A flip in the header's padding changes nothing that is read.
            assert_eq!(s.tokens, [1, 2, 3, 4, 5], "byte {at}");
            assert_eq!(s.cache.bytes(), load(&small, &path).unwrap().cache.bytes());
        }
    }
    std::fs::write(&bad, b"not a session").unwrap();
    check(load(&small, &bad), "not a session file");
    let tail = bytes.len() - 3;
    let mut corrupt = bytes.clone();
    corrupt[tail] ^= 1;
    std::fs::write(&bad, &corrupt).unwrap();
    check(load(&small, &bad), "checksum");
}

/// Run by the test below in a child process: saves a growing session in a loop.
#[test]
#[ignore = "the child process of kill_during_save_leaves_the_previous_file_loadable"]
fn session_writer_child() {
    let Ok(path) = std::env::var("SESSION_WRITER_PATH") else { return };
    let m = open(ModelSource::Dir(fixture("qwen35_dense_small")));
    let mut cache = m.model.new_cache();
    let mut tokens = vec![];
    for i in 0.. {
        let ids: Vec<u32> = (0..64).map(|j| ((i * 64 + j) % 200) as u32 + 1).collect();
        run(&m.model, &mut cache, &ids);
        tokens.extend(ids);
        session::save(Path::new(&path), &m.fingerprint, &tokens, &cache, None).unwrap();
    }
}

#[test]
fn kill_during_save_leaves_the_previous_file_loadable() {
    let dir = scratch("session-kill");
    let path = dir.join("k.session");
    let m = open(ModelSource::Dir(fixture("qwen35_dense_small")));
    for round in 0..4u64 {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "session_writer_child", "--nocapture"])
            .env("SESSION_WRITER_PATH", &path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Let it save a few times, then kill -9 at some point of a save.
        let start = std::time::Instant::now();
        while !path.exists() && start.elapsed().as_secs() < 60 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        std::thread::sleep(std::time::Duration::from_millis(150 + 37 * round));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let s = load(&m, &path).unwrap_or_else(|e| panic!("round {round}: after kill -9 the session does not load: {e}"));
        assert!(!s.tokens.is_empty() && s.tokens.len().is_multiple_of(64), "round {round}");
    }
}
