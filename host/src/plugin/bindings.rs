//! Host bindings generated from `wit/switchyard.wit`, in one place.

wasmtime::component::bindgen!({
    path: "../wit",
    world: "router",
});
