//! Records from columnar files: Parquet tables, Arrow IPC files, and the folders `datasets`'
//! `save_to_disk` writes. Each row becomes the JSON object it would be in a JSON-lines file
//! and is read by the same schemas ([`super::records`]), so a row is named in errors as a line
//! is (`row N`, counted from 1 over the whole file or folder).
//!
//! Columns of types the schemas never read (binary, dates, decimals...) come through as null:
//! they are ignored unless `--columns` points a field at them, and then the error names the
//! field.

use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::DataType;
use parquet::file::reader::{FileReader, SerializedFileReader};
use serde_json::{Map, Value};

use super::records::{object_record, uniform, Columns, Origin, Record};
use crate::{Error, Result};

/// The records of a Parquet file.
pub fn parquet(path: &Path, columns: &Columns) -> Result<Vec<Record>> {
    let unreadable = |e: parquet::errors::ParquetError| {
        Error::Usage(format!(
            "`{}` cannot be read as Parquet ({e}); give a Parquet file, or name the file's \
             format with --data-format",
            path.display()
        ))
    };
    let file = crate::input_file::open(path)
        .map_err(|e| Error::file("cannot read training data", path, e))?;
    let reader = SerializedFileReader::new(file).map_err(unreadable)?;
    let mut records = Vec::new();
    for (i, row) in reader.get_row_iter(None).map_err(unreadable)?.enumerate() {
        let origin = row_origin(path, i);
        let row = row.map_err(|e| Error::Usage(format!("{origin}: cannot be read ({e})")))?;
        records.push(object_record(&row.to_json_value(), columns, &origin)?);
    }
    uniform(records, path)
}

/// The records of Arrow data: a `.arrow` file (stream or file format), or a `datasets`
/// folder (its shards in order; of a `DatasetDict`, the `train` split).
pub fn arrow(path: &Path, columns: &Columns) -> Result<Vec<Record>> {
    let shards = if path.is_dir() {
        saved_shards(path)?
    } else {
        vec![path.to_path_buf()]
    };
    let mut records = Vec::new();
    for shard in &shards {
        for batch in arrow_batches(shard)? {
            for i in 0..batch.num_rows() {
                let origin = row_origin(path, records.len());
                let row = Value::Object(row_object(&batch, i));
                records.push(object_record(&row, columns, &origin)?);
            }
        }
    }
    uniform(records, path)
}

fn row_origin(path: &Path, index: usize) -> Origin {
    Origin {
        file: path.to_path_buf(),
        unit: "row",
        number: index + 1,
    }
}

/// The Arrow files of a `save_to_disk` folder, in the order its `state.json` lists them (else
/// by name); a `DatasetDict` folder gives its `train` split's.
fn saved_shards(dir: &Path) -> Result<Vec<PathBuf>> {
    let splits = dir.join("dataset_dict.json");
    if splits.is_file() {
        let train = dir.join("train");
        if !train.is_dir() {
            let listed =
                crate::input_file::read_to_string(&splits, crate::input_file::DOCUMENT_LIMIT)
                    .unwrap_or_default();
            return Err(Error::Usage(format!(
                "`{}` is a dataset of splits ({}) without a `train` split; give the folder of \
                 the split to train on",
                dir.display(),
                listed.trim()
            )));
        }
        return saved_shards(&train);
    }
    let state = dir.join("state.json");
    if let Ok(text) = crate::input_file::read_to_string(&state, crate::input_file::DOCUMENT_LIMIT) {
        let listed: Option<Vec<PathBuf>> = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v.get("_data_files")?.as_array().cloned())
            .map(|files| {
                files
                    .iter()
                    .filter_map(|f| f.get("filename")?.as_str().map(|n| dir.join(n)))
                    .collect()
            });
        if let Some(files) = listed.filter(|f| !f.is_empty()) {
            return Ok(files);
        }
    }
    let entries = std::fs::read_dir(dir).map_err(|e| Error::file("cannot read", dir, e))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "arrow"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::Usage(format!(
            "`{}` holds no .arrow file; give a folder `datasets` saved with save_to_disk",
            dir.display()
        )));
    }
    Ok(files)
}

/// The record batches of an Arrow IPC file, in the stream format `datasets` writes or the file
/// format.
fn arrow_batches(path: &Path) -> Result<Vec<RecordBatch>> {
    let open = || {
        crate::input_file::open(path).map_err(|e| Error::file("cannot read training data", path, e))
    };
    let unreadable = |e: arrow_schema::ArrowError| {
        Error::Usage(format!(
            "`{}` cannot be read as Arrow ({e}); give a file `datasets` or pyarrow wrote",
            path.display()
        ))
    };
    let batches: std::result::Result<Vec<RecordBatch>, _> =
        match arrow_ipc::reader::StreamReader::try_new_buffered(open()?, None) {
            Ok(stream) => stream.collect(),
            Err(_) => arrow_ipc::reader::FileReader::try_new_buffered(open()?, None)
                .map_err(unreadable)?
                .collect(),
        };
    batches.map_err(unreadable)
}

/// Row `i` of `batch` as a JSON object.
fn row_object(batch: &RecordBatch, i: usize) -> Map<String, Value> {
    let schema = batch.schema();
    schema
        .fields()
        .iter()
        .zip(batch.columns())
        .map(|(field, column)| (field.name().clone(), json_value(column.as_ref(), i)))
        .collect()
}

/// Element `i` of `array` as JSON: strings, numbers, booleans, lists and structs as they
/// are; other types as null.
fn json_value(array: &dyn Array, i: usize) -> Value {
    if array.is_null(i) {
        return Value::Null;
    }
    macro_rules! number {
        ($t:ty) => {
            Value::from(array.as_primitive::<$t>().value(i))
        };
    }
    match array.data_type() {
        DataType::Utf8 => Value::from(array.as_string::<i32>().value(i)),
        DataType::LargeUtf8 => Value::from(array.as_string::<i64>().value(i)),
        DataType::Utf8View => Value::from(array.as_string_view().value(i)),
        DataType::Boolean => Value::from(array.as_boolean().value(i)),
        DataType::Int8 => number!(Int8Type),
        DataType::Int16 => number!(Int16Type),
        DataType::Int32 => number!(Int32Type),
        DataType::Int64 => number!(Int64Type),
        DataType::UInt8 => number!(UInt8Type),
        DataType::UInt16 => number!(UInt16Type),
        DataType::UInt32 => number!(UInt32Type),
        DataType::UInt64 => number!(UInt64Type),
        DataType::Float32 => number!(Float32Type),
        DataType::Float64 => number!(Float64Type),
        DataType::List(_) => list(array.as_list::<i32>().value(i).as_ref()),
        DataType::LargeList(_) => list(array.as_list::<i64>().value(i).as_ref()),
        DataType::Struct(fields) => {
            let parts = array.as_struct();
            let object = fields
                .iter()
                .zip(parts.columns())
                .map(|(field, column)| (field.name().clone(), json_value(column.as_ref(), i)))
                .collect();
            Value::Object(object)
        }
        _ => Value::Null,
    }
}

fn list(items: &dyn Array) -> Value {
    Value::Array((0..items.len()).map(|j| json_value(items, j)).collect())
}
