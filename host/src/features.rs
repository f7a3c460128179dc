//! What a build left out: the words every module uses when a config asks
//! for something a cargo feature brings and this build lacks.

/// What a build without a cargo feature says of a config that needs it:
/// `what` the feature brings, `feature` its name.
pub fn built_without(what: &str, feature: &str) -> String {
    format!("this switchyard was built without {what} (cargo feature `{feature}`, on by default)")
}
