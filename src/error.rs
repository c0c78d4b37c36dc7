//! Every user-facing error, with its SQLSTATE. Messages are lower-case;
//! details and hints are sentences.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode as Code;
use streampos_core::token::TokenError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("stream \"{0}\" does not exist")]
    UnknownStream(String),
    #[error("stream \"{0}\" already exists")]
    StreamExists(String),
    #[error("instance \"{0}\" does not exist")]
    UnknownInstanceName(String),
    #[error("instance {0} does not exist")]
    UnknownInstanceId(i32),
    #[error("instance \"{instance}\" is not a writer of stream \"{stream}\"")]
    NotAWriter { stream: String, instance: String },
    #[error("streampos is not loaded")]
    NotLoaded,
    #[error("streampos registry is full")]
    RegistryFull {
        what: &'static str,
        guc: &'static str,
    },
    #[error("cannot PREPARE a transaction that has allocated stream IDs")]
    Prepare,
    #[error("cannot allocate stream IDs {0}")]
    ReadOnly(&'static str),
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
    #[error("column \"{column}\" of relation \"{table}\" does not exist")]
    UnknownColumn { column: String, table: String },
    #[error("cannot wait for stream positions on a hot standby")]
    StandbyWait,
    /// A race with a concurrent change: retrying the transaction succeeds.
    #[error("{message}")]
    Retry { message: String },
    /// Not the caller's fault: an internal query failed at the SPI level.
    #[error("{0}")]
    Internal(String),
    #[error(transparent)]
    Token(#[from] TokenError),
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
            | Error::UnknownInstanceId(_) => Code::ERRCODE_UNDEFINED_OBJECT,
            Error::StreamExists(_) => Code::ERRCODE_DUPLICATE_OBJECT,
            Error::NotAWriter { .. } | Error::NotLoaded | Error::InvalidState { .. } => {
                Code::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE
            }
            Error::RegistryFull { .. } => Code::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            Error::Prepare => Code::ERRCODE_FEATURE_NOT_SUPPORTED,
            Error::ReadOnly(_) => Code::ERRCODE_READ_ONLY_SQL_TRANSACTION,
            Error::InvalidArgument { .. } => Code::ERRCODE_INVALID_PARAMETER_VALUE,
            Error::UnknownColumn { .. } => Code::ERRCODE_UNDEFINED_COLUMN,
            Error::StandbyWait => Code::ERRCODE_FEATURE_NOT_SUPPORTED,
            Error::Retry { .. } => Code::ERRCODE_T_R_SERIALIZATION_FAILURE,
            Error::Internal(_) => Code::ERRCODE_INTERNAL_ERROR,
            Error::Token(e) => match e {
                TokenError::Syntax { .. } => Code::ERRCODE_INVALID_TEXT_REPRESENTATION,
                TokenError::OutOfRange { .. } => Code::ERRCODE_NUMERIC_VALUE_OUT_OF_RANGE,
                TokenError::InvalidArgument { .. } => Code::ERRCODE_INVALID_PARAMETER_VALUE,
                TokenError::Binary { .. } => Code::ERRCODE_INVALID_BINARY_REPRESENTATION,
                TokenError::Corrupt { .. } => Code::ERRCODE_DATA_CORRUPTED,
            },
        }
    }

    fn detail(&self) -> Option<String> {
        match self {
            Error::NotAWriter { stream, .. } => Some(format!(
                "The writers of stream \"{stream}\" are listed in streampos.streams; change them with streampos.set_writers()."
            )),
            Error::RegistryFull { what, .. } => Some(format!("No free {what} is left.")),
            Error::Prepare => Some(
                "Stream IDs must be finished when their transaction ends; a prepared transaction would hold them in flight indefinitely."
                    .into(),
            ),
            Error::InvalidArgument { detail, .. } | Error::InvalidState { detail, .. } => detail.clone(),
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
            Error::StandbyWait => Some("Poll streampos.stream_positions, or follow the primary.".into()),
            Error::Retry { .. } => Some("Retry the transaction.".into()),
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
