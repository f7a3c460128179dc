//! The `switchyard` binary: everything lives in the library's [`switchyard::cli`].

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    switchyard::cli::main()
}
