//! The tensors of a checkpoint directory, memory-mapped and indexed by name.
//!
//! One safetensors file (`model.safetensors`), shards listed by `model.safetensors.index.json`, or —
//! failing both — every `*.safetensors` file of the directory. Each file is mapped once; a tensor is a
//! [`Blob`] view whose owner is the `Arc<Mmap>`, so the bytes are never copied and the map lives as
//! long as any matrix that points into it.
//!
//! The header is parsed here (not by `SafeTensors::deserialize`) so that every problem names the file
//! and the tensor: a truncated file says which tensor runs past the end, a corrupt entry says which
//! entry. The store also records which tensors were consumed, so the loader can refuse leftovers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use memmap2::Mmap;
use safetensors::tensor::TensorInfo;
use safetensors::Dtype;

use crate::error::LoadError;
use crate::matrix::{Blob, DType};

const HEADER_LEN_BYTES: usize = 8;
/// safetensors refuses headers above 100 MB; so do we.
const MAX_HEADER_BYTES: usize = 100_000_000;

pub struct MappedFile {
    pub path: PathBuf,
    /// The file's bytes: a memory map, or (with [`Residency::Read`]) a copy in memory.
    pub map: Arc<dyn AsRef<[u8]> + Send + Sync>,
    /// Set when mapped: what the file looked like when it was mapped.
    pub stamp: Option<FileStamp>,
}

/// How the weights' bytes are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Residency {
    /// Memory-mapped (no copy, pages read on demand). A file truncated or overwritten while served
    /// changes what the engine reads, or kills the process with SIGBUS: watch the stamps.
    #[default]
    Mapped,
    /// Read into memory at load: later changes to the files do not matter (`--no-mmap`).
    Read,
}

/// Length, modification time and inode of a file: enough to notice a `cp` over it, an in-place
/// write or a truncation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStamp {
    pub path: PathBuf,
    len: u64,
    modified: Option<std::time::SystemTime>,
    inode: u64,
}

impl FileStamp {
    pub fn of(path: &Path) -> std::io::Result<FileStamp> {
        let meta = std::fs::metadata(path)?;
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(&meta);
        #[cfg(not(unix))]
        let inode = 0;
        Ok(FileStamp {
            path: path.to_path_buf(),
            len: meta.len(),
            modified: meta.modified().ok(),
            inode,
        })
    }

    /// What changed since the stamp was taken (None: nothing).
    pub fn changed(&self) -> Option<String> {
        match FileStamp::of(&self.path) {
            Err(e) => Some(format!("it cannot be read any more ({e})")),
            Ok(now) if now.inode != self.inode => {
                Some("it was replaced (another file now has its name)".into())
            }
            Ok(now) if now.len != self.len => Some(format!(
                "its length changed from {} to {} bytes",
                self.len, now.len
            )),
            Ok(now) if now.modified != self.modified => Some("it was written to".into()),
            Ok(_) => None,
        }
    }
}

/// Where one tensor lives.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// index into [`TensorStore::files`]
    pub file: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// absolute byte range in the mapped file
    pub start: usize,
    pub len: usize,
}

/// A tensor taken from the store: its bytes (a view into the map) plus what describes them.
#[derive(Debug, Clone)]
pub struct TensorView {
    pub name: String,
    pub path: PathBuf,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Blob,
}

impl TensorView {
    /// The float dtype of this tensor, or a dtype error naming it.
    pub fn float_dtype(&self) -> Result<DType, LoadError> {
        float_dtype(self.dtype).ok_or_else(|| self.dtype_error("f32, bf16 or f16"))
    }

    pub fn dtype_error(&self, expected: &str) -> LoadError {
        LoadError::DType {
            path: self.path.clone(),
            tensor: self.name.clone(),
            expected: expected.to_string(),
            found: dtype_name(self.dtype),
        }
    }

    pub fn shape_error(&self, expected: &[usize]) -> LoadError {
        LoadError::Shape {
            path: self.path.clone(),
            tensor: self.name.clone(),
            expected: expected.to_vec(),
            found: self.shape.clone(),
        }
    }

    pub fn expect_shape(&self, expected: &[usize]) -> Result<(), LoadError> {
        if self.shape != expected {
            return Err(self.shape_error(expected));
        }
        Ok(())
    }

