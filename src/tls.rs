//! Optional HTTPS (`--tls-cert`, `--tls-key`): a rustls server configuration
//! offering HTTP/2 and HTTP/1.1 by ALPN, with the `ring` provider.
//!
//! The handshake runs inside the connection's task, under the header-read
//! timeout, so a client that opens a socket and never finishes the handshake
//! costs one connection slot for that long and no more.

use crate::config::TlsFiles;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::Arc;
use tokio_rustls::TlsAcceptor;

/// Builds the acceptor from PEM files.
pub fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| format!("cannot read --tls-cert {}: {e}", files.cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("bad PEM in --tls-cert {}: {e}", files.cert.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "--tls-cert {} holds no certificate",
            files.cert.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| {
        format!(
            "cannot read a private key from --tls-key {}: {e}",
            files.key.display()
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("TLS certificate and key do not fit: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
