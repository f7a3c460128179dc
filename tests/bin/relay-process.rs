//! The `switchyard` command line, built inside the test crate so tests can run
//! real relay processes (and kill them) via `CARGO_BIN_EXE_relay-process`.
//! Same code and allocator as the shipped binary: the image the container
//! tests run is assembled from this build (`scripts/image.sh build --binary`).

#[global_allocator]
static ALLOCATOR: switchyard::Allocator = switchyard::ALLOCATOR;

fn main() -> std::process::ExitCode {
    switchyard::cli::main()
}
