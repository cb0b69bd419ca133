//! A private CA for one test, made with rcgen: server and client certificates signed by
//! it (or expired, or self-signed), written as PEM files into a directory removed when
//! the `Pki` drops, and TLS clients that trust it.

use std::path::PathBuf;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, date_time_ymd,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

impl Issued {
    fn chain(&self) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_file_iter(&self.cert_file)
            .expect("read the chain")
            .map(|certificate| certificate.expect("a certificate"))
            .collect()
    }

    fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::from_pem_file(&self.key_file).expect("read the key")
    }
}

pub struct Pki {
    dir: tempfile::TempDir,
    ca: CertifiedIssuer<'static, KeyPair>,
    pub ca_file: PathBuf,
    count: std::cell::Cell<usize>,
}

impl Pki {
    pub fn new(name: &str) -> Pki {
        let dir = tempfile::Builder::new()
            .prefix("idemproxy-pki-")
            .tempdir()
            .expect("temp dir");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("the CA");
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca.pem()).expect("write the CA");
        Pki {
            dir,
            ca,
            ca_file,
            count: std::cell::Cell::new(0),
        }
    }

    fn write(&self, certificate: &rcgen::Certificate, key: &KeyPair) -> Issued {
        let n = self.count.get() + 1;
        self.count.set(n);
        let cert_file = self.dir.path().join(format!("cert-{n}.pem"));
        let key_file = self.dir.path().join(format!("key-{n}.pem"));
        std::fs::write(&cert_file, certificate.pem()).expect("write a certificate");
        std::fs::write(&key_file, key.serialize_pem()).expect("write a key");
        Issued { cert_file, key_file }
    }

    fn issue(&self, params: CertificateParams) -> Issued {
        let key = KeyPair::generate().expect("key");
        let certificate = params.signed_by(&key, &self.ca).expect("sign");
        self.write(&certificate, &key)
    }

    /// A server certificate for `localhost` and `127.0.0.1`.
    pub fn server(&self) -> Issued {
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).expect("params");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue(params)
    }

    /// A Redis node's certificate: a server one that also serves as a client one, as
    /// a node presents it to the nodes it replicates from, its sentinels and its cluster
    /// bus peers.
    pub fn node(&self) -> Issued {
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).expect("params");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(params)
    }

    /// A client certificate named `name`; `expired` makes one that ran out in 2001.
    pub fn client(&self, name: &str, expired: bool) -> Issued {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        if expired {
            params.not_before = date_time_ymd(2000, 1, 1);
            params.not_after = date_time_ymd(2001, 1, 1);
        }
        self.issue(params)
    }

    /// A client certificate no CA of this `Pki` signed.
    pub fn self_signed_client(&self) -> Issued {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().expect("key");
        let certificate = params.self_signed(&key).expect("self-sign");
        self.write(&certificate, &key)
    }

    /// A TLS client that trusts this CA, offers `alpn`, and presents `identity`.
    pub fn connector(&self, alpn: &[&str], identity: Option<&Issued>) -> tokio_rustls::TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        for certificate in CertificateDer::pem_file_iter(&self.ca_file).expect("read the CA") {
            roots.add(certificate.expect("a certificate")).expect("a root");
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots);
        let mut config = match identity {
            None => builder.with_no_client_auth(),
            Some(identity) => builder
                .with_client_auth_cert(identity.chain(), identity.key())
                .expect("a client certificate"),
        };
        config.alpn_protocols = alpn.iter().map(|protocol| protocol.as_bytes().to_vec()).collect();
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }
}

/// The server name the test certificates are for.
pub fn localhost() -> ServerName<'static> {
    ServerName::try_from("localhost").expect("a server name")
}

/// A TLS acceptor for a fake upstream with `issued`.
pub fn acceptor(issued: &Issued) -> tokio_rustls::TlsAcceptor {
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(issued.chain(), issued.key())
        .expect("a server certificate");
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// The `[store]` lines that trust `ca` and present `client`, as every store takes them.
pub fn store_tls_lines(ca: Option<&std::path::Path>, client: Option<&Issued>) -> String {
    let mut lines = String::new();
    if let Some(ca) = ca {
        lines.push_str(&format!("tls_ca_file = {:?}\n", ca.display().to_string()));
    }
    if let Some(client) = client {
        lines.push_str(&format!(
            "tls_cert_file = {:?}\ntls_key_file = {:?}\n",
            client.cert_file.display().to_string(),
            client.key_file.display().to_string()
        ));
    }
    lines
}
