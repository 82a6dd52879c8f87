//! Conversions at the Python boundary: bytes arguments, `open()`'s keyword options and the
//! `stats()` dictionary.

use std::path::PathBuf;
use std::str::FromStr;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyMemoryView, PyString};

use crate::errors;

/// A key or value argument: borrowed from an immutable `bytes`, copied from anything else.
///
/// A borrowed slice may cross [`Python::detach`]: a `bytes` object never changes and the
/// caller's reference keeps it alive. A `bytearray`, `memoryview` or other buffer may be
/// changed by another thread while the GIL is released, so it is copied first.
#[derive(Debug)]
pub(crate) enum Arg<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

impl Arg<'_> {
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Arg::Borrowed(s) => s,
            Arg::Owned(v) => v,
        }
    }
}

/// Accept `bytes` or any object with the buffer protocol; refuse `str` (no silent encoding)
/// and everything else with `TypeError`. `what` names the argument in the message.
pub(crate) fn bytes_arg<'a>(obj: &'a Bound<'_, PyAny>, what: &str) -> PyResult<Arg<'a>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Arg::Borrowed(b.as_bytes()));
    }
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be bytes (or another buffer), not str: encode it first, e.g. s.encode()"
        )));
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return Ok(Arg::Owned(b.to_vec()));
    }
    // Any other buffer (memoryview, array.array, numpy arrays, mmap, ...): the stable ABI of
    // Python 3.9 has no PyObject_GetBuffer, so go through a memoryview and copy its bytes
    // (C order for a non-contiguous view).
    match PyMemoryView::from(obj) {
        Ok(view) => {
            let copy = view.call_method0("tobytes")?;
            let copy = copy.cast::<PyBytes>()?;
            Ok(Arg::Owned(copy.as_bytes().to_vec()))
        }
        Err(_) => Err(PyTypeError::new_err(format!(
            "{what} must be bytes or a buffer (bytearray, memoryview, ...), not {}",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
        ))),
    }
}

/// Extract option `name` as `T`, naming the option in the error.
fn opt<T>(v: &Bound<'_, PyAny>, name: &str) -> PyResult<T>
where
    T: for<'a, 'py> FromPyObject<'a, 'py>,
{
    v.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        let ty = v.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
        PyTypeError::new_err(format!("option {name}: {ty} not accepted ({e})"))
    })
}

/// Parse a named variant of an option from its string.
fn opt_str<T: FromStr>(py: Python<'_>, v: &Bound<'_, PyAny>, name: &str) -> PyResult<T>
where
    T::Err: std::fmt::Display,
{
    let s: String = opt(v, name)?;
    T::from_str(&s).map_err(|e| errors::invalid(py, format!("option {name}: {e}")))
}

fn unknown(name: &str) -> PyErr {
    PyTypeError::new_err(format!("open() got an unexpected option {name:?}"))
}

/// Fill the fields of one preset's options struct from a dict (`native={"shards": 8}`).
macro_rules! preset_fields {
    ($py:expr, $value:expr, $target:expr, $prefix:literal, { $($field:ident),* $(,)? } $(, $special:literal => $handler:expr)?) => {{
        let dict = $value.cast::<PyDict>().map_err(|_| {
            PyTypeError::new_err(concat!("option ", $prefix, " must be a dict of its fields"))
        })?;
        for (k, v) in dict.iter() {
            let field: String = k.extract()?;
            let full = format!("{}.{}", $prefix, field);
            match field.as_str() {
                $( stringify!($field) => $target.$field = opt(&v, &full)?, )*
                $( $special => ($handler)(&mut $target, &v, &full)?, )?
                _ => return Err(unknown(&full)),
            }
        }
    }};
}

