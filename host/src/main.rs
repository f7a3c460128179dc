//! The `switchyard` binary: everything lives in the library's [`switchyard::cli`].

fn main() -> std::process::ExitCode {
    switchyard::cli::main()
}
