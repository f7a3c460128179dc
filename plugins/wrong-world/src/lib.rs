//! Test plugin: a real component, but for another world (`route` takes a
//! number). Loading it as a Switchyard router must fail the type check.

wit_bindgen::generate!({ path: "wit", world: "other" });

struct Other;

impl Guest for Other {
    fn route(x: u32) -> u32 {
        x + 1
    }
}

export!(Other);
