//! The `switchyard` binary: everything lives in the library's [`switchyard::cli`].

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    switchyard::cli::main()
}
