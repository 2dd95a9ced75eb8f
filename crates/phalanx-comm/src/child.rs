//! Launching rank processes: what every launcher here (`phalanx run`, the
//! examples' `spawn_ranks`) does to each child so that no rank outlives
//! its launcher.

use std::process::Command;

/// Make the child of `c` lead its own process group (stopping it stops
/// whatever it starts: a shell's children hold its pipes open) and die with
/// this process, even if this process is SIGKILLed (`PR_SET_PDEATHSIG`);
/// a child whose launcher died before that took effect fails to start.
pub fn die_with_launcher(c: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        c.pre_exec(move || {
            libc::setpgid(0, 0);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            // The launcher may have died before the line above.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("the launcher is gone"));
            }
            Ok(())
        });
    }
}
