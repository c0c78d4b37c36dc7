//! Synapse's stream map: for each of Synapse's `MultiWriterIdGenerator`
//! streams, its sequence, direction, tables and where its writers come from.
//!
//! The map is `sql/synapse_streams.tsv` (PostgreSQL `COPY` text format with
//! a header line, one row per (stream, table)); the extension embeds that
//! file at build time and parses it here, so the file stays the one source
//! (a test checks it against Synapse's own code).

use thiserror::Error;

/// The header of the map, column by column.
pub const COLUMNS: [&str; 9] = [
    "stream_name",
    "sequence_name",
    "backwards",
    "table_position",
    "table_name",
    "instance_column",
    "id_column",
    "writers",
    "source",
];

/// A table whose rows carry a stream's IDs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapTable {
    pub name: String,
    pub instance_column: String,
    pub id_column: String,
}

/// Where Synapse takes a stream's writers from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Writers {
    /// `stream_writers.<key>`: the `stream_writers` section of
    /// `homeserver.yaml` (not in the database).
    Configured(String),
    /// A list hard-coded in Synapse (`{master}`); empty (`{}`) means any
    /// instance writes and Synapse stores no positions for the stream.
    Fixed(Vec<String>),
}

/// One stream of the map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapStream {
    pub name: String,
    pub sequence: String,
    pub backwards: bool,
    /// In Synapse's order.
    pub tables: Vec<MapTable>,
    pub writers: Writers,
    /// Where Synapse constructs the generator (`file.py:Class`).
    pub source: String,
}

#[derive(Debug, Error, PartialEq, Eq)]
#[error("line {line} of the Synapse stream map: {reason}")]
pub struct MapError {
    pub line: usize,
    pub reason: String,
}

fn error(line: usize, reason: impl Into<String>) -> MapError {
    MapError {
        line,
        reason: reason.into(),
    }
}

/// One field of COPY text format: backslash escapes decoded; `\N` (NULL)
/// is refused, as every column of the map has a value.
fn field(raw: &str, line: usize) -> Result<String, MapError> {
    if raw == "\\N" {
        return Err(error(line, "a field is NULL"));
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        out.push(match chars.next() {
            Some('t') => '\t',
            Some('n') => '\n',
            Some('r') => '\r',
            Some('\\') => '\\',
            Some(other) => {
                return Err(error(line, format!("unsupported escape \\{other}")));
            }
            None => return Err(error(line, "a field ends with a backslash")),
        });
    }
    Ok(out)
}

fn writers(text: &str, line: usize) -> Result<Writers, MapError> {
    if let Some(key) = text.strip_prefix("stream_writers.") {
        if key.is_empty() {
            return Err(error(line, "writers names no stream_writers key"));
        }
        return Ok(Writers::Configured(key.to_string()));
    }
    let inner = text
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'))
        .ok_or_else(|| {
            error(
                line,
                format!("writers {text:?} is neither stream_writers.<key> nor {{…}}"),
            )
        })?;
    Ok(Writers::Fixed(
        inner
            .split(',')
            .filter(|w| !w.is_empty())
            .map(str::to_string)
            .collect(),
    ))
}

/// Parse the map. Rows of one stream must be consecutive, with table
/// positions 1, 2, … and the same sequence, direction, writers and source.
pub fn parse(text: &str) -> Result<Vec<MapStream>, MapError> {
    let mut lines = text.lines().enumerate().map(|(n, l)| (n + 1, l));
    let (_, header) = lines.next().ok_or_else(|| error(1, "the map is empty"))?;
    if header.split('\t').ne(COLUMNS) {
        return Err(error(
            1,
            format!("the header is not {}", COLUMNS.join(", ")),
        ));
    }
    let mut streams: Vec<MapStream> = Vec::new();
    for (line, raw) in lines {
        if raw.is_empty() {
            continue;
        }
        let fields = raw
            .split('\t')
            .map(|f| field(f, line))
            .collect::<Result<Vec<_>, _>>()?;
        let [name, sequence, backwards, position, table, instance_column, id_column, writer_list, source]: [String; 9] =
            fields
                .try_into()
                .map_err(|f: Vec<String>| error(line, format!("{} fields, not {}", f.len(), COLUMNS.len())))?;
        let backwards = match backwards.as_str() {
            "t" => true,
            "f" => false,
            other => return Err(error(line, format!("backwards is {other:?}, not t or f"))),
        };
        let position: usize = position
            .parse()
            .map_err(|_| error(line, format!("table_position {position:?} is not a number")))?;
        let writers = writers(&writer_list, line)?;
        let table = MapTable {
            name: table,
            instance_column,
            id_column,
        };
        match streams.last_mut() {
            Some(last) if last.name == name => {
                if last.sequence != sequence
                    || last.backwards != backwards
                    || last.writers != writers
                    || last.source != source
                {
                    return Err(error(
                        line,
                        format!("stream {name} changes its sequence, direction, writers or source"),
                    ));
                }
                if position != last.tables.len() + 1 {
                    return Err(error(
                        line,
                        format!("table_position {position} of stream {name} is out of order"),
                    ));
                }
                last.tables.push(table);
            }
            _ => {
                if streams.iter().any(|s| s.name == name) {
                    return Err(error(
                        line,
                        format!("the rows of stream {name} are not consecutive"),
                    ));
                }
                if position != 1 {
                    return Err(error(
                        line,
                        format!("stream {name} starts at table_position {position}"),
                    ));
                }
                streams.push(MapStream {
                    name,
                    sequence,
                    backwards,
                    tables: vec![table],
                    writers,
                    source,
                });
            }
        }
    }
    Ok(streams)
}
