//! The Synapse stream map: the real file parses into the streams the docs
//! list, and malformed maps are refused with the line at fault.

use streampos_core::synapse_map::{parse, MapTable, Writers};

const MAP: &str = include_str!("../../sql/synapse_streams.tsv");
const HEADER: &str = "stream_name\tsequence_name\tbackwards\ttable_position\ttable_name\tinstance_column\tid_column\twriters\tsource\n";

#[test]
fn the_map_has_synapses_seventeen_streams() {
    let streams = parse(MAP).unwrap();
    assert_eq!(streams.len(), 17);
    let names: Vec<&str> = streams.iter().map(|s| s.name.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), 17, "stream names are unique");
    assert_eq!(
        streams.iter().map(|s| s.tables.len()).sum::<usize>(),
        MAP.lines().count() - 1
    );
    // backfill is the only backward stream.
    let backwards: Vec<&str> = streams
        .iter()
        .filter(|s| s.backwards)
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(backwards, ["backfill"]);
}

#[test]
fn events_and_backfill_share_tables_in_synapses_order() {
    let streams = parse(MAP).unwrap();
    let events = streams.iter().find(|s| s.name == "events").unwrap();
    assert_eq!(events.sequence, "events_stream_seq");
    assert_eq!(
        events.tables,
        [
            ("events", "stream_ordering"),
            ("current_state_delta_stream", "stream_id"),
            ("ex_outlier_stream", "event_stream_ordering"),
        ]
        .map(|(name, id)| MapTable {
            name: name.into(),
            instance_column: "instance_name".into(),
            id_column: id.into(),
        })
    );
    assert_eq!(events.writers, Writers::Configured("events".into()));
    let backfill = streams.iter().find(|s| s.name == "backfill").unwrap();
    assert_eq!(backfill.sequence, "events_backfill_stream_seq");
    assert_eq!(backfill.tables[0].name, "events");
    let pushers = streams.iter().find(|s| s.name == "pushers").unwrap();
    assert_eq!(pushers.writers, Writers::Fixed(vec!["master".into()]));
    assert_eq!(pushers.tables[0].id_column, "id");
    let caches = streams.iter().find(|s| s.name == "caches").unwrap();
    assert_eq!(caches.writers, Writers::Fixed(vec![]));
    let quarantined = streams
        .iter()
        .find(|s| s.name == "quarantined_media")
        .unwrap();
    assert_eq!(quarantined.sequence, "quarantined_media_id_seq");
}

#[test]
fn copy_text_escapes_are_decoded() {
    let map = format!("{HEADER}a\\\\b\ts\tf\t1\tt\\tx\ti\tid\t{{}}\tsrc\n");
    let streams = parse(&map).unwrap();
    assert_eq!(streams[0].name, "a\\b");
    assert_eq!(streams[0].tables[0].name, "t\tx");
}

#[test]
fn malformed_maps_are_refused_with_their_line() {
    let row = |stream: &str, position: &str, backwards: &str, writers: &str| {
        format!("{stream}\tseq\t{backwards}\t{position}\ttbl\tinstance_name\tstream_id\t{writers}\tsrc\n")
    };
    let cases = [
        (String::new(), 1, "empty"),
        ("stream\tsequence\n".to_string(), 1, "header"),
        (format!("{HEADER}a\tseq\tf\n"), 2, "3 fields"),
        (
            format!("{HEADER}{}", row("a", "1", "x", "{}")),
            2,
            "backwards",
        ),
        (
            format!("{HEADER}{}", row("a", "one", "f", "{}")),
            2,
            "table_position",
        ),
        (
            format!("{HEADER}{}", row("a", "2", "f", "{}")),
            2,
            "starts at",
        ),
        (
            format!(
                "{HEADER}{}{}",
                row("a", "1", "f", "{}"),
                row("a", "3", "f", "{}")
            ),
            3,
            "out of order",
        ),
        (
            format!(
                "{HEADER}{}{}",
                row("a", "1", "f", "{}"),
                row("a", "2", "t", "{}")
            ),
            3,
            "changes",
        ),
        (
            format!(
                "{HEADER}{}{}{}",
                row("a", "1", "f", "{}"),
                row("b", "1", "f", "{}"),
                row("a", "2", "f", "{}")
            ),
            4,
            "not consecutive",
        ),
        (
            format!("{HEADER}{}", row("a", "1", "f", "master")),
            2,
            "writers",
        ),
        (
            format!("{HEADER}{}", row("a", "1", "f", "stream_writers.")),
            2,
            "key",
        ),
        (format!("{HEADER}{}", row("\\N", "1", "f", "{}")), 2, "NULL"),
        (
            format!("{HEADER}{}", row("a\\x", "1", "f", "{}")),
            2,
            "escape",
        ),
    ];
    for (map, line, reason) in cases {
        let err = parse(&map).unwrap_err();
        assert_eq!(err.line, line, "{map:?}: {err}");
        assert!(err.reason.contains(reason), "{map:?}: {err}");
    }
}
