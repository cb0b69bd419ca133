//! Certificates and keys from PEM files, and the rustls configurations made from them,
//! all with ring: the listener's (TLS 1.2 and 1.3, ALPN `h2` and `http/1.1`, client
//! certificates verified when a CA is given) and the roots an upstream is verified
//! with. It reads the files it is given and nothing else; config validation calls it, so
//! a bad file is named by `idemproxy check`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

/// Why a certificate, key or CA file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} holds no PEM certificate", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{} holds no PEM private key (PKCS#8, RSA or SEC1)", path.display())]
    NoKey { path: PathBuf },
    #[error("{}: {source}", path.display())]
    Rejected {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in the PEM file at `path`.
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let text = std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let certificates: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&text).filter_map(Result::ok).collect();
    if certificates.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certificates)
}

/// The first private key in the PEM file at `path`.
pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let text = std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    PrivateKeyDer::from_pem_slice(&text).map_err(|_| TlsError::NoKey {
        path: path.to_path_buf(),
    })
}

/// A root store of the CA certificates at `path`.
pub fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for certificate in certificates(path)? {
        roots.add(certificate).map_err(|source| TlsError::Rejected {
            path: path.to_path_buf(),
            source,
        })?;
    }
    Ok(roots)
}

/// The listener's configuration: `chain` and its `key`; with `client_roots`, every
/// client must present a certificate those roots signed.
pub fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    client_roots: Option<RootCertStore>,
) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?;
    let builder = match client_roots {
        None => builder.with_no_client_auth(),
        Some(roots) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|error| rustls::Error::General(error.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Checks that `key` goes with `chain`, as a TLS client would present them.
pub fn client_identity(chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> Result<(), rustls::Error> {
    rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(RootCertStore::empty())
        .with_client_auth_cert(chain, key)
        .map(drop)
}

/// An upstream client's configuration: the webpki roots and the CA certificates at
/// `ca_file`. No ALPN here: the connector sets it (and refuses a config that has some).
pub fn upstream_client_config(ca_file: &Path) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    for certificate in certificates(ca_file)? {
        roots.add(certificate).map_err(|source| TlsError::Rejected {
            path: ca_file.to_path_buf(),
            source,
        })?;
    }
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rejected {
            path: ca_file.to_path_buf(),
            source,
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