    /// The tensor as f32 values (norm gains, conv taps, A_log …: small tensors only).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, LoadError> {
        let dtype = self.float_dtype()?;
        let bytes = self.data.bytes();
        Ok((0..bytes.len() / dtype.size())
            .map(|i| dtype.read(bytes, i))
            .collect())
    }
}

pub fn float_dtype(dtype: Dtype) -> Option<DType> {
    match dtype {
        Dtype::F32 => Some(DType::F32),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F16 => Some(DType::F16),
        _ => None,
    }
}

pub fn dtype_name(dtype: Dtype) -> String {
    match float_dtype(dtype) {
        Some(d) => d.name().to_string(),
        None => format!("{dtype:?}").to_lowercase(),
    }
}

pub struct TensorStore {
    pub dir: PathBuf,
    pub files: Vec<MappedFile>,
    tensors: BTreeMap<String, TensorEntry>,
    consumed: Mutex<BTreeSet<String>>,
}

impl TensorStore {
    /// Map the safetensors files of a checkpoint directory.
    pub fn open(dir: &Path) -> Result<TensorStore, LoadError> {
        TensorStore::open_with(dir, Residency::Mapped)
    }

    /// Map, or read into memory, the safetensors files of a checkpoint directory.
    pub fn open_with(dir: &Path, residency: Residency) -> Result<TensorStore, LoadError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single_path = dir.join("model.safetensors");
        let (file_names, index) = if index_path.is_file() {
            let (files, map) = read_index(&index_path)?;
            (files, Some(map))
        } else if single_path.is_file() {
            (vec!["model.safetensors".to_string()], None)
        } else {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .map_err(|e| LoadError::io(dir, e))?
                .filter_map(|entry| entry.ok())
                .filter_map(|entry| entry.file_name().into_string().ok())
                .filter(|name| name.ends_with(".safetensors"))
                .collect();
            names.sort();
            if names.is_empty() {
                return Err(LoadError::MissingFile {
                    path: dir.to_path_buf(),
                    what:
                        "no model.safetensors.index.json, model.safetensors or *.safetensors file"
                            .into(),
                });
            }
            (names, None)
        };

        let mut store = TensorStore {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            tensors: BTreeMap::new(),
            consumed: Mutex::new(BTreeSet::new()),
        };
        for name in &file_names {
            let path = dir.join(name);
            let (map, stamp): (Arc<dyn AsRef<[u8]> + Send + Sync>, _) = match residency {
                Residency::Mapped => {
                    let stamp = FileStamp::of(&path).map_err(|e| LoadError::io(&path, e))?;
                    (Arc::new(map_file(&path)?), Some(stamp))
                }
                Residency::Read => (Arc::new(read_file(&path)?), None),
            };
            let file_index = store.files.len();
            for (tensor, entry) in parse_header(&path, (*map).as_ref(), file_index)? {
                if let Some(previous) = store.tensors.get(&tensor) {
                    return Err(LoadError::Inconsistent {
                        path: path.clone(),
                        detail: format!(
                            "tensor `{tensor}` is also stored in {}",
                            store.files[previous.file].path.display()
                        ),
                    });
                }
                store.tensors.insert(tensor, entry);
            }
            store.files.push(MappedFile { path, map, stamp });
        }
        if let Some(weight_map) = index {
            for (tensor, file) in &weight_map {
                let found = store
                    .tensors
                    .get(tensor)
                    .map(|e| store.files[e.file].path.file_name() == Some(file.as_ref()));
                if found != Some(true) {
                    return Err(LoadError::Index {
                        path: index_path.clone(),
                        detail: format!("weight_map says tensor `{tensor}` is in {file}, but that file does not contain it"),
                    });
                }
            }
        }
        Ok(store)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn entry(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn path_of(&self, entry: &TensorEntry) -> &Path {
        &self.files[entry.file].path
    }

    /// Take a tensor (marks it consumed). `expected` describes it for the missing-tensor error.
    pub fn take(&self, name: &str, expected: &str) -> Result<TensorView, LoadError> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| LoadError::MissingTensor {
                tensor: name.to_string(),
                expected: expected.to_string(),
                looked_in: self.describe_files(),
            })?;
        self.mark_consumed(name);
        let file = &self.files[entry.file];
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = file.map.clone();
        Ok(TensorView {
            name: name.to_string(),
            path: file.path.clone(),
            dtype: entry.dtype,
            shape: entry.shape.clone(),
            data: Blob::from_owner(owner, entry.start, entry.len),
        })
    }

    /// Mark a tensor as used without reading it (ignored-by-rule tensors are marked by the caller).
    pub fn mark_consumed(&self, name: &str) {
        if let Ok(mut consumed) = self.consumed.lock() {
            consumed.insert(name.to_string());
        }
    }

    /// Tensors nobody took, in name order.
    pub fn unconsumed(&self) -> Vec<String> {
        let consumed = match self.consumed.lock() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        self.tensors
            .keys()
            .filter(|name| !consumed.contains(*name))
            .cloned()
            .collect()
    }

    pub fn describe_files(&self) -> String {
        let names: Vec<String> = self
            .files
            .iter()
            .map(|f| {
                f.path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default()
            })
            .collect();
        format!("{} in {}", names.join(", "), self.dir.display())
    }

    /// Bytes of all mapped files.
    pub fn total_file_bytes(&self) -> usize {
        self.files.iter().map(|f| (*f.map).as_ref().len()).sum()
    }
}

