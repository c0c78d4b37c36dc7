//! Every user-facing error, with its SQLSTATE. Messages are lower-case;
//! details and hints are sentences.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode as Code;
use streampos_core::token::TokenError;

/// Longest name (stream, instance) echoed in a message, in bytes; longer
/// ones are cut with "...". Names are at most 63 bytes when valid, and a
/// message must not echo unbounded input.
const MAX_ECHOED_NAME: usize = 63;

/// `name` as a message may echo it: at most `MAX_ECHOED_NAME` bytes.
pub fn clip(name: &str) -> String {
    if name.len() <= MAX_ECHOED_NAME {
        return name.to_string();
    }
    let mut end = MAX_ECHOED_NAME;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &name[..end])
}

/// A name from the caller, clipped when shown.
#[derive(Debug)]
pub struct Name(String);

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&clip(&self.0))
    }
}

impl From<&str> for Name {
    fn from(s: &str) -> Name {
        Name(s.to_string())
    }
}

impl From<String> for Name {
    fn from(s: String) -> Name {
        Name(s)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("stream \"{0}\" does not exist")]
    UnknownStream(Name),
    #[error("stream \"{0}\" already exists")]
    StreamExists(Name),
    #[error("instance \"{0}\" does not exist")]
    UnknownInstanceName(Name),
    #[error("instance {0} does not exist")]
    UnknownInstanceId(i32),
    #[error("instance \"{instance}\" is not a writer of stream \"{stream}\"")]
    NotAWriter { stream: Name, instance: Name },
    #[error("streampos is not loaded")]
    NotLoaded,
    #[error("streampos registry is full")]
    RegistryFull {
        what: &'static str,
        guc: &'static str,
    },
    #[error("cannot PREPARE a transaction that has allocated stream IDs")]
    Prepare,
    #[error("cannot PREPARE a transaction that has changed the stream catalog")]
    PrepareCatalog,
    #[error("cannot allocate stream IDs {0}")]
    ReadOnly(&'static str),
    /// Something that needs the primary's registry, on a hot standby.
    #[error("cannot {0} during recovery")]
    Recovery(&'static str),
    /// A follower's position is beyond anything this server allocated: it
    /// followed a server whose commits this one does not have.
    /// `position` is shown clipped; `highest` is a token's highest
    /// position, which the clipped text may not show.
    #[error("{what} {position} of stream \"{stream}\" is beyond anything this server allocated")]
    AheadOfServer {
        what: &'static str,
        stream: Name,
        position: String,
        highest: Option<i64>,
        max_allocated: i64,
    },
    /// A follower's position lies where this server, a promoted standby, has
    /// no rows: it came from a history this server lost.
    #[error("token position {position} of stream \"{stream}\" is not in this server's history")]
    LostHistory {
        stream: Name,
        position: i64,
        have: i64,
        ceiling: i64,
    },
    /// A new writer on a stream that already remembers the most writers
    /// it can list.
    #[error("too many writers for one stream")]
    TooManyWriters { limit: usize },
    /// Input beyond a documented size limit.
    #[error("{what} is too large")]
    TooLarge { what: String, limit: String },
    #[error("streampos.instances rows cannot be changed or deleted")]
    InstancesImmutable,
    #[error("must be owner of {0}")]
    NotOwner(String),
    #[error("permission denied for table {0}")]
    NoSelect(String),
    /// A role that cannot act as a table's owner asked the extension to
    /// register it or to read it as its owner (`action` says who reads it).
    #[error("must be owner of table {table}")]
    NotTableOwner {
        table: String,
        owner: String,
        action: &'static str,
    },
    /// Reading as the owner would show rows the table's policies hide from
    /// the caller.
    #[error("table {0} has row-level security enabled")]
    RowSecurity(String),
    /// An ID column that does not compare with the stream's bigint IDs.
    #[error("column \"{column}\" of table {table} is of type {type_name}, not an integer type")]
    IdColumnType {
        column: Name,
        table: String,
        type_name: String,
    },
    /// Another role's code, run inside a streampos function, called a
    /// function that changes the caller's session.
    #[error("{function}() may not run in another role's code inside a streampos function")]
    SessionFunction { function: String, role: String },
    /// A registered relation that is not (or no longer) a table.
    #[error("{relation} is not a table")]
    NotATable { relation: String, kind: String },
    /// An ID or instance column of a type that is not built in.
    #[error("column \"{column}\" of table {table} is of type {type_name}, not a built-in type")]
    ColumnType {
        column: Name,
        table: String,
        type_name: String,
    },
    /// A lock wait of a catalog change, bounded so that the sessions queued
    /// behind it are not stalled by whoever holds the lock.
    #[error("{message}")]
    LockTimeout { message: String, detail: String },
    #[error("{message}")]
    InvalidArgument {
        message: String,
        detail: Option<String>,
    },
    #[error("{message}")]
    InvalidState {
        message: String,
        detail: Option<String>,
    },
    #[error("\"{0}\" is not a sequence")]
    NotASequence(String),
    #[error("sequence {seq} is not permanent")]
    NotPermanent { seq: String, unlogged: bool },
    /// A stream's sequence was dropped (with the table of its bigserial).
    #[error("the sequence of stream \"{0}\" no longer exists")]
    SequenceDropped(Name),
    /// The same, where the stream's name is not at hand.
    #[error("the sequence of a stream (oid {0}) no longer exists")]
    SequenceOidDropped(u32),
    #[error("permission denied to allocate IDs of stream \"{stream}\"")]
    MayNotAllocate { stream: Name, seq: String },
    #[error("permission denied to repair stream \"{stream}\"")]
    MayNotRepair { stream: Name, seq: String },
    #[error("column \"{column}\" of relation {table} does not exist")]
    UnknownColumn { column: Name, table: String },
    /// A race with a concurrent change: retrying the transaction succeeds.
    #[error("{message}")]
    Retry { message: String },
    /// Not the caller's fault: an internal query failed at the SPI level.
    #[error("{0}")]
    Internal(String),
    #[error(transparent)]
    Token(#[from] TokenError),
    // Synapse adoption (api/synapse.rs).
    #[error("schema \"{0}\" does not exist")]
    UnknownSchema(Name),
    #[error("permission denied for schema {0}")]
    NoSchemaUsage(Name),
    /// The schema lacks a table (or column) every Synapse database has.
    #[error("schema \"{schema}\" does not hold a Synapse database")]
    NotSynapse { schema: Name, missing: String },
    /// streampos gives a Synapse instance name another id, or a Synapse id
    /// to another name (the message says which).
    #[error("{0}")]
    InstanceConflict(String),
    // Consumers (api/consumers.rs).
    #[error("consumer \"{consumer}\" of stream \"{stream}\" does not exist")]
    UnknownConsumer { stream: Name, consumer: Name },
    #[error("consumer \"{consumer}\" of stream \"{stream}\" already exists")]
    ConsumerExists {
        stream: Name,
        consumer: Name,
        owner: String,
    },
    #[error("must be owner of consumer \"{consumer}\" of stream \"{stream}\"")]
    NotConsumerOwner {
        stream: Name,
        consumer: Name,
        owner: String,
    },
}

impl Error {
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::InvalidArgument {
            message: message.into(),
            detail: None,
        }
    }

    fn code(&self) -> Code {
        match self {
            Error::UnknownStream(_)
            | Error::UnknownInstanceName(_)
            | Error::UnknownInstanceId(_)
            | Error::UnknownConsumer { .. } => Code::ERRCODE_UNDEFINED_OBJECT,
            Error::StreamExists(_) | Error::ConsumerExists { .. } => Code::ERRCODE_DUPLICATE_OBJECT,
            Error::NotConsumerOwner { .. } => Code::ERRCODE_INSUFFICIENT_PRIVILEGE,
            Error::NotAWriter { .. }
            | Error::NotLoaded
            | Error::InvalidState { .. }
            | Error::InstancesImmutable => Code::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            Error::RegistryFull { .. } => Code::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            Error::Prepare | Error::PrepareCatalog => Code::ERRCODE_FEATURE_NOT_SUPPORTED,
            Error::ReadOnly(_) | Error::Recovery(_) => Code::ERRCODE_READ_ONLY_SQL_TRANSACTION,
            // A code of its own among ours: class 72 says the state asked about
            // is not available here; the follower must resynchronise.
            Error::AheadOfServer { .. } | Error::LostHistory { .. } => {
                Code::ERRCODE_SNAPSHOT_TOO_OLD
            }
            Error::TooLarge { .. } | Error::TooManyWriters { .. } => {
                Code::ERRCODE_PROGRAM_LIMIT_EXCEEDED
            }
            Error::NotOwner(_)
            | Error::NoSelect(_)
            | Error::NotTableOwner { .. }
            | Error::RowSecurity(_) => Code::ERRCODE_INSUFFICIENT_PRIVILEGE,
            Error::SessionFunction { .. } => Code::ERRCODE_INSUFFICIENT_PRIVILEGE,
            Error::NotATable { .. } => Code::ERRCODE_WRONG_OBJECT_TYPE,
            Error::ColumnType { .. } => Code::ERRCODE_DATATYPE_MISMATCH,
            Error::IdColumnType { .. } => Code::ERRCODE_DATATYPE_MISMATCH,
            Error::LockTimeout { .. } => Code::ERRCODE_LOCK_NOT_AVAILABLE,
            Error::InvalidArgument { .. } => Code::ERRCODE_INVALID_PARAMETER_VALUE,
            Error::UnknownColumn { .. } => Code::ERRCODE_UNDEFINED_COLUMN,
            Error::NotASequence(_) => Code::ERRCODE_INVALID_PARAMETER_VALUE,
            Error::NotPermanent { .. } => Code::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            Error::SequenceDropped(_) | Error::SequenceOidDropped(_) => {
                Code::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE
            }
            Error::MayNotAllocate { .. } => Code::ERRCODE_INSUFFICIENT_PRIVILEGE,
            Error::MayNotRepair { .. } => Code::ERRCODE_INSUFFICIENT_PRIVILEGE,
            Error::Retry { .. } => Code::ERRCODE_T_R_SERIALIZATION_FAILURE,
            Error::Internal(_) => Code::ERRCODE_INTERNAL_ERROR,
            Error::UnknownSchema(_) => Code::ERRCODE_INVALID_SCHEMA_NAME,
            Error::NoSchemaUsage(_) => Code::ERRCODE_INSUFFICIENT_PRIVILEGE,
            // What PostgreSQL raises for a table that does not exist: the
            // tables every Synapse database has are not there.
            Error::NotSynapse { .. } => Code::ERRCODE_UNDEFINED_TABLE,
            Error::InstanceConflict(_) => Code::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            Error::Token(e) => match e {
                TokenError::Syntax { .. } => Code::ERRCODE_INVALID_TEXT_REPRESENTATION,
                TokenError::OutOfRange { .. } => Code::ERRCODE_NUMERIC_VALUE_OUT_OF_RANGE,
                TokenError::InvalidArgument { .. } => Code::ERRCODE_INVALID_PARAMETER_VALUE,
                TokenError::Binary { .. } => Code::ERRCODE_INVALID_BINARY_REPRESENTATION,
                TokenError::Corrupt { .. } => Code::ERRCODE_DATA_CORRUPTED,
                TokenError::TooLarge { .. } => Code::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            },
        }
    }

    fn detail(&self) -> Option<String> {
        match self {
            Error::NotAWriter { stream, .. } => Some(format!(
                "The writers of stream \"{stream}\" are listed in streampos.streams; change them with streampos.set_writers()."
            )),
            Error::RegistryFull { what, .. } => Some(format!("No free {what} is left.")),
            Error::ConsumerExists { owner, .. } => Some(format!(
                "It belongs to {owner}; choose another name."
            )),
            Error::NotConsumerOwner { owner, .. } => Some(format!(
                "It belongs to {owner}: only that role, its members and superusers may acknowledge or unregister it."
            )),
            Error::NotPermanent { unlogged, .. } => Some(if *unlogged {
                "An UNLOGGED sequence is reset at crash recovery and would hand out its IDs again.".into()
            } else {
                "A temporary sequence belongs to one session.".into()
            }),
            Error::MayNotAllocate { seq, .. } => Some(format!(
                "Allocating needs USAGE or UPDATE on the stream's sequence {seq}, as nextval() does."
            )),
            Error::MayNotRepair { seq, .. } => Some(format!(
                "Moving the stream's sequence {seq} forward needs UPDATE on it, as setval() does."
            )),
            Error::AheadOfServer {
                highest,
                max_allocated,
                ..
            } => Some(format!(
                "{}The highest ID this server allocated is {max_allocated}. The follower's rows after it may not exist here: after a failover or a point-in-time recovery, resynchronise the follower.",
                highest.map_or(String::new(), |h| format!("The token's highest position is {h}. "))
            )),
            Error::LostHistory { have, ceiling, .. } => Some(format!(
                "This server was a standby or recovered to a point in time; its rows end at {have}, and IDs up to {ceiling} may have been handed out by transactions it never had."
            )),
            Error::TooLarge { limit, .. } => Some(limit.clone()),
            Error::TooManyWriters { limit } => Some(format!(
                "A stream open to any writer lists in its tokens every writer that committed IDs (since the server started, or with a stored position), at most {limit}."
            )),
            Error::InstancesImmutable => Some(
                "Instance ids appear in tokens; renaming or reusing one would change what old tokens mean."
                    .into(),
            ),
            Error::Prepare => Some(
                "Stream IDs must be finished when their transaction ends; a prepared transaction would hold them in flight indefinitely."
                    .into(),
            ),
            Error::PrepareCatalog => Some(
                "Every backend must learn of a catalog change when it commits, which a prepared transaction does elsewhere."
                    .into(),
            ),
            Error::InvalidArgument { detail, .. } | Error::InvalidState { detail, .. } => detail.clone(),
            Error::NotTableOwner { owner, action, .. } => Some(format!(
                "{action} reads the table as its owner, {owner} (its policies, index expressions and constraints run as that role): only a role with the privileges of {owner} may."
            )),
            Error::RowSecurity(_) => Some(
                "streampos reads a stream's tables as their owner, which would show rows the table's policies hide from you."
                    .into(),
            ),
            Error::NotATable { kind, .. } => Some(format!(
                "streampos reads only tables and partitioned tables; this is {kind}."
            )),
            Error::ColumnType { .. } => Some(
                "streampos reads ID and instance columns only of built-in types (looking through domains): the casts and operators of another type are code its owner wrote."
                    .into(),
            ),
            Error::IdColumnType { .. } => Some(ID_COLUMN_TYPES.into()),
            Error::SessionFunction { role, .. } => Some(format!(
                "Code of role {role} (a table's index expression or predicate, policy or constraint) ran while streampos read the table as its owner; it would have changed the caller's session."
            )),
            Error::LockTimeout { detail, .. } => Some(detail.clone()),
            Error::NotSynapse { missing, .. } => Some(missing.clone()),
            Error::InstanceConflict(_) => Some(
                "Tokens that clients hold name writers by Synapse's instance ids; importing would change what they mean. Nothing was changed."
                    .into(),
            ),
            Error::Token(e) => {
                let d = e.detail();
                (!d.is_empty()).then(|| d.to_string())
            }
            _ => None,
        }
    }

    fn hint(&self) -> Option<String> {
        match self {
            Error::NotLoaded => Some(
                "Add streampos to shared_preload_libraries in postgresql.conf and restart the server.".into(),
            ),
            Error::RegistryFull { guc, .. } => Some(format!("Raise {guc} and restart the server.")),
            Error::UnknownStream(_) => Some("Create it with streampos.create_stream() or streampos.adopt_stream().".into()),
            Error::Retry { .. } => Some("Retry the transaction.".into()),
            Error::AheadOfServer { .. } | Error::LostHistory { .. } => Some(
                "Start the follower again from a token this server gave (e.g. streampos.current_token()), or from nothing."
                    .into(),
            ),
            Error::MayNotAllocate { seq, .. } => {
                Some(format!("GRANT USAGE ON SEQUENCE {seq} TO the writing role."))
            }
            Error::TooManyWriters { .. } => Some(
                "List the stream's writers with streampos.set_writers(): its stored positions of writers no longer listed are then forgotten."
                    .into(),
            ),
            Error::NotSynapse { .. } => Some(
                "Pass the schema that holds Synapse's tables: streampos.adopt_synapse('<schema>').".into(),
            ),
            Error::RowSecurity(_) => Some(
                "Call it as the table's owner (or a member of that role) or as a role with BYPASSRLS, or disable row-level security on the table."
                    .into(),
            ),
            Error::SequenceDropped(_) | Error::SequenceOidDropped(_) => Some(
                "streampos.check_stream() names the stream; streampos.drop_stream() forgets it.".into(),
            ),
            Error::LockTimeout { .. } => Some(
                "Retry; pg_locks shows which session holds the lock (end it, or wait until it ends).".into(),
            ),
            _ => None,
        }
    }

    /// Raise this error as a PostgreSQL ERROR. Never returns.
    pub fn report(self) -> ! {
        let mut report = ErrorReport::new(self.code(), self.to_string(), "streampos");
        if let Some(detail) = self.detail() {
            report = report.set_detail(detail);
        }
        if let Some(hint) = self.hint() {
            report = report.set_hint(hint);
        }
        report.report(PgLogLevel::ERROR);
        unreachable!("ERROR does not return")
    }
}

/// Unwrap a result, raising its error as a PostgreSQL ERROR.
pub trait OrRaise<T> {
    fn or_raise(self) -> T;
}

impl<T, E: Into<Error>> OrRaise<T> for Result<T, E> {
    fn or_raise(self) -> T {
        match self {
            Ok(value) => value,
            Err(e) => e.into().report(),
        }
    }
}

/// Why an ID column must be of an integer type (the DETAIL of its error,
/// and check_stream's advice).
pub const ID_COLUMN_TYPES: &str =
    "A stream's IDs are bigint: its tables' ID columns must be smallint, integer or bigint (or a domain over one).";
