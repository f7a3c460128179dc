//! Test plugin: implements the router world, but `init` traps whatever the
//! config, so a reload to it must be refused.

wit_bindgen::generate!({ path: "../../wit", world: "router" });

struct InitTrap;

impl Guest for InitTrap {
    fn init(_config: String) -> Result<(), String> {
        core::arch::wasm32::unreachable()
    }

    fn route(_event: Event) -> Result<Vec<Message>, Refusal> {
        Ok(Vec::new())
    }
}

export!(InitTrap);
