//! TLS with rustls (ring provider), configured as Redis's `tls-*` options.
//!
//! `--tls-port` listens for TLS connections (TLS 1.2 and 1.3) with the certificate chain of
//! `--tls-cert-file` and the key of `--tls-key-file` (PEM; PKCS#8, PKCS#1 or SEC1). With
//! `--tls-ca-cert-file`, clients must present a certificate that chains to one of its CAs
//! (Redis's default `tls-auth-clients yes`); `--tls-auth-clients optional` accepts clients
//! without one (a presented certificate must still verify) and `no` ignores the CA file for
//! clients. Without a CA file no client certificate is asked for. The same commands, limits,
//! AUTH and protected-mode rules apply on both ports.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

/// Whether clients on the TLS port must present a certificate (Redis's `tls-auth-clients`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClientAuth {
    /// Required (when a CA file is given).
    #[default]
    Yes,
    /// Verified when presented.
    Optional,
    /// Not asked for.
    No,
}

impl std::str::FromStr for ClientAuth {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "yes" => Ok(ClientAuth::Yes),
            "optional" => Ok(ClientAuth::Optional),
            "no" => Ok(ClientAuth::No),
            _ => Err(format!("--tls-auth-clients takes yes, optional or no, not '{s}'")),
        }
    }
}

/// The TLS listener's settings.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// Port (0 picks a free one).
    pub port: u16,
    /// PEM certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// PEM private key.
    pub key_file: PathBuf,
    /// PEM CA certificates that client certificates must chain to.
    pub ca_cert_file: Option<PathBuf>,
    /// Whether a client certificate is required (only with `ca_cert_file`).
    pub auth_clients: ClientAuth,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl TlsConfig {
    /// Load the certificates and key into a rustls server configuration.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.cert_file)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("--tls-cert-file {}: {e}", self.cert_file.display()))?;
        if certs.is_empty() {
            return Err(format!("--tls-cert-file {}: no certificate in it", self.cert_file.display()));
        }
        let key = PrivateKeyDer::from_pem_file(&self.key_file)
            .map_err(|e| format!("--tls-key-file {}: {e}", self.key_file.display()))?;
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = match (&self.ca_cert_file, self.auth_clients) {
            (Some(ca), ClientAuth::Yes | ClientAuth::Optional) => {
                let mut roots = RootCertStore::empty();
                for c in CertificateDer::pem_file_iter(ca)
                    .map_err(|e| format!("--tls-ca-cert-file {}: {e}", ca.display()))?
                {
                    let c = c.map_err(|e| format!("--tls-ca-cert-file {}: {e}", ca.display()))?;
                    roots.add(c).map_err(|e| format!("--tls-ca-cert-file {}: {e}", ca.display()))?;
                }
                let mut v = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
                if self.auth_clients == ClientAuth::Optional {
                    v = v.allow_unauthenticated();
                }
                builder.with_client_cert_verifier(
                    v.build().map_err(|e| format!("--tls-ca-cert-file {}: {e}", ca.display()))?,
                )
            }
            _ => builder.with_no_client_auth(),
        };
        let cfg = builder.with_single_cert(certs, key).map_err(|e| format!("--tls-cert-file/--tls-key-file: {e}"))?;
        Ok(Arc::new(cfg))
    }
}
