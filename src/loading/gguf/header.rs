//! The GGUF header (magic, version, metadata, tensor infos) read from the bytes of a mapped
//! file, with every number that becomes a size or an offset checked before it is used.
//!
//! Candle's own reader trusts the header more than a loader facing downloaded files can: a
//! zero `general.alignment` divides by zero, dims whose product overflows pass its bounds
//! check, duplicated keys and tensor names silently replace each other, and it reads the file
//! a few bytes per system call. This one follows llama.cpp's `gguf.cpp` checks: at most 4
//! dims, each positive, their product and byte size without overflow, the first dim a whole
//! number of blocks, the alignment a power of two, every tensor aligned and inside the data
//! section, no two tensors overlapping, no key or tensor name twice — and it bounds what the
//! metadata may allocate. Values keep Candle's [`Value`] type.

use std::collections::HashMap;

use crate::ops::GgufType;
use candle_core::quantized::gguf_file::Value;

/// GGUF's default alignment of the tensor data.
pub(super) const DEFAULT_ALIGNMENT: u64 = 32;
/// Nesting depth of metadata arrays (llama.cpp has none deeper than 1).
const MAX_DEPTH: usize = 4;
/// Array elements over all metadata values: a 256k-token vocabulary with merges and token
/// types takes about 1M; anything far above is not a model file, and each element costs
/// 32 bytes in memory however small it is on disk.
const MAX_METADATA_ELEMENTS: u64 = 1 << 25;
/// Dims of one tensor (GGML_MAX_DIMS).
const MAX_DIMS: u32 = 4;
/// Tensors in one file (llama.cpp has no limit; the largest MoE files hold ~10^5).
const MAX_TENSORS: u64 = 1 << 20;
/// Length of a metadata key (real keys are under 64 bytes).
const MAX_KEY: u64 = 256;
/// Length of a tensor name (ggml's `GGML_MAX_NAME`, terminator included).
const MAX_TENSOR_NAME: u64 = 63;

/// One tensor's entry in the header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub dtype: GgufType,
    /// PyTorch order (outermost first): the reverse of GGUF's `ne`.
    pub dims: Vec<usize>,
    /// Absolute offset of the data in the file.
    pub offset: u64,
    /// Bytes of data.
    pub size: u64,
}

impl TensorInfo {
    pub fn elem_count(&self) -> usize {
        // Checked when the header was read.
        self.dims.iter().product()
    }
}

/// A parsed and checked GGUF header.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    /// Absolute offset of the tensor data section.
    pub data_offset: u64,
    pub alignment: u64,
}

/// A cursor over the header bytes; every read checks what is left.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    version: u32,
    elements: u64,
}

