//! The one place that turns an engine error into a Python exception, as
//! Dynamo's embedded selector raises them: request errors are `ValueError`
//! (Ray answers 400), everything else `SelectionServiceError` with `.kind`
//! and `.status_code` (Ray answers 503 for a `RuntimeError`, 500 otherwise).
//! The match is exhaustive: a new engine error must choose its exception here.

use kvselect::app::ServiceError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

create_exception!(
    kvselect,
    SelectionServiceError,
    PyException,
    "A selection failure other than a malformed request; `.kind` and `.status_code` say which (as the HTTP service's status)."
);

/// A `SelectionServiceError` carrying `kind` and `status_code`.
fn service_error(kind: &str, status: u16, message: String) -> PyErr {
    Python::attach(|py| {
        let err = SelectionServiceError::new_err(message);
        let value = err.value(py);
        // Setting attributes on a fresh exception instance cannot fail.
        let _ = value.setattr("kind", kind);
        let _ = value.setattr("status_code", status);
        err
    })
}

pub fn to_py(e: ServiceError) -> PyErr {
    let message = e.to_string();
    match e {
        ServiceError::Parse(_) | ServiceError::Invalid(_) => PyValueError::new_err(message),
        ServiceError::NoWorkers(_) => service_error("not_ready", 503, message),
        ServiceError::NoCandidates => service_error("scheduler", 503, message),
        ServiceError::Refused(_) => service_error("scheduler", 400, message),
        ServiceError::UnknownWorker(_)
        | ServiceError::UnknownSelection(_)
        | ServiceError::UnknownPeer(_) => service_error("not_found", 404, message),
        ServiceError::UnknownRank(_) => service_error("sequence", 404, message),
        ServiceError::AlreadyReserved(_) | ServiceError::ReplicaSyncDisabled => {
            service_error("conflict", 409, message)
        }
        ServiceError::Busy(_) => service_error("scheduler", 429, message),
    }
}

/// The error of a call that needs new work after `shutdown()`.
pub fn shutting_down() -> PyErr {
    service_error(
        "not_ready",
        503,
        "selection service is shutting down".to_string(),
    )
}