/// Open a checkpoint file for reading: a regular file only (a FIFO or device named
/// model.safetensors would block, or never end).
fn open_regular(path: &Path) -> Result<std::fs::File, LoadError> {
    let meta = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?;
    if !meta.is_file() {
        return Err(LoadError::Corrupt {
            path: path.to_path_buf(),
            detail: "not a regular file (a FIFO, device or directory)".into(),
        });
    }
    std::fs::File::open(path).map_err(|e| LoadError::io(path, e))
}

fn read_file(path: &Path) -> Result<Vec<u8>, LoadError> {
    use std::io::Read;
    let mut file = open_regular(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| LoadError::io(path, e))?;
    Ok(bytes)
}

fn map_file(path: &Path) -> Result<Mmap, LoadError> {
    let file = open_regular(path)?;
    // SAFETY: the map is read-only and calla never writes checkpoint files. A file changed by
    // another process while mapped changes these bytes (or raises SIGBUS when truncated): the
    // stamps let the server log it, and `Residency::Read` (`--no-mmap`) avoids it.
    unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))
}

/// `model.safetensors.index.json` → (shard file names, sorted; tensor → file).
fn read_index(path: &Path) -> Result<(Vec<String>, BTreeMap<String, String>), LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| LoadError::Json {
            path: path.to_path_buf(),
            source,
        })?;
    let weight_map = json
        .get("weight_map")
        .and_then(|w| w.as_object())
        .ok_or_else(|| LoadError::Index {
            path: path.to_path_buf(),
            detail: "no `weight_map` object".into(),
        })?;
    let mut files = Vec::new();
    let mut map = BTreeMap::new();
    for (tensor, file) in weight_map {
        let file = file.as_str().ok_or_else(|| LoadError::Index {
            path: path.to_path_buf(),
            detail: format!("weight_map entry for `{tensor}` is {file}, expected a file name"),
        })?;
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(LoadError::Index {
                path: path.to_path_buf(),
                detail: format!(
                    "weight_map entry for `{tensor}` points outside the directory: {file}"
                ),
            });
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
        map.insert(tensor.clone(), file.to_string());
    }
    files.sort();
    Ok((files, map))
}

/// A safetensors header's entries in file order, duplicates kept.
struct HeaderEntries(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for HeaderEntries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = HeaderEntries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<HeaderEntries, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    entries.push(entry);
                }
                Ok(HeaderEntries(entries))
            }
        }
        d.deserialize_map(Visitor)
    }
}

