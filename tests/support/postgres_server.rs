//! A real PostgreSQL server of the test's own: a data directory copied from one
//! `initdb` per test binary, a `postgres` child process on a free port that a test can
//! stop (`pg_ctl stop -m fast` or `-m immediate`), start again on the same port and
//! data, kill, and give a streaming standby to promote. Never the machine's own
//! service. Run as the `postgres` user when the tests run as root (Postgres refuses
//! root). It never skips: without the binaries the test fails and says how to get them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

use super::proxy::free_port;

/// The role with a password (scram-sha-256 over TCP), for the tests of a refused one.
pub const PASSWORD_ROLE: &str = "idemproxy_pw";
pub const PASSWORD: &str = "correct horse battery staple";

/// Where Debian's `postgresql` package puts the binaries: `$IDEMPROXY_PG_BIN`, else the
/// newest `/usr/lib/postgresql/N/bin`, else PATH.
pub fn bin_dir() -> PathBuf {
    if let Some(path) = std::env::var_os("IDEMPROXY_PG_BIN") {
        return PathBuf::from(path);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return bin;
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths).find(|dir| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "these tests need PostgreSQL's server binaries (initdb, pg_ctl, postgres), and none were found. \
             Install them (Debian/Ubuntu: `apt-get install postgresql`), or set IDEMPROXY_PG_BIN to their \
             directory. .ci/run installs them automatically."
        )
    })
}

fn running_as_root() -> bool {
    rustix::process::getuid().is_root()
}

/// A command of `bin` run as the user that owns the data directories.
fn as_owner(program: &str) -> Command {
    let path = bin_dir().join(program);
    if running_as_root() {
        let mut command = Command::new("setpriv");
        command
            .args(["--reuid", "postgres", "--regid", "postgres", "--init-groups", "--"])
            .arg(path);
        command
    } else {
        Command::new(path)
    }
}

/// A directory the data directory's owner may write in.
fn owned_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a directory for postgres");
    if running_as_root() {
        let status = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir)
            .status()
            .expect("run chown");
        assert!(status.success(), "chown postgres {}", dir.display());
    }
    dir
}

fn run(mut command: Command, what: &str) -> String {
    let output = command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|error| panic!("{what}: {error}"));
    assert!(
        output.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// One `initdb` per test binary, with the test's roles: copied for every server.
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let root = owned_dir(&format!("idemproxy-pg-template-{}", std::process::id()));
        let data = root.join("data");
        let mut initdb = as_owner("initdb");
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync", "--locale=C"]);
        run(initdb, "initdb");
        let hba = format!(
            "local all all trust\nhost all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256\nhost all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n"
        );
        std::fs::write(data.join("pg_hba.conf"), hba).expect("write pg_hba.conf");
        // The role with a password, made once on the template.
        let mut server = PostgresServer::spawn_on(data.clone(), root.clone(), Vec::new(), false);
        server.psql(&format!(
            "SET password_encryption = 'scram-sha-256'; CREATE ROLE {PASSWORD_ROLE} LOGIN SUPERUSER PASSWORD '{PASSWORD}'"
        ));
        server.stop("fast");
        server.owned = false;
        data
    })
}

pub struct PostgresServer {
    child: Option<Child>,
    pub port: u16,
    data: PathBuf,
    /// Where its socket and log go, removed with it.
    dir: PathBuf,
    extra: Vec<String>,
    /// Whether dropping it removes its directory (not the template's).
    owned: bool,
}

impl PostgresServer {
    /// A fresh server of the test's own, on a free port.
    pub fn start() -> PostgresServer {
        PostgresServer::start_with(Vec::new())
    }

    /// With more `-c name=value` settings, e.g. `fsync=on` for a benchmark.
    pub fn start_with(extra: Vec<String>) -> PostgresServer {
        let template = template();
        let (dir, data) = PostgresServer::fresh_dir();
        let mut copy = Command::new("cp");
        copy.arg("-a").arg(template).arg(&data);
        run(copy, "copy the template data directory");
        PostgresServer::spawn_on(data, dir, extra, true)
    }

    fn fresh_dir() -> (PathBuf, PathBuf) {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = owned_dir(&format!("idemproxy-pg-{}-{n}", std::process::id()));
        let data = dir.join("data");
        (dir, data)
    }

    fn spawn_on(data: PathBuf, dir: PathBuf, extra: Vec<String>, owned: bool) -> PostgresServer {
        let mut server = PostgresServer {
            child: None,
            port: free_port(),
            data,
            dir,
            extra,
            owned,
        };
        for _ in 0..5 {
            if server.try_spawn() {
                return server;
            }
            server.port = free_port();
        }
        panic!(
            "postgres exited at start on five free ports in a row; its log:\n{}",
            server.log()
        );
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
    }

