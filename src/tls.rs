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

/// The rustls error a connection's handshake failed with, found anywhere under `error`:
/// itself, inside an I/O error, or behind the `Arc` the redis crate keeps an I/O error
/// in. Only what a handshake fails with (a certificate not trusted, none presented, an
/// alert, nothing in common): a record error on an established connection, which may
/// have carried a request, is not a handshake's. Such a failure repeats on every
/// attempt: a configuration to fix, not a moment to wait.
pub fn handshake_failure<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    type Shared = Arc<dyn std::error::Error + Send + Sync>;
    let mut next = Some(error);
    while let Some(cause) = next {
        let tls = cause
            .downcast_ref::<rustls::Error>()
            .or_else(|| {
                cause
                    .downcast_ref::<std::io::Error>()?
                    .get_ref()?
                    .downcast_ref::<rustls::Error>()
            })
            .or_else(|| {
                let shared: &(dyn std::error::Error + 'static) = &**cause.downcast_ref::<Shared>()?;
                handshake_failure(shared)
            });
        if let Some(tls) = tls {
            return matches!(
                tls,
                rustls::Error::InvalidCertificate(_)
                    | rustls::Error::NoCertificatesPresented
                    | rustls::Error::AlertReceived(_)
                    | rustls::Error::PeerIncompatible(_)
            )
            .then_some(tls);
        }
        next = cause.source();
    }
    None
}

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

/// A store's client configuration (Postgres): the CA certificates at `ca_file`, else
/// the webpki roots; and the client certificate and key to present, when given.
pub fn store_client_config(
    ca_file: Option<&Path>,
    client: Option<(&Path, &Path)>,
) -> Result<rustls::ClientConfig, TlsError> {
    let roots = match ca_file {
        Some(ca_file) => roots(ca_file)?,
        None => {
            let mut roots = RootCertStore::empty();
            roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            roots
        }
    };
    let rejected = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TlsError::Rejected { path, source }
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(rejected(ca_file.unwrap_or(Path::new("the webpki roots"))))?
        .with_root_certificates(roots);
    match client {
        None => Ok(builder.with_no_client_auth()),
        Some((cert_file, key_file)) => builder
            .with_client_auth_cert(certificates(cert_file)?, private_key(key_file)?)
            .map_err(rejected(key_file)),
    }
}

#[cfg(test)]
mod tests {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        KeyUsagePurpose,
    };
    use rustls_pki_types::{PrivatePkcs8KeyDer, ServerName};

    use super::*;

    fn authority(name: &str) -> CertifiedIssuer<'static, KeyPair> {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("a CA")
    }

    fn issue(
        by: &CertifiedIssuer<'static, KeyPair>,
        names: &[&str],
        usage: ExtendedKeyUsagePurpose,
    ) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let mut params =
            CertificateParams::new(names.iter().map(|name| name.to_string()).collect::<Vec<_>>()).expect("params");
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().expect("key");
        let certificate = params.signed_by(&key, by).expect("sign");
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        (vec![certificate.der().clone()], key)
    }

    /// A handshake in memory between `server` and a client that trusts `ca` and
    /// presents `identity`; the first error either side meets.
    fn handshake(
        server: Arc<rustls::ServerConfig>,
        ca: &CertifiedIssuer<'static, KeyPair>,
        identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    ) -> Result<(), rustls::Error> {
        let mut roots = RootCertStore::empty();
        roots.add(ca.der().clone()).expect("the CA");
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots);
        let client = match identity {
            None => builder.with_no_client_auth(),
            Some((chain, key)) => builder.with_client_auth_cert(chain, key)?,
        };
        let name = ServerName::try_from("localhost").expect("a name");
        let mut client = rustls::ClientConnection::new(Arc::new(client), name)?;
        let mut server = rustls::ServerConnection::new(server)?;
        let io = |error: std::io::Error| rustls::Error::General(error.to_string());
        for _ in 0..8 {
            let mut wire = Vec::new();
            while client.wants_write() {
                client.write_tls(&mut wire).map_err(io)?;
            }
            let mut read = &wire[..];
            while !read.is_empty() {
                server.read_tls(&mut read).map_err(io)?;
                server.process_new_packets()?;
            }
            let mut wire = Vec::new();
            while server.wants_write() {
                server.write_tls(&mut wire).map_err(io)?;
            }
            let mut read = &wire[..];
            while !read.is_empty() {
                client.read_tls(&mut read).map_err(io)?;
                client.process_new_packets()?;
            }
            if !client.is_handshaking() && !server.is_handshaking() {
                return Ok(());
            }
        }
        Err(rustls::Error::General("the handshake did not finish".into()))
    }

    /// A handshake's failure is found however deep the crates wrap it (inside an I/O
    /// error, behind an `Arc`); a record error on an established connection is not one.
    #[test]
    fn a_handshake_failure_is_found_under_its_wrappers_and_a_record_error_is_not() {
        let untrusted = || rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let in_io = std::io::Error::other(untrusted());
        assert!(handshake_failure(&in_io).is_some());
        let shared: Arc<dyn std::error::Error + Send + Sync> = Arc::new(std::io::Error::other(untrusted()));
        let wrapped = std::io::Error::other(WrappedShared(shared));
        assert!(handshake_failure(&wrapped).is_some());
        let record = std::io::Error::other(rustls::Error::DecryptError);
        assert!(handshake_failure(&record).is_none());
        assert!(handshake_failure(&std::io::Error::other("reset")).is_none());
    }

    /// An error whose source is the `Arc` itself, as the redis crate gives it.
    #[derive(Debug)]
    struct WrappedShared(Arc<dyn std::error::Error + Send + Sync>);

    impl std::fmt::Display for WrappedShared {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("wrapped")
        }
    }

    impl std::error::Error for WrappedShared {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    /// With client roots, the listener takes a client certificate they signed and
    /// refuses none, a foreign CA's, and a server certificate of its own CA; without,
    /// it asks for none.
    #[test]
    fn a_listener_with_client_roots_takes_only_the_certificates_they_signed() {
        let (ca, foreign) = (authority("listener CA"), authority("foreign CA"));
        let (chain, key) = issue(&ca, &["localhost"], ExtendedKeyUsagePurpose::ServerAuth);
        let mut client_roots = RootCertStore::empty();
        client_roots.add(ca.der().clone()).expect("the CA");
        let mtls = server_config(chain.clone(), key.clone_key(), Some(client_roots)).expect("config");
        let client = || issue(&ca, &[], ExtendedKeyUsagePurpose::ClientAuth);
        assert_eq!(handshake(mtls.clone(), &ca, Some(client())), Ok(()));
        for (what, identity) in [
            ("no certificate", None),
            (
                "a foreign CA's",
                Some(issue(&foreign, &[], ExtendedKeyUsagePurpose::ClientAuth)),
            ),
            (
                "a server certificate",
                Some(issue(&ca, &["localhost"], ExtendedKeyUsagePurpose::ServerAuth)),
            ),
        ] {
            assert!(handshake(mtls.clone(), &ca, identity).is_err(), "{what} was taken");
        }
        let plain = server_config(chain, key, None).expect("config");
        assert_eq!(handshake(plain, &ca, None), Ok(()));
    }
}
