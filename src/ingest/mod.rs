//! ZeroMQ KV-event ingestion. (Lands with issue 3.)