    fn try_spawn(&mut self) -> bool {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("postgres.log"))
            .expect("open the postgres log");
        let mut command = as_owner("postgres");
        command
            .arg("-D")
            .arg(&self.data)
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", self.dir.display()))
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(["-c", "shared_buffers=16MB", "-c", "max_connections=200"])
            .args(["-c", "max_wal_senders=4", "-c", "wal_level=replica"]);
        for setting in &self.extra {
            command.args(["-c", setting]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start postgres");
        self.child = Some(child);
        self.wait_ready()
    }

    /// Waits until the server accepts connections: `pg_isready` polled, bounded at 30 s;
    /// `false` if the process exited (its port was taken).
    fn wait_ready(&mut self) -> bool {
        let started = Instant::now();
        loop {
            let ready = Command::new(bin_dir().join("pg_isready"))
                .args([
                    "-q",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    "postgres",
                    "-d",
                    "postgres",
                ])
                .status()
                .is_ok_and(|status| status.success());
            if ready {
                return true;
            }
            if let Some(child) = &mut self.child
                && let Ok(Some(_)) = child.try_wait()
            {
                self.child = None;
                return false;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "postgres on port {} was not ready within 30s; its log:\n{}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// The superuser's URL, database `postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The password role's URL, without its password.
    pub fn password_url(&self) -> String {
        format!("postgres://{PASSWORD_ROLE}@127.0.0.1:{}/postgres", self.port)
    }

    /// `psql` as the superuser on database `postgres`: unaligned, tuples only,
    /// stopping at the first error.
    fn psql_command(&self) -> Command {
        let mut psql = Command::new(bin_dir().join("psql"));
        psql.args(["-X", "-q", "-At", "-v", "ON_ERROR_STOP=1"])
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-d", "postgres"]);
        psql
    }

    /// Runs `sql` as the superuser; what it printed.
    pub fn psql(&self, sql: &str) -> String {
        let mut psql = self.psql_command();
        psql.args(["-c", sql]);
        run(psql, &format!("psql {sql:?}")).trim().to_string()
    }

    /// `psql` with `sql` on its standard input, held open by the returned child until
    /// it is killed: e.g. a transaction that holds a lock.
    pub fn hold(&self, sql: &str) -> Child {
        use std::io::Write;
        let mut psql = self
            .psql_command()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start psql");
        let stdin = psql.stdin.as_mut().expect("psql's stdin");
        stdin.write_all(sql.as_bytes()).expect("send the statements");
        stdin.flush().expect("send the statements");
        psql
    }

    /// Every record of `schema` with the milliseconds until it expires, as the
    /// history checker reads a store's keys and TTLs.
    pub fn dump_ttls(&self, schema: &str) -> Vec<(String, i64)> {
        let rows = self.psql(&format!(
            "SELECT key || ' ' || floor(extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint \
             FROM {schema}.records WHERE expires_at > clock_timestamp()"
        ));
        rows.lines()
            .filter_map(|line| {
                let (key, ttl) = line.rsplit_once(' ')?;
                Some((key.to_string(), ttl.parse().ok()?))
            })
            .collect()
    }

    /// `pg_ctl stop -m <mode>` (`fast`: sessions ended, a clean shutdown; `immediate`:
    /// every process quit at once, recovered from the WAL at the next start).
    pub fn stop(&mut self, mode: &str) {
        let mut stop = as_owner("pg_ctl");
        stop.arg("stop")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", mode, "-w", "-t", "30"]);
        run(stop, &format!("pg_ctl stop -m {mode}"));
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    /// Starts it again on its port and data.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "the server is running");
        assert!(
            self.try_spawn(),
            "postgres did not start again on port {}:\n{}",
            self.port,
            self.log()
        );
    }

    /// SIGKILL the postmaster (its backends end when they see it gone).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// A streaming standby of this server (`pg_basebackup -R`), and this server made
    /// to wait for it on every commit that asks (`synchronous_standby_names = '*'`).
    pub fn synchronous_standby(&self) -> PostgresServer {
        let (dir, data) = PostgresServer::fresh_dir();
        let mut backup = as_owner("pg_basebackup");
        backup
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "postgres"])
            .arg("-D")
            .arg(&data)
            .args(["-R", "-X", "stream", "--no-sync"]);
        run(backup, "pg_basebackup");
        let standby = PostgresServer::spawn_on(data, dir, self.extra.clone(), true);
        self.psql("ALTER SYSTEM SET synchronous_standby_names = '*'");
        self.psql("SELECT pg_reload_conf()");
        let started = Instant::now();
        while self.psql("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'") != "1" {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the standby never became synchronous"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
        standby
    }

    /// TLS on, with `server` as its certificate and `ca` the CA that client
    /// certificates must chain to, and `hba` as its pg_hba.conf: restarted on its port.
    /// The files are copied into its own directory, where the server may read them
    /// (the key the postgres user's alone, as Postgres insists).
    pub fn enable_tls(&mut self, server: &super::pki::Issued, ca: &Path, hba: &str) {
        for (from, to) in [
            (server.cert_file.as_path(), "server.crt"),
            (server.key_file.as_path(), "server.key"),
            (ca, "root.crt"),
        ] {
            let copy = self.dir.join(to);
            std::fs::copy(from, &copy).expect("copy a TLS file");
            if running_as_root() {
                let mut chown = Command::new("chown");
                chown.arg("postgres:postgres").arg(&copy);
                run(chown, "chown a TLS file");
            }
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o600)).expect("chmod a TLS file");
        }
        std::fs::write(self.data.join("pg_hba.conf"), hba).expect("write pg_hba.conf");
        let dir = self.dir.display().to_string();
        // One statement each: ALTER SYSTEM runs outside a transaction block.
        for (name, value) in [
            ("ssl", "on".to_string()),
            ("ssl_cert_file", format!("{dir}/server.crt")),
            ("ssl_key_file", format!("{dir}/server.key")),
            ("ssl_ca_file", format!("{dir}/root.crt")),
        ] {
            self.psql(&format!("ALTER SYSTEM SET {name} = '{value}'"));
        }
        self.stop("fast");
        self.start_again();
    }

    /// `pg_ctl promote`: a standby becomes a primary.
    pub fn promote(&self) {
        let mut promote = as_owner("pg_ctl");
        promote
            .arg("promote")
            .arg("-D")
            .arg(&self.data)
            .args(["-w", "-t", "30"]);
        run(promote, "pg_ctl promote");
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            // SIGQUIT: an immediate shutdown, the backends told too.
            let _ = Command::new("kill").args(["-QUIT", &child.id().to_string()]).status();
            if let Some(mut child) = self.child.take() {
                let _ = child.wait();
            }
        }
        if self.owned {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