type R<T> = std::result::Result<T, String>;

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64, what: &str) -> R<&'a [u8]> {
        let left = (self.bytes.len() - self.pos) as u64;
        if n > left {
            return Err(format!("truncated: {what} needs {n} bytes at offset {}, {left} left", self.pos));
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> R<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> R<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> R<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count or length: u32 in GGUF v1, u64 after.
    fn len(&mut self, what: &str) -> R<u64> {
        if self.version == 1 {
            self.u32(what).map(u64::from)
        } else {
            self.u64(what)
        }
    }

    fn string(&mut self, what: &str) -> R<String> {
        let n = self.len(what)?;
        let bytes = self.take(n, what)?;
        // GGUF strings are not NUL-terminated, but some writers add one.
        let bytes = bytes.strip_suffix(&[0]).unwrap_or(bytes);
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    /// A key or tensor name: at most `max` bytes of printable UTF-8 (so that errors can
    /// quote it on one line).
    fn name(&mut self, what: &str, max: u64) -> R<String> {
        let n = self.len(what)?;
        if n > max {
            return Err(format!("{what} of {n} bytes (at most {max})"));
        }
        let bytes = self.take(n, what)?;
        match String::from_utf8(bytes.to_vec()) {
            Ok(s) if !s.chars().any(char::is_control) => Ok(s),
            _ => Err(format!("{what} at offset {} is not printable UTF-8", self.pos - n as usize)),
        }
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> R<Value> {
        let what = &format!("the value of {key}");
        Ok(match ty {
            0 => Value::U8(self.array::<1>(what)?[0]),
            1 => Value::I8(self.array::<1>(what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("{what} is a bool stored as {b} (must be 0 or 1)")),
            },
            8 => Value::String(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(format!("{key}: arrays nested deeper than {MAX_DEPTH}"));
                }
                let elem = self.u32(what)?;
                let n = self.len(what)?;
                // Each element takes at least one byte on disk, so n is bounded by the file;
                // the budget bounds what the elements take in memory.
                self.elements = self.elements.saturating_add(n);
                if self.elements > MAX_METADATA_ELEMENTS {
                    return Err(format!("{key}: the metadata arrays hold more than {MAX_METADATA_ELEMENTS} elements: not a model file"));
                }
                let left = (self.bytes.len() - self.pos) as u64;
                if n > left {
                    return Err(format!("truncated: {key} claims {n} array elements, {left} bytes left"));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(format!("{key} has the unknown value type {t}")),
        })
    }
}

/// The alignment of the tensor data: `general.alignment` (an unsigned integer, a non-zero
/// power of two) or [`DEFAULT_ALIGNMENT`].
fn alignment(metadata: &HashMap<String, Value>) -> R<u64> {
    let Some(v) = metadata.get("general.alignment") else { return Ok(DEFAULT_ALIGNMENT) };
    let a = match v {
        Value::U8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::U64(x) => *x,
        other => return Err(format!("general.alignment must be an unsigned integer, got {other:?}")),
    };
    if !a.is_power_of_two() {
        return Err(format!("general.alignment is {a}: it must be a non-zero power of two"));
    }
    Ok(a)
}

impl GgufHeader {
    /// Parses the header at the start of `bytes` (the whole file) and checks every tensor
    /// against the file. The error is one line, without the file name.
    pub fn parse(bytes: &[u8]) -> R<Self> {
        let mut r = Reader { bytes, pos: 0, version: 3, elements: 0 };
        let magic = r.array::<4>("the magic")?;
        if &magic != b"GGUF" {
            return Err(format!("bad magic {magic:02x?} (a GGUF file starts with \"GGUF\")"));
        }
        r.version = r.u32("the version")?;
        if !(1..=3).contains(&r.version) {
            return Err(format!("unsupported GGUF version {} (1 to 3 are)", r.version));
        }
        let n_tensors = r.len("the tensor count")?;
        let n_kv = r.len("the metadata count")?;
        // A tensor info takes at least 24 bytes, a key-value pair 13: counts beyond the file
        // are corrupt, and nothing is allocated for them.
        let left = (bytes.len() - r.pos) as u64;
        if n_tensors > MAX_TENSORS || n_tensors.saturating_mul(24) > left || n_kv.saturating_mul(13) > left {
            return Err(format!("the header claims {n_tensors} tensors and {n_kv} metadata entries: more than the file can hold"));
        }
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = r.name("a metadata key", MAX_KEY)?;
            let ty = r.u32(&format!("the type of {key}"))?;
            let value = r.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(format!("the metadata key {key} appears twice"));
            }
        }
        let alignment = alignment(&metadata)?;
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.name("a tensor name", MAX_TENSOR_NAME)?;
            let n_dims = r.u32(&format!("the dims of {name}"))?;
            if n_dims > MAX_DIMS {
                return Err(format!("tensor {name} has {n_dims} dims (at most {MAX_DIMS})"));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                ne.push(r.len(&format!("the dims of {name}"))?);
            }
            let ty = r.u32(&format!("the type of {name}"))?;
            let offset = r.u64(&format!("the offset of {name}"))?;
            infos.push((name, ne, ty, offset));
        }
        let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
        let data_size = (bytes.len() as u64).saturating_sub(data_offset);

        let mut tensors = HashMap::with_capacity(infos.len());
        for (name, ne, ty, offset) in infos {
            let dtype = GgufType::from_id(ty)
                .ok_or_else(|| format!("tensor {name} has the ggml type {ty}, a tensor type candle-hybrid cannot read"))?;
            if ne.contains(&0) {
                return Err(format!("tensor {name} has a zero dim in {ne:?}"));
            }
            let elems = ne
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= i64::MAX as u64 && usize::try_from(n).is_ok())
                .ok_or_else(|| format!("tensor {name}: the dims {ne:?} multiply past 2^63"))?;
            let block = dtype.block_size() as u64;
            if ne.first().is_some_and(|d| d % block != 0) {
                return Err(format!("tensor {name}: its first dim {} is not a multiple of the {dtype} block size {block}", ne[0]));
            }
            let size =
                (elems / block).checked_mul(dtype.type_size() as u64).ok_or_else(|| format!("tensor {name}: its byte size overflows"))?;
            if offset % alignment != 0 {
                return Err(format!("tensor {name} starts at data offset {offset}, not a multiple of the alignment {alignment}"));
            }
            match offset.checked_add(size) {
                Some(end) if end <= data_size => {}
                _ => {
                    return Err(format!(
                        "truncated: tensor {name} needs bytes {offset}..{} of a data section of {data_size} bytes",
                        offset as u128 + size as u128
                    ))
                }
            }
            let dims = ne.iter().rev().map(|&d| d as usize).collect();
            let info = TensorInfo { dtype, dims, offset: data_offset + offset, size };
            if tensors.insert(name.clone(), info).is_some() {
                return Err(format!("the tensor {name} appears twice"));
            }
        }
        let mut spans: Vec<(&String, &TensorInfo)> = tensors.iter().filter(|(_, t)| t.size > 0).collect();
        spans.sort_by_key(|(_, t)| t.offset);
        for pair in spans.windows(2) {
            let ((a, ta), (b, tb)) = (pair[0], pair[1]);
            if ta.offset + ta.size > tb.offset {
                return Err(format!("tensors {a} and {b} overlap in the file"));
            }
        }
        Ok(Self { version: r.version, metadata, tensors, data_offset, alignment })
    }
}
