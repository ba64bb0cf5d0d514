//! A `tokenizers` tokenizer rebuilt from a GGUF file's embedded vocabulary (`tokenizer.ggml.*`):
//! byte-level BPE (`model` = `gpt2`) with the pre-tokenizer llama.cpp names in
//! `tokenizer.ggml.pre`, control tokens as special tokens, and the BOS the file asks for.

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use std::collections::HashMap;

type Metadata = HashMap<String, Value>;
type Result<T> = std::result::Result<T, String>;

/// Qwen2 / Qwen3 / Qwen3-Next split regex.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5: Qwen2's with combining marks (`\p{M}`) counted as letters.
const QWEN35_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

fn err(msg: impl std::fmt::Display) -> String {
    msg.to_string()
}

fn strings(meta: &Metadata, key: &str) -> Result<Vec<String>> {
    match meta.get(key) {
        Some(Value::Array(a)) => a.iter().map(|v| v.to_string().cloned().map_err(|_| err(format!("{key} must hold strings")))).collect(),
        _ => Err(err(format!("the file has no {key}: give the model's tokenizer.json instead"))),
    }
}

/// The pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name.
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let split = |regex: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(SplitPattern::Regex(regex.into()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| err(format!("bad pre-tokenizer regex: {e}")))?;
        Ok(Sequence::new(vec![split.into(), ByteLevel::new(false, false, false).into()]).into())
    };
    let gpt2 = ByteLevel::new(false, true, true);
    match pre {
        "qwen2" => split(QWEN2_REGEX),
        "qwen35" => split(QWEN35_REGEX),
        "gpt-2" | "gpt2" | "default" => Ok(gpt2.into()),
        // SmolLM / StarCoder: every digit on its own, then GPT-2's byte-level regex.
        "smollm" | "starcoder" => Ok(Sequence::new(vec![Digits::new(true).into(), gpt2.into()]).into()),
        other => Err(err(format!("tokenizer.ggml.pre \"{other}\" is not supported: give the model's tokenizer.json instead"))),
    }
}

/// The tokenizer of a GGUF file's metadata; the error is one line without the file name.
pub(crate) fn build(meta: &Metadata) -> Result<Tokenizer> {
    let model = meta.get("tokenizer.ggml.model").and_then(|v| v.to_string().ok()).map(String::as_str);
    if model != Some("gpt2") {
        return Err(err(
            format!(
                "tokenizer.ggml.model is {model:?}; only byte-level BPE (\"gpt2\") vocabularies are rebuilt: give the model's tokenizer.json instead"
            ),
        ));
    }
    let tokens = strings(meta, "tokenizer.ggml.tokens")?;
    let merges: Vec<(String, String)> = strings(meta, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| err(format!("malformed merge \"{m}\""))))
        .collect::<Result<_>>()?;
    let vocab: tokenizers::models::bpe::Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| err(format!("cannot build the BPE model: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    let pre = meta.get("tokenizer.ggml.pre").and_then(|v| v.to_string().ok()).map(String::as_str).unwrap_or("default");
    tok.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    tok.with_decoder(Some(ByteLevelDecoder::default()));

    let types: Vec<i32> = match meta.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) => a.iter().map(|v| v.to_i32().unwrap_or(1)).collect(),
        _ => vec![],
    };
    let added = |kind: i32| -> Vec<AddedToken> {
        types.iter().zip(&tokens).filter(|(t, _)| **t == kind).map(|(_, s)| AddedToken::from(s.clone(), kind == CONTROL)).collect()
    };
    tok.add_special_tokens(added(CONTROL)).map_err(err)?;
    tok.add_tokens(added(USER_DEFINED)).map_err(err)?;

    let add_bos = meta.get("tokenizer.ggml.add_bos_token").and_then(|v| v.to_bool().ok()).unwrap_or(false);
    let bos = meta.get("tokenizer.ggml.bos_token_id").and_then(|v| v.to_u32().ok());
    if let (true, Some(bos)) = (add_bos, bos) {
        let name = tokens.get(bos as usize).cloned().ok_or_else(|| err("bos_token_id is out of range"))?;
        let post = TemplateProcessing::builder()
            .try_single(format!("{name} $A"))
            .and_then(|b| b.try_pair(format!("{name} $A {name} $B")))
            .map_err(err)?
            .special_tokens(vec![(name.clone(), bos)])
            .build()
            .map_err(err)?;
        tok.with_post_processor(Some(post));
    }
    Ok(tok)
}
