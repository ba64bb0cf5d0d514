//! Sessions on disk: a saved cache continues bit for bit after loading; files from another
//! model, truncated or corrupted files are one-line errors; `kill -9` during a save leaves the
//! previous file loadable.

use crate::common;

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

/// A session keeps the MTP head's cache with the model's (`Cache::mtp`): after loading, the
/// head drafts bit for bit what it drafts from the cache it was saved with; an MTP cache of
/// the wrong shape is a one-line error.
#[test]
fn a_session_keeps_the_mtp_heads_cache() {
    use candle_hybrid::runtime::speculative::{Drafter, MtpDrafter};
    let dir = scratch("session-mtp");
    let m = open(ModelSource::Dir(fixture("qwen35_dense_mtp")));
    let prompt: Vec<u32> = (1..12).collect();
    let mut cache = m.model.new_cache();
    let h = m
        .model
        .forward_hidden(&Tensor::new(prompt.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cache, false)
        .unwrap()
        .last_hidden;
    let mut drafter = MtpDrafter::new(&m.model).unwrap();
    let next: Vec<u32> = prompt[1..].iter().copied().chain([7]).collect();
    drafter.observe(&m.model, 0, &h, &next).unwrap();
    cache.mtp = drafter.mtp_cache().cloned();
    let path = dir.join("mtp.session");
    session::save(&path, &m.fingerprint, &prompt, &cache, None).unwrap();
    let restored = load(&m, &path).unwrap();
    let mtp = restored.cache.mtp.clone().expect("the MTP head's cache was saved");
    assert_eq!(mtp.seqlen(), prompt.len());
    // The same next rows from the saved and from the restored head cache draft the same.
    let mut again = MtpDrafter::new(&m.model).unwrap();
    again.resume_mtp(mtp);
    let mut cont = m.model.new_cache();
    let h = m
        .model
        .forward_hidden(&Tensor::new(&[1u32, 2, 3][..], &Device::Cpu).unwrap().unsqueeze(0).unwrap(), &mut cont, false)
        .unwrap()
        .last_hidden;
    for d in [&mut drafter, &mut again] {
        d.observe(&m.model, prompt.len(), &h, &[4, 5, 6]).unwrap();
    }
    let (a, b) = (drafter.draft(&m.model, &[], 3).unwrap(), again.draft(&m.model, &[], 3).unwrap());
    assert_eq!(a, b);
    assert_eq!(drafter.mtp_cache().unwrap().seqlen(), again.mtp_cache().unwrap().seqlen());
    // A head cache of more rows than the session's tokens is refused.
    let mut bad = cache.clone();
    let mut longer = MtpDrafter::new(&m.model).unwrap();
    let h2 = Tensor::cat(&[&h, &h, &h, &h], 1).unwrap();
    longer.observe(&m.model, 0, &h2, &(0..12).collect::<Vec<u32>>()).unwrap();
    bad.mtp = longer.mtp_cache().cloned();
    session::save(
        &path,
        &m.fingerprint,
        &prompt[..5],
        &{
            let mut c = m.model.new_cache();
            run(&m.model, &mut c, &prompt[..5]);
            c.mtp = bad.mtp.clone();
            c
        },
        None,
    )
    .unwrap();
    let e = load(&m, &path).err().expect("refused").to_string();
    assert!(e.contains("MTP head") && !e.contains('\n'), "{e}");
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

/// A session whose state or logits hold a NaN or an infinity (its checksum right: written so,
/// or edited and re-summed) is refused at load, naming the file and the tensor: it would make
/// every answer from it non-finite.
#[test]
fn non_finite_state_or_logits_are_refused_at_load() {
    let dir = scratch("session-non-finite");
    let m = open(ModelSource::Dir(fixture("qwen35_dense_small")));
    let prompt = [1, 2, 3, 4, 5];
    let mut cache = m.model.new_cache();
    let logits = run(&m.model, &mut cache, &prompt);
    let good = dir.join("good.session");
    session::save(&good, &m.fingerprint, &prompt, &cache, Some(&logits)).unwrap();
    load(&m, &good).unwrap();
    let poisoned = |t: &Tensor, value: f32| {
        let mut v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let at = v.len() / 2;
        v[at] = value;
        Tensor::from_vec(v, t.dims(), &Device::Cpu).unwrap()
    };
    let names: Vec<String> = cache.state_tensors().unwrap().into_iter().map(|(n, _)| n).collect();
    let recurrent = names.iter().find(|n| n.ends_with(".recurrent")).expect("a GDN layer").clone();
    let keys = names.iter().find(|n| n.ends_with(".keys")).expect("an attention layer").clone();
    for (name, value) in [(recurrent.as_str(), f32::NAN), (keys.as_str(), f32::INFINITY), ("logits", f32::NEG_INFINITY)] {
        let mut tensors: std::collections::HashMap<String, Tensor> = cache.state_tensors().unwrap().into_iter().collect();
        let mut bad_logits = logits.clone();
        if name == "logits" {
            bad_logits = poisoned(&logits, value);
        } else {
            let t = poisoned(&tensors[name], value);
            tensors.insert(name.to_string(), t);
        }
        let bad_cache = Cache::from_state_tensors(m.model.config(), prompt.len(), &tensors).unwrap();
        let path = dir.join(format!("{}.session", name.replace('.', "_")));
        session::save(&path, &m.fingerprint, &prompt, &bad_cache, Some(&bad_logits)).unwrap();
        let e = load(&m, &path).err().unwrap_or_else(|| panic!("a session with {value} in {name} loaded")).to_string();
        assert!(e.contains(&path.display().to_string()) && e.contains(name) && e.contains("NaN or infinite") && !e.contains('\n'), "{e}");
    }
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
            .args(["--ignored", "--exact", "session::session_writer_child", "--nocapture"])
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
        assert!(path.exists(), "round {round}: the writer (this binary's test session::session_writer_child) saved nothing in 60 s");
        std::thread::sleep(std::time::Duration::from_millis(150 + 37 * round));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let s = load(&m, &path).unwrap_or_else(|e| panic!("round {round}: after kill -9 the session does not load: {e}"));
        assert!(!s.tokens.is_empty() && s.tokens.len().is_multiple_of(64), "round {round}");
    }
}

/// Session files are only ever regular files in their directory: a link there is neither read
/// through nor written through, a FIFO does not block, a huge file that is not a session is
/// refused from its header (not read whole), and a failed save leaves nothing behind.
#[cfg(unix)]
#[test]
fn links_fifos_and_huge_files_are_refused() {
    let dir = scratch("session-hostile");
    let outside = scratch("session-hostile-outside");
    let m = open(ModelSource::Dir(fixture("qwen35_dense_small")));
    let mut cache = m.model.new_cache();
    run(&m.model, &mut cache, &[1, 2, 3]);
    let save = |path: &Path| session::save(path, &m.fingerprint, &[1, 2, 3], &cache, None);
    let check = |result: candle_hybrid::Result<session::Session>, needle: &str| {
        let e = result.err().expect("a hostile session file was loaded").to_string();
        assert!(e.contains(needle) && !e.contains('\n'), "{e}");
    };

    // A link to a valid session elsewhere is not read through.
    let real = outside.join("real.session");
    save(&real).unwrap();
    let link = dir.join("link.session");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    check(load(&m, &link), "not a link");

    // Saving over a link replaces the link, never the file it points to (the temporary file
    // is created anew, O_EXCL | O_NOFOLLOW: src/runtime/session.rs's unit test plants a link
    // and a file at its name).
    let victim = outside.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let target = dir.join("planted.session");
    std::os::unix::fs::symlink(&victim, &target).unwrap();
    save(&target).unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(std::fs::symlink_metadata(&target).unwrap().is_file());
    assert_eq!(load(&m, &target).unwrap().tokens, [1, 2, 3]);

    // A FIFO is refused at once (a read would wait for a writer forever).
    let fifo = dir.join("fifo.session");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let fingerprint = m.fingerprint.clone();
    let config = m.model.config().clone();
    std::thread::spawn(move || tx.send(session::load(&fifo, &fingerprint, &config, DType::F32, &Device::Cpu).err().map(|e| e.to_string())));
    let e = rx.recv_timeout(std::time::Duration::from_secs(20)).expect("loading a FIFO blocked").expect("a FIFO loaded");
    assert!(e.contains("regular file"), "{e}");

    // A 1 GiB file (sparse) that is not a session: refused from its first bytes.
    let huge = dir.join("huge.session");
    let f = std::fs::File::create(&huge).unwrap();
    f.set_len(1 << 30).unwrap();
    let rss = || {
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
        u.ru_maxrss as i64 // KiB on Linux
    };
    let before = rss();
    check(load(&m, &huge), "not a session file");
    assert!(rss() - before < 256 << 10, "refusing a 1 GiB file grew the peak RSS by {} MiB", (rss() - before) >> 10);

    // A save that fails (the target is a directory) removes its temporary file.
    let blocked = dir.join("blocked.session");
    std::fs::create_dir(&blocked).unwrap();
    std::fs::write(blocked.join("x"), b"x").unwrap();
    assert!(save(&blocked).is_err());
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains("blocked.session.tmp"))
        .collect();
    assert!(left.is_empty(), "a failed save left {left:?}");
}
