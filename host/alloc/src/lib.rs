//! The allocator the `switchyard` binary ships with: mimalloc, and the two
//! settings that keep a relay's resident memory near what glibc's
//! allocator leaves while keeping mimalloc's lower CPU. The only crate of
//! the project with `unsafe`: two calls into C, each a single setting.

use mimalloc::MiMalloc;

/// The allocator to install: `#[global_allocator] static A: MiMalloc = MiMalloc;`.
pub type Allocator = MiMalloc;

/// The value to install as the global allocator.
pub const ALLOCATOR: Allocator = MiMalloc;

/// mimalloc 3's `mi_option_purge_delay` (its `mimalloc.h`, `mi_option_e`);
/// the test below checks the number names the option with its default.
const PURGE_DELAY: libc::c_int = 15;

/// How long freed memory stays resident before mimalloc gives it back, in
/// ms. Its default, 1,000, kept the peak of a drain's batches resident
/// past the next ones: 83 against 71 MiB in a 200,000-row replication
/// drain, for no measurable CPU.
const PURGE_DELAY_MS: libc::c_long = 10;

unsafe extern "C" {
    fn mi_option_set(option: libc::c_int, value: libc::c_long);
}

/// Applies the settings, first thing in `main`; an explicit
/// `MIMALLOC_PURGE_DELAY` or `MIMALLOC_ALLOW_THP` in the environment wins.
///
/// - Transparent huge pages off for the process: where the kernel gives
///   every anonymous mapping huge pages (`enabled = always`), the first
///   byte written in each 2 MiB of mimalloc's arenas made all of it
///   resident: 156-179 MiB against 67-85 MiB without, in the same drains.
/// - Freed memory purged after [`PURGE_DELAY_MS`].
pub fn tune() {
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: prctl with PR_SET_THP_DISABLE takes integers only and
        // changes only this process's (and its children's) THP use.
        unsafe {
            libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
        }
    }
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets an integer option; mimalloc reads it at each purge.
        unsafe { mi_option_set(PURGE_DELAY, PURGE_DELAY_MS) }
    }
}

#[cfg(test)]
mod tests {
    unsafe extern "C" {
        fn mi_option_get(option: libc::c_int) -> libc::c_long;
    }

    /// One test: both settings are the process's, and tests run side by side.
    #[test]
    fn tuning_sets_the_purge_delay_and_turns_huge_pages_off() {
        // SAFETY: reads an integer option.
        let before = unsafe { mi_option_get(super::PURGE_DELAY) };
        assert_eq!(before, 1_000, "mimalloc 3's default purge delay");
        super::tune();
        // SAFETY: as above.
        let after = unsafe { mi_option_get(super::PURGE_DELAY) };
        // SAFETY: reads this process's flag.
        let disabled = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(after, super::PURGE_DELAY_MS);
        }
        if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
            assert_eq!(disabled, 1);
        }
    }
}