/// `tierkv.Options` from `open()`'s keywords. Top-level fields are keywords of the same
/// name; each preset's options are a dict keyword named after the preset. Unknown names are
/// a `TypeError`, values of the wrong type too; values tierkv refuses are `InvalidArgument`
/// (raised by the open itself).
pub(crate) fn options(py: Python<'_>, preset: &str, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<tierkv::Options> {
    let preset = tierkv::Preset::from_str(preset).map_err(|e| errors::to_py(py, e))?;
    let mut o = tierkv::Options::new().preset(preset);
    let Some(kwargs) = kwargs else { return Ok(o) };
    for (k, v) in kwargs.iter() {
        let name: String = k.extract()?;
        let n = name.as_str();
        match n {
            "create_if_missing" => o.create_if_missing = opt(&v, n)?,
            "error_if_exists" => o.error_if_exists = opt(&v, n)?,
            "pm_path" => o.pm_path = if v.is_none() { None } else { Some(opt::<PathBuf>(&v, n)?) },
            "pm_sync" => o.pm_sync = opt(&v, n)?,
            "pm_write_latency_ns" => o.pm_write_latency_ns = opt(&v, n)?,
            "pm_write_bandwidth_mbps" => o.pm_write_bandwidth_mbps = opt(&v, n)?,
            "pm_read_latency_ns" => o.pm_read_latency_ns = opt(&v, n)?,
            "pm_profile" => o = o.pm_profile(opt_str(py, &v, n)?),
            "pm_capacity" => o.pm_capacity = opt(&v, n)?,
            "pm_preallocate" => o.pm_preallocate = opt(&v, n)?,
            "pm_pool_size" => o.pm_pool_size = opt(&v, n)?,
            "max_key_size" => o.max_key_size = opt(&v, n)?,
            "max_value_size" => o.max_value_size = opt(&v, n)?,
            "wal_recovery" => o.wal_recovery = opt_str(py, &v, n)?,
            "native" => preset_fields!(py, v, o.native, "native", {
                shards, segment_size, verify_reads, dram_budget, pm_watermark, background, checkpoint_bytes
            }),
            "pmekv" => preset_fields!(py, v, o.pmekv, "pmekv", {
                node_capacity, kv_log_size, key_log_size, writeback_interval_ms
            }),
            "slmdb" => preset_fields!(py, v, o.slmdb, "slmdb", {
                memtable_size, block_size, bloom_bits_per_key, block_cache_size, output_file_size,
                live_key_threshold, leaf_scan_files, leaf_node_threshold, seq_subrange_keys,
                seq_degree_threshold, enable_live_ratio, enable_leaf_scan, enable_seq_degree,
                max_merge_files, candidate_trigger, background
            }),
            "hpdk" => preset_fields!(py, v, o.hpdk, "hpdk", {
                memtable_size, vlog_pool_size, sync_wal, live_rate_threshold, merge_trigger,
                block_size, bloom_bits_per_key, use_btree, enable_merge, background
            }),
            "lightkv" => preset_fields!(py, v, o.lightkv, "lightkv", {
                max_leaf_nodes, leaf_buckets, t_normal, segment_size, compaction_size, block_size,
                block_cache_size, background
            }, "placement" => |t: &mut tierkv::LightkvOptions, v: &Bound<'_, PyAny>, full: &str| -> PyResult<()> {
                let s: String = opt(v, full)?;
                t.placement = match s.as_str() {
                    "hybrid" => tierkv::LightkvPlacement::Hybrid,
                    "dram" => tierkv::LightkvPlacement::Dram,
                    "pm" => tierkv::LightkvPlacement::Pm,
                    _ => return Err(errors::invalid(py, format!("option {full}: {s:?} is not hybrid, dram or pm"))),
                };
                Ok(())
            }),
            "hoakv" => preset_fields!(py, v, o.hoakv, "hoakv", {
                hot_store_size, vtable_size, hash_functions, hot_buckets, heat_window,
                promote_min_heat, value_size, group_size, cold_index_capacity, memtable_size,
                level1_size, target_file_size, block_size, bloom_bits_per_key, block_cache_size,
                sync_wal, background
            }),
            _ => return Err(unknown(n)),
        }
    }
    Ok(o)
}

/// A JSON value (from `Stats`' serde form) as a Python object.
pub(crate) fn json_to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => pyo3::types::PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                u.into_pyobject(py)?.into_any()
            } else if let Some(i) = n.as_i64() {
                i.into_pyobject(py)?.into_any()
            } else {
                n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any()
            }
        }
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(a) => {
            let list = PyList::empty(py);
            for x in a {
                list.append(json_to_py(py, x)?)?;
            }
            list.into_any()
        }
        Value::Object(m) => {
            let dict = PyDict::new(py);
            for (k, x) in m {
                dict.set_item(k, json_to_py(py, x)?)?;
            }
            dict.into_any()
        }
    })
}
