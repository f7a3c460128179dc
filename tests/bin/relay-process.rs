//! The `switchyard` command line, built inside the test crate so tests can run
//! real relay processes (and kill them) via `CARGO_BIN_EXE_relay-process`.

fn main() -> std::process::ExitCode {
    switchyard::cli::main()
}