/// Parse and check a safetensors header against the file's length.
fn parse_header(
    path: &Path,
    map: &[u8],
    file: usize,
) -> Result<Vec<(String, TensorEntry)>, LoadError> {
    let corrupt = |detail: String| LoadError::Corrupt {
        path: path.to_path_buf(),
        detail,
    };
    if map.len() < HEADER_LEN_BYTES {
        return Err(corrupt(format!(
            "the file has {} bytes, fewer than the 8-byte header length",
            map.len()
        )));
    }
    let mut len_bytes = [0u8; HEADER_LEN_BYTES];
    len_bytes.copy_from_slice(&map[..HEADER_LEN_BYTES]);
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES as u64 {
        return Err(corrupt(format!(
            "header length {header_len} is implausibly large"
        )));
    }
    let header_end = HEADER_LEN_BYTES + header_len as usize;
    if header_end > map.len() {
        return Err(corrupt(format!(
            "header needs {header_end} bytes but the file has {} (truncated?)",
            map.len()
        )));
    }
    // Kept as a list: a JSON object read into a map keeps only the last of two equal keys, which
    // would let a file hold two tensors of one name silently.
    let header: HeaderEntries = serde_json::from_slice(&map[HEADER_LEN_BYTES..header_end])
        .map_err(|e| corrupt(format!("header is not a JSON object: {e}")))?;
    let header = header.0;
    let mut seen = BTreeSet::new();
    for (name, _) in &header {
        if !seen.insert(name.as_str()) {
            return Err(corrupt(format!(
                "tensor `{name}` appears twice in the header"
            )));
        }
    }
    let mut entries = Vec::with_capacity(header.len());
    for (name, value) in header {
        if name == "__metadata__" {
            continue;
        }
        let info: TensorInfo = serde_json::from_value(value.clone()).map_err(|e| {
            let detail = match value.get("dtype").and_then(|d| d.as_str()) {
                Some(d) if serde_json::from_value::<Dtype>(serde_json::json!(d)).is_err() => {
                    format!("unknown dtype {d:?}")
                }
                _ => e.to_string(),
            };
            corrupt(format!(
                "header entry for tensor `{name}` is invalid ({detail}): {value}"
            ))
        })?;
        let (begin, end) = info.data_offsets;
        let numel = info
            .shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| corrupt(format!("tensor `{name}`: shape {:?} overflows", info.shape)))?;
        let bits = numel.checked_mul(info.dtype.bitsize());
        let expected_bytes = bits.filter(|b| b % 8 == 0).map(|b| b / 8);
        if end < begin || Some(end - begin) != expected_bytes {
            return Err(corrupt(format!(
                "tensor `{name}`: data_offsets [{begin}, {end}) span {} bytes, but shape {:?} of {} needs {}",
                end.saturating_sub(begin),
                info.shape,
                dtype_name(info.dtype),
                expected_bytes.map_or("an unrepresentable number of".to_string(), |b| b.to_string())
            )));
        }
        // Offsets come from the file: every sum is checked (a wrap past 2^64 used to panic later).
        let start = header_end.checked_add(begin);
        let stop = start.and_then(|s| s.checked_add(end - begin));
        let (Some(start), Some(_)) = (start, stop) else {
            return Err(corrupt(format!(
                "tensor `{name}`: data_offsets [{begin}, {end}) overflow"
            )));
        };
        entries.push((
            name,
            TensorEntry {
                file,
                dtype: info.dtype,
                shape: info.shape,
                start,
                len: end - begin,
            },
        ));
    }
    // Two tensors must not share bytes (a crafted header could alias one tensor's data as another).
    let mut by_start: Vec<&(String, TensorEntry)> =
        entries.iter().filter(|(_, e)| e.len > 0).collect();
    by_start.sort_by_key(|(_, e)| e.start);
    for pair in by_start.windows(2) {
        let ((a, ea), (b, eb)) = (pair[0], pair[1]);
        if ea.start + ea.len > eb.start {
            return Err(corrupt(format!(
                "tensors `{a}` and `{b}` overlap (bytes [{}, {}) and [{}, {}))",
                ea.start - header_end,
                ea.start + ea.len - header_end,
                eb.start - header_end,
                eb.start + eb.len - header_end
            )));
        }
    }
    // Truncation: name the first tensor (in file order) that runs past the end.
    let needed = entries
        .iter()
        .map(|(_, e)| e.start + e.len)
        .max()
        .unwrap_or(header_end);
    if needed > map.len() {
        let first_cut = entries
            .iter()
            .filter(|(_, e)| e.start + e.len > map.len())
            .min_by_key(|(_, e)| e.start)
            .map(|(n, _)| n.clone())
            .unwrap_or_default();
        return Err(LoadError::Truncated {
            path: path.to_path_buf(),
            tensor: first_cut,
            needed,
            found: map.len(),
        });
    }
    Ok(entries)
}
