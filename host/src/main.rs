//! The `switchyard` binary: everything lives in the library's [`switchyard::cli`].

#[global_allocator]
static ALLOCATOR: switchyard::Allocator = switchyard::ALLOCATOR;

fn main() -> std::process::ExitCode {
    switchyard::cli::main()
}
