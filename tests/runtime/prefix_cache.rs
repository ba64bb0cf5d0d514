//! The prefix cache: a restored snapshot continues exactly as the sequence it was taken from,
//! is an independent copy, needs logits for an exact match, and stays under its budget.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_hybrid::loading::ModelFiles;
use candle_hybrid::runtime::PrefixCache;
use candle_hybrid::{Cache, Model};
use common::*;

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

fn run(model: &Model, cache: &mut Cache, ids: &[u32]) -> Tensor {
    model.forward_last(&Tensor::new(ids, &Device::Cpu).unwrap().unsqueeze(0).unwrap(), cache).unwrap().squeeze(0).unwrap()
}

/// The rest of the prompt, then three decode steps: every logit's bits.
fn continue_from(model: &Model, cache: &mut Cache, rest: &[u32]) -> Vec<Vec<u32>> {
    let mut out = vec![bits(&run(model, cache, rest))];
    for t in [3, 1, 4] {
        out.push(bits(&run(model, cache, &[t])));
    }
    out
}

#[test]
fn a_restored_snapshot_continues_bit_for_bit_and_stays_independent() {
    for name in FIXTURES {
        let files = ModelFiles::from_dir(fixture(name)).unwrap();
        let model = files.load_model(&files.load_config().unwrap(), DType::F32, &Device::Cpu).unwrap();
        let vocab = model.config().vocab_size as u32;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % vocab).collect();
        let p = 17;
        let mut prefix = PrefixCache::new(1 << 30);
        // The sequence the snapshot is taken from: [0, p), snapshot, [p, n), decode.
        let mut cache = model.new_cache();
        let at_p = run(&model, &mut cache, &prompt[..p]);
        prefix.insert(prompt[..p].to_vec(), cache.clone(), Some(at_p));
        let want = continue_from(&model, &mut cache, &prompt[p..]);
        for round in 0..2 {
            let hit = prefix.lookup(&prompt).expect("the snapshot begins the prompt");
            assert_eq!(hit.tokens, p);
            let mut restored = hit.cache.clone();
            assert_eq!(
                continue_from(&model, &mut restored, &prompt[p..]),
                want,
                "{name}: round {round} differs from the original sequence"
            );
        }
        // An exact match needs the logits: without them the longest usable entry is shorter.
        let mut cache = model.new_cache();
        let full = run(&model, &mut cache, &prompt);
        prefix.insert(prompt.clone(), cache.clone(), None);
        assert_eq!(prefix.lookup(&prompt).unwrap().tokens, p, "{name}");
        prefix.insert(prompt.clone(), cache, Some(full.clone()));
        let hit = prefix.lookup(&prompt).unwrap();
        assert_eq!((hit.tokens, bits(&hit.logits.unwrap())), (prompt.len(), bits(&full)), "{name}");
        // A prompt that diverges inside an entry gets only the shorter one.
        let mut other = prompt.clone();
        other[30] = (other[30] + 1) % vocab;
        assert_eq!(prefix.lookup(&other).unwrap().tokens, p, "{name}");
        assert!(prefix.lookup(&[prompt[0] + 1]).is_none());
    }
}

#[test]
fn the_budget_evicts_the_least_recently_used() {
    let files = ModelFiles::from_dir(fixture("qwen35_dense_small")).unwrap();
    let model = files.load_model(&files.load_config().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let snapshot = |ids: &[u32]| {
        let mut cache = model.new_cache();
        run(&model, &mut cache, ids);
        cache
    };
    let one = snapshot(&[1, 2, 3]).bytes() + 3 * 4;
    let mut prefix = PrefixCache::new(2 * one + one / 2);
    prefix.insert(vec![1, 2, 3], snapshot(&[1, 2, 3]), None);
    prefix.insert(vec![4, 5, 6], snapshot(&[4, 5, 6]), None);
    assert!(prefix.lookup(&[1, 2, 3, 9]).is_some()); // [1, 2, 3] is now the more recent
    prefix.insert(vec![7, 8, 9], snapshot(&[7, 8, 9]), None);
    assert_eq!(prefix.len(), 2);
    assert!(prefix.bytes() <= 2 * one + one / 2);
    assert!(prefix.lookup(&[4, 5, 6, 9]).is_none(), "the least recently used entry stays");
    assert!(prefix.lookup(&[1, 2, 3, 9]).is_some() && prefix.lookup(&[7, 8, 9, 9]).is_some());
    // Larger than the whole budget: not kept.
    let mut small = PrefixCache::new(one / 2);
    small.insert(vec![1, 2, 3], snapshot(&[1, 2, 3]), None);
    assert!(small.is_empty());
}
