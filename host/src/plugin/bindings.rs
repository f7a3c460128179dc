//! Host bindings generated from `wit/switchyard.wit`, in one place: one
//! module per world, sharing the `types` and `host` interfaces.

pub(super) mod single {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "router",
    });
}

pub(super) mod batch {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "batch-router",
        with: {
            "switchyard:plugin/types": super::single::switchyard::plugin::types,
            "switchyard:plugin/host": super::single::switchyard::plugin::host,
        },
    });
}

pub(super) use batch::{BatchRouter, BatchRouterPre};
pub use single::switchyard;
pub(super) use single::{Router, RouterPre};
