//! A small disk of its own: a tmpfs mounted on a temporary directory (as root), so a
//! test can fill it and see what the SQLite store does when no byte more fits.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct SmallDisk {
    dir: tempfile::TempDir,
    filler: PathBuf,
}

impl SmallDisk {
    /// A tmpfs of `bytes`. Mounting one needs root (CI runs as root): without it the
    /// test fails here, saying so.
    pub fn mount(bytes: u64) -> SmallDisk {
        let dir = tempfile::tempdir().expect("temporary directory");
        let output = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes},mode=0755"), "tmpfs"])
            .arg(dir.path())
            .output()
            .expect("run mount");
        assert!(
            output.status.success(),
            "cannot mount a tmpfs for the full-disk test (it needs root): {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let filler = dir.path().join("filler");
        SmallDisk { dir, filler }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes a file until the disk takes no more: the bytes written.
    pub fn fill(&self) -> u64 {
        let mut file = std::fs::File::create(&self.filler).expect("create the filler");
        let chunk = vec![0u8; 4096];
        let mut written = 0;
        while file.write_all(&chunk).is_ok() {
            written += chunk.len() as u64;
        }
        // The last partial chunk, byte by byte, so that not one byte is left.
        while file.write_all(&[0]).is_ok() && file.flush().is_ok() {
            written += 1;
        }
        let _ = file.sync_all();
        written
    }

    /// Frees what `fill` took.
    pub fn free(&self) {
        std::fs::remove_file(&self.filler).expect("remove the filler");
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}
